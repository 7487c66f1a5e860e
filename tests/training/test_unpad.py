"""The unpadded (packed) encoder path equals the padded one; compiled layers equal eager."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from bertpipe.app.bench.model import make_batch
from bertpipe.training.models.attention import Varlen, nested_attention, per_sequence_attention
from bertpipe.training.models.bert.model import BertForPreTraining, BertModelConfig, compile_layers
from bertpipe.training.models.flops import training_flops, training_flops_per_sequence
from bertpipe.training.pretrain.batches import BatchPrep
from bertpipe.training.pretrain.data.collate import unpad_batch

VOCAB = 300


def _batch(seed: int = 0, batch_size: int = 6, seq_len: int = 32) -> dict[str, torch.Tensor]:
    batch = make_batch(batch_size, seq_len, VOCAB, seed)
    batch.pop("hf_labels")
    return batch


def _model(**overrides: object) -> BertForPreTraining:
    torch.manual_seed(0)
    cfg = BertModelConfig.preset(
        "tiny", vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0, **overrides
    )
    return BertForPreTraining(cfg)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_unpad_batch_packs_real_tokens_and_renumbers_masked_positions() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])  # the second row has a hole
    ids = torch.tensor([[5, 6, 7, 0], [8, 0, 9, 10]])
    batch = {
        "input_ids": ids,
        "token_type_ids": torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]]),
        "attention_mask": mask,
        "mlm_positions": torch.tensor([1, 6, 7]),  # (0, 1), (1, 2), (1, 3)
        "mlm_labels": torch.tensor([6, 9, 10]),
        "nsp_labels": torch.tensor([0, 1]),
    }
    packed = unpad_batch(batch)
    assert packed["input_ids"].tolist() == [5, 6, 7, 8, 9, 10]
    assert packed["token_type_ids"].tolist() == [0, 1, 1, 0, 1, 1]
    assert packed["position_ids"].tolist() == [0, 1, 2, 0, 2, 3]
    assert packed["cu_seqlens"].tolist() == [0, 3, 6]
    assert packed["seq_lengths"] == (3, 3)
    assert packed["mlm_positions"].tolist() == [1, 4, 5]
    assert packed["input_ids"][packed["mlm_positions"]].tolist() == [6, 9, 10]


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"pre_layer_norm": True},
        {"position_embedding": "sinusoidal"},
        {"activation_checkpointing": True},
    ],
    ids=["post-ln", "pre-ln", "sinusoidal", "checkpointing"],
)
def test_unpadded_equals_padded(overrides: dict[str, object]) -> None:
    """Losses, accuracies, logits and every gradient agree within fp32 rounding."""
    model = _model(**overrides).train()
    batch = _batch()
    assert (batch["attention_mask"] == 0).any(), "the batch must hold padding"
    padded = model(**batch)
    padded.loss.backward()
    padded_grads = _grads(model)
    model.zero_grad()
    packed = model(**unpad_batch(batch))
    packed.loss.backward()
    torch.testing.assert_close(packed.mlm_logits, padded.mlm_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.nsp_logits, padded.nsp_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.loss, padded.loss, rtol=1e-6, atol=1e-6)
    assert int(packed.mlm_correct) == int(padded.mlm_correct)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, padded_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_unpadded_trains_with_dropout() -> None:
    cfg = BertModelConfig.preset("tiny", vocab_size=VOCAB)
    torch.manual_seed(0)
    model = BertForPreTraining(cfg).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = unpad_batch(_batch())
    losses = []
    for _ in range(15):
        out = model(**batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out.loss.detach()))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 1.0


def test_nested_tensor_attention_equals_per_sequence() -> None:
    """The CUDA path (SDPA on jagged nested tensors) checked against the CPU path, on CPU."""
    torch.manual_seed(0)
    lengths = torch.tensor([5, 17, 1, 32])
    varlen = Varlen.from_lengths(lengths)
    q, k, v = (torch.randn(int(lengths.sum()), 2, 16, requires_grad=True) for _ in range(3))
    out = nested_attention(q, k, v, varlen, 0.0)
    ref = per_sequence_attention(q, k, v, varlen, 0.0)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_varlen_rejects_empty_sequences() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        Varlen.from_lengths(torch.tensor([3, 0]))


def test_flops_count_real_tokens() -> None:
    cfg = BertModelConfig.preset("base", vocab_size=30522)
    per = training_flops_per_sequence(cfg, 128, 20)
    assert training_flops(cfg, [128, 128], 40) == pytest.approx(2 * per)
    # shorter sequences cost less than the padded shape, quadratically so in attention
    assert training_flops(cfg, [64, 128], 40) < training_flops(cfg, [128, 128], 40)


def test_batch_prep_counts_real_and_padded_work() -> None:
    cfg = BertModelConfig.preset("tiny", vocab_size=VOCAB)
    batch = _batch()
    device_batch, stats = BatchPrep(cfg, torch.device("cpu"), unpad=True)(batch)
    lengths = batch["attention_mask"].sum(1)
    assert stats.real_tokens == int(lengths.sum()) == device_batch["input_ids"].numel()
    assert stats.padded_tokens == batch["input_ids"].numel()
    assert stats.sequences == 6
    assert stats.flops == pytest.approx(
        training_flops(cfg, lengths.numpy(), batch["mlm_positions"].numel())
    )
    assert stats.padded_flops > stats.flops


def _inductor_works() -> str | None:
    if shutil.which("g++") is None and shutil.which("c++") is None:
        return "torch.compile's CPU backend (inductor) needs a C++ compiler; none is installed"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_inductor_works() is not None, reason=str(_inductor_works()))
@pytest.mark.parametrize("unpad", [True, False], ids=["unpadded", "padded"])
def test_compiled_equals_eager(unpad: bool) -> None:
    eager, compiled = _model().train(), _model().train()
    assert compile_layers(compiled) > 0
    # two batch shapes: the second must reuse the dynamic graph and still agree
    for seed, size in ((0, 6), (1, 5)):
        batch = _batch(seed, size)
        if unpad:
            batch = unpad_batch(batch)
        eager.zero_grad()
        compiled.zero_grad()
        ref, out = eager(**batch), compiled(**batch)
        ref.loss.backward()
        out.loss.backward()
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
        for (name, g), (_, r) in zip(_grads(compiled).items(), _grads(eager).items(), strict=True):
            torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-5, msg=name)
    assert set(compiled.state_dict()) == set(eager.state_dict())
