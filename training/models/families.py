"""The two encoder families behind one set of calls: BERT
(:mod:`bertpipe.training.models.bert.model`) and ModernBERT
(:mod:`bertpipe.training.models.modernbert.model`).

A model config says which family it is (``family`` on :class:`ModernBertModelConfig`; BERT's
config has none), and so does the dict a checkpoint records of it; these functions build the
config or the pre-training model of either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from bertpipe.training.models.bert.config import BertModelConfig
from bertpipe.training.models.modernbert.config import ModernBertModelConfig, is_modern

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "ModelConfig",
    "config_from_dict",
    "is_modern",
    "preset_config",
    "pretraining_model",
    "with_dropout",
]

ModelConfig = BertModelConfig | ModernBertModelConfig


def preset_config(family: str, preset: str, vocab_size: int, **overrides: Any) -> ModelConfig:
    """The family's preset with ``overrides``."""
    if family == "modernbert":
        return ModernBertModelConfig.preset(preset, vocab_size, **overrides)
    return BertModelConfig.preset(preset, vocab_size, **overrides)


def config_from_dict(data: Mapping[str, Any]) -> ModelConfig:
    """A config from its ``dataclasses.asdict`` (as checkpoints record it)."""
    if data.get("family") == "modernbert":
        return ModernBertModelConfig(**data)
    return BertModelConfig(**data)


def pretraining_model(cfg: ModelConfig) -> nn.Module:
    """The family's model with its pre-training heads: ``BertForPreTraining`` (MLM + NSP) or
    ``ModernBertForMaskedLM`` (MLM), freshly initialised from torch's current seed."""
    if isinstance(cfg, ModernBertModelConfig):
        from bertpipe.training.models.modernbert.model import ModernBertForMaskedLM

        return ModernBertForMaskedLM(cfg)
    from bertpipe.training.models.bert.model import BertForPreTraining

    return BertForPreTraining(cfg)


def with_dropout(cfg: ModelConfig, p: float | None) -> ModelConfig:
    """``cfg`` with every dropout of the encoder at ``p`` (None: unchanged)."""
    if p is None:
        return cfg
    if isinstance(cfg, ModernBertModelConfig):
        names = ("embedding_dropout", "attention_dropout", "mlp_dropout")
    else:
        names = ("hidden_dropout", "attention_dropout")
    return dataclasses.replace(cfg, **dict.fromkeys(names, p))
