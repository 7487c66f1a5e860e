"""``bertpipe bench train``: optimizer steps of the real pre-training path on one device.

The same pieces as ``bertpipe pretrain``: the model of :mod:`bertpipe.training.models.bert.model`
(padded or unpadded, eager or compiled), the DeepSpeed engine of
:func:`bertpipe.training.core.engine.build_engine` (ZeRO stage, precision, optimizer, clipping from
the typed config), the trainer's loader
(:func:`bertpipe.training.pretrain.data.loader.build_pretraining_data`) and its guarded step
(:class:`bertpipe.training.core.step.OptimizerStep`,
:class:`bertpipe.training.pretrain.batches.BatchPrep`), for a preset at one phase's shape. The
shards are ``--data`` (a phase folder with ``manifest.json``) or synthetic ones written to a
temporary folder, whose lengths follow Google's instance recipe on documents of about 900 tokens
(Wikipedia's mean): 10% short targets (uniform), and a target-length instance unless the document
ends first (probability ``seq_len / 900``, then uniform in [seq_len / 4, seq_len]); about 90% real
tokens at 128 and 76% at 512.

Figures (the last line of output is one JSON object): sequences/s, real tokens/s, achieved
TFLOP/s and MFU on real tokens (what the model needs) and on padded tokens (what a padded
encoder computes), peak memory, and the time split of a step (forward, backward, optimizer
step, data wait). Throughput comes from steps timed as a whole, without synchronising inside
a step; on a GPU the split comes from extra steps with a synchronisation after each part.

``--model hf`` times transformers' ``BertForPreTraining`` instead (SDPA attention, bf16
autocast with fp32 weights, torch's fused AdamW, the same batches padded as transformers
takes them) as the reference. It predicts every position, so its FLOPs are counted the
same way as ours for MFU (the useful work), not what it computes.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bertpipe.training.pretrain.data.manifest import Manifest

log = logging.getLogger(__name__)

__all__ = ["add_arguments", "run_bench", "synthetic_lengths"]

DOCUMENT_TOKENS = 900
SHORT_FRACTION = 0.1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", help="model size preset (default tiny)")
    parser.add_argument(
        "--family", choices=("bert", "modernbert"), default=None, help="default: the preset's"
    )
    parser.add_argument("--seq-len", type=int, default=128, help="phase shape: max tokens")
    parser.add_argument("--micro-batch", type=int, default=32, help="sequences per step")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument(
        "--split-steps", type=int, default=5, help="GPU: extra steps timed part by part"
    )
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None)
    parser.add_argument("--mixed-precision", choices=("weights", "autocast"), default="weights")
    parser.add_argument("--zero", type=int, choices=(0, 1, 2), default=1)
    parser.add_argument("--optimizer", choices=("adamw", "lamb"), default="adamw")
    parser.add_argument("--padding", choices=("unpad", "pad"), default="unpad")
    parser.add_argument("--compile", action="store_true", help="torch.compile each layer")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument(
        "--dropout", type=float, default=None, help="hidden and attention (default: the family's)"
    )
    parser.add_argument("--data", help="phase shard folder (default: synthetic shards)")
    parser.add_argument("--instances", type=int, default=0, help="synthetic: 0 = enough")
    parser.add_argument("--model", choices=("bertpipe", "hf"), default="bertpipe")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--workers", type=int, default=None, help="loader workers")
    parser.add_argument("--name", default=None, help="label in the JSON")
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="device peak for MFU (default: table)"
    )
    parser.add_argument("--seed", type=int, default=0)


def synthetic_lengths(rng: Any, n: int, seq_len: int) -> Any:
    """Instance lengths as Google's recipe gives on ~900-token documents (module doc)."""
    import numpy as np

    lengths = np.full(n, seq_len, dtype=np.int64)
    cut = rng.random(n) < min(0.9, seq_len / DOCUMENT_TOKENS)
    lengths[cut] = rng.integers(max(8, seq_len // 4), seq_len + 1, int(cut.sum()))
    short = rng.random(n) < SHORT_FRACTION
    lengths[short] = rng.integers(8, seq_len + 1, int(short.sum()))
    return lengths


def _synthetic_data(folder: str, args: argparse.Namespace, batches: int) -> str:
    from bertpipe.app.bench.loader import write_shards

    instances = args.instances or max(2048, 2 * batches * args.micro_batch)
    max_predictions = max(1, round(0.15 * args.seq_len))
    phase = os.path.join(folder, f"seq{args.seq_len}")
    write_shards(
        phase,
        instances,
        shards=2,
        masked=True,
        seed=args.seed,
        seq_len=args.seq_len,
        max_predictions=max_predictions,
        lengths_fn=synthetic_lengths,
    )
    return phase


def _config(args: argparse.Namespace, data: str, total_steps: int, precision: str) -> Any:
    from bertpipe.config import load_config
    from bertpipe.training.pretrain.config import PretrainConfig

    overrides = [
        f"model.preset={args.preset}",
        f"model.max_position_embeddings={max(512, args.seq_len)}",
        f"model.unpad={str(args.padding == 'unpad').lower()}",
        f"model.compile={str(args.compile).lower()}",
        f"model.activation_checkpointing={str(args.activation_checkpointing).lower()}",
        f"phases=[{{name: bench, data: '{data}', max_steps: {total_steps}, "
        f"micro_batch_size: {args.micro_batch}, global_batch_size: {args.micro_batch}, "
        "learning_rate: 1.0e-4, warmup: 0}]",
        f"precision={precision}",
        f"mixed_precision={args.mixed_precision}",
        f"zero.stage={args.zero}",
        f"optimizer.name={args.optimizer}",
        "tracking.enabled=false",
        f"seed={args.seed}",
    ]
    if args.family is not None:
        overrides.append(f"model.family={args.family}")
    if args.dropout is not None:
        overrides += [
            f"model.hidden_dropout={args.dropout}",
            f"model.attention_dropout={args.dropout}",
        ]
    if args.peak_tflops:
        overrides.append(f"device_peak_tflops={args.peak_tflops}")
    return load_config(PretrainConfig, None, overrides)


class _Timer:
    """Wall seconds of the parts of a step; synchronises the device at each mark when asked."""

    def __init__(self, device: Any, sync: bool) -> None:
        import torch

        self._sync: Callable[[], None] = (
            (lambda: torch.cuda.synchronize(device)) if sync and device.type == "cuda" else _noop
        )
        self.parts: dict[str, float] = {}
        self._t = time.perf_counter()

    def mark(self, part: str) -> None:
        self._sync()
        now = time.perf_counter()
        self.parts[part] = self.parts.get(part, 0.0) + now - self._t
        self._t = now


def _step_figures(stats: Any) -> dict[str, float]:
    """A step's :class:`~bertpipe.training.pretrain.batches.BatchStats` as the figures
    :func:`_figures` sums."""
    keys = ("sequences", "real_tokens", "padded_tokens", "flops", "padded_flops")
    return {k: float(getattr(stats, k)) for k in keys}


def _noop() -> None:
    return None


def _peak_memory_gb(device: Any) -> float:
    import torch

    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device) / 2**30)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    precision = args.precision or ("bf16" if device_type == "cuda" else "fp32")
    total = args.warmup + args.steps + (args.split_steps if device_type == "cuda" else 0)
    with contextlib.ExitStack() as stack:
        data = args.data
        if data is None:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-train-"))
            data = _synthetic_data(folder, args, total)
        cfg = _config(args, data, total, precision)
        workers = args.workers if args.workers is not None else (2 if device_type == "cuda" else 0)
        cfg.data.num_workers = workers
        run = _run_ours if args.model == "bertpipe" else _run_hf
        result = run(args, cfg, device_type)
    name = args.name or (
        f"{args.model}-{args.preset}-s{args.seq_len}-b{args.micro_batch}-{args.padding}"
        + ("-compiled" if args.compile else "")
    )
    return {
        "name": name,
        "model": args.model,
        "preset": args.preset,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "precision": precision,
        "mixed_precision": args.mixed_precision,
        "zero": args.zero if args.model == "bertpipe" else None,
        "optimizer": args.optimizer,
        "padding": args.padding if args.model == "bertpipe" else "pad",
        "compile": args.compile,
        "activation_checkpointing": args.activation_checkpointing,
        "data": args.data or "synthetic",
        "torch": torch.__version__,
        **result,
    }


def _loader(
    cfg: Any, rank: int = 0, world: int = 1, manifest: Manifest | None = None
) -> Iterator[Any]:
    """The trainer's own training loader (``build_pretraining_data``; ``manifest``: the first
    phase's, if already read)."""
    from bertpipe.training.pretrain.data.loader import build_pretraining_data

    loader = build_pretraining_data(
        cfg.phases[0], cfg.data, rank=rank, world_size=world, seed=cfg.seed, manifest=manifest
    )
    return iter(loader)


def _figures(
    steps: list[dict[str, float]], split: dict[str, float], split_steps: int, device: Any
) -> dict[str, Any]:
    """Throughput figures from the timed steps' sums; the split per step."""
    seconds = sum(s["seconds"] for s in steps)
    total = {k: sum(s[k] for s in steps) for k in steps[0]}
    per = max(split_steps, 1)
    tflops = total["flops"] / seconds / 1e12
    padded_tflops = total["padded_flops"] / seconds / 1e12
    return {
        "steps": len(steps),
        "step_s": seconds / len(steps),
        "step_s_median": statistics.median(s["seconds"] for s in steps),
        "seq_per_s": total["sequences"] / seconds,
        "real_tokens_per_s": total["real_tokens"] / seconds,
        "padded_tokens_per_s": total["padded_tokens"] / seconds,
        "mean_length": total["real_tokens"] / total["sequences"],
        "padding_fraction": 1 - total["real_tokens"] / total["padded_tokens"],
        "tflops": tflops,
        "tflops_padded": padded_tflops,
        "peak_memory_gb": _peak_memory_gb(device),
        "forward_s": split.get("forward", 0.0) / per,
        "backward_s": split.get("backward", 0.0) / per,
        "optimizer_s": split.get("optimizer", 0.0) / per,
        "data_wait_s": split.get("data", 0.0) / per,
        "loss_first": steps[0]["loss"],
        "loss_last": steps[-1]["loss"],
    }


def _run_ours(args: argparse.Namespace, cfg: Any, device_type: str) -> dict[str, Any]:
    import torch

    from bertpipe.training.core.engine import build_engine, init_distributed
    from bertpipe.training.core.step import OptimizerStep
    from bertpipe.training.pretrain.batches import BatchPrep
    from bertpipe.training.pretrain.trainer import Trainer

    info = init_distributed()
    trainer = Trainer(cfg, info)
    engine, _ = build_engine(trainer.new_model(), trainer.engine_spec(0))
    prep = BatchPrep(trainer.model_cfg, info.device, unpad=cfg.model.unpad)
    batches = (prep(host) for host in _loader(cfg, info.rank, info.world_size))
    losses: list[torch.Tensor] = []
    figures: list[dict[str, float]] = []

    def keep(out: Any, stats: Any) -> None:
        losses.append(out.loss.detach())
        figures.append(_step_figures(stats))

    optimizer_step = OptimizerStep(engine, 1, on_output=keep)  # the trainer's guarded step
    count = 0

    def step(timer: _Timer) -> dict[str, float]:
        nonlocal count
        count += 1
        optimizer_step(count, batches, mark=timer.mark)
        return figures[-1]

    result = _timed(args, info.device, step, losses)
    return {**result, **_mfu_with(trainer.peak, result)}


def _mfu_with(peak: float | None, result: dict[str, Any]) -> dict[str, Any]:
    from bertpipe.training.models.flops import mfu

    return {
        "mfu_real": mfu(result["tflops"] * 1e12, peak),
        "mfu_padded": mfu(result["tflops_padded"] * 1e12, peak),
        "peak_tflops": None if peak is None else peak / 1e12,
    }


def _timed(
    args: argparse.Namespace,
    device: Any,
    step: Callable[[_Timer], dict[str, float]],
    losses: list[Any],
) -> dict[str, Any]:
    """Warm-up, timed steps (no synchronisation inside), then on a GPU split-timed steps."""
    import torch

    for _ in range(args.warmup):
        step(_Timer(device, sync=False))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    first = len(losses)
    timed: list[dict[str, float]] = []
    split_timer = _Timer(device, sync=device.type == "cuda")
    started = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        timer = split_timer if device.type != "cuda" else _Timer(device, sync=False)
        figures = step(timer)
        figures["seconds"] = time.perf_counter() - t0
        timed.append(figures)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # the last step's time includes the queued work; spread the total evenly
        elapsed = time.perf_counter() - started
        for figures in timed:
            figures["seconds"] = elapsed / len(timed)
        split_steps = args.split_steps
        for _ in range(split_steps):
            split_timer.mark("idle")
            step(split_timer)
    else:
        split_steps = args.steps
    values = [float(v) for v in torch.stack(losses[first:]).float().cpu()]
    for figures, loss in zip(timed, values, strict=False):
        figures["loss"] = loss
    return _figures(timed, split_timer.parts, split_steps, device)


def _run_hf(args: argparse.Namespace, cfg: Any, device_type: str) -> dict[str, Any]:
    """transformers' model of the family (``BertForPreTraining``, ``ModernBertForMaskedLM``),
    the same batches, a plain torch loop."""
    import torch
    import transformers

    from bertpipe.training.models.flops import peak_flops
    from bertpipe.training.models.hf import hf_config_dict
    from bertpipe.training.pretrain.batches import BatchPrep
    from bertpipe.training.pretrain.data.manifest import read_phase_data
    from bertpipe.training.pretrain.phases import model_config

    device = torch.device(device_type)
    phase_data = read_phase_data(cfg.phases[0], "phases[0]")
    model_cfg = model_config(cfg, [phase_data])
    family = cfg.model.family_entry
    settings = hf_config_dict(model_cfg)
    hf_cfg = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(cfg.seed)
    model = getattr(transformers, family.reference_model)(hf_cfg).to(device).train()
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=fused)
    autocast = cfg.precision == "bf16"
    prep = BatchPrep(model_cfg, device, unpad=False, nsp=family.nsp)
    batches = _loader(cfg, manifest=phase_data.parsed)
    losses: list[torch.Tensor] = []

    def step(timer: _Timer) -> dict[str, float]:
        host = next(batches)
        timer.mark("data")
        batch, stats = prep(host)
        B, S = batch["input_ids"].shape
        labels = torch.full((B * S,), -100, dtype=torch.long, device=device)
        labels[batch["mlm_positions"]] = batch["mlm_labels"]
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        if family.nsp:
            inputs["token_type_ids"] = batch["token_type_ids"]
            inputs["next_sentence_label"] = batch["nsp_labels"]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out = model(**inputs, labels=labels.view(B, S))
        timer.mark("forward")
        out.loss.backward()
        timer.mark("backward")
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.mark("optimizer")
        losses.append(out.loss.detach())
        return _step_figures(stats)

    result = _timed(args, device, step, losses)
    peak = None
    if cfg.device_peak_tflops:
        peak = cfg.device_peak_tflops * 1e12
    elif device.type == "cuda":
        peak = peak_flops(torch.cuda.get_device_name(device), cfg.precision)
    return {**result, **_mfu_with(peak, result)}
