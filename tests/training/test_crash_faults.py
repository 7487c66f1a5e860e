"""Crashes that lose no more than the work since the last checkpoint, injected into real runs:
a process killed in the middle of writing a checkpoint, a full disk during a save, and
SIGKILL to every rank of a 2-rank run. Each time ``latest`` still names the last complete
checkpoint and the same command, run again, continues from it bit for bit. (2 ranks x 2
loader workers killed in the middle of saving to object storage:
``tests/storage/test_s3_checkpoints.py``.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bertpipe.config import to_yaml
from bertpipe.training import checkpoint as ckpt
from tests.training.test_pretrain import _cfg, _env, _history

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _setup(shards: Path, out: Path) -> tuple[Path, str]:
    out.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{out / 'mlflow.db'}"
    cfg = _cfg(
        shards, out / "run", uri, steps=12, checkpoint__every_steps=4, checkpoint__keep_last=5
    )
    path = out / "cfg.yaml"
    path.write_text(to_yaml(cfg))
    return path, uri


def _run(cmd: list[str], fault: str | None = None) -> subprocess.CompletedProcess[str]:
    env = _env()
    if fault:
        env[ckpt.FAULT_IN_SAVE] = fault
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _losses_twice_equal(uri: str, folder: Path, first_logged: int) -> None:
    """Steps logged before the crash and again after the resume have the same loss."""
    state, _ = ckpt.read_state(str(folder), "global_step12", 0)
    history = _history(uri, state.mlflow_run_id, "train/loss")
    steps = [s for s, _ in history]
    assert sorted(set(steps)) == list(range(1, 13)), steps
    by_step: dict[int, list[float]] = {}
    for step, value in history:
        by_step.setdefault(step, []).append(value)
    repeated = {s: v for s, v in by_step.items() if len(v) > 1}
    assert len(repeated) >= first_logged, repeated  # the resumed steps were really re-run
    assert all(len(set(v)) == 1 for v in repeated.values()), repeated


def test_killed_while_writing_a_checkpoint(pretrain_shards: Path, tmp_path: Path) -> None:
    cfg, uri = _setup(pretrain_shards, tmp_path)
    cmd = [sys.executable, "-m", "bertpipe.app.cli", "pretrain", "--config", str(cfg),
           "only_phase=phase1"]  # fmt: skip
    crashed = _run(cmd, fault="kill:global_step8")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    folder = tmp_path / "run" / "checkpoints"
    assert ckpt.latest_tag(str(folder)) == "global_step4"  # the half-written one is not latest
    assert (folder / "global_step8").exists()  # DeepSpeed's files of it are there
    again = _run(cmd)
    assert again.returncode == 0, again.stderr[-2000:]
    assert ckpt.latest_tag(str(folder)) == "global_step12"
    _losses_twice_equal(uri, folder, first_logged=4)  # steps 5-8 ran twice


def test_disk_full_during_a_save(pretrain_shards: Path, tmp_path: Path) -> None:
    cfg, uri = _setup(pretrain_shards, tmp_path)
    cmd = [sys.executable, "-m", "bertpipe.app.cli", "pretrain", "--config", str(cfg),
           "only_phase=phase1"]  # fmt: skip
    full = _run(cmd, fault="enospc:global_step8")
    assert full.returncode != 0
    assert "No space left on device" in full.stderr
    folder = tmp_path / "run" / "checkpoints"
    assert ckpt.latest_tag(str(folder)) == "global_step4"
    state, _ = ckpt.read_state(str(folder), "global_step4", 0)
    assert state.global_step == 4  # the last complete checkpoint is intact
    again = _run(cmd)  # space freed: the same command continues
    assert again.returncode == 0, again.stderr[-2000:]
    _losses_twice_equal(uri, folder, first_logged=4)


def test_sigkill_to_both_ranks_mid_phase(pretrain_shards: Path, tmp_path: Path) -> None:
    cfg, uri = _setup(pretrain_shards, tmp_path)
    deepspeed = str(Path(sys.executable).parent / "deepspeed")
    bertpipe = str(Path(sys.executable).parent / "bertpipe")
    cmd = [deepspeed, "--num_gpus", "2", "--master_port", "29651", bertpipe, "pretrain",
           "--config", str(cfg), "only_phase=phase1", "zero.stage=1"]  # fmt: skip
    folder = tmp_path / "run" / "checkpoints"
    log = (tmp_path / "log").open("wb")
    proc = subprocess.Popen(
        cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 300
    while ckpt.latest_tag(str(folder)) != "global_step4":
        assert proc.poll() is None, (tmp_path / "log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, no time to save
    proc.wait(timeout=60)
    assert ckpt.latest_tag(str(folder)) == "global_step4"
    again = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:]
    state, _ = ckpt.read_state(str(folder), "global_step12", 0)
    assert state.world_size == 2
    _losses_twice_equal(uri, folder, first_logged=0)
