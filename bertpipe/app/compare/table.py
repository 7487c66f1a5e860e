"""The comparison of runs and its outputs: a terminal table, CSV and JSON.

:class:`Comparison` holds the rows in display order and the chosen metric and param columns;
:meth:`Comparison.render` lays them out with :mod:`bertpipe.formatting` (which columns may be
left out or cut to fit a width is decided here, per column).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import io
from collections.abc import Sequence
from typing import Any

from bertpipe import fsio
from bertpipe.app.compare.rows import SHORT_ID, RunRow
from bertpipe.formatting import (
    MISSING,
    Column,
    fit_columns,
    format_duration,
    format_number,
    render_table,
)

__all__ = ["Comparison"]


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
            columns = fit_columns(columns, width)
        return "\n".join(render_table(columns)) + "\n"

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
        url = fsio.absolute(url)
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

    def _columns(self) -> list[Column]:
        rows = self.rows
        parent_names = _disambiguated(rows)
        columns: list[Column] = []
        if self.sort:
            columns.append(Column("", ["best" if r.best else "" for r in rows], shrinkable=False))
        columns += [
            Column("run", [r.name for r in rows], name_like=True),
            Column("id", [r.short_id for r in rows], shrinkable=False),
            Column("stage", [r.stage or MISSING for r in rows], drop_if_constant=True),
            Column("status", [r.status for r in rows], drop_if_constant=True),
            Column(
                "started",
                [_local_time(r.start_time) for r in rows],
                short_cells=[_local_time(r.start_time, year=False) for r in rows],
                optional=True,
            ),
            Column("duration", [format_duration(r.duration_s) for r in rows], numeric=True),
        ]
        for p in self.params:
            columns.append(Column(p, [r.params.get(p, MISSING) for r in rows], name_like=True))
        for m in self.metrics:
            cells = [format_number(r.metrics[m]) if m in r.metrics else MISSING for r in rows]
            columns.append(Column(m, cells, numeric=True, split_header_at="/"))
        columns.append(
            Column(
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
                columns.append(Column(header, cells, name_like=True))
        return columns


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
            out[run_id] = run_id[:SHORT_ID]
        elif len(ids_by_name[name]) > 1:
            out[run_id] = f"{name} ({run_id[:SHORT_ID]})"
        else:
            out[run_id] = name
    return out


def _local_time(ms: int | None, year: bool = True) -> str:
    if ms is None:
        return MISSING
    return dt.datetime.fromtimestamp(ms / 1000).strftime(
        "%Y-%m-%d %H:%M" if year else "%m-%d %H:%M"
    )
