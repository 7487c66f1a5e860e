"""The model a suite evaluates, as one local HF folder every trial starts from.

``model`` may be an export folder (any transformers BERT folder), a pre-training checkpoint
folder (its ``latest`` checkpoint), one checkpoint of such a folder (``.../global_stepN``), or
a model of MLflow's registry (``models:/NAME/VERSION``), local or on object storage. A
checkpoint is exported once into the suite's folder (``model/``, as ``bertpipe export`` does,
without recording it in MLflow); a remote export or a registered model is downloaded there.
``latest`` is read once: the suite keeps the checkpoint it started with, even if the
pre-training run saves more while the suite runs.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bertpipe import fsio, staging, tracking
from bertpipe.config import ConfigError
from bertpipe.finetuning.evaluation.config import safe_name
from bertpipe.training import checkpoint as ckpt

log = logging.getLogger(__name__)

__all__ = ["ModelSource", "resolve_model"]

DONE = ".bertpipe-model-ready"
"""Written last into ``model/``: a folder without it was interrupted and is made again."""


@dataclass
class ModelSource:
    """Where the suite's model came from, and the local folder the trials read."""

    given: str
    """``model`` as the user gave it."""
    folder: str
    """The local HF folder (``init_from`` of every trial)."""
    kind: str
    """``export``, ``checkpoint`` or ``registered``."""
    label: str
    """A short name for tables."""
    pretrain_run_id: str | None = None
    """The pre-training MLflow run the model comes from, where known."""
    global_step: int | None = None
    """The pre-training step of the model's checkpoint, where known."""
    checkpoint: str | None = None
    """``<folder>/<tag>`` of a checkpoint's export."""
    model_id: str | None = None
    """The model as a logged model in MLflow (an export recorded there), where known."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _checkpoint_tag(url: str) -> tuple[str, str] | None:
    """(folder, tag) when ``url`` is a checkpoint folder (its latest) or one of its tags."""
    if fsio.exists(fsio.join(url, "latest")):
        tag = ckpt.latest_tag(url)
        return (url, tag) if tag else None
    parent, _, tag = url.rstrip("/").rpartition("/")
    if parent and tag.startswith("global_step") and fsio.exists(url):
        return parent, tag
    return None


def resolve_model(given: str, work: Path, tracking_uri: str | None = None) -> ModelSource:
    """``given`` as a local HF folder under ``work`` (or itself, a local export)."""
    target = work / "model"
    if given.startswith("models:/"):
        return _registered(given, target, tracking_uri)
    found = _checkpoint_tag(given)
    if found is not None:
        return _exported(given, *found, target)
    if not fsio.exists(fsio.join(given, "config.json")):
        raise ConfigError(
            "model",
            f"{given} is neither an HF BERT folder (config.json), a checkpoint folder (latest) "
            "nor a checkpoint (global_stepN): give `bertpipe export`'s folder or a checkpoint",
        )
    if staging.is_remote(given):
        if not (target / DONE).exists():
            _fresh(target)
            with staging.local_copy(given) as local:
                shutil.copytree(local, target, dirs_exist_ok=True)
            (target / DONE).write_text(given + "\n")
        folder = str(target)
    else:
        folder = str(Path(fsio.to_fs(given)[1]).resolve())
    lineage = _lineage(Path(folder))
    label = safe_name(given.rstrip("/").rsplit("/", 1)[-1])
    return ModelSource(given, folder, "export", label, **lineage)


def _fresh(target: Path) -> None:
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)


def _lineage(folder: Path) -> dict[str, Any]:
    path = folder / "bertpipe_export.json"
    if not path.exists():
        return {}
    info = json.loads(path.read_text())
    step = info.get("global_step")
    return {
        "pretrain_run_id": info.get("source_run_id") or info.get("mlflow_run_id"),
        "global_step": int(step) if step is not None else None,
        "checkpoint": info.get("checkpoint"),
        "model_id": info.get("mlflow_model_id"),
    }


def _exported(given: str, folder: str, tag: str, target: Path) -> ModelSource:
    from bertpipe.training.export import export_checkpoint

    done = target / DONE
    if not done.exists() or done.read_text().strip() != f"{folder}/{tag}":
        _fresh(target)
        log.info("evaluate: exporting checkpoint %s/%s into %s", folder, tag, target)
        export_checkpoint(folder, str(target), tag=tag, track=False)
        done.write_text(f"{folder}/{tag}\n")
    above = folder.rstrip("/").rsplit("/", 2)
    run = above[-2] if len(above) > 1 and above[-1] == "checkpoints" else above[-1]
    label = safe_name(f"{run}-{tag}")
    return ModelSource(given, str(target.resolve()), "checkpoint", label, **_lineage(target))


def _registered(given: str, target: Path, tracking_uri: str | None) -> ModelSource:
    if not (target / DONE).exists():
        _fresh(target)
        try:
            tracking.download_model(given, str(target), tracking_uri)
        except Exception as exc:
            raise ConfigError(
                "model", f"{given} could not be read from MLflow's registry: {exc}"
            ) from None
        (target / DONE).write_text(given + "\n")
    configs = sorted(target.rglob("config.json"), key=lambda p: len(p.parts))
    if not configs:
        raise ConfigError("model", f"{given} holds no HF model folder (no config.json)")
    folder = configs[0].parent
    for name in ("tokenizer.json", "vocab.txt"):  # MLflow keeps them as a component
        found = sorted(target.rglob(name), key=lambda p: len(p.parts))
        if found and not (folder / name).exists():
            shutil.copy(found[0], folder / name)
    label = safe_name(given.removeprefix("models:/"))
    lineage = _lineage(folder)
    if lineage.get("pretrain_run_id") is None:  # the registry knows the run that logged it
        lineage["pretrain_run_id"] = tracking.model_version_run(given, tracking_uri)
    return ModelSource(given, str(folder.resolve()), "registered", label, **lineage)
