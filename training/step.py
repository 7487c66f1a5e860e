"""From a loader's host batch to a device batch, with the figures a step is measured by.

The trainer and ``bertpipe bench train`` share this: :class:`BatchPrep` turns a padded host
batch (:mod:`bertpipe.training.collate`) into what the model takes, packed with
:func:`bertpipe.training.collate.unpad_batch` when unpadding is on, pinned and copied without
blocking on a GPU, and counts on the host (no device read) what the step will compute:
sequences, real and padded tokens, and model FLOPs on real tokens (the numerator of MFU)
and on the padded shape (what a padded encoder computes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bertpipe.training.collate import unpad_batch
from bertpipe.training.flops import training_flops
from bertpipe.training.model import BertModelConfig

__all__ = ["BatchPrep", "BatchStats", "to_device"]


@dataclasses.dataclass
class BatchStats:
    """What one micro-batch holds and costs, counted on the host."""

    sequences: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    """B x S of the padded batch (what the padded encoder processes)."""
    masked: int = 0
    flops: float = 0.0
    """Model FLOPs on real tokens (forward + backward, no recomputation)."""
    padded_flops: float = 0.0
    """The same on the padded [B, S] shape."""

    def __iadd__(self, other: BatchStats) -> BatchStats:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self


def to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """Tensors to ``device`` without blocking (a pinned source makes the copy asynchronous);
    host values (the packed batch's ``seq_lengths``) stay as they are."""
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, Tensor) else v for k, v in batch.items()
    }


class BatchPrep:
    """Host batch -> (device batch, :class:`BatchStats`)."""

    def __init__(self, model_cfg: BertModelConfig, device: torch.device, unpad: bool) -> None:
        self.model_cfg = model_cfg
        self.device = device
        self.unpad = unpad
        self.pin = device.type == "cuda"

    def stats(self, batch: Mapping[str, Tensor]) -> BatchStats:
        lengths = batch["attention_mask"].sum(1).numpy()
        B, S = batch["attention_mask"].shape
        masked = int(batch["mlm_positions"].numel())
        return BatchStats(
            sequences=B,
            real_tokens=int(lengths.sum()),
            padded_tokens=B * S,
            masked=masked,
            flops=training_flops(self.model_cfg, lengths, masked),
            padded_flops=training_flops(self.model_cfg, np.full(B, S), masked),
        )

    def __call__(self, batch: Mapping[str, Tensor]) -> tuple[dict[str, Any], BatchStats]:
        stats = self.stats(batch)
        host: dict[str, Any] = unpad_batch(batch) if self.unpad else dict(batch)
        if self.pin:
            host = {k: v.pin_memory() if isinstance(v, Tensor) else v for k, v in host.items()}
        return to_device(host, self.device), stats
