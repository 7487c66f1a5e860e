"""Pre-training's metrics: sums over the optimizer steps between two log lines.

:class:`Window` keeps losses and counts on the device (no step waits for the device) and what
the batches held and cost on the host; :meth:`Window.reduce` sums them over the ranks once,
at a log step. Memory and the fp16 loss scale are read at log steps too.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from bertpipe.training.core.step import StepResult
from bertpipe.training.pretrain.batches import BatchStats

__all__ = ["Window", "loss_scale", "memory_metrics"]


class Window:
    """Sums over the optimizer steps since the last log line (this rank). Losses and counts
    stay on the device, so that no step waits for the device; what the batches held and cost
    (:class:`~bertpipe.training.pretrain.batches.BatchStats`) and the time spent waiting for data
    are host sums."""

    FIELDS = ("loss", "mlm_loss", "nsp_loss", "mlm_correct", "mlm_count", "nsp_correct")
    HOST_FIELDS = ("sequences", "tokens", "padded_tokens", "flops", "padded_flops", "data_wait")

    def __init__(self, device: torch.device) -> None:
        self.sums = torch.zeros(len(self.FIELDS), dtype=torch.float64, device=device)
        self.batch = BatchStats()
        self.data_wait = 0.0
        self.steps = 0
        self.lr = 0.0
        self.micro_batches = 0
        """Of the window's last step on this rank: its accumulation (batch warmup changes
        it; :meth:`add` averages a step's losses over its own count)."""
        self.started = time.monotonic()
        self.has_nsp = True

    def add(self, out: Any, stats: BatchStats, accumulation: int) -> None:
        """One micro-batch's output; a model without NSP (``nsp_loss`` None) adds no NSP
        terms, and :meth:`reduce` then reports none."""
        nsp = out.nsp_loss is not None
        self.has_nsp = nsp
        zero = out.mlm_count.new_zeros((), dtype=torch.float64)
        values = torch.stack(
            [
                out.loss.detach().double() / accumulation,
                out.mlm_loss.detach().double() / accumulation,
                out.nsp_loss.detach().double() / accumulation if nsp else zero,
                out.mlm_correct.double(),
                out.mlm_count.double(),
                out.nsp_correct.double() if nsp else zero,
            ]
        )
        self.sums += values
        self.batch += stats

    def record(self, result: StepResult) -> None:
        """Count one optimizer step (its micro-batches were added by :meth:`add`)."""
        self.steps += 1
        self.lr = result.lr
        self.micro_batches = result.micro_batches
        self.data_wait += result.data_wait

    def reduce(self, world: int) -> dict[str, float]:
        b = self.batch
        host = [b.sequences, b.real_tokens, b.padded_tokens, b.flops, b.padded_flops]
        values = torch.cat(
            [self.sums, torch.tensor([*host, self.data_wait], dtype=torch.float64).to(self.sums)]
        )
        dist.all_reduce(values)
        total = dict(zip(self.FIELDS + self.HOST_FIELDS, values.tolist(), strict=True))
        seconds = max(time.monotonic() - self.started, 1e-9)
        steps = max(self.steps, 1)
        out = {
            "loss": total["loss"] / steps / world,
            "mlm_loss": total["mlm_loss"] / steps / world,
            "nsp_loss": total["nsp_loss"] / steps / world,
            "mlm_accuracy": total["mlm_correct"] / max(total["mlm_count"], 1.0),
            "nsp_accuracy": total["nsp_correct"] / max(total["sequences"], 1.0),
            "samples_per_s": total["sequences"] / seconds,
            "tokens_per_s": total["tokens"] / seconds,
            "padding_fraction": 1.0 - total["tokens"] / max(total["padded_tokens"], 1.0),
            "tflops_per_device": total["flops"] / seconds / world / 1e12,
            "padded_tflops_per_device": total["padded_flops"] / seconds / world / 1e12,
            "data_wait_fraction": total["data_wait"] / world / seconds,
        }
        if not self.has_nsp:
            del out["nsp_loss"], out["nsp_accuracy"]
        return out


def memory_metrics(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {
            "memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            "memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    import resource

    return {"memory_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def loss_scale(engine: Any) -> float | None:
    optimizer = engine.optimizer
    for name in ("cur_scale", "loss_scale"):
        value = getattr(optimizer, name, None)
        if isinstance(value, int | float):
            return float(value)
    return None
