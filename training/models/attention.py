"""Attention over unpadded (packed) sequences: the encoder's variable-length layout.

A batch of B sequences with lengths L_1..L_B is packed into T = sum(L_i) token rows
(sequence after sequence, no padding); :class:`Varlen` says where each sequence starts.
:func:`varlen_attention` computes softmax(Q K^T / sqrt(D)) V within each sequence only, so
its result equals padded attention with a key mask at the real tokens, while padding costs
neither matmul nor memory. Implementations, chosen by device and what is installed:

* CUDA with ``flash_attn`` installed (fp16/bf16): FlashAttention's ``flash_attn_varlen_func``;
* CUDA otherwise: PyTorch SDPA on a jagged nested tensor (``torch.nested``), which dispatches
  to its FlashAttention / memory-efficient varlen kernels; the sequence-length bounds come
  from the host (:class:`Varlen`), so building the nested tensor reads nothing back from
  the device;
* CPU: one dense attention per sequence (``torch.split``), with the faster CPU dropout of
  :mod:`bertpipe.training.models.bert.model` when training.

``window`` (ModernBERT's local layers): a query attends only to keys at distance <= window
in its sequence; FlashAttention's ``window_size=(window, window)``, elsewhere the dense
attention of each sequence longer than the window gets a band mask.

Shapes: T packed tokens, A heads, D head size, B sequences.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Varlen", "nested_attention", "per_sequence_attention", "varlen_attention"]


@dataclasses.dataclass(frozen=True)
class Varlen:
    """Where the sequences of a packed batch start and end.

    ``cu_seqlens`` long [B + 1] on the model's device: 0, L_1, L_1 + L_2, ..., T.
    ``lengths`` the same on the host (a tuple of B ints), so no kernel needs to read the
    device to know them; ``max_seqlen``/``min_seqlen`` follow from it.
    """

    cu_seqlens: Tensor
    lengths: tuple[int, ...]

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths)

    @property
    def min_seqlen(self) -> int:
        return min(self.lengths)

    @property
    def starts(self) -> Tensor:
        """long [B]: the packed row of each sequence's first token ([CLS])."""
        return self.cu_seqlens[:-1]

    @classmethod
    def from_lengths(cls, lengths: Tensor, device: torch.device | str | None = None) -> Varlen:
        """From per-sequence lengths on the host (long [B], every one >= 1)."""
        host = lengths.cpu()
        if host.numel() == 0 or int(host.min()) < 1:
            raise ValueError("every sequence of a packed batch needs at least one token")
        cu = F.pad(host.to(torch.int64).cumsum(0), (1, 0))
        return cls(cu.to(device) if device is not None else cu, tuple(host.tolist()))


def band_mask(length: int, window: int | None, device: torch.device) -> Tensor | None:
    """bool [L, L], True where |query - key| <= ``window``; None when nothing is masked."""
    if window is None or length <= window + 1:
        return None
    index = torch.arange(length, device=device)
    return (index[:, None] - index[None, :]).abs() <= window


def _dense_attention(
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float, window: int | None = None
) -> Tensor:
    """[..., A, L, D] x3 -> [..., A, L, D], keys limited to ``window`` (None: all). Dropout
    through bertpipe.training.models.bert.model.dropout on CPU (SDPA's CPU kernels cannot drop
    attention weights)."""
    mask = band_mask(q.shape[-2], window, q.device)
    if dropout_p > 0 and q.device.type == "cpu":
        from bertpipe.training.models.bert.model import dropout

        scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2))
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        return torch.matmul(dropout(scores.softmax(-1), dropout_p, True), v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def per_sequence_attention(
    q: Tensor, k: Tensor, v: Tensor, varlen: Varlen, dropout_p: float, window: int | None = None
) -> Tensor:
    """Dense attention per sequence, sequences of equal length batched into one call
    (instances cut at the phase's length are common): [T, A, D] x3 -> [T, A, D]."""
    lengths = varlen.lengths
    if len(set(lengths)) == len(lengths):
        outs = [
            _dense_attention(
                qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1), dropout_p, window
            )
            for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)
        ]
        return torch.cat(outs, dim=1).transpose(0, 1)
    T, A, D = q.shape
    starts = [0, *itertools.accumulate(lengths)][:-1]
    groups: dict[int, list[int]] = {}
    for i, length in enumerate(lengths):
        groups.setdefault(length, []).append(starts[i])
    pieces, order = [], []
    for length, firsts in groups.items():
        rows = (torch.tensor(firsts)[:, None] + torch.arange(length)).reshape(-1).to(q.device)
        qg, kg, vg = (
            x.index_select(0, rows).view(len(firsts), length, A, D).transpose(1, 2)
            for x in (q, k, v)
        )  # [n, A, L, D]
        out = _dense_attention(qg, kg, vg, dropout_p, window)
        pieces.append(out.transpose(1, 2).reshape(-1, A, D))
        order.append(rows)
    rows = torch.cat(order)
    inverse = torch.empty_like(rows)
    inverse[rows] = torch.arange(T, device=rows.device)
    return torch.cat(pieces).index_select(0, inverse)


def nested_attention(q: Tensor, k: Tensor, v: Tensor, varlen: Varlen, dropout_p: float) -> Tensor:
    """SDPA on jagged nested tensors: [T, A, D] x3 -> [T, A, D]."""

    def jagged(x: Tensor) -> Tensor:  # [T, A, D] -> nested [B, A, j, D]
        return torch.nested.nested_tensor_from_jagged(
            x,
            offsets=varlen.cu_seqlens,
            min_seqlen=varlen.min_seqlen,
            max_seqlen=varlen.max_seqlen,
        ).transpose(1, 2)

    out = F.scaled_dot_product_attention(jagged(q), jagged(k), jagged(v), dropout_p=dropout_p)
    return out.transpose(1, 2).values()


@functools.cache
def _flash_varlen() -> Callable[..., Tensor] | None:
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:  # installed for another torch/CUDA
        return None
    return flash_attn_varlen_func  # type: ignore[no-any-return]


def _flash_attention(
    fn: Callable[..., Any],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    varlen: Varlen,
    dropout_p: float,
    window: int | None = None,
) -> Tensor:
    cu = varlen.cu_seqlens.to(torch.int32)
    m = varlen.max_seqlen
    if window is None:
        return fn(q, k, v, cu, cu, m, m, dropout_p=dropout_p)  # type: ignore[no-any-return]
    return fn(  # type: ignore[no-any-return]
        q, k, v, cu, cu, m, m, dropout_p=dropout_p, window_size=(window, window)
    )


@torch.compiler.disable
def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, varlen: Varlen, dropout_p: float, window: int | None = None
) -> Tensor:
    """Attention within each packed sequence: [T, A, D] x3 -> [T, A, D] (see the module doc),
    keys limited to distance <= ``window`` when it is given.

    Left out of ``torch.compile`` graphs: it is already one fused kernel on a GPU, and the
    per-sequence CPU path depends on the batch's lengths.
    """
    if window is not None and varlen.max_seqlen <= window + 1:
        window = None  # every sequence fits the window: plain attention
    if q.device.type == "cpu":
        return per_sequence_attention(q, k, v, varlen, dropout_p, window)
    flash = _flash_varlen() if q.dtype in (torch.float16, torch.bfloat16) else None
    if flash is not None:
        return _flash_attention(flash, q, k, v, varlen, dropout_p, window)
    if window is not None:  # SDPA on nested tensors takes no mask
        return per_sequence_attention(q, k, v, varlen, dropout_p, window)
    return nested_attention(q, k, v, varlen, dropout_p)
