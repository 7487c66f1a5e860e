"""A suite's trial pool (:func:`bertpipe.finetuning.evaluation.pool.run_pool`) on stand-in
trials, as ``bertpipe evaluate`` runs it, for ``tests/finetuning/test_trial_pool.py``: ``python
-m tests.finetuning.trial_pool_scenario FOLDER KIND...`` runs one trial per KIND, two at a
time, and exits as the command line does (its exit_status: 143 on SIGTERM, 130 on Ctrl-C, 75
and one line for a lost worker).

A ``long`` trial trains (sleeps) under the real :class:`~bertpipe.training.core.cadence.
StopFlag` until a SIGTERM, then writes its checkpoint and stops with ``PreemptedError``, as a
fine-tuning trial does at its next step; a ``quick`` trial returns at once. Each writes
``<i>.started`` (its pid) when it starts and ``<i>.checkpoint`` or ``<i>.finished``, so the
test sees which worker holds what."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from bertpipe.app.cli import exit_status
from bertpipe.finetuning.evaluation.pool import run_pool
from bertpipe.tracking import terminated_raises
from bertpipe.training.core.cadence import PreemptedError, StopFlag

LONG_TRIAL_S = 120.0
"""A long trial that sees no SIGTERM in this time fails (the scenario never hangs)."""


def trial(step: dict[str, Any]) -> dict[str, Any]:
    folder, i = Path(step["folder"]), step["index"]
    (folder / f"{i}.started").write_text(str(os.getpid()))
    if step["kind"] == "quick":
        (folder / f"{i}.finished").touch()
        return {"index": i}
    with StopFlag() as stop:
        deadline = time.monotonic() + LONG_TRIAL_S
        while not stop.requested:
            if time.monotonic() > deadline:
                raise RuntimeError(f"trial {i}: no SIGTERM in {LONG_TRIAL_S:.0f} s")
            time.sleep(0.02)
        time.sleep(0.5)  # saving takes a moment: the suite must wait for it
        (folder / f"{i}.checkpoint").touch()
    raise PreemptedError(f"trial {i} stopped at a step with its checkpoint")


def main(folder: Path, kinds: list[str]) -> int:
    steps = [{"folder": str(folder), "index": i, "kind": k} for i, k in enumerate(kinds)]

    def suite() -> None:
        with terminated_raises():
            run_pool(trial, steps, lambda result: None, processes=2, threads=1, gpus=0)

    return exit_status(suite)  # the command line's lines and statuses


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
