"""FLOP counts against hand-computed tiny cases, peak table look-ups, MFU."""

from __future__ import annotations

import pytest

from bertpipe.training.models.bert.model import BertModelConfig
from bertpipe.training.models.flops import mfu, peak_flops, training_flops_per_sequence


def test_hand_computed_tiny_case() -> None:
    # H=4, I=8, L=1, S=2, V=8 (already a multiple of 8), one masked token
    cfg = BertModelConfig(
        vocab_size=8, hidden_size=4, num_layers=1, num_heads=2, intermediate_size=8
    )
    # per layer: 4 projections 4*2*2*4*4 = 256, FFN 2*2*2*4*8 = 256, attention 2*2*2*2*4 = 64
    layer = 256 + 256 + 64
    pooler, nsp = 2 * 4 * 4, 2 * 4 * 2
    mlm = 1 * (2 * 4 * 4 + 2 * 4 * 8)
    forward = layer + pooler + nsp + mlm
    assert forward == 720
    assert training_flops_per_sequence(cfg, seq_len=2, num_masked=1) == 3 * 720
    with_recompute = training_flops_per_sequence(cfg, 2, 1, activation_checkpointing=True)
    assert with_recompute == 3 * 720 + layer


def test_padded_vocab_and_masked_count() -> None:
    cfg = BertModelConfig(
        vocab_size=5, hidden_size=4, num_layers=1, num_heads=1, intermediate_size=8
    )
    # V pads to 8: each masked token costs 2*4*4 + 2*4*8 = 96 forward FLOPs, x3 for training
    assert (
        training_flops_per_sequence(cfg, 2, 3) - training_flops_per_sequence(cfg, 2, 1)
        == 2 * 3 * 96
    )


def test_base_is_about_six_n_per_token() -> None:
    cfg = BertModelConfig.preset("base", 30522)
    flops = training_flops_per_sequence(cfg, seq_len=128, num_masked=20)
    encoder_params = 12 * (4 * 768 * 768 + 2 * 768 * 3072)
    # the 6 * N * tokens rule of thumb for the encoder matmuls, plus attention and heads
    assert 6 * encoder_params * 128 < flops < 1.2 * 6 * encoder_params * 128


def test_peak_flops_table() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H200", "bfloat16") == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == pytest.approx(756e12)
    assert peak_flops("NVIDIA A100-SXM4-80GB", "torch.bfloat16") == pytest.approx(312e12)
    assert peak_flops("NVIDIA A100-SXM4-40GB", "tf32") == pytest.approx(156e12)
    assert peak_flops("NVIDIA A10", "fp32") == pytest.approx(31.2e12)
    assert peak_flops("Tesla V100-SXM2-16GB", "fp16") == pytest.approx(125e12)
    assert peak_flops("NVIDIA L40S", "bf16") == pytest.approx(362e12)
    assert peak_flops("NVIDIA L4", "bf16") == pytest.approx(121e12)
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # V100 has no bf16
    assert peak_flops("NVIDIA A10G", "bf16") is None
    assert peak_flops("cpu", "fp32") is None
    assert peak_flops("NVIDIA H100", "int8") is None


def test_mfu() -> None:
    assert mfu(494.7e12, 989.4e12) == pytest.approx(0.5)
    assert mfu(1e12, None) is None
