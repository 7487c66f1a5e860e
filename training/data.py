"""The pre-training data loader: equal batches per rank, deterministic, exactly resumable.

A phase folder (``manifest.json`` + WebDataset tar shards, see docs/data-format.md) is read
by R ranks x W loader workers = P *slots* (W = 1 when ``num_workers`` is 0). Everything is
planned from the manifest alone, with no communication:

- **Partition** (the same every epoch): shards are placed whole, largest first, on the least
  loaded slot while they fit its share; the shards left over are cut into contiguous runs of
  blocks (WebDataset samples) so that every slot ends up with about the same number of
  instances. No block belongs to two slots. Each slot yields ``batches_per_slot`` =
  min over slots of ``instances // micro_batch_size`` batches per epoch, so every rank gets
  exactly ``W * batches_per_slot`` and DDP/ZeRO never waits at the end of an epoch; the rest
  (usually well under 1%) is dropped, a different part every epoch.
- **Order** (per epoch, from :func:`bertpipe.seeding.rng_for`): the groups of runs are dealt
  to slots by a permutation, each slot reads its runs in a shuffled order, blocks are mixed
  in windows of ``shuffle_blocks`` blocks (one permutation of their instances per window) and
  consecutive micro-batches are cut from that instance stream. A slot's batch j is therefore
  instances ``[j*B, (j+1)*B)`` of its stream, which lets a resumed loader jump straight to the
  window holding the next batch without decoding what came before.
- **Workers**: a ``torch.utils.data.DataLoader`` over an ``IterableDataset`` asks its W
  workers for batches round-robin; every worker yields the same count per epoch, so a rank's
  batch k is batch k // W of worker k % W. After resuming at k consumed batches, new worker w
  plays worker (w + k) % W, so the DataLoader's round robin continues where it stopped.

Reading: every shard is read whole with fsspec (local paths, ``memory://``, ``s3://``,
``gs://``), in one request on object storage (``cat_file``: one GET), its checksum verified
on those bytes, and its blocks parsed from memory by webdataset's ``tar_file_expander`` +
``group_by_keys``. While a shard's blocks are consumed, a background thread of the reading
process (the training process, or the loader worker) fetches the next shard of that slot:
at most one ahead, so a reader holds two shards (32 MB each by default). Shards larger than
:data:`WHOLE_READ_MAX` are streamed through the tar reader instead, without prefetch. The
``webdataset.WebDataset`` pipeline is not used: its URL opener knows no fsspec schemes, and
its node/worker splitting (which raises under DDP and gives ranks unequal counts) is
replaced by the partition above. Members of blocks a slot does not need are skipped
(``select_files``). Blocks are decoded by ``InstanceBlock.from_sample`` (``.npy`` with
``allow_pickle=False``).

Faults: a read that fails with an error that may be transient (``OSError``: I/O error, file
briefly unreadable or gone; timeouts; lost connections) is retried with exponential backoff
(``data.read_retries``, ``data.read_retry_delay``): the whole shard is read again (a streamed
one resumes after the last block delivered); still failing,
:class:`~bertpipe.errors.TransientError` (exit status 75: retry the job), raised when the
loader reaches that shard (a prefetch's error waits for it). A corrupt shard (tar or
``.npy`` errors, counts that disagree with the manifest), a shard whose sha256 differs from
its manifest's (checked on every read of it, ``data.verify_checksums``) and token or label
ids outside the vocabulary are :class:`DataError` (exit status 2), naming the shard.

An error raised in a loader worker reaches the training process as its own class with its
one-line message (:func:`_from_worker`), after the workers were stopped. Workers ignore
SIGTERM and SIGINT (preemption signals the whole process group; the trainer saves first), so
nothing may leave them to multiprocessing's exit hook, which sends SIGTERM and then waits
forever: they are stopped when the loader's generator ends or is closed, at interpreter exit
for loaders still alive then, and killed if they do not stop within
:data:`WORKER_STOP_GRACE` seconds (:func:`_stop_workers`); a worker whose parent dies is
killed by the kernel (:func:`_die_with_parent`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import hashlib
import io
import itertools
import json
import logging
import multiprocessing.connection
import os
import posixpath
import signal
import sys
import tarfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from webdataset.tariterators import group_by_keys, tar_file_expander

from bertpipe import fsio
from bertpipe.errors import BertpipeError, TransientError
from bertpipe.fsio import RetryPolicy
from bertpipe.preprocessing.masking import MaskingSpec, mask_block
from bertpipe.preprocessing.shard_format import FORMAT_NAME, SCHEMA_VERSION, InstanceBlock
from bertpipe.seeding import rng_for
from bertpipe.training.collate import (
    DynamicMasking,
    check_ids,
    cut_batches,
    pack_batch,
    unpack_batch,
)
from bertpipe.training.config import DataConfig, EvalConfig, PhaseSpec

__all__ = [
    "DataError",
    "DynamicMasking",
    "Manifest",
    "PretrainingData",
    "Run",
    "ShardInfo",
    "build_pretraining_data",
    "load_manifest",
    "partition_blocks",
    "read_bytes",
]

log = logging.getLogger(__name__)


class DataError(BertpipeError):
    """A manifest or shard that cannot be used; the message names the URL."""


@dataclass(frozen=True)
class ShardInfo:
    """One tar shard of a split, as the manifest describes it."""

    file: str
    url: str
    instances: int
    samples: int
    sha256: str | None = None
    """The shard's checksum as the manifest lists it (None in manifests without one)."""
    bytes: int | None = None
    """The shard's size as the manifest lists it (None in manifests without one)."""


@dataclass(frozen=True)
class Manifest:
    """The parts of ``manifest.json`` the loader needs (validated by :func:`load_manifest`)."""

    url: str
    max_seq_length: int
    max_predictions_per_seq: int
    masking: str
    """``static`` (masks in the shards) or ``none`` (the loader masks: dynamic masking)."""
    vocab_size: int
    special_token_ids: dict[str, int]
    instances_per_sample: int
    splits: dict[str, tuple[ShardInfo, ...]]
    masking_config: dict[str, Any] = field(default_factory=dict)
    """The ``config.masking`` section the shards were written with (may be empty)."""

    def block_sizes(self, split: str) -> list[np.ndarray]:
        """Instances of every block (sample) of every shard of ``split``: [samples] each."""
        ips = self.instances_per_sample
        out = []
        for shard in self.splits[split]:
            sizes = np.full(shard.samples, ips, dtype=np.int64)
            if shard.samples:
                sizes[-1] = shard.instances - ips * (shard.samples - 1)
            out.append(sizes)
        return out


def _read_bytes(url: str) -> bytes:
    with fsio.open_url(url, "rb") as f:
        return bytes(f.read())


def read_bytes(url: str, retry: RetryPolicy | None = None) -> bytes:
    """The bytes of ``url`` (a manifest), transient errors retried with ``retry``'s backoff; a
    missing file raises ``FileNotFoundError`` at once (a wrong path is not transient)."""
    what = f"reading {url}"
    return fsio.retried(lambda: _read_bytes(url), what, retry, _transient_unless_missing)


def _transient_unless_missing(exc: BaseException) -> bool:
    """Transient, except a file that is not there (a wrong path, not a storage hiccup)."""
    return not isinstance(exc, FileNotFoundError) and fsio.is_transient(exc)


def load_manifest(folder: str, retry: RetryPolicy | None = None) -> Manifest:
    """Read and validate ``<folder>/manifest.json``; checks that every listed shard exists.

    Transient read errors are retried with ``retry``'s backoff (a missing manifest is not)."""
    url = fsio.join(folder, "manifest.json")
    try:
        raw = json.loads(read_bytes(url, retry))
    except FileNotFoundError:
        raise DataError(
            f"no manifest at {url}: point the phase's data at a folder written by "
            "`bertpipe preprocess` (it writes manifest.json last)"
        ) from None
    except ValueError as exc:
        raise DataError(f"{url} is not valid JSON ({exc}): rerun `bertpipe preprocess`") from None

    def fail(what: str) -> DataError:
        return DataError(f"{url}: {what}; rerun `bertpipe preprocess` with this bertpipe version")

    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise fail(f"format is {got!r}, expected {FORMAT_NAME!r}")
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise fail(
            f"schema_version {raw.get('schema_version')!r}, this loader reads {SCHEMA_VERSION}"
        )
    try:
        ips = int(raw["instances_per_sample"])
        splits: dict[str, tuple[ShardInfo, ...]] = {}
        for name, split in raw["splits"].items():
            shards = tuple(
                ShardInfo(
                    s["file"],
                    fsio.join(folder, s["file"]),
                    int(s["instances"]),
                    int(s["samples"]),
                    str(s["sha256"]) if s.get("sha256") else None,
                    int(s["bytes"]) if s.get("bytes") is not None else None,
                )
                for s in split["shards"]
            )
            for s in shards:
                if s.samples != -(-s.instances // ips):
                    raise fail(
                        f"shard {s.file} lists {s.instances} instances in {s.samples} samples"
                    )
            splits[name] = shards
        manifest = Manifest(
            url=url,
            max_seq_length=int(raw["max_seq_length"]),
            max_predictions_per_seq=int(raw["max_predictions_per_seq"]),
            masking=str(raw["masking"]),
            vocab_size=int(raw["vocab_size"]),
            special_token_ids={k: int(v) for k, v in raw["special_token_ids"].items()},
            instances_per_sample=ips,
            splits=splits,
            masking_config=dict(raw.get("config", {}).get("masking", {})),
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise fail(f"missing or malformed entry {exc}") from None
    if manifest.masking not in ("static", "none"):
        raise fail(f"masking {manifest.masking!r} is neither 'static' nor 'none'")
    fs, path = fsio.to_fs(folder)
    listing = fsio.retried(
        lambda: fs.ls(path, detail=False), f"listing {folder}", retry, _transient_unless_missing
    )
    present = {posixpath.basename(p.rstrip("/")) for p in listing}
    missing = [s.url for shards in splits.values() for s in shards if s.file not in present]
    if missing:
        raise DataError(
            f"{url} lists {missing[0]}, which does not exist: rerun `bertpipe preprocess`"
        )
    return manifest


@dataclass(frozen=True)
class Run:
    """Blocks ``start:stop`` of shard number ``shard`` (its index in the split's list)."""

    shard: int
    start: int
    stop: int


def partition_blocks(block_sizes: Sequence[np.ndarray], num_slots: int) -> list[list[Run]]:
    """Split the blocks of all shards into ``num_slots`` groups of about equal instance counts.

    Whole shards first (largest first, onto the least loaded group while it stays within its
    share, plus 1% or one block of slack); the leftover shards' blocks, in shard order, are
    cut into contiguous runs for the groups still short of their share. Depends only on the
    block sizes, never on the epoch.
    """
    sizes = np.array([int(b.sum()) for b in block_sizes], dtype=np.int64)
    target = float(sizes.sum()) / num_slots
    biggest_block = max((int(b.max()) for b in block_sizes if b.size), default=0)
    slack = min(float(biggest_block), target / 100)
    loads = np.zeros(num_slots, dtype=np.int64)
    groups: list[list[Run]] = [[] for _ in range(num_slots)]
    pool: list[int] = []
    for shard in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        slot = int(np.argmin(loads))
        if loads[slot] + sizes[shard] <= target + slack:
            groups[slot].append(Run(shard, 0, len(block_sizes[shard])))
            loads[slot] += sizes[shard]
        else:
            pool.append(shard)
    if not pool:
        return groups
    pool.sort()
    refs = [(s, b) for s in pool for b in range(len(block_sizes[s]))]
    bounds = np.concatenate(([0], np.cumsum(np.concatenate([block_sizes[s] for s in pool]))))
    need = np.maximum(target - loads, 0.0)
    needy = np.flatnonzero(need > 0)
    cuts = np.cumsum(need[needy]) * (bounds[-1] / need[needy].sum())
    right = np.clip(np.searchsorted(bounds, cuts), 1, len(bounds) - 1)
    nearest = np.where(cuts - bounds[right - 1] < bounds[right] - cuts, right - 1, right)
    nearest[-1] = len(refs)
    start = 0
    for slot, stop in zip(needy.tolist(), nearest.tolist(), strict=True):
        for shard, blocks in itertools.groupby(refs[start:stop], key=lambda r: r[0]):
            numbers = [b for _, b in blocks]
            groups[slot].append(Run(shard, numbers[0], numbers[-1] + 1))
        start = max(start, stop)
    return groups


@dataclass(frozen=True)
class _Plan:
    """Everything a slot needs to produce its batches (picklable, for loader workers)."""

    manifest: Manifest
    split: str
    micro_batch_size: int
    seed: int
    num_slots: int
    shuffle_blocks: int
    groups: tuple[tuple[Run, ...], ...]
    batches_per_slot: int
    block_sizes: tuple[np.ndarray, ...]
    masking: MaskingSpec | None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    verify_checksums: bool = True

    def slot_runs(self, epoch: int, slot: int) -> list[Run]:
        """The runs slot ``slot`` reads in ``epoch``, in reading order."""
        deal = rng_for(self.seed, "loader-groups", self.split, epoch, self.num_slots)
        group = int(deal.permutation(self.num_slots)[slot])
        runs = self.groups[group]
        key = (self.seed, "loader-runs", self.split, epoch, self.num_slots, group)
        order = rng_for(*key).permutation(len(runs))
        return [runs[i] for i in order]

    def slot_batches(
        self, epoch: int, slot: int, skip: int = 0, limit: int | None = None
    ) -> Iterator[dict[str, Tensor]]:
        """Batches ``skip, skip + 1, ..., batches_per_slot - 1`` of ``slot`` in ``epoch``
        (only the first ``limit`` of them, if given)."""
        refs = [(r.shard, b) for r in self.slot_runs(epoch, slot) for b in range(r.start, r.stop)]
        window = self.shuffle_blocks
        per_window = [
            sum(int(self.block_sizes[s][b]) for s, b in refs[i : i + window])
            for i in range(0, len(refs), window)
        ]
        ends = np.cumsum(per_window)
        B = self.micro_batch_size
        count = self.batches_per_slot - skip
        if limit is not None:
            count = min(count, limit)
        first = int(np.searchsorted(ends, skip * B, side="right"))  # first window still needed
        offset = skip * B - (int(ends[first - 1]) if first else 0)
        # the window holding the last instance needed: no shard after it is read (prefetched)
        last = int(np.searchsorted(ends, (skip + count) * B - 1, side="right"))
        blocks = self._read_blocks(epoch, refs[first * window : (last + 1) * window])

        def windows() -> Iterator[InstanceBlock]:
            for w in range(first, len(per_window)):
                mixed = InstanceBlock.concat(list(itertools.islice(blocks, window)))
                key = (self.seed, "loader-window", self.split, epoch, self.num_slots, slot, w)
                order = rng_for(*key).permutation(len(mixed))
                yield mixed.take(order[offset:] if w == first else order)

        pad, longest = self.manifest.special_token_ids["pad"], self.manifest.max_seq_length
        try:
            yield from cut_batches(windows(), B, count, pad, longest)
        finally:
            blocks.close()

    def _read_blocks(self, epoch: int, refs: list[tuple[int, int]]) -> Iterator[InstanceBlock]:
        """Decode (and mask, for dynamic masking) the blocks ``refs``, in that order.

        Each shard is read whole, in one request (:func:`_fetch_shard`); once its bytes are
        in hand, the next shard of ``refs`` is fetched by a background thread of this
        process (:class:`_Prefetch`) while these blocks are decoded and consumed: at most
        one shard ahead. Shards over :data:`WHOLE_READ_MAX` are streamed instead."""
        shards = self.manifest.splits[self.split]
        runs = [(shard, [b for _, b in g]) for shard, g in itertools.groupby(refs, lambda r: r[0])]
        ahead: _Prefetch | None = None
        try:
            for i, (shard, wanted) in enumerate(runs):
                info = shards[shard]
                fetched, ahead = ahead, None
                args = self._fetch_args(info)
                if fetched is not None:
                    try:
                        data = fetched.result()
                    except TransientError:  # retried as long again, from now: as unfetched
                        data = _fetch_shard(**args)
                    blocks = _blocks_from_bytes(info.url, data, wanted)
                elif _read_whole(info):
                    blocks = _blocks_from_bytes(info.url, _fetch_shard(**args), wanted)
                else:
                    blocks = _stream_shard_blocks(wanted=wanted, **args)
                if i + 1 < len(runs) and _read_whole(upcoming := shards[runs[i + 1][0]]):
                    ahead = _Prefetch(self._fetch_args(upcoming))
                yield from self._checked(epoch, shard, info, blocks)
        finally:
            if ahead is not None:
                ahead.cancel()

    def _fetch_args(self, info: ShardInfo) -> dict[str, Any]:
        sha256 = info.sha256 if self.verify_checksums else None
        return {
            "url": info.url,
            "retry": self.retry,
            "sha256": sha256,
            "manifest_url": self.manifest.url,
        }

    def _checked(
        self,
        epoch: int,
        shard: int,
        info: ShardInfo,
        blocks: Iterator[tuple[int, str, InstanceBlock]],
    ) -> Iterator[InstanceBlock]:
        """The blocks of one shard, checked against the manifest and the vocabulary (and
        masked, for dynamic masking)."""
        for number, key, block in blocks:
            expected = int(self.block_sizes[shard][number])
            if len(block) != expected:
                raise DataError(
                    f"{info.url}: sample {key} holds {len(block)} instances, the manifest "
                    f"{self.manifest.url} says {expected}: rerun `bertpipe preprocess`"
                )
            check_ids(block, self.manifest.vocab_size, f"shard {info.url} sample {key}")
            if self.masking is not None:
                rng = rng_for(self.seed, "dynamic-mask", epoch, info.file, key)
                block = mask_block(block, self.masking, rng)
            yield block


def _block_number(name: str) -> int:
    """``SSSSS-BBBBBB.member`` -> BBBBBB."""
    return int(name.split(".", 1)[0].rsplit("-", 1)[1])


_verified: dict[str, tuple[Any, ...]] = {}
"""Shards whose checksum this process verified: URL -> (size, modification time, ...) then."""
_verified_lock = threading.Lock()


def _file_signature(url: str) -> tuple[Any, ...]:
    fs, path = fsio.to_fs(url)
    info = fs.info(path)
    keys = ("size", "mtime", "created", "LastModified", "ETag", "etag", "md5Hash", "ino")
    return tuple(str(info.get(k)) for k in keys)


def _verify_shard(url: str, sha256: str, manifest_url: str) -> None:
    """Check the shard's sha256 against its manifest once per process (again if the file's
    size or modification time changed since); a mismatch is a one-line :class:`DataError`."""
    signature = _file_signature(url)
    with _verified_lock:
        if _verified.get(url) == signature:
            return
    actual = fsio.file_sha256(url)
    if actual != sha256:
        raise _checksum_error(url, actual, sha256, manifest_url)
    with _verified_lock:
        _verified[url] = signature


WHOLE_READ_MAX = 512 << 20
"""Shards up to this size (bytes, as the manifest lists them) are read whole into memory,
in one request, and the next one prefetched (:class:`_Prefetch`): with shards of 32 MB by
default a reading process holds two. Larger shards are streamed (:func:`_stream_shard_blocks`)."""

_READ_CHUNK = 64 << 20


def _read_whole(info: ShardInfo) -> bool:
    return info.bytes is None or info.bytes <= WHOLE_READ_MAX


def _read_all(url: str) -> bytes:
    """The file's bytes: one ``cat_file`` (a single GET) on object storage; a local file in
    large reads."""
    fs, path = fsio.to_fs(url)
    if not isinstance(fs, LocalFileSystem):
        return bytes(fs.cat_file(path))
    chunks = []
    with fsio.open_url(url, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            chunks.append(chunk)
    return b"".join(chunks)


def _fetch_shard(
    url: str,
    *,
    retry: RetryPolicy | None = None,
    sha256: str | None = None,
    manifest_url: str = "",
    transient: Callable[[BaseException], bool] = fsio.is_transient,
) -> bytes:
    """The whole shard, read once (transient errors retried with ``retry``'s backoff), its
    ``sha256`` (if given) verified on those bytes: a mismatch is a :class:`DataError`."""
    data = fsio.retried(lambda: _read_all(url), f"reading shard {url}", retry, transient)
    if sha256 is not None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != sha256:
            raise _checksum_error(url, actual, sha256, manifest_url)
    return data


def _checksum_error(url: str, actual: str, sha256: str, manifest_url: str) -> DataError:
    return DataError(
        f"shard {url} has sha256 {actual}, its manifest {manifest_url} lists {sha256}: the "
        "shard was changed or damaged after `bertpipe preprocess` wrote it; rerun it (or "
        "restore the shard)"
    )


class _Prefetch:
    """A shard read whole (:func:`_fetch_shard`) by a background thread of the process that
    will decode it (a loader worker's thread lives in that worker: it is started when the
    worker starts reading, never before a fork)."""

    def __init__(self, args: dict[str, Any]) -> None:
        self.url = str(args["url"])
        self._cancelled = threading.Event()
        self._done = threading.Event()
        self._data: bytes | None = None
        self._error: BaseException | None = None
        args = {**args, "transient": self._transient}
        thread = threading.Thread(
            target=self._run, args=(args,), name="bertpipe-shard-prefetch", daemon=True
        )
        thread.start()

    def _transient(self, exc: BaseException) -> bool:
        return not self._cancelled.is_set() and fsio.is_transient(exc)

    def _run(self, args: dict[str, Any]) -> None:
        try:
            if not self._cancelled.is_set():
                self._data = _fetch_shard(**args)
        except BaseException as exc:  # handed to the consumer by result()
            self._error = exc
        finally:
            self._done.set()

    def result(self) -> bytes:
        """The shard's bytes, once read; its read's error (after the retries) raised here."""
        self._done.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        data, self._data = self._data, None
        if data is None:
            raise RuntimeError(f"the prefetch of {self.url} was cancelled")
        return data

    def cancel(self) -> None:
        """Not needed after all (the loader was closed): a read in progress ends without
        retries and its bytes are dropped."""
        self._cancelled.set()


def _read_shard_blocks(
    url: str,
    wanted: list[int],
    *,
    retry: RetryPolicy | None = None,
    sha256: str | None = None,
    manifest_url: str = "",
) -> Iterator[tuple[int, str, InstanceBlock]]:
    """Yield ``(number, key, block)`` for the blocks ``wanted`` (ascending) of one shard,
    read whole (:func:`_fetch_shard`: one read, transient errors retried, ``sha256``
    verified on the bytes read) and decoded from memory; a corrupt shard is a
    :class:`DataError` at once."""
    data = _fetch_shard(url, retry=retry, sha256=sha256, manifest_url=manifest_url)
    yield from _blocks_from_bytes(url, data, wanted)


def _blocks_from_bytes(
    url: str, data: bytes, wanted: list[int]
) -> Iterator[tuple[int, str, InstanceBlock]]:
    """``(number, key, block)`` of the blocks ``wanted`` of the shard ``data`` (its bytes)."""
    seen: list[int] = []
    try:
        for number, key, block in _tar_blocks(url, io.BytesIO(data), wanted):
            seen.append(number)
            yield number, key, block
    except (tarfile.TarError, ValueError, IndexError, EOFError) as exc:
        raise _corrupt(url, exc) from exc
    _check_complete(url, wanted, seen)


def _corrupt(url: str, exc: BaseException) -> DataError:
    detail = exc.args[0] if exc.args else type(exc).__name__
    return DataError(f"cannot read shard {url}: {detail}; rerun `bertpipe preprocess`")


def _check_complete(url: str, wanted: list[int], seen: list[int]) -> None:
    if seen != wanted:
        missing = sorted(set(wanted) - set(seen))[:3]
        raise DataError(f"shard {url} lacks samples {missing} that its manifest lists")


def _stream_shard_blocks(
    url: str,
    wanted: list[int],
    *,
    retry: RetryPolicy | None = None,
    sha256: str | None = None,
    manifest_url: str = "",
) -> Iterator[tuple[int, str, InstanceBlock]]:
    """:func:`_read_shard_blocks` for a shard too large to hold (over
    :data:`WHOLE_READ_MAX`): streamed through the tar reader, its checksum verified first in
    a pass of its own (:func:`_verify_shard`). A transient read error reopens the shard after
    ``retry``'s backoff and continues after the last block yielded."""
    policy = retry or RetryPolicy()
    waits = policy.waits()
    attempt = 1
    seen: list[int] = []
    left = list(wanted)
    while left:
        try:
            if sha256 is not None:
                _verify_shard(url, sha256, manifest_url)
            with fsio.open_url(url, "rb") as stream:
                for number, key, block in _tar_blocks(url, stream, left):
                    seen.append(number)
                    yield number, key, block
            break
        except BertpipeError:
            raise
        except (tarfile.TarError, ValueError, IndexError, EOFError) as exc:
            raise _corrupt(url, exc) from exc
        except Exception as exc:
            if not fsio.is_transient(exc):
                raise
            wait = next(waits, None)
            if wait is None:
                raise fsio.give_up(f"reading shard {url}", exc, attempt, policy) from exc
            fsio.backoff(f"reading shard {url}", exc, wait, attempt, policy)
            attempt += 1
            done = set(seen)
            left = [b for b in wanted if b not in done]
    _check_complete(url, wanted, seen)


def _tar_blocks(
    url: str, stream: Any, wanted: list[int]
) -> Iterator[tuple[int, str, InstanceBlock]]:
    """One pass over a shard's tar stream: ``(number, key, block)`` of the blocks
    ``wanted``, in order, stopping after the last of them (members of other blocks are
    skipped unread; errors pass through to the caller)."""
    want = set(wanted)
    last = wanted[-1]
    members = tar_file_expander(
        [{"url": url, "stream": stream}],
        select_files=lambda name: _block_number(name) in want,
    )
    for sample in group_by_keys(members):
        number = _block_number(sample["__key__"])
        if number not in want:
            continue
        yield number, sample["__key__"], InstanceBlock.from_sample(sample)
        if number == last:
            break


class _SlotDataset(IterableDataset):
    """One rank's batches, read by ``workers`` DataLoader workers (see the module doc) or,
    with ``workers`` 1, in the training process.

    Starts at (``epoch``, ``consumed`` batches of this rank) and runs through the epochs
    forever, or stops after ``limit`` batches of this rank.
    """

    def __init__(
        self, plan: _Plan, rank: int, workers: int, epoch: int, consumed: int, limit: int | None
    ) -> None:
        super().__init__()
        self._plan, self._rank, self._workers = plan, rank, workers
        self._epoch, self._consumed, self._limit = epoch, consumed, limit

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        info = get_worker_info()  # None: iterated in the training process (W = 1)
        new_id = info.id if info is not None else 0
        W, c = self._workers, self._consumed
        worker = (new_id + c) % W  # the logical worker this one plays
        skip = c // W + (1 if worker < c % W else 0)  # its batches the trainer already had
        slot = self._rank * W + worker
        mine = None if self._limit is None else max(0, -(-(self._limit - new_id) // W))
        stream = (
            batch
            for e in itertools.count(self._epoch)
            for batch in self._plan.slot_batches(
                e, slot, skip if e == self._epoch else 0, mine if e == self._epoch else None
            )
        )
        if mine is not None:
            stream = itertools.islice(stream, mine)
        for batch in stream:
            yield batch if info is None else pack_batch(batch)


class PretrainingData:
    """One rank's micro-batches of a phase folder's split (a torchtitan-style ``Stateful``).

    Training (``train=True``): ``iter(data)`` yields batches forever, epoch after epoch,
    starting at the current state; every rank gets ``batches_per_epoch`` batches per epoch.
    ``state_dict()`` is ``{"epoch": e, "batches": c}``, c the batches of epoch e already
    handed out, and a fresh loader given it by ``load_state_dict`` yields exactly the batches
    that would have come next. Evaluation (``train=False``): each ``iter(data)`` yields the
    same ``eval_batches`` batches (epoch 0, at most ``max_batches``), and the state is unused.

    Batches are dicts of int64 tensors, see :mod:`bertpipe.training.collate`.
    """

    def __init__(
        self,
        url: str,
        split: str = "train",
        micro_batch_size: int = 32,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        num_workers: int = 0,
        shuffle_blocks: int = 4,
        masking: DynamicMasking | None = None,
        train: bool = True,
        max_batches: int | None = None,
        pin_memory: bool = False,
        read_retries: int = 4,
        read_retry_delay: float = 0.5,
        verify_checksums: bool = True,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if micro_batch_size < 1 or shuffle_blocks < 1 or num_workers < 0:
            raise ValueError("micro_batch_size and shuffle_blocks must be >= 1, num_workers >= 0")
        if max_batches is not None and max_batches < 1:
            raise ValueError("max_batches must be at least 1 (None: the whole split)")
        retry = RetryPolicy(retries=read_retries, delay=read_retry_delay)
        self.manifest = m = load_manifest(url, retry)
        if split not in self.manifest.splits:
            raise DataError(
                f"{self.manifest.url} has no split {split!r} (it has "
                f"{sorted(self.manifest.splits)}): check the data config"
            )
        self.rank, self.world_size, self.num_workers = rank, world_size, num_workers
        self.train, self.max_batches, self.pin_memory = train, max_batches, pin_memory
        workers = max(1, num_workers)
        slots = world_size * workers
        sizes = self.manifest.block_sizes(split)
        groups = partition_blocks(sizes, slots)
        per_group = [sum(int(sizes[r.shard][r.start : r.stop].sum()) for r in g) for g in groups]
        batches = min(per_group) // micro_batch_size
        self.instances_in_split = int(sum(int(s.sum()) for s in sizes))
        if batches == 0:
            raise DataError(
                f"split {split!r} of {self.manifest.url} has {self.instances_in_split} instances "
                f"in {sum(len(s) for s in sizes)} blocks: too few for one batch of "
                f"{micro_batch_size} per reader ({world_size} ranks x {workers} worker(s)); use "
                "fewer loader workers, a smaller micro batch or more data"
            )
        spec = None
        if m.masking == "none":
            masking = masking or DynamicMasking.from_config(m.masking_config)
            spec = masking.spec(m.vocab_size, m.max_predictions_per_seq, m.special_token_ids)
        self._plan = _Plan(
            manifest=self.manifest,
            split=split,
            micro_batch_size=micro_batch_size,
            seed=seed,
            num_slots=slots,
            shuffle_blocks=shuffle_blocks,
            groups=tuple(tuple(g) for g in groups),
            batches_per_slot=batches,
            block_sizes=tuple(sizes),
            masking=spec,
            retry=retry,
            verify_checksums=verify_checksums,
        )
        self.split = split
        self.micro_batch_size = micro_batch_size
        self.batches_per_epoch = batches * workers
        """Batches every rank gets per epoch."""
        self.instances_per_epoch = self.batches_per_epoch * micro_batch_size * world_size
        """Instances all ranks together use per epoch (the rest of the split is dropped)."""
        self._epoch = 0
        self._batches = 0
        self._readers = workers
        log.info("%s: %s", self.manifest.url, self.summary())

    @property
    def eval_batches(self) -> int:
        """Batches one evaluation pass (``train=False``) yields on every rank."""
        cap = self.max_batches or self.batches_per_epoch
        return min(cap, self.batches_per_epoch)

    def summary(self) -> dict[str, Any]:
        """Figures for logs and MLflow: the epoch's size against the split's."""
        return {
            "split": self.split,
            "shards": len(self._plan.block_sizes),
            "readers": f"{self.world_size} rank(s) x {self._readers}",
            "masking": "dynamic" if self._plan.masking else "static",
            "batches_per_epoch": self.batches_per_epoch,
            "instances_per_epoch": self.instances_per_epoch,
            "instances_in_split": self.instances_in_split,
            "dropped_per_epoch": self.instances_in_split - self.instances_per_epoch,
        }

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": e, "batches": c}``: c batches of epoch e were handed out on this rank."""
        return {"epoch": self._epoch, "batches": self._batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after ``state`` (call before ``iter()``)."""
        epoch, batches = int(state["epoch"]), int(state["batches"])
        if epoch < 0 or batches < 0:
            raise ValueError(f"invalid loader state {state}")
        if batches >= self.batches_per_epoch:
            log.warning(
                "loader state %s is past this layout's %d batches per epoch (world size, "
                "workers or batch size changed?): continuing with epoch %d",
                state,
                self.batches_per_epoch,
                epoch + 1,
            )
            epoch, batches = epoch + 1, 0
        self._epoch, self._batches = epoch, batches

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        # closed explicitly: closing this generator stops the loader's workers at once
        if not self.train:
            with contextlib.closing(self._batches_from(0, 0, self.eval_batches)) as batches:
                yield from batches
            return
        with contextlib.closing(self._batches_from(self._epoch, self._batches, None)) as batches:
            for batch in batches:
                self._batches += 1
                if self._batches == self.batches_per_epoch:
                    self._epoch, self._batches = self._epoch + 1, 0
                yield batch

    def _batches_from(
        self, epoch: int, consumed: int, limit: int | None
    ) -> Iterator[dict[str, Tensor]]:
        pin = self.pin_memory and torch.cuda.is_available()
        workers = max(1, self.num_workers)
        dataset = _SlotDataset(self._plan, self.rank, workers, epoch, consumed, limit)
        if self.num_workers == 0:
            for batch in dataset:
                yield {k: v.pin_memory() for k, v in batch.items()} if pin else batch
            return
        # The DataLoader draws its workers' base seed from `generator`; without one it draws
        # from the global torch RNG, which then differs after a resume (restored RNG + one
        # draw) from the uninterrupted run (dropout masks shift). Seeded from the position.
        generator = torch.Generator()
        generator.manual_seed(
            int(
                rng_for(
                    self._plan.seed, "loader-torch", self.split, self.rank, epoch, consumed
                ).integers(0, 2**63 - 1)
            )
        )
        loader = DataLoader(
            dataset,
            batch_size=None,
            num_workers=self.num_workers,
            pin_memory=pin,
            in_order=True,
            worker_init_fn=functools.partial(
                _init_worker,
                os.getpid(),
                # the parent-death signal follows the thread that forks the workers
                threading.current_thread() is threading.main_thread(),
            ),
            generator=generator,
        )
        iterator = iter(loader)  # forks the workers
        _track(iterator)
        error: BaseException | None = None
        try:
            for packed in iterator:
                yield unpack_batch(packed)
        except BertpipeError as exc:  # re-raised by torch with the worker's traceback inside
            error = _from_worker(exc)
            # torch's ExceptionWrapper.reraise() holds the exception it raises in a local of
            # its own frame: exception -> traceback -> that frame -> exception, a cycle that
            # also holds the frames of the iterator's __next__ (and so the iterator). Only
            # the cycle collector would free it, maybe never before exit.
            exc.__traceback__ = None
        finally:
            # Stop the workers here, not when the iterator is freed: freed by the cycle
            # collector, its queues are closed (weakref finalizers) before its __del__ asks
            # the workers to stop, and at exit multiprocessing waits forever for workers
            # that ignore SIGTERM.
            _stop_workers(iterator)
        if error is not None:
            try:
                raise error  # outside the except clause: no __context__ keeps torch's error
            finally:
                error = None  # no cycle through this frame either


def _from_worker(exc: BertpipeError) -> BertpipeError:
    """A worker's error as it was raised there: torch re-raises it in the training process
    as ``Caught DataError in DataLoader worker process 0.`` + its traceback, whose last
    line holds the one-line message the command line should print. The class is kept
    (:class:`~bertpipe.errors.TransientError` exits with 75, other errors with 2)."""
    text = str(exc).rstrip()
    prefix = f"{type(exc).__name__}: "
    if not text.startswith("Caught "):
        return exc
    last = text.splitlines()[-1]
    message = last.split(prefix, 1)[1] if prefix in last else last
    try:
        return type(exc)(message)
    except TypeError:  # an error class with another constructor
        return exc


WORKER_STOP_GRACE = 3.0
"""Seconds loader workers get to finish the batch in hand once asked to stop (a long read,
a retry's backoff); then they are killed (SIGKILL: they ignore SIGTERM)."""

_live_iterators: weakref.WeakSet[Any] = weakref.WeakSet()
"""DataLoader iterators whose workers may still run; stopped at interpreter exit."""
_live_lock = threading.Lock()
_exit_hook_registered = False


def _track(iterator: Any) -> None:
    """Remember ``iterator`` (weakly) so that its workers are stopped at exit at the latest."""
    global _exit_hook_registered
    with _live_lock:
        _live_iterators.add(iterator)
        if not _exit_hook_registered:
            # atexit runs its hooks last registered first: ours runs before multiprocessing's
            # (which joins every child forever, after a SIGTERM the workers ignore) and
            # before torch's (after which _shutdown_workers does nothing); both registered
            # theirs when imported, which happened before
            import multiprocessing.util  # noqa: F401

            atexit.register(_stop_all_workers)
            _exit_hook_registered = True


def _stop_all_workers() -> None:
    """At interpreter exit: stop the workers of every iterator still alive (held by a global,
    an uncaught exception's traceback, a reference cycle), within one grace period."""
    with _live_lock:
        iterators = list(_live_iterators)
    deadline = time.monotonic() + WORKER_STOP_GRACE
    for iterator in iterators:
        _stop_workers(iterator, deadline)


def _stop_workers(iterator: Any, deadline: float | None = None) -> None:
    """Stop the worker processes of a DataLoader iterator now; the workers still running at
    ``deadline`` (default: :data:`WORKER_STOP_GRACE` from now) are killed. Returns with no
    worker of ``iterator`` alive and never raises (it runs while an error propagates).

    Torch's own ``_shutdown_workers`` joins each worker for up to 5 s and then only sends
    SIGTERM, which the workers ignore; so they are asked to stop as it asks them (its done
    event, a ``None`` on each index queue), given until ``deadline``, killed if need be, and
    only then is ``_shutdown_workers`` called, to join them and close the queues. No thread
    is started: this also runs in an atexit hook, where Python 3.12 refuses new threads.
    """
    with _live_lock:
        _live_iterators.discard(iterator)
    workers = list(getattr(iterator, "_workers", ()))
    if not any(_running(w) for w in workers):
        if workers and not getattr(iterator, "_shutdown", True):
            with contextlib.suppress(Exception):
                iterator._shutdown_workers()  # close the queues
        return
    if sys.is_finalizing():  # after the exit hooks: the queues' threads are gone
        _kill_workers(iterator)
        return
    try:  # the first half of _shutdown_workers, without its joins
        iterator._workers_done_event.set()
        for worker_id, active in enumerate(iterator._workers_status):
            if active:
                iterator._mark_worker_as_unavailable(worker_id, shutdown=True)
    except Exception:  # another torch version: they are killed at the deadline
        log.debug("asking the loader's workers to stop", exc_info=True)
    limit = time.monotonic() + WORKER_STOP_GRACE if deadline is None else deadline
    pending = [w for w in workers if _running(w)]
    while pending and (left := limit - time.monotonic()) > 0:
        multiprocessing.connection.wait([w.sentinel for w in pending], timeout=left)
        pending = [w for w in pending if w.exitcode is None]
    if pending:
        _kill_workers(iterator)
    try:
        iterator._shutdown_workers()  # joins them (at once now) and closes the queues
    except Exception:
        log.debug("shutting the loader's workers down", exc_info=True)


def _running(worker: Any) -> bool:
    """Started and not yet reaped (without polling: the check of a process not our own)."""
    popen = getattr(worker, "_popen", None)
    return popen is not None and popen.returncode is None


def _kill_workers(iterator: Any) -> None:
    """SIGKILL the iterator's workers that are still running, and wait for them."""
    if getattr(iterator, "_worker_pids_set", False):
        # torch's SIGCHLD handler would raise "DataLoader worker exited unexpectedly" in
        # the main thread for a killed worker whose pid it still watches
        iterator._worker_pids_set = False
        with contextlib.suppress(Exception):
            from torch.utils.data._utils.signal_handling import _remove_worker_pids

            _remove_worker_pids(id(iterator))
    workers = [w for w in getattr(iterator, "_workers", ()) if _running(w)]
    for w in workers:
        log.warning(
            "loader worker (pid %d) did not stop within %.0f s: killing it",
            w.pid,
            WORKER_STOP_GRACE,
        )
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.pid, signal.SIGKILL)
    for w in workers:
        with contextlib.suppress(Exception):
            w.join(timeout=5.0)


def _init_worker(parent: int, die_with_parent: bool, worker_id: int) -> None:
    """The loader's ``worker_init_fn``: runs in each worker before its first batch."""
    _ignore_stop_signals()
    if die_with_parent:
        _die_with_parent(parent)


def _ignore_stop_signals() -> None:
    """Loader workers ignore SIGTERM and SIGINT: SLURM preemption, ``scancel`` and Ctrl-C
    signal the whole process group, and a worker that died first would fail the trainer's next
    batch before it could save. The trainer acts on the signal, saves and stops its workers
    (:func:`_stop_workers`); a worker whose parent is gone dies (:func:`_die_with_parent`)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this worker when its parent dies (Linux ``prctl``
    ``PR_SET_PDEATHSIG``; strictly: when the parent's thread that forked it ends): a worker
    busy in a read or a retry's backoff never reaches the check of its parent that torch's
    worker loop makes between batches (every 5 s when idle), and an orphan would hold the
    job's process group (and the scheduler's slot) open. Exits at once if the parent is
    already gone."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), 0, 0, 0) != 0:
                log.debug("prctl(PR_SET_PDEATHSIG): errno %d", ctypes.get_errno())
        except (OSError, AttributeError):  # no libc symbol: rely on torch's parent check
            log.debug("prctl is not available", exc_info=True)
    if os.getppid() != parent:  # died before the signal was armed
        os._exit(1)


def build_pretraining_data(
    phase: PhaseSpec,
    data: DataConfig,
    *,
    rank: int,
    world_size: int,
    seed: int,
    evaluation: EvalConfig | None = None,
    masking: DynamicMasking | None = None,
) -> PretrainingData:
    """The endless training loader of ``phase`` for this rank; with ``evaluation``, its
    held-out loader instead: one pass of at most ``evaluation.max_batches``, read in the
    training process (no workers forked at every evaluation; 50 batches take milliseconds).

    The one place where the loaders of pre-training, its evaluation and ``bertpipe bench
    train`` are configured. Evaluation reads its blocks unmixed (``shuffle_blocks`` 1): the
    batches it takes are a fixed subset whatever the training's shuffle. Batches are not
    pinned here: :class:`~bertpipe.training.step.BatchPrep` pins what it sends to a GPU
    (after unpadding, which makes new tensors)."""
    train = evaluation is None
    return PretrainingData(
        phase.data,
        "train" if train else data.heldout_split,
        phase.micro_batch_size,
        rank=rank,
        world_size=world_size,
        seed=seed,
        num_workers=data.num_workers if train else 0,
        shuffle_blocks=data.shuffle_blocks if train else 1,
        masking=masking,
        train=train,
        max_batches=None if evaluation is None else evaluation.max_batches or None,
        pin_memory=False,
        read_retries=data.read_retries,
        read_retry_delay=data.read_retry_delay,
        verify_checksums=data.verify_checksums,
    )
