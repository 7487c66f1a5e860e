"""Fine-tuning stopped and continued, as a preemptible job is: a SIGTERM in the middle of an
epoch (the run saves and exits 143), then a SIGKILL in the middle of the next (the last
periodic checkpoint is all there is); the same command each time (``resume=auto``) ends with
what the uninterrupted run ends with: the same losses, metrics, best epoch and best model.

The signals are real signals the process sends itself at a given step
(``BERTPIPE_FAULT_SIGNAL``), so that "mid-epoch" is the same point on every machine. The runs a
signal stops are fresh single-threaded processes, as a real job is; the uninterrupted
reference and the last resume run in the test process on one thread too (CPU kernels may
round differently with another thread count)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bertpipe.config import ConfigError, load_config
from bertpipe.finetuning.config import FinetuneConfig
from bertpipe.finetuning.run import run_finetuning
from bertpipe.training import checkpoint as ckpt
from tests.cli_runner import run_cli
from tests.conftest import sqlite_uri
from tests.faultenv import FAULT_SIGNAL
from tests.finetuning.test_loop import _glue_files
from tests.training.test_pretrain import _env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLI = "bertpipe.app.cli"


def _finetune(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", CLI, "finetune", *args],
        env={**_env(), "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


def _finetune_here(args: list[str]) -> subprocess.CompletedProcess[str]:
    """The same command in this process, on one thread: a run no signal stops needs no
    interpreter of its own."""
    return run_cli(["finetune", *args], {**_env(), "OMP_NUM_THREADS": "1"})


def _summary(proc: subprocess.CompletedProcess[str]) -> dict:  # type: ignore[type-arg]
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _losses(uri: str, run_id: str) -> list[tuple[int, float]]:
    import mlflow

    history = mlflow.MlflowClient(tracking_uri=uri).get_metric_history(run_id, "train/loss")
    return sorted((m.step, m.value) for m in history)


def test_sigterm_then_sigkill_mid_epoch_resume_to_the_same_result(
    pretrained: Path, tmp_path: Path
) -> None:
    train, dev = _glue_files(tmp_path)  # 40 rows: 10 steps of 4 per epoch, 20 in all
    common = [
        f"init_from={pretrained}",
        "task.family=glue",
        "task.name=sst-2",
        f"task.train={train}",
        f"task.dev=[{dev}]",
        "epochs=2",
        "batch_size=4",
        "learning_rate=2e-3",
        "eval_batch_size=16",
        "checkpoint.every_steps=4",
        "checkpoint.preemption_check_steps=1",
        "tracking.experiment=finetune-resume",
    ]
    ref_uri = sqlite_uri(tmp_path / "reference.db")
    reference = _summary(
        _finetune_here([*common, f"output={tmp_path / 'reference'}", f"tracking.uri={ref_uri}"])
    )
    out, uri = tmp_path / "run", sqlite_uri(tmp_path / "run.db")
    args = [*common, f"output={out}", f"tracking.uri={uri}"]
    folder = out / "checkpoints"

    stopped = _finetune(args, **{FAULT_SIGNAL: "TERM:5"})  # epoch 1, step 5
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert ckpt.latest_tag(str(folder)) == "global_step5"
    state, rank_state = ckpt.read_state(str(folder), "global_step5", 0)
    assert state.data == {"epoch": 1, "batches": 5} and rank_state is not None
    assert "loss_sum" in rank_state["loop"]

    killed = _finetune(args, **{FAULT_SIGNAL: "KILL:13"})  # epoch 2, step 13
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert ckpt.latest_tag(str(folder)) == "global_step12"
    state, _ = ckpt.read_state(str(folder), "global_step12", 0)
    assert state.loop["best_epoch"] == 1 and len(state.loop["history"]) == 1

    # a setting that fixes what the checkpoint is cannot change: one line, nothing trained
    cfg = load_config(FinetuneConfig, None, [*args, "batch_size=8", "tracking.enabled=false"])
    with pytest.raises(ConfigError, match=r"batch_size 4 -> 8") as error:
        run_finetuning(cfg)
    assert "\n" not in str(error.value) and "checkpoint.allow_changes" in str(error.value)
    assert ckpt.latest_tag(str(folder)) == "global_step12"

    resumed = _summary(_finetune_here(args))
    assert resumed["metrics"] == reference["metrics"]
    assert resumed["best_epoch"] == reference["best_epoch"]
    assert resumed["run_id"] == state.mlflow_run_id  # one MLflow run across the three processes
    assert _losses(uri, resumed["run_id"]) == _losses(ref_uri, reference["run_id"])
    best, ref_best = out / "best" / "model.safetensors", tmp_path / "reference" / "best"
    assert best.read_bytes() == (ref_best / "model.safetensors").read_bytes()
    assert not folder.exists()  # a complete run keeps its result, not its checkpoints
