"""Non-finite values: a step whose loss or gradient is NaN or infinite is skipped, never applied.

How a bad step is kept out of the weights, on any rank and at any ZeRO stage:

1. :func:`poisoned` makes a non-finite loss turn every gradient into NaN (a loss of inf can
   have finite gradients), without reading the device.
2. The gradients' own reduction carries a bad micro-batch of any rank to all ranks: the
   all-reduce at ZeRO 0, the gradient-norm all-reduce of DeepSpeed's ZeRO optimizer at
   stages 1-3.
3. DeepSpeed's optimizer wrappers (ZeRO 1-3, fp16, bf16) then set ``overflow``, skip the
   update and do not step the LR schedule; at ZeRO 0 in fp32 (and with ``torch_autocast``)
   the engine calls the client optimizer directly, so :func:`guard_updates` wraps its step
   to do the same.
4. :class:`SkipGuard` counts skipped steps (DeepSpeed's host-side ``skipped_steps``, no
   device read) and stops the run with :class:`NonFiniteError` after ``max_bad_steps`` in a
   row. :func:`weights_finite` is checked before every checkpoint: none with non-finite
   weights is ever written.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from bertpipe.errors import BertpipeError

log = logging.getLogger(__name__)

__all__ = ["NonFiniteError", "SkipGuard", "guard_updates", "poisoned", "weights_finite"]


class NonFiniteError(BertpipeError):
    """Too many consecutive steps with a non-finite loss or gradient, or non-finite weights
    at a checkpoint: the run stops without saving them (``bertpipe: error: ...``, status 2)."""


def poisoned(loss: torch.Tensor) -> torch.Tensor:
    """The loss to back-propagate: the loss itself (x 1.0, bit for bit) when finite, else x NaN,
    so that a non-finite loss always makes every gradient NaN. No device read."""
    finite = torch.isfinite(loss)
    return loss * torch.where(finite, torch.ones_like(loss), torch.full_like(loss, math.nan))


def guard_updates(engine: Any) -> bool:
    """Make the engine skip steps with non-finite gradients where DeepSpeed does not.

    At ZeRO 0 in fp32 (and with ``torch_autocast``) the engine calls the client optimizer
    directly, which would write NaN into every weight. This wraps that optimizer's ``step`` to
    check the (already all-reduced, so identical on every rank) gradients first and to set
    ``overflow`` like DeepSpeed's wrappers do, so the engine's own skip accounting applies. It
    costs one device read per optimizer step, at ZeRO 0 only. Returns whether the guard was
    installed (False where DeepSpeed's own wrapper already checks)."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "overflow"):
        return False
    step = optimizer.step

    @functools.wraps(step)  # keeps the LR scheduler's mark on the wrapped step
    def guarded_step(*args: Any, **kwargs: Any) -> Any:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        total = torch.stack(torch._foreach_norm(grads)).sum() if grads else None
        optimizer.overflow = total is not None and not bool(torch.isfinite(total))
        if optimizer.overflow:
            return None
        return step(*args, **kwargs)

    optimizer.overflow = False
    optimizer.step = guarded_step
    return True


def weights_finite(engine: Any, collective: bool = True) -> bool:
    """Whether every weight of the engine's model is finite (on all ranks if ``collective``).
    Under ZeRO 3 this rank's partition of each parameter is checked."""
    tensors = [getattr(p, "ds_tensor", p).detach() for p in engine.module.parameters()]
    checks = [torch.isfinite(t).all() for t in tensors if t.numel()]
    device = tensors[0].device if tensors else torch.device("cpu")
    bad = (~torch.stack(checks).all()).float().reshape(1) if checks else torch.zeros(1)
    bad = bad.to(device)
    if collective:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad.item() > 0)


class SkipGuard:
    """Skipped steps of a run: the total (``train/skipped_steps``) and the current streak.

    ``record(skipped)`` after every optimizer step; it warns on a skipped step and raises
    :class:`NonFiniteError` once ``max_bad_steps`` steps in a row were skipped (the caller
    says where the run stands and what was saved: ``latest`` is never a bad step's)."""

    def __init__(self, max_bad_steps: int, skipped: int = 0, *, log_rank: bool = True) -> None:
        self.max_bad_steps = max_bad_steps
        self.skipped = skipped
        """Steps not applied for non-finite values, over the whole run."""
        self.streak = 0
        """Consecutive skipped steps up to the last one."""
        self._log = log_rank

    def record(self, skipped: int, where: str) -> None:
        """Count one optimizer step (``skipped``: how many DeepSpeed skipped, 0 or 1)."""
        self.skipped += skipped
        self.streak = self.streak + 1 if skipped else 0
        if skipped and self._log:
            log.warning(
                "%s: non-finite loss or gradient, update skipped (%d in a row, %d in all; the "
                "run stops at %d in a row)",
                where,
                self.streak,
                self.skipped,
                self.max_bad_steps,
            )

    @property
    def exhausted(self) -> bool:
        return self.streak >= self.max_bad_steps

    def error(
        self, where: str, latest: str | None, unit: str = "optimizer steps"
    ) -> NonFiniteError:
        """The error that stops the run (raise it once :attr:`exhausted`)."""
        return NonFiniteError(
            f"{where}: {self.streak} {unit} in a row had a non-finite loss or gradient "
            f"(max_bad_steps={self.max_bad_steps}); none was applied and nothing was saved, "
            f"the latest checkpoint is {latest or 'none'}: lower the learning rate or check "
            "the data, then resume"
        )
