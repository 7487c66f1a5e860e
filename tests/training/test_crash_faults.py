"""Crashes that lose no more than the work since the last checkpoint, injected into real runs:
a process killed in the middle of writing a checkpoint and a full disk during a save. Each
time ``latest`` still names the last complete checkpoint and the same command, run again,
continues from it bit for bit. Multi-rank: 2 ranks x 2 loader workers killed in the middle of
saving to object storage (``tests/storage/test_s3_checkpoints.py``); a rank of 2 lost in
the middle of a phase (``tests/training/test_peers.py``)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def _small_disk(path: Path, size_mb: int) -> Iterator[Callable[[int], None]]:
    """A tmpfs of ``size_mb`` MB at ``path`` (root's ``mount``; the test is skipped where it
    cannot be made); yields a function that resizes it."""
    path.mkdir(parents=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)]
    made = subprocess.run(mount, capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.strip()}")

    def resize(mb: int) -> None:
        remount = ["mount", "-o", f"remount,size={mb}m", str(path)]
        subprocess.run(remount, check=True)

    try:
        yield resize
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


CHECKPOINT_MB = 8.0
"""A checkpoint of the tiny model of ``_setup`` (its files in ``global_step4``)."""


def test_disk_full_during_a_save(pretrain_shards: Path, tmp_path: Path) -> None:
    """Checkpoints on a real small file system (tmpfs). Too small for the first one:
    torch's writer fails in the middle (its own RuntimeError, no errno), reported as one
    line naming the folder, the space free and exit 74. Room for one: the second one is
    refused before a byte is written (its size is the first's). Space freed: the same
    command resumes from the first bit for bit."""
    cfg, uri = _setup(pretrain_shards, tmp_path)
    disk = tmp_path / "disk"
    folder = disk / "checkpoints"
    cmd = [sys.executable, "-m", "bertpipe.app.cli", "pretrain", "--config", str(cfg),
           "only_phase=phase1", f"checkpoint.dir={folder}"]  # fmt: skip
    with _small_disk(disk, int(CHECKPOINT_MB // 2)) as resize:
        full = _run_here(cmd)
        lines = [line for line in full.stderr.splitlines() if line.startswith("bertpipe: error:")]
        assert full.returncode == 74 and len(lines) == 1, full.stderr[-3000:]
        assert f"checkpoint global_step4 does not fit in {folder}" in lines[0]
        assert "no space left on device" in lines[0] and "free of 4.0 MB" in lines[0]
        assert not (folder / "global_step4").exists()  # its partial files removed

        resize(int(CHECKPOINT_MB * 1.6))
        full = _run_here(cmd)
        lines = [line for line in full.stderr.splitlines() if line.startswith("bertpipe: error:")]
        assert full.returncode == 74 and len(lines) == 1, full.stderr[-3000:]
        assert f"checkpoint global_step8 does not fit in {folder}: needs about" in lines[0]
        assert "it resumes from global_step4" in lines[0]
        assert ckpt.latest_tag(str(folder)) == "global_step4"
        assert not (folder / "global_step8").exists()  # refused before writing
        state, _ = ckpt.read_state(str(folder), "global_step4", 0)
        assert state.global_step == 4  # the last complete checkpoint is intact

        resize(64)  # space freed: the same command continues
        again = _run_here(cmd)
        assert again.returncode == 0, again.stderr[-2000:]
        _losses_twice_equal(uri, folder, first_logged=4)
