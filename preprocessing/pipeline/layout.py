"""The job's layout on storage and the plan it runs: where spill files, parts, shards,
manifests and the resume records go, what a finished task left behind, and the counters'
namespace (shared by every stage of :mod:`bertpipe.preprocessing.pipeline`)."""

from __future__ import annotations

import json
import logging
import posixpath
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from bertpipe import fsio
from bertpipe.errors import BertpipeError
from bertpipe.preprocessing.config import PhaseConfig, PreprocessConfig
from bertpipe.preprocessing.shard_format import (
    token_dtype,
)

log = logging.getLogger(__name__)


NAMESPACE = "bertpipe.preprocess"


SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class Plan:
    """Everything the workers need, fixed before the pipeline starts (and picklable)."""

    cfg: PreprocessConfig
    root: str
    """The inputs' common folder (document ids are relative to it)."""
    num_files: int
    num_buckets: int
    shards: dict[str, dict[str, int]]
    """phase name -> split -> number of shards."""
    tokenizer_url: str
    """Where workers load the tokenizer from (any fsspec URL they can reach)."""
    tokenizer_sha256: str
    """Workers refuse a tokenizer with another checksum."""
    vocab_size: int
    special_ids: dict[str, int]
    continuation_ids: tuple[int, ...]
    """Ids of ``##`` pieces (for whole-word masking)."""
    continuing: bool = False
    """The job continues a stopped one in its output (tasks it finished are not run again)."""
    eval_index_url: str | None = None
    """Decontamination: where workers load the evaluation sets' n-grams from."""
    dedup_partitions: int = 1
    """Partitions of the deduplication keys (as many as buckets: memory per task stays flat)."""
    report_only: bool = False
    """``bertpipe preprocess --dry-run-quality``: documents are checked and counted, and no
    instance is made; they are spilled only for deduplication to take its removals out of
    the counts (as the job does where it makes instances)."""

    def phase(self, name: str) -> PhaseConfig:
        return next(p for p in self.cfg.phases if p.name == name)

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab_size)


class PartRef(NamedTuple):
    """Where a bucket's instances for one shard lie in the bucket's part file."""

    bucket: int
    dupe: int
    piece: int
    url: str
    offset: int
    length: int
    instances: int = 0
    tokens: int = 0
    masked: int = 0
    """Sizes of the block's arrays: a shard writer allocates the shard once and fills it."""

    def read(self) -> bytes:
        return _read_range(self.url, self.offset, self.length)


def spill_folder(output: str) -> str:
    """Scratch folder of the tokenized documents, one file per read range (removed when the
    run completes)."""
    return fsio.join(output, "_spill")


def progress_folder(output: str) -> str:
    """Scratch folder of the markers a driver counts for progress: one empty file per read
    range, training bucket and shard done (removed when the run completes)."""
    return fsio.join(output, "_progress")


def _mark_done(output: str, name: str) -> None:
    fs, path = fsio.to_fs(fsio.join(progress_folder(output), name))
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    fs.pipe_file(path, b"")


def resume_folder(output: str) -> str:
    """Scratch folder of what finished tasks made (``<task>.json``: a read range's spill
    references and counts, a bucket's part references and statistics, a shard's manifest
    record), and of the job's identity (``job.json``): the same command continues a stopped
    job from them (removed when the run completes)."""
    return fsio.join(output, "_resume")


def finished(output: str, task: str) -> Any:
    """What task ``task`` recorded when it finished (None: not finished)."""
    url = fsio.join(resume_folder(output), f"{task}.json")
    try:
        with fsio.open_url(url, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None
    except ValueError:  # cut short: a record is written atomically, so not by us
        return None


def _finish(output: str, task: str, record: Any) -> None:
    """Record task ``task`` as finished (after everything it wrote is complete)."""
    fsio.atomic_write_text(fsio.join(resume_folder(output), f"{task}.json"), json.dumps(record))


def parts_folder(output: str, phase: str) -> str:
    """Scratch folder of a phase's part files (removed when the run completes)."""
    return fsio.join(output, phase, "_parts")


def shard_name(split: str, shard: int) -> str:
    return f"{split}-{shard:05d}.tar"


def manifest_url(output: str, phase: str) -> str:
    return fsio.join(output, phase, "manifest.json")


class TaskFailedError(BertpipeError):
    """A task of the job failed for another reason than its input or storage (a bug, no
    memory left): exit status 1; the message names the task's input and the cause, the
    worker's traceback is in the job's log."""

    exit_code = 1


def _size(url: str) -> int | None:
    fs, path = fsio.to_fs(url)
    try:
        return int(fs.size(path))
    except FileNotFoundError:
        return None


def _plain(value: Any) -> Any:
    """A ``CreateInstancesFn`` output value as JSON (a ``PartRef`` as a list)."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _revived(kind: str, value: Any) -> Any:
    """The value :func:`_plain` made, back: ``("parts", ((phase, split, shard), PartRef))``,
    ``("stats", (phase, ("stats", {...})))``."""
    if kind == "parts":
        (phase, split, shard), ref = value
        return ((phase, split, shard), PartRef(*ref))
    if kind == "samples":
        reason, items = value
        return (reason, items)
    phase, (tag, stats) = value
    return (phase, (tag, stats))


def _count(counts: Counter[str]) -> None:
    for key, value in counts.items():
        if value:
            Metrics.counter(NAMESPACE, key).inc(value)


def _read_range(url: str, offset: int, length: int) -> bytes:
    """Bytes ``offset:offset + length`` of ``url``: one ranged request on an object store
    (a file opened for reading there fetches a whole block ahead, 50 MB with s3fs: every
    writer reading its slices of a part file would fetch the rest of the file each time)."""
    fs, path = fsio.to_fs(url)
    data = fs.cat_file(path, start=offset, end=offset + length)
    if len(data) != length:
        raise OSError(f"{url}: read {len(data)} of {length} bytes at offset {offset}")
    return bytes(data)


class SumCounts(beam.CombineFn):
    """Adds up dictionaries of counts."""

    def create_accumulator(self) -> dict[str, int]:
        return {}

    def add_input(self, acc: dict[str, int], counts: dict[str, int]) -> dict[str, int]:
        for k, v in counts.items():
            acc[k] = acc.get(k, 0) + v
        return acc

    def merge_accumulators(self, accs: Iterable[dict[str, int]]) -> dict[str, int]:
        out: dict[str, int] = {}
        for acc in accs:
            self.add_input(out, acc)
        return out

    def extract_output(self, acc: dict[str, int]) -> dict[str, int]:
        return dict(sorted(acc.items()))


class Demux(beam.PTransform):
    """Splits a PCollection of ``(tag, value)`` pairs into one PCollection per tag.

    Used instead of Beam's multi-output ParDo (``with_outputs``): the DaskRunner merges all
    outputs of such a ParDo into one collection. For the same reason no DoFn here emits from
    ``finish_bundle`` (the DaskRunner drops those outputs) and ``BatchElements`` is not used.
    """

    def __init__(self, *tags: str) -> None:
        super().__init__()
        self._tags = tags

    def expand(self, pcoll: beam.PCollection) -> dict[str, beam.PCollection]:
        return {tag: pcoll | f"Select_{tag}" >> beam.FlatMap(_select, tag) for tag in self._tags}


def _select(element: tuple[str, Any], tag: str) -> Iterator[Any]:
    if element[0] == tag:
        yield element[1]
