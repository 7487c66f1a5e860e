"""What happens after an optimizer step: log, evaluate, checkpoint, stop for preemption.

Pre-training and fine-tuning decide it the same way, in :meth:`Cadence.after_step`, so that
their one loop (:mod:`bertpipe.training.core.loop`) reads as "step, then do what is due". A SIGTERM
(SLURM preemption, a Kubernetes pod being evicted, ``scancel``) only sets a flag
(:class:`StopFlag`); the ranks agree on it at the next check (one all-reduce, so every few
steps rather than every step) and then save a checkpoint and stop with
:class:`PreemptedError`, exit status 143.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PREEMPTED_EXIT_CODE", "Cadence", "Due", "PreemptedError", "SigtermLatch", "StopFlag"]

PREEMPTED_EXIT_CODE = 143
"""128 + SIGTERM: what schedulers expect of a job that stopped because it was told to."""


class PreemptedError(Exception):
    """The run was asked to stop (SIGTERM) and saved a checkpoint."""


class SigtermLatch:
    """A SIGTERM handler that remembers the signal, for a process that runs one run after
    another (a suite's trial worker): a :class:`StopFlag` installed over it starts requested
    when it fired (a SIGTERM while the run was starting is not lost), and hands back a SIGTERM
    it got itself when uninstalled."""

    def __init__(self) -> None:
        self.received = False

    def __call__(self, signum: int, frame: object) -> None:
        self.received = True


class StopFlag:
    """Set by SIGTERM; checked collectively (:meth:`agreed`) at the cadence's checks."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def install(self) -> None:
        self._previous = signal.signal(signal.SIGTERM, self._handler)
        if isinstance(self._previous, SigtermLatch) and self._previous.received:
            self.requested = True

    def uninstall(self) -> None:
        if isinstance(self._previous, SigtermLatch) and self.requested:
            self._previous.received = True
        signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)

    def __enter__(self) -> StopFlag:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def _handler(self, signum: int, frame: object) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank got a SIGTERM (a collective: every rank must call it)."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)


@dataclass(frozen=True)
class Due:
    """What to do after a step."""

    log: bool = False
    evaluate: bool = False
    save: bool = False
    stop: bool = False
    """SIGTERM: save, then raise :class:`PreemptedError`."""
    deferred: bool = False
    """A periodic checkpoint was due but the last steps were skipped (non-finite): the last
    good checkpoint stays ``latest``."""


@dataclass(frozen=True)
class Cadence:
    """Every how many optimizer steps each thing happens (0: never on a step count)."""

    log_every: int = 0
    eval_every: int = 0
    checkpoint_every: int = 0
    preemption_every: int = 10
    save_at_end: bool = True
    """Checkpoint the last step (a pre-training phase's end, which the next phase and exports
    start from); false: a run that completes saves nothing at its end (fine-tuning: its
    result is the best epoch's model)."""

    def after_step(
        self, step: int, *, ended: bool, streak: int, exhausted: bool, stop: StopFlag, device: Any
    ) -> Due:
        """What is due after step ``step`` (of the phase or run; ``ended``: its last).

        The stop flag costs a device read: it is checked at log steps and every
        ``preemption_every`` steps, and at the end, never in between. A periodic checkpoint
        during a streak of skipped steps is deferred; at the end or on a stop it is saved
        (marked not good), so that nothing is lost."""
        log = (self.log_every and step % self.log_every == 0) or ended or exhausted
        stopping = (log or step % self.preemption_every == 0) and stop.agreed(device)
        periodic = bool(self.checkpoint_every) and step % self.checkpoint_every == 0
        save = (stopping or ended or periodic) and (self.save_at_end or not ended)
        deferred = save and bool(streak) and not (stopping or ended)
        return Due(
            log=bool(log),
            evaluate=bool(self.eval_every) and step % self.eval_every == 0 and not ended,
            save=save and not deferred and not exhausted,
            stop=stopping,
            deferred=deferred,
        )
