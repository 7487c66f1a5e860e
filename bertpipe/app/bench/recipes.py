"""``bertpipe bench recipes``: the paper's recipe against the modern one at the same compute.

On the demo's corpus and tokenizer (the documentation that ships with Python), for each seed:

* **paper**: BERT (post-LN, learned positions, NSP head) on ``mlm+nsp`` instances (Google's
  pairs: 50% random next, 10% short targets), 15% masking (80/10/10), AdamW (0.9, 0.999),
  weight decay 0.01, linear warmup and linear decay;
* **modern**: ModernBERT of the same depth, width and heads (RoPE, GeGLU of 1.5 x hidden,
  pre-norm without biases, alternating global / local attention) on ``mlm`` instances
  (FULL-SENTENCES packing, no NSP), 30% masking, AdamW (0.9, 0.98), weight decay 1e-5,
  warmup-stable-decay with a 1-sqrt cooldown over the last 20% of the steps.

Both read dynamically masked shards of one sequence length and train with the same batch and
peak learning rate. The modern recipe trains for the same number of pre-training tokens as
the paper's (its packed sequences are fuller, so it takes fewer steps), and separately for the
same wall time (steps from the measured step times of the token-matched runs). Each model is
scored on held-out MLM accuracy, on both recipes' held-out splits (each model's own objective
is 15% or 30%: both sets show it on the other's too), and downstream on the demo's evaluation
suite (two tasks; one learning rate, fine-tuning seeds 1-3 per pre-trained model).

The runs are resumable: a finished run's results are read back from ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from pathlib import Path
from typing import Any

from bertpipe.errors import BertpipeError

log = logging.getLogger(__name__)

__all__ = ["add_arguments", "check_sizes", "log_every", "run_bench", "step_seconds"]

RECIPES = ("paper", "modern")
HELDOUT_FRACTION = 0.02
"""Share of the corpus's documents both recipes hold out (chosen by a stable hash)."""
HELDOUT_BATCH = 8
"""Held-out instances per batch of the accuracy measurement."""
MIN_DOCUMENTS = 400
"""The smallest ``--documents``: 2% held out is about 8 documents, which give each recipe's
held-out split the batch of 8 instances its accuracy is measured on (60 documents held
none out, and the bench failed only after its first pre-training run)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/bench-recipes", help="work folder (resumable)")
    parser.add_argument("--documents", type=int, default=None, help="corpus documents (all)")
    parser.add_argument("--preset", default="tiny", help="both models' depth/width preset")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=1600, help="the paper recipe's steps")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step (both)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (both)")
    parser.add_argument("--seeds", default="1,2,3", help="pre-training seeds")
    parser.add_argument("--no-wall-time", action="store_true", help="skip the equal-time runs")
    parser.add_argument("--finetune-lr", type=float, default=2e-3)
    parser.add_argument("--finetune-seeds", default="1,2,3")
    parser.add_argument("--epochs", type=int, default=10, help="fine-tuning epochs")
    parser.add_argument("--no-downstream", action="store_true", help="skip the suite")


def check_sizes(args: argparse.Namespace) -> None:
    """One line (exit 2) before any work for sizes the bench cannot run at."""
    problems = []
    if args.documents is not None and args.documents < MIN_DOCUMENTS:
        problems.append(
            f"--documents {args.documents} is too few: at least {MIN_DOCUMENTS} (or all, the "
            f"default), so that the {HELDOUT_FRACTION:.0%} held out give each recipe a batch of "
            "held-out instances"
        )
    if args.steps < 2:
        problems.append(f"--steps {args.steps} is too few: at least 2 (a step time needs two)")
    for name in ("batch", "epochs"):
        if getattr(args, name) < 1:
            problems.append(f"--{name} must be at least 1")
    for name in ("seeds", "finetune_seeds"):
        try:
            [int(s) for s in str(getattr(args, name)).split(",")]
        except ValueError:
            problems.append(f"--{name.replace('_', '-')} must be integers separated by commas")
    if problems:
        raise BertpipeError("bench recipes: " + "; ".join(problems) + " (nothing was run)")


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    import os

    check_sizes(args)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{out / 'mlflow.db'}"
    common = [f"tracking.uri={uri}", "tracking.experiment=bench-recipes"]
    seeds = [int(s) for s in str(args.seeds).split(",")]
    _data(out, args, common)
    _check_heldout(out, args)
    mean_tokens = {r: _mean_tokens(out / f"shards-{r}" / f"seq{args.seq_len}") for r in RECIPES}
    # (at least 2: a run's step time is measured between two logged losses)
    modern_steps = max(2, round(args.steps * mean_tokens["paper"] / mean_tokens["modern"]))
    runs: dict[str, list[dict[str, Any]]] = {"paper": [], "modern": []}
    for seed in seeds:
        runs["paper"].append(_pretrain(out, args, common, "paper", seed, args.steps, "tokens"))
        runs["modern"].append(_pretrain(out, args, common, "modern", seed, modern_steps, "tokens"))
    step_s = {r: statistics.median(x["wall_s"] / x["steps"] for x in runs[r]) for r in RECIPES}
    conditions = {"tokens": runs}
    if not args.no_wall_time:
        paper_wall = statistics.median(x["wall_s"] for x in runs["paper"])
        timed_steps = max(2, round(paper_wall / step_s["modern"]))
        conditions["wall"] = {
            "paper": runs["paper"],
            "modern": [
                _pretrain(out, args, common, "modern", seed, timed_steps, "wall") for seed in seeds
            ],
        }
    if not args.no_downstream:
        from bertpipe.app.demo import demo_tasks

        if not (out / "tasks" / "suite.yaml").exists():
            demo_tasks(out)
        for by_recipe in conditions.values():
            for recipe_runs in by_recipe.values():
                for run in recipe_runs:
                    run.setdefault("downstream", _downstream(out, args, common, run))
    result = {
        "name": f"recipes-{args.preset}-s{args.seq_len}",
        "preset": args.preset,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "seeds": seeds,
        "mean_tokens_per_sequence": mean_tokens,
        "step_s": step_s,
        "step_time_ratio_modern_over_paper": step_s["modern"] / step_s["paper"],
        "tokens_per_s": {r: args.batch * mean_tokens[r] / step_s[r] for r in RECIPES},
        "conditions": {c: _summary(by_recipe) for c, by_recipe in conditions.items()},
    }
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(_table(result))
    return result


# ------------------------------------------------------------------ data


def _data(out: Path, args: argparse.Namespace, common: list[str]) -> None:
    """Corpus, tokenizer and both recipes' shards (each made once)."""
    from bertpipe.app.demo import demo_corpus, demo_tokenizer
    from bertpipe.config import load_config
    from bertpipe.preprocessing.config import PreprocessConfig
    from bertpipe.preprocessing.run import run_preprocess

    if not (out / "corpus").exists():
        demo_corpus(out, args.documents)
    if not (out / "tokenizer" / "tokenizer.json").exists():
        demo_tokenizer(out, common)
    s = args.seq_len
    recipe = {
        "paper": ["objective=mlm+nsp", "masking.masked_lm_prob=0.15", f"{round(0.15 * s) + 1}"],
        "modern": ["objective=mlm", "masking.masked_lm_prob=0.3", f"{round(0.3 * s) + 1}"],
    }
    for name, (objective, prob, predictions) in recipe.items():
        folder = out / f"shards-{name}"
        if (folder / f"seq{s}" / "manifest.json").exists():
            continue
        cfg = load_config(
            PreprocessConfig,
            None,
            [
                f"input.paths=[{out / 'corpus'}]",
                "input.format=jsonl",
                f"tokenizer={out / 'tokenizer'}",
                f"output={folder}",
                f"phases=[{{name: seq{s}, max_seq_length: {s}, "
                f"max_predictions_per_seq: {predictions}}}]",
                objective,
                prob,
                "masking.mode=none",  # dynamic masking for both: a small corpus, many epochs
                "dupe_factor=5",
                f"heldout_fraction={HELDOUT_FRACTION}",
                "overwrite=true",
                f"tracking.run_name=recipes-preprocess-{name}",
                *common,
            ],
        )
        run_preprocess(cfg)


def _check_heldout(out: Path, args: argparse.Namespace) -> None:
    """Each recipe's held-out split holds a batch (one line, exit 2, before any training)."""
    for recipe in RECIPES:
        manifest = out / f"shards-{recipe}" / f"seq{args.seq_len}" / "manifest.json"
        held = json.loads(manifest.read_text())["splits"]["heldout"]["instances"]
        if held < HELDOUT_BATCH:
            raise BertpipeError(
                f"bench recipes: the {recipe} recipe's held-out split ({manifest}) has {held} "
                f"instance(s), fewer than the batch of {HELDOUT_BATCH} its accuracy is measured "
                "on: give more --documents"
            )


def _mean_tokens(phase: Path) -> float:
    manifest = json.loads((phase / "manifest.json").read_text())
    train = manifest.get("stats", {}).get("train", {})
    if "mean_tokens_per_instance" in train:
        return float(train["mean_tokens_per_instance"])
    return float(train["instance_tokens"]) / float(train["instances"])


# ------------------------------------------------------------------ pre-training


def _pretrain(
    out: Path,
    args: argparse.Namespace,
    common: list[str],
    recipe: str,
    seed: int,
    steps: int,
    condition: str,
) -> dict[str, Any]:
    """One pre-training run (or its recorded result): wall time, held-out accuracies."""
    from bertpipe.config import load_config
    from bertpipe.training.pretrain.config import PretrainConfig
    from bertpipe.training.pretrain.trainer import run_pretraining

    name = f"{recipe}-{condition}-seed{seed}"
    folder = out / "pretrain" / name
    record = folder / "bench.json"
    if record.exists():
        return dict(json.loads(record.read_text()))
    s = args.seq_len
    settings = {
        "paper": [
            "model.family=bert",
            "phases[0].decay=linear",
            "optimizer.betas=[0.9, 0.999]",
            "optimizer.weight_decay=0.01",
        ],
        "modern": [
            "model.family=modernbert",
            "phases[0].decay=wsd",
            "phases[0].decay_shape=1-sqrt",
            "phases[0].decay_fraction=0.2",
            "optimizer.betas=[0.9, 0.98]",
            "optimizer.weight_decay=1.0e-5",
        ],
    }[recipe]
    cfg = load_config(
        PretrainConfig,
        None,
        [
            f"output={folder}",
            f"model.preset={args.preset}",
            f"model.max_position_embeddings={max(512, s)}",
            f"phases=[{{name: phase1, data: {out / f'shards-{recipe}' / f'seq{s}'}, "
            f"max_steps: {steps}, micro_batch_size: {args.batch}, "
            f"global_batch_size: {args.batch}, learning_rate: {args.lr}, warmup: 0.1}}]",
            *settings,
            "optimizer.eps=1.0e-6",
            "precision=fp32",
            "zero.stage=1",
            "data.num_workers=0",
            f"seed={seed}",
            "eval.max_batches=1",
            "checkpoint.every_steps=0",
            "checkpoint.keep_last=1",
            "checkpoint.resume=none",
            f"log_every_steps={log_every(steps)}",
            f"tracking.run_name=recipes-{name}",
            *common,
        ],
    )
    if folder.exists():  # an unfinished earlier attempt
        import shutil

        shutil.rmtree(folder)
    started = time.monotonic()
    run_pretraining(cfg)
    wall = time.monotonic() - started
    result: dict[str, Any] = {
        "recipe": recipe,
        "condition": condition,
        "seed": seed,
        "steps": steps,
        "run_s": wall,
        "wall_s": steps * _step_seconds(cfg, uri_of(common)),
        "tokens": steps * args.batch * _mean_tokens(out / f"shards-{recipe}" / f"seq{s}"),
        "checkpoints": str(folder / "checkpoints"),
        "heldout": {
            data: _heldout_accuracy(folder / "checkpoints", out / f"shards-{data}" / f"seq{s}")
            for data in RECIPES
        },
    }
    record.write_text(json.dumps(result, indent=2) + "\n")
    return result


def uri_of(common: list[str]) -> str:
    return next(item.split("=", 1)[1] for item in common if item.startswith("tracking.uri="))


def log_every(steps: int) -> int:
    """Every how many steps a run logs its loss: 10, fewer for short runs, so that a run of
    2 steps or more logs twice (its step time is measured between the first and the last;
    with 10 a run of 10 steps logged once and timed 0 s per step, a ZeroDivisionError)."""
    return max(1, min(10, steps // 20))


def _step_seconds(cfg: Any, uri: str) -> float:
    """Seconds per optimizer step of the run, from the times its loss was logged (every
    ``log_every_steps``): the training alone, not the process's start-up, the engine's
    set-up, the evaluation or the checkpoint."""
    import mlflow

    from bertpipe.training import checkpoint as ckpt

    state, _ = ckpt.read_state(cfg.checkpoint_dir, ckpt.latest_tag(cfg.checkpoint_dir), 0)
    client = mlflow.MlflowClient(tracking_uri=uri)
    history = client.get_metric_history(state.mlflow_run_id, "train/loss")
    return step_seconds([(m.step, m.timestamp) for m in history], cfg.output)


def step_seconds(history: list[tuple[int, int]], run: str) -> float:
    """Seconds per step between the first and the last ``(step, timestamp in ms)`` logged."""
    points = sorted(history)
    if len(points) < 2 or points[-1][0] == points[0][0] or points[-1][1] <= points[0][1]:
        raise RuntimeError(
            f"{run}: cannot time its steps from {len(points)} logged loss(es) {points}: a step "
            "time needs two at different steps and times"
        )
    (first, t0), (last, t1) = points[0], points[-1]
    return (t1 - t0) / 1000 / (last - first)


def _heldout_accuracy(checkpoints: Path, phase: Path) -> float:
    """MLM accuracy of the checkpoint's model on all of ``phase``'s held-out split (the
    loader's dynamic masks with a fixed seed: the same masked positions for every model)."""
    import torch

    from bertpipe.training.export import load_checkpoint_model
    from bertpipe.training.pretrain.batches import BatchPrep
    from bertpipe.training.pretrain.config import DataConfig, EvalConfig, PhaseSpec
    from bertpipe.training.pretrain.data.loader import build_pretraining_data

    model, _ = load_checkpoint_model(str(checkpoints))
    spec = PhaseSpec(
        name="heldout",
        data=str(phase),
        micro_batch_size=HELDOUT_BATCH,
        global_batch_size=HELDOUT_BATCH,
    )
    loader = build_pretraining_data(
        spec, DataConfig(num_workers=0), rank=0, world_size=1, seed=0, evaluation=EvalConfig(0, 0)
    )
    prep = BatchPrep(model.config, torch.device("cpu"), unpad=True)  # type: ignore[arg-type]
    correct = count = 0
    with torch.no_grad():
        for host in loader:
            batch, _ = prep(host)
            batch.pop("nsp_labels", None)
            output = model(**batch)
            correct += int(output.mlm_correct)
            count += int(output.mlm_count)
    return correct / max(count, 1)


# ------------------------------------------------------------------ downstream


def _downstream(
    out: Path, args: argparse.Namespace, common: list[str], run: dict[str, Any]
) -> dict[str, Any]:
    """The demo suite fine-tuned from the run's export: the average and each task's score."""
    from bertpipe.config import load_config
    from bertpipe.finetuning.evaluation.config import EvaluateConfig
    from bertpipe.finetuning.evaluation.runner import run_suite
    from bertpipe.training.export import export_checkpoint

    name = f"{run['recipe']}-{run['condition']}-seed{run['seed']}"
    record = out / "evaluate" / f"{name}.json"
    if record.exists():
        return dict(json.loads(record.read_text()))
    export = out / "exports" / name
    if not (export / "config.json").exists():
        export_checkpoint(run["checkpoints"], str(export), track=False)
    cfg = load_config(
        EvaluateConfig,
        None,
        [
            f"model={export}",
            f"model_name={name}",
            f"suite={out / 'tasks' / 'suite.yaml'}",
            f"output={out / 'evaluate' / name}",
            "overwrite=true",
            f"protocol.learning_rates=[{args.finetune_lr}]",
            f"protocol.seeds=[{args.finetune_seeds}]",
            f"protocol.epochs={args.epochs}",
            "protocol.batch_size=16",
            f"tracking.run_name=recipes-evaluate-{name}",
            *common,
        ],
    )
    scores = run_suite(cfg).scores
    result = {"average": scores.average, "tasks": {t.task: t.mean for t in scores.tasks}}
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(result, indent=2) + "\n")
    return result


# ------------------------------------------------------------------ report


def _mean_std(values: list[float]) -> list[float]:
    if not values:
        return [math.nan, math.nan]
    return [statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0]


def _summary(by_recipe: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per recipe: steps, tokens, wall time, held-out accuracies and downstream scores as
    [mean, std] over the pre-training seeds."""
    out: dict[str, Any] = {}
    for recipe, runs in by_recipe.items():
        item: dict[str, Any] = {
            "steps": runs[0]["steps"],
            "tokens": _mean_std([r["tokens"] for r in runs]),
            "wall_s": _mean_std([r["wall_s"] for r in runs]),
        }
        for data in RECIPES:
            item[f"heldout_{data}"] = _mean_std([r["heldout"][data] for r in runs])
        scored = [r["downstream"] for r in runs if "downstream" in r]
        if scored:
            item["downstream_average"] = _mean_std([d["average"] for d in scored])
            for task in scored[0]["tasks"]:
                item[f"downstream_{task}"] = _mean_std([d["tasks"][task] for d in scored])
        out[recipe] = item
    return out


def _table(result: dict[str, Any]) -> str:
    """The figures as the Markdown table BENCHMARKS.md records."""

    def pct(pair: list[float]) -> str:
        return "-" if not math.isfinite(pair[0]) else f"{100 * pair[0]:.1f} ± {100 * pair[1]:.1f}"

    keys = [
        k
        for k in next(iter(result["conditions"].values()))["paper"]
        if k.startswith(("heldout", "downstream"))
    ]
    head = ["condition", "recipe", "steps", "tokens (M)", "wall (s)", *keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for condition, by_recipe in result["conditions"].items():
        for recipe, item in by_recipe.items():
            row = [
                condition,
                recipe,
                str(item["steps"]),
                f"{item['tokens'][0] / 1e6:.2f}",
                f"{item['wall_s'][0]:.0f} ± {item['wall_s'][1]:.0f}",
                *(pct(item[k]) for k in keys),
            ]
            lines.append("| " + " | ".join(row) + " |")
    ratio = result["step_time_ratio_modern_over_paper"]
    lines.append("")
    lines.append(f"step time modern / paper: {ratio:.3f} (median over seeds)")
    return "\n".join(lines)
