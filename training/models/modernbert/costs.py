"""What ModernBERT costs to train: FLOPs of a step and the activations a layer keeps for
the backward pass (the terms :mod:`bertpipe.training.models.flops` and ``bertpipe plan`` sum;
BERT's are in :mod:`bertpipe.training.models.bert.costs`)."""

from __future__ import annotations

import numpy as np

from bertpipe.training.models.modernbert.config import ModernBertModelConfig

__all__ = ["ACTIVATIONS", "head_activation_bytes", "layer_activation_bytes", "training_flops"]

ACTIVATIONS = "activations per layer s*b*e*(10h+4I) bytes (ModernBERT: no dropout, GeGLU), e={e}"
"""The plan's statement of :func:`layer_activation_bytes` (``{e}``: the element size)."""


def training_flops(
    cfg: ModernBertModelConfig,
    lengths: np.ndarray,
    num_masked: int,
    activation_checkpointing: bool,
) -> float:
    """The feed-forward is a GeGLU (Wi: H -> 2I, Wo: I -> H: ``3 * 2*S*H*I``), there is no
    pooler or NSP classifier, and a local layer scores each query against the keys of its
    window only (``2 * 2*S*min(S, 2*window + 1)*H``, the work of windowed FlashAttention)."""
    H, I, L = cfg.hidden_size, cfg.ffn_size, cfg.num_layers  # noqa: E741
    tokens, squares = float(lengths.sum()), float((lengths * lengths).sum())
    mlm = num_masked * (2 * H * H + 2 * H * cfg.padded_vocab_size)
    n_global = sum(cfg.is_global(i) for i in range(L))
    local = float((lengths * np.minimum(lengths, 2 * cfg.window + 1)).sum())
    attention = 2 * 2 * H * (n_global * squares + (L - n_global) * local)
    encoder = L * (4 * 2 * H * H + 3 * 2 * H * I) * tokens + attention
    return float(3 * (encoder + mlm) + (encoder if activation_checkpointing else 0))


def layer_activation_bytes(
    cfg: ModernBertModelConfig, s: int, b: int, e: int, mask_bytes: int
) -> int:
    """``s·b·e·(10h + 4I)``: the two pre-norm inputs, the Q/K/V input, Q, K, V, Q and K
    again after the rotary embedding, the attention output (in both layouts) and the
    out-projection's input, and the GeGLU's 2I projection, GELU output and gated product
    (4I); no dropout by default, so no masks."""
    return s * b * e * (10 * cfg.hidden_size + 4 * cfg.ffn_size)


def head_activation_bytes(cfg: ModernBertModelConfig, b: int, n: int, e: int) -> int:
    """The MLM head at ``n`` masked positions: ``n·(4·e·h + V·(e + 8))``; no pooler or NSP."""
    return n * (4 * e * cfg.hidden_size + cfg.padded_vocab_size * (e + 8))
