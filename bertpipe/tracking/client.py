"""Where runs are logged: the tracking config, the store's URI, the experiment, the HTTP policy.

The tracking URI is always set explicitly: MLflow's own default depends on the working
directory, and so does its default artifact location for a sqlite store, so a relative
``sqlite:///`` path is made absolute and new experiments get an explicit artifact folder
beside the database (``file:///<db folder>/mlartifacts``). A tracking server is probed
before the first call (:func:`check_reachable`): nothing answering at ``tracking.uri`` is one
line within seconds, not minutes of MLflow's retries. A config becomes MLflow params with
:func:`config_params`.

A run that has ended (the pre-training run an export is recorded in) is reached by its id:
:func:`connect_to_run`, then :func:`set_run_tag` and :func:`log_run_artifact`, which call
the store at once (no outbox: the caller decides what a failure means).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import pathlib
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from bertpipe import fsio
from bertpipe.config import ConfigError, to_dict
from bertpipe.errors import BertpipeError

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_URI",
    "EXPERIMENT_KIND",
    "HTTP_RETRIES",
    "HTTP_TIMEOUT",
    "MAX_PARAM_KEY",
    "MAX_PARAM_VALUE",
    "PROBE_SECONDS",
    "STAGES",
    "TAG_DATA_CHECKSUM",
    "TAG_EXPERIMENT_KIND",
    "TAG_PARENT",
    "TAG_STAGE",
    "TAG_TOKENIZER",
    "TrackingConfig",
    "TrackingUnreachableError",
    "check_new_run",
    "check_reachable",
    "config_params",
    "connect",
    "connect_to_run",
    "log_run_artifact",
    "misread_artifact_root",
    "quick_http",
    "runs_page_url",
    "set_run_tag",
    "sqlite_path",
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
PROBE_SECONDS = 3.0
"""How long :func:`check_reachable` keeps trying a tracking server before a run starts (each
try times out within it). MLflow's own retries (7, with exponential backoff) take about four
minutes to give up on a server that is not there."""


class TrackingUnreachableError(BertpipeError):
    """No tracking server answers at the configured URI when a stage starts (exit 2, one line
    naming ``tracking.uri``): nothing has run yet."""


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
    with MLflow's own samplers in the rank-0 process every ``system_metrics_interval_s``;
    kept through an outage of the store like the other metrics."""
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
            uri = _file_uri(uri)
        return uri

    def uri_key(self) -> str:
        """The setting a user changes to point at another store: ``tracking.uri``, or the
        environment variable it came from."""
        if self.uri is None and os.environ.get("MLFLOW_TRACKING_URI"):
            return "tracking.uri ($MLFLOW_TRACKING_URI)"
        return "tracking.uri"

    def resolved_artifact_location(self) -> str | None:
        """The artifact root given to a new experiment (None: the server decides): the
        ``mlartifacts`` folder beside a sqlite database, as a ``file:///`` URI."""
        if self.artifact_location:
            loc = self.artifact_location
            return loc if "://" in loc else _file_uri(loc)
        db = sqlite_path(self.resolved_uri())
        if db is not None:
            return _file_uri(os.path.join(os.path.dirname(db), "mlartifacts"))
        return None


def sqlite_path(uri: str) -> str | None:
    """The absolute path of the database of a ``sqlite:///`` URI (``sqlite:////abs/x.db``,
    ``sqlite:///rel/x.db`` from the working directory); None for other URIs and in-memory
    databases."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].split("?", 1)[0]
    if not path or path == ":memory:":
        return None
    return os.path.abspath(path)  # "/abs/x.db" was "sqlite:////abs/x.db"


def _file_uri(path: str) -> str:
    """A local path as the ``file:///...`` URI MLflow reads back as that path. Gluing
    ``file://`` to ``//abs`` (what a ``sqlite:////abs`` URI holds) gives ``file:////abs``,
    from which MLflow derives run URIs ``file://abs/...``: ``abs`` read as a host, and the
    files written under ``/`` without it."""
    return pathlib.Path(os.path.abspath(path)).as_uri()


def connect(cfg: TrackingConfig, probe_seconds: float | None = None) -> str:
    """Point MLflow at ``cfg``'s store and return the experiment id (created if missing).

    A tracking server is probed first, for ``probe_seconds`` (default
    :data:`PROBE_SECONDS`; 0 is one attempt: :func:`check_reachable`). The experiment carries
    MLflow's kind tag for model training (:data:`EXPERIMENT_KIND`): a new one from the start,
    an existing one without a kind on first use (a kind someone chose is kept). An existing
    experiment whose artifact root MLflow misreads (written for a sqlite store by an earlier
    bertpipe) gets one warning saying where its artifacts really go."""
    import mlflow

    uri = cfg.resolved_uri()
    db = sqlite_path(uri)
    if db is not None:
        os.makedirs(os.path.dirname(db), exist_ok=True)
    mlflow.set_tracking_uri(uri)  # first: a resumed run that goes on detached sends here
    check_reachable(uri, cfg.uri_key(), probe_seconds)
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
    _warn_misread_root(cfg, exp)
    return str(exp.experiment_id)


def misread_artifact_root(location: str) -> str | None:
    """Where MLflow puts a run's artifacts under the experiment root ``location`` when that
    is a ``file:`` URI it misreads (``file:////abs/x``: runs get ``file://abs/x/<run>``,
    ``abs`` taken for a host, so the files go to ``/x/<run>``); None for a root read as
    written."""
    parts = urlsplit(location)
    if parts.scheme != "file" or not parts.path.startswith("//"):
        return None
    _, _, rest = parts.path.lstrip("/").partition("/")
    return "/" + rest


def _warn_misread_root(cfg: TrackingConfig, exp: Any) -> None:
    actual = misread_artifact_root(exp.artifact_location or "")
    if actual is None:
        return
    log.warning(
        "experiment %r (%s) has the artifact root %s, which MLflow reads as %s: its runs' "
        "artifacts and models go there, not beside the database (written by an earlier "
        "bertpipe; docs/tracking.md, 'Artifact root of older stores', says how to fix it)",
        exp.name,
        fsio.redact(cfg.resolved_uri()),
        exp.artifact_location,
        actual,
    )


def check_reachable(uri: str, key: str = "tracking.uri", seconds: float | None = None) -> None:
    """Raise :class:`TrackingUnreachableError` (one line naming ``key``) when nothing answers
    at the ``http(s)://`` tracking server ``uri`` within ``seconds`` (default
    :data:`PROBE_SECONDS`): refused or timed-out connections, unknown host names, TLS
    failures. Any HTTP answer counts as reachable (the server's own errors come from MLflow's
    first call). Other URIs: nothing.

    One ``GET /health`` through MLflow's own request code (its TLS and auth settings), without
    retries, tried again each second until the time is up (at least once, with a timeout of
    at least 2 s); the retry policy of later calls is left as it is, so an outage in the
    middle of a run is still waited out."""
    if urlsplit(uri).scheme not in ("http", "https"):
        return
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    if seconds is None:
        seconds = PROBE_SECONDS
    deadline = time.monotonic() + seconds
    while True:
        left = max(2.0, deadline - time.monotonic())
        try:
            http_request(
                get_default_host_creds(uri),
                "/health",
                "GET",
                max_retries=0,
                backoff_factor=0,
                timeout=left,
                raise_on_status=False,
            )
            return
        except Exception as exc:
            why = _unreachable(exc)
            if why is None:  # not a connection failure: MLflow's own calls report it
                return
        if time.monotonic() + 1.0 >= deadline:
            break
        time.sleep(1.0)
    tried = f"; tried for {seconds:.0f} s" if seconds >= 1 else ""
    raise TrackingUnreachableError(
        f"{key}: no MLflow tracking server answers at {fsio.redact(uri)} ({why}{tried}): "
        "start the server, point tracking.uri at one, or run without tracking "
        "(tracking.enabled=false)"
    )


def check_new_run(cfg: TrackingConfig, checkpoints: str | None = None) -> None:
    """The early check of a stage that opens its run only after costly work (joining the
    process group, which may first compile DeepSpeed's CPU op for minutes; the model): a new
    run's tracking server that is not there is one line now (:func:`check_reachable`), on
    every rank, before any of it. Skipped when tracking is off, and when ``checkpoints`` (the
    stage's checkpoint folder) holds a ``latest`` checkpoint: a resumed run goes on while its
    server is down (its records buffered), as :func:`~bertpipe.tracking.lifecycle.start_run`
    decides once it knows the run. Only rank 0 logs to MLflow, so only the process the
    launcher's environment names rank 0 asks (the others may sit on nodes that cannot reach
    the server); an ambiguous environment asks, and is refused later with its own line."""
    if not cfg.enabled:
        return
    if checkpoints and fsio.exists(fsio.join(str(checkpoints), "latest")):
        return
    from bertpipe.launch import LaunchError, detect_launch

    try:
        if detect_launch(os.environ).rank != 0:
            return
    except LaunchError:
        pass
    check_reachable(cfg.resolved_uri(), cfg.uri_key())


def _unreachable(exc: BaseException) -> str | None:
    """Why a request failed to reach its server (``connection refused``, ``timed out``...),
    from the exceptions ``exc`` was raised from; None when it reached it."""
    import socket
    import ssl

    import requests

    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    if not any(isinstance(e, requests.ConnectionError | requests.Timeout) for e in chain):
        return None
    text = " ".join(str(exc).split())
    if any(isinstance(e, ssl.SSLError | requests.exceptions.SSLError) for e in chain):
        return "TLS handshake failed"
    if any(isinstance(e, requests.Timeout) for e in chain) or "timed out" in text:
        return "timed out"
    if any(isinstance(e, socket.gaierror) for e in chain) or "resolve" in text.lower():
        return "host name not resolved"
    if "refused" in text.lower():
        return "connection refused"
    return "connection failed"


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


class _HttpPolicy:
    """The MLflow HTTP settings of the calls inside :func:`quick_http`, shared by threads (a
    run's system-metrics sampler sends from its own): MLflow reads them from the process's
    environment on each request, so they are set while any thread is inside, the strictest
    asked (no timeout of its own while an upload is inside), and restored when the last one
    leaves."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.quick = 0
        self.uploads = 0
        self.saved: dict[str, str | None] = {}

    def enter(self, upload: bool) -> None:
        with self.lock:
            if self.quick + self.uploads == 0:
                self.saved = {k: os.environ.get(k) for k in _HTTP_KEYS}
            if upload:
                self.uploads += 1
            else:
                self.quick += 1
            self._apply()

    def leave(self, upload: bool) -> None:
        with self.lock:
            if upload:
                self.uploads -= 1
            else:
                self.quick -= 1
            self._apply()

    def _apply(self) -> None:
        values = dict(self.saved)
        if self.quick + self.uploads:
            values["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = str(HTTP_RETRIES)
            values["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] = "1"
        if self.quick and not self.uploads:
            values["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(HTTP_TIMEOUT)
        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_HTTP_KEYS = (
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
)
_HTTP_POLICY = _HttpPolicy()


@contextlib.contextmanager
def quick_http(upload: bool = False) -> Iterator[None]:
    """Few retries and a short timeout (MLflow's own for an ``upload``) for the calls made
    inside it (read by MLflow from the environment on each request). Safe across threads:
    the settings hold while any thread is inside (see :class:`_HttpPolicy`)."""
    _HTTP_POLICY.enter(upload)
    try:
        yield
    finally:
        _HTTP_POLICY.leave(upload)


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
