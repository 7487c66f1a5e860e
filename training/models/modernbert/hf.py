"""transformers' ModernBERT config.json to and from :class:`ModernBertModelConfig`.

Parameter names are transformers' own (:mod:`bertpipe.training.models.modernbert.model`), so the
weights need no renaming; :mod:`bertpipe.training.models.hf` reads and writes the folders of
both families. config.json is written in both of transformers' spellings of RoPE and the layer
pattern (``global_rope_theta``/``local_rope_theta``/``global_attn_every_n_layers``, read by
4.48-4.x, and ``rope_parameters``/``layer_types``, read by 5.x), so either major version loads it;
ModernBERT arrived in transformers 4.48."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from bertpipe.training.models.modernbert.config import ModernBertModelConfig

__all__ = [
    "ARCHITECTURES",
    "check_exportable",
    "config_from_hf",
    "hf_config_dict",
    "token_config",
]

ARCHITECTURES = (
    "ModernBertForMaskedLM",
    "ModernBertModel",
    "ModernBertForSequenceClassification",
    "ModernBertForQuestionAnswering",
    "ModernBertForTokenClassification",
)


def hf_config_dict(
    cfg: ModernBertModelConfig,
    architecture: str = "ModernBertForMaskedLM",
    num_labels: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """A transformers ``ModernBertConfig`` as written to config.json."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; known: {ARCHITECTURES}")
    out: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": "modernbert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "hidden_activation": "gelu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.initializer_range,
        "initializer_cutoff_factor": cfg.initializer_cutoff_factor,
        "norm_eps": cfg.norm_eps,
        "norm_bias": False,
        "pad_token_id": cfg.pad_token_id,
        # transformers' defaults are ModernBERT's own vocabulary's; the export writes the
        # tokenizer's (save_hf_folder's token_ids)
        "cls_token_id": None,
        "sep_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
        "global_attn_every_n_layers": cfg.global_attn_every_n_layers,
        "layer_types": cfg.layer_types,
        "local_attention": cfg.local_attention,
        "global_rope_theta": cfg.global_rope_theta,
        "local_rope_theta": cfg.local_rope_theta,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": cfg.global_rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.local_rope_theta},
        },
        "attention_bias": False,
        "attention_dropout": cfg.attention_dropout,
        "embedding_dropout": cfg.embedding_dropout,
        "mlp_bias": False,
        "mlp_dropout": cfg.mlp_dropout,
        "decoder_bias": True,
        "classifier_pooling": "cls",
        "classifier_dropout": 0.0,
        "classifier_bias": False,
        "classifier_activation": "gelu",
        "tie_word_embeddings": True,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if num_labels is not None:
        out["id2label"] = {str(i): f"LABEL_{i}" for i in range(num_labels)}
        out["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
    return out


def _theta(data: Mapping[str, Any], kind: str, legacy: str, default: float) -> float:
    params = (data.get("rope_parameters") or {}).get(kind) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.{kind}: only the default RoPE type is supported")
    return float(params.get("rope_theta", data.get(legacy, default)))


def _every_n(data: Mapping[str, Any], layers: int) -> int:
    n = int(data.get("global_attn_every_n_layers", 3))
    types = data.get("layer_types")
    if types is None:
        return n
    global_at = [i for i, t in enumerate(types) if t == "full_attention"]
    n = global_at[1] - global_at[0] if len(global_at) > 1 else max(layers, 1)
    expected = ["full_attention" if i % n == 0 else "sliding_attention" for i in range(layers)]
    if list(types) != expected:
        raise ValueError(
            "layer_types: only a global layer every n layers from layer 0 is supported"
        )
    return n


def config_from_hf(data: Mapping[str, Any], pad_vocab_multiple: int = 8) -> ModernBertModelConfig:
    """The :class:`ModernBertModelConfig` of a transformers ModernBERT config.json mapping;
    ValueError for what this architecture does not compute (biases, other activations)."""
    if data.get("model_type") != "modernbert":
        raise ValueError(f"not a ModernBERT checkpoint: model_type={data.get('model_type')!r}")
    for key, want in (
        ("hidden_activation", "gelu"),
        ("norm_bias", False),
        ("attention_bias", False),
        ("mlp_bias", False),
        ("decoder_bias", True),
    ):
        if data.get(key, want) != want:
            raise ValueError(f"{key}={data[key]!r} is not supported (only {want!r})")
    layers = int(data["num_hidden_layers"])
    pad = data.get("pad_token_id")
    return ModernBertModelConfig(
        vocab_size=int(data["vocab_size"]),
        hidden_size=int(data["hidden_size"]),
        num_layers=layers,
        num_heads=int(data["num_attention_heads"]),
        intermediate_size=int(data["intermediate_size"]),
        max_position_embeddings=int(data.get("max_position_embeddings", 8192)),
        global_attn_every_n_layers=_every_n(data, layers),
        local_attention=int(data.get("local_attention", 128)),
        global_rope_theta=_theta(data, "full_attention", "global_rope_theta", 160_000.0),
        local_rope_theta=_theta(data, "sliding_attention", "local_rope_theta", 10_000.0),
        norm_eps=float(data.get("norm_eps", 1e-5)),
        embedding_dropout=float(data.get("embedding_dropout", 0.0)),
        attention_dropout=float(data.get("attention_dropout", 0.0)),
        mlp_dropout=float(data.get("mlp_dropout", 0.0)),
        initializer_range=float(data.get("initializer_range", 0.02)),
        initializer_cutoff_factor=float(data.get("initializer_cutoff_factor") or 2.0),
        pad_token_id=0 if pad is None else int(pad),
        pad_vocab_multiple=pad_vocab_multiple,
    )


def check_exportable(cfg: ModernBertModelConfig) -> None:
    """Every ModernBERT config has a transformers equivalent: nothing to refuse."""


def token_config(token_ids: Mapping[str, int]) -> dict[str, int]:
    """The tokenizer's special token ids as ModernBERT's config.json holds them (its defaults
    are ModernBERT's own vocabulary's): ``cls``/``sep``/``pad`` ids, and ``bos``/``eos`` as
    the ``cls``/``sep`` ids."""
    out = {f"{k}_token_id": v for k, v in token_ids.items() if k != "mask"}
    for kind, special in (("bos", "cls"), ("eos", "sep")):
        if special in token_ids:
            out[f"{kind}_token_id"] = token_ids[special]
    return out
