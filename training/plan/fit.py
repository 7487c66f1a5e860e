"""``bertpipe plan --fit``: the fastest configuration that fits the GPUs, found by search over
the plan's own memory and time model (:mod:`bertpipe.training.plan.memory`,
:mod:`bertpipe.training.plan.time`), without trial jobs.

The recipe stays as it is: each phase's global batch, steps, learning rate and optimizer. What
is searched, for the whole run (ZeRO's stage, activation checkpointing and offload are one
setting for all phases) and per phase (the micro batch):

* micro batch ``b`` x accumulation ``a`` x world ``N`` = the phase's global batch, exactly:
  every divisor ``b`` of ``global / N``;
* ZeRO stage 0-3 (LAMB: 0-2, as the config allows), activation checkpointing on or off,
  optimizer offload to the CPU (AdamW at stage 1 or more: DeepSpeed's CPU Adam).

A configuration fits when its planned peak per GPU is within the *budget*: the GPU's memory
less :data:`MARGIN` of it (allocator fragmentation and cached blocks) and :data:`NCCL_GIB`
(NCCL's communicator buffers), both stated with the plan. Among those that fit, the one with
the least predicted time for the whole run wins (each phase's step time x its steps). A
family (stage, checkpointing, offload) that fits no micro batch in some phase is listed with
the term of memory that is too large there.

Step time is the plan's (compute at the assumed MFU, exposed communication) with two terms
that only matter when choosing between configurations:

* small micro batches run below the assumed MFU: compute is divided by
  ``tokens / (tokens + T)`` with ``tokens = b x s`` per micro batch and
  :data:`HALF_EFFICIENCY_TOKENS` ``T`` (assumed: a GPU's GEMMs reach half their rate on
  about 1k tokens and most of it from 8k);
* an offloaded optimizer steps on the CPU: ``Ψ/N`` parameters at :data:`CPU_ADAM_PARAMS_S`
  per second plus their gradients and weights over PCIe at :data:`PCIE_GBS`, not overlapped.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bertpipe.errors import BertpipeError
from bertpipe.training.models.flops import training_flops_per_sequence
from bertpipe.training.plan.memory import GIB, MemoryEstimate, element_bytes, estimate_memory
from bertpipe.training.plan.options import PlanOptions
from bertpipe.training.plan.plan import Plan, make_plan
from bertpipe.training.plan.time import comm_bytes_per_step
from bertpipe.training.pretrain.config import PretrainConfig

__all__ = ["Choice", "FitResult", "NothingFitsError", "fit", "fitted_config"]

MARGIN = 0.10
"""Share of a GPU's memory kept free: the caching allocator's fragmentation and cached
blocks (PyTorch reserves more than it allocates; 5-10% is what a long run loses)."""
NCCL_GIB = 0.5
"""NCCL's communicator buffers and streams per GPU, in GiB (assumed)."""
HALF_EFFICIENCY_TOKENS = 1024
"""Tokens per micro batch at which compute runs at half the assumed MFU (assumed)."""
CPU_ADAM_PARAMS_S = 1.0e9
"""Parameters per second DeepSpeed's CPU Adam updates per rank (assumed: AVX-512, a few
cores per rank)."""
PCIE_GBS = 25.0
"""Host <-> GPU bandwidth per GPU in GB/s (assumed: PCIe 4.0 x16 achieved)."""


class NothingFitsError(BertpipeError):
    """No configuration fits: one line naming the phase, the term and what would fit."""


@dataclass(frozen=True)
class Choice:
    """One phase under one configuration."""

    phase: str
    micro_batch_size: int
    accumulation: int
    zero_stage: int
    activation_checkpointing: bool
    offload: bool
    memory_gib: float
    budget_gib: float
    step_s: float
    phase_s: float
    largest_term: str
    """The biggest part of the planned memory (``activations``, ``optimizer_states``...)."""

    @property
    def family(self) -> tuple[int, bool, bool]:
        return self.zero_stage, self.activation_checkpointing, self.offload


@dataclass(frozen=True)
class Config:
    """A whole-run configuration: one choice per phase."""

    zero_stage: int
    activation_checkpointing: bool
    offload: bool
    phases: list[Choice]

    @property
    def total_s(self) -> float:
        return sum(c.phase_s for c in self.phases)

    def label(self) -> str:
        micro = ", ".join(
            f"{c.phase}: {c.micro_batch_size} x {c.accumulation}" for c in self.phases
        )
        ckpt = "on" if self.activation_checkpointing else "off"
        offload = "cpu" if self.offload else "none"
        return (
            f"ZeRO {self.zero_stage}, checkpointing {ckpt}, offload {offload}; "
            f"micro x accumulation {micro}"
        )


@dataclass(frozen=True)
class FitResult:
    winner: Config
    runners_up: list[Config]
    rejected: dict[str, str]
    """Family label -> why nothing of it fits."""
    budget_gib: float
    world_size: int
    assumptions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _families(cfg: PretrainConfig) -> list[tuple[int, bool, bool]]:
    stages = (0, 1, 2) if cfg.optimizer.name == "lamb" else (0, 1, 2, 3)
    out = []
    for stage, ckpt, offload in itertools.product(stages, (False, True), (False, True)):
        if offload and (stage == 0 or cfg.optimizer.name == "lamb"):
            continue
        out.append((stage, ckpt, offload))
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _largest(memory: MemoryEstimate) -> str:
    parts = {
        "parameters": memory.parameters,
        "gradients": memory.gradients,
        "optimizer_states": memory.optimizer_states,
        "activations": memory.activations,
        "communication_buffers": memory.buffers,
    }
    return max(parts, key=lambda k: parts[k])


def _with(cfg: PretrainConfig, stage: int, ckpt: bool, offload: bool, micro: dict[str, int]):  # type: ignore[no-untyped-def]
    """``cfg`` with one configuration applied (a new object; ``cfg`` is unchanged)."""
    phases = [
        dataclasses.replace(p, micro_batch_size=micro.get(p.name, p.micro_batch_size))
        for p in cfg.phases
    ]
    zero = dataclasses.replace(
        cfg.zero, stage=stage, offload_optimizer="cpu" if offload else "none"
    )
    model = dataclasses.replace(cfg.model, activation_checkpointing=ckpt)
    return dataclasses.replace(cfg, model=model, zero=zero, phases=phases)


class _Evaluator:
    """Memory and step time of one phase under one configuration, from the plan's functions
    (no config is rebuilt and no manifest read again: a search takes milliseconds)."""

    def __init__(self, cfg: PretrainConfig, options: PlanOptions, base: Plan) -> None:
        from bertpipe.training.plan.plan import _model_config, _peak

        self.cfg, self.options, self.base = cfg, options, base
        self.models = {
            ckpt: dataclasses.replace(
                _model_config(cfg, base.model.vocab_size), activation_checkpointing=ckpt
            )
            for ckpt in (False, True)
        }
        self.peak = _peak(cfg, options)[0]

    def __call__(
        self, index: int, micro: int, stage: int, ckpt: bool, offload: bool
    ) -> tuple[MemoryEstimate, float]:
        cfg, options, base = self.cfg, self.options, self.base
        phase = base.phases[index]
        world = base.world_size
        model = self.models[ckpt]
        memory = estimate_memory(
            model,
            precision=cfg.precision,
            zero_stage=stage,
            world_size=world,
            offload=offload,
            seq_len=phase.seq_len,
            micro_batch=micro,
            num_masked=phase.num_masked,
            bucket_size=cfg.zero.bucket_size,
            cuda_overhead_bytes=int(options.cuda_overhead_gib * GIB),
            capacity_bytes=None,
            attention_scores_stored=options.stores_scores(model.attention_dropout),
            mask_bytes=options.mask_bytes(cfg.precision),
        )
        accumulation = phase.global_batch_size // (world * micro)
        if self.peak is None:  # no time model: ranked by memory alone
            return memory, float("nan")
        flops = training_flops_per_sequence(model, phase.seq_len, phase.num_masked, ckpt)
        compute = flops * phase.global_batch_size / (world * self.peak * options.mfu)
        tokens = micro * phase.seq_len
        compute /= tokens / (tokens + HALF_EFFICIENCY_TOKENS)
        comm = 0.0
        if world > 1:
            gbps = options.inter_node_gbps if base.nodes > 1 else options.intra_node_gbps
            sent = comm_bytes_per_step(
                base.model.num_parameters, stage, world, accumulation, cfg.precision
            )
            comm = (1 - options.overlap) * sent / (gbps * 1e9 / 8)
        step = compute + comm
        if offload:
            shard = base.model.num_parameters / world
            e = element_bytes(cfg.precision)
            step += shard / CPU_ADAM_PARAMS_S + 2 * e * shard / (PCIE_GBS * 1e9)
        return memory, step


def fit(
    cfg: PretrainConfig, options: PlanOptions, env: Mapping[str, str] | None = None
) -> FitResult:
    """The fastest whole-run configuration that fits (raises :class:`NothingFitsError`)."""
    base = make_plan(cfg, options, env)
    if base.gpu_memory_gib is None:
        raise BertpipeError("plan --fit needs the GPU's memory: give --gpu or --gpu-memory-gb")
    evaluate = _Evaluator(cfg, options, base)
    world = base.world_size
    budget = base.gpu_memory_gib * (1 - MARGIN) - NCCL_GIB
    configs: list[Config] = []
    rejected: dict[str, str] = {}
    closest: tuple[float, str] | None = None  # (memory over budget, why) of the nearest miss
    for stage, ckpt, offload in _families(cfg):
        label = (
            f"ZeRO {stage}, checkpointing {'on' if ckpt else 'off'}, "
            f"offload {'cpu' if offload else 'none'}"
        )
        chosen: list[Choice] = []
        for index, phase in enumerate(base.phases):
            best: Choice | None = None
            smallest: Choice | None = None
            for micro in _divisors(phase.global_batch_size // world):
                memory, step_s = evaluate(index, micro, stage, ckpt, offload)
                choice = Choice(
                    phase=phase.name,
                    micro_batch_size=micro,
                    accumulation=phase.global_batch_size // (world * micro),
                    zero_stage=stage,
                    activation_checkpointing=ckpt,
                    offload=offload,
                    memory_gib=round(memory.total / GIB, 2),
                    budget_gib=round(budget, 2),
                    step_s=step_s,
                    phase_s=step_s * phase.max_steps,
                    largest_term=_largest(memory),
                )
                if smallest is None:
                    smallest = choice
                if memory.total / GIB <= budget and (best is None or _faster(choice, best)):
                    best = choice
            if best is None:
                assert smallest is not None
                why = (
                    f"{phase.name}: {smallest.memory_gib:.2f} GiB at micro batch 1, over the "
                    f"{budget:.2f} GiB budget; the largest term is {smallest.largest_term}"
                )
                rejected[label] = why
                over = smallest.memory_gib - budget
                if closest is None or over < closest[0]:
                    closest = (over, why)
                break
            chosen.append(best)
        else:
            configs.append(Config(stage, ckpt, offload, chosen))
    if not configs:
        assert closest is not None
        raise NothingFitsError(
            f"nothing fits in {base.gpu_memory_gib:g} GiB per GPU (budget {budget:.1f} GiB): "
            f"closest {closest[1]}; {_what_would_fit(cfg, options, env)}"
        )
    if evaluate.peak is None:
        raise BertpipeError(
            "plan --fit ranks what fits by predicted step time: give --gpu with a known "
            "peak FLOP/s (or device_peak_tflops=...)"
        )
    configs.sort(key=lambda c: (c.total_s, max(p.memory_gib for p in c.phases)))
    return FitResult(
        winner=configs[0],
        runners_up=configs[1:4],
        rejected=rejected,
        budget_gib=round(budget, 2),
        world_size=world,
        assumptions=[
            f"budget = GPU memory x (1 - {MARGIN}) - {NCCL_GIB} GiB of NCCL buffers",
            f"compute at the assumed MFU x tokens / (tokens + {HALF_EFFICIENCY_TOKENS}) per "
            "micro batch",
            f"offload: CPU Adam at {CPU_ADAM_PARAMS_S:.0e} parameters/s per rank + weights and "
            f"gradients over PCIe at {PCIE_GBS:g} GB/s, not overlapped",
            "fused options as the config has them (not modelled)",
        ],
    )


def _faster(a: Choice, b: Choice) -> bool:
    if a.step_s != b.step_s and a.step_s == a.step_s and b.step_s == b.step_s:  # not NaN
        return a.step_s < b.step_s
    return a.memory_gib < b.memory_gib


def _what_would_fit(
    cfg: PretrainConfig, options: PlanOptions, env: Mapping[str, str] | None
) -> str:
    """The nearest change that fits: more memory per GPU, or an offloaded AdamW."""
    if cfg.optimizer.name == "lamb":
        optimizer = dataclasses.replace(cfg.optimizer, name="adamw")
        adamw = dataclasses.replace(cfg, optimizer=optimizer)
        try:
            result = fit(adamw, options, env)
            return f"optimizer.name=adamw would fit ({result.winner.label()})"
        except NothingFitsError:
            pass
    current = options.gpu_memory_gib or make_plan(cfg, options, env).gpu_memory_gib or 0
    for gib in (16, 24, 32, 40, 48, 80, 96, 141, 192):
        if gib <= current:
            continue
        try:
            fit(cfg, dataclasses.replace(options, gpu_memory_gib=float(gib)), env)
            return f"a {gib} GiB GPU would fit"
        except NothingFitsError:
            continue
    return "no GPU up to 192 GiB fits it: more GPUs (ZeRO 3 shards the model states)"


def fitted_config(cfg: PretrainConfig, result: FitResult) -> PretrainConfig:
    """``cfg`` with the winner applied and its predictions recorded (``planned``)."""
    winner = result.winner
    out = _with(
        cfg,
        winner.zero_stage,
        winner.activation_checkpointing,
        winner.offload,
        {c.phase: c.micro_batch_size for c in winner.phases},
    )
    planned = {
        c.phase: {
            "step_s": round(c.step_s, 4),
            "memory_gib": c.memory_gib,
            "budget_gib": result.budget_gib,
        }
        for c in winner.phases
    }
    return dataclasses.replace(out, planned=planned)
