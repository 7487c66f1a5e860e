"""Which runs to compare, and finding them in the MLflow store.

:class:`CompareQuery` says which runs (one experiment; by stage, tags, status or sweep parent)
and which of their values to show; :func:`find_runs` searches the store for them (the search
every view shares, :mod:`~bertpipe.app.compare.suites` included); :func:`compare_runs` adds
each run's lineage (:mod:`~bertpipe.app.compare.lineage`) and returns a
:class:`~bertpipe.app.compare.table.Comparison`.

The tracking URI always goes through :class:`~bertpipe.tracking.TrackingConfig` (never
MLflow's working-directory-dependent default), and a store that does not exist or does not
answer is reported as :class:`TrackingUnreachableError` instead of being created or retried
for minutes. MLflow is imported only when a function needs it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import os
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from bertpipe.app.compare.lineage import add_lineage
from bertpipe.app.compare.rows import MLFLOW_PARENT_TAG, RunRow, run_row
from bertpipe.app.compare.table import Comparison
from bertpipe.errors import BertpipeError
from bertpipe.formatting import format_listing
from bertpipe.tracking import STAGES, TAG_STAGE, TrackingConfig

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

__all__ = [
    "DEFAULT_PRETRAIN_METRICS",
    "MAX_RUNS_LIMIT",
    "BadTagError",
    "CompareQuery",
    "FoundRuns",
    "NoMatchingRunsError",
    "RunsError",
    "TrackingUnreachableError",
    "UnknownExperimentError",
    "UnknownMetricError",
    "UnknownRunError",
    "compare_runs",
    "find_runs",
    "lower_is_better",
    "open_client",
    "parse_tags",
]

DEFAULT_PRETRAIN_METRICS = ("train/loss", "eval/loss", "eval/mlm_accuracy", "eval/nsp_accuracy")
"""Metrics shown for pre-training runs when none are chosen."""
MAX_RUNS_LIMIT = 50_000
"""MLflow's largest page of a run search."""
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
    """MLflow tracking URI; unset: $MLFLOW_TRACKING_URI, else ``sqlite:///runs/mlflow.db``
    (resolved by :class:`~bertpipe.tracking.TrackingConfig`)."""
    stage: str | None = None
    """Only runs whose ``bertpipe.stage`` tag is this stage."""
    tags: dict[str, str] = dataclasses.field(default_factory=dict)
    """Only runs with each of these tag values (exact match), e.g.
    ``bertpipe.parent_run_id=<run id>``."""
    children_of: str | None = None
    """Only the nested runs (sweep trials) of this run: a run id or a run name."""
    metrics: list[str] = dataclasses.field(default_factory=list)
    """Metric columns (final values); ``*`` globs match the logged names. Empty: the stage's
    defaults (for finetune runs every ``best/*`` metric, the kept epoch's, else ``eval/*``,
    the last epoch's; ``best/*`` and ``eval/*`` for sweep runs; the pre-training losses and
    accuracies for pretrain runs; every metric for the other stages)."""
    params: list[str] = dataclasses.field(default_factory=list)
    """Param columns; ``*`` globs match the logged names."""
    sort: str | None = None
    """Metric to order the rows by (runs without it last); its best row is marked. Unset:
    newest first."""
    ascending: bool | None = None
    """Sort direction; None: ascending for metrics where lower is better (names with loss,
    perplexity, error, ...), else descending."""
    max_runs: int = 100
    """At most this many runs: the newest, or the best by the sort metric."""
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


# --------------------------------------------------------------------------- search


@dataclasses.dataclass(frozen=True)
class FoundRuns:
    """The runs a :class:`CompareQuery` found, and where they were searched."""

    client: MlflowClient
    """The client of the store (for further look-ups: lineage, metric histories)."""
    tracking_uri: str
    """The absolute tracking URI."""
    experiment_id: str
    filter: str
    """The MLflow filter string the runs were searched with."""
    runs: list[Run]
    """At most ``query.max_runs``, in the order asked for; never empty."""


def find_runs(
    query: CompareQuery,
    client: MlflowClient | None = None,
    *,
    order_by: Sequence[str] = ("attributes.start_time DESC",),
    hint: str = "",
) -> FoundRuns:
    """Search the store for the runs ``query`` selects (its experiment, stage, tags,
    ``children_of`` and status filters, at most ``max_runs``), ordered by ``order_by``.

    Raises :class:`TrackingUnreachableError`, :class:`UnknownExperimentError`,
    :class:`UnknownRunError` (``children_of``), :class:`RunsError` (a failed search) or
    :class:`NoMatchingRunsError` (``hint`` is added to its message), each with a one-line
    message.
    """
    uri = query.resolved_uri()
    if client is None:
        client = open_client(uri)
    experiment_id = _experiment_id(client, query.experiment, uri)
    parent_id = None
    if query.children_of is not None:
        parent_id = _resolve_run(client, experiment_id, query.children_of)
    filter_string = query.filter_string(parent_id)
    runs = _search(client, experiment_id, filter_string, query.max_runs, list(order_by), uri)
    if not runs:
        if not query.all_states:
            hint += "; --all-states includes unfinished and failed runs"
        raise NoMatchingRunsError(
            f"no runs of experiment '{query.experiment}' match {query.describe()} "
            f"(MLflow filter: {filter_string or 'none'}){hint}"
        )
    return FoundRuns(client, uri, experiment_id, filter_string, runs)


def compare_runs(query: CompareQuery, client: MlflowClient | None = None) -> Comparison:
    """Find the runs ``query`` asks for and build their comparison.

    Raises the errors of :func:`find_runs`, and :class:`UnknownMetricError` (a sort metric no
    run has), each with a one-line message.
    """
    order_by = ["attributes.start_time DESC"]
    ascending = query.sort_ascending
    if query.sort:
        order_by.insert(0, f"metrics.`{query.sort}` {'ASC' if ascending else 'DESC'}")
    found = find_runs(query, client, order_by=order_by)
    rows = [run_row(run) for run in found.runs]
    add_lineage(found.client, rows)
    present = sorted({m for row in rows for m in row.metrics})
    if query.sort and query.sort not in present:
        raise UnknownMetricError(
            f"cannot sort by {query.sort}: none of the {len(rows)} runs logged it; "
            f"metrics logged: {format_listing(present)}"
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
        experiment_id=found.experiment_id,
        tracking_uri=found.tracking_uri,
        filter=found.filter,
        description=query.describe(),
        rows=rows,
        metrics=metrics,
        params=params,
        sort=query.sort,
        ascending=ascending,
    )


def open_client(uri: str) -> MlflowClient:
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
        f"no experiment '{name}' at {uri}; experiments there: {format_listing(names)} "
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


def _choose_metrics(query: CompareQuery, rows: list[RunRow], present: list[str]) -> list[str]:
    if query.metrics:
        return _expand(query.metrics, present)
    stages = [query.stage] if query.stage else list(dict.fromkeys(r.stage for r in rows))
    chosen: dict[str, None] = {}
    for stage in stages:
        logged = sorted({m for r in rows if r.stage == stage for m in r.metrics})
        if stage == "pretrain":
            chosen.update(dict.fromkeys(DEFAULT_PRETRAIN_METRICS))
        elif stage == "finetune":  # the kept (best) epoch's, named best/; else the last's
            best = [m for m in logged if m.startswith("best/") and m != "best/step"]
            chosen.update(dict.fromkeys(best or [m for m in logged if m.startswith("eval/")]))
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


def _quote(value: str) -> str:
    return f'"{value}"' if "'" in value else f"'{value}'"


def _tag_clause(key: str, value: str) -> str:
    return f"tags.`{key}` = {_quote(value)}"
