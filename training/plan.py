"""``bertpipe plan``: what a pre-training run will do and need, worked out without starting it.

Everything here is arithmetic on the typed config, the data manifests and a few stated
assumptions: no process group, no DeepSpeed engine, no GPU and no model is built (the
parameter count is analytic, :meth:`BertModelConfig.num_parameters`). The functions are
pure; :func:`make_plan` ties them together into a :class:`Plan` that the command line
prints (:mod:`bertpipe.training.cli_plan`). Its inputs beyond the config, :class:`PlanOptions`,
are in :mod:`bertpipe.training.plan_options`.

Symbols used in the formulas below: Ψ parameters, N world size (GPUs), L layers, h hidden
size, I feed-forward width, a attention heads, V padded vocabulary, s sequence length,
b micro batch, m masked positions per sequence, e bytes per 16/32-bit element.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bertpipe import fsio
from bertpipe.config import ConfigError
from bertpipe.errors import BertpipeError
from bertpipe.formatting import format_hmm
from bertpipe.training.config import PretrainConfig
from bertpipe.training.flops import peak_flops, training_flops_per_sequence
from bertpipe.training.model_config import BertModelConfig
from bertpipe.training.plan_options import DEFAULT_SEQ_LENS, DEFAULT_VOCAB_SIZE, PlanOptions

if TYPE_CHECKING:  # the loader module imports webdataset: only when a manifest is read
    from bertpipe.training.data import Manifest

__all__ = [
    "ALLREDUCE_BUCKET_ELEMENTS",
    "DEFAULT_SEQ_LENS",
    "DEFAULT_VOCAB_SIZE",
    "GIB",
    "GPU_MEMORY_GIB",
    "ActivationBytes",
    "DataPlan",
    "MemoryEstimate",
    "ModelSummary",
    "PhasePlan",
    "Plan",
    "PlanOptions",
    "StepTime",
    "World",
    "activation_bytes",
    "buffer_bytes",
    "bytes_per_parameter",
    "comm_bytes_per_step",
    "comm_passes_per_step",
    "data_plan",
    "estimate_memory",
    "format_hmm",
    "gpu_memory_gib",
    "make_plan",
    "model_state_bytes",
    "read_manifest",
    "resolve_world",
    "step_time",
]

GIB = 1 << 30
"""Bytes in a GiB; every memory figure of the plan is in GiB (as nvidia-smi's MiB / 1024)."""

ALLREDUCE_BUCKET_ELEMENTS = 500_000_000
"""Elements DeepSpeed flattens per all-reduce without ZeRO (its ``MEMORY_OPT_ALLREDUCE_SIZE``)."""

# Total memory of one GPU in GiB as nvidia-smi reports it (MiB / 1024), by the short names
# ``--gpu`` accepts. Plain "a100" and "v100" are taken as their smaller models, so a "fits"
# verdict is never optimistic; name the larger one (a100-80g, v100-32g) when that is the card.
GPU_MEMORY_GIB: Mapping[str, float] = {
    "h200": 140.4,
    "h100": 79.6,
    "h100-sxm": 79.6,
    "h100-pcie": 79.6,
    "h100-nvl": 93.6,
    "a100-80g": 80.0,
    "a100-40g": 40.0,
    "a100": 40.0,
    "l40s": 45.0,
    "a10g": 22.5,
    "a10": 22.5,
    "l4": 22.5,
    "v100-32g": 31.7,
    "v100-16g": 15.8,
    "v100": 15.8,
    "t4": 14.7,
}


# --------------------------------------------------------------------------- world


@dataclass(frozen=True)
class World:
    """The GPUs of the run: ``nodes`` x ``gpus_per_node`` ranks."""

    nodes: int
    gpus_per_node: int
    source: str
    """Where the figures came from (options, the launcher's environment or the default)."""

    @property
    def size(self) -> int:
        return self.nodes * self.gpus_per_node


def resolve_world(nodes: int | None, gpus_per_node: int | None, env: Mapping[str, str]) -> World:
    """The world from explicit options, else the launcher's WORLD_SIZE (split into nodes by
    LOCAL_WORLD_SIZE when that divides it), else one node with one GPU."""
    local_env = _env_int(env, "LOCAL_WORLD_SIZE")
    if nodes is not None or gpus_per_node is not None:
        g = gpus_per_node if gpus_per_node is not None else (local_env or 1)
        return World(nodes or 1, g, "--nodes/--gpus-per-node")
    world_env = _env_int(env, "WORLD_SIZE")
    if world_env is not None:
        local = local_env if local_env and world_env % local_env == 0 else world_env
        return World(world_env // local, local, f"WORLD_SIZE={world_env} from the environment")
    return World(1, 1, "default (no --nodes/--gpus-per-node, no WORLD_SIZE)")


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise BertpipeError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < 1:
        raise BertpipeError(f"environment variable {name}={value} must be at least 1")
    return value


def gpu_memory_gib(gpu: str) -> float | None:
    """Memory of a GPU type from :data:`GPU_MEMORY_GIB` (``"A100 80GB"`` -> ``a100-80g``)."""
    return GPU_MEMORY_GIB.get(_gpu_key(gpu))


def _gpu_key(gpu: str) -> str:
    key = re.sub(r"[\s_]+", "-", gpu.strip().lower()).removeprefix("nvidia-")
    return re.sub(r"(\d+)gb$", r"\1g", key)


def read_manifest(data_url: str) -> Manifest | None:
    """The phase folder's manifest, read and checked by the loader's own
    :func:`bertpipe.training.data.load_manifest` (so a broken folder fails here as it would in
    ``pretrain``), or None when the folder has no ``manifest.json``."""
    if not fsio.exists(fsio.join(data_url, "manifest.json")):
        return None
    from bertpipe.training.data import load_manifest

    return load_manifest(data_url)


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state on one GPU before ZeRO partitioning."""

    parameters: int
    gradients: int
    optimizer: int


def bytes_per_parameter(precision: str) -> StateBytes:
    """Model-state bytes per parameter (Rajbhandari et al. 2020, "ZeRO", section 3.1).

    Mixed precision (bf16/fp16): 2 (16-bit weights) + 2 (16-bit gradients) + 12 (fp32
    master weights, Adam or LAMB first and second moments, 4 each) = 16 bytes.
    fp32: 4 (weights, which are their own master copy) + 4 (gradients) + 8 (moments) = 16.
    Gradients are accumulated in the model dtype (DeepSpeed's default ``grad_accum_dtype``).
    """
    if precision == "fp32":
        return StateBytes(parameters=4, gradients=4, optimizer=8)
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
    per = bytes_per_parameter(precision)
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
    cfg: BertModelConfig,
    seq_len: int,
    micro_batch: int,
    num_masked: int,
    precision: str,
    checkpointing: bool,
    attention_scores_stored: bool = False,
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
    h, inter, a = cfg.hidden_size, cfg.ffn_size, cfg.num_heads
    layer = s * b * (e * (8 * h + 2 * inter) + 2 * h)
    if attention_scores_stored:
        layer += a * s * s * b * (2 * e + 1)
    # checkpointing: the layer inputs stay, one layer's activations exist while it is redone
    encoder = cfg.num_layers * (e * s * b * h if checkpointing else layer)
    encoder += layer if checkpointing else 0
    embeddings = s * b * (e * h + h)
    n = b * num_masked
    head = n * (4 * e * h + cfg.padded_vocab_size * (e + 8)) + b * 3 * e * h
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
    cfg: BertModelConfig,
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


# --------------------------------------------------------------------------- time


def comm_passes_per_step(zero_stage: int, accumulation: int) -> int:
    """Full passes of Ψ elements over the ring per optimizer step (each pass sends
    (N-1)/N·Ψ elements per GPU, as a reduce-scatter or all-gather does).

    * stage 0: one all-reduce of the gradients at the accumulation boundary = 2 passes
      (a ring all-reduce is a reduce-scatter plus an all-gather);
    * stage 1: reduce-scatter of the gradients at the boundary + all-gather of the
      updated parameters = 2;
    * stage 2: DeepSpeed reduce-scatters the gradients after every micro batch (they are
      partitioned, so they cannot wait for the boundary) + one all-gather = accumulation + 1;
    * stage 3: per micro batch, all-gather of the parameters in the forward and again in
      the backward pass + reduce-scatter of the gradients = 3·accumulation.

    With accumulation 1 these are ZeRO's 2Ψ (stages 0-2) and 3Ψ (stage 3).
    """
    if zero_stage <= 1:
        return 2
    if zero_stage == 2:
        return accumulation + 1
    return 3 * accumulation


def comm_bytes_per_step(
    num_params: int, zero_stage: int, world_size: int, accumulation: int, precision: str
) -> float:
    """Bytes each GPU sends per optimizer step over its slowest link:
    ``passes · (N-1)/N · Ψ · e`` (passes from :func:`comm_passes_per_step`; for the stage 0
    all-reduce this is the ring factor 2(N-1)/N). Zero on one GPU."""
    if world_size == 1:
        return 0.0
    ring = (world_size - 1) / world_size
    passes = comm_passes_per_step(zero_stage, accumulation)
    return passes * ring * num_params * element_bytes(precision)


@dataclass(frozen=True)
class StepTime:
    """Estimated time of one optimizer step and of a whole phase."""

    flops_per_step: float
    """Training FLOPs of a global batch (hardware FLOPs: with recomputation if checkpointing)."""
    compute_s: float
    comm_bytes_per_gpu: float
    link: str
    """``none`` (one GPU), ``intra-node`` (NVLink) or ``inter-node``."""
    bandwidth_gbps: float | None
    comm_s: float
    exposed_comm_s: float
    step_s: float
    phase_s: float


def step_time(
    *,
    flops_per_step: float,
    world_size: int,
    peak_flops_per_gpu: float,
    mfu: float,
    comm_bytes: float,
    link: str,
    bandwidth_gbps: float | None,
    overlap: float,
    steps: int,
) -> StepTime:
    """Time per step = compute + non-overlapped communication::

        compute = flops_per_step / (N · peak · MFU)
        comm    = comm_bytes / (bandwidth_gbps · 1e9 / 8)
        step    = compute + (1 - overlap) · comm
        phase   = steps · step

    N is the world size, peak the dense FLOP/s of one GPU.
    """
    compute = flops_per_step / (world_size * peak_flops_per_gpu * mfu)
    comm = 0.0
    if comm_bytes > 0:
        if bandwidth_gbps is None or bandwidth_gbps <= 0:
            raise BertpipeError("a positive bandwidth is needed when GPUs communicate")
        comm = comm_bytes / (bandwidth_gbps * 1e9 / 8)
    exposed = (1.0 - overlap) * comm
    step = compute + exposed
    return StepTime(
        flops_per_step=flops_per_step,
        compute_s=compute,
        comm_bytes_per_gpu=comm_bytes,
        link=link,
        bandwidth_gbps=bandwidth_gbps,
        comm_s=comm,
        exposed_comm_s=exposed,
        step_s=step,
        phase_s=step * steps,
    )


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class DataPlan:
    """What a phase's training split gives each rank (None fields: data not found)."""

    url: str
    found: bool
    num_shards: int | None = None
    instances: int | None = None
    """Training instances (sequences) in the phase's shards."""
    shards_per_rank: float | None = None
    """num_shards / N (the loader places whole shards and cuts the rest into block runs)."""
    readers_per_rank: int | None = None
    """Loader readers per rank: max(1, data.num_workers)."""
    min_instances_per_reader: int | None = None
    """Instances of the reader with the fewest: every reader yields as many batches as it."""
    batches_per_rank_per_epoch: int | None = None
    """floor(min_instances_per_reader / micro batch) x readers_per_rank."""
    steps_per_epoch: int | None = None
    """floor(batches_per_rank_per_epoch / accumulation) optimizer steps."""
    instances_used_per_epoch: int | None = None
    """batches_per_rank_per_epoch x micro batch x N; the rest of the split is dropped."""
    epochs: float | None = None
    """Samples the phase consumes / instances in the split."""


def data_plan(
    url: str,
    manifest: Manifest | None,
    world_size: int,
    num_workers: int,
    micro_batch: int,
    accumulation: int,
    samples: int,
) -> DataPlan:
    """Shards and batches per rank as the loader (:mod:`bertpipe.training.data`) will cut them.

    The loader splits the training split's blocks into N x W reader groups of about equal
    instance counts (:func:`bertpipe.training.data.partition_blocks`, W = max(1, num_workers)) and
    every reader yields ``floor(min over readers of instances / b)`` batches per epoch, so
    a rank gets W times that and no rank waits for another at the end of an epoch.
    """
    if manifest is None:
        return DataPlan(url=url, found=False)
    from bertpipe.training.data import DataError, partition_blocks

    if "train" not in manifest.splits:
        raise DataError(f"{manifest.url} has no 'train' split")
    readers = max(1, num_workers)
    sizes = manifest.block_sizes("train")
    groups = partition_blocks(sizes, world_size * readers)
    per_reader = [sum(int(sizes[r.shard][r.start : r.stop].sum()) for r in g) for g in groups]
    smallest = min(per_reader)
    batches = smallest // micro_batch * readers
    instances = sum(int(s.sum()) for s in sizes)
    return DataPlan(
        url=url,
        found=True,
        num_shards=len(sizes),
        instances=instances,
        shards_per_rank=len(sizes) / world_size,
        readers_per_rank=readers,
        min_instances_per_reader=smallest,
        batches_per_rank_per_epoch=batches,
        steps_per_epoch=batches // accumulation,
        instances_used_per_epoch=batches * micro_batch * world_size,
        epochs=samples / instances if instances else None,
    )


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class ModelSummary:
    preset: str
    num_layers: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    vocab_size: int
    vocab_source: str
    padded_vocab_size: int
    num_parameters: int
    """Analytic count of BertForPreTraining (the tied decoder counted once)."""
    activation_checkpointing: bool


@dataclass(frozen=True)
class PhasePlan:
    """One phase: batch arithmetic, lengths, data, memory and (with a GPU type) time."""

    name: str
    data: DataPlan
    seq_len: int
    seq_len_source: str
    num_masked: int
    """Masked positions per sequence the MLM head runs on (memory and FLOPs)."""
    micro_batch_size: int
    accumulation: int
    world_size: int
    global_batch_size: int
    tokens_per_step: int
    """global batch x max_seq_length (padded positions included)."""
    max_steps: int
    warmup_steps: int
    samples: int
    tokens: int
    learning_rate: float
    memory: MemoryEstimate
    time: StepTime | None


@dataclass(frozen=True)
class Plan:
    """The whole plan; :meth:`to_dict` is the ``--json`` output."""

    world_size: int
    nodes: int
    gpus_per_node: int
    world_source: str
    model: ModelSummary
    precision: str
    zero_stage: int
    offload_optimizer: str
    optimizer: str
    gpu: str | None
    peak_tflops: float | None
    peak_source: str | None
    gpu_memory_gib: float | None
    gpu_memory_source: str | None
    mfu: float
    inter_node_gbps: float
    intra_node_gbps: float
    overlap: float
    cuda_overhead_gib: float
    phases: list[PhasePlan]
    total_time_s: float | None
    total_time_hmm: str | None
    assumptions: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def make_plan(
    cfg: PretrainConfig, options: PlanOptions, env: Mapping[str, str] | None = None
) -> Plan:
    """Plan the phases that ``bertpipe pretrain`` would run with ``cfg`` on the world from
    ``options`` (or the launcher's environment ``env``).

    Raises :class:`ConfigError` (key ``phases[i].global_batch_size`` and so on) for a batch
    that does not divide, before any data is read, and :class:`BertpipeError` for an unknown
    GPU type or an unreadable manifest.
    """
    world = resolve_world(options.nodes, options.gpus_per_node, env or {})
    accumulations = cfg.check_world(world.size)
    selected = [p.name for p in cfg.phases if cfg.only_phase in (None, p.name)]
    if len(options.seq_lens) > len(cfg.phases):
        raise BertpipeError(
            f"--seq-len gives {len(options.seq_lens)} lengths for {len(cfg.phases)} phases"
        )
    warnings: list[str] = []
    if cfg.only_phase is not None:
        warnings.append(f"only_phase={cfg.only_phase}: planning that phase alone")

    capacity_gib, capacity_source = _gpu_capacity(options)
    peak, peak_source = _peak(cfg, options)
    if options.gpu is not None and capacity_gib is None and peak is None:
        known = ", ".join(sorted(GPU_MEMORY_GIB))
        raise BertpipeError(
            f"unknown --gpu {options.gpu!r}; known: {known} (or give --gpu-memory-gb and "
            "device_peak_tflops=...)"
        )
    if options.gpu is not None and peak is None:
        warnings.append(
            f"no dense {cfg.precision} peak for {options.gpu!r} in training/flops.py: no time "
            "estimate (set device_peak_tflops=... to give one)"
        )

    _model_config(cfg, options.vocab_size or DEFAULT_VOCAB_SIZE)  # config errors before data
    manifests = {p.name: read_manifest(p.data) for p in cfg.phases if p.name in selected}
    vocab, vocab_source = _vocab(cfg, manifests, options, warnings)
    model_cfg = _model_config(cfg, vocab)
    num_params = model_cfg.num_parameters()

    planned: list[PhasePlan] = []
    for index, phase in enumerate(cfg.phases):
        if phase.name not in selected:
            continue
        manifest = manifests[phase.name]
        seq_len, seq_source = _seq_len(index, manifest, options, warnings)
        if seq_len > model_cfg.max_position_embeddings:
            raise ConfigError(
                "model.max_position_embeddings",
                f"{model_cfg.max_position_embeddings} is shorter than phase {phase.name}'s "
                f"sequences ({seq_len}, {seq_source})",
            )
        if manifest is not None:
            num_masked = manifest.max_predictions_per_seq
        else:
            num_masked = math.ceil(options.mask_fraction * seq_len)
        accumulation = accumulations[phase.name]
        samples = phase.global_batch_size * phase.max_steps
        data = data_plan(
            phase.data,
            manifest,
            world.size,
            cfg.data.num_workers,
            phase.micro_batch_size,
            accumulation,
            samples,
        )
        _data_warnings(phase.name, data, warnings)
        memory = estimate_memory(
            model_cfg,
            precision=cfg.precision,
            zero_stage=cfg.zero.stage,
            world_size=world.size,
            offload=cfg.zero.offload_optimizer != "none",
            seq_len=seq_len,
            micro_batch=phase.micro_batch_size,
            num_masked=num_masked,
            bucket_size=cfg.zero.bucket_size,
            cuda_overhead_bytes=int(options.cuda_overhead_gib * GIB),
            capacity_bytes=None if capacity_gib is None else int(capacity_gib * GIB),
            attention_scores_stored=options.attention_scores_stored,
        )
        if memory.fits is False:
            warnings.append(
                f"{phase.name}: needs {memory.total / GIB:.1f} GiB per GPU, more than "
                f"{capacity_gib} GiB: lower micro_batch_size, set "
                "model.activation_checkpointing=true or raise zero.stage"
            )
        timing = None
        if peak is not None:
            flops_seq = training_flops_per_sequence(
                model_cfg, seq_len, num_masked, model_cfg.activation_checkpointing
            )
            link, gbps = _slowest_link(world, options)
            timing = step_time(
                flops_per_step=flops_seq * phase.global_batch_size,
                world_size=world.size,
                peak_flops_per_gpu=peak,
                mfu=options.mfu,
                comm_bytes=comm_bytes_per_step(
                    num_params, cfg.zero.stage, world.size, accumulation, cfg.precision
                ),
                link=link,
                bandwidth_gbps=gbps,
                overlap=options.overlap,
                steps=phase.max_steps,
            )
        planned.append(
            PhasePlan(
                name=phase.name,
                data=data,
                seq_len=seq_len,
                seq_len_source=seq_source,
                num_masked=num_masked,
                micro_batch_size=phase.micro_batch_size,
                accumulation=accumulation,
                world_size=world.size,
                global_batch_size=phase.global_batch_size,
                tokens_per_step=phase.global_batch_size * seq_len,
                max_steps=phase.max_steps,
                warmup_steps=phase.warmup_steps(),
                samples=samples,
                tokens=samples * seq_len,
                learning_rate=phase.learning_rate,
                memory=memory,
                time=timing,
            )
        )

    total = None
    if planned and all(p.time is not None for p in planned):
        total = sum(p.time.phase_s for p in planned if p.time is not None)
    return Plan(
        world_size=world.size,
        nodes=world.nodes,
        gpus_per_node=world.gpus_per_node,
        world_source=world.source,
        model=ModelSummary(
            preset=cfg.model.preset,
            num_layers=model_cfg.num_layers,
            hidden_size=model_cfg.hidden_size,
            num_heads=model_cfg.num_heads,
            intermediate_size=model_cfg.ffn_size,
            vocab_size=vocab,
            vocab_source=vocab_source,
            padded_vocab_size=model_cfg.padded_vocab_size,
            num_parameters=num_params,
            activation_checkpointing=model_cfg.activation_checkpointing,
        ),
        precision=cfg.precision,
        zero_stage=cfg.zero.stage,
        offload_optimizer=cfg.zero.offload_optimizer,
        optimizer=cfg.optimizer.name,
        gpu=options.gpu,
        peak_tflops=None if peak is None else peak / 1e12,
        peak_source=peak_source,
        gpu_memory_gib=capacity_gib,
        gpu_memory_source=capacity_source,
        mfu=options.mfu,
        inter_node_gbps=options.inter_node_gbps,
        intra_node_gbps=options.intra_node_gbps,
        overlap=options.overlap,
        cuda_overhead_gib=options.cuda_overhead_gib,
        phases=planned,
        total_time_s=total,
        total_time_hmm=None if total is None else format_hmm(total),
        assumptions=_assumptions(cfg, options, peak is not None),
        warnings=warnings,
    )


def _model_config(cfg: PretrainConfig, vocab_size: int) -> BertModelConfig:
    try:
        return BertModelConfig.preset(cfg.model.preset, vocab_size, **cfg.model.overrides())
    except ConfigError as exc:
        raise exc.with_prefix("model") from None


def _gpu_capacity(options: PlanOptions) -> tuple[float | None, str | None]:
    if options.gpu_memory_gib is not None:
        return options.gpu_memory_gib, "--gpu-memory-gb"
    if options.gpu is not None:
        value = gpu_memory_gib(options.gpu)
        if value is not None:
            return value, f"nvidia-smi total of {_gpu_key(options.gpu)}"
    return None, None


def _peak(cfg: PretrainConfig, options: PlanOptions) -> tuple[float | None, str | None]:
    if cfg.device_peak_tflops is not None:
        return cfg.device_peak_tflops * 1e12, "config device_peak_tflops"
    if options.gpu is None:
        return None, None
    peak = peak_flops(options.gpu, cfg.precision)
    if peak is None:
        return None, None
    return peak, f"training/flops.py dense {cfg.precision} peak"


def _vocab(
    cfg: PretrainConfig,
    manifests: Mapping[str, Manifest | None],
    options: PlanOptions,
    warnings: list[str],
) -> tuple[int, str]:
    for phase in cfg.phases:
        manifest = manifests.get(phase.name)
        if manifest is not None:
            vocab = manifest.vocab_size
            if options.vocab_size is not None and options.vocab_size != vocab:
                warnings.append(
                    f"--vocab-size {options.vocab_size} ignored: {phase.name}'s manifest says "
                    f"{vocab}, which is what pretrain will use"
                )
            return vocab, f"{phase.name} manifest"
    if options.vocab_size is not None:
        return options.vocab_size, "--vocab-size"
    return DEFAULT_VOCAB_SIZE, "default: no manifest, no --vocab-size"


def _seq_len(
    index: int,
    manifest: Manifest | None,
    options: PlanOptions,
    warnings: list[str],
) -> tuple[int, str]:
    given = options.seq_lens[index] if index < len(options.seq_lens) else None
    if manifest is not None:
        seq = manifest.max_seq_length
        if given is not None and given != seq:
            warnings.append(
                f"--seq-len {given} ignored for phase {index + 1}: the manifest has {seq}"
            )
        return seq, "manifest"
    if given is not None:
        return given, "--seq-len"
    return DEFAULT_SEQ_LENS[min(index, len(DEFAULT_SEQ_LENS) - 1)], "default by phase order"


def _data_warnings(name: str, data: DataPlan, warnings: list[str]) -> None:
    if not data.found:
        return
    if data.batches_per_rank_per_epoch == 0:
        warnings.append(
            f"{name}: too few instances for one micro batch per loader reader: pretrain will "
            "refuse this data (fewer data.num_workers, a smaller micro batch or more data)"
        )
    elif data.steps_per_epoch == 0:
        warnings.append(f"{name}: a rank's data per epoch does not fill one optimizer step")
    if data.epochs is not None and data.epochs > 40:
        warnings.append(f"{name}: {data.epochs:.0f} epochs of the data: expect overfitting")


def _slowest_link(world: World, options: PlanOptions) -> tuple[str, float | None]:
    """The link a step's gradients cross (the slowest the world has) and its bandwidth."""
    if world.size == 1:
        return "none", None
    if world.nodes > 1:
        return "inter-node", options.inter_node_gbps
    return "intra-node", options.intra_node_gbps


def _assumptions(cfg: PretrainConfig, options: PlanOptions, timed: bool) -> list[str]:
    e = element_bytes(cfg.precision)
    per = bytes_per_parameter(cfg.precision)
    out = [
        f"parameters: analytic count (tied decoder once, vocabulary padded); model states "
        f"{per.parameters} (weights) + {per.gradients} (gradients) + {per.optimizer} "
        f"(optimizer: {'fp32 master + ' if e == 2 else ''}2 moments) bytes/parameter, ZeRO "
        "stage 1 partitions optimizer states, 2 + gradients, 3 + weights over N GPUs; "
        "offload moves optimizer states to host memory",
        f"activations per layer s*b*(e*(8h+2I)+2h) bytes, e={e} (Korthikanti et al. 2022: "
        "34*s*b*h for I=4h at 16 bit)"
        + (
            " + a*s^2*b*(2e+1) for stored attention scores"
            if options.attention_scores_stored
            else "; no s^2 term: SDPA stores no attention scores"
        )
        + "; with activation checkpointing L*e*s*b*h + one layer; MLM head "
        "n*(4*e*h + V*(e+8)) at n = b x masked positions (manifest max_predictions_per_seq, "
        f"else ceil({options.mask_fraction}*s))",
        f"CUDA context/workspace allowance {options.cuda_overhead_gib} GiB per GPU (assumed); "
        "communication buckets "
        + (
            f"min(5e8, Psi) x {e} bytes (DeepSpeed's flattened all-reduce)"
            if cfg.zero.stage == 0
            else f"2 x min(zero.bucket_size={cfg.zero.bucket_size:,}, Psi) x {e} bytes"
        )
        + "; parts summed as if they peaked together, fragmentation not modelled",
        "data: the loader's partition into N x max(1, data.num_workers) readers of about "
        "equal instances; batches per rank per epoch = floor(min over readers of instances / "
        "micro batch) x readers per rank",
    ]
    if timed:
        out += [
            f"MFU {options.mfu:.2f} (assumed): compute per step = training FLOPs of the global "
            "batch (training/flops.py, recomputation included with checkpointing) / "
            "(N x peak x MFU)",
            "communication per step per GPU = passes x (N-1)/N x Psi x e bytes, passes: "
            "stage 0/1: 2 (all-reduce, ring factor 2(N-1)/N), stage 2: accumulation + 1 "
            "(reduce-scatter every micro batch), stage 3: 3 x accumulation",
            f"bandwidth per GPU (assumed, achieved): inter-node {options.inter_node_gbps:g} Gb/s "
            f"({options.inter_node_gbps / 8:g} GB/s), used when nodes > 1; intra-node "
            f"(NVLink) {options.intra_node_gbps:g} Gb/s ({options.intra_node_gbps / 8:g} GB/s)",
            f"overlap {options.overlap:g}: step = compute + (1 - overlap) x communication"
            + (" (zero.overlap_comm is on; try --overlap 0.5)" if cfg.zero.overlap_comm else ""),
            "not modelled: data loading, the optimizer step"
            + (" (on the CPU with offload)" if cfg.zero.offload_optimizer != "none" else "")
            + ", evaluation, checkpoint saves, start-up and restarts",
        ]
    return out
