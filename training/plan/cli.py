"""``bertpipe plan``: print what a pre-training config will do and need, starting nothing.

The arithmetic lives in :mod:`bertpipe.training.plan.plan`; this module parses the options and
prints the plan as a table (or, with ``--json``, as one JSON object on the last line). The options'
flags are generated from :class:`~bertpipe.training.plan.options.PlanOptions` (name, type, default,
docstring as help; :data:`PLAN_FLAGS` renames a few).

Example, NVIDIA's BERT-Large LAMB recipe on 4 nodes x 8 H100 (``paper.yaml``)::

    model: {preset: large}
    precision: bf16
    optimizer: {name: lamb}
    zero: {stage: 0}
    phases:
      - {name: phase1, data: shards/seq128, max_steps: 7038, micro_batch_size: 64,
         global_batch_size: 65536, learning_rate: 6.0e-3, warmup: 0.2843, decay: poly}
      - {name: phase2, data: shards/seq512, max_steps: 1563, micro_batch_size: 16,
         global_batch_size: 32768, learning_rate: 4.0e-3, warmup: 0.128, decay: poly}

    $ bertpipe plan -c paper.yaml --nodes 4 --gpus-per-node 8 --gpu h100
    bertpipe plan: nothing is started; every figure is an estimate (assumptions below)

    model     BERT large: L24 H1024 A16 I4096, 336,232,258 parameters (336.2M)
    vocab     30,522 (default: no manifest, no --vocab-size), padded to 30,528
    world     32 GPUs = 4 nodes x 8 (--nodes/--gpus-per-node)
    training  bf16, ZeRO stage 0, lamb, offload none, activation checkpointing off
    gpu       h100: 989.4 TFLOP/s (training/models/flops.py dense bf16 peak), 79.6 GiB (...)

                                        phase1                        phase2
    data                                shards/seq128                 shards/seq512
    max_seq_length                      128 (default by phase order)  512 (default by phase order)
    micro x accum x world = global      64 x 32 x 32 = 65,536         16 x 64 x 32 = 32,768
    tokens per step                     8,388,608                     16,777,216
    steps (warmup)                      7,038 (2,001)                 1,563 (200)
    peak learning rate                  0.006                         0.004
    samples                             461,242,368                   51,216,384
    tokens                              59.04B                        26.22B
    masked positions per sequence       20                            77
    instances in the data               data not found                data not found
    ...
    memory per GPU, GiB
      parameters                        0.63                          0.63
      gradients                         0.63                          0.63
      optimizer states                  3.76                          3.76
      activations (one micro batch)     6.77                          6.76
      communication buckets             0.63                          0.63
      CUDA context/workspace (assumed)  1.50                          1.50
      total                             13.91                         13.89
      fits 79.6 GiB                     yes, 65.7 free                yes, 65.7 free
    time (MFU 0.40)
      training FLOPs per step           1.58e+16                      3.34e+16
      compute per step                  1.245 s                       2.639 s
      communication link                inter-node, 100 Gb/s per GPU  inter-node, 100 Gb/s per GPU
      communication per step            1.30 GB, 0.104 s              1.30 GB, 0.104 s
      exposed communication             0.104 s                       0.104 s
      time per step                     1.350 s                       2.743 s
      time for the phase (h:mm)         2:38                          1:11
    total time (h:mm)                   3:50

    assumptions:
      - ... (every assumption behind the figures, one per line)

The same run with AdamW under ZeRO-2 (``optimizer.name=adamw zero.stage=2``) needs less
memory (9.2 GiB: optimizer states and gradients split 32 ways) but, with 32 and 64
accumulation steps, DeepSpeed reduce-scatters the gradients after every micro batch:
21.5 GB per GPU per phase-1 step instead of 1.3 GB, 1.7 s more per step at 100 Gb/s
(0.43 s at 400 Gb/s) unless overlapped; total 8:25 (4:47 at ``--inter-node-gbps 400``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from bertpipe import fsio
from bertpipe.cli_args import (
    Flag,
    add_dataclass_arguments,
    add_stage_command,
    config_from_args,
    dataclass_from_args,
)
from bertpipe.formatting import GAP, Column, format_hmm, format_si, render_table
from bertpipe.training.plan.options import PlanOptions

if TYPE_CHECKING:
    from bertpipe.training.plan.plan import Plan
    from bertpipe.training.plan.time import StepTime
    from bertpipe.training.pretrain.config import PretrainConfig

__all__ = ["PLAN_FLAGS", "add_plan_command", "render_plan"]

_LABEL_WIDTH = 36

PLAN_FLAGS: dict[str, Flag] = {
    "gpu_memory_gib": Flag("--gpu-memory-gb"),
    "seq_lens": Flag("--seq-len", metavar="N[,N...]", separator=","),
    "cuda_overhead_gib": Flag("--cuda-overhead-gb"),
    "attention_scores_stored": Flag("--attention-scores"),
    "cpu": Flag("--cpu"),
}
"""How the fields of :class:`~bertpipe.training.plan.options.PlanOptions` appear as flags of
``bertpipe plan`` (every field is one; the rest comes from the class)."""


def add_plan_command(sub: argparse._SubParsersAction) -> None:
    """Register ``bertpipe plan``."""
    parser = add_stage_command(
        sub,
        "plan",
        help="print world size, batch arithmetic, data per rank, memory and time per phase",
        description=(
            "Reads the pretrain config (and each phase's manifest.json where it exists) and "
            "prints, without starting anything: world size, micro x accumulation x world = "
            "global batch, tokens per step, steps and warmup, data per rank, the per-GPU "
            "memory for the chosen ZeRO stage and precision and, with --gpu, the time. "
            "Every assumption is printed with the plan."
        ),
        config="bertpipe.training.pretrain.config:PretrainConfig",
        example="optimizer.name=adamw zero.stage=2",
        examples=[
            "bertpipe plan --config bert-large-lamb --nodes 4 --gpus-per-node 8 --gpu h100",
            "bertpipe plan --config bert-base-adamw --nodes 1 --gpus-per-node 8 --gpu a100-80g "
            "zero.stage=2 'phases[0].micro_batch_size=64'",
        ],
        handler=_plan,
    )
    add_dataclass_arguments(parser, PlanOptions, PLAN_FLAGS)
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument(
        "--fit",
        action="store_true",
        help="search micro batch x accumulation x ZeRO stage x activation checkpointing x "
        "offload for the fastest configuration that fits the GPUs, keeping each phase's "
        "global batch (docs/training.md)",
    )
    parser.add_argument(
        "--write",
        metavar="FILE",
        help="with --fit: write the winner as a pretrain config (its predictions recorded)",
    )


def _plan(args: argparse.Namespace, passthrough: list[str]) -> int:
    from bertpipe.training.plan.plan import make_plan
    from bertpipe.training.pretrain.config import PretrainConfig

    cfg = config_from_args(PretrainConfig, args)
    if cfg is None:
        return 0
    _check_hardware(cfg, args.gpu)
    options = dataclass_from_args(PlanOptions, args, PLAN_FLAGS)
    if args.fit or args.write:
        return _fit(cfg, options, args)
    plan = make_plan(cfg, options, os.environ)
    if args.json:
        sys.stdout.write(json.dumps(plan.to_dict()) + "\n")
    else:
        sys.stdout.write(render_plan(plan))
    return 0


def _fit(cfg: PretrainConfig, options: PlanOptions, args: argparse.Namespace) -> int:
    from bertpipe.config import to_yaml
    from bertpipe.training.plan.fit import fit, fitted_config

    result = fit(cfg, options, os.environ)
    if args.write:
        fsio.atomic_write_text(args.write, to_yaml(fitted_config(cfg, result)))
    if args.json:
        sys.stdout.write(json.dumps(result.to_dict()) + "\n")
        return 0
    lines = [f"fit for {result.world_size} GPU(s), {result.budget_gib:g} GiB budget per GPU"]
    for rank, config in enumerate([result.winner, *result.runners_up]):
        lines.append(f"{'winner' if rank == 0 else f'#{rank + 1}':>7}: {config.label()}")
        for c in config.phases:
            lines.append(
                f"         {c.phase}: {c.memory_gib:.1f} GiB, {c.step_s:.3f} s/step "
                f"({c.phase_s / 3600:.1f} h); largest term {c.largest_term}"
            )
    for label, why in result.rejected.items():
        lines.append(f"rejected: {label}: {why}")
    lines += [f"assumption: {a}" for a in result.assumptions]
    if args.write:
        lines.append(f"written: {args.write} (bertpipe pretrain --config {args.write})")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


# --------------------------------------------------------------------------- rendering


def render_plan(plan: Plan) -> str:
    """The plan as a readable table, one column per phase."""
    from bertpipe.training.models.families import FAMILIES
    from bertpipe.training.plan.memory import GIB

    m = plan.model
    family = FAMILIES[m.family].title
    lines = ["bertpipe plan: nothing is started; every figure is an estimate (assumptions below)"]
    lines.append("")
    lines.append(
        f"model     {family} {m.preset}: L{m.num_layers} H{m.hidden_size} A{m.num_heads} "
        f"I{m.intermediate_size}, {m.num_parameters:,} parameters ({m.num_parameters / 1e6:.1f}M)"
    )
    lines.append(
        f"vocab     {m.vocab_size:,} ({m.vocab_source}), padded to {m.padded_vocab_size:,}"
    )
    nodes = f"{plan.nodes} node{'s' if plan.nodes > 1 else ''}"
    lines.append(
        f"world     {plan.world_size} GPU{'s' if plan.world_size > 1 else ''} = {nodes} x "
        f"{plan.gpus_per_node} ({plan.world_source})"
    )
    checkpointing = "on" if m.activation_checkpointing else "off"
    lines.append(
        f"training  {plan.precision}, ZeRO stage {plan.zero_stage}, {plan.optimizer}, "
        f"offload {plan.offload_optimizer}, activation checkpointing {checkpointing}"
    )
    gpu = plan.gpu or "not given (--gpu)"
    if plan.peak_tflops is not None:
        gpu += f": {plan.peak_tflops:g} TFLOP/s ({plan.peak_source})"
    if plan.gpu_memory_gib is not None:
        gpu += f", {plan.gpu_memory_gib:g} GiB ({plan.gpu_memory_source})"
    lines.append(f"gpu       {gpu}")
    lines.append("")

    phases = plan.phases
    rows: list[tuple[str, list[str]]] = []
    rows.append(("data", [p.data.url for p in phases]))
    rows.append(("max_seq_length", [f"{p.seq_len} ({p.seq_len_source})" for p in phases]))
    rows.append(
        (
            "micro x accum x world = global",
            [
                f"{p.micro_batch_size} x {p.accumulation} x {p.world_size} = "
                f"{p.global_batch_size:,}"
                for p in phases
            ],
        )
    )
    rows.append(("tokens per step", [f"{p.tokens_per_step:,}" for p in phases]))
    rows.append(("steps (warmup)", [f"{p.max_steps:,} ({p.warmup_steps:,})" for p in phases]))
    rows.append(("peak learning rate", [f"{p.learning_rate:g}" for p in phases]))
    rows.append(("samples", [f"{p.samples:,}" for p in phases]))
    rows.append(("tokens", [format_si(p.tokens) for p in phases]))
    rows.append(("masked positions per sequence", [str(p.num_masked) for p in phases]))
    missing = "data not found"
    rows.append(
        (
            "instances in the data",
            [f"{p.data.instances:,}" if p.data.found else missing for p in phases],
        )
    )
    rows.append(
        (
            "epochs of the data",
            [f"{p.data.epochs:.2f}" if p.data.epochs is not None else missing for p in phases],
        )
    )
    rows.append(
        (
            "shards (per rank)",
            [
                f"{p.data.num_shards} ({p.data.shards_per_rank:g})" if p.data.found else missing
                for p in phases
            ],
        )
    )
    rows.append(
        (
            "batches per rank per epoch",
            [
                f"{p.data.batches_per_rank_per_epoch:,} ({p.data.readers_per_rank} reader(s))"
                if p.data.found
                else missing
                for p in phases
            ],
        )
    )
    rows.append(
        (
            "instances used per epoch",
            [
                f"{p.data.instances_used_per_epoch:,}"
                f" ({100 * (p.data.instances_used_per_epoch or 0) / (p.data.instances or 1):.1f}%)"
                if p.data.found
                else missing
                for p in phases
            ],
        )
    )
    rows.append(
        (
            "optimizer steps per epoch",
            [f"{p.data.steps_per_epoch:,}" if p.data.found else missing for p in phases],
        )
    )
    rows.append(("memory per GPU, GiB", ["" for _ in phases]))
    for label, attr in (
        ("parameters", "parameters"),
        ("gradients", "gradients"),
        ("optimizer states", "optimizer_states"),
        ("activations (one micro batch)", "activations"),
        ("communication buckets", "buffers"),
        ("CUDA context/workspace (assumed)", "cuda_overhead"),
        ("total", "total"),
    ):
        rows.append((f"  {label}", [f"{getattr(p.memory, attr) / GIB:.2f}" for p in phases]))
    if any(p.memory.host_optimizer_states for p in phases):
        rows.append(
            (
                "  host memory per GPU (offload)",
                [f"{p.memory.host_optimizer_states / GIB:.2f}" for p in phases],
            )
        )
    if plan.gpu_memory_gib is not None:
        rows.append(
            (
                f"  fits {plan.gpu_memory_gib:g} GiB",
                [
                    f"yes, {(p.memory.capacity or 0) / GIB - p.memory.total / GIB:.1f} free"
                    if p.memory.fits
                    else "NO"
                    for p in phases
                ],
            )
        )
    else:
        rows.append(("  fits", ["unknown: give --gpu or --gpu-memory-gb" for _ in phases]))
    if all(p.time is not None for p in phases) and phases:
        rows.append((f"time (MFU {plan.mfu:.2f})", ["" for _ in phases]))
        timed = [p.time for p in phases if p.time is not None]
        rows.append(("  training FLOPs per step", [f"{t.flops_per_step:.3g}" for t in timed]))
        rows.append(("  compute per step", [f"{t.compute_s:.3f} s" for t in timed]))
        rows.append(("  communication link", [_link_text(t) for t in timed]))
        rows.append(
            (
                "  communication per step",
                [f"{t.comm_bytes_per_gpu / 1e9:.2f} GB, {t.comm_s:.3f} s" for t in timed],
            )
        )
        rows.append(("  exposed communication", [f"{t.exposed_comm_s:.3f} s" for t in timed]))
        rows.append(("  time per step", [f"{t.step_s:.3f} s" for t in timed]))
        rows.append(("  time for the phase (h:mm)", [format_hmm(t.phase_s) for t in timed]))
    lines += _table([p.name for p in phases], rows)
    if plan.total_time_s is not None:
        lines.append(f"{'total time (h:mm)':<{_LABEL_WIDTH}}{plan.total_time_hmm}")
    else:
        lines.append("time: not estimated (give --gpu with a known peak, or device_peak_tflops)")
    lines.append("")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in plan.assumptions]
    if plan.warnings:
        lines.append("warnings:")
        lines += [f"  - {w}" for w in plan.warnings]
    return "\n".join(lines) + "\n"


def _table(names: list[str], rows: list[tuple[str, list[str]]]) -> list[str]:
    """One column per phase under its name, left-aligned, after a column of row labels as
    wide as the lines printed below the table align to."""
    labels = Column("", [label for label, _ in rows], min_width=_LABEL_WIDTH - len(GAP))
    phases = [Column(name, [values[i] for _, values in rows]) for i, name in enumerate(names)]
    return render_table([labels, *phases], rule=False)


def _link_text(t: StepTime) -> str:
    """The link of a step's communication as the plan shows it."""
    if t.link == "none":
        return "none (one GPU)"
    return f"{t.link}, {t.bandwidth_gbps:g} Gb/s per GPU"


def _check_hardware(cfg: PretrainConfig, gpu: str | None) -> None:
    """Precision and fused ops against ``--gpu``; without it against this machine's GPU, or
    its CPU when DS_ACCELERATOR=cpu says the run is a CPU run. A login node without GPUs
    planning a GPU job is not held to its own CPU. torch is imported only to look at this
    machine (about 2 s: ``plan`` is the gate in front of every launch)."""
    from bertpipe.training.core.hardware import (
        Hardware,
        check_hardware,
        gpu_by_name,
        local_hardware,
    )

    hw: Hardware | None
    if gpu is not None:
        hw = gpu_by_name(gpu)
    else:
        import torch

        local = torch.cuda.is_available() or os.environ.get("DS_ACCELERATOR", "").lower() == "cpu"
        hw = local_hardware() if local else None
    if hw is not None:
        check_hardware(hw, precision=cfg.precision, fused=cfg.optimizer.fused)
