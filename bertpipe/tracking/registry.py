"""Models in MLflow as its users see them: a logged model of the run that made it, in MLflow's
``transformers`` flavour, and (when asked) a new version of a registered model.

What is stored is the HF folder bertpipe writes (``config.json``, ``model.safetensors``, the
tokenizer), re-saved by ``transformers``: safetensors weights, no pickle, no bertpipe class.
``mlflow.transformers.load_model("models:/NAME/VERSION", return_type="components")`` loads it
back wherever ``transformers`` is installed, bertpipe or not, and nothing is unpickled.

The folder is read with ``transformers`` (model and tokenizer) and handed to MLflow as
components, not as a path: MLflow's local-checkpoint path (3.17, 3.18) fails with
transformers 5, whose pipeline registry names its classes by string.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bertpipe import fsio
from bertpipe.errors import BertpipeError

log = logging.getLogger(__name__)

__all__ = [
    "LoggedModelRef",
    "RegistryError",
    "hf_task",
    "log_hf_model",
    "pip_requirements",
    "register_logged_model",
]

ARCHITECTURE_TASKS = {
    "BertForPreTraining": "fill-mask",
    "BertForMaskedLM": "fill-mask",
    "BertForSequenceClassification": "text-classification",
    "BertForTokenClassification": "token-classification",
    "BertForQuestionAnswering": "question-answering",
    "ModernBertForMaskedLM": "fill-mask",
    "ModernBertForSequenceClassification": "text-classification",
    "ModernBertForTokenClassification": "token-classification",
    "ModernBertForQuestionAnswering": "question-answering",
}
"""The ``transformers`` pipeline task of each architecture bertpipe writes."""


class RegistryError(BertpipeError):
    """The MLflow model registry could not take a model; ``key`` is the setting naming the
    tracking URI (``tracking.uri``, ``--tracking-uri``)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


@dataclasses.dataclass(frozen=True)
class LoggedModelRef:
    """A model logged to MLflow: ``model_id`` (``m-...``), ``model_uri`` (``models:/<id>``) and
    ``registered`` (``NAME/VERSION``) when it was also registered."""

    model_id: str
    model_uri: str
    registered: str | None = None


def pip_requirements() -> list[str]:
    """What loading a logged model needs (bertpipe is not one of them): given explicitly, so
    that MLflow neither infers them (slow: it loads the model in a subprocess) nor guesses."""
    from importlib.metadata import version

    return [
        f"{name}=={version(name).split('+')[0]}"
        for name in ("transformers", "torch", "safetensors")
    ]


def hf_task(folder: str | os.PathLike[str]) -> str:
    """The ``transformers`` pipeline task of the HF folder ``folder``, from its config.json's
    architecture. ``question-answering`` is ``feature-extraction`` (the model loads as the same
    ``*ForQuestionAnswering``) where transformers has no question-answering pipeline (5.x)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    architecture = (config.get("architectures") or ["?"])[0]
    if architecture not in ARCHITECTURE_TASKS:
        raise ValueError(
            f"{folder}: architecture {architecture!r} has no pipeline task here; "
            f"known: {sorted(ARCHITECTURE_TASKS)}"
        )
    task = ARCHITECTURE_TASKS[architecture]
    if task == "question-answering":
        from transformers import pipelines

        if task not in pipelines.SUPPORTED_TASKS:
            return "feature-extraction"
    return task


def log_hf_model(
    folder: str | os.PathLike[str],
    *,
    task: str,
    run_id: str | None,
    name: str = "model",
    register: str | None = None,
    uri_key: str,
    experiment_id: str | None = None,
) -> LoggedModelRef | None:
    """Log the HF folder ``folder`` (local) as a ``transformers``-flavour model output of MLflow
    run ``run_id`` (the Models column of the run; ``None``: no run, in ``experiment_id`` or
    the current experiment) and, with ``register``, register it as a new version of that
    name, whose source is this logged model. ``task`` is its pipeline task
    (:func:`hf_task`).

    Tracking never stops a stage: any failure is one warning line and ``None``, unless
    ``register`` was asked, where it is a one-line :class:`RegistryError` naming ``uri_key``,
    the setting that holds the tracking URI.
    """
    import mlflow

    try:
        model_id = _log(Path(folder).resolve(), task, run_id, name, experiment_id)
    except Exception as exc:  # MlflowException, connection, storage and loading errors alike
        what = f"could not log {folder} as model {name!r} of MLflow run {run_id}"
        if register:
            raise _registry_error(uri_key, f"{what} to register it as {register!r}", exc) from exc
        log.warning(
            "%s at %s: %s; the model is not logged there",
            what,
            fsio.redact(mlflow.get_tracking_uri()),
            reason_line(exc),
        )
        return None
    registered = register_logged_model(model_id, register, uri_key=uri_key) if register else None
    log.info(
        "logged %s as model %s of MLflow run %s%s (%s)",
        folder,
        model_id,
        run_id,
        f", registered as {registered}" if registered else "",
        fsio.redact(mlflow.get_tracking_uri()),
    )
    return LoggedModelRef(model_id, f"models:/{model_id}", registered)


def register_logged_model(model_id: str, name: str, *, uri_key: str) -> str:
    """Register the logged model ``model_id`` as a new version of ``name`` (its source is that
    model); returns ``NAME/VERSION``. Any failure is a one-line :class:`RegistryError` naming
    ``uri_key``."""
    import mlflow

    try:
        version = mlflow.register_model(f"models:/{model_id}", name)
    except Exception as exc:
        raise _registry_error(
            uri_key, f"could not register logged model {model_id} as {name!r}", exc
        ) from exc
    return f"{name}/{version.version}"


def reason_line(exc: BaseException) -> str:
    """An MLflow or storage error as one redacted line of at most 300 characters."""
    return fsio.redact(" ".join(str(exc).split())[:300]) or type(exc).__name__


def _registry_error(uri_key: str, what: str, exc: BaseException) -> RegistryError:
    import mlflow

    return RegistryError(
        uri_key,
        f"{what} in the MLflow model registry at {fsio.redact(mlflow.get_tracking_uri())}: "
        f"{reason_line(exc)} (check that the tracking store is reachable and has a model "
        f"registry, or point {uri_key} at one)",
    )


def _log(folder: Path, task: str, run_id: str | None, name: str, experiment_id: str | None) -> str:
    """Log ``folder``; returns the logged model's id."""
    import mlflow
    import mlflow.transformers

    params: dict[str, str] = {}
    if run_id is not None:  # the model goes to the run's experiment, whatever is current
        run = mlflow.MlflowClient().get_run(run_id)
        experiment_id = experiment_id or run.info.experiment_id
        params = dict(run.data.params)  # what log_model gives a model of its own
    with _quiet_transformers():
        components = _components(folder)
        model = mlflow.initialize_logged_model(
            name=name, source_run_id=run_id, params=params, experiment_id=experiment_id
        )
        mlflow.transformers.log_model(
            components,
            task=task,
            name=name,
            model_id=model.model_id,
            run_id=run_id,
            model_card=_model_card(components["model"], task, run_id),
            pip_requirements=pip_requirements(),
        )
    return model.model_id


def _components(folder: Path) -> dict[str, Any]:
    """The model (its config.json's architecture, safetensors weights only) and tokenizer of
    ``folder``, read from the folder alone (never the HF hub)."""
    import transformers

    config = json.loads((folder / "config.json").read_text())
    architecture = (config.get("architectures") or ["?"])[0]
    cls = getattr(transformers, architecture, None)
    if cls is None:
        raise ValueError(f"{folder}: transformers has no architecture {architecture!r}")
    # an absolute path: MLflow's licence lookup takes it for a hub repository id otherwise
    model = cls.from_pretrained(str(folder), use_safetensors=True, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return {"model": model.eval(), "tokenizer": tokenizer}


def _model_card(model: Any, task: str, run_id: str | None) -> Any:
    """The card stored with the model; given, so that MLflow does not ask the HF hub for one."""
    from huggingface_hub import ModelCard

    architecture = type(model).__name__
    source = f" in MLflow run {run_id}" if run_id else ""
    return ModelCard(
        "---\n"
        "library_name: transformers\n"
        f"pipeline_tag: {task}\n"
        "tags: [bert, bertpipe]\n"
        "---\n"
        f"# {architecture}\n\n"
        f"A BERT trained with bertpipe{source}. Safetensors weights, no pickle: "
        '`mlflow.transformers.load_model(uri, return_type="components")` loads it with '
        "transformers alone (bertpipe is not needed).\n"
    )


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No progress bars from transformers while it reads and writes the model (bertpipe logs
    lines)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
