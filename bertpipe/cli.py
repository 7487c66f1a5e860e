"""The ``bertpipe`` command line: one subcommand per stage, each reading one typed config.

Every stage command takes ``--config FILE.yaml`` and ``key.sub=value`` overrides (command
line > file > defaults), ``--print-config`` to show the resolved config and exit, and writes
the resolved config next to its outputs. ``bertpipe STAGE --help [SECTION]`` lists the config
keys, generated from the config dataclasses (:mod:`bertpipe.config_help`). Stage modules are
imported only when their command runs (or its config help is printed), so ``bertpipe --help``
is fast and a missing optional dependency only affects the commands that need it.

The global options (``--log-level``, ``--traceback``) are accepted before or after the
command: every subcommand's parser has them too, with ``SUPPRESS`` defaults so that only a
value actually given there overrides the top-level one.
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
from bertpipe.errors import BertpipeError, TransientError
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


class ConfigHelpAction(argparse.Action):
    """``-h/--help [SECTION]`` and ``--help-config [SECTION]`` of a stage command: print the
    help with the config keys of ``config`` (``"module:Class"``), or one SECTION's; the
    listing is built by :mod:`bertpipe.config_help`, imported only then."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str = argparse.SUPPRESS,
        default: object = argparse.SUPPRESS,
        help: str | None = None,
        *,
        config: str,
        example: str = "",
        examples: Sequence[str] = (),
        full: bool = True,
    ) -> None:
        super().__init__(
            option_strings, dest, nargs="?", default=default, metavar="SECTION", help=help
        )
        self.config = config
        self.example = example
        self.examples = tuple(examples)
        self.full = full

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        from bertpipe.config_help import print_config_help

        query = values if isinstance(values, str) else None
        print_config_help(parser, self.config, query, full=self.full, examples=self.examples)


def add_config_arguments(
    parser: argparse.ArgumentParser,
    config: str | None = None,
    *,
    example: str = "section.key=value",
    examples: Sequence[str] = (),
) -> None:
    """The arguments every stage command shares.

    ``config`` (``"package.module:ConfigClass"``, imported only when help is printed) makes
    ``-h/--help [SECTION]`` and ``--help-config [SECTION]`` list the config keys; the parser
    must then be created with ``add_help=False``. ``example`` is a few overrides shown in the
    KEY=VALUE help, ``examples`` whole command lines shown under "examples:" (both must load:
    tests/unit/test_cli_help.py runs them with ``--print-config``).
    """
    if config is not None:
        if parser.add_help:
            raise ValueError(f"{parser.prog}: create the parser with add_help=False")
        parser.add_argument(
            "-h",
            "--help",
            action=ConfigHelpAction,
            config=config,
            examples=examples,
            example=example,
            help="show this help, examples and every config key, and exit; "
            "with SECTION (e.g. phases, or a key), only that part",
        )
        parser.add_argument(
            "--help-config",
            action=ConfigHelpAction,
            config=config,
            full=False,
            help="list the config keys (or one SECTION's) with types, defaults and docs",
        )
    parser.add_argument(
        "-c",
        "--config",
        help="YAML config file, or the name of a shipped recipe (`bertpipe configs list`)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help=f"config overrides (command line > file > defaults), e.g. {example}",
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


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def add_global_options(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """``--log-level`` and ``--traceback``: on the top-level parser with their defaults, on
    every subcommand (``top=False``) with ``SUPPRESS`` defaults, so they work before or after
    the command and a value given after it wins."""
    group = parser if top else parser.add_argument_group("global options (also before COMMAND)")
    group.add_argument(
        "--log-level",
        default="INFO" if top else argparse.SUPPRESS,
        type=str.upper,
        choices=LOG_LEVELS,
        metavar="LEVEL",
        help="DEBUG, INFO, WARNING, ERROR or CRITICAL (default INFO)",
    )
    group.add_argument(
        "--traceback",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="show the full traceback of input errors too",
    )


def _subcommand_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every parser below ``parser`` (nested subcommands included), each once."""
    out: list[argparse.ArgumentParser] = []
    seen: set[int] = set()
    pending = [parser]
    while pending:
        current = pending.pop()
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    if id(child) not in seen:
                        seen.add(id(child))
                        out.append(child)
                        pending.append(child)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bertpipe",
        description="BERT pre-training from raw text to fine-tuned models.",
        epilog="`bertpipe COMMAND --help` shows a command's options; a stage's also lists "
        "every config key.",
    )
    parser.add_argument("--version", action="version", version=f"bertpipe {__version__}")
    add_global_options(parser, top=True)
    # the deepspeed launcher puts --local_rank=N right after the script; the rank is read
    # from the environment it also sets
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for target in COMMANDS.values():
        module, func = target.split(":")
        getattr(importlib.import_module(module), func)(sub)
    for child in _subcommand_parsers(parser):
        if "--log-level" not in child._option_string_actions:  # unless it has its own
            add_global_options(child)
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
        return 75 if isinstance(exc, TransientError) else 2  # EX_TEMPFAIL: retry the job
    except KeyboardInterrupt:
        print("bertpipe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
