"""The table of encoder families: everything that differs between BERT
(:mod:`bertpipe.training.models.bert`) and ModernBERT (:mod:`bertpipe.training.models.modernbert`)
is registered here once, and the rest of bertpipe looks it up (:func:`family_of` a model config,
:data:`FAMILIES` by name) instead of comparing names.

A family is its config class (torch-free, so ``bertpipe plan`` sizes a run in a second), its
pre-training model and the task models' encoder (in its ``model`` module, imported only when a
model is built), its transformers conversion (``hf``), its FLOP and activation terms
(``costs``), what its pre-training reads (the data's objective: NSP or not), and how the
``model`` section of a config maps onto it. Adding a family is a package with those four
modules and one entry in :data:`FAMILIES`.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from bertpipe.training.models.bert import costs as bert_costs
from bertpipe.training.models.bert.config import BertModelConfig
from bertpipe.training.models.modernbert import costs as modern_costs
from bertpipe.training.models.modernbert.config import ModernBertModelConfig

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "DEFAULT_FAMILY",
    "FAMILIES",
    "Family",
    "ModelConfig",
    "config_from_dict",
    "family_of",
    "preset_config",
    "pretraining_model",
    "with_dropout",
]

ModelConfig = BertModelConfig | ModernBertModelConfig


@dataclasses.dataclass(frozen=True)
class Family:
    """One encoder family: what the rest of bertpipe needs to know of it."""

    name: str
    """The ``model.family`` value, and the ``family`` a checkpoint's model config records."""
    title: str
    """How tables name it."""
    config: type
    """Its model config class (``preset(name, vocab_size, **overrides)``, torch-free)."""
    own_presets: tuple[str, ...]
    """Size presets only this family has (the others share Google's small shapes)."""
    own_settings: Mapping[str, Any]
    """``model.*`` keys only this family takes, with their "not set" values."""
    objective: str
    """The preprocessing objective its pre-training reads: ``mlm+nsp`` or ``mlm``."""
    nsp: bool
    """Whether its pre-training model has a next-sentence head (and takes NSP labels)."""
    dropout_keys: tuple[str, ...]
    """Its config's dropout fields (:func:`with_dropout`)."""
    hidden_dropout_keys: tuple[str, ...]
    """The config fields ``model.hidden_dropout`` sets."""
    attention_dropout: float
    """Its attention-probability dropout unless set: whether a CPU plan stores the scores."""
    default_dropout: float | None
    """The dropout a pre-training config that sets none gives a model started from weights
    (``model.init_from``); None: the weights' own config's."""
    model_type: str
    """transformers' ``model_type`` (its config.json)."""
    class_prefix: str
    """transformers' class names: ``<prefix>ForSequenceClassification``..."""
    encoder_prefix: str
    """The encoder's attribute in a model with heads (``bert.``, ``model.``)."""
    encoder_parts: tuple[str, ...]
    """The encoder's parts that a checkpoint must provide (never optional)."""
    bare_parts: tuple[str, ...]
    """Top-level names of a bare encoder's state dict (prefixed with ``encoder_prefix``)."""
    costs: ModuleType
    """``training_flops``, ``layer_activation_bytes``, ``head_activation_bytes``,
    ``ACTIVATIONS`` (:mod:`bertpipe.training.models.bert.costs`)."""
    package: str
    """Its package; ``model`` and ``hf`` are imported from it when needed (torch)."""

    def module(self, name: str) -> ModuleType:
        """The family's ``model`` or ``hf`` module."""
        return importlib.import_module(f"{self.package}.{name}")

    @property
    def reference_model(self) -> str:
        """transformers' pre-training class of this family."""
        return f"{self.class_prefix}{'ForPreTraining' if self.nsp else 'ForMaskedLM'}"


FAMILIES: Mapping[str, Family] = {
    "bert": Family(
        name="bert",
        title="BERT",
        config=BertModelConfig,
        own_presets=(),
        own_settings={"pre_layer_norm": False, "position_embedding": "learned"},
        objective="mlm+nsp",
        nsp=True,
        dropout_keys=("hidden_dropout", "attention_dropout"),
        hidden_dropout_keys=("hidden_dropout",),
        attention_dropout=0.1,
        default_dropout=0.1,
        model_type="bert",
        class_prefix="Bert",
        encoder_prefix="bert.",
        encoder_parts=("embeddings", "encoder"),
        bare_parts=("embeddings", "encoder", "pooler"),
        costs=bert_costs,
        package="bertpipe.training.models.bert",
    ),
    "modernbert": Family(
        name="modernbert",
        title="ModernBERT",
        config=ModernBertModelConfig,
        own_presets=("modernbert-base", "modernbert-large"),
        own_settings={"local_attention": None, "global_attn_every_n_layers": None},
        objective="mlm",
        nsp=False,
        dropout_keys=("embedding_dropout", "attention_dropout", "mlp_dropout"),
        hidden_dropout_keys=("embedding_dropout", "mlp_dropout"),
        attention_dropout=0.0,
        default_dropout=None,
        model_type="modernbert",
        class_prefix="ModernBert",
        encoder_prefix="model.",
        encoder_parts=("embeddings", "layers", "final_norm"),
        bare_parts=("embeddings", "layers", "final_norm"),
        costs=modern_costs,
        package="bertpipe.training.models.modernbert",
    ),
}
DEFAULT_FAMILY = "bert"
"""The family of a config that names none (and of checkpoints recorded before ModernBERT)."""


def family_of(cfg: Any) -> Family:
    """The family of a model config (either family's class, or a checkpoint's dict of one)."""
    if isinstance(cfg, Mapping):
        return FAMILIES[cfg.get("family", DEFAULT_FAMILY)]
    for family in FAMILIES.values():
        if isinstance(cfg, family.config):
            return family
    raise TypeError(f"{type(cfg).__name__} is the config of no model family")


def by_model_type(model_type: str) -> Family | None:
    """The family of a transformers config.json's ``model_type`` (None: no family's)."""
    return next((f for f in FAMILIES.values() if f.model_type == model_type), None)


def preset_config(family: str, preset: str, vocab_size: int, **overrides: Any) -> ModelConfig:
    """The family's preset with ``overrides``."""
    return FAMILIES[family].config.preset(preset, vocab_size, **overrides)  # type: ignore[no-any-return]


def config_from_dict(data: Mapping[str, Any]) -> ModelConfig:
    """A config from its ``dataclasses.asdict`` (as checkpoints record it)."""
    return family_of(data).config(**data)  # type: ignore[no-any-return]


def pretraining_model(cfg: ModelConfig) -> nn.Module:
    """The family's model with its pre-training heads: ``BertForPreTraining`` (MLM + NSP) or
    ``ModernBertForMaskedLM`` (MLM), freshly initialised from torch's current seed."""
    family = family_of(cfg)
    build: Callable[[ModelConfig], nn.Module] = getattr(
        family.module("model"), family.reference_model
    )
    return build(cfg)


def with_dropout(cfg: ModelConfig, p: float | None) -> ModelConfig:
    """``cfg`` with every dropout of the encoder at ``p`` (None: unchanged)."""
    if p is None:
        return cfg
    return dataclasses.replace(cfg, **dict.fromkeys(family_of(cfg).dropout_keys, p))
