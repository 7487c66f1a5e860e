"""``bertpipe bench memory``: the model-state and activation bytes a rank really holds,
measured through DeepSpeed on CPU, next to ``bertpipe plan``'s estimate of the same run.

For a pretrain config (a shipped recipe's name or a path) and one of its phases, every ZeRO
stage asked for runs ``--ranks`` processes on this machine (``torch.multiprocessing``, gloo,
``DS_ACCELERATOR=cpu``), each building its engine the way pre-training does
(:func:`bertpipe.training.core.engine.build_engine` from :meth:`EngineSpec.for_phase`) and taking
``--steps`` optimizer steps through the trainer's guarded step
(:class:`bertpipe.training.core.step.OptimizerStep`) on synthetic full-length sequences with
``ceil(0.15 s)`` masked positions each (plan's assumption when no manifest is read). Per rank:

* **Model states**, summed from the tensors DeepSpeed holds, each storage counted once
  (keyed by ``untyped_storage().data_ptr()``, its whole ``nbytes``, so views into a flat
  buffer count the buffer once). Parameters: the module's parameters (ZeRO 3: their
  ``ds_tensor`` partitions), after the last step. Optimizer states: the tensors the client
  optimizer (LAMB, AdamW) steps on (DeepSpeed's fp32 master copies: stage 0 ``fp32_groups``,
  stages 1-2 ``single_partition_of_fp32_groups``, stage 3 ``fp32_partitioned_groups_flat``)
  and its ``state`` (``exp_avg``, ``exp_avg_sq``), after the last step. Gradients: the
  ``.grad`` of the module's parameters plus every tensor reachable from DeepSpeed's
  optimizer wrapper under an attribute whose name holds ``grad`` (``averaged_gradients``,
  ``grads_in_partition``, stage 3's grad partitions), after the last backward pass (the
  accumulation boundary, gradients reduced), where they peak. Whatever else the wrapper
  holds is reported as ``buffers`` (names with ``ipg``/``bucket``: the reduce buckets) or
  ``other`` (the largest by attribute path in ``other_paths``).
* **In the optimizer step**: the same walk at the entry of the client optimizer's ``step``
  (wrapped), where the fp32 gradient copy DeepSpeed hands the optimizer exists next to the
  16-bit gradients: ``in_step_total`` and ``in_step_gradients``.
* **Activations of one micro batch**: the bytes of the tensors autograd saves for the
  backward pass in one forward, through :func:`torch.autograd.graph.saved_tensors_hooks`
  (parameters and views of them excluded, storages de-duplicated). This is what the plan's
  activation formula models (tensors kept between forward and backward), it is exact and
  deterministic, and it does not depend on the allocator. An RSS delta was the alternative
  and is worse here: glibc keeps freed blocks, the forward's transient buffers (attention
  workspaces, GELU temporaries) inflate it, and several ranks share the machine. Transients
  of the forward itself are not in this figure.
* ``peak_rss_gb`` (``ru_maxrss``) and the time per step, as context.

The plan's figures come from :func:`bertpipe.training.plan.memory.estimate_memory` for the same
model, micro batch, world size (``--ranks``), ZeRO stage and precision; the table gives
measured / planned per category and the last line of output is one JSON object.
LAMB at ZeRO 3 is refused by the config (whole-tensor trust ratios need stages 1-2); the
benchmark then runs that stage with AdamW and says so (``optimizer`` and ``note``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bertpipe.app.bench.memory_tally import ActivationMeter, StorageTally, tally_engine

log = logging.getLogger(__name__)

__all__ = ["CATEGORIES", "add_arguments", "run_bench"]

CATEGORIES = ("parameters", "gradients", "optimizer_states")
"""The model-state categories compared with the plan (its MemoryEstimate field names)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-c", "--config", default="bert-large-lamb", help="pretrain config: recipe name or path"
    )
    parser.add_argument("--phase", type=int, default=1, help="the config's phase, from 1")
    parser.add_argument("--seq-len", type=int, default=None, help="default: 128, then 512")
    parser.add_argument("--micro-batch", type=int, default=None, help="default: the phase's")
    parser.add_argument(
        "--zero", type=int, choices=(0, 1, 2, 3), action="append", help="repeatable; default all"
    )
    parser.add_argument("--ranks", type=int, default=2, help="processes on this machine")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per stage")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--preset", default=None, help="model preset instead of the config's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-rss-gb",
        type=float,
        default=16.0,
        help="stop the ranks when their resident memory together exceeds this",
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")


# --------------------------------------------------------------------------- one rank


def _synthetic_batches(
    model_cfg: Any, micro_batch: int, seq_len: int, num_masked: int, seed: int
) -> Iterator[dict[str, Any]]:
    """Full-length host batches in the collator's layout
    (:mod:`bertpipe.training.pretrain.data.collate`)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    B, S = micro_batch, seq_len
    while True:
        ids = rng.integers(5, model_cfg.vocab_size, (B, S))
        types = np.zeros((B, S), dtype=np.int64)
        types[:, S // 2 :] = 1
        cols = np.sort(np.argsort(rng.random((B, S - 2)), axis=1)[:, :num_masked] + 1, axis=1)
        positions = (np.arange(B)[:, None] * S + cols).reshape(-1)
        yield {
            "input_ids": torch.from_numpy(ids),
            "token_type_ids": torch.from_numpy(types),
            "attention_mask": torch.ones((B, S), dtype=torch.int64),
            "mlm_positions": torch.from_numpy(positions),
            "mlm_labels": torch.from_numpy(ids.reshape(-1)[positions]),
            "nsp_labels": torch.from_numpy(rng.integers(0, 2, B)),
        }


def _wrap_client_step(engine: Any, on_entry: Callable[[], None]) -> None:
    """Call ``on_entry`` whenever DeepSpeed calls the client optimizer's ``step``."""
    client = engine.basic_optimizer
    inner = client.step

    @functools.wraps(inner)
    def step(*args: Any, **kwargs: Any) -> Any:
        on_entry()
        return inner(*args, **kwargs)

    client.step = step


_EPILOGUES = (
    "overlapping_partition_gradients_reduce_epilogue",
    "independent_gradient_partition_epilogue",
)
"""ZeRO 1-2 and ZeRO 3 methods that end a backward pass: every gradient has been produced
(stage 1 still holds them all, whole) and is then cut to this rank's partition."""


def _wrap_epilogue(engine: Any, on_entry: Callable[[], None]) -> None:
    """Call ``on_entry`` when DeepSpeed's ZeRO optimizer ends a backward pass."""
    for name in _EPILOGUES:
        inner = getattr(engine.optimizer, name, None)
        if inner is not None:

            def epilogue(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
                on_entry()
                return _inner(*args, **kwargs)

            setattr(engine.optimizer, name, epilogue)
            return


def _rank_main(rank: int, job: dict[str, Any]) -> None:
    """One rank: build the engine, take the steps, write what it measured as JSON."""
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(job["ranks"]),
            "LOCAL_WORLD_SIZE": str(job["ranks"]),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(job["port"]),
            "DS_ACCELERATOR": "cpu",
        }
    )
    import torch

    from bertpipe.app.bench.train import _peak_memory_gb
    from bertpipe.config import load_config
    from bertpipe.training.core.engine import build_engine, init_distributed
    from bertpipe.training.core.step import OptimizerStep
    from bertpipe.training.models.families import pretraining_model
    from bertpipe.training.pretrain.batches import BatchPrep
    from bertpipe.training.pretrain.config import PretrainConfig
    from bertpipe.training.pretrain.phases import phase_engine

    torch.set_num_threads(job["threads"])
    logging.basicConfig(level=logging.WARNING)
    cfg = load_config(PretrainConfig, job["config"], job["overrides"])
    info = init_distributed()
    model_cfg = _model_config(cfg)
    torch.manual_seed(cfg.seed)
    model = pretraining_model(model_cfg)  # the config's family (BERT: MLM + NSP heads)
    spec = phase_engine(cfg, cfg.phases[0], info.world_size)
    engine, _ = build_engine(model, spec)
    nsp = cfg.model.family_entry.nsp
    prep = BatchPrep(model_cfg, info.device, unpad=cfg.model.unpad, nsp=nsp)
    host = _synthetic_batches(
        model_cfg, job["micro_batch"], job["seq_len"], job["num_masked"], job["seed"] + rank
    )
    batches = (prep(h)[0] for h in host)

    steps = job["steps"]
    last = {"step": 0}
    points: dict[str, dict[str, Any]] = {}
    in_step: list[StorageTally] = []
    meter = ActivationMeter(model)
    measuring = contextlib.ExitStack()

    def on_client_step() -> None:
        if last["step"] == steps:
            in_step.append(tally_engine(engine, model))

    def mark(part: str) -> None:
        if last["step"] != steps:
            return
        if part == "data":
            measuring.enter_context(meter)
        elif part == "forward":
            measuring.close()
        elif part == "backward":
            tally = tally_engine(engine, model)
            points["after_backward"] = tally.bytes
            points["paths_after_backward"] = _top(tally.paths)

    def before_epilogue() -> None:
        if last["step"] == steps:
            points["before_epilogue"] = tally_engine(engine, model).bytes

    _wrap_client_step(engine, on_client_step)
    _wrap_epilogue(engine, before_epilogue)
    optimizer_step = OptimizerStep(engine, spec.accumulation)
    times = []
    for n in range(1, steps + 1):
        last["step"] = n
        started = time.perf_counter()
        optimizer_step(n, batches, mark=mark)
        times.append(time.perf_counter() - started)
        if info.is_main:
            log.warning("ZeRO %d, step %d: %.1f s", cfg.zero.stage, n, times[-1])
    after = tally_engine(engine, model)
    peak_in_step = max(in_step, key=lambda t: sum(t.bytes.values()), default=StorageTally())
    grads = max(
        points.get(p, {}).get("gradients", 0) for p in ("before_epilogue", "after_backward")
    )
    result = {
        "rank": rank,
        "parameters": after.get("parameters"),
        "gradients": grads,
        "optimizer_states": after.get("optimizer_states"),
        "buffers": max(after.get("buffers"), points.get("after_backward", {}).get("buffers", 0)),
        "other": after.get("other"),
        "paths_after_backward": points.get("paths_after_backward", {}),
        "paths_after_step": _top(after.paths),
        "in_step_total": sum(peak_in_step.bytes.values()),
        "in_step_gradients": peak_in_step.get("gradients"),
        "activations": meter.total,
        "num_parameters": sum(
            p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()
        ),
        "step_s": times,
        "peak_rss_gb": _peak_memory_gb(info.device),
    }
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps(result))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def _top(paths: dict[str, int], n: int = 12) -> dict[str, int]:
    return dict(sorted(paths.items(), key=lambda kv: -kv[1])[:n])


def _model_config(cfg: Any) -> Any:
    """The model of the config as plan sizes it (no manifest: plan's default vocabulary)."""
    from bertpipe.training.models.families import preset_config
    from bertpipe.training.plan.options import DEFAULT_VOCAB_SIZE

    return preset_config(
        cfg.model.resolved_family, cfg.model.preset, DEFAULT_VOCAB_SIZE, **cfg.model.overrides()
    )


# --------------------------------------------------------------------------- the runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(job: dict[str, Any], max_rss_gb: float) -> list[dict[str, Any]]:
    """Run the ranks, stopping them (only them) if together they pass ``max_rss_gb``."""
    import psutil
    import torch.multiprocessing as mp

    context = mp.start_processes(
        _rank_main, args=(job,), nprocs=job["ranks"], join=False, start_method="spawn"
    )
    peak = 0.0
    while not context.join(timeout=1.0):
        rss = 0
        for proc in context.processes:
            with contextlib.suppress(psutil.Error):
                rss += psutil.Process(proc.pid).memory_info().rss
        peak = max(peak, rss / 2**30)
        if peak > max_rss_gb:
            for proc in context.processes:
                if proc.is_alive():
                    proc.kill()
            raise RuntimeError(
                f"ZeRO {job['zero']}: the ranks held {peak:.1f} GiB together, more than "
                f"--max-rss-gb {max_rss_gb}: lower --micro-batch or --ranks"
            )
    return [json.loads(Path(job["out"], f"rank{r}.json").read_text()) for r in range(job["ranks"])]


def _bf16_note(precision: str) -> tuple[str, str | None]:
    """bf16 needs the CPU's bf16 matmuls (oneDNN); without them fall back to fp32."""
    import torch

    if precision != "bf16" or os.environ.get("DS_ACCELERATOR", "cpu") != "cpu":
        return precision, None
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if supported is not None and not supported():
        return "fp32", "bf16 is not supported by this CPU (oneDNN): measured in fp32"
    return precision, None


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from bertpipe.config import load_config
    from bertpipe.recipes import resolve
    from bertpipe.training.plan.options import DEFAULT_SEQ_LENS, PlanOptions
    from bertpipe.training.pretrain.config import PretrainConfig

    config = resolve(args.config)
    base = load_config(PretrainConfig, config, list(args.overrides))
    if not 1 <= args.phase <= len(base.phases):
        raise SystemExit(f"--phase {args.phase}: the config has {len(base.phases)} phase(s)")
    phase = base.phases[args.phase - 1]
    seq_len = args.seq_len or DEFAULT_SEQ_LENS[min(args.phase, len(DEFAULT_SEQ_LENS)) - 1]
    micro = args.micro_batch or phase.micro_batch_size
    num_masked = math.ceil(PlanOptions().mask_fraction * seq_len)
    precision, precision_note = _bf16_note(args.precision)
    stages = sorted(set(args.zero)) if args.zero else [0, 1, 2, 3]
    threads = max(1, (os.cpu_count() or 1) // args.ranks)
    results = []
    for stage in stages:
        optimizer, note = base.optimizer.name, precision_note
        if optimizer == "lamb" and stage == 3:
            optimizer = "adamw"
            note = "LAMB is refused at ZeRO 3 (trust ratios need stages 1-2): AdamW instead"
        overrides = [
            *args.overrides,
            f"zero.stage={stage}",
            f"precision={precision}",
            f"optimizer.name={optimizer}",
            "zero.offload_optimizer=none",
            "tracking.enabled=false",
            f"seed={args.seed}",
            f"phases=[{{name: {phase.name}, data: '{phase.data}', max_steps: {args.steps}, "
            f"micro_batch_size: {micro}, global_batch_size: {micro * args.ranks}, "
            f"learning_rate: {phase.learning_rate}, warmup: 0}}]",
        ]
        if args.preset:
            overrides.append(f"model.preset={args.preset}")
        cfg = load_config(PretrainConfig, config, overrides)
        with tempfile.TemporaryDirectory(prefix="bench-memory-") as out:
            job = {
                "config": config,
                "overrides": overrides,
                "ranks": args.ranks,
                "port": _free_port(),
                "threads": threads,
                "steps": args.steps,
                "seed": args.seed,
                "micro_batch": micro,
                "seq_len": seq_len,
                "num_masked": num_masked,
                "zero": stage,
                "out": out,
            }
            started = time.perf_counter()
            per_rank = _spawn(job, args.max_rss_gb)
            wall = time.perf_counter() - started
        results.append(
            _compare(cfg, stage, optimizer, note, per_rank, seq_len, micro, num_masked, wall)
        )
    sys.stdout.write(render(results))
    model_cfg = _model_config(cfg)
    return {
        "name": f"memory-{Path(config).stem}-phase{args.phase}",
        "config": config,
        "preset": cfg.model.preset,
        "num_parameters": model_cfg.num_parameters(),
        "phase": args.phase,
        "seq_len": seq_len,
        "micro_batch": micro,
        "num_masked": num_masked,
        "ranks": args.ranks,
        "steps": args.steps,
        "precision": precision,
        "precision_note": precision_note,
        "threads_per_rank": threads,
        "stages": results,
    }


def _compare(
    cfg: Any,
    stage: int,
    optimizer: str,
    note: str | None,
    per_rank: list[dict[str, Any]],
    seq_len: int,
    micro: int,
    num_masked: int,
    wall: float,
) -> dict[str, Any]:
    """Measured (the largest rank per category) against plan's estimate of the same run."""
    from bertpipe.training.plan.memory import element_bytes, estimate_memory

    plan = estimate_memory(
        _model_config(cfg),
        precision=cfg.precision,
        zero_stage=stage,
        world_size=len(per_rank),
        offload=False,
        seq_len=seq_len,
        micro_batch=micro,
        num_masked=num_masked,
        bucket_size=cfg.zero.bucket_size,
        cuda_overhead_bytes=0,
        capacity_bytes=None,
        # the run is on the CPU: what `bertpipe plan --cpu` plans (16-bit masks; the scores
        # stored where the attention has dropout)
        attention_scores_stored=_model_config(cfg).attention_dropout > 0,
        mask_bytes=element_bytes(cfg.precision),
    )
    keys = (*CATEGORIES, "buffers", "other", "in_step_total", "in_step_gradients", "activations")
    measured = {k: max(r[k] for r in per_rank) for k in keys}
    measured["model_states"] = sum(measured[k] for k in CATEGORIES)
    planned = {
        "parameters": plan.parameters,
        "gradients": plan.gradients,
        "optimizer_states": plan.optimizer_states,
        "model_states": plan.parameters + plan.gradients + plan.optimizer_states,
        "buffers": plan.buffers,
        "activations": plan.activations,
    }
    ratio = {k: measured[k] / v if v else None for k, v in planned.items()}
    return {
        "zero": stage,
        "optimizer": optimizer,
        "note": note,
        "measured": measured,
        "planned": planned,
        "ratio": ratio,
        "per_rank": per_rank,
        "step_s": max(max(r["step_s"]) for r in per_rank),
        "peak_rss_gb": max(r["peak_rss_gb"] for r in per_rank),
        "wall_s": wall,
    }


def render(results: list[dict[str, Any]]) -> str:
    """measured / planned GiB per category and stage, one row per category."""
    gib = 2**30
    rows = ["parameters", "gradients", "optimizer_states", "model_states", "buffers"]
    rows += ["activations"]
    head = f"{'GiB per rank':<18}" + "".join(
        f"{'ZeRO ' + str(r['zero']) + ' (' + r['optimizer'] + ')':>28}" for r in results
    )
    lines = [head, f"{'':<18}" + "".join(f"{'measured / plan = ratio':>28}" for _ in results)]
    for key in rows:
        cells = []
        for r in results:
            m, p, q = r["measured"][key], r["planned"][key], r["ratio"][key]
            cells.append(f"{m / gib:8.3f} / {p / gib:7.3f} = {q:5.2f}" if q else f"{m / gib:8.3f}")
        lines.append(f"{key:<18}" + "".join(f"{c:>28}" for c in cells))
    for key in ("other", "in_step_total", "in_step_gradients"):
        lines.append(f"{key:<18}" + "".join(f"{r['measured'][key] / gib:>28.3f}" for r in results))
    lines.append(f"{'step s':<18}" + "".join(f"{r['step_s']:>28.1f}" for r in results))
    lines.append(f"{'peak RSS GiB':<18}" + "".join(f"{r['peak_rss_gb']:>28.2f}" for r in results))
    for r in results:
        if r["note"]:
            lines.append(f"ZeRO {r['zero']}: {r['note']}")
    return "\n".join(lines) + "\n"
