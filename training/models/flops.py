"""Training FLOPs of BERT pre-training and model FLOP utilisation (MFU).

Only matrix multiplications are counted; a product of an [m, k] and a [k, n] matrix costs
``2 * m * n * k`` FLOPs. LayerNorm, softmax, GELU, dropout and embedding lookups are
negligible next to them and left out.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from bertpipe.training.models.bert.config import BertModelConfig
from bertpipe.training.models.families import family_of
from bertpipe.training.models.modernbert.config import ModernBertModelConfig

__all__ = ["PEAK_TFLOPS", "mfu", "peak_flops", "training_flops", "training_flops_per_sequence"]

# Dense (no sparsity) peak tensor/vector throughput in TFLOP/s from the vendors' data sheets.
# Device patterns are regular expressions searched in torch.cuda.get_device_name(); the first
# match wins, so the more specific names come first.
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"\bH100\b.*\bPCIe\b", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    (r"\bH100\b", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM
    (r"\bH200\b", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"\bA100\b", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"\bL40S\b", {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bV100\b", {"fp16": 125.0, "fp32": 15.7}),  # SXM2; no bf16 or tf32
    (r"\bT4\b", {"fp16": 65.0, "fp32": 8.1}),
)

_DTYPE_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "tf32": "tf32",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
}


def training_flops_per_sequence(
    cfg: BertModelConfig | ModernBertModelConfig,
    seq_len: int,
    num_masked: int,
    activation_checkpointing: bool = False,
) -> float:
    """FLOPs of one training step (forward + backward) for one sequence.

    With S = ``seq_len``, H hidden, I intermediate, L layers, V the padded vocabulary and
    M = ``num_masked``::

        layer    = 4 * 2*S*H*H          (query, key, value, attention output)
                 + 2 * 2*S*H*I          (the two feed-forward matmuls)
                 + 2 * 2*S*S*H          (scores Q K^T and the weighted sum of V)
        forward  = L * layer
                 + 2*H*H                (pooler, [CLS] only)
                 + 2*H*2                (NSP classifier)
                 + M * (2*H*H + 2*H*V)  (MLM transform and vocabulary projection, masked only)
        training = 3 * forward          (backward = 2 x forward)
                 + L * layer            (only with activation checkpointing: the encoder's
                                         forward runs again in the backward pass)

    ModernBERT: the feed-forward is a GeGLU (``3 * 2*S*H*I``), there is no pooler or NSP
    classifier, and a local layer scores each query against the keys of its window only
    (``2 * 2*S*min(S, 2*window + 1)*H``, the work of windowed FlashAttention).

    Without checkpointing this is the model FLOPs of MFU; with it, the hardware FLOPs.
    """
    return training_flops(cfg, [seq_len], num_masked, activation_checkpointing)


def training_flops(
    cfg: BertModelConfig | ModernBertModelConfig,
    lengths: Sequence[int] | np.ndarray,
    num_masked: int,
    activation_checkpointing: bool = False,
) -> float:
    """FLOPs of one training step of a batch whose sequences have ``lengths`` (S_i) and
    ``num_masked`` MLM positions in all: :func:`training_flops_per_sequence` summed over the
    sequences, so it counts what an unpadded encoder computes. Give the padded length for
    every row to count what a padded encoder computes. The terms are the family's
    (:mod:`bertpipe.training.models.bert.costs`,
    :mod:`bertpipe.training.models.modernbert.costs`)."""
    S = np.asarray(lengths, dtype=np.float64)
    return float(family_of(cfg).costs.training_flops(cfg, S, num_masked, activation_checkpointing))


def peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of a GPU (``torch.cuda.get_device_name()``) for a compute dtype
    (bf16, fp16, tf32, fp32 or the torch names); None when either is unknown."""
    key = _DTYPE_ALIASES.get(dtype.lower().removeprefix("torch."))
    if key is None:
        return None
    for pattern, table in PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            tflops = table.get(key)
            return None if tflops is None else tflops * 1e12
    return None


def mfu(flops_per_s: float, peak: float | None) -> float | None:
    """Achieved over peak FLOP/s (0..1); None when the peak is unknown."""
    if peak is None or peak <= 0:
        return None
    return flops_per_s / peak
