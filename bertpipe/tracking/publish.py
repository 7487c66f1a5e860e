"""A run's model output as a stage publishes it: logged to its run, registered on request,
kept as plain artifacts while the store is down.

Fine-tuning (each run's ``best/`` folder, a sweep's best trial) publishes through
:func:`publish_model`; the stage itself makes no MLflow call.
"""

from __future__ import annotations

import logging
import os

from bertpipe.tracking.client import quick_http, set_run_tag
from bertpipe.tracking.lifecycle import current_outbox, log_artifacts
from bertpipe.tracking.registry import (
    LoggedModelRef,
    hf_task,
    log_hf_model,
    register_logged_model,
)

log = logging.getLogger(__name__)

__all__ = ["TAG_REGISTERED", "publish_model"]

TAG_REGISTERED = "bertpipe.registered_model"
"""``NAME/VERSION`` of a run's model in the registry."""


def publish_model(
    folder: str | os.PathLike[str],
    run_id: str,
    *,
    register: str | None = None,
    model_id: str | None = None,
    uri_key: str = "tracking.uri",
) -> LoggedModelRef | None:
    """Log the HF folder ``folder`` as the model output of run ``run_id`` (MLflow's
    ``transformers`` flavour, the pipeline task of its head) and, with ``register``, register
    it as a new version of that name (the run gets a :data:`TAG_REGISTERED` tag). A model
    already logged (``model_id``: a sweep trial's) is registered, not logged again.

    Without ``register`` tracking never stops the run: while the store is down (the open run's
    buffer cannot be replayed), or if logging fails, the folder goes to the run as plain
    artifacts ``model`` instead, through the buffer, and None is returned. With ``register``
    any failure is a :class:`~bertpipe.tracking.RegistryError` naming ``uri_key``."""
    if model_id is not None:  # logged already: register it (or nothing to do)
        if register is None:
            return LoggedModelRef(model_id, f"models:/{model_id}")
        with quick_http(upload=True):
            registered = register_logged_model(model_id, register, uri_key=uri_key)
        set_run_tag(run_id, TAG_REGISTERED, registered)
        return LoggedModelRef(model_id, f"models:/{model_id}", registered)
    outbox = current_outbox()
    if outbox is not None and outbox.run_id != run_id:
        outbox = None  # another run's (a sweep's parent): no buffer for this run
    logged: LoggedModelRef | None = None
    if register is None and outbox is not None and outbox.pending() and not outbox.replay():
        log.warning("MLflow is down: the model of run %s is buffered as artifacts `model`", run_id)
    else:
        with quick_http(upload=True):
            logged = log_hf_model(
                folder,
                task=hf_task(folder),
                run_id=run_id,
                name="model",
                register=register,
                uri_key=uri_key,
            )
    if logged is None:
        if outbox is not None:  # the files at least, when the store answers again
            log.info("uploading %s to run %s as plain artifacts `model` instead", folder, run_id)
            log_artifacts(str(folder), "model")
        return None
    if logged.registered:
        set_run_tag(run_id, TAG_REGISTERED, logged.registered)
    return logged
