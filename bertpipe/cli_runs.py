"""``bertpipe runs compare``: a table (and plot) of MLflow runs, with their lineage.

The logic lives in :mod:`bertpipe.runs`; this module parses the options and prints.
:func:`print_comparison` is the same thing for Python callers (``bertpipe demo``).

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
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from bertpipe.tracking import STAGES

if TYPE_CHECKING:
    from bertpipe.runs import CompareQuery, Comparison

__all__ = ["add_runs_command", "print_comparison"]


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
            "Missing values show as '-'."
        ),
    )
    where = compare.add_argument_group("which runs")
    where.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///runs/mlflow.db)",
    )
    where.add_argument(
        "--experiment", default="bertpipe", help="experiment name (default: bertpipe)"
    )
    where.add_argument("--stage", choices=STAGES, default=None, help="only runs of this stage")
    where.add_argument(
        "--tag",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="only runs with this tag value (repeatable), e.g. bertpipe.parent_run_id=<run id>",
    )
    where.add_argument(
        "--children-of",
        metavar="RUN",
        default=None,
        help="only the nested runs (sweep trials) of this run: a run id or a run name",
    )
    where.add_argument(
        "--all-states",
        action="store_true",
        help="include running, failed and killed runs (default: FINISHED only)",
    )
    where.add_argument(
        "--max-runs",
        type=int,
        default=100,
        metavar="N",
        help="at most N runs: the newest, or the best by --sort (default 100)",
    )
    what = compare.add_argument_group("what to show")
    what.add_argument(
        "--metric",
        action="append",
        default=[],
        metavar="NAME",
        help="metric column, final value (repeatable; globs like 'eval/*'). Default: every "
        "eval/* metric for finetune runs, best/* and eval/* for sweep runs; train/loss, "
        "eval/loss, eval/mlm_accuracy, eval/nsp_accuracy for pretrain runs",
    )
    what.add_argument(
        "--param", action="append", default=[], metavar="NAME", help="param column (repeatable)"
    )
    what.add_argument(
        "--sort",
        metavar="METRIC",
        default=None,
        help="order by this metric and mark the best run (default order: newest first)",
    )
    direction = what.add_mutually_exclusive_group()
    direction.add_argument(
        "--ascending",
        dest="ascending",
        action="store_const",
        const=True,
        default=None,
        help="smallest first (default for metrics named like loss, perplexity, error)",
    )
    direction.add_argument(
        "--descending",
        dest="ascending",
        action="store_const",
        const=False,
        help="largest first (default for other metrics)",
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
        help="write the full history of each --plot-metric, one line per run, to this image",
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
    from bertpipe.runs import CompareQuery, RunsError, parse_tags

    if passthrough:
        raise RunsError(f"bertpipe runs compare takes no arguments after --: {passthrough}")
    query = CompareQuery(
        experiment=args.experiment,
        tracking_uri=args.tracking_uri,
        stage=args.stage,
        tags=parse_tags(args.tag),
        children_of=args.children_of,
        metrics=list(args.metric),
        params=list(args.param),
        sort=args.sort,
        ascending=args.ascending,
        max_runs=args.max_runs,
        all_states=args.all_states,
    )
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
    limit). Returns the comparison; raises :class:`bertpipe.runs.RunsError` subclasses.
    """
    from bertpipe.runs import compare_runs, plot_comparison

    stream = sys.stdout if stream is None else stream
    comparison = compare_runs(query)
    plot_path = None
    plotted: list[str] = []
    if plot is not None:
        figure = plot_comparison(comparison, plot, plot_metrics)
        plotted = [ax.get_title() for ax in figure.axes]
        plot_path = plot if "://" in plot else os.path.abspath(plot)
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


def _table_width(width: int | None, stream: TextIO) -> int | None:
    if width is not None:
        return width if width > 0 else None
    if "COLUMNS" in os.environ or (hasattr(stream, "isatty") and stream.isatty()):
        return shutil.get_terminal_size().columns
    return None
