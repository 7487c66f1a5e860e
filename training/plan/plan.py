"""``bertpipe plan``: what a pre-training run will do and need, worked out without starting it.

Everything here is arithmetic on the typed config, the data manifests and a few stated
assumptions: no process group, no DeepSpeed engine, no GPU and no model is built (the
parameter count is analytic, :meth:`BertModelConfig.num_parameters`). The functions are
pure; :func:`make_plan` ties them together into a :class:`Plan` that the command line
prints (:mod:`bertpipe.training.plan.cli`). Its inputs beyond the config, :class:`PlanOptions`,
are in :mod:`bertpipe.training.plan.options`; the parts it combines are in their own modules:
the world and GPU memory table (:mod:`~bertpipe.training.plan.world`), per-GPU memory
(:mod:`~bertpipe.training.plan.memory`), step time (:mod:`~bertpipe.training.plan.time`) and
data per rank (:mod:`~bertpipe.training.plan.data`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bertpipe.config import ConfigError
from bertpipe.errors import BertpipeError
from bertpipe.formatting import format_hmm
from bertpipe.training.models.families import ModelConfig, preset_config
from bertpipe.training.models.flops import peak_flops, training_flops_per_sequence
from bertpipe.training.plan.data import DataPlan, data_plan, read_manifest
from bertpipe.training.plan.memory import (
    GIB,
    MemoryEstimate,
    bytes_per_parameter,
    element_bytes,
    estimate_memory,
)
from bertpipe.training.plan.options import DEFAULT_SEQ_LENS, DEFAULT_VOCAB_SIZE, PlanOptions
from bertpipe.training.plan.time import StepTime, comm_bytes_per_step, step_time
from bertpipe.training.plan.world import (
    GPU_MEMORY_GIB,
    World,
    gpu_key,
    gpu_memory_gib,
    resolve_world,
)
from bertpipe.training.pretrain.config import PretrainConfig

if TYPE_CHECKING:  # the loader module imports webdataset: only when a manifest is read
    from bertpipe.training.pretrain.data.manifest import Manifest

__all__ = ["ModelSummary", "PhasePlan", "Plan", "make_plan"]


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
    """Analytic count of BertForPreTraining or ModernBertForMaskedLM (the tied decoder counted
    once)."""
    activation_checkpointing: bool
    family: str = "bert"


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
            f"no dense {cfg.precision} peak for {options.gpu!r} in training/models/flops.py: "
            "no time estimate (set device_peak_tflops=... to give one)"
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
            attention_scores_stored=options.stores_scores(model_cfg.attention_dropout),
            mask_bytes=options.mask_bytes(cfg.precision),
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
            family=getattr(model_cfg, "family", "bert"),
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


def _model_config(cfg: PretrainConfig, vocab_size: int) -> ModelConfig:
    try:
        return preset_config(
            cfg.model.resolved_family, cfg.model.preset, vocab_size, **cfg.model.overrides()
        )
    except ConfigError as exc:
        raise exc.with_prefix("model") from None


def _gpu_capacity(options: PlanOptions) -> tuple[float | None, str | None]:
    if options.gpu_memory_gib is not None:
        return options.gpu_memory_gib, "--gpu-memory-gb"
    if options.gpu is not None:
        value = gpu_memory_gib(options.gpu)
        if value is not None:
            return value, f"nvidia-smi total of {gpu_key(options.gpu)}"
    return None, None


def _peak(cfg: PretrainConfig, options: PlanOptions) -> tuple[float | None, str | None]:
    if cfg.device_peak_tflops is not None:
        return cfg.device_peak_tflops * 1e12, "config device_peak_tflops"
    if options.gpu is None:
        return None, None
    peak = peak_flops(options.gpu, cfg.precision)
    if peak is None:
        return None, None
    return peak, f"training/models/flops.py dense {cfg.precision} peak"


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
    per = bytes_per_parameter(cfg.precision, cfg.zero.stage)
    master = e == 2 or cfg.zero.stage >= 1
    out = [
        f"parameters: analytic count (tied decoder once, vocabulary padded); model states "
        f"{per.parameters} (weights) + {per.gradients} (gradients) + {per.optimizer} "
        f"(optimizer: {'fp32 master + ' if master else ''}2 moments) bytes/parameter, ZeRO "
        "stage 1 partitions optimizer states, 2 + gradients, 3 + weights over N GPUs; "
        "offload moves optimizer states to host memory",
        cfg.model.family_entry.costs.ACTIVATIONS.format(e=e)
        + (
            f" + a*s^2*b*(2e+m) for stored attention scores, m={options.mask_bytes(cfg.precision)}"
            " byte(s) per dropout mask element"
            + (" (--cpu: torch's CPU attention with dropout)" if options.cpu else "")
            if options.stores_scores(cfg.model.family_entry.attention_dropout)
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
            "batch (training/models/flops.py, recomputation included with checkpointing) / "
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
