"""The BERT architecture's configuration, without torch: ``bertpipe plan``, the launch gate
in front of every multi-node job, sizes a run from it in a second (importing torch alone
takes ~2 s of a 4.9 s ``plan``); :mod:`bertpipe.training.models.bert.model` builds the modules from
it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from bertpipe.config import ConfigError

__all__ = ["PRESETS", "BertModelConfig"]

POSITIVE_FIELDS: tuple[str, ...] = ("vocab_size", "hidden_size", "num_layers", "num_heads")
POSITIVE_FIELDS += ("max_position_embeddings", "type_vocab_size", "pad_vocab_multiple")

# Google's published BERT sizes (github.com/google-research/bert): layers, hidden, heads.
PRESETS: Mapping[str, Mapping[str, int]] = {
    "tiny": {"num_layers": 2, "hidden_size": 128, "num_heads": 2},
    "mini": {"num_layers": 4, "hidden_size": 256, "num_heads": 4},
    "small": {"num_layers": 4, "hidden_size": 512, "num_heads": 8},
    "medium": {"num_layers": 8, "hidden_size": 512, "num_heads": 8},
    "base": {"num_layers": 12, "hidden_size": 768, "num_heads": 12},
    "large": {"num_layers": 24, "hidden_size": 1024, "num_heads": 16},
}


@dataclasses.dataclass
class BertModelConfig:
    """Architecture of the BERT encoder and its pre-training heads."""

    vocab_size: int
    """Real vocabulary size of the tokenizer (padding to ``pad_vocab_multiple`` is internal)."""
    hidden_size: int = 768
    """Width H of every token representation."""
    num_layers: int = 12
    """Number of transformer layers L."""
    num_heads: int = 12
    """Attention heads A per layer; must divide hidden_size."""
    intermediate_size: int | None = None
    """Width of the feed-forward layer; null means 4 * hidden_size."""
    max_position_embeddings: int = 512
    """Longest sequence the position embeddings cover."""
    type_vocab_size: int = 2
    """Number of segment (token type) ids: 2 for sentence A / sentence B."""
    hidden_dropout: float = 0.1
    """Dropout on embeddings and on every sub-layer output."""
    attention_dropout: float = 0.1
    """Dropout on the attention probabilities."""
    layer_norm_eps: float = 1e-12
    """Epsilon of every LayerNorm (BERT's TF value)."""
    initializer_range: float = 0.02
    """Standard deviation of the normal init of Linear and Embedding weights."""
    pad_token_id: int = 0
    """Id of [PAD]; its embedding row starts at zero and gets no gradient from the input side."""
    pre_layer_norm: bool = False
    """LayerNorm before each sub-layer plus a final one (stabler for deep or high-LR runs).
    False is the paper's post-LN. Pre-LN models cannot be exported to transformers."""
    position_embedding: Literal["learned", "sinusoidal"] = "learned"
    """Learned position table (BERT) or the original Transformer's fixed sinusoids (a buffer,
    no parameters; cannot be exported to transformers)."""
    pad_vocab_multiple: int = 8
    """Pad the vocabulary to a multiple of this for aligned matmuls (1 = no padding)."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass (saves memory, ~1/3 more compute)."""

    def __post_init__(self) -> None:
        for name in POSITIVE_FIELDS:
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be at least 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            why = f"{self.hidden_size} % {self.num_heads} != 0; change hidden_size or num_heads"
            raise ConfigError("hidden_size", f"must be divisible by num_heads ({why})")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ConfigError("intermediate_size", "must be at least 1, or null for 4 * hidden")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(name, f"must be in [0, 1), got {getattr(self, name)}")
        for name in ("layer_norm_eps", "initializer_range"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be positive, got {getattr(self, name)}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ConfigError("pad_token_id", f"must be in [0, vocab_size={self.vocab_size})")
        if self.position_embedding not in ("learned", "sinusoidal"):
            raise ConfigError("position_embedding", "must be 'learned' or 'sinusoidal'")

    @classmethod
    def preset(cls, name: str, vocab_size: int, **overrides: Any) -> BertModelConfig:
        """One of Google's published sizes (see ``PRESETS``) with optional field overrides."""
        if name not in PRESETS:
            raise ConfigError("preset", f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        return cls(vocab_size=vocab_size, **{**PRESETS[name], **overrides})

    @property
    def padded_vocab_size(self) -> int:
        """``vocab_size`` rounded up to a multiple of ``pad_vocab_multiple``."""
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        """The resolved intermediate (feed-forward) width."""
        return self.intermediate_size or 4 * self.hidden_size

    def num_parameters(self, with_heads: bool = True) -> int:
        """Analytic parameter count of :class:`BertForPreTraining` (tied decoder counted once),
        or of :class:`BertModel` (encoder + pooler) when ``with_heads`` is False."""
        H, I = self.hidden_size, self.ffn_size  # noqa: E741
        learned = self.position_embedding == "learned"
        embeddings = (self.padded_vocab_size + self.type_vocab_size) * H + 2 * H
        embeddings += self.max_position_embeddings * H if learned else 0
        layer = 4 * (H * H + H) + (H * I + I) + (I * H + H) + 2 * 2 * H
        encoder = self.num_layers * layer + (2 * H if self.pre_layer_norm else 0)
        total = embeddings + encoder + (H * H + H)  # + pooler
        if with_heads:
            total += (H * H + H) + 2 * H + self.padded_vocab_size  # transform, LN, bias
            total += 2 * H + 2  # NSP classifier
        return total
