"""What a fine-tuning run publishes: its best epoch's model as an HF folder, and at the end
its metrics, summary and predictions in MLflow, the model as the run's logged model
(registered with ``register``). Every MLflow call goes through :mod:`bertpipe.tracking`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bertpipe import tracking
from bertpipe.finetuning.config import FinetuneConfig
from bertpipe.finetuning.data import TaskData
from bertpipe.finetuning.tasks.base import TaskSpec

if TYPE_CHECKING:
    from torch import nn

    from bertpipe.finetuning.run import FinetuneResult

__all__ = ["TAG_REGISTERED", "log_result", "register_best", "save_best"]

TAG_REGISTERED = tracking.TAG_REGISTERED


def save_best(module: nn.Module, output: Path, tokenizer_dir: str, spec: TaskSpec) -> Path:
    """Write ``module`` (the engine's model) as ``<output>/best``, an HF folder with the
    tokenizer's files and the task's label names (rank 0)."""
    from bertpipe.preprocessing.tokenizer import load_tokenizer, tokenizer_files
    from bertpipe.training.models.hf import save_hf_folder

    best = output / "best"
    if best.exists():
        shutil.rmtree(best)
    # the files of the tokenizer the run used, written from it (transformers then gives its
    # ids), not copied from the folder (an older tokenizer_config.json lacked settings)
    max_length = getattr(getattr(module, "config", None), "max_position_embeddings", 512)
    extra = tokenizer_files(load_tokenizer(tokenizer_dir), model_max_length=max_length)
    save_hf_folder(module, best, extra_files=extra)
    if spec.labels:
        config = json.loads((best / "config.json").read_text())
        config["id2label"] = {str(i): label for i, label in enumerate(spec.labels)}
        config["label2id"] = {label: i for i, label in enumerate(spec.labels)}
        (best / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return best


def log_result(
    result: FinetuneResult,
    data: TaskData,
    output: Path,
    cfg: FinetuneConfig,
    upload_model: bool,
) -> None:
    """The run's end in its MLflow run (rank 0, inside it): the best epoch's metrics, the
    summary with every epoch's, the predictions, and the model (``upload_model``; always
    when it is to be registered)."""
    tracking.log_metrics({f"best/{k}": v for k, v in result.metrics.items()})
    tracking.log_metrics({"best/epoch": result.best_epoch, "best/step": result.best_step})
    summary: dict[str, Any] = {
        "task": data.spec.name,
        "kind": data.spec.kind,
        "labels": list(data.spec.labels),
        "main_metric": data.spec.main_metric,
        "read_reports": [r.summary() for r in data.reports],
        "history": result.history,
    }
    tracking.log_dict(summary, "finetune_summary.json")
    if (output / "predictions").exists():
        tracking.log_artifacts(str(output / "predictions"), "predictions")
    best = output / "best"
    wanted = cfg.register or (cfg.save_model and upload_model)
    if wanted and best.exists() and result.run_id is not None:
        logged = register_best(best, cfg.register, result.run_id)
        if logged is not None:
            result.model_id, result.registered_model = logged.model_id, logged.registered


def register_best(
    folder: Path, name: str | None, run_id: str, model_id: str | None = None
) -> tracking.LoggedModelRef | None:
    """Log the fine-tuned model in ``folder`` as the model output of run ``run_id`` and, with
    ``name``, register it (:func:`bertpipe.tracking.publish_model`: buffered as artifacts
    while the store is down, unless it is to be registered)."""
    return tracking.publish_model(folder, run_id, register=name, model_id=model_id)
