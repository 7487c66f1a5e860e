"""Crashes that lose no more than the work since the last checkpoint, injected into real runs:
a process killed in the middle of writing a checkpoint and a full disk during a save. Each
time ``latest`` still names the last complete checkpoint and the same command, run again,
continues from it bit for bit. Multi-rank: 2 ranks x 2 loader workers killed in the middle of
saving to object storage (``tests/storage/test_s3_checkpoints.py``); a rank of 2 lost in
the middle of a phase (``tests/training/test_peers.py``)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bertpipe.config import to_yaml
from bertpipe.training import checkpoint as ckpt
from tests.cli_runner import run_cli
from tests.conftest import sqlite_uri
from tests.faultenv import FAULT_IN_SAVE
from tests.training.test_pretrain import _cfg, _env, _history

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _setup(shards: Path, out: Path) -> tuple[Path, str]:
    out.mkdir(parents=True, exist_ok=True)
    uri = sqlite_uri(out / "mlflow.db")
    cfg = _cfg(
        shards, out / "run", uri, steps=12, checkpoint__every_steps=4, checkpoint__keep_last=5
    )
    path = out / "cfg.yaml"
    path.write_text(to_yaml(cfg))
    return path, uri


def _run(cmd: list[str], fault: str | None = None) -> subprocess.CompletedProcess[str]:
    """``cmd`` in a process of its own: the fault kills it."""
    env = _env()
    if fault:
        env[FAULT_IN_SAVE] = fault
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _run_here(cmd: list[str], fault: str | None = None) -> subprocess.CompletedProcess[str]:
    """``cmd`` (``python -m bertpipe.app.cli ARGS``) in this process: a run that ends by
    itself (an error, or done) needs no interpreter start-up of its own."""
    env = _env()
    if fault:
        env[FAULT_IN_SAVE] = fault
    return run_cli(cmd[3:], env)


def _losses_twice_equal(uri: str, folder: Path, first_logged: int, last_step: int = 12) -> None:
    """Steps logged before the crash and again after the resume have the same loss."""
    state, _ = ckpt.read_state(str(folder), f"global_step{last_step}", 0)
    history = _history(uri, state.mlflow_run_id, "train/loss")
    steps = [s for s, _ in history]
    assert sorted(set(steps)) == list(range(1, last_step + 1)), steps
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
    again = _run_here(cmd)
    assert again.returncode == 0, again.stderr[-2000:]
    assert ckpt.latest_tag(str(folder)) == "global_step12"
    _losses_twice_equal(uri, folder, first_logged=4)  # steps 5-8 ran twice


def test_disk_full_during_a_save(pretrain_shards: Path, tmp_path: Path) -> None:
    cfg, uri = _setup(pretrain_shards, tmp_path)
    cmd = [sys.executable, "-m", "bertpipe.app.cli", "pretrain", "--config", str(cfg),
           "only_phase=phase1"]  # fmt: skip
    full = _run_here(cmd, fault="enospc:global_step8")
    assert full.returncode != 0
    assert "No space left on device" in full.stderr
    folder = tmp_path / "run" / "checkpoints"
    assert ckpt.latest_tag(str(folder)) == "global_step4"
    state, _ = ckpt.read_state(str(folder), "global_step4", 0)
    assert state.global_step == 4  # the last complete checkpoint is intact
    again = _run_here(cmd)  # space freed: the same command continues
    assert again.returncode == 0, again.stderr[-2000:]
    _losses_twice_equal(uri, folder, first_logged=4)
