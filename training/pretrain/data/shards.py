"""Reading the blocks of a phase's tar shards: whole with a checksum and a prefetch, or streamed.

Every shard is read whole with fsspec (local paths, ``memory://``, ``s3://``, ``gs://``), in
one request on object storage (``cat_file``: one GET), its checksum verified on those bytes,
and its blocks parsed from memory by webdataset's ``tar_file_expander`` + ``group_by_keys``.
While a shard's blocks are consumed, a background thread of the reading process (the
training process, or the loader worker) fetches the next shard of the reader's list
(:func:`read_shards`): at most one ahead, so a reader holds two shards (32 MB each by
default). Shards larger than :data:`WHOLE_READ_MAX` are streamed through the tar reader
instead, without prefetch. The ``webdataset.WebDataset`` pipeline is not used: its URL
opener knows no fsspec schemes, and its node/worker splitting (which raises under DDP and
gives ranks unequal counts) is replaced by the loader's partition
(:func:`bertpipe.training.pretrain.data.loader.partition_blocks`). Members of blocks a reader does
not need are skipped (``select_files``). Blocks are decoded by ``InstanceBlock.from_sample``
(``.npy`` with ``allow_pickle=False``).

Faults: a read that fails with an error that may be transient (``OSError``: I/O error, file
briefly unreadable or gone; timeouts; lost connections) is retried with exponential backoff
(``data.read_retries``, ``data.read_retry_delay``): the whole shard is read again (a streamed
one resumes after the last block delivered); still failing,
:class:`~bertpipe.errors.TransientError` (exit status 75: retry the job), raised when the
reader reaches that shard (a prefetch's error waits for it). A corrupt shard (tar or
``.npy`` errors, samples the manifest lists and the shard lacks) and a shard whose sha256
differs from its manifest's (checked on every read of it, ``data.verify_checksums``) are
:class:`~bertpipe.training.pretrain.data.manifest.DataError` (exit status 2), naming the shard. What
the blocks hold (instance counts, ids in the vocabulary) is checked by the loader."""

from __future__ import annotations

import hashlib
import io
import tarfile
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

from fsspec.implementations.local import LocalFileSystem
from webdataset.tariterators import group_by_keys, tar_file_expander

from bertpipe import fsio
from bertpipe.errors import BertpipeError, TransientError
from bertpipe.fsio import RetryPolicy
from bertpipe.preprocessing.shard_format import InstanceBlock
from bertpipe.training.pretrain.data.manifest import DataError, ShardInfo

__all__ = ["WHOLE_READ_MAX", "ShardBlocks", "read_shards"]

ShardBlocks = Iterator[tuple[int, str, InstanceBlock]]
"""``(number, key, block)`` of the blocks wanted from one shard, in ascending order."""

WHOLE_READ_MAX = 512 << 20
"""Shards up to this size (bytes, as the manifest lists them) are read whole into memory,
in one request, and the next one prefetched (:class:`_Prefetch`): with shards of 32 MB by
default a reading process holds two. Larger shards are streamed (:func:`_stream_shard_blocks`)."""

_READ_CHUNK = 64 << 20


def read_shards(
    runs: Sequence[tuple[ShardInfo, list[int]]],
    *,
    retry: RetryPolicy | None = None,
    verify_checksums: bool = True,
    manifest_url: str = "",
) -> Generator[ShardBlocks, None, None]:
    """For each ``(shard, wanted)`` of ``runs``, in order: the blocks ``wanted`` (ascending
    block numbers) of that shard, to be consumed before the next shard's are asked for.

    Each shard is read whole, in one request (:func:`_fetch_shard`, its sha256 verified if
    ``verify_checksums`` and the manifest lists one); once its bytes are in hand, the next
    shard is fetched by a background thread of this process (:class:`_Prefetch`) while these
    blocks are decoded and consumed: at most one shard ahead. Shards over
    :data:`WHOLE_READ_MAX` are streamed instead (:func:`_stream_shard_blocks`). Closing the
    iterator cancels a prefetch in progress."""

    def fetch_args(info: ShardInfo) -> dict[str, Any]:
        sha256 = info.sha256 if verify_checksums else None
        return {"url": info.url, "retry": retry, "sha256": sha256, "manifest_url": manifest_url}

    ahead: _Prefetch | None = None
    try:
        for i, (info, wanted) in enumerate(runs):
            fetched, ahead = ahead, None
            args = fetch_args(info)
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
            if i + 1 < len(runs) and _read_whole(upcoming := runs[i + 1][0]):
                ahead = _Prefetch(fetch_args(upcoming))
            yield blocks
    finally:
        if ahead is not None:
            ahead.cancel()


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
) -> ShardBlocks:
    """Yield ``(number, key, block)`` for the blocks ``wanted`` (ascending) of one shard,
    read whole (:func:`_fetch_shard`: one read, transient errors retried, ``sha256``
    verified on the bytes read) and decoded from memory; a corrupt shard is a
    :class:`DataError` at once."""
    data = _fetch_shard(url, retry=retry, sha256=sha256, manifest_url=manifest_url)
    yield from _blocks_from_bytes(url, data, wanted)


def _blocks_from_bytes(url: str, data: bytes, wanted: list[int]) -> ShardBlocks:
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
) -> ShardBlocks:
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


def _tar_blocks(url: str, stream: Any, wanted: list[int]) -> ShardBlocks:
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
