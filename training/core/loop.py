"""The training loop of both stages: step, guard, then whatever the cadence says is due.

``bertpipe pretrain`` runs :func:`run_loop` once per phase, ``bertpipe finetune`` once per run.
The loop owns what the two have in common: the guarded optimizer step
(:class:`~bertpipe.training.core.step.OptimizerStep`), the count of skipped non-finite steps
(:class:`~bertpipe.training.core.guard.SkipGuard`, which ends the run after ``max_bad_steps`` in a
row, logged first), what is due after a step (:class:`~bertpipe.training.core.cadence.Cadence`:
log, evaluate, checkpoint, SIGTERM), the checkpoints (:class:`~bertpipe.training.core.checkpoints.
CheckpointManager`), the save of the last completed step after an unexpected error, and the
clean-up of the stage's loader. A stage supplies what differs, as a :class:`Stage`: its
batches and their position, its metrics and evaluation, and what its checkpoints hold beyond
the run's counters.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from bertpipe.errors import DiskFullError
from bertpipe.training import checkpoint as ckpt
from bertpipe.training.core.cadence import Cadence, PreemptedError, StopFlag
from bertpipe.training.core.checkpoints import CheckpointManager, Position, StageState
from bertpipe.training.core.faults import NO_FAULTS, Faults
from bertpipe.training.core.guard import NonFiniteError
from bertpipe.training.core.step import OptimizerStep, StepResult

log = logging.getLogger(__name__)

__all__ = ["LoopEnd", "Stage", "run_loop"]


class Stage(Protocol):
    """What a stage gives the loop for one engine (a pre-training phase, a fine-tuning run).

    Every method runs on every rank; ``log`` and ``evaluate`` may be collectives."""

    name: str
    """Names the stage in log lines (``phase1``, ``fine-tuning``)."""
    max_steps: int
    """The stage's last step (its steps count from 1)."""
    accumulation: int
    """Micro-batches of the next optimizer step on this rank. The loop reads it before each
    step: a stage may change it in :meth:`after_step` (pre-training's batch-size warmup)."""
    samples_per_step: int
    """Sequences the next optimizer step consumes on this rank (read with
    ``accumulation``)."""

    def batches(self) -> Iterator[Any]:
        """The micro-batches for :class:`OptimizerStep` (on the device), from the stage's
        start position on, endless; closed by :meth:`close`."""
        ...

    def position(self) -> dict[str, int]:
        """This rank's loader position after the batches taken so far."""
        ...

    def where(self, step: int, global_step: int) -> str:
        """Step ``step`` as log lines and errors name it."""
        ...

    def on_output(self, output: Any, extra: Any) -> None:
        """A micro-batch's model output (and what ``batches`` yielded beside the batch)."""
        ...

    def after_step(self, step: int, result: StepResult) -> None:
        """Step ``step`` completed: take its figures into the stage's counts."""
        ...

    def log(self, engine: Any, step: int) -> None:
        """The cadence's log step (and the last step, and the step that ends a run of
        non-finite steps)."""
        ...

    def evaluate(self, engine: Any, step: int) -> None:
        """The cadence's evaluation, and the stage's end."""
        ...

    def state(self, ended: bool) -> StageState:
        """What a checkpoint of the last completed step holds for the stage."""
        ...

    def close(self) -> None:
        """Stop the loader (its workers ignore SIGTERM) and progress output."""
        ...


@dataclass(frozen=True)
class LoopEnd:
    """How the loop ended (it returns only at the stage's last step)."""

    at: Position
    stopped: bool
    """A SIGTERM was agreed at the last step: the stage is complete (and saved if the cadence
    saves at the end), but what would come after it should not start."""


def run_loop(
    engine: Any,
    stage: Stage,
    checkpoints: CheckpointManager,
    *,
    start: Position,
    cadence: Cadence,
    stop: StopFlag,
    faults: Faults = NO_FAULTS,
) -> LoopEnd:
    """Train ``stage`` from ``start`` to its last step, then evaluate it once more.

    Raises :class:`~bertpipe.training.core.cadence.PreemptedError` after saving when a SIGTERM
    was agreed, :class:`~bertpipe.training.core.guard.NonFiniteError` after ``max_bad_steps``
    skipped steps in a row (nothing of them saved); any other error is re-raised after
    :meth:`~bertpipe.training.core.checkpoints.CheckpointManager.save_after_error`."""
    info, guard, progress = checkpoints.info, checkpoints.guard, checkpoints.progress
    step = OptimizerStep(engine, stage.accumulation, faults=faults, on_output=stage.on_output)
    done, stopped = start, False
    try:
        batches = stage.batches()
        while done.step < stage.max_steps:
            result = step(progress.global_step + 1, batches, accumulation=stage.accumulation)
            progress.global_step += 1
            progress.samples_seen += stage.samples_per_step
            done = Position(done.step + 1, stage.position())
            stage.after_step(done.step, result)
            where = stage.where(done.step, progress.global_step)
            guard.record(result.skipped, where)
            ended = done.step >= stage.max_steps
            due = cadence.after_step(
                done.step,
                ended=ended,
                streak=guard.streak,
                exhausted=guard.exhausted,
                stop=stop,
                device=info.device,
            )
            if due.log:
                stage.log(engine, done.step)
            if guard.exhausted:
                raise guard.error(where, ckpt.latest_tag(checkpoints.folder))
            if due.evaluate:
                stage.evaluate(engine, done.step)
            if due.deferred and info.is_main:
                log.warning(
                    "%s: checkpoint deferred, the last %d steps were skipped", where, guard.streak
                )
            if due.save:
                good = not guard.streak
                wait = due.stop or ended  # the next phase (or the requeued job) loads it
                checkpoints.save(
                    engine, stage.state(ended), done, where=where, good=good, wait=wait
                )
            if due.stop and not ended:
                raise PreemptedError(f"stopped by SIGTERM at {where}")
            stopped = due.stop
    except (PreemptedError, NonFiniteError, DiskFullError):  # saved, or nothing to save
        raise
    except Exception:
        ended = done.step >= stage.max_steps
        ran = done.step > start.step
        checkpoints.save_after_error(engine, stage.state(ended), done, name=stage.name, ran=ran)
        raise
    finally:
        stage.close()
    stage.evaluate(engine, done.step)
    return LoopEnd(done, stopped)
