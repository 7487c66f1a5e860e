"""Compare MLflow runs: find them, build a table with lineage, plot metric histories.

This is the logic behind ``bertpipe runs compare``; it prints nothing (the command line in
:mod:`bertpipe.cli_runs` does). :func:`compare_runs` searches one experiment for runs (by
stage, tags, status or sweep parent) and returns a :class:`Comparison`: one row per run
with its chosen params, final metric values and lineage (the parent run from the
``bertpipe.parent_run_id`` tag, else MLflow's nested-run parent; the sweep a trial is
nested in; the nearest pre-training ancestor), renderable as a terminal table, CSV or JSON.
:func:`plot_comparison` draws the full history of chosen metrics, one line per run.

The tracking URI always goes through :class:`~bertpipe.tracking.TrackingConfig` (never
MLflow's working-directory-dependent default), and a store that does not exist or does not
answer is reported as :class:`TrackingUnreachableError` instead of being created or retried
for minutes. MLflow and matplotlib are imported only when a function needs them.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import fnmatch
import io
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from bertpipe import fsio
from bertpipe.errors import BertpipeError
from bertpipe.tracking import STAGES, TAG_DATA_CHECKSUM, TAG_PARENT, TAG_STAGE, TrackingConfig

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from mlflow import MlflowClient
    from mlflow.entities import Run

__all__ = [
    "DEFAULT_PRETRAIN_METRICS",
    "MISSING",
    "BadTagError",
    "CompareQuery",
    "Comparison",
    "NoMatchingRunsError",
    "RunRow",
    "RunsError",
    "TrackingUnreachableError",
    "UnknownExperimentError",
    "UnknownMetricError",
    "UnknownRunError",
    "compare_runs",
    "format_duration",
    "format_number",
    "lower_is_better",
    "parse_tags",
    "plot_comparison",
]

MLFLOW_PARENT_TAG = "mlflow.parentRunId"
"""MLflow's own tag on a nested run (a sweep trial) naming its parent run."""
DEFAULT_PRETRAIN_METRICS = ("train/loss", "eval/loss", "eval/mlm_accuracy", "eval/nsp_accuracy")
"""Metrics shown for pre-training runs when none are chosen."""
MISSING = "-"
"""What the table shows for a value a run does not have."""
MAX_RUNS_LIMIT = 50_000
"""MLflow's largest page of a run search."""
_LINEAGE_DEPTH = 10
_SHORT_ID = 8
_MIN_WIDTH = 6
_NAME_WIDTH = 10
_GAP = "  "
_LOWER_IS_BETTER = frozenset(
    {"loss", "perplexity", "ppl", "error", "err", "mse", "mae", "rmse", "wer", "cer"}
)


# --------------------------------------------------------------------------- errors


class RunsError(BertpipeError):
    """A run comparison cannot be made; the message says why and what to do."""


class BadTagError(RunsError, ValueError):
    """A ``--tag`` filter is not ``KEY=VALUE`` or cannot be expressed as an MLflow filter."""


class UnknownExperimentError(RunsError):
    """The experiment does not exist in the store."""


class NoMatchingRunsError(RunsError):
    """No run of the experiment matches the filter."""


class UnknownRunError(RunsError):
    """A run named by id or name (``--children-of``) does not exist."""


class UnknownMetricError(RunsError):
    """A metric to sort by or to plot is logged by none of the runs."""


class TrackingUnreachableError(RunsError):
    """The tracking store does not exist or the tracking server does not answer."""


# --------------------------------------------------------------------------- the query


@dataclasses.dataclass
class CompareQuery:
    """Which runs to compare and which of their values to show."""

    experiment: str = "bertpipe"
    """Experiment name (one per project)."""
    tracking_uri: str | None = None
    """Tracking URI; None means $MLFLOW_TRACKING_URI, else ``sqlite:///runs/mlflow.db``
    (resolved by :class:`~bertpipe.tracking.TrackingConfig`)."""
    stage: str | None = None
    """Only runs whose ``bertpipe.stage`` tag is this stage."""
    tags: dict[str, str] = dataclasses.field(default_factory=dict)
    """Only runs with each of these tag values (exact match)."""
    children_of: str | None = None
    """Only the nested runs (sweep trials) of this run: a run id or a run name."""
    metrics: list[str] = dataclasses.field(default_factory=list)
    """Metric columns (final values); ``*`` globs match the logged names. Empty: the stage's
    defaults (every ``eval/*`` metric for finetune runs, ``best/*`` and ``eval/*`` for sweep
    runs, the pre-training losses and accuracies for pretrain runs, every metric for the
    other stages)."""
    params: list[str] = dataclasses.field(default_factory=list)
    """Param columns; ``*`` globs match the logged names."""
    sort: str | None = None
    """Metric to order the rows by (runs without it last); its best row is marked."""
    ascending: bool | None = None
    """Sort direction; None: ascending for metrics where lower is better (names with loss,
    perplexity, error, ...), else descending."""
    max_runs: int = 100
    """At most this many runs (the newest, or the best by ``sort``)."""
    all_states: bool = False
    """Include RUNNING, FAILED and KILLED runs, not only FINISHED ones."""

    def __post_init__(self) -> None:
        if self.stage is not None and self.stage not in STAGES:
            raise RunsError(f"unknown stage {self.stage!r}; stages: {', '.join(STAGES)}")
        if not 1 <= self.max_runs <= MAX_RUNS_LIMIT:
            raise RunsError(f"max runs must be between 1 and {MAX_RUNS_LIMIT}, got {self.max_runs}")
        if not self.experiment.strip():
            raise RunsError("the experiment name must not be empty")
        for name in [*self.metrics, *([self.sort] if self.sort else [])]:
            if "`" in name:
                raise RunsError(f"invalid metric name {name!r}: backticks are not allowed")

    @property
    def sort_ascending(self) -> bool:
        """The direction rows are sorted in (meaningful when ``sort`` is set)."""
        if self.ascending is not None:
            return self.ascending
        return self.sort is not None and lower_is_better(self.sort)

    def resolved_uri(self) -> str:
        """The absolute tracking URI (see :meth:`TrackingConfig.resolved_uri`)."""
        return TrackingConfig(uri=self.tracking_uri, experiment=self.experiment).resolved_uri()

    def filter_string(self, parent_run_id: str | None = None) -> str:
        """The MLflow search filter; ``parent_run_id`` is the resolved ``children_of`` run."""
        clauses = []
        if self.stage is not None:
            clauses.append(_tag_clause(TAG_STAGE, self.stage))
        for key, value in self.tags.items():
            clauses.append(_tag_clause(key, value))
        if parent_run_id is not None:
            clauses.append(_tag_clause(MLFLOW_PARENT_TAG, parent_run_id))
        if not self.all_states:
            clauses.append("attributes.status = 'FINISHED'")
        return " AND ".join(clauses)

    def describe(self) -> str:
        """The filter in words, for messages (``stage finetune, tag a=b, FINISHED``)."""
        parts = []
        if self.stage is not None:
            parts.append(f"stage {self.stage}")
        parts.extend(f"tag {key}={value}" for key, value in self.tags.items())
        if self.children_of is not None:
            parts.append(f"children of run {self.children_of}")
        parts.append("any status" if self.all_states else "status FINISHED")
        return ", ".join(parts)


def parse_tags(items: Iterable[str]) -> dict[str, str]:
    """``["k=v", ...]`` -> ``{"k": "v"}``; raises :class:`BadTagError` for anything else."""
    tags: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise BadTagError(f"bad --tag {item!r}: it must look like KEY=VALUE")
        if "`" in key:
            raise BadTagError(f"bad --tag {item!r}: a tag key cannot hold a backtick")
        if "'" in value and '"' in value:
            raise BadTagError(f"bad --tag {item!r}: a value cannot hold both ' and \" quotes")
        tags[key] = value
    return tags


def lower_is_better(metric: str) -> bool:
    """Whether smaller values of ``metric`` are better (losses, perplexities, errors)."""
    words = re.split(r"[^a-z0-9]+", metric.rsplit("/", 1)[-1].lower())
    return any(word in _LOWER_IS_BETTER for word in words)


# --------------------------------------------------------------------------- rows


@dataclasses.dataclass
class RunRow:
    """One run: identity, timing, chosen values and lineage."""

    run_id: str
    name: str
    stage: str | None
    status: str
    start_time: int | None
    """Milliseconds since the epoch."""
    end_time: int | None
    """Milliseconds since the epoch; None while running."""
    params: dict[str, str]
    """Every param of the run."""
    metrics: dict[str, float]
    """The final (latest step) value of every metric of the run."""
    parent_run_id: str | None = None
    """``bertpipe.parent_run_id``, else MLflow's nested-run parent."""
    parent_name: str | None = None
    """The parent's run name, when the parent could be looked up."""
    nested_in_run_id: str | None = None
    """MLflow's parent of a nested run (``mlflow.parentRunId``): the sweep of a trial."""
    nested_in_name: str | None = None
    pretrain_run_id: str | None = None
    """The nearest ancestor whose stage is ``pretrain``."""
    pretrain_name: str | None = None
    data_checksums: dict[str, str] = dataclasses.field(default_factory=dict)
    """Data manifest checksum per phase, the run's own or its nearest ancestor's."""
    best: bool = False
    """Whether this row has the best value of the sort metric."""

    @property
    def short_id(self) -> str:
        return self.run_id[:_SHORT_ID]

    @property
    def duration_s(self) -> float | None:
        """Wall time of a finished run in seconds; None while it runs."""
        if self.start_time is None or self.end_time is None:
            return None
        return max(0.0, (self.end_time - self.start_time) / 1000.0)

    def record(self, metrics: Sequence[str], params: Sequence[str]) -> dict[str, Any]:
        """A JSON-ready dict of this row (non-finite metric values become None)."""
        return {
            "best": self.best,
            "run_name": self.name,
            "run_id": self.run_id,
            "stage": self.stage,
            "status": self.status,
            "start_time": _iso(self.start_time),
            "end_time": _iso(self.end_time),
            "duration_s": self.duration_s,
            "params": {p: self.params.get(p) for p in params},
            "metrics": {m: _finite_or_none(self.metrics.get(m)) for m in metrics},
            "parent_run_id": self.parent_run_id,
            "parent_run_name": self.parent_name,
            "nested_in_run_id": self.nested_in_run_id,
            "nested_in_run_name": self.nested_in_name,
            "pretrain_run_id": self.pretrain_run_id,
            "pretrain_run_name": self.pretrain_name,
            "data_manifest_sha256": dict(self.data_checksums),
        }


@dataclasses.dataclass
class _Column:
    """One table column; the fitting steps may change its header lines, cells and width."""

    header: str
    cells: list[str]
    numeric: bool = False
    shrinkable: bool = True
    drop_if_constant: bool = False
    """May be left out to fit the width when every row has the same value."""
    optional: bool = False
    """May be left out to fit the width once names are cut."""
    name_like: bool = False
    """Names and param values: cut before the other columns."""
    short_cells: list[str] | None = None
    """A narrower form of the cells, used to fit the width."""
    header_lines: list[str] = dataclasses.field(default_factory=list)
    width: int = 0

    def __post_init__(self) -> None:
        self.header_lines = self.header_lines or [self.header]
        self.width = self.width or self.natural_width()

    def natural_width(self) -> int:
        return max(len(text) for text in [*self.header_lines, *self.cells])


@dataclasses.dataclass
class Comparison:
    """The runs found, in display order, and the columns chosen for them."""

    experiment: str
    experiment_id: str
    tracking_uri: str
    filter: str
    """The MLflow filter string the runs were searched with."""
    description: str
    """The filter in words."""
    rows: list[RunRow]
    metrics: list[str]
    params: list[str]
    sort: str | None = None
    ascending: bool = False

    @property
    def best(self) -> RunRow | None:
        """The first row marked best (None without a sort metric or values)."""
        return next((row for row in self.rows if row.best), None)

    def summary(self) -> str:
        """One line: how many runs, where from, what filter, what order."""
        order = (
            f"sorted by {self.sort} ({'ascending' if self.ascending else 'descending'})"
            if self.sort
            else "newest first"
        )
        n = len(self.rows)
        return (
            f"{n} run{'s' if n != 1 else ''} of experiment '{self.experiment}' at "
            f"{self.tracking_uri} ({self.description}), {order}"
        )

    def render(self, width: int | None = None) -> str:
        """The table as text, fitted to ``width`` characters if given.

        To fit, in this order: columns whose rows all hold the same value (stage, status)
        are left out, start times lose their year, metric names are split over two header
        lines at their last ``/``, and the widest columns are cut (ending in ``…``); run ids
        are never cut. If it still does not fit, the terminal wraps the lines.
        """
        columns = self._columns()
        if width is not None:
            columns = _fit(columns, width)
        depth = max(len(c.header_lines) for c in columns)
        lines = []
        for level in range(depth):
            parts = []
            for c in columns:
                pad = depth - len(c.header_lines)  # short headers sit on the bottom line
                text = c.header_lines[level - pad] if level >= pad else ""
                parts.append(_cut(text, c.width).ljust(c.width))
            lines.append(_GAP.join(parts).rstrip())
        lines.append(_GAP.join("-" * c.width for c in columns))
        for i in range(len(self.rows)):
            cells = []
            for c in columns:
                text = _cut(c.cells[i], c.width)
                cells.append(text.rjust(c.width) if c.numeric else text.ljust(c.width))
            lines.append(_GAP.join(cells).rstrip())
        return "\n".join(lines) + "\n"

    def csv_text(self) -> str:
        """The table as CSV: full run ids, ISO times, ``params.X`` and ``metrics.X`` columns
        (MLflow's naming), full-precision values; a missing value is an empty cell."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(
            [
                "best",
                "run_name",
                "run_id",
                "stage",
                "status",
                "start_time",
                "end_time",
                "duration_s",
                *(f"params.{p}" for p in self.params),
                *(f"metrics.{m}" for m in self.metrics),
                "parent_run_id",
                "parent_run_name",
                "nested_in_run_id",
                "nested_in_run_name",
                "pretrain_run_id",
                "pretrain_run_name",
            ]
        )
        for row in self.rows:
            record = row.record(self.metrics, self.params)
            writer.writerow(
                [
                    "best" if row.best else "",
                    row.name,
                    row.run_id,
                    row.stage or "",
                    row.status,
                    record["start_time"] or "",
                    record["end_time"] or "",
                    "" if row.duration_s is None else f"{row.duration_s:.3f}",
                    *(row.params.get(p, "") for p in self.params),
                    *("" if m not in row.metrics else repr(row.metrics[m]) for m in self.metrics),
                    row.parent_run_id or "",
                    row.parent_name or "",
                    row.nested_in_run_id or "",
                    row.nested_in_name or "",
                    row.pretrain_run_id or "",
                    row.pretrain_name or "",
                ]
            )
        return out.getvalue()

    def write_csv(self, url: str) -> str:
        """Write :meth:`csv_text` to ``url`` atomically; returns the path written."""
        url = _absolute(url)
        fsio.atomic_write_text(url, self.csv_text())
        return url

    def to_dict(self) -> dict[str, Any]:
        """The comparison as a JSON-ready dict."""
        return {
            "experiment": self.experiment,
            "experiment_id": self.experiment_id,
            "tracking_uri": self.tracking_uri,
            "filter": self.filter,
            "sort": self.sort,
            "ascending": self.ascending if self.sort else None,
            "metrics": list(self.metrics),
            "params": list(self.params),
            "best_run_id": self.best.run_id if self.best else None,
            "runs": [row.record(self.metrics, self.params) for row in self.rows],
        }

    def _columns(self) -> list[_Column]:
        rows = self.rows
        parent_names = _disambiguated(rows)
        columns: list[_Column] = []
        if self.sort:
            columns.append(_Column("", ["best" if r.best else "" for r in rows], shrinkable=False))
        columns += [
            _Column("run", [r.name for r in rows], name_like=True),
            _Column("id", [r.short_id for r in rows], shrinkable=False),
            _Column("stage", [r.stage or MISSING for r in rows], drop_if_constant=True),
            _Column("status", [r.status for r in rows], drop_if_constant=True),
            _Column(
                "started",
                [_local_time(r.start_time) for r in rows],
                short_cells=[_local_time(r.start_time, year=False) for r in rows],
                optional=True,
            ),
            _Column("duration", [format_duration(r.duration_s) for r in rows], numeric=True),
        ]
        for p in self.params:
            columns.append(_Column(p, [r.params.get(p, MISSING) for r in rows], name_like=True))
        for m in self.metrics:
            cells = [format_number(r.metrics[m]) if m in r.metrics else MISSING for r in rows]
            columns.append(_Column(m, cells, numeric=True))
        columns.append(
            _Column(
                "parent",
                [parent_names.get(r.parent_run_id or "", MISSING) for r in rows],
                name_like=True,
            )
        )
        # the sweep and pretrain columns only where they add to the parent column
        for header, attr in (("sweep", "nested_in_run_id"), ("pretrain", "pretrain_run_id")):
            ids = [getattr(r, attr) for r in rows]
            if any(i and i != r.parent_run_id for i, r in zip(ids, rows, strict=True)):
                cells = [parent_names.get(i, MISSING) if i else MISSING for i in ids]
                columns.append(_Column(header, cells, name_like=True))
        return columns


# --------------------------------------------------------------------------- search


def compare_runs(query: CompareQuery, client: MlflowClient | None = None) -> Comparison:
    """Find the runs ``query`` asks for and build their comparison.

    Raises :class:`TrackingUnreachableError`, :class:`UnknownExperimentError`,
    :class:`UnknownRunError` (``children_of``), :class:`NoMatchingRunsError` or
    :class:`UnknownMetricError` (a sort metric no run has), each with a one-line message.
    """
    uri = query.resolved_uri()
    if client is None:
        client = _client(uri)
    experiment_id = _experiment_id(client, query.experiment, uri)
    parent_id = None
    if query.children_of is not None:
        parent_id = _resolve_run(client, experiment_id, query.children_of)
    filter_string = query.filter_string(parent_id)
    order_by = ["attributes.start_time DESC"]
    ascending = query.sort_ascending
    if query.sort:
        order_by.insert(0, f"metrics.`{query.sort}` {'ASC' if ascending else 'DESC'}")
    runs = _search(client, experiment_id, filter_string, query.max_runs, order_by, uri)
    if not runs:
        hint = "" if query.all_states else "; --all-states includes unfinished and failed runs"
        raise NoMatchingRunsError(
            f"no runs of experiment '{query.experiment}' match {query.describe()} "
            f"(MLflow filter: {filter_string or 'none'}){hint}"
        )
    rows = [_row(run) for run in runs]
    _add_lineage(client, rows)
    present = sorted({m for row in rows for m in row.metrics})
    if query.sort and query.sort not in present:
        raise UnknownMetricError(
            f"cannot sort by {query.sort}: none of the {len(rows)} runs logged it; "
            f"metrics logged: {_listing(present)}"
        )
    metrics = _choose_metrics(query, rows, present)
    if query.sort and query.sort not in metrics:
        metrics.append(query.sort)
    params = _expand(query.params, sorted({p for row in rows for p in row.params}))
    if query.sort:
        rows = _sort_rows(rows, query.sort, ascending)
        _mark_best(rows, query.sort)
    return Comparison(
        experiment=query.experiment,
        experiment_id=experiment_id,
        tracking_uri=uri,
        filter=filter_string,
        description=query.describe(),
        rows=rows,
        metrics=metrics,
        params=params,
        sort=query.sort,
        ascending=ascending,
    )


def _client(uri: str) -> MlflowClient:
    """An MLflow client for an existing store at ``uri`` (checked, never created)."""
    from mlflow import MlflowClient

    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///") :].split("?", 1)[0]  # absolute: sqlite:////abs/path
        if not os.path.isfile(path):
            raise TrackingUnreachableError(
                f"no MLflow store at {uri}: {path} does not exist (pass --tracking-uri or set "
                "MLFLOW_TRACKING_URI)"
            )
    elif uri.startswith("file://"):
        path = uri[len("file://") :]
        if not os.path.isdir(path):
            raise TrackingUnreachableError(
                f"no MLflow store at {uri}: {path} is not a folder (pass --tracking-uri)"
            )
    elif uri.startswith(("http://", "https://")):
        _probe_server(uri)
    return MlflowClient(tracking_uri=uri)


def _probe_server(uri: str, timeout_s: float = 10.0) -> None:
    """Fail fast if nothing answers at ``uri`` (MLflow itself retries for minutes)."""
    import ssl
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s):
            pass
    except urllib.error.HTTPError:
        return  # something answered (maybe asking for credentials): let MLflow talk to it
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        if isinstance(reason, ssl.SSLError):
            return  # it answered; MLflow has its own TLS settings (MLFLOW_TRACKING_INSECURE_TLS)
        raise TrackingUnreachableError(
            f"cannot reach the MLflow tracking server at {uri}: {reason} (is `mlflow server` "
            "running? pass --tracking-uri or set MLFLOW_TRACKING_URI)"
        ) from None


def _store_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean the store could not be read (not a bug here)."""
    from mlflow.exceptions import MlflowException

    errors: list[type[BaseException]] = [MlflowException, OSError]
    try:
        from sqlalchemy.exc import SQLAlchemyError
    except ImportError:  # pragma: no cover - mlflow's sql stores need it
        pass
    else:
        errors.append(SQLAlchemyError)
    return tuple(errors)


def _experiment_id(client: MlflowClient, name: str, uri: str) -> str:
    try:
        experiment = client.get_experiment_by_name(name)
        if experiment is not None and experiment.lifecycle_stage == "active":
            return str(experiment.experiment_id)
        names = sorted(e.name for e in client.search_experiments(max_results=1000))
    except _store_errors() as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TrackingUnreachableError(f"cannot read the MLflow store at {uri}: {first}") from None
    if experiment is not None:
        raise UnknownExperimentError(
            f"experiment '{name}' at {uri} is deleted (`mlflow experiments restore "
            f"--experiment-id {experiment.experiment_id}` brings it back)"
        )
    raise UnknownExperimentError(
        f"no experiment '{name}' at {uri}; experiments there: {_listing(names)} "
        "(pass --experiment NAME)"
    )


def _resolve_run(client: MlflowClient, experiment_id: str, ref: str) -> str:
    """The run id of ``ref``: a full run id, or the name of a run in the experiment."""
    from mlflow.entities import ViewType
    from mlflow.exceptions import MlflowException

    if re.fullmatch(r"[0-9a-f]{32}", ref):
        try:
            return str(client.get_run(ref).info.run_id)
        except MlflowException:
            raise UnknownRunError(f"no run with id {ref}") from None
    if "'" in ref and '"' in ref:
        raise UnknownRunError(f"no run with id or name {ref!r}: a name cannot hold both quotes")
    found = client.search_runs(
        [experiment_id],
        filter_string=f"attributes.run_name = {_quote(ref)}",
        run_view_type=ViewType.ACTIVE_ONLY,
        max_results=10,
        order_by=["attributes.start_time DESC"],
    )
    if not found:
        raise UnknownRunError(
            f"no run with id or name {ref!r} in this experiment (pass a full 32-character "
            "run id, see --json, or a run name)"
        )
    if len(found) > 1:
        ids = ", ".join(run.info.run_id for run in found)
        raise UnknownRunError(f"{len(found)} runs are named {ref!r} ({ids}): pass the run id")
    return str(found[0].info.run_id)


def _search(
    client: MlflowClient,
    experiment_id: str,
    filter_string: str,
    max_runs: int,
    order_by: list[str],
    uri: str,
) -> list[Run]:
    from mlflow.entities import ViewType

    try:
        return list(
            client.search_runs(
                [experiment_id],
                filter_string=filter_string,
                run_view_type=ViewType.ACTIVE_ONLY,
                max_results=max_runs,
                order_by=order_by,
            )
        )
    except _store_errors() as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RunsError(f"run search failed at {uri} (filter: {filter_string}): {first}") from None


def _row(run: Run) -> RunRow:
    tags = run.data.tags
    return RunRow(
        run_id=run.info.run_id,
        name=run.info.run_name or tags.get("mlflow.runName") or run.info.run_id[:_SHORT_ID],
        stage=tags.get(TAG_STAGE),
        status=str(run.info.status),
        start_time=run.info.start_time,
        end_time=run.info.end_time,
        params=dict(run.data.params),
        metrics={k: float(v) for k, v in run.data.metrics.items()},
        parent_run_id=tags.get(TAG_PARENT) or tags.get(MLFLOW_PARENT_TAG),
        nested_in_run_id=tags.get(MLFLOW_PARENT_TAG),
        data_checksums=_checksums(tags),
    )


def _checksums(tags: Mapping[str, str]) -> dict[str, str]:
    prefix = TAG_DATA_CHECKSUM + "."
    return {k[len(prefix) :]: v for k, v in sorted(tags.items()) if k.startswith(prefix)}


@dataclasses.dataclass
class _Node:
    name: str
    stage: str | None
    parent_id: str | None
    checksums: dict[str, str]


def _add_lineage(client: MlflowClient, rows: list[RunRow]) -> None:
    """Fill in parent and sweep names, the nearest pretrain ancestor (following each run's
    parent: its lineage tag, else its MLflow parent) and inherited data checksums."""
    from mlflow.exceptions import MlflowException

    nodes: dict[str, _Node | None] = {
        row.run_id: _Node(row.name, row.stage, row.parent_run_id, row.data_checksums)
        for row in rows
    }

    def node(run_id: str) -> _Node | None:
        if run_id not in nodes:
            try:
                parent = _row(client.get_run(run_id))
            except MlflowException:
                nodes[run_id] = None  # deleted, or in a store we cannot see
            else:
                nodes[run_id] = _Node(
                    parent.name, parent.stage, parent.parent_run_id, parent.data_checksums
                )
        return nodes[run_id]

    for row in rows:
        if row.nested_in_run_id:
            sweep = node(row.nested_in_run_id)
            row.nested_in_name = sweep.name if sweep else None
        if not row.parent_run_id:
            continue
        parent = node(row.parent_run_id)
        row.parent_name = parent.name if parent else None
        seen = {row.run_id}
        current: str | None = row.parent_run_id
        for _ in range(_LINEAGE_DEPTH):
            if not current or current in seen:
                break
            seen.add(current)
            ancestor = node(current)
            if ancestor is None:
                break
            if not row.data_checksums and ancestor.checksums:
                row.data_checksums = dict(ancestor.checksums)
            if ancestor.stage == "pretrain":
                row.pretrain_run_id, row.pretrain_name = current, ancestor.name
                break
            current = ancestor.parent_id


def _choose_metrics(query: CompareQuery, rows: list[RunRow], present: list[str]) -> list[str]:
    if query.metrics:
        return _expand(query.metrics, present)
    stages = [query.stage] if query.stage else list(dict.fromkeys(r.stage for r in rows))
    chosen: dict[str, None] = {}
    for stage in stages:
        logged = sorted({m for r in rows if r.stage == stage for m in r.metrics})
        if stage == "pretrain":
            chosen.update(dict.fromkeys(DEFAULT_PRETRAIN_METRICS))
        elif stage == "finetune":
            chosen.update(dict.fromkeys(m for m in logged if m.startswith("eval/")))
        elif stage == "sweep":  # a sweep logs its best trial's metrics as best/*
            chosen.update(dict.fromkeys(m for m in logged if m.startswith(("best/", "eval/"))))
        else:
            chosen.update(dict.fromkeys(logged))
    return list(chosen)


def _expand(patterns: Sequence[str], names: Sequence[str]) -> list[str]:
    """Names in pattern order; a glob pattern adds every matching name, a plain one itself."""
    out: dict[str, None] = {}
    for pattern in patterns:
        if any(ch in pattern for ch in "*?["):
            out.update(dict.fromkeys(n for n in names if fnmatch.fnmatchcase(n, pattern)))
        else:
            out[pattern] = None
    return list(out)


def _sort_rows(rows: list[RunRow], metric: str, ascending: bool) -> list[RunRow]:
    """Rows with a finite value of ``metric`` in order, then the rest (newest first kept)."""
    have = [r for r in rows if math.isfinite(r.metrics.get(metric, math.nan))]
    rest = [r for r in rows if not math.isfinite(r.metrics.get(metric, math.nan))]
    have.sort(key=lambda r: r.metrics[metric], reverse=not ascending)
    return have + rest


def _mark_best(rows: list[RunRow], metric: str) -> None:
    """Mark the first row (best after sorting) and any row tied with it."""
    if not rows or not math.isfinite(rows[0].metrics.get(metric, math.nan)):
        return
    best = rows[0].metrics[metric]
    for row in rows:
        row.best = row.metrics.get(metric) == best


# --------------------------------------------------------------------------- plot


def plot_comparison(
    comparison: Comparison,
    out: str | None = None,
    metrics: Sequence[str] = (),
    client: MlflowClient | None = None,
) -> Figure:
    """Plot each metric's full history (value against step), one line per run.

    One subplot per metric, a legend of run names in each, a run keeps its colour across
    subplots; the best run (if any) is drawn thicker. ``metrics`` defaults to the
    comparison's first metric, else ``train/loss``.
    With ``out``, the figure is written there atomically (PNG, or SVG/PDF by extension).
    Returns the matplotlib figure (Agg canvas, no display, not registered with pyplot).
    Raises :class:`UnknownMetricError` if no run logged one of the metrics.
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(metrics) or comparison.metrics[:1] or ["train/loss"]
    if client is None:
        client = _client(comparison.tracking_uri)
    labels = _legend_labels(comparison.rows)
    palette = colormaps["tab10" if len(comparison.rows) <= 10 else "tab20"]
    colors = {row.run_id: palette(i % palette.N) for i, row in enumerate(comparison.rows)}
    histories: dict[str, list[tuple[RunRow, list[int], list[float]]]] = {}
    for name in names:
        lines = []
        for row in comparison.rows:
            if name not in row.metrics:
                continue
            points = sorted(
                (m.step, m.timestamp, m.value) for m in client.get_metric_history(row.run_id, name)
            )
            if points:
                lines.append((row, [p[0] for p in points], [p[2] for p in points]))
        if not lines:
            logged = sorted({m for row in comparison.rows for m in row.metrics})
            raise UnknownMetricError(
                f"cannot plot {name}: none of the {len(comparison.rows)} runs logged it; "
                f"metrics logged: {_listing(logged)}"
            )
        histories[name] = lines

    fig = Figure(figsize=(9.0, 1.0 + 3.2 * len(names)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(names), 1, squeeze=False)[:, 0]
    for ax, name in zip(axes, names, strict=True):
        for row, steps, values in histories[name]:
            ax.plot(
                steps,
                values,
                label=labels[row.run_id] + (" (best)" if row.best else ""),
                color=colors[row.run_id],
                marker="o" if len(steps) <= 20 else None,
                markersize=4,
                linewidth=2.6 if row.best else 1.4,
            )
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="best", ncols=1 if len(histories[name]) <= 12 else 2)
    fig.suptitle(f"experiment {comparison.experiment}: {comparison.description}", fontsize=10)
    if out is not None:
        fmt = os.path.splitext(out)[1].lstrip(".").lower()
        buffer = io.BytesIO()
        fig.savefig(buffer, format=fmt if fmt in ("png", "svg", "pdf") else "png", dpi=110)
        fsio.atomic_write_bytes(_absolute(out), buffer.getvalue())
    return fig


def _legend_labels(rows: Sequence[RunRow]) -> dict[str, str]:
    """Run names, with the short id added where two runs share a name."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.name] = counts.get(row.name, 0) + 1
    return {r.run_id: r.name if counts[r.name] == 1 else f"{r.name} ({r.short_id})" for r in rows}


# --------------------------------------------------------------------------- formatting


def format_number(value: float) -> str:
    """A metric value for the table: 4 significant digits, integers as integers."""
    if not math.isfinite(value):
        return str(value)
    magnitude = abs(value)
    if value.is_integer() and magnitude < 1e12:
        return str(int(value))
    if magnitude >= 1e5 or magnitude < 1e-3:
        return f"{value:.3e}"
    if magnitude >= 1000:
        return f"{value:.1f}"
    return f"{value:.4g}"


def format_duration(seconds: float | None) -> str:
    """``0.4s``, ``42s``, ``3m05s``, ``2h07m``, ``1d03h``; ``-`` for None."""
    if seconds is None:
        return MISSING
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _fit(columns: list[_Column], limit: int) -> list[_Column]:
    """Make the table at most ``limit`` characters wide (see :meth:`Comparison.render`)."""

    def fits() -> bool:
        return sum(c.width for c in columns) + len(_GAP) * (len(columns) - 1) <= limit

    def shrink(eligible: list[_Column], floor: int) -> None:
        while not fits():
            candidates = [c for c in eligible if c.width > floor]
            if not candidates:
                return
            max(candidates, key=lambda c: c.width).width -= 1

    if not fits():
        columns = [c for c in columns if not (c.drop_if_constant and len(set(c.cells)) <= 1)]
    for c in columns:
        if c.short_cells is not None and not fits():
            c.cells = c.short_cells
            c.width = c.natural_width()
    for c in columns:
        longest_cell = max((len(cell) for cell in c.cells), default=0)
        if not fits() and c.numeric and "/" in c.header and len(c.header) > longest_cell:
            head, _, tail = c.header.rpartition("/")
            c.header_lines = [head + "/", tail]
            c.width = c.natural_width()
    names = [c for c in columns if c.name_like]
    shrink(names, _NAME_WIDTH)
    if not fits():  # a little more off the names, or else without the optional columns
        before = [c.width for c in names]
        shrink(names, _NAME_WIDTH - 2)
        if not fits():
            for c, w in zip(names, before, strict=True):
                c.width = w
            columns = [c for c in columns if not c.optional]
    shrink([c for c in columns if c.shrinkable], _MIN_WIDTH)
    return columns


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def _disambiguated(rows: Sequence[RunRow]) -> dict[str, str]:
    """Run id -> display name of the runs and their relatives, the short id added where two
    runs share a name (or the name is unknown)."""
    names: dict[str, str] = {r.run_id: r.name for r in rows}
    for r in rows:
        for run_id, name in (
            (r.parent_run_id, r.parent_name),
            (r.nested_in_run_id, r.nested_in_name),
            (r.pretrain_run_id, r.pretrain_name),
        ):
            if run_id:
                names[run_id] = name or ""
    ids_by_name: dict[str, set[str]] = {}
    for run_id, name in names.items():
        ids_by_name.setdefault(name, set()).add(run_id)
    out = {}
    for run_id, name in names.items():
        if not name:
            out[run_id] = run_id[:_SHORT_ID]
        elif len(ids_by_name[name]) > 1:
            out[run_id] = f"{name} ({run_id[:_SHORT_ID]})"
        else:
            out[run_id] = name
    return out


def _local_time(ms: int | None, year: bool = True) -> str:
    if ms is None:
        return MISSING
    return dt.datetime.fromtimestamp(ms / 1000).strftime(
        "%Y-%m-%d %H:%M" if year else "%m-%d %H:%M"
    )


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.timezone.utc).isoformat(timespec="seconds")


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _listing(names: Sequence[str], limit: int = 20) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names) - limit} more)"


def _quote(value: str) -> str:
    return f'"{value}"' if "'" in value else f"'{value}'"


def _tag_clause(key: str, value: str) -> str:
    return f"tags.`{key}` = {_quote(value)}"


def _absolute(url: str) -> str:
    return url if "://" in url else os.path.abspath(url)
