"""The ``model`` section of the pre-training config: which encoder family and size to train,
with optional changes, or which weights to start from (re-exported by
:mod:`bertpipe.training.pretrain.config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bertpipe.config import ConfigError
from bertpipe.training.models.families import DEFAULT_FAMILY, FAMILIES, Family

__all__ = ["ModelSpec"]


@dataclass
class ModelSpec:
    """Which encoder to train: a family, a size preset, optional changes, or weights to start
    from."""

    family: Literal["bert", "modernbert"] | None = None
    """``bert``: the paper's architecture (post-LN, learned positions, segments, NSP head).
    ``modernbert``: ModernBERT's (Warner et al. 2024): RoPE, GeGLU, pre-norm without biases,
    alternating global and sliding-window attention, MLM head only; exports as transformers'
    ``ModernBertForMaskedLM``. Null: ``modernbert`` for the ``modernbert-*`` presets, else
    ``bert``."""
    preset: Literal[
        "tiny", "mini", "small", "medium", "base", "large", "modernbert-base", "modernbert-large"
    ] = "base"
    """Google's published sizes: tiny L2/H128, mini L4/H256, small L4/H512, medium L8/H512,
    base L12/H768, large L24/H1024 (with the modernbert family: these shapes with a GLU of
    1.5 x hidden); ModernBERT's: modernbert-base L22/H768/GLU 1152, modernbert-large
    L28/H1024/GLU 2624."""
    num_layers: int | None = None
    """Override the preset's layer count."""
    hidden_size: int | None = None
    """Override the preset's hidden size."""
    num_heads: int | None = None
    """Override the preset's head count."""
    intermediate_size: int | None = None
    """Feed-forward width; null means the preset's (BERT: 4 x hidden)."""
    max_position_embeddings: int = 512
    """Longest sequence any phase may use."""
    hidden_dropout: float | None = None
    """Dropout on embeddings and on each sub-layer's output (modernbert: on the embeddings
    and inside the GLU). Null: the family's, 0.1 for bert, 0 for modernbert."""
    attention_dropout: float | None = None
    """Dropout on the attention probabilities (modernbert: and after the attention's output
    projection). Null: 0.1 for bert, 0 for modernbert."""
    local_attention: int | None = None
    """modernbert: width of the sliding window of the local layers (null: 128)."""
    global_attn_every_n_layers: int | None = None
    """modernbert: every n-th layer (from the first) attends globally (null: 3)."""
    pre_layer_norm: bool = False
    """Pre-LN instead of the paper's post-LN (not exportable to transformers)."""
    position_embedding: Literal["learned", "sinusoidal"] = "learned"
    """Learned position table (BERT) or fixed sinusoids (not exportable to transformers)."""
    activation_checkpointing: bool = False
    """Recompute layer activations in the backward pass (less memory, ~1/3 more compute)."""
    unpad: bool = True
    """Run the encoder on the real tokens only: padding is dropped after the loader, and
    attention runs over variable-length sequences (FlashAttention varlen / SDPA on nested
    tensors on a GPU). Equal to the padded computation; false computes padding too."""
    compile: bool = False
    """``torch.compile`` each layer (fuses bias + GELU, dropout + residual + LayerNorm);
    the first steps are slower while graphs compile. Needs a C++ compiler on CPU."""
    init_from: str | None = None
    """Start from weights: an HF BERT folder (config.json + model.safetensors) or a bertpipe
    export. Null: BERT initialisation (normal, std 0.02)."""

    def __post_init__(self) -> None:
        family = self.family_entry
        for other in FAMILIES.values():
            if other is family:
                continue
            if self.preset in other.own_presets:
                raise ConfigError(
                    "preset",
                    f"{self.preset} is a {other.name} size: set family={other.name} or null",
                )
            for key, unset in other.own_settings.items():
                if getattr(self, key) != unset:
                    raise ConfigError(
                        key,
                        f"is a {other.name} setting, not {family.name}'s: set family={other.name}",
                    )

    @property
    def resolved_family(self) -> str:
        """The family: given, else the one whose own preset this is, else the default."""
        if self.family is not None:
            return self.family
        own = (f.name for f in FAMILIES.values() if self.preset in f.own_presets)
        return next(own, DEFAULT_FAMILY)

    @property
    def family_entry(self) -> Family:
        """The family's entry in the table (:data:`~bertpipe.training.models.families.FAMILIES`)."""
        return FAMILIES[self.resolved_family]

    def overrides(self) -> dict[str, object]:
        """Fields to pass on top of the preset to the family's model config
        (``BertModelConfig`` or ``ModernBertModelConfig``)."""
        family = self.family_entry
        out: dict[str, object] = {
            "max_position_embeddings": self.max_position_embeddings,
            "activation_checkpointing": self.activation_checkpointing,
        }
        if self.hidden_dropout is not None:
            out.update(dict.fromkeys(family.hidden_dropout_keys, self.hidden_dropout))
        out.update({key: getattr(self, key) for key in family.own_settings})
        for key in (
            "attention_dropout",
            "num_layers",
            "hidden_size",
            "num_heads",
            "intermediate_size",
        ):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return {k: v for k, v in out.items() if v is not None}
