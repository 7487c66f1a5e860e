"""``bertpipe evaluate`` (parser and handler)."""

from __future__ import annotations

import argparse
import json
import sys

from bertpipe.cli_args import add_stage_command, config_from_args

__all__ = ["add_evaluate_command"]


def add_evaluate_command(sub: argparse._SubParsersAction) -> None:
    parser = add_stage_command(
        sub,
        "evaluate",
        help="a model's downstream scores on a suite (GLUE, SQuAD, CoNLL, KLUE): the paper's "
        "protocol",
        description=(
            "Fine-tunes a model (an export folder, a pre-training checkpoint or one of its "
            "global_stepN, or models:/NAME/VERSION) on every task of a suite (glue, squad, "
            "conll, klue, or a suite YAML) with the BERT paper's protocol: per task the learning "
            "rates 5e-5/4e-5/3e-5/2e-5, batch 32, 3 epochs, N seeds (protocol.seeds, 3); the "
            "learning rate with the best mean dev score is chosen and its mean and standard "
            "deviation over seeds reported, with the GLUE-style average. One MLflow run per "
            "suite, a child run per trial. Run again, the same command continues a stopped "
            "suite. With --watch CHECKPOINTS, evaluates new checkpoints of a pre-training run "
            "as they appear and logs the average into that run."
        ),
        config="bertpipe.finetuning.evaluation.config:EvaluateConfig",
        example="'protocol.seeds=[1,2,3,4,5]' parallel=2",
        examples=[
            "bertpipe evaluate model=runs/bert-base/hf suite=glue data=glue_data",
            "bertpipe evaluate model=runs/bert-base/checkpoints/global_step20000 suite=squad "
            "data=squad 'protocol.learning_rates=[5e-5,3e-5]'",
            "bertpipe evaluate model=runs/bert-ko/hf suite=klue data=KLUE/klue_benchmark",
            "bertpipe evaluate --watch runs/bert-base/checkpoints suite=my-suite.yaml "
            "watch.every=5 'protocol.seeds=[1]' 'protocol.learning_rates=[5e-5]'",
        ],
        handler=_evaluate,
    )
    parser.add_argument(
        "--watch",
        metavar="CHECKPOINTS",
        default=None,
        help="evaluate every watch.every-th new checkpoint of this pre-training checkpoint "
        "folder (local or object storage) as it appears, logging the suite's average into "
        "the pre-training run at the checkpoint's step; ends when that run has ended",
    )


def _evaluate(args: argparse.Namespace, passthrough: list[str]) -> int:
    from bertpipe.finetuning.evaluation.config import EvaluateConfig

    cfg = config_from_args(EvaluateConfig, args)
    if cfg is None:
        return 0
    from bertpipe.training.core.cadence import PREEMPTED_EXIT_CODE, PreemptedError

    try:
        if args.watch:
            from bertpipe.finetuning.evaluation.watch import watch_checkpoints

            evaluated = watch_checkpoints(cfg, args.watch)
            sys.stdout.write(json.dumps({"evaluated": evaluated}) + "\n")
            return 0
        from bertpipe.finetuning.evaluation.runner import describe, run_suite

        result = run_suite(cfg)
    except PreemptedError:  # the trial in progress saved its checkpoint
        return PREEMPTED_EXIT_CODE
    scores = result.scores
    sys.stdout.write(scores.table(f"{scores.suite}: {result.label}", describe(cfg)))
    summary = {
        "run_id": result.run_id,
        "output": result.output,
        "suite": scores.suite,
        "model_name": result.label,
        "average": scores.average,
        "average_std": scores.average_std,
        "tasks": {
            t.task: {"score": t.mean, "std": t.std, "learning_rate": t.learning_rate}
            for t in scores.tasks
        },
        "trials_run": result.ran,
        "trials": len(result.trials),
    }
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0
