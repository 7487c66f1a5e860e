"""``bertpipe bench ...``: every benchmark, in one package; each prints figures, the last
line one JSON object.

Speed and memory targets are checked here, not in timed unit tests. One module per
benchmark (``preprocess`` and ``preprocess_scale``, ``sentences``, ``model``, ``loader``,
``train``, ``memory`` with ``memory_tally``, ``evaluate``, ``recipes``), each with
``add_arguments(parser)`` and ``run_bench(args) -> dict``; :data:`BENCHMARKS` names them for
the command line (a module is imported only when its benchmark runs).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

# name -> (module with add_arguments(parser) and run_bench(args) -> dict, help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "preprocess": (
        "bertpipe.app.bench.preprocess",
        "Beam job vs tokenizer, one core; --scale-mb N: MB/s, memory",
    ),
    "sentences": (
        "bertpipe.app.bench.sentences",
        "sentence splitting per language: MB/s, sentence endings found (--preprocess: the job)",
    ),
    "model": ("bertpipe.app.bench.model", "forward+backward, ours vs transformers', CPU"),
    "loader": ("bertpipe.app.bench.loader", "pre-training loader: collated instances/s"),
    "train": ("bertpipe.app.bench.train", "real trainer path steps: seq/s, MFU"),
    "evaluate": (
        "bertpipe.app.bench.evaluate",
        "a GLUE suite under the protocol: seconds per task and per trial",
    ),
    "memory": (
        "bertpipe.app.bench.memory",
        "model states and activations per rank on N CPU ranks vs bertpipe plan",
    ),
    "recipes": (
        "bertpipe.app.bench.recipes",
        "the paper's recipe vs the modern one at equal tokens and time: MLM, downstream",
    ),
    "language": ("bertpipe.app.bench.language", "pre-trained vs random init in Korean"),
}


def add_bench_command(sub: argparse._SubParsersAction) -> None:
    listing = "\n".join(f"  {name:12s} {help_text}" for name, (_, help_text) in BENCHMARKS.items())
    parser = sub.add_parser(
        "bench",
        help="run a benchmark; prints one JSON line last",
        description=f"benchmarks:\n{listing}\n\n`bertpipe bench NAME --help` lists its options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS), metavar="NAME")
    # a benchmark's own options; its module (which may import torch) is loaded only to run it
    parser.add_argument("options", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace, passthrough: list[str]) -> int:
    from bertpipe.cli_args import add_global_options
    from bertpipe.logs import setup_logging

    module = importlib.import_module(BENCHMARKS[args.benchmark][0])
    parser = argparse.ArgumentParser(prog=f"bertpipe bench {args.benchmark}")
    module.add_arguments(parser)
    # after NAME every argument is the benchmark's, so the global options are parsed here
    add_global_options(parser)
    options = parser.parse_args(args.options)
    if "log_level" in vars(options):
        setup_logging(options.log_level)
    args.traceback = vars(options).get("traceback", args.traceback)
    result = module.run_bench(options)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0
