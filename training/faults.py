"""Fault injection: the one seam through which tests make real runs fail.

Pre-training and fine-tuning take a :class:`Faults` object and call its hooks at fixed points
of a step and of a checkpoint save; the hooks do nothing unless a fault was asked for. Tests
ask for faults either by passing a :class:`Faults` in (in-process runs) or through the
environment (runs in a child process, where nothing can be passed in), read here and nowhere
else:

``BERTPIPE_FAULT_NAN_STEPS``
    ``5,6``, ``3-4`` or ``8-`` (optimizer steps of the run counted from 1; ``8-`` is every
    step from 8 on): those steps' loss is multiplied by NaN.
``BERTPIPE_FAULT_RAISE_STEP``
    ``6``: ``RuntimeError`` before step 6's first forward pass.
``BERTPIPE_FAULT_SIGNAL``
    ``TERM:5`` or ``KILL:13``: the process sends itself that signal before step 5 (13)
    starts: a preemption (the run saves at its next SIGTERM check) or a crash at a known
    point of a run.
``BERTPIPE_FAULT_RANK``
    ``1``: the three faults above on that rank only (default: every rank).
``BERTPIPE_FAULT_IN_SAVE``
    ``kill:TAG`` kills the process (SIGKILL) and ``enospc:TAG`` raises "No space left on
    device" after DeepSpeed wrote checkpoint TAG's files and before bertpipe's state and
    ``latest``: a crash or a full disk in the middle of a save. On object storage,
    ``kill-upload:TAG`` (SIGKILL) and ``term-upload:TAG`` (SIGTERM) hit the process after
    the first file of TAG's upload reached the store: a crash or a preemption mid-upload.

Real runs never set these; a run that finds one logs a warning naming it.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

__all__ = [
    "FAULT_IN_SAVE",
    "FAULT_NAN_STEPS",
    "FAULT_RAISE_STEP",
    "FAULT_RANK",
    "FAULT_SIGNAL",
    "NO_FAULTS",
    "Faults",
]

FAULT_NAN_STEPS = "BERTPIPE_FAULT_NAN_STEPS"
FAULT_RAISE_STEP = "BERTPIPE_FAULT_RAISE_STEP"
FAULT_RANK = "BERTPIPE_FAULT_RANK"
FAULT_SIGNAL = "BERTPIPE_FAULT_SIGNAL"
FAULT_IN_SAVE = "BERTPIPE_FAULT_IN_SAVE"


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
    """``(kind, tag)``: ``kill`` or ``enospc`` in the middle of saving checkpoint ``tag``,
    ``kill-upload`` or ``term-upload`` in the middle of uploading it."""
    signal_step: tuple[int, int] | None = None
    """``(signal number, step)``: the process signals itself before that step."""
    source: dict[str, str] = field(default_factory=dict, compare=False)
    """The environment variables these came from (for the log line)."""

    @classmethod
    def from_environ(cls, rank: int, environ: Mapping[str, str] = os.environ) -> Faults:
        """The faults the environment asks of rank ``rank``."""
        source = {k: v for k, v in environ.items() if k.startswith("BERTPIPE_FAULT_")}
        kind, _, tag = environ.get(FAULT_IN_SAVE, "").partition(":")
        kinds = ("kill", "enospc", "kill-upload", "term-upload")
        in_save = (kind, tag) if kind in kinds and tag else None
        only = environ.get(FAULT_RANK)
        if only is not None and int(only) != rank:
            faults = cls(in_save=in_save, source=source)
        else:
            nan_steps: set[int] = set()
            nan_from = None
            for item in filter(None, environ.get(FAULT_NAN_STEPS, "").replace(" ", "").split(",")):
                if item.endswith("-"):
                    nan_from = int(item[:-1])
                elif "-" in item:
                    first, last = (int(x) for x in item.split("-"))
                    nan_steps.update(range(first, last + 1))
                else:
                    nan_steps.add(int(item))
            raise_step = environ.get(FAULT_RAISE_STEP)
            signal_step = None
            if environ.get(FAULT_SIGNAL):
                name, _, step = environ[FAULT_SIGNAL].partition(":")
                signal_step = (int(getattr(signal, f"SIG{name.upper()}")), int(step))
            faults = cls(
                frozenset(nan_steps),
                nan_from,
                int(raise_step) if raise_step else None,
                in_save,
                signal_step,
                source,
            )
        if faults.active:
            log.warning("fault injection (tests only): %s", faults.source or faults)
        return faults

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
            raise RuntimeError(f"fault injection: {FAULT_RAISE_STEP}={step}")

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
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), tag)

    def in_checkpoint_upload(self, tag: str) -> None:
        """Called (in the upload thread) once the first file of ``tag`` is on the store."""
        if self.in_save is None or self.in_save[1] != tag:
            return
        if self.in_save[0] == "kill-upload":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.in_save[0] == "term-upload":
            os.kill(os.getpid(), signal.SIGTERM)


NO_FAULTS = Faults()
