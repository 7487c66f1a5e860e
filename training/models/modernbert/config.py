"""The ModernBERT architecture's configuration, without torch (``bertpipe plan`` sizes runs
from it in a second, as from :class:`~bertpipe.training.models.bert.config.BertModelConfig`).

Fields follow transformers' ``ModernBertConfig`` (names mapped in
:mod:`bertpipe.training.models.modernbert.hf`); :mod:`bertpipe.training.models.modernbert.model`
builds the modules. The published sizes are those of answerdotai/ModernBERT-base and -large (Warner
et al. 2024, "Smarter, Better, Faster, Longer", arXiv:2412.13663, table 3 and the released
config.json)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from bertpipe.config import ConfigError

__all__ = ["MODERN_PRESETS", "ModernBertModelConfig"]

# layers, hidden, heads, GLU width: the released ModernBERT-base / -large configs; the small
# sizes are Google's BERT shapes with ModernBERT's GLU ratio (1.5 x hidden), for tests and demos
MODERN_PRESETS: Mapping[str, Mapping[str, int]] = {
    "modernbert-base": {
        "num_layers": 22,
        "hidden_size": 768,
        "num_heads": 12,
        "intermediate_size": 1152,
    },
    "modernbert-large": {
        "num_layers": 28,
        "hidden_size": 1024,
        "num_heads": 16,
        "intermediate_size": 2624,
    },
}
SMALL_SIZES: Mapping[str, Mapping[str, int]] = {
    "tiny": {"num_layers": 2, "hidden_size": 128, "num_heads": 2},
    "mini": {"num_layers": 4, "hidden_size": 256, "num_heads": 4},
    "small": {"num_layers": 4, "hidden_size": 512, "num_heads": 8},
    "medium": {"num_layers": 8, "hidden_size": 512, "num_heads": 8},
    "base": {"num_layers": 12, "hidden_size": 768, "num_heads": 12},
    "large": {"num_layers": 24, "hidden_size": 1024, "num_heads": 16},
}


@dataclasses.dataclass
class ModernBertModelConfig:
    """Architecture of the ModernBERT encoder and its MLM head."""

    vocab_size: int
    """Real vocabulary size of the tokenizer (padding to ``pad_vocab_multiple`` is internal)."""
    hidden_size: int = 768
    num_layers: int = 22
    num_heads: int = 12
    intermediate_size: int = 1152
    """Width of the GLU: ``Wi`` maps H to 2 x this (input and gate), ``Wo`` this back to H."""
    max_position_embeddings: int = 8192
    """Longest sequence (RoPE has no table; this is what the export declares)."""
    global_attn_every_n_layers: int = 3
    """Layer i attends globally when i % n == 0, else within the local window."""
    local_attention: int = 128
    """Total width of the sliding window: a token sees those at distance <= half of it."""
    global_rope_theta: float = 160_000.0
    """RoPE base of the global layers."""
    local_rope_theta: float = 10_000.0
    """RoPE base of the local layers."""
    norm_eps: float = 1e-5
    """Epsilon of every LayerNorm (no biases)."""
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    """On the attention probabilities and after the attention output projection."""
    mlp_dropout: float = 0.0
    """Between the GLU and its output projection."""
    initializer_range: float = 0.02
    initializer_cutoff_factor: float = 2.0
    """Weights are drawn from a normal truncated at this many standard deviations."""
    pad_token_id: int = 0
    pad_vocab_multiple: int = 8
    activation_checkpointing: bool = False
    family: Literal["modernbert"] = "modernbert"
    """Which architecture (recorded in checkpoints; BERT's config has none)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be at least 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads or self.head_dim % 2:
            raise ConfigError(
                "num_heads",
                f"hidden_size {self.hidden_size} / num_heads {self.num_heads} must be a whole, "
                "even head size (RoPE rotates pairs of channels)",
            )
        if self.global_attn_every_n_layers < 1:
            raise ConfigError("global_attn_every_n_layers", "must be at least 1")
        if self.local_attention < 2 or self.local_attention % 2:
            raise ConfigError("local_attention", "must be an even window of at least 2 tokens")
        for name in ("embedding_dropout", "attention_dropout", "mlp_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(name, f"must be in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ConfigError("pad_token_id", f"must be in [0, vocab_size={self.vocab_size})")

    @classmethod
    def preset(cls, name: str, vocab_size: int, **overrides: Any) -> ModernBertModelConfig:
        """A published ModernBERT size, or one of BERT's small shapes with a 1.5 x GLU."""
        if name in MODERN_PRESETS:
            shape = dict(MODERN_PRESETS[name])
        elif name in SMALL_SIZES:
            shape = dict(SMALL_SIZES[name])
            shape["intermediate_size"] = 3 * shape["hidden_size"] // 2
        else:
            known = sorted([*MODERN_PRESETS, *SMALL_SIZES])
            raise ConfigError("preset", f"unknown preset {name!r}; choose from {known}")
        return cls(vocab_size=vocab_size, **{**shape, **overrides})

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size

    @property
    def window(self) -> int:
        """Half window: local layers attend to keys at distance <= this."""
        return self.local_attention // 2

    def is_global(self, layer: int) -> bool:
        return layer % self.global_attn_every_n_layers == 0

    @property
    def layer_types(self) -> list[str]:
        """transformers' names of each layer's attention."""
        return [
            "full_attention" if self.is_global(i) else "sliding_attention"
            for i in range(self.num_layers)
        ]

    def num_parameters(self, with_heads: bool = True) -> int:
        """Analytic parameter count of the MLM model (tied decoder counted once), or of the
        encoder alone."""
        H, I, L = self.hidden_size, self.intermediate_size, self.num_layers  # noqa: E741
        embeddings = self.padded_vocab_size * H + H
        layer = 3 * H * H + H * H + H * 2 * I + I * H + 2 * H  # attn_norm is absent in layer 0
        encoder = L * layer - H + H  # final norm
        total = embeddings + encoder
        if with_heads:
            total += H * H + H + self.padded_vocab_size  # head dense + norm, decoder bias
        return total
