"""Durations, numbers and text tables, as the command line prints them.

One home for the figures ``bertpipe runs compare`` and ``bertpipe plan`` show:

* :func:`format_duration`: a measured wall time in a table cell (``3m05s``);
  :func:`format_hmm`: a planned wall time to the minute (``2:38``);
* :func:`format_number`: a metric value (4 significant digits); :func:`format_si`: a large
  count with its SI-style suffix (``59.04B`` tokens);
* :class:`Column`, :func:`fit_columns` and :func:`render_table`: a plain-text table whose
  columns are padded to a common width, numbers right-aligned, fitted to a terminal width by
  leaving out and cutting the columns that matter least.

The table is plain text on purpose: it is read in terminals, SLURM ``.out`` files and CI logs,
and copied into issues, so it has no colour, no box characters and no wrapping of its own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = [
    "MISSING",
    "Column",
    "cut",
    "fit_columns",
    "format_duration",
    "format_hmm",
    "format_listing",
    "format_number",
    "format_si",
    "render_table",
]

MISSING = "-"
"""What a table shows for a value that is absent."""
GAP = "  "
"""Between two columns."""
ELLIPSIS = "…"
"""Ends a cut cell."""


# --------------------------------------------------------------------------- durations


def format_duration(seconds: float | None) -> str:
    """A measured duration, compact: ``0.4s``, ``42s``, ``3m05s``, ``2h07m``, ``1d03h``;
    :data:`MISSING` for None (a run still going)."""
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


def format_hmm(seconds: float) -> str:
    """A planned duration as ``h:mm``, rounded to the minute: 3725 -> ``1:02``."""
    minutes = round(seconds / 60.0)
    return f"{minutes // 60}:{minutes % 60:02d}"


# --------------------------------------------------------------------------- numbers


def format_number(value: float) -> str:
    """A metric value: 4 significant digits, integers as integers, very large and very small
    values in scientific notation; ``nan``/``inf`` as themselves."""
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


def format_si(value: float) -> str:
    """A large count with two decimals and a suffix: ``59.04B``, ``1.50M``, ``8.00k``; below a
    thousand as it is."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{unit}"
    return f"{value:g}"


def format_listing(names: Sequence[str], limit: int = 20) -> str:
    """Names for a message: ``a, b, c``; past ``limit``, ``..., (N more)``; ``none``."""
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names) - limit} more)"


# --------------------------------------------------------------------------- tables


@dataclasses.dataclass
class Column:
    """One table column; :func:`fit_columns` may change its header lines, cells and width."""

    header: str
    cells: list[str]
    numeric: bool = False
    """Right-aligned."""
    shrinkable: bool = True
    """May be cut (ending in ``…``) to fit the width."""
    drop_if_constant: bool = False
    """May be left out to fit the width when every row has the same value."""
    optional: bool = False
    """May be left out to fit the width once names are cut."""
    name_like: bool = False
    """Names and free text: cut before the other columns."""
    short_cells: list[str] | None = None
    """A narrower form of the cells, used to fit the width."""
    split_header_at: str | None = None
    """To fit the width, the header may go over two lines, split after the last of this
    string (``/`` for metric names such as ``eval/accuracy``)."""
    min_width: int = 0
    """The column is at least this wide (a label column that aligns with later lines)."""
    header_lines: list[str] = dataclasses.field(default_factory=list)
    width: int = 0

    def __post_init__(self) -> None:
        self.header_lines = self.header_lines or [self.header]
        self.width = self.width or self.natural_width()

    def natural_width(self) -> int:
        """The width that shows every header line and cell whole."""
        return max(self.min_width, *(len(text) for text in [*self.header_lines, *self.cells]))


def fit_columns(
    columns: list[Column], limit: int, *, min_width: int = 6, name_width: int = 10
) -> list[Column]:
    """Make the table at most ``limit`` characters wide; returns the columns kept.

    In this order, each step only while the table is still too wide: columns whose rows all
    hold the same value (``drop_if_constant``) are left out, cells take their short form,
    headers are split over two lines (``split_header_at``), ``name_like`` columns are cut
    down to ``name_width`` characters (two fewer if that makes it fit, else the ``optional``
    columns are left out instead), and then the widest ``shrinkable`` columns are cut, down to
    ``min_width``. If it still does not fit, the terminal wraps the lines.
    """

    def fits() -> bool:
        return sum(c.width for c in columns) + len(GAP) * (len(columns) - 1) <= limit

    def shrink(eligible: list[Column], floor: int) -> None:
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
        sep = c.split_header_at
        longest_cell = max((len(cell) for cell in c.cells), default=0)
        if not fits() and sep and sep in c.header and len(c.header) > longest_cell:
            head, _, tail = c.header.rpartition(sep)
            c.header_lines = [head + sep, tail]
            c.width = c.natural_width()
    names = [c for c in columns if c.name_like]
    shrink(names, name_width)
    if not fits():  # a little more off the names, or else without the optional columns
        before = [c.width for c in names]
        shrink(names, name_width - 2)
        if not fits():
            for c, w in zip(names, before, strict=True):
                c.width = w
            columns = [c for c in columns if not c.optional]
    shrink([c for c in columns if c.shrinkable], min_width)
    return columns


def render_table(columns: Sequence[Column], *, rule: bool = True) -> list[str]:
    """The table's lines: the header lines (a short header on the bottom one), a rule of
    dashes under them if ``rule``, then one line per row; trailing spaces stripped. Cells
    wider than their column are cut (:func:`cut`)."""
    depth = max(len(c.header_lines) for c in columns)
    lines = []
    for level in range(depth):
        parts = []
        for c in columns:
            pad = depth - len(c.header_lines)
            text = c.header_lines[level - pad] if level >= pad else ""
            parts.append(cut(text, c.width).ljust(c.width))
        lines.append(GAP.join(parts).rstrip())
    if rule:
        lines.append(GAP.join("-" * c.width for c in columns))
    for i in range(len(columns[0].cells)):
        cells = []
        for c in columns:
            text = cut(c.cells[i], c.width)
            cells.append(text.rjust(c.width) if c.numeric else text.ljust(c.width))
        lines.append(GAP.join(cells).rstrip())
    return lines


def cut(text: str, width: int) -> str:
    """``text`` if it fits in ``width`` characters, else its start and ``…``."""
    return text if len(text) <= width else text[: max(0, width - 1)] + ELLIPSIS
