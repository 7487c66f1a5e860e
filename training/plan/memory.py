"""Per-GPU memory of a planned pre-training run: model states under ZeRO, activations,
communication buckets and the CUDA allowance.

Part of ``bertpipe plan`` (:mod:`bertpipe.training.plan.plan`); pure arithmetic on the model
config. Symbols used in the formulas below: Ψ parameters, N world size (GPUs), L layers,
h hidden size, I feed-forward width, a attention heads, V padded vocabulary, s sequence
length, b micro batch, m masked positions per sequence, e bytes per 16/32-bit element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bertpipe.config import ConfigError
from bertpipe.training.models.bert.config import BertModelConfig
from bertpipe.training.models.families import family_of
from bertpipe.training.models.modernbert.config import ModernBertModelConfig

__all__ = [
    "ALLREDUCE_BUCKET_ELEMENTS",
    "GIB",
    "ActivationBytes",
    "MemoryEstimate",
    "StateBytes",
    "activation_bytes",
    "buffer_bytes",
    "bytes_per_parameter",
    "element_bytes",
    "estimate_memory",
    "model_state_bytes",
]

GIB = 1 << 30
"""Bytes in a GiB; every memory figure of the plan is in GiB (as nvidia-smi's MiB / 1024)."""

ALLREDUCE_BUCKET_ELEMENTS = 500_000_000
"""Elements DeepSpeed flattens per all-reduce without ZeRO (its ``MEMORY_OPT_ALLREDUCE_SIZE``)."""


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state on one GPU before ZeRO partitioning."""

    parameters: int
    gradients: int
    optimizer: int


def bytes_per_parameter(precision: str, zero_stage: int = 0) -> StateBytes:
    """Model-state bytes per parameter (Rajbhandari et al. 2020, "ZeRO", section 3.1).

    Mixed precision (bf16/fp16): 2 (16-bit weights) + 2 (16-bit gradients) + 12 (fp32
    master weights, Adam or LAMB first and second moments, 4 each) = 16 bytes.
    fp32 at ZeRO 0: 4 (weights, which are their own master copy) + 4 (gradients) + 8
    (moments) = 16. fp32 at ZeRO 1-3: DeepSpeed's ZeRO optimizer steps on an fp32 copy of
    its partition even when the weights are fp32 (``single_partition_of_fp32_groups``,
    stage 3's ``fp32_partitioned_groups_flat``), so the optimizer holds 12 bytes, as in
    mixed precision (measured: BENCHMARKS.md, "Memory", the chosen configs).
    Gradients are accumulated in the model dtype (DeepSpeed's default ``grad_accum_dtype``).
    """
    if precision == "fp32":
        return StateBytes(parameters=4, gradients=4, optimizer=12 if zero_stage >= 1 else 8)
    if precision in ("bf16", "fp16"):
        return StateBytes(parameters=2, gradients=2, optimizer=12)
    raise ConfigError("precision", f"must be fp32, fp16 or bf16, got {precision!r}")


def element_bytes(precision: str) -> int:
    """Bytes per activation / communicated element: 2 at bf16 and fp16, 4 at fp32."""
    return 4 if precision == "fp32" else 2


def model_state_bytes(
    num_params: int, precision: str, zero_stage: int, world_size: int, offload: bool
) -> tuple[int, int, int, int]:
    """(parameters, gradients, optimizer states on the GPU, optimizer states on the host)
    in bytes per GPU.

    ZeRO partitions over N = ``world_size`` ranks, each holding ceil(Ψ / N) elements:
    stage 0 nothing, 1 the optimizer states, 2 + gradients, 3 + parameters. Optimizer
    offload moves the optimizer states (fp32 master weights included) to host memory.
    """
    per = bytes_per_parameter(precision, zero_stage)
    shard = math.ceil(num_params / world_size)
    params = per.parameters * (shard if zero_stage >= 3 else num_params)
    grads = per.gradients * (shard if zero_stage >= 2 else num_params)
    optim = per.optimizer * (shard if zero_stage >= 1 else num_params)
    if offload:
        return params, grads, 0, optim
    return params, grads, optim, 0


@dataclass(frozen=True)
class ActivationBytes:
    """Activation memory of one micro batch on one GPU, in bytes."""

    per_layer: int
    """One layer with everything stored for its backward pass."""
    encoder: int
    """All layers (with checkpointing: layer inputs plus one layer being recomputed)."""
    embeddings: int
    head: int
    """MLM head at the masked positions, its fp32 loss, pooler and NSP."""
    total: int


def activation_bytes(
    cfg: BertModelConfig | ModernBertModelConfig,
    seq_len: int,
    micro_batch: int,
    num_masked: int,
    precision: str,
    checkpointing: bool,
    attention_scores_stored: bool = False,
    mask_bytes: int = 1,
) -> ActivationBytes:
    """Activations kept for the backward pass of one micro batch.

    Per layer, after Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models", eq. 2: s·b·h·(34 + 5·a·s/h) bytes at 16 bit), generalised to an
    FFN width I and element size e, with 1-byte dropout masks::

        layer = s·b·(e·(8h + 2I) + 2h)        (I = 4h, e = 2: 34·s·b·h)
              + a·s²·b·(2e + 1)               (only if the s x s scores are stored: 5·a·s²·b)

    8h + 2I values per token: QKV input, Q, K, V, attention output (the out-projection's
    input), FFN input, GELU input and output (2I), both LayerNorm inputs; 2h bytes: the two
    dropout masks. The model's SDPA kernels keep no s x s matrix (a log-sum-exp of a·s·b
    floats, left out), so the second line is off by default.

    ModernBERT (no dropout, no NSP): ``layer = s·b·e·(10h + 4I)``: the two pre-norm inputs, the
    Q/K/V input, Q, K, V, Q and K again after the rotary embedding, the attention output (in
    both layouts) and the out-projection's input, and the GeGLU's 2I projection, GELU output
    and gated product (4I). (Counted with ``saved_tensors_hooks`` on one to three layers of
    ModernBERT-large: 10.3 and 42 MiB per layer at 2 x 128 and 2 x 512 tokens against
    10h + 4I's 10.1 and 40.5.) Without dropout its attention keeps no s x s matrix on the
    CPU either.

    ``mask_bytes``: a dropout mask's element, 1 (``F.dropout`` on a GPU keeps bool masks);
    torch's CPU dropout keeps its masks in the activations' dtype (``e``), and its CPU
    attention the s x s probabilities, their mask and the dropped probabilities: a plan for
    DeepSpeed's CPU accelerator (``bertpipe plan --cpu``) stores the scores with
    ``mask_bytes = e``: ``a·s²·b·3e`` (measured: BENCHMARKS.md, "Memory").

    Activation checkpointing keeps only each layer's input, plus one layer's full set while
    it is recomputed in the backward pass: ``L·e·s·b·h + layer``.

    Embeddings: the LayerNorm input and the dropout mask, ``s·b·(e·h + h)``.
    MLM head at n = b·m masked positions: transform input, GELU input, LayerNorm input and
    decoder input (4·e·h per position), the logits (V·e), their fp32 copy for the loss and
    the log-softmax the loss keeps (V·8): ``n·(4·e·h + V·(e + 8))``; pooler and NSP
    ``b·(3·e·h)``, tiny.
    """
    e = element_bytes(precision)
    s, b = seq_len, micro_batch
    h, a = cfg.hidden_size, cfg.num_heads
    costs = family_of(cfg).costs
    layer = costs.layer_activation_bytes(cfg, s, b, e, mask_bytes)
    if attention_scores_stored:
        layer += a * s * s * b * (2 * e + mask_bytes)
    # checkpointing: the layer inputs stay, one layer's activations exist while it is redone
    encoder = cfg.num_layers * (e * s * b * h if checkpointing else layer)
    encoder += layer if checkpointing else 0
    embeddings = s * b * (e * h + h * mask_bytes)
    n = b * num_masked
    head = costs.head_activation_bytes(cfg, b, n, e)
    return ActivationBytes(
        per_layer=layer,
        encoder=encoder,
        embeddings=embeddings,
        head=head,
        total=encoder + embeddings + head,
    )


def buffer_bytes(num_params: int, precision: str, zero_stage: int, bucket_size: int) -> int:
    """Gradient communication buffers as DeepSpeed allocates them, in bytes:
    ``min(5e8, Ψ)·e`` without ZeRO (the all-reduce flattens that many elements at a time),
    ``2·min(bucket_size, Ψ)·e`` with ZeRO (its reduce and all-gather buckets)."""
    e = element_bytes(precision)
    if zero_stage == 0:
        return min(ALLREDUCE_BUCKET_ELEMENTS, num_params) * e
    return 2 * min(bucket_size, num_params) * e


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory of one GPU, in bytes: the sum of the parts (each at its own peak)."""

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    buffers: int
    """Communication buckets: stage 0 one flattened all-reduce bucket of min(5e8, Ψ)
    elements, stages 1-3 a reduce and an all-gather bucket, 2 x min(zero.bucket_size, Ψ)."""
    cuda_overhead: int
    """The assumed CUDA context and workspace allowance."""
    total: int
    host_optimizer_states: int
    """Optimizer states each GPU's rank keeps in host memory (optimizer offload)."""
    capacity: int | None
    """The GPU's memory; None when unknown."""
    fits: bool | None
    """total <= capacity; None when the capacity is unknown."""
    activation_detail: ActivationBytes


def estimate_memory(
    cfg: BertModelConfig | ModernBertModelConfig,
    *,
    precision: str,
    zero_stage: int,
    world_size: int,
    offload: bool,
    seq_len: int,
    micro_batch: int,
    num_masked: int,
    bucket_size: int,
    cuda_overhead_bytes: int,
    capacity_bytes: int | None,
    attention_scores_stored: bool = False,
    mask_bytes: int = 1,
) -> MemoryEstimate:
    """Per-GPU memory: model states (:func:`model_state_bytes`), activations
    (:func:`activation_bytes`), communication buckets (:func:`buffer_bytes`) and the CUDA
    allowance. The parts are summed although they do not all peak together (gradients
    fill up while activations drain), so the total leans high; allocator fragmentation
    is not modelled."""
    num_params = cfg.num_parameters()
    params, grads, optim, host = model_state_bytes(
        num_params, precision, zero_stage, world_size, offload
    )
    act = activation_bytes(
        cfg,
        seq_len,
        micro_batch,
        num_masked,
        precision,
        cfg.activation_checkpointing,
        attention_scores_stored,
        mask_bytes,
    )
    buffers = buffer_bytes(num_params, precision, zero_stage, bucket_size)
    total = params + grads + optim + act.total + buffers + cuda_overhead_bytes
    return MemoryEstimate(
        parameters=params,
        gradients=grads,
        optimizer_states=optim,
        activations=act.total,
        buffers=buffers,
        cuda_overhead=cuda_overhead_bytes,
        total=total,
        host_optimizer_states=host,
        capacity=capacity_bytes,
        fits=None if capacity_bytes is None else total <= capacity_bytes,
        activation_detail=act,
    )
