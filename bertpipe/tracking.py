"""MLflow helpers: one experiment per project, one run per stage, lineage tags.

Only rank 0 of a distributed job may call these (a sqlite store takes one writer). The
tracking URI is always set explicitly: MLflow's own default depends on the working
directory, and so does its default artifact location for a sqlite store, so a relative
``sqlite:///`` path is made absolute and new experiments get an explicit artifact folder
beside the database.

Tracking never stops a run: once :func:`start_run` has started the run, every call made
through this module (:func:`log_metrics`, :func:`log_dict`, :func:`log_text`,
:func:`log_artifacts`, :func:`set_tags`, :func:`log_params`, ending the run) catches MLflow's
errors. What could not be sent is appended to a local buffer (a JSONL file, by default
``<output>/mlflow-buffer.jsonl``: one record per metric point with its run id, key, value,
step and timestamp, or per param/tag/artifact call) and replayed, with the original steps and
timestamps, when the store answers again (tried at most every :data:`RETRY_SECONDS`), at the
end of the run, or when a later run with the same buffer starts (a resumed pre-training).
One warning when tracking fails, one when it recovers; ``tracking/failed_calls`` and
``tracking/replayed_metrics`` are logged once it works again. Mid-run HTTP calls are made
with few retries and a short timeout (:data:`HTTP_RETRIES`, :data:`HTTP_TIMEOUT`), so a
store that is down costs the loop (and the ranks waiting for rank 0 in the next collective)
at most one short attempt per :data:`RETRY_SECONDS`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from bertpipe import fsio
from bertpipe.config import ConfigError, to_dict, to_yaml
from bertpipe.errors import BertpipeError

if TYPE_CHECKING:
    import mlflow

log = logging.getLogger(__name__)

__all__ = [
    "STAGES",
    "TAG_DATA_CHECKSUM",
    "TAG_PARENT",
    "TAG_STAGE",
    "RegistryError",
    "TrackingConfig",
    "buffer_path",
    "config_params",
    "log_artifacts",
    "log_dict",
    "log_metrics",
    "log_params",
    "log_text",
    "register_pytorch_model",
    "replay_buffer",
    "set_tags",
    "start_run",
]

TAG_STAGE = "bertpipe.stage"
TAG_PARENT = "bertpipe.parent_run_id"
TAG_DATA_CHECKSUM = "bertpipe.data_manifest_sha256"
STAGES = ("tokenizer", "preprocess", "pretrain", "finetune", "sweep")
DEFAULT_URI = "sqlite:///runs/mlflow.db"
MAX_PARAM_VALUE = 500
"""Param values longer than this are cut (with ``...``): long values are unreadable in the UI
and some stores reject them (MLflow's own limit is larger)."""
MAX_PARAM_KEY = 250
"""MLflow's limit on a param key's length."""
BUFFER_NAME = "mlflow-buffer.jsonl"
"""The buffer of unsent tracking records in a run's output folder."""
RETRY_SECONDS = 60.0
"""While the store is down, how often a call tries it again (the others go to the buffer)."""
HTTP_RETRIES = 0
HTTP_TIMEOUT = 10
"""Retries and timeout (seconds) of a mid-run HTTP call. MLflow's defaults (7 retries with
exponential backoff, 120 s) would stall the loop, and the ranks waiting for rank 0, for
minutes; a call that fails is buffered and replayed, so no retry is needed."""
BATCH_METRICS = 1000
"""Metric points per ``log_batch`` call of a replay (MLflow's limit)."""


class RegistryError(BertpipeError):
    """The MLflow model registry could not take a model; ``key`` is the setting naming the
    tracking URI (``tracking.uri``, ``--tracking-uri``)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


@dataclasses.dataclass
class TrackingConfig:
    """Where and whether runs are logged to MLflow."""

    enabled: bool = True
    """Log this stage to MLflow."""
    uri: str | None = None
    """Tracking URI (``sqlite:///path.db``, ``http://host:5000``, ``file:///dir``).
    Null means $MLFLOW_TRACKING_URI, else ``sqlite:///runs/mlflow.db`` in the working
    directory. Relative sqlite paths are made absolute."""
    experiment: str = "bertpipe"
    """Experiment name: one per project."""
    artifact_location: str | None = None
    """Artifact root for a new experiment. Null: an ``mlartifacts`` folder beside a sqlite
    database, the server's default for a server."""
    run_name: str | None = None
    """Name of the run; null lets the stage choose one."""
    tags: dict[str, str] = dataclasses.field(default_factory=dict)
    """Extra tags set on the run."""

    def __post_init__(self) -> None:
        if not self.experiment.strip():
            raise ConfigError("experiment", "must not be empty")

    def resolved_uri(self) -> str:
        """The tracking URI to use, absolute for sqlite and local folders."""
        uri = self.uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI
        if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
            path = uri[len("sqlite:///") :]
            uri = "sqlite:///" + os.path.abspath(path)
        elif "://" not in uri:
            uri = "file://" + os.path.abspath(uri)
        return uri

    def resolved_artifact_location(self) -> str | None:
        if self.artifact_location:
            loc = self.artifact_location
            return loc if "://" in loc else "file://" + os.path.abspath(loc)
        uri = self.resolved_uri()
        if uri.startswith("sqlite:///"):
            db_dir = os.path.dirname(uri[len("sqlite://") :])
            return "file://" + os.path.join(db_dir, "mlartifacts")
        return None


def connect(cfg: TrackingConfig) -> str:
    """Point MLflow at ``cfg``'s store and return the experiment id (created if missing)."""
    import mlflow

    uri = cfg.resolved_uri()
    if uri.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(uri[len("sqlite://") :]), exist_ok=True)
    mlflow.set_tracking_uri(uri)
    exp = mlflow.get_experiment_by_name(cfg.experiment)
    if exp is not None:
        return str(exp.experiment_id)
    try:
        return str(
            mlflow.create_experiment(
                cfg.experiment, artifact_location=cfg.resolved_artifact_location()
            )
        )
    except Exception:  # another process created it first
        exp = mlflow.get_experiment_by_name(cfg.experiment)
        if exp is None:
            raise
        return str(exp.experiment_id)


@contextlib.contextmanager
def start_run(
    cfg: TrackingConfig,
    stage: str,
    *,
    config: Any = None,
    run_name: str | None = None,
    tags: Mapping[str, str] | None = None,
    parent_run_id: str | None = None,
    resume_run_id: str | None = None,
    nested_in: str | None = None,
    buffer: str | None = None,
) -> Iterator[mlflow.ActiveRun | None]:
    """Start (or resume) the run of a stage; yields None when tracking is disabled.

    The resolved ``config`` (a dataclass) is logged as flattened params and as
    ``config.yaml``. ``parent_run_id`` is the lineage tag (the run whose output this stage
    consumed, e.g. the pre-training run of a fine-tuning); ``nested_in`` makes the run an
    MLflow child of that run (a sweep's trials). The run ends FAILED if the body raises.

    ``buffer`` is the local JSONL file where calls that fail while the run is open are kept
    (default ``runs/mlflow-buffer/<run id>.jsonl``); what an earlier run left there is
    replayed first. If the store is still down when the run ends, the buffer is left for the
    next run that uses it (one warning) and the run stays RUNNING in MLflow until then.
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}")
    if not cfg.enabled:
        yield None
        return
    import mlflow

    all_tags = {TAG_STAGE: stage, **cfg.tags, **(tags or {})}
    if parent_run_id:
        all_tags[TAG_PARENT] = parent_run_id
    detached = None
    run: Any  # an mlflow.ActiveRun, or a _DetachedRun (same ``run.info.run_id``)
    if resume_run_id:
        try:
            with _quick_http():  # a store that is down costs one short attempt, not minutes
                connect(cfg)
                run = mlflow.start_run(run_id=resume_run_id)
        except Exception as exc:  # the run goes on; its records wait in the buffer
            detached = exc
            run = _DetachedRun(resume_run_id)
    else:
        experiment_id = connect(cfg)
        run = mlflow.start_run(
            experiment_id=experiment_id,
            run_name=run_name or cfg.run_name,
            nested=nested_in is not None,
            parent_run_id=nested_in,
            tags=all_tags,
        )
    global _outbox
    run_id = run.info.run_id
    path = buffer or os.path.abspath(os.path.join("runs", "mlflow-buffer", f"{run_id}.jsonl"))
    outer, _outbox = _outbox, _Outbox(run_id, path)
    status = "FINISHED"
    try:
        if detached is not None:
            _outbox.detached = True
            _outbox._failed(detached)
        else:
            _outbox.replay(force=True, resuming=True)
        if resume_run_id:
            set_tags(all_tags)
        elif config is not None:
            log_params(config_params(config))
            log_text(to_yaml(config), "config.yaml")
        log.info("MLflow run %s (%s) in %s", run_id, stage, fsio.redact(cfg.resolved_uri()))
        yield run
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except BaseException:
        status = "FAILED"
        raise
    finally:
        outbox, _outbox = _outbox, outer
        outbox.close(status)


def buffer_path(output: Any) -> str | None:
    """The tracking buffer of a run writing to ``output``: ``<output>/mlflow-buffer.jsonl``
    for a local folder; None (the default under ``runs/mlflow-buffer``) for a remote one."""
    text = str(output)
    if "://" in text and not text.startswith("file://"):
        return None
    return os.path.join(os.path.abspath(text.removeprefix("file://")), BUFFER_NAME)


def log_config(config: Any, name: str = "config.yaml") -> None:
    """Log a dataclass config as params (dotted keys, see :func:`config_params`) and as a
    YAML artifact."""
    import mlflow

    mlflow.log_params(config_params(config))
    mlflow.log_text(to_yaml(config), name)


def config_params(config: Any) -> dict[str, str]:
    """A config as MLflow params: nested sections as dotted keys (``zero.stage``), lists of
    sections with their index (``phases.0.learning_rate``, ``phases.1.max_steps``), other
    lists and scalars as their text. Values are cut at :data:`MAX_PARAM_VALUE` characters;
    keys longer than MLflow's limit are shortened with a digest (kept unique)."""
    data = to_dict(config)
    params: dict[str, str] = {}
    for key, value in _flatten_params(data, "").items():
        params[_param_key(key)] = fsio.redact(_param_value(value))
    return params


def _flatten_params(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten_params(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if (
        isinstance(value, list | tuple)
        and value
        and all(isinstance(item, Mapping) for item in value)
    ):
        out = {}
        for i, item in enumerate(value):
            out.update(_flatten_params(item, f"{prefix}.{i}" if prefix else str(i)))
        return out
    return {prefix: value}


def _param_key(key: str) -> str:
    if len(key) <= MAX_PARAM_KEY:
        return key
    import hashlib

    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return f"{key[: MAX_PARAM_KEY - len(digest) - 1]}-{digest}"


def log_metrics(metrics: Mapping[str, float], step: int | None = None) -> None:
    """Log numeric metrics; non-numeric values are skipped. NaN and infinities are logged as
    what they are (a diverging loss must show as NaN in the run, not as a gap). Inside
    :func:`start_run` this never raises: see the module's docstring."""
    import mlflow

    clean = {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    if not clean:
        return
    timestamp = int(time.time() * 1000)
    if _outbox is None:
        mlflow.log_metrics(clean, step=step, timestamp=timestamp)
        return
    records = [
        {
            "kind": "metric",
            "run_id": _outbox.run_id,
            "key": k,
            "value": _encode(v),
            "step": step or 0,
            "timestamp": timestamp,
        }
        for k, v in clean.items()
    ]
    _outbox.send(records)


def log_params(params: Mapping[str, Any]) -> None:
    """Log params to the open run; buffered, never raised, inside :func:`start_run`."""
    _call("params", {"params": {k: str(v) for k, v in params.items()}})


def set_tags(tags: Mapping[str, Any]) -> None:
    """Set tags on the open run; buffered, never raised, inside :func:`start_run`."""
    _call("tags", {"tags": {k: str(v) for k, v in tags.items()}})


def log_dict(data: Any, name: str) -> None:
    """Log ``data`` as a JSON/YAML artifact of the open run (buffered on failure)."""
    _call("dict", {"data": data, "name": name})


def log_text(text: str, name: str) -> None:
    """Log ``text`` as an artifact of the open run (buffered on failure)."""
    _call("text", {"text": text, "name": name})


def log_artifacts(local_dir: str, artifact_path: str | None = None) -> None:
    """Upload a local folder to the open run. On failure the buffer records the folder's
    path (not its files): keep the folder until the buffer is replayed."""
    _call("artifacts", {"local_dir": os.path.abspath(local_dir), "artifact_path": artifact_path})


def _call(kind: str, fields: dict[str, Any]) -> None:
    if _outbox is None:  # outside start_run: MLflow's own behaviour
        import mlflow

        run = mlflow.active_run()
        if run is None:
            raise RuntimeError(f"tracking.{kind}: no active MLflow run")
        _send_one(mlflow.MlflowClient(), {"kind": kind, "run_id": run.info.run_id, **fields})
        return
    _outbox.send([{"kind": kind, "run_id": _outbox.run_id, **fields}])


def _encode(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)  # "nan", "inf", "-inf"


@contextlib.contextmanager
def _quick_http(upload: bool = False) -> Iterator[None]:
    """Few retries and a short timeout (MLflow's own for an ``upload``) for the calls made
    inside it (read by MLflow from the environment on each request)."""
    values = {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(HTTP_RETRIES),
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    }
    if not upload:
        values["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(HTTP_TIMEOUT)
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _send_one(client: Any, record: dict[str, Any]) -> None:
    """Send one non-metric record."""
    kind, run_id = record["kind"], record["run_id"]
    if kind == "params":
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in record["params"].items()]
        for i in range(0, len(params), 100):
            client.log_batch(run_id, params=params[i : i + 100])
    elif kind == "tags":
        from mlflow.entities import RunTag

        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in record["tags"].items()])
    elif kind == "dict":
        client.log_dict(run_id, record["data"], record["name"])
    elif kind == "text":
        client.log_text(run_id, record["text"], record["name"])
    elif kind == "artifacts":
        if os.path.isdir(record["local_dir"]):
            with _quick_http(upload=True):
                client.log_artifacts(run_id, record["local_dir"], record["artifact_path"])
        else:
            log.warning("MLflow: %s is gone, not uploaded to run %s", record["local_dir"], run_id)
    elif kind == "end":
        client.set_terminated(run_id, record["status"], end_time=record["timestamp"])
    else:
        log.warning("MLflow buffer: unknown record kind %r skipped", kind)


def _send(records: list[dict[str, Any]]) -> None:
    """Send records in order (consecutive metric points of a run in batches); raises the
    first failure after dropping what was sent from ``records`` (so the caller keeps the
    rest)."""
    import mlflow
    from mlflow.entities import Metric

    client = mlflow.MlflowClient()
    with _quick_http():
        while records:
            first = records[0]
            n = 1
            if first["kind"] == "metric":
                n = 0
                while (
                    n < len(records)
                    and n < BATCH_METRICS
                    and records[n]["kind"] == "metric"
                    and records[n]["run_id"] == first["run_id"]
                ):
                    n += 1
            try:
                if first["kind"] == "metric":
                    metrics = [
                        Metric(r["key"], float(r["value"]), int(r["timestamp"]), int(r["step"]))
                        for r in records[:n]
                    ]
                    client.log_batch(first["run_id"], metrics=metrics)
                else:
                    _send_one(client, first)
            except Exception as exc:
                if not _refused(exc):
                    raise
                log.warning(
                    "MLflow refused %d %s record(s) of run %s, dropped: %s",
                    n,
                    first["kind"],
                    first["run_id"],
                    " ".join(str(exc).split())[:200],
                )
            del records[:n]


_REFUSED = {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_ALREADY_EXISTS", "INVALID_STATE"}


def _refused(exc: BaseException) -> bool:
    """The store answered and refused the record (sending it again would fail the same way),
    as opposed to a store that is down."""
    return getattr(exc, "error_code", None) in _REFUSED


@dataclasses.dataclass
class _RunInfo:
    run_id: str


class _DetachedRun:
    """A resumed run whose store did not answer at the start (``run.info.run_id`` only)."""

    def __init__(self, run_id: str) -> None:
        self.info = _RunInfo(run_id)


class _Outbox:
    """The open run's sender: straight to MLflow while it answers, else to the buffer file
    (append-only JSONL), replayed when the store answers again."""

    def __init__(self, run_id: str, path: str, retry_seconds: float | None = None) -> None:
        self.run_id = run_id
        self.path = path
        self.retry_seconds = RETRY_SECONDS if retry_seconds is None else retry_seconds
        self.next_try = 0.0
        self.down = False
        self.failed_calls = 0
        self.replayed = 0
        self.last_step = 0
        self.detached = False
        """The run was never reopened in MLflow (store down at resume): its end is a record."""

    def pending(self) -> bool:
        return os.path.exists(self.path) and os.path.getsize(self.path) > 0

    def send(self, records: list[dict[str, Any]]) -> None:
        for r in records:
            if r["kind"] == "metric":
                self.last_step = max(self.last_step, int(r["step"]))
        if self.pending() and not self.replay():
            self._append(records)
            return
        todo = list(records)
        try:
            _send(todo)
        except Exception as exc:
            self._failed(exc)
            self._append(todo)

    def replay(self, force: bool = False, resuming: bool = False) -> bool:
        """Send what the buffer holds (at most every ``retry_seconds`` unless ``force``);
        True when the buffer is empty after it. Never raises."""
        if not self.pending():
            return True
        if not force and time.monotonic() < self.next_try:
            return False
        try:
            records = _read_buffer(self.path)
        except OSError as exc:
            self._failed(exc)
            return False
        if resuming:  # this run is open again: its earlier end is void
            records = [
                r for r in records if not (r["kind"] == "end" and r["run_id"] == self.run_id)
            ]
        metrics = sum(1 for r in records if r["kind"] == "metric")
        try:
            _send(records)
        except Exception as exc:
            self._failed(exc)
            _rewrite(self.path, records)  # the unsent rest
            return False
        os.remove(self.path)
        self.replayed += metrics
        log.warning(
            "MLflow reachable again: replayed %d metric points%s from %s (%d failed calls)",
            metrics,
            " of an earlier run" if resuming else "",
            self.path,
            self.failed_calls,
        )
        self.down = False
        counters = {
            "tracking/failed_calls": float(self.failed_calls),
            "tracking/replayed_metrics": float(self.replayed),
        }
        with contextlib.suppress(Exception):
            _send(
                [
                    {
                        "kind": "metric",
                        "run_id": self.run_id,
                        "key": k,
                        "value": v,
                        "step": self.last_step,
                        "timestamp": int(time.time() * 1000),
                    }
                    for k, v in counters.items()
                ]
            )
        return True

    def close(self, status: str) -> None:
        """End the run: replay the buffer, set the run's status; if the store is still down,
        leave both in the buffer (one warning)."""
        import mlflow

        self.replay(force=True)
        end = {
            "kind": "end",
            "run_id": self.run_id,
            "status": status,
            "timestamp": int(time.time() * 1000),
        }
        if self.detached:  # never reopened in MLflow: its end is one more record
            self.send([end])
        else:
            try:
                active = mlflow.active_run()
                if active is not None and active.info.run_id == self.run_id:
                    with _quick_http():
                        mlflow.end_run(status)
            except Exception as exc:
                self._failed(exc, warn=False)
                self._append([end])
        if self.pending():
            records = _read_buffer(self.path)
            unended = any(r["kind"] == "end" and r["run_id"] == self.run_id for r in records)
            log.warning(
                "MLflow unreachable at the end of run %s: %d tracking records left in %s, "
                "replayed by the next run started with this buffer (a resumed pre-training) or "
                "bertpipe.tracking.replay_buffer(path, uri)%s",
                self.run_id,
                len(records),
                self.path,
                ""
                if not unended
                else "; the run's status is set then"
                if self.detached
                else "; the run stays RUNNING in MLflow until then",
            )

    def _failed(self, exc: BaseException, warn: bool = True) -> None:
        self.failed_calls += 1
        self.next_try = time.monotonic() + self.retry_seconds
        if warn and not self.down:
            log.warning(
                "MLflow call failed (%s: %s); training goes on, tracking records are kept in "
                "%s and replayed when the store answers again (tried every %.0f s)",
                type(exc).__name__,
                fsio.redact(" ".join(str(exc).split())[:200]),
                self.path,
                self.retry_seconds,
            )
        self.down = True

    def _append(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            log.error(
                "MLflow buffer %s not writable (%s): %d records lost", self.path, exc, len(records)
            )


_outbox: _Outbox | None = None
"""The sender of the run open in :func:`start_run` (None outside)."""


def _read_buffer(path: str) -> list[dict[str, Any]]:
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a crash while appending
                log.warning("MLflow buffer %s: an unreadable line skipped", path)
    return records


def _rewrite(path: str, records: list[dict[str, Any]]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def replay_buffer(path: str, uri: str | None = None) -> int:
    """Send what a buffer file left by a run holds to ``uri`` (default: the current tracking
    URI); returns the number of metric points sent. Raises when the store is still down
    (the unsent rest stays in the file)."""
    import mlflow

    if uri:
        mlflow.set_tracking_uri(uri)
    records = _read_buffer(path)
    metrics = sum(1 for r in records if r["kind"] == "metric")
    try:
        _send(records)
    except Exception:
        _rewrite(path, records)
        raise
    os.remove(path)
    return metrics


def _param_value(value: Any) -> str:
    text = str(value)
    return text if len(text) <= MAX_PARAM_VALUE else text[: MAX_PARAM_VALUE - 3] + "..."


def pip_requirements() -> list[str]:
    """What a registered bertpipe model needs to load: given explicitly, so that MLflow does
    not infer the requirements (slow: it loads the model in a subprocess)."""
    import torch

    from bertpipe import __version__

    return [f"torch=={torch.__version__.split('+')[0]}", f"bertpipe=={__version__}"]


def register_pytorch_model(
    model: Any,
    registered_name: str,
    *,
    uri_key: str,
    run_id: str | None = None,
    artifact_name: str = "model",
) -> int:
    """Log ``model`` (a ``torch.nn.Module``) with MLflow's ``pytorch`` flavour and register it
    as a new version of ``registered_name``; returns the version number.

    The model is pickled (``serialization_format="pickle"``): it loads back as the same
    bertpipe class with ``mlflow.pytorch.load_model("models:/NAME/VERSION")`` wherever
    bertpipe is installed. It is linked to ``run_id`` (default: the active run). Any MLflow
    failure becomes a one-line :class:`RegistryError` naming ``uri_key``, the setting that
    holds the tracking URI.
    """
    import mlflow
    import mlflow.pytorch

    uri = mlflow.get_tracking_uri()
    kwargs: dict[str, Any] = {"run_id": run_id} if run_id else {}
    try:
        info = mlflow.pytorch.log_model(
            model,
            name=artifact_name,
            registered_model_name=registered_name,
            pip_requirements=pip_requirements(),
            serialization_format="pickle",
            **kwargs,
        )
    except Exception as exc:  # MlflowException, connection and storage errors alike
        reason = fsio.redact(" ".join(str(exc).split())[:300]) or type(exc).__name__
        raise RegistryError(
            uri_key,
            f"could not register model {registered_name!r} in the MLflow model registry at "
            f"{fsio.redact(uri)}: {reason} (check that the tracking store is reachable and "
            f"has a model registry, or point {uri_key} at one)",
        ) from exc
    version = int(info.registered_model_version)
    log.info("registered %s version %d (%s)", registered_name, version, fsio.redact(uri))
    return version
