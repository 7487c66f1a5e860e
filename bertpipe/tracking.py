"""MLflow helpers: one experiment per project, one run per stage, lineage tags.

Only rank 0 of a distributed job may call these (a sqlite store takes one writer). The
tracking URI is always set explicitly: MLflow's own default depends on the working
directory, and so does its default artifact location for a sqlite store, so a relative
``sqlite:///`` path is made absolute and new experiments get an explicit artifact folder
beside the database.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
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
    "config_params",
    "register_pytorch_model",
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
) -> Iterator[mlflow.ActiveRun | None]:
    """Start (or resume) the run of a stage; yields None when tracking is disabled.

    The resolved ``config`` (a dataclass) is logged as flattened params and as
    ``config.yaml``. ``parent_run_id`` is the lineage tag (the run whose output this stage
    consumed, e.g. the pre-training run of a fine-tuning); ``nested_in`` makes the run an
    MLflow child of that run (a sweep's trials). The run ends FAILED if the body raises.
    """
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}")
    if not cfg.enabled:
        yield None
        return
    import mlflow

    experiment_id = connect(cfg)
    all_tags = {TAG_STAGE: stage, **cfg.tags, **(tags or {})}
    if parent_run_id:
        all_tags[TAG_PARENT] = parent_run_id
    if resume_run_id:
        run = mlflow.start_run(run_id=resume_run_id)
    else:
        run = mlflow.start_run(
            experiment_id=experiment_id,
            run_name=run_name or cfg.run_name,
            nested=nested_in is not None,
            parent_run_id=nested_in,
            tags=all_tags,
        )
    with run:
        if resume_run_id:
            mlflow.set_tags(all_tags)
        elif config is not None:
            log_config(config)
        log.info(
            "MLflow run %s (%s) in %s", run.info.run_id, stage, fsio.redact(cfg.resolved_uri())
        )
        yield run


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
    what they are (a diverging loss must show as NaN in the run, not as a gap)."""
    import mlflow

    clean = {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    if clean:
        mlflow.log_metrics(clean, step=step, timestamp=int(time.time() * 1000))


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
