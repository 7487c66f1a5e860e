"""Fault injection: the one seam through which tests make real runs fail.

The training loop and the checkpoint saves call the hooks of a :class:`Faults` at fixed
points of a step and of a save; the default breaks nothing. Nothing in bertpipe decides to
inject a fault: a test passes a :class:`Faults` to ``run_pretraining`` / ``run_finetuning``,
or installs a provider with :func:`install` at its own entry point (the test suite's
``conftest.py`` for in-process runs, ``tests/faultinject/sitecustomize.py`` for the child
processes tests start), which the runs ask for their rank's faults (:func:`for_rank`). A run
that gets active faults logs a warning naming them.
"""

from __future__ import annotations

import logging
import math
import os
import signal
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the hooks only multiply tensors: importing this module imports no torch
    import torch

log = logging.getLogger(__name__)

__all__ = ["NO_FAULTS", "Faults", "for_rank", "install"]


@dataclass(frozen=True)
class Faults:
    """What to break, and where. The default breaks nothing."""

    nan_steps: frozenset[int] = frozenset()
    """Optimizer steps (from 1) whose loss becomes NaN."""
    nan_from: int | None = None
    """Every step from this one on has a NaN loss."""
    raise_step: int | None = None
    """Raise ``RuntimeError`` before this step."""
    in_save: tuple[str, str] | None = None
    """``(kind, tag)``: ``kill`` in the middle of saving checkpoint ``tag`` (a full disk is
    made with a real small file system, not here),
    ``kill-upload`` or ``term-upload`` in the middle of uploading it."""
    signal_step: tuple[int, int] | None = None
    """``(signal number, step)``: the process signals itself before that step."""
    source: dict[str, str] = field(default_factory=dict, compare=False)
    """Where these came from (for the log line)."""

    @property
    def active(self) -> bool:
        return bool(
            self.nan_steps
            or self.nan_from is not None
            or self.raise_step is not None
            or self.in_save is not None
            or self.signal_step is not None
        )

    def before_step(self, step: int) -> None:
        """Called before optimizer step ``step`` (from 1) starts."""
        if self.signal_step is not None and step == self.signal_step[1]:
            os.kill(os.getpid(), self.signal_step[0])
        if step == self.raise_step:
            raise RuntimeError(f"fault injection: raise before step {step}")

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """The loss of a micro-batch of optimizer step ``step``, as the step will see it."""
        if step in self.nan_steps or (self.nan_from is not None and step >= self.nan_from):
            return loss * math.nan
        return loss

    def in_checkpoint_save(self, tag: str) -> None:
        """Called after DeepSpeed wrote ``tag``'s files, before bertpipe's state and
        ``latest``."""
        if self.in_save is None or self.in_save[1] != tag or "upload" in self.in_save[0]:
            return
        if self.in_save[0] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)

    def in_checkpoint_upload(self, tag: str) -> None:
        """Called (in the upload thread) once the first file of ``tag`` is on the store."""
        if self.in_save is None or self.in_save[1] != tag:
            return
        if self.in_save[0] == "kill-upload":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.in_save[0] == "term-upload":
            os.kill(os.getpid(), signal.SIGTERM)


NO_FAULTS = Faults()

_provider: ContextVar[Callable[[int], Faults] | None] = ContextVar("bertpipe_faults", default=None)


def install(provider: Callable[[int], Faults] | None) -> None:
    """Make ``provider(rank)`` the faults of the runs started from now on in this context
    (None: none again). For test entry points only."""
    _provider.set(provider)


def for_rank(rank: int) -> Faults:
    """The faults a run on rank ``rank`` gets: the installed provider's, else none."""
    provider = _provider.get()
    faults = NO_FAULTS if provider is None else provider(rank)
    if faults.active:
        log.warning("fault injection (tests only): %s", faults.source or faults)
    return faults
