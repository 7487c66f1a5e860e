"""Metric histories of compared runs, one line per run, one subplot per metric."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from bertpipe import fsio
from bertpipe.app.compare.query import UnknownMetricError, open_client
from bertpipe.app.compare.rows import RunRow
from bertpipe.app.compare.table import Comparison
from bertpipe.formatting import format_listing

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from mlflow import MlflowClient

__all__ = ["plot_comparison", "save_figure"]


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
    Raises :class:`~bertpipe.app.compare.query.UnknownMetricError` if no run logged one of the
    metrics.
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(metrics) or comparison.metrics[:1] or ["train/loss"]
    if client is None:
        client = open_client(comparison.tracking_uri)
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
                f"metrics logged: {format_listing(logged)}"
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
        save_figure(fig, out)
    return fig


def save_figure(fig: Figure, out: str) -> str:
    """Write ``fig`` to ``out`` atomically (PNG, or SVG/PDF by extension; local or object
    storage); returns the absolute path written."""
    fmt = os.path.splitext(out)[1].lstrip(".").lower()
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt if fmt in ("png", "svg", "pdf") else "png", dpi=110)
    path = fsio.absolute(out)
    fsio.atomic_write_bytes(path, buffer.getvalue())
    return path


def _legend_labels(rows: Sequence[RunRow]) -> dict[str, str]:
    """Run names, with the short id added where two runs share a name."""
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.name] = counts.get(row.name, 0) + 1
    return {r.run_id: r.name if counts[r.name] == 1 else f"{r.name} ({r.short_id})" for r in rows}
