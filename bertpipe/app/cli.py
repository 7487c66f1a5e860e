"""The ``bertpipe`` command line: one subcommand per stage, each reading one typed config.

Every stage command takes ``--config FILE.yaml`` and ``key.sub=value`` overrides (command
line > file > defaults), ``--print-config`` to show the resolved config and exit, and writes
the resolved config next to its outputs. ``bertpipe STAGE --help [SECTION]`` lists the config
keys, generated from the config dataclasses (:mod:`bertpipe.config_help`). Stage modules are
imported only when their command runs (or its config help is printed), so ``bertpipe --help``
is fast and a missing optional dependency only affects the commands that need it. The
arguments the commands share are built by :mod:`bertpipe.cli_args`.

The global options (``--log-level``, ``--traceback``) are accepted before or after the
command: every subcommand's parser has them too, with ``SUPPRESS`` defaults so that only a
value actually given there overrides the top-level one.

Without installing the console script: ``python -m bertpipe.app.cli COMMAND ...``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from bertpipe import __version__
from bertpipe.cli_args import add_global_options
from bertpipe.errors import TERMINATED_EXIT_CODE, BertpipeError, Terminated, TransientError
from bertpipe.logs import setup_logging

__all__ = ["COMMANDS", "build_parser", "main"]

# command -> "module:function" that adds its parser (imported when the parser is built;
# these modules import nothing heavy at module level)
COMMANDS: dict[str, str] = {
    "tokenizer": "bertpipe.preprocessing.cli:add_tokenizer_command",
    "preprocess": "bertpipe.preprocessing.cli:add_preprocess_command",
    "pretrain": "bertpipe.training.cli:add_pretrain_command",
    "export": "bertpipe.training.cli:add_export_command",
    "finetune": "bertpipe.finetuning.cli:add_finetune_command",
    "sweep": "bertpipe.finetuning.cli:add_sweep_command",
    "evaluate": "bertpipe.finetuning.evaluation.cli:add_evaluate_command",
    "bench": "bertpipe.app.bench:add_bench_command",
    "demo": "bertpipe.app.demo:add_demo_command",
    "plan": "bertpipe.training.plan.cli:add_plan_command",
    "runs": "bertpipe.app.compare.cli:add_runs_command",
    "configs": "bertpipe.recipes:add_configs_command",
}


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
    """The ``bertpipe`` parser with every command of :data:`COMMANDS`."""
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
    return exit_status(lambda: args.handler(args, passthrough), show_traceback=args.traceback)


def exit_status(run: Callable[[], int | None], show_traceback: bool = False) -> int:
    """``run()``'s exit status as the command line gives it: bad input one line and 2 (74 a
    full disk, 75 what a rerun may fix), SIGTERM 143, Ctrl-C 130; a bug keeps its traceback
    (every error does with ``show_traceback``)."""
    try:
        return int(run() or 0)
    except Exception as exc:
        from bertpipe.storage_check import describe  # storage refusals s3fs raised raw

        shown = describe(exc) if not isinstance(exc, BertpipeError) else None
        if show_traceback or (
            shown is None
            and not isinstance(exc, (BertpipeError, FileNotFoundError, FileExistsError))
        ):
            raise
        exc = shown or exc
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"bertpipe: error: {message}", file=sys.stderr)
        if isinstance(exc, TransientError):
            return 75  # EX_TEMPFAIL: retry the job
        return int(getattr(exc, "exit_code", 2))  # 74: a full disk
    except Terminated:
        print("bertpipe: terminated (SIGTERM)", file=sys.stderr)
        return TERMINATED_EXIT_CODE
    except KeyboardInterrupt:
        print("bertpipe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
