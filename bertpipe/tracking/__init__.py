"""MLflow helpers: one experiment per project, one run per stage, lineage tags.

Only rank 0 of a distributed job may call these (a sqlite store takes one writer). Stages use
the names exported here (``tracking.start_run``, ``tracking.log_metrics``, ...); the code is
split by concern:

* :mod:`~bertpipe.tracking.client`: :class:`TrackingConfig`, the store's absolute URI and
  experiment (:func:`connect`), a config as params (:func:`config_params`), the lineage tags
  (:data:`TAG_STAGE`, :data:`TAG_PARENT`, :data:`TAG_DATA_CHECKSUM`), the short HTTP
  timeout of mid-run calls (:data:`~bertpipe.tracking.client.HTTP_TIMEOUT`), the probe of a
  tracking server before a run starts (:func:`~bertpipe.tracking.client.check_reachable`,
  :func:`check_new_run` before a stage's costly start),
  and a run that has ended, by its id (:func:`connect_to_run`, :func:`set_run_tag`,
  :func:`log_run_artifact`).
* :mod:`~bertpipe.tracking.lifecycle`: :func:`start_run` and the logging calls made inside it.
* :mod:`~bertpipe.tracking.outbox`: the outage buffer. Tracking never stops a run: what
  MLflow could not take waits in ``<output>/mlflow-buffer.jsonl`` (:func:`buffer_path`) and is
  replayed with its original steps and timestamps when the store answers again, tried at most
  every :data:`~bertpipe.tracking.outbox.RETRY_SECONDS`, so a store that is down costs the
  loop (and the ranks waiting for rank 0 in the next collective) at most one short attempt
  per retry interval; :func:`replay_buffer` sends a buffer left behind.
* :mod:`~bertpipe.tracking.system_metrics`: MLflow's system-metrics samplers in a thread,
  sending through the open run's outbox (so an outage buffers them too).
* :mod:`~bertpipe.tracking.inputs`: what a run read and made as MLflow's own dataset inputs
  and logged models (:class:`DatasetRef`, :func:`log_inputs`, :func:`log_folder_model`).
* :mod:`~bertpipe.tracking.registry`: :func:`log_hf_model` (a model as a logged model of its
  run, MLflow's ``transformers`` flavour, optionally registered) and :func:`hf_task`.
* :mod:`~bertpipe.tracking.runs`: calls on runs other than the open one (a suite's killed
  trials, a watcher's metrics in the pre-training run, a run's status, a registered model's
  files).
* :mod:`~bertpipe.tracking.publish`: :func:`publish_model`, a stage's model output logged
  or registered, kept as plain artifacts through the buffer while the store is down.

The tunables (``RETRY_SECONDS``, ``BATCH_METRICS`` in :mod:`~bertpipe.tracking.outbox`;
``HTTP_RETRIES``, ``HTTP_TIMEOUT`` in :mod:`~bertpipe.tracking.client`) are read where they
are defined and are not re-exported here, so that setting them on this package (which would
change nothing) fails instead.
"""

from __future__ import annotations

from bertpipe.tracking.client import (
    DEFAULT_URI,
    MAX_PARAM_KEY,
    MAX_PARAM_VALUE,
    STAGES,
    TAG_DATA_CHECKSUM,
    TAG_PARENT,
    TAG_STAGE,
    TAG_TOKENIZER,
    TrackingConfig,
    TrackingUnreachableError,
    check_new_run,
    config_params,
    connect,
    connect_to_run,
    log_run_artifact,
    runs_page_url,
    set_run_tag,
)
from bertpipe.tracking.inputs import (
    DatasetRef,
    export_model_id,
    files_dataset,
    find_model,
    log_folder_model,
    log_inputs,
)
from bertpipe.tracking.lifecycle import (
    log_artifacts,
    log_config,
    log_dict,
    log_metrics,
    log_params,
    log_text,
    set_tags,
    start_run,
    terminated_raises,
)
from bertpipe.tracking.outbox import BUFFER_NAME, buffer_path, replay_buffer
from bertpipe.tracking.publish import TAG_REGISTERED, publish_model
from bertpipe.tracking.registry import (
    LoggedModelRef,
    RegistryError,
    hf_task,
    log_hf_model,
    pip_requirements,
    register_logged_model,
)
from bertpipe.tracking.runs import (
    download_model,
    end_killed_children,
    log_run_metrics,
    model_version_run,
    run_status,
)

__all__ = [
    "BUFFER_NAME",
    "DEFAULT_URI",
    "MAX_PARAM_KEY",
    "MAX_PARAM_VALUE",
    "STAGES",
    "TAG_DATA_CHECKSUM",
    "TAG_PARENT",
    "TAG_REGISTERED",
    "TAG_STAGE",
    "TAG_TOKENIZER",
    "DatasetRef",
    "LoggedModelRef",
    "RegistryError",
    "TrackingConfig",
    "TrackingUnreachableError",
    "buffer_path",
    "check_new_run",
    "config_params",
    "connect",
    "connect_to_run",
    "download_model",
    "end_killed_children",
    "export_model_id",
    "files_dataset",
    "find_model",
    "hf_task",
    "log_artifacts",
    "log_config",
    "log_dict",
    "log_folder_model",
    "log_hf_model",
    "log_inputs",
    "log_metrics",
    "log_params",
    "log_run_artifact",
    "log_run_metrics",
    "log_text",
    "model_version_run",
    "pip_requirements",
    "publish_model",
    "register_logged_model",
    "replay_buffer",
    "run_status",
    "runs_page_url",
    "set_run_tag",
    "set_tags",
    "start_run",
    "terminated_raises",
]
