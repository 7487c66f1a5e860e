"""BertForPreTraining: shapes, sparse MLM, masking, vocab padding, tying, init, variants."""

from __future__ import annotations

import dataclasses
from typing import cast

import pytest
import torch

from bertpipe.config import ConfigError, from_dict
from bertpipe.training.models.bert.model import (
    PRESETS,
    BertForPreTraining,
    BertLayer,
    BertModel,
    BertModelConfig,
)

VOCAB = 1003  # not a multiple of 8


def tiny_config(**overrides: object) -> BertModelConfig:
    fields = {"vocab_size": VOCAB, "hidden_size": 32, "num_layers": 2, "num_heads": 4}
    fields["intermediate_size"] = 64
    fields["max_position_embeddings"] = 64
    return BertModelConfig(**{**fields, **overrides})  # type: ignore[arg-type]


def make_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """B=3 rows of S=12 tokens, two of them padded, five masked positions."""
    B, S = 3, 12
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (B, S), generator=g)
    attention_mask = torch.ones(B, S, dtype=torch.long)
    attention_mask[1, 8:] = 0
    attention_mask[2, 5:] = 0
    input_ids = input_ids * attention_mask
    token_type_ids = torch.zeros(B, S, dtype=torch.long)
    token_type_ids[:, S // 2 :] = 1
    positions = torch.tensor([1, 3, S + 2, S + 7, 2 * S + 1])
    return {
        "input_ids": input_ids,
        "token_type_ids": token_type_ids * attention_mask,
        "attention_mask": attention_mask,
        "mlm_positions": positions,
        "mlm_labels": torch.randint(0, VOCAB, (positions.numel(),), generator=g),
        "nsp_labels": torch.tensor([0, 1, 0]),
    }


def model_for(cfg: BertModelConfig, seed: int = 0) -> BertForPreTraining:
    torch.manual_seed(seed)
    return BertForPreTraining(cfg)


def test_shapes_and_losses() -> None:
    model = model_for(tiny_config()).train()
    batch = make_batch()
    out = model(**batch)
    assert out.mlm_logits.shape == (5, VOCAB)
    assert out.nsp_logits.shape == (3, 2)
    assert out.loss is not None and out.mlm_loss is not None and out.nsp_loss is not None
    torch.testing.assert_close(out.loss, out.mlm_loss + out.nsp_loss)
    assert out.mlm_loss.dtype == torch.float32
    assert 0 <= int(out.mlm_correct) <= 5 and int(out.mlm_count) == 5
    assert 0 <= int(out.nsp_correct) <= 3
    assert not out.mlm_correct.requires_grad
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())

    encoder = BertModel(tiny_config())(batch["input_ids"], batch["token_type_ids"])
    assert encoder.sequence_output.shape == (3, 12, 32)
    assert encoder.pooled_output is not None and encoder.pooled_output.shape == (3, 32)


def test_sparse_logits_equal_full_logits_at_positions() -> None:
    model = model_for(tiny_config()).eval()
    batch = make_batch()
    full = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
    assert full.mlm_logits.shape == (3, 12, VOCAB)
    sparse = model(**batch)
    gathered = full.mlm_logits.reshape(-1, VOCAB)[batch["mlm_positions"]]
    torch.testing.assert_close(sparse.mlm_logits, gathered, atol=1e-5, rtol=1e-5)
    # the same loss from [B, S] labels with -100 at the unmasked tokens (transformers' way)
    labels = torch.full((3 * 12,), -100)
    labels[batch["mlm_positions"]] = batch["mlm_labels"]
    dense = model(
        batch["input_ids"],
        batch["token_type_ids"],
        batch["attention_mask"],
        mlm_labels=labels.view(3, 12),
        nsp_labels=batch["nsp_labels"],
    )
    torch.testing.assert_close(dense.loss, sparse.loss)
    # -100 inside a fixed-size position list is ignored
    padded_labels = batch["mlm_labels"].clone()
    padded_labels[-1] = -100
    part = model(**{**batch, "mlm_labels": padded_labels})
    assert int(part.mlm_count) == 4
    expected = torch.nn.functional.cross_entropy(sparse.mlm_logits[:4], batch["mlm_labels"][:4])
    torch.testing.assert_close(part.mlm_loss, expected)


def test_padding_does_not_change_real_tokens() -> None:
    model = model_for(tiny_config()).eval()
    batch = make_batch()
    changed = batch["input_ids"].clone()
    changed[batch["attention_mask"] == 0] = 7
    args = (batch["token_type_ids"], batch["attention_mask"])
    a = model.bert(batch["input_ids"], *args)
    b = model.bert(changed, *args)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(a.sequence_output[real], b.sequence_output[real])
    torch.testing.assert_close(a.pooled_output, b.pooled_output)
    # and the mask matters at all
    c = model.bert(changed, batch["token_type_ids"])
    assert not torch.allclose(a.sequence_output[real], c.sequence_output[real])


def test_vocab_padding() -> None:
    cfg = tiny_config()
    assert cfg.padded_vocab_size == 1008 and cfg.padded_vocab_size % 8 == 0
    assert tiny_config(pad_vocab_multiple=1).padded_vocab_size == VOCAB
    assert tiny_config(vocab_size=1024).padded_vocab_size == 1024
    model = model_for(cfg)
    assert model.bert.embeddings.word_embeddings.weight.shape == (1008, 32)
    assert model.cls.predictions.bias.shape == (1008,)
    assert torch.all(model.bert.embeddings.word_embeddings.weight[VOCAB:] == 0)
    out = model.eval()(make_batch()["input_ids"])
    assert out.mlm_logits.shape[-1] == VOCAB


def test_decoder_is_tied_to_word_embeddings() -> None:
    model = model_for(tiny_config())
    embedding = model.bert.embeddings.word_embeddings.weight
    decoder = model.cls.predictions.decoder
    assert decoder.weight is embedding
    assert decoder.weight.data_ptr() == embedding.data_ptr()
    assert decoder.bias is model.cls.predictions.bias
    assert sum(p.numel() for p in model.parameters()) == model.config.num_parameters()
    batch = make_batch()
    out = model(batch["input_ids"], mlm_positions=batch["mlm_positions"])
    # a loss on the MLM logits alone reaches the embedding only through the decoder
    out.mlm_logits[:, batch["mlm_labels"]].sum().backward()
    grad = embedding.grad
    assert grad is not None and grad[batch["mlm_labels"]].abs().sum() > 0
    with torch.no_grad():
        embedding[5, 0] += 1.0
    assert decoder.weight[5, 0] == embedding[5, 0]


def test_init_statistics() -> None:
    cfg = BertModelConfig.preset("mini", 5000)
    model = model_for(cfg)
    words = model.bert.embeddings.word_embeddings.weight
    assert torch.all(words[cfg.pad_token_id] == 0)
    assert words[1 : cfg.vocab_size].std().item() == pytest.approx(0.02, rel=0.05)
    layer = cast(BertLayer, model.bert.encoder.layer[0])
    query = layer.attention.self.query
    assert query.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(query.bias == 0)
    ln = layer.output.LayerNorm
    assert torch.all(ln.weight == 1) and torch.all(ln.bias == 0)
    assert model.cls.predictions.transform.dense.weight.std().item() == pytest.approx(
        0.02, rel=0.05
    )
    assert torch.all(model.cls.predictions.bias == 0)


@pytest.mark.parametrize(
    "overrides",
    [{"pre_layer_norm": True}, {"position_embedding": "sinusoidal"}],
    ids=["pre_ln", "sinusoidal"],
)
def test_variants_run_and_backprop(overrides: dict[str, object]) -> None:
    cfg = tiny_config(**overrides)
    model = model_for(cfg).train()
    names = dict(model.named_parameters())
    if cfg.pre_layer_norm:
        assert "bert.encoder.final_layer_norm.weight" in names
    else:
        assert "bert.embeddings.position_embeddings.weight" not in names
        assert "sinusoidal_table" not in str(list(model.state_dict()))
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
    out = model(**make_batch())
    assert out.loss is not None and torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_activation_checkpointing_same_loss_and_grads() -> None:
    batch = make_batch()
    results = []
    for checkpointing in (False, True):
        model = model_for(tiny_config(activation_checkpointing=checkpointing)).train()
        torch.manual_seed(1)  # same dropout masks; checkpoint replays the RNG state
        out = model(**batch)
        out.loss.backward()
        grads = {n: torch.clone(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.loss.detach(), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == len(list(model.parameters()))
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], msg=name)


def test_autocast_keeps_losses_fp32() -> None:
    model = model_for(tiny_config()).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**make_batch())
    assert out.mlm_logits.dtype == torch.bfloat16
    assert out.mlm_loss.dtype == torch.float32 and out.nsp_loss.dtype == torch.float32


@pytest.mark.parametrize(
    ("preset", "millions"),
    [("tiny", 4.4), ("mini", 11.3), ("small", 29.1), ("medium", 41.7), ("base", 110.1)],
)
def test_preset_parameter_counts(preset: str, millions: float) -> None:
    cfg = BertModelConfig.preset(preset, 30522)
    assert cfg.num_parameters() / 1e6 == pytest.approx(millions, abs=0.1)
    if preset != "base":  # building base takes seconds; its formula is the same
        model = BertForPreTraining(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()
        assert sum(p.numel() for p in model.bert.parameters()) == cfg.num_parameters(False)


def test_published_sizes() -> None:
    base = BertModelConfig.preset("base", 30522).num_parameters(with_heads=False)
    large = BertModelConfig.preset("large", 30522).num_parameters(with_heads=False)
    assert base / 1e6 == pytest.approx(110, rel=0.01)
    assert large / 1e6 == pytest.approx(335, rel=0.02)
    assert set(PRESETS) == {"tiny", "mini", "small", "medium", "base", "large"}
    cfg = BertModelConfig.preset("large", 100, hidden_dropout=0.0)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.ffn_size) == (24, 1024, 16, 4096)
    assert cfg.hidden_dropout == 0.0 and cfg.head_dim == 64


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"hidden_size": 30}, "hidden_size"),
        ({"num_heads": 0}, "num_heads"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"hidden_dropout": 1.0}, "hidden_dropout"),
        ({"pad_token_id": VOCAB}, "pad_token_id"),
        ({"layer_norm_eps": 0.0}, "layer_norm_eps"),
        ({"intermediate_size": 0}, "intermediate_size"),
        ({"position_embedding": "rotary"}, "position_embedding"),
    ],
)
def test_config_errors_name_the_key(overrides: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        tiny_config(**overrides)
    assert info.value.key == key
    assert key in str(info.value)


def test_config_loads_through_the_config_loader() -> None:
    data = {k: v for k, v in dataclasses.asdict(tiny_config()).items()}
    assert from_dict(BertModelConfig, data) == tiny_config()
    with pytest.raises(ConfigError) as info:
        from_dict(BertModelConfig, {**data, "num_heads": 5}, prefix="model")
    assert info.value.key == "model.hidden_size"
    with pytest.raises(ConfigError, match="preset"):
        BertModelConfig.preset("huge", 100)
