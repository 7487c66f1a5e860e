"""Where runs are logged: the tracking config, the store's URI, the experiment, the HTTP policy.

The tracking URI is always set explicitly: MLflow's own default depends on the working
directory, and so does its default artifact location for a sqlite store, so a relative
``sqlite:///`` path is made absolute and new experiments get an explicit artifact folder
beside the database. A config becomes MLflow params with :func:`config_params`.

A run that has ended (the pre-training run an export is recorded in) is reached by its id:
:func:`connect_to_run`, then :func:`set_run_tag` and :func:`log_run_artifact`, which call
the store at once (no outbox: the caller decides what a failure means).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

from bertpipe import fsio
from bertpipe.config import ConfigError, to_dict

__all__ = [
    "DEFAULT_URI",
    "EXPERIMENT_KIND",
    "HTTP_RETRIES",
    "HTTP_TIMEOUT",
    "MAX_PARAM_KEY",
    "MAX_PARAM_VALUE",
    "STAGES",
    "TAG_DATA_CHECKSUM",
    "TAG_EXPERIMENT_KIND",
    "TAG_PARENT",
    "TAG_STAGE",
    "TAG_TOKENIZER",
    "TrackingConfig",
    "config_params",
    "connect",
    "connect_to_run",
    "log_run_artifact",
    "quick_http",
    "runs_page_url",
    "set_run_tag",
]

TAG_STAGE = "bertpipe.stage"
TAG_PARENT = "bertpipe.parent_run_id"
TAG_DATA_CHECKSUM = "bertpipe.data_manifest_sha256"
TAG_TOKENIZER = "bertpipe.tokenizer_sha256"
"""The tokenizer's checksum: on the tokenizer, preprocess and pre-training runs and on the
tokenizer's logged model (how the later runs find it as their model input)."""
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
"""The experiment kind MLflow's UI reads to choose an experiment's first page: model training
opens on the runs table (without it, MLflow 3 opens an untagged experiment on its GenAI
overview of traces, empty for bertpipe)."""
STAGES = ("tokenizer", "preprocess", "pretrain", "finetune", "sweep", "evaluate")
DEFAULT_URI = "sqlite:///runs/mlflow.db"
MAX_PARAM_VALUE = 500
"""Param values longer than this are cut (with ``...``): long values are unreadable in the UI
and some stores reject them (MLflow's own limit is larger)."""
MAX_PARAM_KEY = 250
"""MLflow's limit on a param key's length."""
HTTP_RETRIES = 0
HTTP_TIMEOUT = 10
"""Retries and timeout (seconds) of a mid-run HTTP call. MLflow's defaults (7 retries with
exponential backoff, 120 s) would stall the loop, and the ranks waiting for rank 0, for
minutes; a call that fails is buffered and replayed, so no retry is needed."""


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
    system_metrics: bool = True
    """Log the machine's CPU, memory, disk and network use (and each GPU's utilisation and
    memory where ``nvidia-ml-py`` is installed) into the run as ``system/*`` metrics, sampled
    by MLflow's own monitor in the rank-0 process every ``system_metrics_interval_s``."""
    system_metrics_interval_s: float = 10.0
    """Seconds between two system-metrics samples."""

    def __post_init__(self) -> None:
        if not self.experiment.strip():
            raise ConfigError("experiment", "must not be empty")
        if not self.system_metrics_interval_s > 0:
            raise ConfigError("system_metrics_interval_s", "must be > 0 seconds")

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
        """The artifact root given to a new experiment (None: the server decides)."""
        if self.artifact_location:
            loc = self.artifact_location
            return loc if "://" in loc else "file://" + os.path.abspath(loc)
        uri = self.resolved_uri()
        if uri.startswith("sqlite:///"):
            db_dir = os.path.dirname(uri[len("sqlite://") :])
            return "file://" + os.path.join(db_dir, "mlartifacts")
        return None


def connect(cfg: TrackingConfig) -> str:
    """Point MLflow at ``cfg``'s store and return the experiment id (created if missing).

    The experiment carries MLflow's kind tag for model training (:data:`EXPERIMENT_KIND`):
    a new one from the start, an existing one without a kind on first use (a kind someone
    chose is kept)."""
    import mlflow

    uri = cfg.resolved_uri()
    if uri.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(uri[len("sqlite://") :]), exist_ok=True)
    mlflow.set_tracking_uri(uri)
    exp = mlflow.get_experiment_by_name(cfg.experiment)
    if exp is None:
        try:
            return str(
                mlflow.create_experiment(
                    cfg.experiment,
                    artifact_location=cfg.resolved_artifact_location(),
                    tags={TAG_EXPERIMENT_KIND: EXPERIMENT_KIND},
                )
            )
        except Exception:  # another process created it first
            exp = mlflow.get_experiment_by_name(cfg.experiment)
            if exp is None:
                raise
    if TAG_EXPERIMENT_KIND not in (exp.tags or {}):
        mlflow.MlflowClient().set_experiment_tag(
            exp.experiment_id, TAG_EXPERIMENT_KIND, EXPERIMENT_KIND
        )
    return str(exp.experiment_id)


def connect_to_run(uri: str, run_id: str) -> str:
    """Point MLflow at the store ``uri`` and return the experiment id of its run ``run_id``.
    Raises what MLflow raises for an unreachable store or an unknown run."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    experiment_id: str = mlflow.MlflowClient().get_run(run_id).info.experiment_id
    return experiment_id


def set_run_tag(run_id: str, key: str, value: str) -> None:
    """Set tag ``key`` of run ``run_id`` (in the current store) to ``value``."""
    import mlflow

    mlflow.MlflowClient().set_tag(run_id, key, value)


def log_run_artifact(run_id: str, local_path: str, artifact_path: str | None = None) -> None:
    """Log the local file ``local_path`` as an artifact of run ``run_id`` (in the current
    store), in its folder ``artifact_path``."""
    import mlflow

    mlflow.MlflowClient().log_artifact(run_id, local_path, artifact_path)


def runs_page_url(server: str, uri: str, experiment: str) -> str:
    """The address of ``experiment``'s runs table in the MLflow UI served at ``server`` on the
    store ``uri``. MLflow 3.17's UI shows an experiment's GenAI pages unless the address (or
    the sidebar's switch, which it then remembers) asks for model training, whatever the
    experiment's kind tag says; ``workflowType=machine_learning`` does."""
    import mlflow

    exp = mlflow.MlflowClient(tracking_uri=uri).get_experiment_by_name(experiment)
    page = f"#/experiments/{exp.experiment_id}/runs" if exp is not None else "#/experiments"
    return f"{server.rstrip('/')}/{page}?workflowType=machine_learning"


@contextlib.contextmanager
def quick_http(upload: bool = False) -> Iterator[None]:
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
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return f"{key[: MAX_PARAM_KEY - len(digest) - 1]}-{digest}"


def _param_value(value: Any) -> str:
    text = str(value)
    return text if len(text) <= MAX_PARAM_VALUE else text[: MAX_PARAM_VALUE - 3] + "..."
