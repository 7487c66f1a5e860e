"""``bertpipe runs compare``: MLflow runs of every stage side by side, with their lineage.

Split by concern:

* :mod:`~bertpipe.app.compare.query`: :class:`CompareQuery` (which runs, which values) and
  :func:`compare_runs`, the search of the MLflow store, with the errors it reports;
* :mod:`~bertpipe.app.compare.rows`: :class:`RunRow`, one run's identity, timing and values;
* :mod:`~bertpipe.app.compare.lineage`: each run's parent, sweep and pre-training ancestor;
* :mod:`~bertpipe.app.compare.table`: :class:`Comparison` as a fitted terminal table, CSV, JSON;
* :mod:`~bertpipe.app.compare.plot`: :func:`plot_comparison`, metric histories per run;
* :mod:`~bertpipe.app.compare.suites`: :func:`compare_suites`, the suite runs of
  ``bertpipe evaluate`` side by side (``--suites``): a :class:`SuiteTable` of each task's
  score per run as a table, CSV, JSON, and :func:`plot_suites`, grouped bars;
* :mod:`~bertpipe.app.compare.cli`: the command line, :func:`print_comparison` and
  :func:`print_suites`.

This is the application layer (it reads the runs of all stages); the tags it follows are
written by :mod:`bertpipe.tracking`, which the stages use. (The package is not called
``runs``: that is the name of the output folder, ignored by git.)
"""

from __future__ import annotations

from bertpipe.app.compare.cli import print_comparison, print_suites
from bertpipe.app.compare.plot import plot_comparison
from bertpipe.app.compare.query import (
    DEFAULT_PRETRAIN_METRICS,
    BadTagError,
    CompareQuery,
    FoundRuns,
    NoMatchingRunsError,
    RunsError,
    TrackingUnreachableError,
    UnknownExperimentError,
    UnknownMetricError,
    UnknownRunError,
    compare_runs,
    find_runs,
    lower_is_better,
    parse_tags,
)
from bertpipe.app.compare.rows import MLFLOW_PARENT_TAG, RunRow
from bertpipe.app.compare.suites import SuiteRun, SuiteTable, compare_suites, plot_suites
from bertpipe.app.compare.table import Comparison

__all__ = [
    "DEFAULT_PRETRAIN_METRICS",
    "MLFLOW_PARENT_TAG",
    "BadTagError",
    "CompareQuery",
    "Comparison",
    "FoundRuns",
    "NoMatchingRunsError",
    "RunRow",
    "RunsError",
    "SuiteRun",
    "SuiteTable",
    "TrackingUnreachableError",
    "UnknownExperimentError",
    "UnknownMetricError",
    "UnknownRunError",
    "compare_runs",
    "compare_suites",
    "find_runs",
    "lower_is_better",
    "parse_tags",
    "plot_comparison",
    "plot_suites",
    "print_comparison",
    "print_suites",
]
