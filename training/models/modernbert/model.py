"""ModernBERT in plain torch, parameter names as transformers' ``ModernBertForMaskedLM``.

The architecture of Warner et al. 2024 (arXiv:2412.13663) exactly as transformers'
``modeling_modernbert`` computes it: token embeddings then LayerNorm (no position table, no
segments); pre-norm layers (the first without an attention norm) of fused Q/K/V attention with
rotary position embeddings and a GeGLU feed-forward, no biases in the encoder and no bias in
any LayerNorm; global attention every ``global_attn_every_n_layers`` layers with RoPE base
``global_rope_theta``, the others within a sliding window of ``local_attention`` tokens (keys at
distance <= half of it) with base ``local_rope_theta``; a final LayerNorm; the MLM head
(dense, GELU, LayerNorm) and a decoder tied to the token embeddings, with a bias.

Module and parameter names match transformers one-to-one (``model.layers.0.attn.Wqkv.weight``,
``head.norm.weight``, ``decoder.bias``), so state dicts convert without renaming
(:mod:`bertpipe.training.models.modernbert.hf`). As in :mod:`bertpipe.training.models.bert.model`:
the vocabulary is padded internally, the MLM head runs only at the masked positions when given, and
the encoder runs on packed real tokens (:class:`~bertpipe.training.models.attention.Varlen`) or on a
padded batch.

Shapes: B batch, S sequence length, T packed tokens, H hidden, A heads, D head size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from bertpipe.training.models.attention import Varlen, band_mask, varlen_attention
from bertpipe.training.models.bert.model import IGNORE_INDEX, Dropout, PreTrainingOutput, dropout
from bertpipe.training.models.modernbert.config import ModernBertModelConfig

__all__ = [
    "ModernBertEmbeddings",
    "ModernBertEncoderLayer",
    "ModernBertForMaskedLM",
    "ModernBertModel",
    "ModernBertModelConfig",
    "init_modern_weights",
    "init_task_layer",
    "task_dropout",
    "task_encoder",
    "task_features",
]

QA_LAYER = "classifier"
"""The name of a span-QA model's output layer (the same ``classifier`` as the other tasks)."""


def _layer_norm(cfg: ModernBertModelConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=False)


def _trunc_normal(weight: Tensor, std: float, cutoff: float) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std)


class RotaryEmbedding(nn.Module):
    """cos/sin of RoPE for one base: positions [...] -> ([..., D], [..., D]) in fp32, then the
    input's dtype (transformers' ``ModernBertRotaryEmbedding`` with the default rope type)."""

    inv_freq: Tensor

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        self.register_buffer("inv_freq", 1.0 / theta**exponent, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate [..., A, D] queries or keys by cos/sin [..., D] (computed in fp32)."""
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    rotated = x.float() * cos + _rotate_half(x.float()) * sin
    return rotated.to(x.dtype)


class ModernBertEmbeddings(nn.Module):
    """Token embeddings, LayerNorm, dropout: ids [B, S] or [T] -> [..., H]."""

    def __init__(self, cfg: ModernBertModelConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(
            cfg.padded_vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id
        )
        self.norm = _layer_norm(cfg)
        self.drop = Dropout(cfg.embedding_dropout)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.drop(self.norm(self.tok_embeddings(input_ids)))


class ModernBertMLP(nn.Module):
    """GeGLU: ``Wo(drop(gelu(input) * gate))`` with ``input, gate = Wi(x).chunk(2)``."""

    def __init__(self, cfg: ModernBertModelConfig) -> None:
        super().__init__()
        self.Wi = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.drop = Dropout(cfg.mlp_dropout)
        self.Wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        value, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.drop(F.gelu(value) * gate))


PaddedMask = Tensor | None
"""bool [B, 1, S, S] or [B, 1, 1, S] (True: attend), or None (every key)."""


class ModernBertAttention(nn.Module):
    """Self-attention with RoPE, global or within the layer's window: packed [T, H] (with a
    :class:`Varlen`) or padded [B, S, H] (with a bool mask) -> the same shape."""

    def __init__(self, cfg: ModernBertModelConfig, window: int | None) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.window = window
        self.dropout_p = cfg.attention_dropout
        self.Wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=False)
        self.Wo = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Varlen | PaddedMask) -> Tensor:
        shape = x.shape[:-1]
        q, k, v = self.Wqkv(x).view(*shape, 3, self.num_heads, self.head_dim).unbind(-3)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        dropout_p = self.dropout_p if self.training else 0.0
        if isinstance(mask, Varlen):
            out = varlen_attention(q, k, v, mask, dropout_p, self.window)
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, A, S, D]
            out = _padded_attention(q, k, v, mask, dropout_p).transpose(1, 2)
        out = out.reshape(*shape, -1)
        return dropout(self.Wo(out), self.dropout_p, self.training)


def _padded_attention(q: Tensor, k: Tensor, v: Tensor, mask: PaddedMask, p: float) -> Tensor:
    if p > 0 and q.device.type == "cpu":  # SDPA's CPU kernels cannot drop attention weights
        scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2))
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        return torch.matmul(dropout(scores.softmax(-1), p, True), v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)


class ModernBertEncoderLayer(nn.Module):
    """Pre-norm layer: ``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``; layer 0 has
    no attention norm (its input is the embeddings' norm)."""

    def __init__(self, cfg: ModernBertModelConfig, index: int) -> None:
        super().__init__()
        self.is_global = cfg.is_global(index)
        self.attn_norm: nn.Module = nn.Identity() if index == 0 else _layer_norm(cfg)
        self.attn = ModernBertAttention(cfg, None if self.is_global else cfg.window)
        self.mlp_norm = _layer_norm(cfg)
        self.mlp = ModernBertMLP(cfg)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Varlen | PaddedMask) -> Tensor:
        x = x + self.attn(self.attn_norm(x), rope, mask)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertModel(nn.Module):
    """Embeddings, layers and the final norm."""

    def __init__(self, cfg: ModernBertModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.activation_checkpointing = cfg.activation_checkpointing
        self.embeddings = ModernBertEmbeddings(cfg)
        self.layers = nn.ModuleList(ModernBertEncoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = _layer_norm(cfg)
        self.global_rope = RotaryEmbedding(cfg.head_dim, cfg.global_rope_theta)
        self.local_rope = RotaryEmbedding(cfg.head_dim, cfg.local_rope_theta)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        position_ids: Tensor | None = None,
        varlen: Varlen | None = None,
    ) -> Tensor:
        """Padded: ``input_ids`` [B, S], ``attention_mask`` [B, S] (1 for real tokens; None:
        all real) -> [B, S, H]. Packed: ``input_ids`` and ``position_ids`` [T] (each token's
        position in its sequence) with ``varlen`` -> [T, H]."""
        x = self.embeddings(input_ids)
        if varlen is not None:
            if position_ids is None or attention_mask is not None:
                raise ValueError("packed input takes position_ids and no attention_mask")
            masks: dict[bool, Varlen | PaddedMask] = {True: varlen, False: varlen}
        else:
            S = input_ids.shape[1]
            if position_ids is None:
                position_ids = torch.arange(S, device=input_ids.device)
            keys = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
            band = band_mask(S, self.config.window, input_ids.device)
            local = keys if band is None else (band if keys is None else keys & band)
            masks = {True: keys, False: local}
        ropes = {
            True: self.global_rope(position_ids, x.dtype),
            False: self.local_rope(position_ids, x.dtype),
        }
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            args = (x, ropes[layer.is_global], masks[layer.is_global])
            x = checkpoint(layer, *args, use_reentrant=False) if recompute else layer(*args)
        return self.final_norm(x)


class ModernBertPredictionHead(nn.Module):
    """Dense (no bias), GELU, LayerNorm: [..., H] -> [..., H]."""

    def __init__(self, cfg: ModernBertModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.norm = _layer_norm(cfg)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(F.gelu(self.dense(x)))


def init_modern_weights(model: nn.Module, cfg: ModernBertModelConfig) -> None:
    """transformers' ``ModernBertPreTrainedModel._init_weights``: truncated normals (at
    ``initializer_cutoff_factor`` std) with std ``initializer_range`` for embeddings and
    input projections, ``initializer_range / sqrt(2 L)`` for output projections and the
    head's dense layer; LayerNorms at 1; biases at 0."""
    std, cutoff = cfg.initializer_range, cfg.initializer_cutoff_factor
    out_std = std / math.sqrt(2.0 * cfg.num_layers)
    for module in model.modules():
        if isinstance(module, ModernBertEmbeddings):
            _trunc_normal(module.tok_embeddings.weight, std, cutoff)
        elif isinstance(module, ModernBertMLP):
            _trunc_normal(module.Wi.weight, std, cutoff)
            _trunc_normal(module.Wo.weight, out_std, cutoff)
        elif isinstance(module, ModernBertAttention):
            _trunc_normal(module.Wqkv.weight, std, cutoff)
            _trunc_normal(module.Wo.weight, out_std, cutoff)
        elif isinstance(module, ModernBertPredictionHead):
            _trunc_normal(module.dense.weight, out_std, cutoff)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)


class ModernBertForMaskedLM(nn.Module):
    """ModernBERT with its MLM head, for pre-training; takes the batches of
    :class:`~bertpipe.training.models.bert.model.BertForPreTraining` (segment ids and NSP labels,
    which this architecture has no use for, are accepted and ignored)."""

    def __init__(self, cfg: ModernBertModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vocab_size = cfg.vocab_size
        self.model = ModernBertModel(cfg)
        self.head = ModernBertPredictionHead(cfg)
        self.decoder = nn.Linear(cfg.hidden_size, cfg.padded_vocab_size, device="meta")
        self.decoder.weight = self.model.embeddings.tok_embeddings.weight
        self.decoder.bias = nn.Parameter(torch.zeros(cfg.padded_vocab_size))
        init_modern_weights(self, cfg)
        with torch.no_grad():
            self.model.embeddings.tok_embeddings.weight[cfg.vocab_size :].zero_()

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        mlm_positions: Tensor | None = None,
        mlm_labels: Tensor | None = None,
        nsp_labels: Tensor | None = None,
        position_ids: Tensor | None = None,
        cu_seqlens: Tensor | None = None,
        seq_lengths: tuple[int, ...] | None = None,
    ) -> PreTrainingOutput:
        """As :meth:`BertForPreTraining.forward`; ``nsp_logits`` and the NSP terms are None."""
        varlen = None
        if cu_seqlens is not None:
            if seq_lengths is None:
                raise ValueError("packed input needs seq_lengths (host ints) with cu_seqlens")
            varlen = Varlen(cu_seqlens, tuple(seq_lengths))
        x = self.model(input_ids, attention_mask, position_ids=position_ids, varlen=varlen)
        if mlm_positions is not None:
            x = x.reshape(-1, x.shape[-1]).index_select(0, mlm_positions)
        logits = self.decoder(self.head(x))[..., : self.vocab_size]
        result = PreTrainingOutput(mlm_logits=logits, nsp_logits=None)
        if mlm_labels is not None:
            flat, labels = logits.reshape(-1, logits.shape[-1]), mlm_labels.reshape(-1)
            result.mlm_loss = F.cross_entropy(flat.float(), labels, ignore_index=IGNORE_INDEX)
            with torch.no_grad():
                result.mlm_correct = (flat.argmax(-1) == labels).sum()
                result.mlm_count = (labels != IGNORE_INDEX).sum()
            result.loss = result.mlm_loss
        return result


# --- what a fine-tuning task model of this family holds before its task layer


def task_encoder(cfg: ModernBertModelConfig, pooled: bool) -> dict[str, nn.Module]:
    """The encoder of a task model and the prediction head before the task layer (which a
    pre-trained MLM checkpoint provides, as transformers loads it), named as transformers
    names them: ``model``, ``head``. Sequence tasks pool the ``[CLS]`` state (transformers'
    default ``classifier_pooling``)."""
    return {"model": ModernBertModel(cfg), "head": ModernBertPredictionHead(cfg)}


def task_features(
    model: nn.Module,
    input_ids: Tensor,
    token_type_ids: Tensor | None,
    attention_mask: Tensor | None,
    pooled: bool,
) -> Tensor:
    """[B, H] (the ``[CLS]`` state) or [B, S, H], through the prediction head; segment ids,
    which this architecture has none of, are ignored."""
    states = model.model(input_ids, attention_mask)
    return model.head(states[:, 0] if pooled else states)


def task_dropout(cfg: ModernBertModelConfig, span_qa: bool, given: float | None) -> float:
    """Dropout before the task layer: ``given``, else none (transformers' default)."""
    return 0.0 if given is None else given


def init_task_layer(model: nn.Module, layer: nn.Linear, cfg: ModernBertModelConfig) -> None:
    """transformers' init of the whole task model (:func:`init_modern_weights`), then its
    "final_out" init of the task layer: std hidden^-1/2, truncated, zero bias."""
    init_modern_weights(model, cfg)
    std = cfg.hidden_size**-0.5
    _trunc_normal(layer.weight, std, cfg.initializer_cutoff_factor)
    nn.init.zeros_(layer.bias)
