"""``bertpipe pretrain`` and ``bertpipe export`` (parsers and handlers; work is elsewhere).

``bertpipe pretrain`` is what the ``deepspeed`` launcher runs on every rank, e.g. with the
shipped BERT-Large recipe (``configs/pretrain-bert-large-lamb.yaml``, ``bert-large-lamb``)::

    bertpipe plan --config bert-large-lamb --nodes 4 --gpus-per-node 8 --gpu h100
    deepspeed --hostfile hostfile $(which bertpipe) pretrain --config bert-large-lamb

(``bertpipe plan`` checks the config for that world size without starting anything.) The
launcher's ``--local_rank`` argument is accepted and ignored: the rank comes from the
environment it sets.
"""

from __future__ import annotations

import argparse
import json
import sys

from bertpipe.cli_args import add_stage_command, config_from_args
from bertpipe.storage_check import preflight

PRETRAIN_DESCRIPTION = """\
Pre-trains BERT with DeepSpeed from one config: the model, one or two phases (data, batch,
steps, learning-rate schedule), optimizer, ZeRO stage, precision, checkpoints and MLflow
tracking. --config takes a YAML file or a shipped recipe (`bertpipe configs list`:
bert-base-adamw, bert-large-lamb, demo); KEY=VALUE overrides follow.

One process runs it directly. For several GPUs or nodes, run it under the deepspeed launcher,
which starts it on every rank; check the config for that world size first (batch arithmetic,
memory, time), which starts nothing:

    bertpipe plan --config bert-large-lamb --nodes 4 --gpus-per-node 8 --gpu h100
    deepspeed --hostfile hostfile $(which bertpipe) pretrain --config bert-large-lamb

A run resumes from its latest checkpoint by default (checkpoint.resume=auto)."""


def add_pretrain_command(sub: argparse._SubParsersAction) -> None:
    add_stage_command(
        sub,
        "pretrain",
        help="pre-train BERT with DeepSpeed (run it under the deepspeed launcher for >1 process)",
        description=PRETRAIN_DESCRIPTION,
        raw_description=True,
        config="bertpipe.training.pretrain.config:PretrainConfig",
        example="zero.stage=2 'phases[0].max_steps=500'",
        examples=[
            "bertpipe pretrain --config demo output=runs/try1  # one process, no launcher",
            "bertpipe pretrain --config bert-base-adamw zero.stage=2 "
            "'phases[0].micro_batch_size=16'",
            "bertpipe pretrain --config bert-large-lamb checkpoint.resume=global_step1000",
        ],
        handler=_pretrain,
    )


def _pretrain(args: argparse.Namespace, passthrough: list[str]) -> int:
    from bertpipe.training.pretrain.config import PretrainConfig

    cfg = config_from_args(PretrainConfig, args)
    if cfg is None:  # --print-config and the like: no torch to import (infra scripts use it)
        return 0
    from bertpipe import tracking

    reads = [(f"phases[{i}].data", p.data) for i, p in enumerate(cfg.phases)]
    if cfg.model.init_from:
        reads.append(("model.init_from", cfg.model.init_from))
    preflight(reads, [("output", cfg.output), ("checkpoint.dir", cfg.checkpoint_dir)])
    tracking.check_new_run(cfg.tracking, cfg.checkpoint_dir)  # before torch and DeepSpeed
    import torch.distributed as dist

    from bertpipe.training.pretrain.trainer import (
        PREEMPTED_EXIT_CODE,
        PreemptedError,
        run_pretraining,
    )

    owned = not dist.is_initialized()  # a group this command forms is this command's to end
    together = False  # all ranks got here together: safe to meet at a barrier
    try:
        summary = run_pretraining(cfg)
        together = True
    except PreemptedError:  # the stop was agreed by all ranks
        together = True
        return PREEMPTED_EXIT_CODE
    finally:
        if owned:
            _leave_process_group(barrier=together)
    if summary:
        sys.stdout.write(json.dumps(summary) + "\n")
    return 0


def _leave_process_group(barrier: bool) -> None:
    """End the process group this command formed, at interpreter exit: left to exit-time
    destructors, gloo's threads sometimes abort the process ("terminate called without an
    active exception") after the work is done. The ranks meet at a barrier first when they
    got here together (not after an error on this rank: the others may never reach it). At
    exit rather than now, so that an in-process caller (tests) keeps a group DeepSpeed's
    cached groups still point at."""
    import atexit

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if barrier:
        dist.barrier()

    def destroy() -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(destroy)


def add_export_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "export",
        help="write a pre-training checkpoint as a transformers BERT folder (with tokenizer)",
    )
    parser.add_argument("checkpoint_dir", help="the run's checkpoint folder")
    parser.add_argument("out", help="folder to write")
    parser.add_argument("--tag", help="checkpoint tag (default: latest)")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the data's)")
    parser.add_argument(
        "--register",
        metavar="NAME",
        help="also register the model (BertForPreTraining, MLflow's transformers flavour, "
        "safetensors weights) as a new version of NAME in the MLflow model registry; it is "
        "logged to the pre-training run whether registered or not",
    )
    parser.add_argument(
        "--tracking-uri",
        metavar="URI",
        help="MLflow tracking URI of the pre-training run, where the export is recorded "
        "(default: the checkpoint config's tracking.uri, else $MLFLOW_TRACKING_URI)",
    )
    parser.add_argument(
        "--no-tracking",
        action="store_true",
        help="do not record the export in the pre-training's MLflow run",
    )
    parser.set_defaults(handler=_export)


def _export(args: argparse.Namespace, passthrough: list[str]) -> int:
    from bertpipe.training.export import export_checkpoint

    preflight([("checkpoint_dir", args.checkpoint_dir)], [("out", args.out)])
    info = export_checkpoint(
        args.checkpoint_dir,
        args.out,
        tag=args.tag,
        tokenizer=args.tokenizer,
        tracking_uri=args.tracking_uri,
        register=args.register,
        track=not args.no_tracking,
    )
    sys.stdout.write(json.dumps(info) + "\n")
    return 0
