"""The MLflow model registry: a trained model registered as a new version of a named model."""

from __future__ import annotations

import logging
from typing import Any

from bertpipe import fsio
from bertpipe.errors import BertpipeError

log = logging.getLogger(__name__)

__all__ = ["RegistryError", "pip_requirements", "register_pytorch_model"]


class RegistryError(BertpipeError):
    """The MLflow model registry could not take a model; ``key`` is the setting naming the
    tracking URI (``tracking.uri``, ``--tracking-uri``)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


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
