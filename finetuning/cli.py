"""``bertpipe finetune`` and ``bertpipe sweep`` (parsers and handlers)."""

from __future__ import annotations

import argparse
import json
import sys

from bertpipe.cli_args import add_stage_command, config_from_args
from bertpipe.storage_check import preflight


def add_finetune_command(sub: argparse._SubParsersAction) -> None:
    add_stage_command(
        sub,
        "finetune",
        help="fine-tune a pre-trained BERT on one task (GLUE, tables, SQuAD, CoNLL)",
        description=(
            "Fine-tunes a pre-trained BERT (init_from: a `bertpipe export` folder, any "
            "transformers BERT folder or a pre-training checkpoint folder) on one task: GLUE, "
            "a table (CSV/TSV/JSONL), SQuAD or CoNLL. Every epoch is evaluated; the best "
            "epoch's model is kept. Runs under the deepspeed launcher too (one process by "
            "default)."
        ),
        config="bertpipe.finetuning.config:FinetuneConfig",
        example="learning_rate=2e-5 task.max_seq_length=384",
        examples=[
            "bertpipe finetune init_from=runs/bert-large/hf task.family=glue task.name=mrpc "
            "task.train=glue/MRPC/train.tsv 'task.dev=[glue/MRPC/dev.tsv]' learning_rate=2e-5",
            "bertpipe finetune init_from=runs/bert-large/hf task.family=squad task.name=squad2 "
            "task.train=train-v2.0.json 'task.dev=[dev-v2.0.json]' task.max_seq_length=384",
        ],
        handler=_finetune,
    )


def _finetune(args: argparse.Namespace, passthrough: list[str]) -> int:
    from bertpipe.finetuning.config import FinetuneConfig

    cfg = config_from_args(FinetuneConfig, args)
    if cfg is None:  # --print-config: the stage's modules (torch) are not imported
        return 0
    from bertpipe import fsio, tracking

    preflight(
        [("init_from", cfg.init_from)] if cfg.init_from else [],
        [("checkpoint.dir", cfg.checkpoint.dir)] if cfg.checkpoint.dir else [],
    )
    checkpoints = cfg.checkpoint.dir or (cfg.output and fsio.join(cfg.output, "checkpoints"))
    tracking.check_new_run(cfg.tracking, checkpoints)  # before torch and DeepSpeed
    from bertpipe.finetuning.run import run_finetuning
    from bertpipe.training.core.cadence import PREEMPTED_EXIT_CODE, PreemptedError

    try:
        result = run_finetuning(cfg)
    except PreemptedError:  # saved (and logged); the same command continues the run
        return PREEMPTED_EXIT_CODE
    summary = {
        "run_id": result.run_id,
        "best_epoch": result.best_epoch,
        "main_metric": result.main_metric,
        "metrics": result.metrics,
        "output": result.output,
        "registered_model": result.registered_model,
        "mlflow_model_id": result.model_id,
    }
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0


def add_sweep_command(sub: argparse._SubParsersAction) -> None:
    add_stage_command(
        sub,
        "sweep",
        help="fine-tune over a hyper-parameter grid (the paper's by default), nested MLflow runs",
        description=(
            "Fine-tunes once per point of the grid in sweep.* (by default the BERT paper's: "
            "learning rate 5e-5/4e-5/3e-5/2e-5 x batch 16/32 x epochs 2/3/4), each a nested "
            "MLflow run under one parent run that records the best. Reads the finetune config."
        ),
        config="bertpipe.finetuning.config:FinetuneConfig",
        example="'sweep.learning_rate=[5e-5,3e-5]' sweep.max_trials=4",
        examples=[
            "bertpipe sweep init_from=runs/bert-base/hf task.family=glue task.name=sst-2 "
            "task.train=glue/SST-2/train.tsv 'task.dev=[glue/SST-2/dev.tsv]'",
            "bertpipe sweep init_from=runs/bert-base/hf task.family=conll task.name=ner "
            "task.train=train.txt 'task.dev=[dev.txt]' 'sweep.epochs=[3]' sweep.max_trials=4",
        ],
        handler=_sweep,
    )


def _sweep(args: argparse.Namespace, passthrough: list[str]) -> int:
    from bertpipe.finetuning.config import FinetuneConfig

    cfg = config_from_args(FinetuneConfig, args)
    if cfg is None:
        return 0
    from bertpipe import tracking
    from bertpipe.finetuning.sweep import run_sweep
    from bertpipe.training.core.cadence import PREEMPTED_EXIT_CODE, PreemptedError

    tracking.check_new_run(cfg.tracking)  # a sweep's run is new: before DeepSpeed starts
    try:
        result = run_sweep(cfg)
    except PreemptedError:  # the trial in progress saved (and logged) its checkpoint
        return PREEMPTED_EXIT_CODE
    summary = {
        "run_id": result.run_id,
        "best_run_id": result.best.run_id,
        "best_params": result.best_params,
        "main_metric": result.best.main_metric,
        "best": result.best.metrics,
        "trials": len(result.trials),
        "output": result.output,
        "best_output": result.best.output,
        "registered_model": result.best.registered_model,
        "mlflow_model_id": result.best.model_id,
    }
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0
