"""``bertpipe finetune`` and ``bertpipe sweep`` (parsers and handlers)."""

from __future__ import annotations

import argparse
import json
import sys

from bertpipe.cli import add_config_arguments, config_from_args


def add_finetune_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "finetune",
        help="fine-tune a pre-trained BERT on one task (GLUE, tables, SQuAD, CoNLL)",
        description="Runs under the deepspeed launcher too (one process by default).",
    )
    add_config_arguments(parser)
    parser.set_defaults(handler=_finetune)


def _finetune(args: argparse.Namespace, passthrough: list[str]) -> int:
    from bertpipe.finetuning.config import FinetuneConfig
    from bertpipe.finetuning.loop import run_finetuning

    cfg = config_from_args(FinetuneConfig, args)
    if cfg is None:
        return 0
    result = run_finetuning(cfg)
    summary = {
        "run_id": result.run_id,
        "best_epoch": result.best_epoch,
        "main_metric": result.main_metric,
        "metrics": result.metrics,
    }
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0


def add_sweep_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "sweep",
        help="fine-tune over a hyper-parameter grid (the paper's by default), nested MLflow runs",
    )
    add_config_arguments(parser)
    parser.set_defaults(handler=_sweep)


def _sweep(args: argparse.Namespace, passthrough: list[str]) -> int:
    from bertpipe.finetuning.config import FinetuneConfig
    from bertpipe.finetuning.sweep import run_sweep

    cfg = config_from_args(FinetuneConfig, args)
    if cfg is None:
        return 0
    result = run_sweep(cfg)
    summary = {
        "run_id": result.run_id,
        "best_run_id": result.best.run_id,
        "best_params": result.best_params,
        "main_metric": result.best.main_metric,
        "best": result.best.metrics,
        "trials": len(result.trials),
    }
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0
