"""``bertpipe evaluate --watch``: downstream scores of a pre-training run's checkpoints while it
trains, logged into its MLflow run, without changing its losses.

A real pre-training process (the tiny BERT, phase 1, a checkpoint every 2 steps, the last 2
kept) and a real watcher process. The pre-training stops itself (SIGSTOP) before step 7 with
checkpoints 4 and 6 published; the watcher lists both and starts on 4; the watcher is then
stopped (SIGSTOP) while the pre-training finishes, pruning 4 and 6 as it saves 8 and 10; the
watcher, continued, finishes 4, meets 6 gone (one line, skipped), evaluates 8 and 10, and
ends because the run has ended.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bertpipe.training import checkpoint as ckpt
from bertpipe.training.pretrain.trainer import run_pretraining
from tests.cli_runner import run_cli
from tests.conftest import WORDS, sqlite_uri
from tests.faultenv import FAULT_SIGNAL
from tests.training.test_pretrain import _cfg, _env, _history, _overrides

pytestmark = pytest.mark.integration

PRETRAIN = {
    "checkpoint__every_steps": 2,
    "checkpoint__keep_last": 2,
    "phases[0].global_batch_size": 8,
    "only_phase": "phase1",
    "tracking__system_metrics": "false",
}
SUITE = "name: words\ntasks:\n  - {name: has-the, train: train.tsv, dev: [dev.tsv]}\n"


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def wait_for(what: str, until, proc: subprocess.Popen, timeout: float) -> None:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while not until():
        assert proc.poll() is None, f"the process ended ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.05)


def _task(folder: Path) -> Path:
    """A small table task in the pre-training corpus's words: does the row hold 'the'?"""
    rng = np.random.default_rng(0)
    others = [w for w in WORDS if w != "the"]
    for name, n in (("train.tsv", 64), ("dev.tsv", 32)):
        rows = ["text\tlabel"]
        for i in range(n):
            words = list(rng.choice(others, size=8))
            if i % 2:
                words[int(rng.integers(0, 8))] = "the"
            rows.append(f"{' '.join(words)}\t{i % 2}")
        (folder / name).write_text("\n".join(rows) + "\n")
    (folder / "suite.yaml").write_text(SUITE)
    return folder / "suite.yaml"


def test_a_watcher_logs_downstream_scores_at_checkpoint_steps(
    pretrain_shards: Path, tmp_path: Path
) -> None:
    uri = sqlite_uri(tmp_path / "mlflow.db")
    suite = _task(tmp_path)
    alone = _cfg(pretrain_shards, tmp_path / "alone", uri, steps=10, **PRETRAIN)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the watched run's process computes
    try:
        alone_summary = run_pretraining(alone)
    finally:
        torch.set_num_threads(threads)
    assert alone_summary["phase1"]["steps"] == 10

    out = tmp_path / "watched"
    folder = out / "checkpoints"
    env = {**_env(), "OMP_NUM_THREADS": "1"}
    args = ["pretrain", *_overrides(pretrain_shards, out, uri, steps=10, **PRETRAIN)]
    pre = subprocess.Popen(
        [sys.executable, "-m", "bertpipe.app.cli", *args],
        env={**env, FAULT_SIGNAL: "STOP:7"},
        start_new_session=True,
    )
    watcher = None
    try:
        wait_for("the pre-training to stop before step 7", lambda: stopped(pre.pid), pre, 180)
        assert ckpt.published_tags(str(folder)) == ["global_step4", "global_step6"]
        watch_out = tmp_path / "watch"
        watch = [
            "evaluate",
            "--watch",
            str(folder),
            f"suite={suite}",
            f"output={watch_out}",
            "watch.poll_s=0.2",
            "watch.idle_timeout_s=300",
            "protocol.learning_rates=[1e-3]",
            "protocol.seeds=[1]",
            "protocol.epochs=1",
            "protocol.batch_size=16",
            "protocol.max_seq_length=32",
            "threads_per_trial=1",
            f"tracking.uri={uri}",
            "tracking.experiment=pretrain-tests",
        ]
        watcher = subprocess.Popen(
            [sys.executable, "-m", "bertpipe.app.cli", *watch],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        ready = watch_out / "global_step4" / "model" / ".bertpipe-model-ready"
        wait_for("the watcher to start on global_step4", ready.exists, watcher, 180)
        os.killpg(watcher.pid, signal.SIGSTOP)
        os.kill(pre.pid, signal.SIGCONT)
        assert pre.wait(timeout=180) == 0
        assert ckpt.published_tags(str(folder)) == ["global_step8", "global_step10"]
        os.killpg(watcher.pid, signal.SIGCONT)
        stdout, stderr = watcher.communicate(timeout=300)
        assert watcher.returncode == 0, stderr.decode()[-3000:]
    finally:
        for proc in (pre, watcher):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert json.loads(stdout.decode().strip().splitlines()[-1]) == {"evaluated": [4, 8, 10]}
    assert "global_step6 was pruned by the run before it was evaluated: skipped" in (
        stderr.decode()
    )

    state, _ = ckpt.read_state(str(folder), "global_step10", 0)
    scores = _history(uri, state.mlflow_run_id, "downstream/words/average")
    assert [step for step, _ in scores] == [4, 8, 10]
    assert all(0 <= value <= 1 for _, value in scores)
    assert [s for s, _ in _history(uri, state.mlflow_run_id, "downstream/words/has-the")] == [
        4,
        8,
        10,
    ]
    alone_state, _ = ckpt.read_state(alone.checkpoint_dir, "global_step10", 0)
    losses = _history(uri, state.mlflow_run_id, "train/loss")
    assert losses == _history(uri, alone_state.mlflow_run_id, "train/loss")  # bit for bit
    assert len(losses) == 10

    # the same command again: everything was done, nothing runs
    again = run_cli(watch, env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout.strip().splitlines()[-1]) == {"evaluated": [4, 8, 10]}
    assert "trials finished before" not in again.stderr  # no suite was opened again


def test_every_kth_checkpoint_is_due() -> None:
    from bertpipe.finetuning.evaluation.watch import due

    listed = [f"global_step{s}" for s in (2, 4, 6, 8, 10)]
    assert due(listed, 1, {}) == listed
    assert due(listed, 2, {}) == ["global_step4", "global_step8"]
    assert due(listed, 2, {"global_step4": {"step": 4}}) == ["global_step8"]
    assert due(listed, 3, {}) == ["global_step6"]
