"""A stage's MLflow run: start (or resume) it, log to it, end it; never let it stop training.

Once :func:`start_run` has started the run, every call made through this module
(:func:`log_metrics`, :func:`log_dict`, :func:`log_text`, :func:`log_artifacts`,
:func:`set_tags`, :func:`log_params`, ending the run) catches MLflow's errors and hands what
could not be sent to the run's :class:`~bertpipe.tracking.outbox.Outbox`, which keeps it in
a local buffer and replays it when the store answers again. Outside :func:`start_run` the
calls behave as MLflow's own (they raise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from bertpipe import fsio
from bertpipe.config import to_yaml
from bertpipe.errors import Terminated
from bertpipe.tracking.client import (
    STAGES,
    TAG_PARENT,
    TAG_STAGE,
    TrackingConfig,
    config_params,
    connect,
    quick_http,
)
from bertpipe.tracking.outbox import Outbox, encode_value, send_one

if TYPE_CHECKING:
    import mlflow

log = logging.getLogger(__name__)

__all__ = [
    "current_outbox",
    "log_artifacts",
    "log_config",
    "log_dict",
    "log_metrics",
    "log_params",
    "log_text",
    "set_tags",
    "start_run",
    "terminated_raises",
]

_outbox: Outbox | None = None
"""The sender of the run open in :func:`start_run` (None outside)."""


def current_outbox() -> Outbox | None:
    """The sender of the run open in :func:`start_run`; None outside one."""
    return _outbox


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
            with quick_http():  # a store that is down costs one short attempt, not minutes
                connect(cfg, probe_seconds=0)
                run = mlflow.start_run(run_id=resume_run_id, log_system_metrics=False)
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
            log_system_metrics=False,  # sampled below, through the outbox
        )
    global _outbox
    sigterm = _TermAsKilled()
    run_id = run.info.run_id
    path = buffer or os.path.abspath(os.path.join("runs", "mlflow-buffer", f"{run_id}.jsonl"))
    outer, _outbox = _outbox, Outbox(run_id, path)
    status = "FINISHED"
    sampler = None
    try:
        if detached is not None:
            _outbox.detached = True
            _outbox.failed(detached)
        else:
            _outbox.replay(force=True, resuming=True)
        if cfg.system_metrics:
            sampler = _start_system_metrics(cfg, _outbox, resumed=resume_run_id is not None)
        if resume_run_id:
            set_tags(all_tags)
        elif config is not None:
            log_config(config)
        log.info("MLflow run %s (%s) in %s", run_id, stage, fsio.redact(cfg.resolved_uri()))
        yield run
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    except BaseException:
        status = "FAILED"
        raise
    finally:
        sigterm.restore()
        if sampler is not None:
            sampler.finish()  # its last aggregate goes before the run's end
        outbox, _outbox = _outbox, outer
        outbox.close(status)


def _start_system_metrics(cfg: TrackingConfig, outbox: Outbox, resumed: bool) -> Any:
    """MLflow's system-metrics samplers in a thread, sending through ``outbox`` (see
    :mod:`~bertpipe.tracking.system_metrics`); None, with a warning, if they cannot start."""
    from bertpipe.tracking.system_metrics import OutboxSystemMetrics, next_system_step

    try:
        first = next_system_step(outbox, resumed)
        sampler = OutboxSystemMetrics(outbox, cfg.system_metrics_interval_s, first)
    except Exception as exc:  # psutil missing, a sampler failing at start: the run goes on
        log.warning("system metrics not logged for run %s: %s", outbox.run_id, exc)
        return None
    sampler.start()
    return sampler


class _TermAsKilled:
    """While a run is open in the main thread, a SIGTERM that would kill the process outright
    (its handler is the default) raises :class:`~bertpipe.errors.Terminated` instead, so the
    run ends KILLED rather than staying RUNNING; a stage with its own handler (pre-training
    saves first) keeps it."""

    def __init__(self) -> None:
        self.installed = False
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, self._raise)
        self.installed = True

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:
        raise Terminated()

    def restore(self) -> None:
        if self.installed and signal.getsignal(signal.SIGTERM) == self._raise:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self.installed = False


@contextlib.contextmanager
def terminated_raises() -> Iterator[None]:
    """In the block (main thread, default SIGTERM handler), a SIGTERM raises
    :class:`~bertpipe.errors.Terminated` (the command exits 143 after ``finally`` blocks
    ran), whether or not a run is tracked."""
    sigterm = _TermAsKilled()
    try:
        yield
    finally:
        sigterm.restore()


def log_config(config: Any, name: str = "config.yaml") -> None:
    """Log a dataclass config as params (dotted keys, see
    :func:`~bertpipe.tracking.client.config_params`) and as a YAML artifact of the open run
    (buffered on failure)."""
    log_params(config_params(config))
    log_text(to_yaml(config), name)


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
            "value": encode_value(v),
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
        send_one(mlflow.MlflowClient(), {"kind": kind, "run_id": run.info.run_id, **fields})
        return
    _outbox.send([{"kind": kind, "run_id": _outbox.run_id, **fields}])


@dataclasses.dataclass
class _RunInfo:
    run_id: str


class _DetachedRun:
    """A resumed run whose store did not answer at the start (``run.info.run_id`` only)."""

    def __init__(self, run_id: str) -> None:
        self.info = _RunInfo(run_id)
