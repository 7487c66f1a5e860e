"""Fine-tuning's non-finite policy, as pre-training's: a NaN burst is skipped (never applied,
counted) and the run completes with finite weights; persistent NaN stops with one line after
``max_bad_steps``. Faults are injected into the loss of real DeepSpeed steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bertpipe.finetuning.run import load_task_model, run_finetuning
from bertpipe.training.core.guard import NonFiniteError
from tests.conftest import sqlite_uri
from tests.faultenv import FAULT_NAN_STEPS
from tests.finetuning.test_loop import _cfg

pytestmark = pytest.mark.integration


def test_nan_burst_is_skipped(pretrained: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(FAULT_NAN_STEPS, "2,3")
    uri = sqlite_uri(tmp_path / "mlflow.db")
    result = run_finetuning(_cfg(pretrained, tmp_path, uri, "glue", "epochs=2"))
    import mlflow

    history = mlflow.MlflowClient(tracking_uri=uri).get_metric_history(
        result.run_id, "train/skipped_steps"
    )
    assert history[-1].value == 2
    model = load_task_model(Path(result.output) / "best")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_persistent_nan_stops(pretrained: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(FAULT_NAN_STEPS, "1-")
    uri = sqlite_uri(tmp_path / "mlflow.db")
    with pytest.raises(NonFiniteError, match=r"3 optimizer steps in a row.*max_bad_steps=3") as e:
        run_finetuning(_cfg(pretrained, tmp_path, uri, "glue", "epochs=2", "max_bad_steps=3"))
    assert "\n" not in str(e.value)
