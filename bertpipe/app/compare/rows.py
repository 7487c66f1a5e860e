"""One MLflow run as a row of the comparison: identity, timing, values, lineage."""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from bertpipe.tracking import TAG_DATA_CHECKSUM, TAG_PARENT, TAG_STAGE

if TYPE_CHECKING:
    from mlflow.entities import Run

__all__ = ["MLFLOW_PARENT_TAG", "SHORT_ID", "RunRow", "iso_time", "run_row"]

MLFLOW_PARENT_TAG = "mlflow.parentRunId"
"""MLflow's own tag on a nested run (a sweep trial) naming its parent run."""
SHORT_ID = 8
"""Characters of a run id shown in the table."""


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
        return self.run_id[:SHORT_ID]

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
            "start_time": iso_time(self.start_time),
            "end_time": iso_time(self.end_time),
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


def run_row(run: Run) -> RunRow:
    """The row of an MLflow run, lineage names not yet filled in
    (:func:`~bertpipe.app.compare.lineage.add_lineage` does)."""
    tags = run.data.tags
    return RunRow(
        run_id=run.info.run_id,
        name=run.info.run_name or tags.get("mlflow.runName") or run.info.run_id[:SHORT_ID],
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


def iso_time(ms: int | None) -> str | None:
    """Milliseconds since the epoch as an ISO 8601 UTC time (to the second)."""
    if ms is None:
        return None
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.timezone.utc).isoformat(timespec="seconds")


def _checksums(tags: Mapping[str, str]) -> dict[str, str]:
    prefix = TAG_DATA_CHECKSUM + "."
    return {k[len(prefix) :]: v for k, v in sorted(tags.items()) if k.startswith(prefix)}


def _finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
