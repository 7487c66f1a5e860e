"""ModernBERT: the same model as transformers' ModernBertForMaskedLM, both ways, packed or
padded, with sequences longer than the local window so that the alternating attention counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bertpipe.config import ConfigError
from bertpipe.training.models.attention import Varlen
from bertpipe.training.models.families import config_from_dict, pretraining_model
from bertpipe.training.models.flops import training_flops
from bertpipe.training.models.hf import load_hf_folder, load_into, save_hf_folder
from bertpipe.training.models.modernbert.model import ModernBertForMaskedLM, ModernBertModelConfig

transformers = pytest.importorskip("transformers")

VOCAB = 101  # not a multiple of 8: the padded rows are exercised


def _cfg(**overrides: object) -> ModernBertModelConfig:
    shape: dict[str, object] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_layers": 4,  # global, local, local, global
        "num_heads": 4,
        "intermediate_size": 96,
        "local_attention": 16,  # keys within 8 tokens
        "max_position_embeddings": 128,
    }
    return ModernBertModelConfig(**{**shape, **overrides})  # type: ignore[arg-type]


def _batch(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    ids = torch.randint(5, VOCAB, (len(lengths), S), generator=g)
    mask = (torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def _packed(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    lengths = mask.sum(1)
    positions = torch.cat([torch.arange(int(n)) for n in lengths])
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    out = model(
        ids[mask.bool()], position_ids=positions, cu_seqlens=cu, seq_lengths=tuple(lengths.tolist())
    )
    return out.mlm_logits


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModernBertForMaskedLM, Path]:
    torch.manual_seed(0)
    model = ModernBertForMaskedLM(_cfg()).eval()
    folder = tmp_path_factory.mktemp("modern") / "hf"
    save_hf_folder(model, folder, token_ids={"cls": 2, "sep": 3, "pad": 0})
    return model, folder


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_export_loads_in_transformers_with_equal_logits(exported, attn: str) -> None:  # type: ignore[no-untyped-def]
    model, folder = exported
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["ModernBertForMaskedLM"] and config["cls_token_id"] == 2
    hf = transformers.ModernBertForMaskedLM.from_pretrained(folder, attn_implementation=attn)
    auto = transformers.AutoModelForMaskedLM.from_pretrained(folder)
    assert type(auto).__name__ == "ModernBertForMaskedLM"
    ids, mask = _batch([50, 31, 9])  # 50 and 31 > the window; padded rows
    with torch.no_grad():
        theirs = hf.eval()(input_ids=ids, attention_mask=mask).logits
        mine = model(ids, attention_mask=mask).mlm_logits
        packed = _packed(model, ids, mask)
    real = mask.bool()
    assert theirs.shape == mine.shape and theirs.shape[-1] == VOCAB
    torch.testing.assert_close(mine[real], theirs[real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(packed, theirs[real], atol=2e-5, rtol=1e-4)


def test_a_transformers_folder_initialises_bertpipe_with_equal_logits(tmp_path: Path) -> None:
    """transformers' own ModernBERT (its init, its config.json spelling) -> bertpipe."""
    config = transformers.ModernBertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=5,
        num_attention_heads=4,
        local_attention=16,
        global_attn_every_n_layers=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        cls_token_id=2,
        sep_token_id=3,
    )
    torch.manual_seed(1)
    hf = transformers.ModernBertForMaskedLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    cfg, weights = load_hf_folder(tmp_path / "hf")
    assert isinstance(cfg, ModernBertModelConfig)
    assert cfg.global_attn_every_n_layers == 2 and cfg.window == 8 and cfg.num_layers == 5
    model = ModernBertForMaskedLM(cfg).eval()
    report = load_into(model, weights)
    assert report.missing == [] and report.unexpected == []
    ids, mask = _batch([40, 17, 40, 3], seed=2)
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask).logits
        mine = model(ids, attention_mask=mask).mlm_logits
        packed = _packed(model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(mine[real], theirs[real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(packed, theirs[real], atol=2e-5, rtol=1e-4)
    # and the export of what was loaded is transformers' folder again
    save_hf_folder(model, tmp_path / "again")
    back = transformers.ModernBertForMaskedLM.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        torch.testing.assert_close(
            back(input_ids=ids, attention_mask=mask).logits[real], theirs[real]
        )


def test_unpadded_gradients_equal_the_padded_reference() -> None:
    torch.manual_seed(3)
    cfg = _cfg()
    model = ModernBertForMaskedLM(cfg)
    ids, mask = _batch([45, 12, 30, 45], seed=4)
    real = mask.bool()
    positions = real.reshape(-1).nonzero().squeeze(1)[::3]  # flat indices into B*S
    labels = ids.reshape(-1)[positions]

    def grads(packed: bool) -> dict[str, torch.Tensor]:
        model.zero_grad()
        if packed:
            lengths = mask.sum(1)
            pos = torch.cat([torch.arange(int(n)) for n in lengths])
            cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
            # the flat padded indices of the masked tokens -> their packed rows
            packed_row = torch.full((ids.numel(),), -1, dtype=torch.long)
            packed_row[real.reshape(-1).nonzero().squeeze(1)] = torch.arange(int(lengths.sum()))
            out = model(
                ids[real],
                position_ids=pos,
                cu_seqlens=cu,
                seq_lengths=tuple(lengths.tolist()),
                mlm_positions=packed_row[positions],
                mlm_labels=labels,
            )
        else:
            out = model(ids, attention_mask=mask, mlm_positions=positions, mlm_labels=labels)
        assert out.nsp_logits is None and out.nsp_loss is None
        out.loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    padded, packed = grads(False), grads(True)
    assert set(padded) == set(packed) and len(padded) == len(list(model.parameters()))
    for name in padded:
        torch.testing.assert_close(packed[name], padded[name], atol=1e-6, rtol=1e-4, msg=name)


def test_local_layers_see_only_their_window() -> None:
    """A token further away than the window changes nothing in a local layer's output there;
    in a global layer it changes every position."""
    torch.manual_seed(5)
    model = ModernBertForMaskedLM(_cfg(num_layers=2, global_attn_every_n_layers=5)).eval()
    assert [layer.is_global for layer in model.model.layers] == [True, False]
    ids, mask = _batch([40])
    changed = ids.clone()
    changed[0, 39] = (changed[0, 39] + 1) % VOCAB  # tokens 0..30 are more than 8 away
    with torch.no_grad():
        assert not torch.allclose(
            model.model(ids, mask)[0, :20], model.model(changed, mask)[0, :20]
        )
        model.model.layers = model.model.layers[1:]  # the local layer alone
        for packed in (False, True):
            if packed:
                a, b = (_packed(model, x, mask)[:31] for x in (ids, changed))
            else:
                a, b = (model(x, attention_mask=mask).mlm_logits[0, :31] for x in (ids, changed))
            torch.testing.assert_close(a, b, atol=0, rtol=0)
        near = [model(x, attention_mask=mask).mlm_logits[0, 31:] for x in (ids, changed)]
        assert not torch.allclose(*near)  # within 8 of the changed token: it counts


def test_config_checks_counts_and_families() -> None:
    cfg = _cfg()
    model = pretraining_model(cfg)
    assert isinstance(model, ModernBertForMaskedLM)
    total = sum(p.numel() for p in model.parameters())
    assert cfg.num_parameters() == total
    back = config_from_dict(__import__("dataclasses").asdict(cfg))
    assert back == cfg
    for bad, key in (
        ({"num_heads": 5}, "num_heads"),
        ({"local_attention": 7}, "local_attention"),
        ({"mlp_dropout": 1.0}, "mlp_dropout"),
    ):
        with pytest.raises(ConfigError, match=key):
            _cfg(**bad)
    base = ModernBertModelConfig.preset("modernbert-base", 50368)
    assert (base.num_layers, base.hidden_size, base.intermediate_size) == (22, 768, 1152)
    assert 149e6 < base.num_parameters() < 150e6  # the released ModernBERT-base: 149M
    large = ModernBertModelConfig.preset("modernbert-large", 50368)
    assert 395e6 < large.num_parameters() < 396e6  # ModernBERT-large: 395M
    # local layers count window-limited attention: shorter sequences cost the same per token
    f512 = training_flops(base, [512], 0)
    f1024 = training_flops(base, [1024], 0)
    assert 2 < f1024 / f512 < 2.2  # global layers (1 in 3) grow with S^2
    with pytest.raises(ValueError, match="packed input"):
        model(torch.zeros(4, dtype=torch.long), cu_seqlens=torch.tensor([0, 4]), seq_lengths=None)
    assert Varlen.from_lengths(torch.tensor([3, 1])).lengths == (3, 1)
