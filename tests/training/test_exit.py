"""A process never hangs at exit on its loader workers (issue 14, "No exit hang").

The workers ignore SIGTERM (so that a preempted trainer can save first), and multiprocessing's
exit hook terminates children with SIGTERM and then joins them without a timeout: a process
whose workers were still alive at exit reached its exit status and waited forever. Here, real
processes: ``bertpipe pretrain`` failing in a 2-worker loader (a checksum error: 2, storage that
stays unreadable: 75), a plain script that raises with a live 2-worker iterator, and workers
whose parent is SIGKILLed. Every child runs in its own session and is killed at the end.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bertpipe.errors import TransientError
from bertpipe.training.pretrain.data.loader import PretrainingData
from bertpipe.training.pretrain.data.manifest import DataError
from tests.training.test_data import UNEVEN, write_phase
from tests.training.test_data_integrity import add_checksums
from tests.training.test_pretrain import _env

EXIT_WITHIN = 10.0
"""Seconds from the error (its line, or the raise) to the end of the process."""


class Child:
    """A subprocess in its own session whose stderr lines are collected by a thread, so that
    a test can wait for a line with a timeout; :meth:`kill` ends the whole session."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: list[tuple[float, str]] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._changed.notify_all()

    @property
    def stderr(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, text: str, count: int = 1, timeout: float = 300) -> float:
        """When the ``count``-th line holding ``text`` was read (fails after ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                seen = [t for t, line in self.lines if text in line]
                if len(seen) >= count:
                    return seen[count - 1]
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    pytest.fail(f"no {text!r} line in time; stderr:\n{self.stderr[-3000:]}")
                self._changed.wait(min(left, 0.5))

    def exit_status_within(self, seconds: float, since: float) -> int:
        """The exit status, which must come within ``seconds`` of ``since``."""
        try:
            status = self.proc.wait(timeout=max(0.0, since + seconds - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"still running {seconds:.0f} s after the error (the exit hang); "
                f"stderr:\n{self.stderr[-3000:]}"
            )
        waited = time.monotonic() - since
        assert waited < seconds, f"exited {waited:.1f} s after the error"
        self._reader.join(timeout=10)
        return status

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    """Children a test starts; their sessions are killed at its end, whatever happened."""
    started: list[Child] = []
    yield started
    for child in started:
        child.kill()


def _session_gone(child: Child, timeout: float = 5.0) -> bool:
    """Whether no process (the loader workers included) is left in the child's session."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not [pid for pid in _pids() if _sid(pid) == child.proc.pid and _running(pid)]:
            return True
        time.sleep(0.1)
    return False


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw.rsplit(")", 1)[1].split()


def _sid(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[3]) if fields else None


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever reaps orphans here)."""
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _children_of(pid: int) -> list[int]:
    return [p for p in _pids() if (f := _stat(p)) is not None and int(f[1]) == pid]


# ---------------------------------------------------------------- bertpipe pretrain


def _pretrain(child_data: Path, out: Path, *extra: str) -> list[str]:
    """A tiny fp32 run of 4 steps on ``child_data`` with 2 loader workers, no tracking."""
    return [
        sys.executable,
        "-m",
        "bertpipe.app.cli",
        "pretrain",
        f"output={out}",
        "model.preset=tiny",
        "model.max_position_embeddings=128",
        f"phases=[{{name: phase1, data: {child_data}, max_steps: 4, micro_batch_size: 8,"
        " global_batch_size: 16}]",
        "precision=fp32",
        "zero.stage=0",
        "data.num_workers=2",
        "data.verify_checksums=true",
        "tracking.enabled=false",
        *extra,
    ]


def _flip_bytes(path: Path) -> None:
    """Flip 4 bytes inside the shard's first member (its header is the first 512 bytes): the
    checksum, verified before the shard is read, tells."""
    raw = bytearray(path.read_bytes())
    for i in range(812, 816):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def _unreadable(path: Path) -> None:
    """The shard becomes a folder: every read fails with an OSError (transient) for good."""
    path.unlink()
    path.mkdir()


@pytest.mark.integration
@pytest.mark.parametrize(
    ("fault", "status", "says"),
    [
        ("checksum", 2, "train-00002.tar has sha256"),
        ("storage", 75, "still failing after 2 attempt(s)"),
    ],
)
def test_pretrain_error_in_a_worker_exits_with_its_status_within_10s(
    pretrain_shards: Path,
    tmp_path: Path,
    children: list[Child],
    fault: str,
    status: int,
    says: str,
) -> None:
    data = tmp_path / "seq64"
    shutil.copytree(pretrain_shards / "seq64", data)
    shard = data / "train-00002.tar"
    if fault == "checksum":
        _flip_bytes(shard)
    else:
        _unreadable(shard)
    cmd = _pretrain(data, tmp_path / "run", "data.read_retries=1", "data.read_retry_delay=0.05")
    child = Child(cmd, {**_env(), "OMP_NUM_THREADS": "1"})
    children.append(child)
    error_at = child.wait_for("bertpipe: error:")
    assert child.exit_status_within(EXIT_WITHIN, since=error_at) == status, child.stderr[-3000:]
    errors = [line for _, line in child.lines if line.startswith("bertpipe: error:")]
    assert len(errors) == 1 and says in errors[0] and str(shard) in errors[0], child.stderr
    assert "Traceback" not in child.stderr and "Caught " not in child.stderr
    assert _session_gone(child), "a loader worker outlived the trainer"


# ---------------------------------------------------------------- a plain script

_RAISES = """
import multiprocessing, sys
from bertpipe.training.pretrain.data.loader import PretrainingData

def first_batch_then_raise():
    batches = iter(PretrainingData(sys.argv[1], micro_batch_size=3, num_workers=2))
    next(batches)
    pids = [str(p.pid) for p in multiprocessing.active_children()]
    print("workers", *pids, file=sys.stderr, flush=True)
    if sys.argv[2] == "global":
        globals()["kept"] = batches  # alive until after the exit hooks
    raise RuntimeError("raised with a live 2-worker iterator")

first_batch_then_raise()  # uncaught: its traceback (sys.last_exc) holds the iterator
"""


@pytest.mark.parametrize("held_by", ["traceback", "global"])
def test_script_raising_with_a_live_2_worker_iterator_exits_within_10s(
    tmp_path: Path, children: list[Child], held_by: str
) -> None:
    folder = tmp_path / "phase"
    write_phase(str(folder), UNEVEN)
    script = tmp_path / "raises.py"
    script.write_text(_RAISES)
    child = Child([sys.executable, str(script), str(folder), held_by], _env())
    children.append(child)
    raised_at = child.wait_for("workers ", timeout=120)
    assert child.exit_status_within(EXIT_WITHIN, since=raised_at) == 1, child.stderr
    assert "RuntimeError: raised with a live 2-worker iterator" in child.stderr
    workers = [int(p) for p in child.stderr.split("workers ", 1)[1].splitlines()[0].split()]
    assert len(workers) == 2
    assert _session_gone(child), "a loader worker outlived its process"
    assert "killing it" not in child.stderr  # idle workers stop when asked


def test_workers_die_with_their_parent(tmp_path: Path, children: list[Child]) -> None:
    """Both workers are in a 60 s retry backoff (every shard unreadable), where torch's check
    of the parent between batches never runs: the parent-death signal kills them at once."""
    folder = tmp_path / "phase"
    write_phase(str(folder), UNEVEN)
    for shard in folder.glob("train-*.tar"):
        _unreadable(shard)
    script = tmp_path / "waits.py"
    script.write_text(
        "import sys\n"
        "from bertpipe.training.pretrain.data.loader import PretrainingData\n"
        "data = PretrainingData(sys.argv[1], micro_batch_size=3, num_workers=2,\n"
        "                       read_retries=1, read_retry_delay=60, verify_checksums=False)\n"
        "next(iter(data))\n"
    )
    child = Child([sys.executable, str(script), str(folder)], _env())
    children.append(child)
    child.wait_for("retrying in", count=2, timeout=120)  # both workers are in the backoff
    workers = _children_of(child.proc.pid)
    assert len(workers) == 2, child.stderr
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.wait(timeout=10)
    deadline = time.monotonic() + 5
    while any(_running(pid) for pid in workers):
        assert time.monotonic() < deadline, "loader workers outlived their parent"
        time.sleep(0.1)


# ---------------------------------------------------------------- in this process


@pytest.mark.parametrize("fault", ["checksum", "storage"])
def test_worker_error_arrives_as_its_type_with_the_workers_already_stopped(
    tmp_path: Path, fault: str
) -> None:
    """The error reaches the caller as the worker raised it (one line; TransientError keeps
    exit status 75), chained to nothing that holds torch's iterator, and the workers were
    stopped before it left the loader (not whenever the garbage collector gets to it)."""
    folder = tmp_path / "phase"
    write_phase(str(folder), UNEVEN)
    add_checksums(folder)
    shard = folder / "train-00001.tar"
    if fault == "checksum":
        _flip_bytes(shard)
    else:
        _unreadable(shard)
    before = {p.pid for p in multiprocessing.active_children()}
    data = PretrainingData(
        str(folder), micro_batch_size=3, num_workers=2, read_retries=1, read_retry_delay=0.05
    )
    expected = DataError if fault == "checksum" else TransientError
    with pytest.raises(expected) as err:
        for _ in data:
            pass
    assert type(err.value) is expected and "\n" not in str(err.value)
    assert str(shard) in str(err.value)
    assert getattr(err.value, "exit_code", 2) == (75 if fault == "storage" else 2)
    assert err.value.__context__ is None and err.value.__cause__ is None
    assert {p.pid for p in multiprocessing.active_children()} <= before
