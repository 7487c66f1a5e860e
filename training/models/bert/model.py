"""BERT for pre-training in plain torch: single-device code, parameter names as transformers'.

Module and parameter names match ``transformers.BertForPreTraining`` one-to-one
(``bert.encoder.layer.0.attention.self.query.weight``, ``cls.predictions.bias``, ...), so
state dicts convert without renaming (see :mod:`bertpipe.training.models.bert.hf`). Two things
differ inside:

* the vocabulary is padded to a multiple of ``pad_vocab_multiple`` (embedding rows and
  decoder bias); logits are sliced back to the real ``vocab_size``;
* the MLM head runs only at the masked positions when ``mlm_positions`` is given (sparse
  prediction), so the full ``[B, S, V]`` logits are never built during training.

Shapes: B batch, S sequence length, H hidden size, V vocabulary size, N masked positions.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from bertpipe.training.models.attention import Varlen, varlen_attention
from bertpipe.training.models.bert.config import PRESETS, BertModelConfig

__all__ = [
    "PRESETS",
    "BertForPreTraining",
    "BertModel",
    "BertModelConfig",
    "BertModelOutput",
    "PreTrainingOutput",
    "Varlen",
    "compile_layers",
    "init_task_layer",
    "init_weights",
    "task_dropout",
    "task_encoder",
    "task_features",
]

QA_LAYER = "qa_outputs"
"""The name of a span-QA model's output layer (transformers' ``BertForQuestionAnswering``)."""

IGNORE_INDEX = -100


def init_weights(module: nn.Module, std: float) -> None:
    """BERT's init for one module (use with ``model.apply``), as transformers' ``_init_weights``:
    Linear/Embedding weights ~ N(0, std), zero biases, LayerNorm 1/0, padding row zero."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def sinusoidal_table(num_positions: int, dim: int) -> Tensor:
    """The Transformer's fixed position table [P, dim]: sin on even, cos on odd channels."""
    position = torch.arange(num_positions, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(1e4) / dim))
    table = torch.zeros(num_positions, dim)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq[: dim // 2])
    return table


class _CpuDropout(torch.autograd.Function):
    """Dropout whose mask comes from ``torch.rand(...) < keep``: the same Bernoulli(keep)
    masks as ``F.dropout``, drawn about twice as fast on CPU as its ``bernoulli_``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, p: float) -> Tensor:
        keep = 1.0 - p
        # in place: uniform draws -> 1.0 where kept -> 1/keep where kept, 0 elsewhere
        mask = torch.rand(x.shape, dtype=x.dtype, device=x.device).lt_(keep).mul_(1.0 / keep)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (mask,) = ctx.saved_tensors
        return grad * mask, None


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """``F.dropout``, with a faster mask on CPU (GPUs keep PyTorch's fused kernel)."""
    if not training or p == 0.0:
        return x
    if x.device.type == "cpu":
        return _CpuDropout.apply(x, p)
    return F.dropout(x, p, True)


class Dropout(nn.Module):
    """``nn.Dropout`` through :func:`dropout`."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class BertEmbeddings(nn.Module):
    """Word + segment + position embeddings, then LayerNorm and dropout: [B, S] -> [B, S, H]."""

    position_ids: Tensor
    sinusoidal_table: Tensor  # only with position_embedding="sinusoidal"

    def __init__(self, cfg: BertModelConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.padded_vocab_size, H, padding_idx=cfg.pad_token_id)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, H)
        self.position_embeddings: nn.Embedding | None = None
        if cfg.position_embedding == "learned":
            self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, H)
        else:
            table = sinusoidal_table(cfg.max_position_embeddings, H)
            self.register_buffer("sinusoidal_table", table, persistent=False)
        self.register_buffer(
            "position_ids", torch.arange(cfg.max_position_embeddings), persistent=False
        )
        self.LayerNorm = nn.LayerNorm(H, eps=cfg.layer_norm_eps)
        self.dropout = Dropout(cfg.hidden_dropout)

    def forward(
        self, input_ids: Tensor, token_type_ids: Tensor, position_ids: Tensor | None = None
    ) -> Tensor:
        """[B, S] -> [B, S, H] (positions 0..S-1), or packed [T] with ``position_ids`` [T]
        (each token's position in its sequence) -> [T, H]."""
        if position_ids is None:
            position_ids = self.position_ids[: input_ids.shape[1]]
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)
        else:
            x = x + self.sinusoidal_table[position_ids].to(x.dtype)
        return self.dropout(self.LayerNorm(x))


AttentionMask = Tensor | Varlen | None
"""A bool key mask [B, 1, 1, S] (padded layout), a :class:`Varlen` (packed layout, [T, H]
hidden states) or None (padded layout, every token real)."""


class BertSelfAttention(nn.Module):
    """Multi-head self-attention: [B, S, H] -> [B, S, H] with SDPA, or packed [T, H] -> [T, H]
    with :func:`bertpipe.training.models.attention.varlen_attention` (before the output Linear)."""

    def __init__(self, cfg: BertModelConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.dropout_p = cfg.attention_dropout
        self.query = nn.Linear(H, H)
        self.key = nn.Linear(H, H)
        self.value = nn.Linear(H, H)

    def forward(self, x: Tensor, mask: AttentionMask) -> Tensor:
        """``mask``: bool [B, 1, 1, S], True where a key is a real token (None: all real), or
        the :class:`Varlen` of packed ``x`` [T, H]."""
        dropout_p = self.dropout_p if self.training else 0.0
        if isinstance(mask, Varlen):
            T, H = x.shape
            q, k, v = (proj(x).view(T, self.num_heads, self.head_dim) for proj in self.qkv())
            return varlen_attention(q, k, v, mask, dropout_p).reshape(T, H)
        B, S, H = x.shape
        q, k, v = (
            proj(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2) for proj in self.qkv()
        )  # [B, A, S, D]
        if self.training and self.dropout_p > 0 and x.device.type == "cpu":
            # SDPA's CPU kernels cannot drop attention weights; it would fall back to this
            # same computation with a slower dropout mask
            scores = torch.matmul(q * self.head_dim**-0.5, k.transpose(-1, -2))
            if mask is not None:
                scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
            weights = dropout(scores.softmax(-1), self.dropout_p, True)
            out = torch.matmul(weights, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        return out.transpose(1, 2).reshape(B, S, H)

    def qkv(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return self.query, self.key, self.value


class BertSelfOutput(nn.Module):
    """Attention output projection, dropout and residual (+ LayerNorm when post-LN)."""

    def __init__(self, cfg: BertModelConfig, in_features: int | None = None) -> None:
        super().__init__()
        self.post_ln = not cfg.pre_layer_norm
        self.dense = nn.Linear(in_features or cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = Dropout(cfg.hidden_dropout)

    def forward(self, hidden: Tensor, residual: Tensor) -> Tensor:
        """[B, S, in_features], [B, S, H] -> [B, S, H]."""
        x = self.dropout(self.dense(hidden)) + residual
        return self.LayerNorm(x) if self.post_ln else x


class BertAttention(nn.Module):
    """Self-attention sub-layer. Pre-LN applies ``output.LayerNorm`` to its input instead."""

    def __init__(self, cfg: BertModelConfig) -> None:
        super().__init__()
        self.pre_ln = cfg.pre_layer_norm
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg)

    def forward(self, x: Tensor, mask: AttentionMask) -> Tensor:
        """[B, S, H] -> [B, S, H], or packed [T, H] -> [T, H]."""
        h = self.output.LayerNorm(x) if self.pre_ln else x
        return self.output(self.self(h, mask), x)


class BertIntermediate(nn.Module):
    """First feed-forward Linear with exact (erf) GELU: [B, S, H] -> [B, S, I]."""

    def __init__(self, cfg: BertModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.ffn_size)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.dense(x))


class BertOutput(BertSelfOutput):
    """Second feed-forward Linear (I -> H), dropout and residual (+ LayerNorm when post-LN)."""

    def __init__(self, cfg: BertModelConfig) -> None:
        super().__init__(cfg, in_features=cfg.ffn_size)


class BertLayer(nn.Module):
    """One transformer layer: attention then feed-forward, [B, S, H] -> [B, S, H]."""

    def __init__(self, cfg: BertModelConfig) -> None:
        super().__init__()
        self.pre_ln = cfg.pre_layer_norm
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertOutput(cfg)

    def forward(self, x: Tensor, mask: AttentionMask) -> Tensor:
        x = self.attention(x, mask)
        h = self.output.LayerNorm(x) if self.pre_ln else x
        return self.output(self.intermediate(h), x)


class BertEncoder(nn.Module):
    """The stack of layers, optionally checkpointed per layer: [B, S, H] -> [B, S, H]."""

    def __init__(self, cfg: BertModelConfig) -> None:
        super().__init__()
        self.activation_checkpointing = cfg.activation_checkpointing
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))
        self.final_layer_norm: nn.LayerNorm | None = None
        if cfg.pre_layer_norm:
            self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: Tensor, mask: AttentionMask) -> Tensor:
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layer:
            x = checkpoint(layer, x, mask, use_reentrant=False) if recompute else layer(x, mask)
        return self.final_layer_norm(x) if self.final_layer_norm is not None else x


class BertPooler(nn.Module):
    """Dense + tanh on the [CLS] token's state: [B, H] -> [B, H]."""

    def __init__(self, cfg: BertModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, cls_state: Tensor) -> Tensor:
        return torch.tanh(self.dense(cls_state))


@dataclasses.dataclass
class BertModelOutput:
    sequence_output: Tensor
    """Last layer's hidden states [B, S, H], or [T, H] for packed input."""
    pooled_output: Tensor | None
    """Pooled [CLS] representation [B, H]; None without a pooler."""


class BertModel(nn.Module):
    """Embeddings, encoder and pooler, initialised with BERT's init."""

    def __init__(self, cfg: BertModelConfig, add_pooling_layer: bool = True) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        self.pooler = BertPooler(cfg) if add_pooling_layer else None
        self.apply(functools.partial(init_weights, std=cfg.initializer_range))
        with torch.no_grad():
            self.embeddings.word_embeddings.weight[cfg.vocab_size :].zero_()

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        *,
        position_ids: Tensor | None = None,
        varlen: Varlen | None = None,
    ) -> BertModelOutput:
        """Padded layout: ``input_ids``/``token_type_ids`` long [B, S]; ``attention_mask``
        [B, S], 1/True for real tokens (None: all real; every row needs a real token).

        Packed (unpadded) layout, with ``varlen``: ``input_ids``, ``token_type_ids`` and
        ``position_ids`` long [T], the real tokens of B sequences one after the other (see
        :func:`bertpipe.training.pretrain.data.collate.unpad_batch`); no attention mask. The encoder
        then computes nothing for padding, and ``sequence_output`` is [T, H]."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if varlen is not None:
            if position_ids is None or attention_mask is not None:
                raise ValueError("packed input takes position_ids and no attention_mask")
            x = self.encoder(self.embeddings(input_ids, token_type_ids, position_ids), varlen)
            first = x.index_select(0, varlen.starts)
        else:
            mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
            x = self.encoder(self.embeddings(input_ids, token_type_ids), mask)
            first = x[:, 0]
        pooled = self.pooler(first) if self.pooler is not None else None
        return BertModelOutput(sequence_output=x, pooled_output=pooled)


class BertPredictionHeadTransform(nn.Module):
    """Dense, GELU, LayerNorm before the vocabulary projection: [..., H] -> [..., H]."""

    def __init__(self, cfg: BertModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.LayerNorm(F.gelu(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    """MLM head: transform, then the vocabulary projection whose weight IS the word embedding
    matrix (same Parameter) and whose bias is ``bias``: [..., H] -> [..., V] (padding sliced)."""

    def __init__(self, cfg: BertModelConfig, word_embeddings: nn.Parameter) -> None:
        super().__init__()
        self.vocab_size = cfg.vocab_size
        self.transform = BertPredictionHeadTransform(cfg)
        self.bias = nn.Parameter(torch.zeros(cfg.padded_vocab_size))
        # built on meta (no memory), then both parameters are shared: decoder.weight is the
        # embedding matrix, decoder.bias is ``bias`` (transformers ties both the same way)
        self.decoder = nn.Linear(cfg.hidden_size, cfg.padded_vocab_size, device="meta")
        self.decoder.weight = word_embeddings
        self.decoder.bias = self.bias

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.transform(x))[..., : self.vocab_size]


class BertPreTrainingHeads(nn.Module):
    """MLM head on token states and NSP classifier on the pooled state."""

    def __init__(self, cfg: BertModelConfig, word_embeddings: nn.Parameter) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(cfg, word_embeddings)
        self.seq_relationship = nn.Linear(cfg.hidden_size, 2)

    def forward(self, tokens: Tensor, pooled: Tensor) -> tuple[Tensor, Tensor]:
        """[..., H], [B, H] -> MLM logits [..., V], NSP logits [B, 2]."""
        return self.predictions(tokens), self.seq_relationship(pooled)


@dataclasses.dataclass
class PreTrainingOutput:
    mlm_logits: Tensor
    """[N, V] at ``mlm_positions``, or [B, S, V] when no positions were given."""
    nsp_logits: Tensor | None
    """[B, 2]; class 0 = B follows A, 1 = B is random (None: a model without NSP)."""
    loss: Tensor | None = None
    """mlm_loss + nsp_loss (only the terms whose labels were given)."""
    mlm_loss: Tensor | None = None
    """Mean fp32 cross-entropy over the MLM labels that are not -100."""
    nsp_loss: Tensor | None = None
    """Mean fp32 cross-entropy of the NSP classifier."""
    mlm_correct: Tensor | None = None
    """Detached count (long scalar) of MLM labels predicted right."""
    mlm_count: Tensor | None = None
    """Detached count of MLM labels that are not -100 (the accuracy's denominator)."""
    nsp_correct: Tensor | None = None
    """Detached count of NSP labels predicted right (denominator: B)."""


class BertForPreTraining(nn.Module):
    """BERT with MLM and NSP heads; the MLM head runs only at the masked positions."""

    def __init__(self, cfg: BertModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.bert = BertModel(cfg)
        word_embeddings = self.bert.embeddings.word_embeddings.weight
        assert isinstance(word_embeddings, nn.Parameter)
        self.cls = BertPreTrainingHeads(cfg, word_embeddings)
        init = functools.partial(init_weights, std=cfg.initializer_range)
        self.cls.predictions.transform.apply(init)
        self.cls.seq_relationship.apply(init)

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
        """Inputs as :meth:`BertModel.forward`; the packed layout is given by ``cu_seqlens``
        (long [B + 1] on the device) with ``seq_lengths`` (the B lengths, host ints).

        ``mlm_positions``: long [N], flat indices ``row * S + col`` into the batch's B*S
        positions (packed: indices into the T tokens); ``mlm_labels``: long [N] original
        token ids there (-100 = ignore, for padded fixed-size position lists). Without
        positions the head runs everywhere and ``mlm_labels``, if given, is [B, S] with
        -100 at unmasked tokens (transformers' way).
        ``nsp_labels``: long [B], 0 = B follows A, 1 = B is random.
        """
        varlen = None
        if cu_seqlens is not None:
            if seq_lengths is None:
                raise ValueError("packed input needs seq_lengths (host ints) with cu_seqlens")
            varlen = Varlen(cu_seqlens, tuple(seq_lengths))
        out = self.bert(
            input_ids, token_type_ids, attention_mask, position_ids=position_ids, varlen=varlen
        )
        tokens = out.sequence_output
        if mlm_positions is not None:
            tokens = tokens.reshape(-1, tokens.shape[-1]).index_select(0, mlm_positions)
        assert out.pooled_output is not None
        mlm_logits, nsp_logits = self.cls(tokens, out.pooled_output)
        result = PreTrainingOutput(mlm_logits=mlm_logits, nsp_logits=nsp_logits)
        if mlm_labels is not None:
            logits, labels = mlm_logits.reshape(-1, mlm_logits.shape[-1]), mlm_labels.reshape(-1)
            result.mlm_loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX)
            with torch.no_grad():
                result.mlm_correct = (logits.argmax(-1) == labels).sum()
                result.mlm_count = (labels != IGNORE_INDEX).sum()
        if nsp_labels is not None:
            result.nsp_loss = F.cross_entropy(nsp_logits.float(), nsp_labels)
            with torch.no_grad():
                result.nsp_correct = (nsp_logits.argmax(-1) == nsp_labels).sum()
        losses = [t for t in (result.mlm_loss, result.nsp_loss) if t is not None]
        result.loss = sum(losses[1:], losses[0]) if losses else None
        return result


def compile_layers(model: nn.Module, **options: Any) -> int:
    """``torch.compile`` the parts of ``model`` between attentions, in place
    (``nn.Module.compile``: parameter names and state dicts stay as they are): each layer's
    output projections with dropout + residual + LayerNorm, its first feed-forward Linear with
    GELU, and the MLM transform, so that those fuse into single kernels. Attention and the
    Q/K/V projections stay eager: their inputs carry the batch's sequence lengths, which a
    graph would be specialised on. Shapes are dynamic, so packed batches of varying token
    counts reuse one graph. Returns the number of modules compiled."""
    options = {"dynamic": True, **options}
    count = 0
    for module in model.modules():
        if isinstance(module, BertSelfOutput | BertIntermediate | BertPredictionHeadTransform):
            module.compile(**options)
            count += 1
    return count


# --- what a fine-tuning task model of this family holds before its task layer


def task_encoder(cfg: BertModelConfig, pooled: bool) -> dict[str, nn.Module]:
    """The encoder of a task model, named as transformers names it: ``bert`` (with the pooler
    for sequence tasks, whose features are the pooled ``[CLS]`` state)."""
    return {"bert": BertModel(cfg, add_pooling_layer=pooled)}


def task_features(
    model: nn.Module,
    input_ids: Tensor,
    token_type_ids: Tensor | None,
    attention_mask: Tensor | None,
    pooled: bool,
) -> Tensor:
    """[B, H] (the pooled ``[CLS]`` state) or [B, S, H] (every token's)."""
    out = model.bert(input_ids, token_type_ids, attention_mask)
    return out.pooled_output if pooled else out.sequence_output


def task_dropout(cfg: BertModelConfig, span_qa: bool, given: float | None) -> float:
    """Dropout before the task layer: ``given``, else the encoder's hidden dropout; none
    before span QA's output layer (transformers' ``BertForQuestionAnswering`` has none)."""
    if span_qa:
        return 0.0
    return cfg.hidden_dropout if given is None else given


def init_task_layer(model: nn.Module, layer: nn.Linear, cfg: BertModelConfig) -> None:
    """BERT's init of a new task layer: N(0, initializer_range), zero bias (the encoder is
    initialised when built, and usually loaded from a checkpoint after)."""
    layer.apply(functools.partial(init_weights, std=cfg.initializer_range))
