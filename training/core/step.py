"""One optimizer step through a DeepSpeed engine, and the batches it is made of.

Pre-training, fine-tuning and ``bertpipe bench train`` step through :class:`OptimizerStep`:
``accumulation`` micro-batches forward and backward, then DeepSpeed's step (gradient
clipping, loss scaling and precision, ZeRO), guarded against non-finite values
(:mod:`bertpipe.training.core.guard`), with the fault-injection hooks of
:mod:`bertpipe.training.core.faults` at fixed points. A step may take another number of
micro-batches than the engine was built for (pre-training's batch-size warmup). Batches
reach it on the device (:func:`to_device`); what a stage's batches are made of is the
stage's (pre-training: :mod:`bertpipe.training.pretrain.batches`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from bertpipe.training.core.faults import NO_FAULTS, Faults
from bertpipe.training.core.guard import guard_updates, poisoned

__all__ = ["OptimizerStep", "StepResult", "to_device"]


def to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """Tensors to ``device`` without blocking (a pinned source makes the copy asynchronous);
    host values (the packed batch's ``seq_lengths``) stay as they are."""
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, Tensor) else v for k, v in batch.items()
    }


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What an optimizer step did, counted on the host."""

    skipped: int
    """1 if DeepSpeed skipped the update (a non-finite loss or gradient on any rank), else 0."""
    lr: float
    """The learning rate the update used (of the first param group)."""
    data_wait: float
    """Seconds spent waiting for the micro-batches."""
    micro_batches: int = 0
    """Micro-batches the step took on this rank (its accumulation)."""


def _no_mark(part: str) -> None:
    return None


class OptimizerStep:
    """``step(n, batches)``: optimizer step ``n`` (of the run, from 1) over ``accumulation``
    micro-batches taken from ``batches`` (dicts of the model's keyword arguments, already on
    the device).

    Each micro-batch: forward, the fault hook on the loss, ``on_output(output, extra)`` (the
    caller's metrics; ``extra`` is what ``batches`` yielded besides the batch, or None), then
    the back-propagation of :func:`~bertpipe.training.core.guard.poisoned` and DeepSpeed's
    ``step()`` (which applies the update at the accumulation boundary). Whether the update
    was skipped is DeepSpeed's host-side count: its ZeRO optimizer, or the ZeRO 0 guard
    installed here, already read the all-reduced gradient norm.

    A call may take another number of micro-batches (``accumulation=``, batch-size warmup):
    the engine's global batch is then set to it with DeepSpeed's public
    ``set_train_batch_size`` (same micro batch, other accumulation: the loss is divided by
    the step's own count), and from then on every micro-batch tells the engine whether it
    ends the step (``set_gradient_accumulation_boundary``). DeepSpeed otherwise finds the
    boundary from its running count of micro-batches modulo the accumulation, which a changed
    accumulation, or a resume (the count is not checkpointed), puts out of step. An engine
    that keeps its accumulation is stepped exactly as before.
    """

    def __init__(
        self,
        engine: Any,
        accumulation: int,
        *,
        faults: Faults = NO_FAULTS,
        on_output: Callable[[Any, Any], None] | None = None,
    ) -> None:
        self.engine = engine
        self.accumulation = accumulation
        self.faults = faults
        self.on_output = on_output
        self.explicit_boundaries = False
        """Whether each micro-batch sets DeepSpeed's accumulation boundary (once a step has
        changed the engine's accumulation)."""
        guard_updates(engine)  # at ZeRO 0 DeepSpeed would apply a non-finite update

    def __call__(
        self,
        step: int,
        batches: Iterator[Any],
        mark: Callable[[str], None] = _no_mark,
        *,
        accumulation: int | None = None,
    ) -> StepResult:
        """``mark(part)`` is called after each part of a micro-batch (``data``, ``forward``,
        ``backward``, ``optimizer``): ``bertpipe bench train`` times them. ``accumulation``:
        this step's micro-batches (default: the one given at construction)."""
        engine = self.engine
        count = self.accumulation if accumulation is None else accumulation
        if count < 1:
            raise ValueError(f"a step takes at least one micro-batch, not {count}")
        if count != engine.gradient_accumulation_steps():
            self._resize(count)
        explicit = self.explicit_boundaries
        lr = float(engine.optimizer.param_groups[0]["lr"])  # this update's rate
        skipped_before = engine.skipped_steps
        self.faults.before_step(step)
        waited = 0.0
        for i in range(count):
            started = time.perf_counter()
            item = next(batches)
            waited += time.perf_counter() - started
            mark("data")
            batch, extra = item if isinstance(item, tuple) else (item, None)
            if explicit:
                engine.set_gradient_accumulation_boundary(i == count - 1)
            out = engine(**batch)
            out.loss = self.faults.loss(step, out.loss)
            if self.on_output is not None:
                self.on_output(out, extra)
            mark("forward")
            engine.backward(poisoned(out.loss))
            mark("backward")
            engine.step()
            mark("optimizer")
        return StepResult(engine.skipped_steps - skipped_before, lr, waited, count)

    def _resize(self, count: int) -> None:
        """Make the engine's steps ``count`` micro-batches long (its micro batch kept)."""
        engine = self.engine
        micro = engine.train_micro_batch_size_per_gpu()
        ranks = engine.train_batch_size() // (micro * engine.gradient_accumulation_steps())
        engine.set_train_batch_size(count * micro * ranks)
        self.explicit_boundaries = True
