"""transformers' BERT ``config.json`` to and from :class:`BertModelConfig` (the folders
themselves are read and written by :mod:`bertpipe.training.models.hf`, for every family)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from bertpipe.training.models.bert.config import BertModelConfig

__all__ = ["ARCHITECTURES", "check_exportable", "config_from_hf", "hf_config_dict", "token_config"]

ARCHITECTURES = (
    "BertForPreTraining",
    "BertModel",
    "BertForSequenceClassification",
    "BertForQuestionAnswering",
    "BertForTokenClassification",
)


def check_exportable(cfg: BertModelConfig) -> None:
    """Raise ValueError if transformers' BertModel has no equivalent of ``cfg``."""
    if cfg.pre_layer_norm:
        raise ValueError(
            "cannot export a pre-LayerNorm model to transformers' BERT format: BertModel is "
            "post-LN only, the weights would load but compute something else"
        )
    if cfg.position_embedding != "learned":
        raise ValueError(
            f"cannot export position_embedding={cfg.position_embedding!r} to transformers' "
            "BERT format: BertModel only has learned absolute position embeddings"
        )


def hf_config_dict(
    cfg: BertModelConfig,
    architecture: str = "BertForPreTraining",
    num_labels: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """A transformers ``BertConfig`` as written to config.json (vocab_size is the real size)."""
    check_exportable(cfg)
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; known: {ARCHITECTURES}")
    out: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": "bert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.ffn_size,
        "hidden_act": "gelu",
        "hidden_dropout_prob": cfg.hidden_dropout,
        "attention_probs_dropout_prob": cfg.attention_dropout,
        "max_position_embeddings": cfg.max_position_embeddings,
        "type_vocab_size": cfg.type_vocab_size,
        "initializer_range": cfg.initializer_range,
        "layer_norm_eps": cfg.layer_norm_eps,
        "pad_token_id": cfg.pad_token_id,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
        "is_decoder": False,
        "use_cache": False,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if num_labels is not None:
        out["id2label"] = {str(i): f"LABEL_{i}" for i in range(num_labels)}
        out["label2id"] = {f"LABEL_{i}": i for i in range(num_labels)}
    return out


def config_from_hf(data: Mapping[str, Any], pad_vocab_multiple: int = 8) -> BertModelConfig:
    """The model config of a transformers BERT config.json mapping."""
    if data.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"hidden_act={data['hidden_act']!r} is not supported (exact gelu only)")
    if data.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError("only absolute position embeddings are supported")
    hidden = int(data["hidden_size"])
    pad = data.get("pad_token_id")
    return BertModelConfig(
        vocab_size=int(data["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(data["num_hidden_layers"]),
        num_heads=int(data["num_attention_heads"]),
        intermediate_size=int(data.get("intermediate_size", 4 * hidden)),
        max_position_embeddings=int(data.get("max_position_embeddings", 512)),
        type_vocab_size=int(data.get("type_vocab_size", 2)),
        hidden_dropout=float(data.get("hidden_dropout_prob", 0.1)),
        attention_dropout=float(data.get("attention_probs_dropout_prob", 0.1)),
        layer_norm_eps=float(data.get("layer_norm_eps", 1e-12)),
        initializer_range=float(data.get("initializer_range", 0.02)),
        pad_token_id=0 if pad is None else int(pad),
        pad_vocab_multiple=pad_vocab_multiple,
    )


def token_config(token_ids: Mapping[str, int]) -> dict[str, int]:
    """What config.json says of the tokenizer's special tokens: nothing (BERT's config has no
    such fields; the tokenizer files carry them)."""
    return {}
