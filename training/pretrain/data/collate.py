"""From decoded blocks to micro-batches: dynamic masking recipe, vectorised collation, transport.

A micro-batch of B instances is a dict of int64 tensors (what
``bertpipe.training.models.bert.model.BertForPreTraining.forward`` takes as keyword arguments):

- ``input_ids``      [B, S]  token ids, ``[PAD]`` (the manifest's pad id) after each instance
- ``token_type_ids`` [B, S]  0 before ``a_end`` (segment A), 1 from it on, 0 on padding
- ``attention_mask`` [B, S]  1 on real tokens, 0 on padding
- ``mlm_positions``  [N]     FLAT indices ``row * S + col`` of the masked tokens, row-major
- ``mlm_labels``     [N]     the original ids at those positions
- ``nsp_labels``     [B]     1 when segment B is a random next (``is_random_next``), else 0

S is the longest instance of the batch rounded up to a multiple of :data:`PAD_MULTIPLE`, so
it never exceeds the phase's ``max_seq_length`` rounded up. N varies from batch to batch.

:func:`unpad_batch` turns such a batch into the packed layout that the model's unpadded
path takes (T = the batch's real tokens, no padding anywhere):

- ``input_ids``, ``token_type_ids``, ``position_ids``  [T]  the real tokens, row after row
- ``cu_seqlens``     [B + 1]  0, L_1, L_1 + L_2, ..., T (where each sequence starts)
- ``seq_lengths``    tuple of B ints (host values: no device read to learn the lengths)
- ``mlm_positions``  [N]  indices into the T tokens; ``mlm_labels``, ``nsp_labels`` as above
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bertpipe.errors import BertpipeError
from bertpipe.preprocessing.masking import MaskingSpec
from bertpipe.preprocessing.shard_format import (
    A_END,
    LENGTH,
    NUM_MASKED,
    RANDOM_NEXT,
    InstanceBlock,
)

__all__ = [
    "BATCH_KEYS",
    "PAD_MULTIPLE",
    "BatchCutter",
    "DynamicMasking",
    "IdRangeError",
    "check_ids",
    "collate_block",
    "cut_batches",
    "pack_batch",
    "round_up",
    "unpack_batch",
    "unpad_batch",
]

PAD_MULTIPLE = 8
BATCH_KEYS = (
    "input_ids",
    "token_type_ids",
    "attention_mask",
    "mlm_positions",
    "mlm_labels",
    "nsp_labels",
)


@dataclass(frozen=True)
class DynamicMasking:
    """The recipe for masking unmasked shards at load time (``masking: none`` manifests).

    Masks are drawn per block and epoch by :func:`bertpipe.preprocessing.masking.mask_block` (the
    recipe of the preprocessing stage), before the block's instances are mixed and cut.
    """

    masked_lm_prob: float = 0.15
    mask_token_prob: float = 0.8
    random_token_prob: float = 0.1
    whole_word: bool = False
    continuation_ids: tuple[int, ...] = ()
    """Ids of the vocabulary's ``##`` pieces; required for whole-word masking."""

    def __post_init__(self) -> None:
        if self.whole_word and not self.continuation_ids:
            raise BertpipeError(
                "whole-word dynamic masking needs continuation_ids (the ids of the tokenizer's "
                "## pieces): pass masking=DynamicMasking(whole_word=True, continuation_ids=...)"
            )

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DynamicMasking:
        """From a manifest's ``config.masking`` (the recipe the shards were cut for)."""
        names = ("masked_lm_prob", "mask_token_prob", "random_token_prob", "whole_word")
        return cls(**{k: v for k, v in config.items() if k in names})

    def spec(
        self, vocab_size: int, max_predictions_per_seq: int, special_token_ids: Mapping[str, int]
    ) -> MaskingSpec:
        """The :class:`MaskingSpec` for a phase (values from its manifest)."""
        continuation = np.zeros(vocab_size, dtype=bool)
        continuation[list(self.continuation_ids)] = True
        return MaskingSpec(
            masked_lm_prob=self.masked_lm_prob,
            max_predictions_per_seq=max_predictions_per_seq,
            mask_id=special_token_ids["mask"],
            vocab_size=vocab_size,
            special_ids=tuple(special_token_ids.values()),
            mask_token_prob=self.mask_token_prob,
            random_token_prob=self.random_token_prob,
            whole_word=self.whole_word,
            continuation=continuation,
        )


class IdRangeError(BertpipeError):
    """A token or label id outside the vocabulary: the shard does not match its manifest."""


def check_ids(block: InstanceBlock, vocab_size: int, where: str) -> None:
    """Raise :class:`IdRangeError` naming ``where`` (the shard and sample) if a token id or MLM
    label id of ``block`` lies outside ``[0, vocab_size)``.

    Without this, an id past the vocabulary fails the embedding lookup with an IndexError
    that names no shard (a device-side assert on GPU), and an id between the vocabulary and
    its padded size (the model's embedding has rows up to a multiple of 8 or 64) trains
    silently on a row no token maps to. Costs a min and max per block.
    """
    for name, ids in (("token id", block.tokens), ("label id", block.mlm_ids)):
        if not ids.size:
            continue
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise IdRangeError(
                f"{where}: {name} {bad} is outside the vocabulary of {vocab_size} tokens: "
                "the shard was not written with this manifest's tokenizer, or is corrupt; "
                "rerun `bertpipe preprocess`"
            )


def round_up(n: int, multiple: int = PAD_MULTIPLE) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


class BatchCutter:
    """Cuts contiguous instance ranges of one block into padded micro-batches.

    The offsets are computed once per block (a shuffle window of the loader), so each batch
    costs a handful of numpy operations on its own [B, S] arrays. The block is validated
    here: no instance longer than ``max_seq_length``, no masked position outside its instance.
    """

    def __init__(self, block: InstanceBlock, pad_id: int, max_seq_length: int) -> None:
        info = block.info
        self._lengths = info[:, LENGTH].astype(np.int64)
        self._a_end = info[:, A_END].astype(np.int64)
        self._num_masked = info[:, NUM_MASKED].astype(np.int64)
        self._nsp = info[:, RANDOM_NEXT].astype(np.int64)
        self._tok_off = np.concatenate(([0], np.cumsum(self._lengths)))
        self._mlm_off = np.concatenate(([0], np.cumsum(self._num_masked)))
        self._block = block
        self._pad_id = pad_id
        if self._lengths.size and int(self._lengths.max()) > max_seq_length:
            raise ValueError(
                f"an instance has {int(self._lengths.max())} tokens, more than the phase's "
                f"max_seq_length {max_seq_length}: the shards do not match their manifest"
            )
        if (
            block.tokens.shape[0] != self._tok_off[-1]
            or block.mlm_pos.shape[0] != (self._mlm_off[-1])
        ):
            raise ValueError("a block's arrays disagree with its info: corrupt shard")
        if (
            block.mlm_pos.size
            and (block.mlm_pos.astype(np.int64) >= np.repeat(self._lengths, self._num_masked)).any()
        ):
            raise ValueError("a masked position lies outside its instance: corrupt shard")

    def __len__(self) -> int:
        return int(self._lengths.shape[0])

    def batch(self, start: int, stop: int, seq_len: int | None = None) -> dict[str, Tensor]:
        """Instances ``start:stop`` as one micro-batch (see the module docstring for shapes).

        ``seq_len`` forces S (at least the longest instance); default: rounded up to 8.
        """
        lengths = self._lengths[start:stop]
        rows = lengths.shape[0]
        longest = int(lengths.max()) if rows else 0
        S = round_up(max(longest, 1)) if seq_len is None else seq_len
        if longest > S:
            raise ValueError(f"seq_len {S} is shorter than the longest instance ({longest})")
        cols = np.arange(S)
        real = cols[None, :] < lengths[:, None]  # [B, S]
        input_ids = np.full((rows, S), self._pad_id, dtype=np.int64)
        input_ids[real] = self._block.tokens[self._tok_off[start] : self._tok_off[stop]]
        token_types = (cols[None, :] >= self._a_end[start:stop, None]) & real
        m0, m1 = self._mlm_off[start], self._mlm_off[stop]
        row_base = np.repeat(np.arange(rows, dtype=np.int64) * S, self._num_masked[start:stop])
        positions = self._block.mlm_pos[m0:m1].astype(np.int64) + row_base
        return {
            "input_ids": torch.from_numpy(input_ids),
            "token_type_ids": torch.from_numpy(token_types.astype(np.int64)),
            "attention_mask": torch.from_numpy(real.astype(np.int64)),
            "mlm_positions": torch.from_numpy(positions),
            "mlm_labels": torch.from_numpy(self._block.mlm_ids[m0:m1].astype(np.int64)),
            "nsp_labels": torch.from_numpy(self._nsp[start:stop].copy()),
        }


def collate_block(block: InstanceBlock, pad_id: int, max_seq_length: int) -> dict[str, Tensor]:
    """All instances of ``block`` as one micro-batch (B = ``len(block)``)."""
    return BatchCutter(block, pad_id, max_seq_length).batch(0, len(block))


def cut_batches(
    windows: Iterable[InstanceBlock],
    micro_batch_size: int,
    count: int,
    pad_id: int,
    max_seq_length: int,
) -> Iterator[dict[str, Tensor]]:
    """Exactly ``count`` micro-batches of consecutive instances of the windows' concatenation.

    A batch may span two windows (the remainder of one is carried into the next). Windows
    are pulled lazily and no more than needed; raises if they run out first.
    """
    done, pending = 0, None
    if count <= 0:
        return
    for window in windows:
        block = window if pending is None else InstanceBlock.concat([pending, window])
        cutter = BatchCutter(block, pad_id, max_seq_length)
        n = min(len(block) // micro_batch_size, count - done)
        for j in range(n):
            yield cutter.batch(j * micro_batch_size, (j + 1) * micro_batch_size)
        done += n
        if done == count:
            return
        used = n * micro_batch_size
        pending = block.take(np.arange(used, len(block))) if len(block) > used else None
    raise ValueError(f"the instances ran out after {done} of {count} batches")


def pack_batch(batch: dict[str, Tensor]) -> Tensor:
    """A batch as one int64 tensor ``[B, S, N, input_ids..., nsp_labels...]``.

    Loader workers send this instead of six tensors: each tensor crossing processes costs a
    shared-memory segment and a file descriptor, which dominated the transfer.
    """
    B, S = batch["input_ids"].shape
    header = torch.tensor([B, S, batch["mlm_positions"].numel()], dtype=torch.int64)
    return torch.cat([header, *(batch[key].reshape(-1) for key in BATCH_KEYS)])


def unpack_batch(packed: Tensor) -> dict[str, Tensor]:
    """The batch :func:`pack_batch` packed (views into ``packed``, no copies)."""
    B, S, N = (int(v) for v in packed[:3].tolist())
    sizes = [B * S, B * S, B * S, N, N, B]
    parts = packed[3:].split(sizes)
    shapes = [(B, S), (B, S), (B, S), (N,), (N,), (B,)]
    return {
        key: part.view(shape) for key, part, shape in zip(BATCH_KEYS, parts, shapes, strict=True)
    }


def unpad_batch(batch: Mapping[str, Tensor]) -> dict[str, Any]:
    """A padded batch (host tensors, see the module docstring) in the packed layout.

    Works for any attention mask, not only right-padding: every real token keeps its
    column as its position, and the masked positions are renumbered into the packed rows.
    """
    mask = batch["attention_mask"].bool()
    B, S = mask.shape
    lengths = mask.sum(1)
    flat = mask.reshape(-1)
    packed_index = flat.cumsum(0) - 1  # [B*S]: packed row of each real token
    columns = torch.arange(S, dtype=torch.int64).expand(B, S)
    return {
        "input_ids": batch["input_ids"][mask],
        "token_type_ids": batch["token_type_ids"][mask],
        "position_ids": columns[mask],
        "cu_seqlens": torch.nn.functional.pad(lengths.cumsum(0), (1, 0)),
        "seq_lengths": tuple(lengths.tolist()),
        "mlm_positions": packed_index[batch["mlm_positions"]],
        "mlm_labels": batch["mlm_labels"],
        "nsp_labels": batch["nsp_labels"],
    }
