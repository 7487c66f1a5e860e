"""Export to / import from transformers' BERT folder format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bertpipe.training.models.bert.model import BertForPreTraining, BertModel, BertModelConfig
from bertpipe.training.models.hf import (
    export_state_dict,
    hf_config_dict,
    load_hf_folder,
    load_into,
    save_hf_folder,
)

VOCAB = 1003  # not a multiple of 8: the export must strip the padding


def tiny_config(**overrides: object) -> BertModelConfig:
    fields = {"vocab_size": VOCAB, "hidden_size": 32, "num_layers": 2, "num_heads": 4}
    fields.update(intermediate_size=48, max_position_embeddings=40, type_vocab_size=2)
    return BertModelConfig(**{**fields, **overrides})  # type: ignore[arg-type]


def random_model(cfg: BertModelConfig, seed: int = 0) -> BertForPreTraining:
    """A model whose every parameter is random (biases and LayerNorms too), so that a
    wrongly mapped tensor cannot go unnoticed."""
    torch.manual_seed(seed)
    model = BertForPreTraining(cfg)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
        # the padding rows beyond the real vocabulary stay zero: they are never exported
        model.bert.embeddings.word_embeddings.weight[VOCAB:] = 0
        model.cls.predictions.bias[VOCAB:] = 0
    return model.eval()


def padded_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, VOCAB, (3, 10), generator=g)
    attention_mask = torch.ones(3, 10, dtype=torch.long)
    attention_mask[1, 6:] = 0
    attention_mask[2, 3:] = 0
    token_type_ids = torch.zeros(3, 10, dtype=torch.long)
    token_type_ids[:, 4:] = 1
    return {
        "input_ids": input_ids * attention_mask,
        "token_type_ids": token_type_ids * attention_mask,
        "attention_mask": attention_mask,
    }


def test_export_names_shapes_and_copies() -> None:
    model = random_model(tiny_config())
    state = export_state_dict(model)
    assert state["bert.embeddings.word_embeddings.weight"].shape == (VOCAB, 32)
    assert state["cls.predictions.bias"].shape == (VOCAB,)
    assert "cls.predictions.decoder.weight" not in state
    assert "bert.encoder.layer.1.attention.self.query.weight" in state
    assert "bert.embeddings.position_ids" not in state
    embedding = model.bert.embeddings.word_embeddings.weight
    assert state["bert.embeddings.word_embeddings.weight"].data_ptr() != embedding.data_ptr()
    assert all(t.is_contiguous() for t in state.values())
    config = hf_config_dict(model.config)
    assert config["vocab_size"] == VOCAB and config["architectures"] == ["BertForPreTraining"]
    assert config["num_hidden_layers"] == 2 and config["intermediate_size"] == 48


def test_round_trip_through_folder(tmp_path: Path) -> None:
    model = random_model(tiny_config())
    save_hf_folder(model, tmp_path, extra_files={"vocab.txt": b"[PAD]\n[UNK]\n"})
    assert (tmp_path / "vocab.txt").read_bytes() == b"[PAD]\n[UNK]\n"
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "bert"
    cfg, state = load_hf_folder(tmp_path)
    assert cfg.vocab_size == VOCAB and cfg.num_layers == 2 and cfg.ffn_size == 48
    fresh = BertForPreTraining(cfg)
    report = load_into(fresh, state)
    assert report.missing == [] and report.unexpected == []
    original, loaded = model.state_dict(), fresh.state_dict()
    assert original.keys() == loaded.keys()
    for key in original:
        torch.testing.assert_close(loaded[key], original[key], rtol=0, atol=0, msg=key)
    assert fresh.cls.predictions.decoder.weight is fresh.bert.embeddings.word_embeddings.weight


def test_old_names_and_missing_heads() -> None:
    model = random_model(tiny_config())
    old = {}
    for key, value in export_state_dict(model).items():
        if key.startswith("bert."):  # a bare BertModel checkpoint with gamma/beta names
            key = key.removeprefix("bert.").replace("LayerNorm.weight", "LayerNorm.gamma")
            old[key.replace("LayerNorm.bias", "LayerNorm.beta")] = value
    old["embeddings.position_ids"] = torch.arange(40)[None]  # persistent in old transformers
    fresh = BertForPreTraining(model.config)
    with pytest.raises(ValueError, match=r"cls\.predictions"):
        load_into(fresh, old, strict_heads=True)
    report = load_into(fresh, old, strict_heads=False)
    assert report.unexpected == ["bert.embeddings.position_ids"]
    assert report.missing and all(k.startswith("cls.") for k in report.missing)
    key = "bert.encoder.layer.1.output.LayerNorm.bias"
    torch.testing.assert_close(fresh.state_dict()[key], model.state_dict()[key])
    bare = BertModel(model.config)  # loads into a bare encoder too, cls.* reported
    report = load_into(bare, export_state_dict(model))
    assert report.missing == [] and all(k.startswith("cls.") for k in report.unexpected)
    encoder_only = {k: v for k, v in old.items() if not k.startswith("encoder.layer.1.")}
    with pytest.raises(ValueError, match=r"encoder\.layer\.1"):
        load_into(BertForPreTraining(model.config), encoder_only, strict_heads=False)
    wrong = {**old, "embeddings.word_embeddings.weight": torch.zeros(VOCAB - 1, 32)}
    with pytest.raises(ValueError, match="does not fit"):
        load_into(BertForPreTraining(model.config), wrong, strict_heads=False)


def test_pytorch_bin_folder(tmp_path: Path) -> None:
    model = random_model(tiny_config())
    save_hf_folder(model, tmp_path)
    state = export_state_dict(model)
    (tmp_path / "model.safetensors").unlink()
    torch.save(state, tmp_path / "pytorch_model.bin")
    _, loaded = load_hf_folder(tmp_path)
    assert loaded.keys() == state.keys()
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_hf_folder(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [({"pre_layer_norm": True}, "pre-LayerNorm"), ({"position_embedding": "sinusoidal"}, "sinus")],
)
def test_refuses_models_without_an_hf_equivalent(
    tmp_path: Path, overrides: dict[str, object], match: str
) -> None:
    model = BertForPreTraining(tiny_config(**overrides))
    with pytest.raises(ValueError, match=match):
        save_hf_folder(model, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.integration
def test_transformers_loads_our_export_and_we_load_theirs(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model = random_model(tiny_config())
    inputs = padded_inputs()
    with torch.no_grad():
        ours = model(**inputs)

    save_hf_folder(model, tmp_path / "ours")
    theirs, info = transformers.BertForPreTraining.from_pretrained(
        tmp_path / "ours", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    theirs.eval()
    with torch.no_grad():
        out = theirs(**inputs)
    torch.testing.assert_close(out.prediction_logits, ours.mlm_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.seq_relationship_logits, ours.nsp_logits, atol=1e-5, rtol=1e-5)

    # a folder written by transformers itself loads into ours with the same logits
    hf_config = transformers.BertConfig(**hf_config_dict(tiny_config()))
    torch.manual_seed(3)
    hf_model = transformers.BertForPreTraining(hf_config).eval()
    hf_model.save_pretrained(tmp_path / "theirs")
    cfg, state = load_hf_folder(tmp_path / "theirs")
    fresh = BertForPreTraining(cfg).eval()
    report = load_into(fresh, state)
    assert report.missing == [] and report.unexpected == []
    with torch.no_grad():
        expected = hf_model(**inputs)
        got = fresh(**inputs)
    torch.testing.assert_close(got.mlm_logits, expected.prediction_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        got.nsp_logits, expected.seq_relationship_logits, atol=1e-5, rtol=1e-5
    )


@pytest.mark.integration
def test_bench_model_runs_and_prints_one_json_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    from bertpipe.app.bench.model import main

    monkeypatch.setattr("bertpipe.logs.setup_logging", lambda *args, **kwargs: None)

    result = main(["--preset", "tiny", "--batch-size", "2", "--seq-len", "16", "--steps", "1"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == result
    assert result["ratio"] == pytest.approx(result["ours_s"] / result["hf_s"])
    assert result["preset"] == "tiny" and result["seq_len"] == 16
