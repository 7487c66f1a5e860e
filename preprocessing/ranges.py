"""The read tasks of a preprocessing run: the inputs cut into ranges before anything is read.

A range is a whole file, a byte range of an uncompressed ``sentences``/``jsonl`` file larger
than ``split_mb``, or a run of row groups of a parquet file. Ranges are planned from file
sizes (and parquet footers) alone and are small to ship to workers. A document belongs to
the range its first line starts in; in a file read in ranges its id names that byte offset
(a range cannot know the ordinals before it), so any cut of the file yields the same
documents with the same ids. Files read whole keep the ids of a whole read (ordinal, line
number), so their shards are the same as before ranges existed.

Compressed files cannot be split (a gzip or bzip2 stream has no random access): each is one
range, read by one worker, and a large one is logged with the way to parallel reading.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from bertpipe import fsio
from bertpipe.config import ConfigError
from bertpipe.preprocessing.readers import EXTENSIONS, InputConfig, split_extension

log = logging.getLogger(__name__)

__all__ = ["COMPRESSION_RATIO", "ReadRange", "plan_ranges"]

COMPRESSION_RATIO = 3.5
"""Assumed text bytes per compressed byte, for size estimates only."""


@dataclass(frozen=True)
class ReadRange:
    """One read task: ``url`` from ``start`` to ``end`` (bytes; row groups for parquet)."""

    index: int
    url: str
    start: int = 0
    end: int | None = None
    """Exclusive; ``None`` reads to the end of the file."""
    text_bytes: int = 0
    """Estimated text bytes (uncompressed): for bucket counts, balance and progress."""
    split: bool = False
    """Part of a file read in ranges: documents are named by byte offset."""


def plan_ranges(files: Sequence[str], cfg: InputConfig, range_bytes: int) -> list[ReadRange]:
    """Cut ``files`` into ranges of about ``range_bytes`` of text, in file order.

    Only uncompressed ``sentences``/``jsonl`` files larger than ``range_bytes`` are cut (and
    their documents named by byte offset); every other file is one range, read as before.
    """
    ranges: list[ReadRange] = []

    def add(url: str, start: int, end: int | None, size: int, split: bool = False) -> None:
        ranges.append(ReadRange(len(ranges), url, start, end, size, split))

    for url in files:
        fs, path = fsio.to_fs(url)
        ext, compression = split_extension(url)
        if cfg.format == "parquet" and ext in EXTENSIONS["parquet"]:
            for start, end, size in _parquet_groups(url, cfg, range_bytes):
                add(url, start, end, size)
            continue
        size = int(fs.size(path) or 0)
        splittable = (
            compression is None
            and cfg.format in ("sentences", "jsonl")
            and ext in EXTENSIONS[cfg.format]
        )
        if not splittable or size <= range_bytes:
            text = int(size * COMPRESSION_RATIO) if compression else size
            if compression and text > 2 * range_bytes:
                log.warning(
                    "%s is %s-compressed and cannot be split: one worker reads all of it "
                    "(~%.0f MB of text). For parallel reading give many files (e.g. `split -n "
                    "l/64`, then compress each; .zst decompresses fastest) or an uncompressed one",
                    url,
                    compression,
                    text / 1e6,
                )
            add(url, 0, None, text)
            continue
        pieces = -(-size // range_bytes)
        step = -(-size // pieces)
        for k in range(pieces):
            start, end = k * step, min(size, (k + 1) * step)
            add(url, start, None if end >= size else end, end - start, split=True)
    return ranges


def _parquet_groups(
    url: str, cfg: InputConfig, range_bytes: int
) -> list[tuple[int, int | None, int]]:
    """Runs of row groups of about ``range_bytes`` of text: (first, end, text bytes)."""
    import pyarrow.parquet as pq

    with fsio.open_url(url, "rb") as f:
        try:
            meta = pq.ParquetFile(f).metadata
        except Exception as exc:  # pyarrow raises ArrowInvalid (a ValueError) and others
            raise ConfigError(
                "input.paths", f"{url} is not a readable parquet file ({exc}): remove it"
            ) from None
    names = [meta.schema.column(i).path for i in range(meta.num_columns)]
    if cfg.text_field not in names:
        raise ConfigError(
            "input.text_field",
            f"{cfg.text_field!r} is not a column of {url} (columns: {', '.join(names)}): "
            "name the text column",
        )
    column = names.index(cfg.text_field)
    out: list[tuple[int, int | None, int]] = []
    first, size = 0, 0
    for group in range(meta.num_row_groups):
        size += meta.row_group(group).column(column).total_uncompressed_size
        if size >= range_bytes:
            out.append((first, group + 1, size))
            first, size = group + 1, 0
    if size or not out:
        out.append((first, meta.num_row_groups, size))
    return out
