"""A suite's trials in worker processes when a SIGTERM or a lost worker ends the suite
(:mod:`bertpipe.finetuning.evaluation.pool`), on stand-in trials
(``tests/finetuning/trial_pool_scenario.py``) at the moments the whole-suite test
(``test_evaluate.py``) meets only by chance: a worker between trials, a SIGTERM to the
suite's process alone, a worker killed. Every way, the suite ends (the process group empties)
with its exit status and one line, a trial in progress saves its checkpoint first, and no
trial starts after the signal.

CI once hung here: a worker between trials died of the SIGTERM, ``concurrent.futures`` then
waited for the other worker, which had saved its stopped trial and waited for its next trial
for ever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bertpipe.training.core.cadence import SigtermLatch, StopFlag

BOUND_S = 90.0
"""Time for a scenario's three interpreters to start (torch each, slow on a loaded CI) and
for the suite to end after its signal."""


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Suite:
    """``trial_pool_scenario FOLDER KIND...`` in a session of its own."""

    def __init__(self, folder: Path, kinds: list[str]) -> None:
        self.folder = folder
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.finetuning.trial_pool_scenario", str(folder), *kinds],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            # as in a terminal, where Ctrl-C reaches a foreground command: pytest started in
            # the background of a script (`pytest &`, nohup) passes SIGINT on ignored
            preexec_fn=_sigint_default,
        )

    def wait_for(self, *markers: str) -> None:
        deadline = time.monotonic() + BOUND_S
        while not all((self.folder / m).exists() for m in markers):
            assert self.proc.poll() is None, self.proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, f"no {markers} in {BOUND_S:.0f} s"
            time.sleep(0.05)

    def pid_of(self, trial: int) -> int:
        return int((self.folder / f"{trial}.started").read_text())

    def ended(self) -> tuple[int, str]:
        """Exit status and stderr; the whole process group must be gone with it."""
        try:
            _, stderr = self.proc.communicate(timeout=BOUND_S)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.communicate()
        deadline = time.monotonic() + 10
        while _group_alive(self.proc.pid):
            if time.monotonic() > deadline:
                os.killpg(self.proc.pid, signal.SIGKILL)
                pytest.fail("a worker outlived the suite")
            time.sleep(0.05)
        return self.proc.returncode, stderr


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _started(folder: Path) -> set[int]:
    return {int(p.name.split(".")[0]) for p in folder.glob("*.started")}


def test_a_sigterm_while_a_worker_is_between_trials_ends_the_suite(tmp_path: Path) -> None:
    """One worker trains, the other has finished its trial and waits: SIGTERM to the group
    (as a scheduler sends it). The training trial saves, the suite exits 143."""
    suite = Suite(tmp_path, ["long", "quick"])
    suite.wait_for("0.started", "1.finished")
    time.sleep(0.5)  # the quick trial's worker back in the pool, waiting
    os.killpg(suite.proc.pid, signal.SIGTERM)
    status, stderr = suite.ended()
    assert status == 143, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "bertpipe: terminated (SIGTERM)", stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert (tmp_path / "0.checkpoint").exists()


def test_a_sigterm_to_the_suites_process_alone_stops_its_trials(tmp_path: Path) -> None:
    """Both workers train and a third trial waits in the pool's queue: SIGTERM to the suite's
    process only (``kill PID``). Both trials save; the queued one never starts."""
    suite = Suite(tmp_path, ["long", "long", "quick", "quick"])
    suite.wait_for("0.started", "1.started")
    os.kill(suite.proc.pid, signal.SIGTERM)
    status, stderr = suite.ended()
    assert status == 143, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert (tmp_path / "0.checkpoint").exists() and (tmp_path / "1.checkpoint").exists()
    assert _started(tmp_path) == {0, 1}


def test_ctrl_c_stops_the_trials_with_their_checkpoints(tmp_path: Path) -> None:
    """Ctrl-C in a terminal (SIGINT to the foreground group): the workers ignore it, the suite
    passes a SIGTERM on, the training trial saves, exit 130 with one line, no traceback."""
    suite = Suite(tmp_path, ["long", "quick", "quick"])
    suite.wait_for("0.started", "1.finished", "2.finished")
    os.killpg(suite.proc.pid, signal.SIGINT)
    status, stderr = suite.ended()
    assert status == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "bertpipe: interrupted", stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert (tmp_path / "0.checkpoint").exists()


def test_a_killed_worker_fails_the_suite_with_one_line_after_the_other_saves(
    tmp_path: Path,
) -> None:
    """Both workers train; one is SIGKILLed (the OOM killer): exit 75 with one line, the
    other trial saved its checkpoint, no trial started after."""
    suite = Suite(tmp_path, ["long", "long", "quick"])
    suite.wait_for("0.started", "1.started")
    os.kill(suite.pid_of(1), signal.SIGKILL)
    status, stderr = suite.ended()
    assert status == 75, stderr[-3000:]
    line = stderr.strip().splitlines()[-1]
    assert line.startswith("bertpipe: error: evaluate: a trial worker process ended"), line
    assert "run the same command again" in line, line
    assert "Traceback" not in stderr, stderr[-3000:]
    assert (tmp_path / "0.checkpoint").exists()
    assert _started(tmp_path) == {0, 1}


@pytest.fixture
def latch() -> Iterator[SigtermLatch]:
    """A trial worker's SIGTERM handler, in this process for the test."""
    made = SigtermLatch()
    previous = signal.signal(signal.SIGTERM, made)
    try:
        yield made
    finally:
        signal.signal(signal.SIGTERM, previous)


def _sigterm_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # the handler runs in the main thread, between two bytecodes


def test_a_sigterm_while_a_trial_starts_reaches_its_stop_flag(latch: SigtermLatch) -> None:
    """A SIGTERM before the trial's own handler is in place (loading its data, opening its
    MLflow run) is not lost: the trial stops at its first check."""
    _sigterm_self()
    assert latch.received
    with StopFlag() as stop:
        assert stop.requested
    assert signal.getsignal(signal.SIGTERM) is latch


def test_a_sigterm_during_a_trial_is_handed_back_to_the_worker(latch: SigtermLatch) -> None:
    """A SIGTERM the trial's handler took (the trial stopped, or had passed its last check)
    still ends the worker after the trial."""
    with StopFlag() as stop:
        assert not stop.requested
        _sigterm_self()
        assert stop.requested and not latch.received
    assert latch.received
