"""Tracking never kills training: a real ``mlflow server`` is stopped in the middle of a run
and started again on the same port and store; the run completes and every metric point
reaches the run once, with its step, the machine's system metrics of the outage included
(pre-training), or is left in the buffer with a warning and replayed later (fine-tuning with
the server down for the whole training). A server that is not there when a stage starts is
one line naming ``tracking.uri`` within seconds, before any work."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bertpipe import tracking
from bertpipe.tracking import client as tracking_client
from bertpipe.training import checkpoint as ckpt
from bertpipe.training.pretrain.trainer import run_pretraining
from tests.cli_runner import run_cli
from tests.conftest import MlflowServer, free_port, parity_task
from tests.finetuning.conftest import pretrained  # noqa: F401 (a fixture)
from tests.training.test_pretrain import _cfg, _env, _overrides

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
    outage: dict[str, int] = {}

    def timed(metrics: Any, step: int | None = None) -> None:
        """The server dies before step 3 is logged and is back before step 6."""
        if "train/loss" in metrics and step == 3:
            server.stop()
            outage["down"] = int(time.time() * 1000)
        if "train/loss" in metrics and step == 6:
            assert (tmp_path / "run" / tracking.BUFFER_NAME).exists()
            server.start()
            outage["up"] = int(time.time() * 1000)
        real(metrics, step)

    monkeypatch.setattr(tracking, "log_metrics", timed)
    caplog.set_level(logging.WARNING, logger="bertpipe.tracking")
    cfg = _cfg(
        pretrain_shards,
        tmp_path / "run",
        server.uri,
        steps=8,
        tracking__system_metrics_interval_s=0.5,
    )
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
    # the machine's metrics sampled while the server was down arrived, each aggregate once
    for key in ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"):
        points = client.get_metric_history(run.info.run_id, key)
        steps = sorted(m.step for m in points)
        assert steps == list(range(len(steps))), key
        during = [m for m in points if outage["down"] < m.timestamp < outage["up"]]
        assert len(during) >= 2, (key, outage, [m.timestamp for m in points])
        assert max(m.timestamp for m in points) > outage["up"]  # and it went on after


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


# ------------------------------------------------------------- no server when a stage starts


def _refused_for_tracking(done: subprocess.CompletedProcess[str], uri: str) -> str:
    """The command ended with exit 2 and one line naming ``tracking.uri`` and ``uri``: no
    traceback, no storage named."""
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    lines = done.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("bertpipe: error:")] == [lines[-1]]
    assert lines[-1].startswith(
        f"bertpipe: error: tracking.uri: no MLflow tracking server answers at {uri} "
        "(connection refused"
    ), lines[-1]
    assert "Traceback" not in done.stderr and "storage endpoint" not in done.stderr
    return lines[-1]


def test_no_tracking_server_at_start_is_one_line_for_every_stage(
    corpus_dir: Path,
    tokenizer_dir: Path,
    pretrain_shards: Path,
    pretrained: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing listens at ``tracking.uri``: every stage that starts a run exits 2 with one
    line naming it, before any work (no tokenizer, shards, checkpoint, model or trial), and
    within 15 s of the command's start. ``bertpipe pretrain`` (the slowest to start: torch,
    DeepSpeed) is timed as a process of its own with the real probe; the other stages run in
    this process with a one-attempt probe, so their time is their own work before the probe
    (:data:`~bertpipe.tracking.client.PROBE_SECONDS` more with the real one, timed in
    tests/unit/test_tracking_store.py)."""
    uri = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "out"
    probe = tracking_client.PROBE_SECONDS
    train, dev = parity_task(tmp_path / "task")
    suite = tmp_path / "suite.yaml"
    suite.write_text(
        "name: parity\ntasks:\n  - {name: parity, train: train.jsonl, dev: [dev.jsonl]}\n"
    )
    task = ["task.family=table", "task.name=parity", f"task.train={train}", f"task.dev=[{dev}]"]
    stages = {
        "tokenizer": (
            ["tokenizer", "train", f"input.paths=[{corpus_dir}]", "vocab_size=300"],
            "tokenizer.json",
        ),
        "preprocess": (
            [
                "preprocess",
                f"input.paths=[{corpus_dir}]",
                f"tokenizer={tokenizer_dir}",
                "phases=[{name: seq64, max_seq_length: 64, max_predictions_per_seq: 10, "
                "num_shards: 2}]",
            ],
            "**/*.tar",
        ),
        "finetune": (["finetune", f"init_from={pretrained}", *task, "epochs=1"], "**/best"),
        "sweep": (
            ["sweep", f"init_from={pretrained}", *task, "sweep.max_trials=1"],
            "**/trial-*",
        ),
        "evaluate": (
            [
                "evaluate",
                f"model={pretrained}",
                f"suite={suite}",
                f"data={tmp_path / 'task'}",
                "protocol.learning_rates=[1e-3]",
                "protocol.seeds=[1]",
                "protocol.epochs=1",
                "threads_per_trial=1",
            ],
            "**/result.json",
        ),
    }
    monkeypatch.setattr(tracking_client, "PROBE_SECONDS", 0.0)
    for stage, (argv, made) in stages.items():
        output = out / stage
        started = time.monotonic()
        done = run_cli([*argv, f"output={output}", f"tracking.uri={uri}"])
        elapsed = time.monotonic() - started
        _refused_for_tracking(done, uri)
        assert elapsed + probe < 15, (stage, elapsed)
        assert not list(output.glob(made)), (stage, list(output.glob(made)))
    monkeypatch.undo()

    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bertpipe.app.cli",
            "pretrain",
            *_overrides(pretrain_shards, out / "pretrain", uri),
        ],
        env={**_env(), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - started
    line = _refused_for_tracking(done, uri)
    assert f"tried for {probe:.0f} s" in line
    assert elapsed < 15, f"pretrain took {elapsed:.1f} s to name the missing server"
    assert "DeepSpeed" not in done.stderr  # named before DeepSpeed started
    assert not list((out / "pretrain").glob("**/global_step*"))
