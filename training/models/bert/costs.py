"""What BERT costs to train: FLOPs of a step and the activations a layer keeps for the
backward pass (the terms :mod:`bertpipe.training.models.flops` and ``bertpipe plan`` sum;
ModernBERT's are in :mod:`bertpipe.training.models.modernbert.costs`)."""

from __future__ import annotations

import numpy as np

from bertpipe.training.models.bert.config import BertModelConfig

__all__ = ["ACTIVATIONS", "head_activation_bytes", "layer_activation_bytes", "training_flops"]

ACTIVATIONS = (
    "activations per layer s*b*(e*(8h+2I)+2h) bytes, e={e} (Korthikanti et al. 2022: 34*s*b*h "
    "for I=4h at 16 bit)"
)
"""The plan's statement of :func:`layer_activation_bytes` (``{e}``: the element size)."""


def training_flops(
    cfg: BertModelConfig, lengths: np.ndarray, num_masked: int, activation_checkpointing: bool
) -> float:
    """``L * ((4*2*H*H + 2*2*H*I) * S + 2*2*H*S*S)`` for the encoder, the pooler and NSP
    classifier per sequence, the MLM head at the masked positions, times 3 (forward and
    backward), plus the encoder again with activation checkpointing."""
    H, I, L = cfg.hidden_size, cfg.ffn_size, cfg.num_layers  # noqa: E741
    tokens, squares = float(lengths.sum()), float((lengths * lengths).sum())
    mlm = num_masked * (2 * H * H + 2 * H * cfg.padded_vocab_size)
    encoder = L * ((4 * 2 * H * H + 2 * 2 * H * I) * tokens + 2 * 2 * H * squares)
    heads = lengths.size * (2 * H * H + 2 * H * 2) + mlm
    return float(3 * (encoder + heads) + (encoder if activation_checkpointing else 0))


def layer_activation_bytes(cfg: BertModelConfig, s: int, b: int, e: int, mask_bytes: int) -> int:
    """``s·b·(e·(8h + 2I) + 2h·m)``: QKV input, Q, K, V, attention output, FFN input, GELU
    input and output (2I), both LayerNorm inputs, and two dropout masks of ``m`` bytes."""
    h, inter = cfg.hidden_size, cfg.ffn_size
    return s * b * (e * (8 * h + 2 * inter) + 2 * h * mask_bytes)


def head_activation_bytes(cfg: BertModelConfig, b: int, n: int, e: int) -> int:
    """The MLM head at ``n`` masked positions (``n·(4·e·h + V·(e + 8))``) plus the pooler
    and NSP classifier (``b·3·e·h``)."""
    h = cfg.hidden_size
    return n * (4 * e * h + cfg.padded_vocab_size * (e + 8)) + b * 3 * e * h
