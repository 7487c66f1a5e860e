"""Crashes that lose no more than the work since the last checkpoint, injected into real runs:
a process killed in the middle of writing a checkpoint, a checkpoint damaged on disk after
it was saved (a truncated file, a changed byte), a full disk (bytes, inodes) during a save.
Each time the same command, run again, continues from the newest whole checkpoint bit for
bit. Multi-rank: 2 ranks x 2 loader workers killed in the middle of
saving to object storage (``tests/storage/test_s3_checkpoints.py``); a rank of 2 lost in
the middle of a phase (``tests/training/test_peers.py``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

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


@pytest.fixture(scope="module")
def killed_run(pretrain_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A run killed in the middle of saving ``global_step8``, then run again to its end
    (``global_step4``, ``8`` and ``12`` kept): what the kill left, for
    :func:`test_killed_while_writing_a_checkpoint`, and the finished folder, which
    :func:`test_damaged_checkpoints_fall_back` damages afterwards (MLflow only gains
    repeated steps of equal loss from it)."""
    out = tmp_path_factory.mktemp("killed")
    cfg, uri = _setup(pretrain_shards, out)
    cmd = [sys.executable, "-m", "bertpipe.app.cli", "pretrain", "--config", str(cfg),
           "only_phase=phase1"]  # fmt: skip
    folder = out / "run" / "checkpoints"
    crashed = _run(cmd, fault="kill:global_step8")
    left = SimpleNamespace(
        latest=ckpt.latest_tag(str(folder)), partial=(folder / "global_step8").exists()
    )
    again = _run_here(cmd)
    return SimpleNamespace(cmd=cmd, uri=uri, folder=folder, crashed=crashed, left=left, again=again)


def test_killed_while_writing_a_checkpoint(killed_run: SimpleNamespace) -> None:
    crashed, again, folder = killed_run.crashed, killed_run.again, killed_run.folder
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    assert killed_run.left.latest == "global_step4"  # the half-written one is not latest
    assert killed_run.left.partial  # DeepSpeed's files of it were there
    assert again.returncode == 0, again.stderr[-2000:]
    assert "global_step12" in ckpt.tags(str(folder))
    _losses_twice_equal(killed_run.uri, folder, first_logged=4)  # steps 5-8 ran twice


def _truncate(path: Path) -> None:
    """Cut ``path`` to half its size on disk (a copy or a write that stopped half-way)."""
    os.truncate(path, path.stat().st_size // 2)


def _one_line(stderr: str, text: str) -> str:
    lines = [line for line in stderr.splitlines() if text in line]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def test_damaged_checkpoints_fall_back(
    killed_run: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    """The finished run's newest checkpoint damaged on disk, then the same command again:
    its model states truncated, later its rank 0 completion marker truncated. Each time
    the run resumes from ``global_step8`` with one line naming the damaged file, and the
    steps it runs again have the losses the uninterrupted run had. A changed byte (same
    size) is caught by the file's CRC-32. A checkpoint whose markers list no files (saved
    by an older bertpipe) is still taken. Every checkpoint damaged: one line, exit 2,
    nothing trained or written."""
    cmd, uri, folder = killed_run.cmd, killed_run.uri, killed_run.folder
    assert killed_run.again.returncode == 0
    newest = folder / "global_step12"
    for damaged in ("mp_rank_00_model_states.pt", "bertpipe_rank00000.json"):
        _truncate(newest / damaged)
        again = _run_here(cmd)
        assert again.returncode == 0, again.stderr[-3000:]
        line = _one_line(again.stderr, "incomplete or damaged")
        assert "checkpoint global_step12 in" in line and damaged in line, line
        assert "resuming from global_step8, the newest whole checkpoint" in line, line
        assert ckpt.latest_tag(str(folder)) == "global_step12"  # saved again, whole
        _losses_twice_equal(uri, folder, first_logged=4)  # 9-12 again, equal
    assert "Traceback" not in again.stderr

    (optimizer,) = newest.glob("*optim_states.pt")
    data = bytearray(optimizer.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte changed, the size the same
    optimizer.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert ckpt.resume_tag(str(folder), "auto") == "global_step8"
    assert f"{optimizer.name} has another CRC-32" in caplog.text
    # an export takes what a resume takes: the newest whole checkpoint, with one line
    out = folder.parent / "export-of-damaged"
    exported = run_cli(["export", str(folder), str(out), "--no-tracking"])
    assert exported.returncode == 0, exported.stderr[-3000:]
    line = _one_line(exported.stderr, "incomplete or damaged")
    assert "global_step12" in line and optimizer.name in line, line
    assert "reading global_step8, the newest whole checkpoint" in line, line
    assert json.loads((out / "bertpipe_export.json").read_text())["checkpoint"].endswith(
        "global_step8"
    )
    named = run_cli(["export", str(folder), str(out) + "-named", "--tag", "global_step12"])
    assert named.returncode == 2 and "Traceback" not in named.stderr, named.stderr[-3000:]
    assert "checkpoint global_step12 in" in _one_line(named.stderr, "bertpipe: error:")

    # a checkpoint of an older bertpipe (markers without file lists) is still taken, its
    # files checked for presence only
    marker = folder / "global_step8" / "bertpipe_rank00000.json"
    old = {k: v for k, v in json.loads(marker.read_text()).items() if k != "files"}
    marker.write_text(json.dumps(old))
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert ckpt.resume_tag(str(folder), "auto") == "global_step8"
    assert "global_step8 was saved without file sizes" in caplog.text

    marker.unlink()  # global_step8 incomplete, global_step4 truncated: none is whole
    _truncate(folder / "global_step4" / "mp_rank_00_model_states.pt")
    written = {p: p.stat().st_mtime_ns for p in folder.rglob("*")}
    refused = _run_here(cmd)
    line = _one_line(refused.stderr, "bertpipe: error:")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"{folder} has no whole checkpoint to resume from" in line, line
    for tag in ("global_step12", "global_step8", "global_step4"):
        assert tag in line, line
    assert "Traceback" not in refused.stderr
    assert {p: p.stat().st_mtime_ns for p in folder.rglob("*")} == written
    none = run_cli(["export", str(folder), str(folder.parent / "export-of-none"), "--no-tracking"])
    assert none.returncode == 2 and "Traceback" not in none.stderr, none.stderr[-3000:]
    assert "has no whole checkpoint" in _one_line(none.stderr, "bertpipe: error:")


@contextlib.contextmanager
def _small_disk(path: Path, size_mb: int, inodes: int = 100_000) -> Iterator[Callable[..., None]]:
    """A tmpfs of ``size_mb`` MB and ``inodes`` inodes (files and folders, its root
    included) at ``path`` (root's ``mount``; the test is skipped where it cannot be made);
    yields a function that resizes it: ``resize(mb, inodes=...)``."""
    path.mkdir(parents=True)
    options = f"size={size_mb}m,nr_inodes={inodes}"
    mount = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]
    made = subprocess.run(mount, capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.strip()}")

    def resize(mb: int, inodes: int = 100_000) -> None:
        remount = ["mount", "-o", f"remount,size={mb}m,nr_inodes={inodes}", str(path)]
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
    line naming the folder, the space free and exit 74. Bytes free but out of inodes in
    the middle of the first one (torch cannot open its next file): the same, naming the
    inodes, its partial folder removed. Room for one: the second one is refused before a
    byte is written (its size is the first's). Space freed: the same command resumes from
    the first bit for bit."""
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

        # bytes to spare, 4 inodes: the root, checkpoints/, global_step4/ and the model
        # states; the optimizer's file cannot be created
        resize(64, inodes=4)
        full = _run_here(cmd)
        lines = [line for line in full.stderr.splitlines() if line.startswith("bertpipe: error:")]
        assert full.returncode == 74 and len(lines) == 1, full.stderr[-3000:]
        assert f"checkpoint global_step4 does not fit in {folder}" in lines[0], lines[0]
        assert "no inodes left on device (all 4 files and folders in use" in lines[0], lines[0]
        assert "Traceback" not in full.stderr
        assert list(folder.iterdir()) == []  # no partial global_step4/

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


def test_a_save_short_of_inodes_is_refused_before_writing(tmp_path: Path) -> None:
    """The check before a save counts inodes as well as bytes: a checkpoint of as many
    files as the last one, with fewer inodes free on its file system, is refused first."""
    from bertpipe.training.checkpoint import disk as disk_space

    disk = tmp_path / "disk"
    with _small_disk(disk, 8, inodes=12) as resize:
        last = disk / "global_step4"
        last.mkdir()
        for i in range(4):
            (last / f"part{i}").write_bytes(b"x" * 1000)
        need, inodes = disk_space.folder_bytes(last), disk_space.folder_inodes(last)
        assert (need, inodes) == (4000, 5)
        short = disk_space.shortfall(disk, need, "global_step8", "global_step4", inodes)
        assert short is not None, "12 inodes: 6 in use, 6 free, 7 needed"
        assert "needs 7 inodes (files and folders, as the last one), 6 free of 12" in short
        assert "it resumes from global_step4" in short
        resize(8, inodes=13)
        assert disk_space.shortfall(disk, need, "global_step8", "global_step4", inodes) is None


def test_a_quota_error_is_a_full_disk(tmp_path: Path) -> None:
    """``EDQUOT`` (the user's quota reached) ends a save like a full disk: one line saying
    so, the partial folder removed. No quota can be set here (this kernel has neither tmpfs
    quotas nor ext4's quota format), so the error is raised as the kernel reports it, into a
    real file system whose bytes and inodes are free."""
    import errno

    from bertpipe.errors import DiskFullError
    from bertpipe.training.checkpoint import disk as disk_space

    target = tmp_path / "global_step8"
    target.mkdir()
    (target / "mp_rank_00_model_states.pt").write_bytes(b"partial")
    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(target / "x.pt"))
    with (
        pytest.raises(DiskFullError) as full,
        disk_space.full_disk(tmp_path, target, "global_step4", need=4000),
    ):
        raise quota
    line = str(full.value)
    assert f"checkpoint global_step8 does not fit in {tmp_path}: disk quota exceeded" in line
    assert "it resumes from global_step4" in line
    assert not target.exists()
    with pytest.raises(ValueError), disk_space.full_disk(tmp_path, target, None):
        raise ValueError("not a full disk")  # other errors pass
