"""Tracking never kills training: a real ``mlflow server`` is stopped in the middle of a run
and started again on the same port and store; the run completes and every metric point
reaches the run once, with its step (pre-training), or is left in the buffer with a warning
and replayed later (fine-tuning with the server down for the whole training)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from bertpipe import tracking
from bertpipe.training import checkpoint as ckpt
from bertpipe.training.trainer import run_pretraining
from tests.conftest import MlflowServer
from tests.finetuning.conftest import pretrained  # noqa: F401 (a fixture)
from tests.training.test_pretrain import _cfg

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def server(tmp_path: Path) -> Any:
    s = MlflowServer(tmp_path)
    s.start()
    try:
        yield s
    finally:
        s.stop()


def _messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_pretraining_survives_a_server_outage(
    pretrain_shards: Path,
    tmp_path: Path,
    server: MlflowServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import mlflow

    monkeypatch.setattr(tracking.outbox, "RETRY_SECONDS", 0.0)  # try again at every log step
    real = tracking.log_metrics

    def timed(metrics: Any, step: int | None = None) -> None:
        """The server dies before step 3 is logged and is back before step 6."""
        if "train/loss" in metrics and step == 3:
            server.stop()
        if "train/loss" in metrics and step == 6:
            assert (tmp_path / "run" / tracking.BUFFER_NAME).exists()
            server.start()
        real(metrics, step)

    monkeypatch.setattr(tracking, "log_metrics", timed)
    caplog.set_level(logging.WARNING, logger="bertpipe.tracking")
    cfg = _cfg(pretrain_shards, tmp_path / "run", server.uri, steps=8)
    summary = run_pretraining(cfg)
    assert summary["phase2"]["global_step"] == 12
    assert not (tmp_path / "run" / tracking.BUFFER_NAME).exists()
    state, _ = ckpt.read_state(cfg.checkpoint_dir, ckpt.latest_tag(cfg.checkpoint_dir), 0)
    client = mlflow.MlflowClient(tracking_uri=server.uri)
    run = client.get_run(state.mlflow_run_id)
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == list(range(1, 13))  # each step once, in order
    timestamps = [m.timestamp for m in history]
    assert timestamps == sorted(timestamps)  # the buffered points kept their own time
    assert run.data.metrics["tracking/replayed_metrics"] > 0
    assert run.data.metrics["tracking/failed_calls"] >= 1
    assert len(_messages(caplog, "MLflow call failed")) == 1
    assert len(_messages(caplog, "MLflow reachable again")) == 1
    assert not _messages(caplog, "unreachable at the end")


def test_finetuning_with_the_server_down_completes_and_replays_later(
    pretrained: Path,  # noqa: F811
    tmp_path: Path,
    server: MlflowServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import mlflow

    from bertpipe.finetuning import run as loop
    from tests.finetuning.test_loop import _cfg as finetune_cfg

    real_train = loop.Finetuner._train

    def down_for_training(self: Any, run_id: str | None) -> Any:
        server.stop()  # the run exists; the server is gone until after the run
        return real_train(self, run_id)

    monkeypatch.setattr(loop.Finetuner, "_train", down_for_training)
    caplog.set_level(logging.WARNING, logger="bertpipe.tracking")
    result = loop.run_finetuning(finetune_cfg(pretrained, tmp_path, server.uri, "glue", "epochs=2"))
    assert result.run_id is not None and result.metrics
    buffer = tmp_path / "out" / tracking.BUFFER_NAME
    assert buffer.exists()
    assert len(_messages(caplog, "MLflow call failed")) == 1
    (line,) = _messages(caplog, "MLflow unreachable at the end")
    assert "stays RUNNING" in line and str(buffer) in line
    server.start()
    client = mlflow.MlflowClient(tracking_uri=server.uri)
    assert client.get_run(result.run_id).info.status == "RUNNING"
    assert tracking.replay_buffer(str(buffer), server.uri) > 0
    assert not buffer.exists()
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(result.run_id, "train/loss")]
    assert steps == [h["step"] for h in result.history]
    assert run.data.metrics["best/accuracy"] == result.metrics["accuracy"]
    assert {"model", "predictions", "finetune_summary.json"} <= {
        a.path for a in client.list_artifacts(result.run_id)
    }
