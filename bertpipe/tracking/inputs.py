"""What a stage's run read and made, as MLflow sees it: dataset inputs and logged models.

MLflow's own views (the runs table's Dataset and Models columns, a model's lineage) read
these, not bertpipe's tags: a corpus, a phase's shards or a task's files become a *dataset
input* of the run that read them (:class:`DatasetRef`, :func:`log_inputs`); a tokenizer or an
exported model becomes a *logged model* output of the run that made it and a *model input* of
the runs that start from it.

A dataset is described, never uploaded: its source is its URL (``{"uri": ...}``, the source
type being the URL's scheme, ``local`` for a path, as MLflow's own artifact sources write
them), its digest a hash of what identifies its content, its profile a small JSON of counts.
MLflow caps a digest at 36 characters, so a sha256 is cut to its first 32 hex digits; the
whole one is in the profile (and, for shards, in the run's ``bertpipe.data_manifest_sha256.*``
tags).

Inputs go through the run's outbox like every other record (buffered while the store is down,
never raised); creating a logged model needs the store (it returns an id) and is tried once,
with one warning on failure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import posixpath
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from bertpipe import fsio
from bertpipe.tracking.lifecycle import _call

log = logging.getLogger(__name__)

__all__ = [
    "CONTEXT_EVALUATION",
    "CONTEXT_TRAINING",
    "DIGEST_CHARS",
    "DatasetRef",
    "export_model_id",
    "files_dataset",
    "find_model",
    "log_folder_model",
    "log_inputs",
]

CONTEXT_TRAINING = "training"
CONTEXT_EVALUATION = "evaluation"
DIGEST_CHARS = 32
"""Hex digits of a sha256 kept as a dataset's digest (MLflow's limit is 36 characters)."""
_PROFILE_FILES = 20
"""At most this many file names listed in a dataset's profile (the count is always there)."""


@dataclasses.dataclass(frozen=True)
class DatasetRef:
    """A dataset a run read: ``name`` (shown in the UI), ``url`` (its source), ``sha256`` (of
    what identifies its content), ``context`` (``training``, ``evaluation``) and ``profile``
    (counts, JSON-able)."""

    name: str
    url: str
    sha256: str
    context: str = CONTEXT_TRAINING
    profile: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def digest(self) -> str:
        return self.sha256[:DIGEST_CHARS]

    @property
    def source_type(self) -> str:
        scheme = self.url.split("://", 1)[0] if "://" in self.url else "file"
        return "local" if scheme == "file" else scheme

    def record(self) -> dict[str, Any]:
        """The JSON the outbox keeps and sends (``inputs`` records)."""
        uri = self.url if "://" in self.url else "file://" + os.path.abspath(self.url)
        return {
            "name": self.name,
            "digest": self.digest,
            "source_type": self.source_type,
            "source": json.dumps({"uri": fsio.redact(uri)}),
            "profile": json.dumps({"sha256": self.sha256, **self.profile}, sort_keys=True),
            "context": self.context,
        }


def files_dataset(
    name: str,
    files: Sequence[str],
    sizes: Sequence[int] | None = None,
    *,
    source: str | None = None,
    context: str = CONTEXT_TRAINING,
    content: bool = False,
    profile: Mapping[str, Any] | None = None,
) -> DatasetRef:
    """A dataset of ``files`` (URLs): its source is ``source`` (default: their common folder,
    or the file when there is one), its sha256 covers each file's name relative to that
    folder and its size (``sizes``, else asked from the store), or each file's bytes with
    ``content`` (for small files: a task's train and dev sets)."""
    files = list(files)
    if sizes is None:
        sizes = [_size(url) for url in files]
    root = source or (files[0] if len(files) == 1 else fsio.common_root(files))
    digest = hashlib.sha256()
    for url, size in sorted(zip(files, sizes, strict=True)):
        rel = url[len(root) :].lstrip("/") if url.startswith(root) else url
        digest.update(f"{rel}\t{size}\n".encode())
        if content:
            digest.update(bytes.fromhex(fsio.file_sha256(url)))
    names = [os.path.basename(u.rstrip("/")) for u in sorted(files)]
    return DatasetRef(
        name=name,
        url=root,
        sha256=digest.hexdigest(),
        context=context,
        profile={
            "files": len(files),
            "bytes": int(sum(sizes)),
            "names": names[:_PROFILE_FILES],
            **(profile or {}),
        },
    )


def _size(url: str) -> int:
    fs, path = fsio.to_fs(url)
    return int(fs.size(path) or 0)


def log_inputs(datasets: Iterable[DatasetRef] = (), models: Iterable[str] = ()) -> None:
    """Record ``datasets`` and the logged models ``models`` (ids) as inputs of the open run
    (buffered while the store is down, never raised inside ``start_run``)."""
    records = [d.record() for d in datasets]
    ids = [m for m in models if m]
    if records or ids:
        _call("inputs", {"datasets": records, "models": ids})


def log_folder_model(
    folder: str,
    run_id: str,
    *,
    name: str,
    model_type: str,
    tags: Mapping[str, str] | None = None,
) -> str | None:
    """Log the files of ``folder`` (local or remote; or one file) as a logged model made by
    the run ``run_id`` (its output; no MLflow flavour: for what MLflow has none for, a
    tokenizer); returns its id, or None with one warning when the store did not take it.

    MLflow's runs table lists in a run's Models column the logged models whose source run it
    is (not those it only reads), so a model is always logged by the run that made it."""
    import mlflow
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus

    from bertpipe import staging

    try:
        client = mlflow.MlflowClient()
        experiment_id = client.get_run(run_id).info.experiment_id
        model = mlflow.initialize_logged_model(
            name=name,
            source_run_id=run_id,
            model_type=model_type,
            experiment_id=experiment_id,
            tags=dict(tags or {}),
        )
        fs, path = fsio.to_fs(folder)
        if fs.isfile(path):  # one file (a tokenizer.json, a vocab.txt)
            with tempfile.TemporaryDirectory(prefix="bertpipe-model-") as tmp:
                fs.get(path, os.path.join(tmp, posixpath.basename(path)))
                client.log_model_artifacts(model.model_id, tmp)
        else:
            with staging.local_copy(folder) as local:
                client.log_model_artifacts(model.model_id, str(local))
        mlflow.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
        client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=0)])
    except Exception as exc:  # tracking never stops a stage
        from bertpipe.tracking.registry import reason_line

        reason = reason_line(exc)
        log.warning(
            "MLflow: %s %s not logged as a model of run %s: %s", name, folder, run_id, reason
        )
        return None
    return str(model.model_id)


def find_model(run_id: str, tag: str, value: str) -> str | None:
    """The newest READY logged model of ``run_id``'s experiment tagged ``tag=value`` (e.g. the
    tokenizer of a given checksum); None if there is none or the store cannot say."""
    import mlflow

    try:
        experiment_id = mlflow.MlflowClient().get_run(run_id).info.experiment_id
        found = mlflow.search_logged_models(
            experiment_ids=[experiment_id],
            filter_string=f"tags.`{tag}` = '{value}'",
            order_by=[{"field_name": "creation_time", "ascending": False}],
            max_results=5,
            output_format="list",
        )
    except Exception as exc:  # the input is then not linked: one debug line, never an error
        log.debug("MLflow: no model with %s=%s found: %s", tag, value, exc)
        return None
    ready = [m for m in found if str(getattr(m.status, "value", m.status)) == "READY"]
    return str(ready[0].model_id) if ready else None


EXPORT_INFO = "bertpipe_export.json"
"""The lineage file ``bertpipe export`` writes into its folder."""


def export_model_id(folder: str | None) -> str | None:
    """The logged model of the export in ``folder`` (its ``mlflow_model_id``); None for a
    folder that is not a tracked export (or None)."""
    if not folder:
        return None
    url = fsio.join(str(folder), EXPORT_INFO)
    try:
        with fsio.open_url(url, "rt", encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    model_id = info.get("mlflow_model_id") if isinstance(info, dict) else None
    return str(model_id) if model_id else None
