"""Pre-training's batches on their way to the step: :class:`BatchPrep` turns the loader's
padded host batch (:mod:`bertpipe.training.pretrain.data.collate`) into what the model takes,
packed with :func:`~bertpipe.training.pretrain.data.collate.unpad_batch` when unpadding is on,
pinned and copied without blocking on a GPU, and counts on the host (no device read) what the
step will compute (:class:`BatchStats`): sequences, real and padded tokens, and model FLOPs on
real tokens (the numerator of MFU) and on the padded shape (what a padded encoder computes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bertpipe.training.core.step import to_device
from bertpipe.training.models.families import ModelConfig
from bertpipe.training.models.flops import training_flops
from bertpipe.training.pretrain.data.collate import unpad_batch

__all__ = ["BatchPrep", "BatchStats"]


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


class BatchPrep:
    """Host batch -> (device batch, :class:`BatchStats`)."""

    def __init__(
        self, model_cfg: ModelConfig, device: torch.device, unpad: bool, nsp: bool = True
    ) -> None:
        self.model_cfg = model_cfg
        self.device = device
        self.unpad = unpad
        self.nsp = nsp
        """False: the batches carry no NSP labels (data of the ``mlm`` objective, whose
        ``is_random_next`` is 0 throughout: BERT's NSP head gets no loss from it)."""
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
        if not self.nsp:
            host.pop("nsp_labels", None)
        if self.pin:
            host = {k: v.pin_memory() if isinstance(v, Tensor) else v for k, v in host.items()}
        return to_device(host, self.device), stats
