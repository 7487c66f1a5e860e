"""Evaluation suites side by side (``bertpipe runs compare --suites``).

``bertpipe evaluate`` records one MLflow **suite run** (stage ``evaluate``) per model and
suite; for each task ``T`` of the suite it logs ``T/score`` and ``T/score_std`` (the mean and
standard deviation over seeds of the task's score, fractions: SQuAD's too), and ``average`` /
``average_std`` for the suite (the contract: :mod:`bertpipe.finetuning.evaluation`).
:func:`compare_suites` finds the suite runs a
:class:`~bertpipe.app.compare.query.CompareQuery` selects (through
:func:`~bertpipe.app.compare.query.find_runs`, the search every view shares) and pivots them
into a :class:`SuiteTable`: one row per task, then the ``average`` row; one column per suite
run, newest first. The rows are the union of the runs' ``bertpipe.suite_tasks``, each run's
suite order kept: a task only some runs have sits where those runs put it, a task of another
suite comes after the tasks already listed. :meth:`SuiteTable.render` shows each cell as
``mean ± std`` x100 with one decimal (``84.3 ± 0.4``), ``-`` where a run lacks the task;
:meth:`SuiteTable.csv_text` and :meth:`SuiteTable.to_dict` hold the values as logged;
:func:`plot_suites` draws them as grouped bars.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bertpipe import fsio
from bertpipe.app.compare.plot import save_figure
from bertpipe.app.compare.query import CompareQuery, RunsError, find_runs
from bertpipe.app.compare.rows import SHORT_ID, iso_time
from bertpipe.formatting import MISSING, Column, fit_columns, render_table
from bertpipe.tracking import TAG_PARENT

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from mlflow import MlflowClient
    from mlflow.entities import Run

__all__ = [
    "AVERAGE",
    "STAGE_EVALUATE",
    "TAG_MODEL",
    "TAG_MODEL_NAME",
    "TAG_PRETRAIN_STEP",
    "TAG_SUITE",
    "TAG_SUITE_TASKS",
    "SuiteRun",
    "SuiteTable",
    "compare_suites",
    "format_score",
    "plot_suites",
    "suite_query",
    "suite_run",
]

STAGE_EVALUATE = "evaluate"
"""The ``bertpipe.stage`` of a suite run."""
TAG_SUITE = "bertpipe.suite"
"""The suite's name: ``glue``, ``squad``, ``conll`` or a YAML suite's name."""
TAG_MODEL = "bertpipe.model"
"""The model as given to ``bertpipe evaluate`` (a folder, a URL, ``models:/NAME/VERSION``)."""
TAG_MODEL_NAME = "bertpipe.model_name"
"""A short label of the model, for tables."""
TAG_SUITE_TASKS = "bertpipe.suite_tasks"
"""The suite's tasks, comma-separated, in suite order."""
TAG_PRETRAIN_STEP = "bertpipe.pretrain_step"
"""The global step of the pre-training checkpoint evaluated, where known."""
AVERAGE = "average"
"""The last row: the suite's average (metrics ``average`` and ``average_std``)."""
SCALE = 100.0
"""Scores are logged as fractions and shown x100."""
_NOT_TASK_METRICS = frozenset({"score", "score_std", "learning_rate"})


@dataclasses.dataclass
class SuiteRun:
    """One suite run: which model on which suite, and its final metric values."""

    run_id: str
    run_name: str
    status: str
    start_time: int | None
    """Milliseconds since the epoch."""
    suite: str | None
    model: str | None
    model_name: str
    """``bertpipe.model_name``, else the run's name."""
    tasks: list[str]
    """``bertpipe.suite_tasks`` in order; without the tag, the tasks with a ``T/score``."""
    metrics: dict[str, float]
    """The final value of every metric of the run."""
    parent_run_id: str | None = None
    """The pre-training run (``bertpipe.parent_run_id``), where known."""
    pretrain_step: int | None = None

    @property
    def short_id(self) -> str:
        return self.run_id[:SHORT_ID]

    def score(self, task: str) -> tuple[float | None, float | None]:
        """``(mean, std)`` of ``task``'s score (of the suite's average for :data:`AVERAGE`),
        as logged; None for a value the run lacks or that is not finite."""
        key = AVERAGE if task == AVERAGE else f"{task}/score"
        return _finite(self.metrics.get(key)), _finite(self.metrics.get(key + "_std"))

    def task_metrics(self, task: str) -> dict[str, tuple[float | None, float | None]]:
        """``{metric: (mean, std)}`` of ``task``'s own metrics (``mrpc/f1``, ...)."""
        prefix = task + "/"
        names = sorted(
            key[len(prefix) :]
            for key in self.metrics
            if key.startswith(prefix)
            and key[len(prefix) :] not in _NOT_TASK_METRICS
            and not key.endswith("_std")
        )
        return {
            name: (
                _finite(self.metrics.get(prefix + name)),
                _finite(self.metrics.get(prefix + name + "_std")),
            )
            for name in names
        }

    def record(self, heading: str) -> dict[str, Any]:
        """A JSON-ready dict of this run (values as logged; None where absent)."""
        tasks: dict[str, Any] = {}
        for task in self.tasks:
            mean, std = self.score(task)
            tasks[task] = {
                "mean": mean,
                "std": std,
                "learning_rate": _finite(self.metrics.get(f"{task}/learning_rate")),
                "metrics": {
                    name: {"mean": m, "std": s} for name, (m, s) in self.task_metrics(task).items()
                },
            }
        mean, std = self.score(AVERAGE)
        return {
            "heading": heading,
            "run_id": self.run_id,
            "run_name": self.run_name,
            "status": self.status,
            "start_time": iso_time(self.start_time),
            "suite": self.suite,
            "model": self.model,
            "model_name": self.model_name,
            "parent_run_id": self.parent_run_id,
            "pretrain_step": self.pretrain_step,
            "tasks": tasks,
            "average": {"mean": mean, "std": std},
        }


def suite_run(run: Run) -> SuiteRun:
    """The :class:`SuiteRun` of an MLflow run of stage ``evaluate``."""
    tags = run.data.tags
    metrics = {key: float(value) for key, value in run.data.metrics.items()}
    tasks = [t.strip() for t in tags.get(TAG_SUITE_TASKS, "").split(",") if t.strip()]
    if TAG_SUITE_TASKS not in tags:
        tasks = sorted(k.removesuffix("/score") for k in metrics if k.endswith("/score"))
    step = tags.get(TAG_PRETRAIN_STEP, "")
    name = run.info.run_name or tags.get("mlflow.runName") or run.info.run_id[:SHORT_ID]
    return SuiteRun(
        run_id=run.info.run_id,
        run_name=name,
        status=str(run.info.status),
        start_time=run.info.start_time,
        suite=tags.get(TAG_SUITE),
        model=tags.get(TAG_MODEL),
        model_name=tags.get(TAG_MODEL_NAME) or name,
        tasks=list(dict.fromkeys(tasks)),
        metrics=metrics,
        parent_run_id=tags.get(TAG_PARENT),
        pretrain_step=int(step) if step.isdigit() else None,
    )


def format_score(mean: float | None, std: float | None) -> str:
    """A table cell: ``84.3 ± 0.4`` for (0.843, 0.004), ``84.3`` without a std,
    :data:`~bertpipe.formatting.MISSING` without a mean."""
    if mean is None:
        return MISSING
    text = f"{mean * SCALE:.1f}"
    return text if std is None else f"{text} ± {std * SCALE:.1f}"


# --------------------------------------------------------------------------- the table


@dataclasses.dataclass
class SuiteTable:
    """The suite runs found (the columns, newest first) and where they were found."""

    experiment: str
    experiment_id: str
    tracking_uri: str
    filter: str
    """The MLflow filter string the runs were searched with."""
    description: str
    """The filter in words."""
    runs: list[SuiteRun]

    @property
    def tasks(self) -> list[str]:
        """The union of the runs' tasks, each run's order kept (see the module's docstring)."""
        return _merged([run.tasks for run in self.runs])

    @property
    def rows(self) -> list[str]:
        """The table's rows: the tasks, then :data:`AVERAGE`."""
        return [*self.tasks, AVERAGE]

    @property
    def suites(self) -> list[str]:
        """The suites of the runs, in column order, each once."""
        return list(dict.fromkeys(run.suite or MISSING for run in self.runs))

    @property
    def headings(self) -> list[str]:
        """Each column's heading: the model name; where two columns share it, the suite is
        added (``bert-base (glue)``), and the short run id where that is not enough
        (``bert-base (glue, 3f64e0ea)``)."""
        labels = [run.model_name for run in self.runs]
        for with_id in (False, True):
            counts = Counter(labels)
            labels = [
                _qualified(run, with_id) if counts[label] > 1 else label
                for run, label in zip(self.runs, labels, strict=True)
            ]
        return labels

    def summary(self) -> str:
        """One line: how many suite runs of which suites, where from, what filter."""
        n = len(self.runs)
        return (
            f"{n} suite run{'s' if n != 1 else ''} ({', '.join(self.suites)}) of experiment "
            f"'{self.experiment}' at {self.tracking_uri} ({self.description}), newest first; "
            "scores x100, mean ± std over seeds"
        )

    def render(self, width: int | None = None) -> str:
        """The table as text, fitted to ``width`` characters if given (the spaces around
        ``±`` dropped first, then long task names cut, then the widest columns); a rule sets
        the average row apart."""
        rows = self.rows
        columns = [Column("task", list(rows), name_like=True)]
        for run, heading in zip(self.runs, self.headings, strict=True):
            cells = [format_score(*run.score(row)) for row in rows]
            short = [cell.replace(" ± ", "±") for cell in cells]
            columns.append(Column(heading, cells, numeric=True, short_cells=short))
        if width is not None:
            columns = fit_columns(columns, width)
        lines = render_table(columns)
        rule = lines[max(len(c.header_lines) for c in columns)]
        lines.insert(len(lines) - 1, rule)
        return "\n".join(lines) + "\n"

    def csv_text(self) -> str:
        """The table as CSV: a ``task`` column, then ``<heading> mean`` and ``<heading> std``
        per suite run, values as logged (fractions, full precision); a missing value is an
        empty cell."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        headings = self.headings
        writer.writerow(["task", *(f"{h} {part}" for h in headings for part in ("mean", "std"))])
        for row in self.rows:
            cells = [row]
            for run in self.runs:
                cells.extend("" if value is None else repr(value) for value in run.score(row))
            writer.writerow(cells)
        return out.getvalue()

    def write_csv(self, url: str) -> str:
        """Write :meth:`csv_text` to ``url`` atomically; returns the path written."""
        url = fsio.absolute(url)
        fsio.atomic_write_text(url, self.csv_text())
        return url

    def to_dict(self) -> dict[str, Any]:
        """The table as a JSON-ready dict: the rows, and per suite run its identity, each
        task's score, metrics and chosen learning rate, and the average (as logged)."""
        return {
            "experiment": self.experiment,
            "experiment_id": self.experiment_id,
            "tracking_uri": self.tracking_uri,
            "filter": self.filter,
            "suites": self.suites,
            "tasks": self.tasks,
            "runs": [
                run.record(heading) for run, heading in zip(self.runs, self.headings, strict=True)
            ],
        }


def suite_query(query: CompareQuery) -> CompareQuery:
    """``query`` for suite runs (stage ``evaluate``); raises
    :class:`~bertpipe.app.compare.query.RunsError` for a stage or a column choice that does
    not apply to them."""
    if query.stage not in (None, STAGE_EVALUATE):
        raise RunsError(
            f"--suites shows suite runs (stage {STAGE_EVALUATE}), not stage {query.stage}"
        )
    unused = [
        flag
        for flag, given in (
            ("--metric", bool(query.metrics)),
            ("--param", bool(query.params)),
            ("--sort", query.sort is not None),
            ("--ascending/--descending", query.ascending is not None),
        )
        if given
    ]
    if unused:
        raise RunsError(
            f"--suites shows every task's score: {', '.join(unused)} "
            f"{'does' if len(unused) == 1 else 'do'} not apply"
        )
    return dataclasses.replace(query, stage=STAGE_EVALUATE)


def compare_suites(query: CompareQuery, client: MlflowClient | None = None) -> SuiteTable:
    """Find the suite runs ``query`` selects (its stage set to ``evaluate``) and pivot them.

    Raises the errors of :func:`~bertpipe.app.compare.query.find_runs` and of
    :func:`suite_query`, each with a one-line message.
    """
    query = suite_query(query)
    found = find_runs(query, client, hint="; `bertpipe evaluate` records suite runs")
    return SuiteTable(
        experiment=query.experiment,
        experiment_id=found.experiment_id,
        tracking_uri=found.tracking_uri,
        filter=found.filter,
        description=query.describe(),
        runs=[suite_run(run) for run in found.runs],
    )


# --------------------------------------------------------------------------- the plot


def plot_suites(table: SuiteTable, out: str | None = None) -> Figure:
    """Grouped bars: the tasks and the average on the x axis, one bar per suite run (its
    heading in the legend, one colour each), the score x100 as height and its standard
    deviation as error bar; no bar where a run lacks the task.

    With ``out``, the figure is written there atomically (PNG, or SVG/PDF by extension).
    Returns the matplotlib figure (Agg canvas, no display, not registered with pyplot).
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = table.rows
    n = len(table.runs)
    palette = colormaps["tab10" if n <= 10 else "tab20"]
    bar = 0.8 / n
    fig = Figure(figsize=(max(6.0, 1.5 + len(rows) * (0.3 + 0.25 * n)), 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for i, (run, heading) in enumerate(zip(table.runs, table.headings, strict=True)):
        xs, heights, errors = [], [], []
        for x, row in enumerate(rows):
            mean, std = run.score(row)
            if mean is None:
                continue
            xs.append(x - 0.4 + bar * (i + 0.5))
            heights.append(mean * SCALE)
            errors.append((std or 0.0) * SCALE)
        ax.bar(
            xs,
            heights,
            bar,
            yerr=errors,
            capsize=2,
            label=heading,
            color=palette(i % palette.N),
            error_kw={"elinewidth": 1.0},
        )
    ax.set_xticks(range(len(rows)), rows)
    if len(rows) > 1:  # the average set apart
        ax.axvline(len(rows) - 1.5, color="0.6", linestyle="--", linewidth=0.8)
    ax.axhline(0.0, color="0.3", linewidth=0.8)
    ax.set_ylabel("score x100 (mean ± std over seeds)")
    ax.set_title(", ".join(table.suites))
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize="small", loc="best", ncols=1 if n <= 6 else 2)
    import textwrap  # the filter's description is long: wrapped to the figure's width

    width = max(40, int(fig.get_figwidth() * 12))
    title = f"experiment {table.experiment}: {table.description}"
    fig.suptitle("\n".join(textwrap.wrap(title, width)), fontsize=9)
    if out is not None:
        save_figure(fig, out)
    return fig


# --------------------------------------------------------------------------- helpers


def _merged(task_lists: Sequence[Sequence[str]]) -> list[str]:
    """The union of the lists, each list's order kept: a new task goes right after the task
    before it in its own list (before the list's first known task if none; last if the list
    shares no task with the ones before it)."""
    merged: list[str] = []
    for tasks in task_lists:
        at: int | None = None  # where this list's next new task goes
        pending: list[str] = []  # new tasks before the list's first known one
        for task in tasks:
            if task in merged:
                if at is None:
                    first = merged.index(task)
                    merged[first:first] = pending
                    pending = []
                at = merged.index(task) + 1
            elif at is None:
                pending.append(task)
            else:
                merged.insert(at, task)
                at += 1
        merged.extend(pending)
    return merged


def _qualified(run: SuiteRun, with_id: bool) -> str:
    qualifier = f"{run.suite or MISSING}, {run.short_id}" if with_id else run.suite or MISSING
    return f"{run.model_name} ({qualifier})"


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
