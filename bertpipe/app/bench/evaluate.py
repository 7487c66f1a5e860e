"""``bertpipe bench evaluate``: how long a suite takes per task on this machine.

Writes GLUE's eight task folders (:mod:`.sample_glue`, ``--rows`` training rows each, a
third of that for dev), a randomly initialised BERT of ``--preset`` size with a tokenizer
over their words, and runs the suite with the protocol given (the paper's by default: 4
learning rates x 3 seeds x 3 epochs, batch 32) through :func:`~.runner.run_suite`, tracked
in a sqlite MLflow store in ``--out``. Reports per task the wall seconds of its trials, per
trial and per 1,000 training rows per epoch, and the whole suite's wall time (the last line
of stdout is one JSON object). The scores of a random model on these files mean nothing;
the time is what is measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["add_arguments", "run_bench"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", help="model size (tiny, mini, small, base)")
    parser.add_argument("--rows", type=int, default=1000, help="training rows per task")
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--learning-rates", default="5e-5,4e-5,3e-5,2e-5")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--tasks", default="", help="comma-separated (default: all eight)")
    parser.add_argument("--parallel", type=int, default=None, help="trials at once")
    parser.add_argument("--threads-per-trial", type=int, default=None)
    parser.add_argument("--out", default=None, help="folder (default: a temporary one)")


def _model(folder: Path, preset: str, max_positions: int) -> None:
    import torch

    from bertpipe.finetuning.evaluation.sample_glue import WORDS
    from bertpipe.preprocessing.tokenizer import build_from_vocab, save_tokenizer
    from bertpipe.training.models.bert.model import BertForPreTraining, BertModelConfig
    from bertpipe.training.models.hf import save_hf_folder

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_from_vocab(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])
    save_tokenizer(tokenizer, str(folder), lowercase=True)
    torch.manual_seed(0)
    cfg = BertModelConfig.preset(
        preset, tokenizer.get_vocab_size(), max_position_embeddings=max_positions
    )
    extra = {n: (folder / n).read_bytes() for n in ("vocab.txt", "tokenizer.json")}
    save_hf_folder(BertForPreTraining(cfg), folder, extra_files=extra)


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from bertpipe.config import load_config
    from bertpipe.finetuning.evaluation.config import EvaluateConfig
    from bertpipe.finetuning.evaluation.runner import run_suite
    from bertpipe.finetuning.evaluation.sample_glue import write_glue

    out = Path(args.out or tempfile.mkdtemp(prefix="bertpipe-bench-evaluate-"))
    write_glue(out / "glue", train=args.rows, dev=max(8, args.rows // 3))
    _model(out / "model", args.preset, max(128, args.max_seq_length))
    overrides = [
        f"model={out / 'model'}",
        "suite=glue",
        f"data={out / 'glue'}",
        f"output={out / 'suite'}",
        "overwrite=true",
        f"protocol.learning_rates=[{args.learning_rates}]",
        f"protocol.seeds=[{args.seeds}]",
        f"protocol.epochs={args.epochs}",
        f"protocol.batch_size={args.batch_size}",
        f"protocol.max_seq_length={args.max_seq_length}",
        f"tracking.uri=sqlite:///{out / 'mlflow.db'}",
        "tracking.experiment=bench-evaluate",
    ]
    if args.tasks:
        overrides.append(f"tasks=[{args.tasks}]")
    if args.parallel:
        overrides.append(f"parallel={args.parallel}")
    if args.threads_per_trial:
        overrides.append(f"threads_per_trial={args.threads_per_trial}")
    cfg = load_config(EvaluateConfig, None, overrides)
    started = time.monotonic()
    result = run_suite(cfg)
    wall = time.monotonic() - started
    tasks: dict[str, dict[str, float]] = {}
    for trial in result.trials.values():
        tasks.setdefault(trial.task, {"trials": 0, "seconds": 0.0})
        tasks[trial.task]["trials"] += 1
        tasks[trial.task]["seconds"] += trial.seconds
    rows_epochs = args.rows * args.epochs / 1000
    for figures in tasks.values():
        figures["seconds_per_trial"] = figures["seconds"] / figures["trials"]
        figures["seconds_per_1k_rows_epoch"] = figures["seconds_per_trial"] / rows_epochs
    per_trial = statistics.fmean(t.seconds for t in result.trials.values())
    summary = {
        "benchmark": "evaluate",
        "preset": args.preset,
        "rows": args.rows,
        "max_seq_length": args.max_seq_length,
        "trials": len(result.trials),
        "threads_per_trial": statistics.mode(t.threads for t in result.trials.values()),
        "wall_s": round(wall, 1),
        "mean_trial_s": round(per_trial, 2),
        "tasks": {k: {n: round(v, 2) for n, v in f.items()} for k, f in tasks.items()},
        "output": str(out),
    }
    log.info("bench evaluate: %s", json.dumps(summary))
    return summary
