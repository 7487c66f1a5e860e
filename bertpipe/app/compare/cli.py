"""``bertpipe runs compare``: a table (and plot) of MLflow runs, with their lineage.

The logic lives beside this module (:mod:`~bertpipe.app.compare.query`, ``lineage``, ``table``,
``plot``, ``suites``); this module parses the options and prints. The run filter flags are
generated from :class:`~bertpipe.app.compare.query.CompareQuery` (:data:`COMPARE_FLAGS`).
:func:`print_comparison` and :func:`print_suites` (``--suites``) are the same things for Python
callers (``bertpipe demo``).

Example (in a terminal 96 characters wide: the constant stage and status columns are left
out, metric names take two lines, long names are cut)::

    $ bertpipe runs compare --tracking-uri sqlite:///runs/mlflow.db --experiment glue \\
          --stage finetune --sort eval/accuracy --plot cmp.png
    6 runs of experiment 'glue' at sqlite:////home/me/runs/mlflow.db (stage finetune, status
    FINISHED), sorted by eval/accuracy (descending)
                                                    eval/     eval/
          run      id        started      duration  accuracy  f1     parent     sweep     pretrain
    ----  -------  --------  -----------  --------  --------  -----  ---------  --------  ----------
    best  trial-1  3f64e0ea  03-05 00:17     2m00s      0.88      -  pretrain…  sweep-lr  pretrain-…
          ft-sst2  53979e82  03-04 23:53     3m00s      0.85      -  pretrain…  -         pretrain-…
          trial-2  4acb42b5  03-05 00:20     2m00s      0.79      -  pretrain…  sweep-lr  pretrain-…
          ft-mrpc  fd72edda  03-05 00:03     2m30s      0.74   0.82  pretrain…  -         pretrain-…
          trial-0  eb590ba4  03-05 00:14     2m00s       0.7      -  pretrain…  sweep-lr  pretrain-…
          ft-rte   7d4e7dfa  03-05 00:23     1m30s      0.66      -  ft-sst2    -         pretrain-…
    plot: /home/me/cmp.png (eval/accuracy; 6 runs)

``sweep`` (the MLflow parent of a nested run) and ``pretrain`` (the nearest pre-training
ancestor) appear only where they differ from ``parent``; ``--children-of sweep-lr`` lists
one sweep's trials.

``--suites`` shows the suite runs of ``bertpipe evaluate`` instead (stage ``evaluate``; the
same filters), one row per task and one column per suite run, each cell the task's score
x100, mean ± std over seeds (:mod:`~bertpipe.app.compare.suites`)::

    $ bertpipe runs compare --suites --experiment glue --plot suites.png
    2 suite runs (glue) of experiment 'glue' at sqlite:////home/me/runs/mlflow.db (stage
    evaluate, status FINISHED), newest first; scores x100, mean ± std over seeds
    task     bert-small  bert-base
    -------  ----------  ----------
    cola     45.0 ± 1.5  52.3 ± 1.2
    sst2     88.1 ± 0.6  91.2 ± 0.4
    mrpc              -  85.0 ± 1.0
    rte      60.2 ± 2.5  65.0 ± 2.0
    -------  ----------  ----------
    average  64.4 ± 1.1  73.4 ± 0.8
    plot: /home/me/suites.png (4 tasks and the average; 2 suite runs)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from typing import TextIO

from bertpipe import fsio
from bertpipe.app.compare.plot import plot_comparison
from bertpipe.app.compare.query import CompareQuery, RunsError, compare_runs, parse_tags
from bertpipe.app.compare.suites import SuiteTable, compare_suites, plot_suites
from bertpipe.app.compare.table import Comparison
from bertpipe.cli_args import Flag, add_dataclass_arguments, dataclass_from_args
from bertpipe.tracking import STAGES

__all__ = ["COMPARE_FLAGS", "add_runs_command", "print_comparison", "print_suites"]

COMPARE_FLAGS: dict[str, Flag] = {
    "stage": Flag(choices=STAGES),
    "tags": Flag("--tag", metavar="KEY=VALUE", parse=parse_tags),
    "children_of": Flag(metavar="RUN"),
    "max_runs": Flag(metavar="N"),
    "metrics": Flag("--metric", metavar="NAME"),
    "params": Flag("--param", metavar="NAME"),
    "sort": Flag(metavar="METRIC"),
    "ascending": Flag(
        negative="--descending",
        help="smallest first (default for metrics named like loss, perplexity, error)",
        negative_help="largest first (default for other metrics)",
    ),
}
"""How the fields of :class:`~bertpipe.app.compare.query.CompareQuery` appear as flags of
``bertpipe runs compare`` (every field is one; the rest comes from the class)."""


def add_runs_command(sub: argparse._SubParsersAction) -> None:
    """Register ``bertpipe runs`` and its ``compare`` subcommand."""
    parser = sub.add_parser(
        "runs",
        help="compare MLflow runs: table, lineage, metric plots",
        description="Inspect the MLflow runs of a project.",
    )
    actions = parser.add_subparsers(dest="runs_command", metavar="ACTION", required=True)
    compare = actions.add_parser(
        "compare",
        help="table of runs (params, final metrics, parent run), CSV/JSON, metric plots",
        description=(
            "Find the runs of one experiment (by stage, tags, status or sweep parent) and print "
            "one row per run: name, id, stage, status, start, duration, the chosen params and "
            "final metric values, and lineage (the parent run's name from "
            "bertpipe.parent_run_id or the sweep parent, and the nearest pretrain ancestor). "
            "Missing values show as '-'. With --suites, the suite runs of `bertpipe evaluate` "
            "instead: one row per task and the average, one column per suite run (headed by "
            "its model name), each cell the task's score x100 as mean ± std over seeds."
        ),
    )
    add_dataclass_arguments(
        compare.add_argument_group("which runs"),
        CompareQuery,
        COMPARE_FLAGS,
        fields=(
            "tracking_uri",
            "experiment",
            "stage",
            "tags",
            "children_of",
            "all_states",
            "max_runs",
        ),
    )
    what = compare.add_argument_group("what to show")
    add_dataclass_arguments(
        what, CompareQuery, COMPARE_FLAGS, fields=("metrics", "params", "sort", "ascending")
    )
    what.add_argument(
        "--suites",
        action="store_true",
        help="evaluation suites side by side: the suite runs of `bertpipe evaluate` (stage "
        "evaluate) as one row per task plus the average, one column per run, cells 'mean ± "
        "std' x100; with --plot, grouped bars (--metric, --param, --sort do not apply)",
    )
    what.add_argument(
        "--width",
        type=int,
        default=None,
        help="table width in characters, 0 for no limit (default: the terminal's width)",
    )
    out = compare.add_argument_group("outputs")
    out.add_argument(
        "--plot",
        metavar="OUT.png",
        default=None,
        help="write the full history of each --plot-metric, one line per run, to this image "
        "(with --suites: each task's score, one bar per suite run, std as error bars)",
    )
    out.add_argument(
        "--plot-metric",
        action="append",
        default=[],
        metavar="NAME",
        help="metric to plot, one subplot each (repeatable; default: the first shown metric, "
        "else train/loss)",
    )
    out.add_argument("--csv", metavar="OUT.csv", default=None, help="also write the table as CSV")
    out.add_argument(
        "--json", action="store_true", help="print the comparison as one JSON object instead"
    )
    compare.set_defaults(handler=_compare)


def _compare(args: argparse.Namespace, passthrough: list[str]) -> int:
    if passthrough:
        raise RunsError(f"bertpipe runs compare takes no arguments after --: {passthrough}")
    query = dataclass_from_args(CompareQuery, args, COMPARE_FLAGS)
    if args.suites:
        if args.plot_metric:
            raise RunsError("--suites plots every task's score: --plot-metric does not apply")
        print_suites(query, plot=args.plot, csv=args.csv, as_json=args.json, width=args.width)
        return 0
    print_comparison(
        query,
        plot=args.plot,
        plot_metrics=args.plot_metric,
        csv=args.csv,
        as_json=args.json,
        width=args.width,
    )
    return 0


def print_comparison(
    query: CompareQuery,
    *,
    plot: str | None = None,
    plot_metrics: Sequence[str] = (),
    csv: str | None = None,
    as_json: bool = False,
    width: int | None = None,
    stream: TextIO | None = None,
) -> Comparison:
    """Find the runs of ``query``, print their table, write the plot and CSV if asked.

    Prints a summary line, the table and where each file went; with ``as_json``, only one
    JSON object (the comparison plus ``plot`` and ``csv`` paths) on one line. ``width``
    limits the table (None: the terminal's width, no limit when not a terminal; 0: no
    limit). Returns the comparison; raises
    :class:`~bertpipe.app.compare.query.RunsError` subclasses.
    """
    stream = sys.stdout if stream is None else stream
    comparison = compare_runs(query)
    plot_path = None
    plotted: list[str] = []
    if plot is not None:
        figure = plot_comparison(comparison, plot, plot_metrics)
        plotted = [ax.get_title() for ax in figure.axes]
        plot_path = fsio.absolute(plot)
    csv_path = comparison.write_csv(csv) if csv is not None else None
    if as_json:
        payload = {**comparison.to_dict(), "plot": plot_path, "csv": csv_path}
        stream.write(json.dumps(payload) + "\n")
        return comparison
    stream.write(comparison.summary() + "\n")
    stream.write(comparison.render(_table_width(width, stream)))
    if csv_path is not None:
        stream.write(f"csv: {csv_path}\n")
    if plot_path is not None:
        n = len(comparison.rows)
        stream.write(f"plot: {plot_path} ({', '.join(plotted)}; {n} run{'s' * (n != 1)})\n")
    return comparison


def print_suites(
    query: CompareQuery,
    *,
    plot: str | None = None,
    csv: str | None = None,
    as_json: bool = False,
    width: int | None = None,
    stream: TextIO | None = None,
) -> SuiteTable:
    """Find the suite runs ``query`` selects (stage ``evaluate``), print them side by side
    (:mod:`~bertpipe.app.compare.suites`), write the plot and CSV if asked.

    Prints a summary line, the table and where each file went; with ``as_json``, only one
    JSON object (the table plus ``plot`` and ``csv`` paths) on one line. ``width`` as for
    :func:`print_comparison`. Returns the table; raises
    :class:`~bertpipe.app.compare.query.RunsError` subclasses.
    """
    stream = sys.stdout if stream is None else stream
    table = compare_suites(query)
    plot_path = None
    if plot is not None:
        plot_suites(table, plot)
        plot_path = fsio.absolute(plot)
    csv_path = table.write_csv(csv) if csv is not None else None
    if as_json:
        payload = {**table.to_dict(), "plot": plot_path, "csv": csv_path}
        stream.write(json.dumps(payload) + "\n")
        return table
    stream.write(table.summary() + "\n")
    stream.write(table.render(_table_width(width, stream)))
    if csv_path is not None:
        stream.write(f"csv: {csv_path}\n")
    if plot_path is not None:
        t, n = len(table.tasks), len(table.runs)
        stream.write(
            f"plot: {plot_path} ({t} task{'s' * (t != 1)} and the average; "
            f"{n} suite run{'s' * (n != 1)})\n"
        )
    return table


def _table_width(width: int | None, stream: TextIO) -> int | None:
    if width is not None:
        return width if width > 0 else None
    if "COLUMNS" in os.environ or (hasattr(stream, "isatty") and stream.isatty()):
        return shutil.get_terminal_size().columns
    return None
