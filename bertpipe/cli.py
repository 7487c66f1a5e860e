"""The ``bertpipe`` command line: one subcommand per stage, each reading one typed config.

Every stage command takes ``--config FILE.yaml`` and ``key.sub=value`` overrides (command
line > file > defaults), ``--print-config`` to show the resolved config and exit, and writes
the resolved config next to its outputs. Stage modules are imported only when their command
runs, so ``bertpipe --help`` is fast and a missing optional dependency only affects the
commands that need it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import TypeVar

from bertpipe import __version__, fsio
from bertpipe.config import load_config, to_yaml
from bertpipe.errors import BertpipeError
from bertpipe.logs import setup_logging

log = logging.getLogger("bertpipe")
T = TypeVar("T")

# command -> "module:function" that adds its parser (imported when the parser is built;
# these modules import nothing heavy at module level)
COMMANDS: dict[str, str] = {
    "tokenizer": "bertpipe.preprocessing.cli:add_tokenizer_command",
    "preprocess": "bertpipe.preprocessing.cli:add_preprocess_command",
    "pretrain": "bertpipe.training.cli:add_pretrain_command",
    "export": "bertpipe.training.cli:add_export_command",
    "finetune": "bertpipe.finetuning.cli:add_finetune_command",
    "sweep": "bertpipe.finetuning.cli:add_sweep_command",
    "bench": "bertpipe.bench:add_bench_command",
    "demo": "bertpipe.demo:add_demo_command",
    "plan": "bertpipe.training.cli_plan:add_plan_command",
    "runs": "bertpipe.cli_runs:add_runs_command",
    "configs": "bertpipe.recipes:add_configs_command",
}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every stage command shares."""
    parser.add_argument(
        "-c",
        "--config",
        help="YAML config file, or the name of a shipped recipe (`bertpipe configs list`)",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. dupe_factor=10"
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config as YAML and exit"
    )


def config_from_args(cls: type[T], args: argparse.Namespace, extra: Sequence[str] = ()) -> T | None:
    """Load the stage config from ``--config`` and overrides; None after ``--print-config``."""
    cfg = load_config(cls, args.config, [*extra, *args.overrides])
    if args.print_config:
        sys.stdout.write(to_yaml(cfg))
        return None
    return cfg


def write_resolved_config(cfg: object, folder: str, name: str = "config.yaml") -> str:
    """Write the resolved config next to a stage's outputs; returns its URL."""
    url = fsio.join(folder, name)
    fsio.atomic_write_text(url, to_yaml(cfg))
    return url


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bertpipe",
        description="BERT pre-training from raw text to fine-tuned models.",
    )
    parser.add_argument("--version", action="version", version=f"bertpipe {__version__}")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    parser.add_argument(
        "--traceback", action="store_true", help="show the full traceback of input errors too"
    )
    # the deepspeed launcher puts --local_rank=N right after the script; the rank is read
    # from the environment it also sets
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for target in COMMANDS.values():
        module, func = target.split(":")
        getattr(importlib.import_module(module), func)(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``bertpipe``; arguments after ``--`` are passed through (to Beam, for preprocess)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in args_list:
        cut = args_list.index("--")
        args_list, passthrough = args_list[:cut], args_list[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(args_list)
    setup_logging(args.log_level)
    try:
        return int(args.handler(args, passthrough) or 0)
    except (BertpipeError, FileNotFoundError, FileExistsError) as exc:
        if args.traceback:
            raise
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"bertpipe: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bertpipe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
