"""``bertpipe pretrain`` and ``bertpipe export`` (parsers and handlers; work is elsewhere).

``bertpipe pretrain`` is what the ``deepspeed`` launcher runs on every rank::

    bertpipe plan --config configs/pretrain-bert-large.yaml --nodes 4 --gpus-per-node 8
    deepspeed --hostfile hostfile $(which bertpipe) pretrain \
        --config configs/pretrain-bert-large.yaml

(``bertpipe plan`` checks the config for that world size without starting anything.) The
launcher's ``--local_rank`` argument is accepted and ignored: the rank comes from the
environment it sets.
"""

from __future__ import annotations

import argparse
import json
import sys

from bertpipe.cli import add_config_arguments, config_from_args


def add_pretrain_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "pretrain",
        help="pre-train BERT with DeepSpeed (run it under the deepspeed launcher for >1 process)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_arguments(parser)
    parser.set_defaults(handler=_pretrain)


def _pretrain(args: argparse.Namespace, passthrough: list[str]) -> int:
    from bertpipe.training.config import PretrainConfig
    from bertpipe.training.trainer import PREEMPTED_EXIT_CODE, PreemptedError, run_pretraining

    cfg = config_from_args(PretrainConfig, args)
    if cfg is None:
        return 0
    try:
        summary = run_pretraining(cfg)
    except PreemptedError:
        return PREEMPTED_EXIT_CODE
    finally:
        _leave_process_group()
    if summary:
        sys.stdout.write(json.dumps(summary) + "\n")
    return 0


def _leave_process_group() -> None:
    """Shut the process group down before the interpreter exits: left to exit-time
    destructors, gloo's threads sometimes abort the process ("terminate called without an
    active exception") after the work is done."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def add_export_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "export",
        help="write a pre-training checkpoint as a transformers BERT folder (with tokenizer)",
    )
    parser.add_argument("checkpoint_dir", help="the run's checkpoint folder")
    parser.add_argument("out", help="folder to write")
    parser.add_argument("--tag", help="checkpoint tag (default: latest)")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the data's)")
    parser.set_defaults(handler=_export)


def _export(args: argparse.Namespace, passthrough: list[str]) -> int:
    from bertpipe.training.export import export_checkpoint

    info = export_checkpoint(args.checkpoint_dir, args.out, tag=args.tag, tokenizer=args.tokenizer)
    sys.stdout.write(json.dumps(info) + "\n")
    return 0
