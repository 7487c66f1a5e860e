"""Where a run comes from: its parent, the sweep it is nested in, its pre-training run.

A fine-tuning run's ``bertpipe.parent_run_id`` tag names the run whose output it consumed (a
pre-training run, or another fine-tuning); a sweep trial is also MLflow's nested child of its
sweep (``mlflow.parentRunId``). :func:`add_lineage` follows these links up, looking up runs
that are not in the comparison (in any experiment of the store), to name each row's parent,
sweep and nearest pre-training ancestor and to inherit the data manifest checksums.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from bertpipe.app.compare.rows import RunRow, run_row

if TYPE_CHECKING:
    from mlflow import MlflowClient

__all__ = ["LINEAGE_DEPTH", "add_lineage"]

LINEAGE_DEPTH = 10
"""Ancestors followed at most (a guard against cycles and very long chains)."""


@dataclasses.dataclass
class _Node:
    name: str
    stage: str | None
    parent_id: str | None
    checksums: dict[str, str]


def add_lineage(client: MlflowClient, rows: list[RunRow]) -> None:
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
                parent = run_row(client.get_run(run_id))
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
        for _ in range(LINEAGE_DEPTH):
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
