"""``bertpipe bench ...``: benchmarks that print figures, the last line one JSON object.

Speed and memory targets are checked here, not in timed unit tests. Each benchmark lives
beside the code it measures; this module only wires them to the command line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

# name -> (module with add_arguments(parser) and run_bench(args) -> dict, help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "preprocess": ("preprocessing.bench", "Beam job vs the tokenizer alone, one core"),
}


def add_bench_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("bench", help="run a benchmark; prints one JSON line last")
    which = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        bench = which.add_parser(name, help=help_text, description=help_text)
        # benchmark modules import only the standard library at module level
        importlib.import_module(module).add_arguments(bench)
        bench.set_defaults(handler=_run, bench_module=module)


def _run(args: argparse.Namespace, passthrough: list[str]) -> int:
    result = importlib.import_module(args.bench_module).run_bench(args)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0
