"""``bertpipe bench recipes`` at sizes it cannot run: refused in one line before any work;
short runs are timed from two logged losses, never divided by a step time of 0 s."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bertpipe.app.bench.recipes import MIN_DOCUMENTS, log_every, step_seconds
from tests.cli_runner import run_cli


def test_too_few_documents_or_steps_fail_in_one_line_before_any_work(tmp_path: Path) -> None:
    """``--documents 60`` held out no document and failed after 106 s of work (its first
    pre-training run); ``--steps 1`` cannot be timed. Now: exit 2 at once, nothing made."""
    out = tmp_path / "bench"
    started = time.perf_counter()
    done = run_cli(["bench", "recipes", "--documents", "60", "--steps", "10", "--out", str(out)])
    seconds = time.perf_counter() - started
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"bertpipe: error: bench recipes: --documents 60 is too few: at least {MIN_DOCUMENTS} "
        "(or all, the default), so that the 2% held out give each recipe a batch of held-out "
        "instances (nothing was run)"
    ]
    assert seconds < 1.0 and not out.exists()
    both = run_cli(["bench", "recipes", "--documents", "399", "--steps", "1", "--out", str(out)])
    assert both.returncode == 2 and len(both.stderr.splitlines()) == 1
    assert "--documents 399 is too few" in both.stderr
    assert "--steps 1 is too few: at least 2 (a step time needs two)" in both.stderr
    assert not out.exists()


@pytest.mark.parametrize("steps", [*range(2, 41), 99, 100, 1600])
def test_every_run_of_two_steps_or_more_logs_twice_and_gets_a_step_time(steps: int) -> None:
    """The trainer logs the loss every ``log_every_steps`` and at the last step
    (``training/core/cadence.py``): ``--steps 10`` with the fixed 10 logged once, timed 0 s per
    step, and the bench ended in a ZeroDivisionError."""
    every = log_every(steps)
    logged = [s for s in range(1, steps + 1) if s % every == 0 or s == steps]
    assert len(logged) >= 2
    assert every == 10 or steps < 200  # the long runs log as before
    history = [(s, 1_000_000 + 250 * s) for s in logged]  # 0.25 s per step
    assert step_seconds(history, "run") == pytest.approx(0.25)


def test_a_run_logged_once_is_an_error_that_says_so() -> None:
    with pytest.raises(RuntimeError, match=r"cannot time its steps from 1 logged loss"):
        step_seconds([(10, 1_000_000)], "runs/x")
