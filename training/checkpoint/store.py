"""Checkpoints on object storage (``checkpoint.dir=s3://…``, ``gs://…``): stage, upload,
publish.

Object storage has no rename, so the local protocol (every rank writes into one shared
folder, then rank 0 renames ``latest``) cannot work there. Instead:

1. **Stage.** Each rank has its own local folder (``checkpoint.local_dir``, default under the
   system's temporary folder) into which DeepSpeed and bertpipe write that rank's files of
   the checkpoint, exactly as they would on a shared disk.
2. **Upload.** A background thread of each rank uploads its files to ``<dir>/<tag>/`` and
   then writes ``bertpipe_upload_rankNNNNN.json``, the list of those files with their sizes
   and CRC-32 (computed when they were saved) and the save's *attempt* id (drawn by rank 0
   for this save and broadcast). Training goes on meanwhile; the next save first waits for
   this one (one checkpoint in flight).
3. **Publish.** Rank 0's thread then waits until every rank's marker of this attempt is on
   the store and every file it lists is there with its size, writes ``latest`` and reads it
   back, updates ``bertpipe_index.json`` and prunes old checkpoints on the store.

So ``latest`` only ever names a checkpoint whose every file of every rank is on the store. A
job killed during an upload leaves ``latest`` on the previous checkpoint; the half-uploaded
one is ignored (and overwritten when the resumed run saves that step again: its markers carry
the new attempt). ``checkpoint.resume=auto`` checks ``latest`` the same way before using it
and falls back to the newest complete checkpoint in the index, with a log line naming what is
missing. A rank downloads only what it loads (the shared model states and its own partition),
into ``<local_dir>/load-rankNNNNN``, checks each file's size and CRC-32 against the marker
(a file whose content changed on the store: one line, exit 2), and deletes it after the load.

Transient storage errors are retried by the storage client (s3fs/botocore, see
:mod:`bertpipe.fsio`) and then, per file, with bertpipe's backoff; an upload still failing
after that fails the run at its next save or at its end (exit 75: the job is retried), never
publishing the checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import posixpath
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bertpipe import fsio
from bertpipe.errors import BertpipeError, StorageAccessError, TransientError
from bertpipe.staging import is_remote
from bertpipe.storage_check import describe, is_permanent
from bertpipe.training.checkpoint.files import crc32_file, file_rank

log = logging.getLogger(__name__)

__all__ = [
    "CheckpointDamagedError",
    "CheckpointUploadError",
    "RemoteCheckpoints",
    "is_remote",
    "marker_name",
    "remote_store",
]

MARKER_PREFIX = "bertpipe_upload_rank"
DEFAULT_PUBLISH_TIMEOUT_S = 1800.0


class CheckpointDamagedError(BertpipeError):
    """A checkpoint file on the store whose content is not what its rank uploaded (another
    CRC-32 than its marker's, twice): exit 2, retrying cannot mend it."""


class CheckpointUploadError(TransientError):
    """A checkpoint could not be uploaded or published (exit 75: retry the job; ``latest``
    still names the previous complete checkpoint)."""


def marker_name(rank: int) -> str:
    return f"{MARKER_PREFIX}{rank:05d}.json"


@dataclass
class _Upload:
    tag: str
    thread: threading.Thread
    error: BaseException | None = None


@dataclass
class RemoteCheckpoints:
    """The checkpoint folder ``url`` on object storage, as seen by one process."""

    url: str
    local_dir: str | None = None
    publish_timeout_s: float = DEFAULT_PUBLISH_TIMEOUT_S
    _inflight: _Upload | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.fs, self.root = fsio.to_fs(self.url)
        if self.local_dir is None:
            digest = hashlib.sha1(self.url.encode()).hexdigest()[:12]
            self.local_dir = os.path.join(tempfile.gettempdir(), "bertpipe-checkpoints", digest)

    # ------------------------------------------------------------ paths and small files

    def staging(self, rank: int) -> Path:
        """The local folder DeepSpeed saves this rank's files into (``<it>/<tag>/…``)."""
        return Path(str(self.local_dir)) / f"rank{rank:05d}"

    def _path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def read_text(self, name: str) -> str | None:
        """``<url>/<name>`` (fresh from the store, not from a listing cache), or None."""
        path = self._path(name)
        self.fs.invalidate_cache(posixpath.dirname(path))

        def read() -> str | None:
            try:
                return bytes(self.fs.cat_file(path)).decode("utf-8")
            except FileNotFoundError:
                return None

        return fsio.retried(read, f"reading {self.url}/{name}")

    def write_text(self, name: str, text: str) -> None:
        path = self._path(name)
        fsio.retried(lambda: self.fs.pipe_file(path, text.encode("utf-8")), f"writing {path}")
        self.fs.invalidate_cache(posixpath.dirname(path))

    def tags(self) -> list[str]:
        """The ``global_step*`` folders on the store (complete or not)."""
        self.fs.invalidate_cache(self.root)
        try:
            with fsio.storage_errors(self.url):  # a refusal names the folder
                entries = self.fs.ls(self.root, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        names = [posixpath.basename(p.rstrip("/")) for p in entries]
        return sorted(n for n in names if n.startswith("global_step"))

    def remove_tag(self, tag: str) -> None:
        path = self._path(tag)
        with contextlib.suppress(FileNotFoundError):
            fsio.retried(lambda: self.fs.rm(path, recursive=True), f"removing {self.url}/{tag}")
        self.fs.invalidate_cache(self.root)

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError), fsio.storage_errors(f"{self.url}/{name}"):
            self.fs.rm_file(self._path(name))

    # ------------------------------------------------------------ completeness

    def _listing(self, tag: str) -> dict[str, int]:
        """Every object under ``<tag>/`` (relative name -> size), listed afresh."""
        base = self._path(tag)
        self.fs.invalidate_cache(base)
        try:
            with fsio.storage_errors(f"{self.url}/{tag}"):
                found = self.fs.find(base, detail=True, withdirs=False)
        except FileNotFoundError:
            return {}
        return {
            posixpath.relpath(path, base): int(info.get("size") or 0)
            for path, info in found.items()
        }

    def _markers(self, tag: str, listing: dict[str, int]) -> dict[int, dict[str, Any]]:
        """Every rank's upload marker of ``tag`` by rank; one that does not parse (damaged)
        raises :class:`ValueError` naming it."""
        out = {}
        for name in listing:
            if name.startswith(MARKER_PREFIX):
                text = self.read_text(f"{tag}/{name}")
                if text is not None:
                    try:
                        marker = json.loads(text)
                        out[int(marker["rank"])] = marker
                    except (ValueError, KeyError, TypeError) as exc:
                        raise ValueError(f"{name} does not parse (truncated?)") from exc
        return out

    def missing(
        self,
        tag: str,
        world_size: int | None = None,
        attempt: str | None = None,
        *,
        markers_required: bool = True,
    ) -> str:
        """Why checkpoint ``tag`` on the store is not complete ('' when it is): every rank of
        its world has a marker (of ``attempt``, if given), and every file a marker lists is
        on the store with the size it had. Without ``markers_required`` a checkpoint with
        no marker at all (uploaded by hand: a universal conversion) passes."""
        listing = self._listing(tag)
        if not listing:
            return f"{tag} has no files on the store"
        try:
            markers = self._markers(tag, listing)
        except ValueError as exc:
            return str(exc)
        if not markers and not markers_required:
            return ""
        if world_size is None:
            sizes = {int(m.get("world_size", 0)) for m in markers.values()}
            if len(sizes) != 1:
                return f"{tag} has no upload marker" if not sizes else f"{tag}'s markers disagree"
            world_size = sizes.pop()
        for rank in range(world_size):
            marker = markers.get(rank)
            if marker is None:
                return f"rank {rank}'s upload marker {marker_name(rank)} is missing"
            if attempt is not None and marker.get("attempt") != attempt:
                return f"rank {rank}'s upload marker is from another save"
            for name, size in marker["files"].items():
                if name not in listing:
                    return f"rank {rank}'s file {name} is missing"
                if listing[name] != size:
                    return f"rank {rank}'s file {name} has {listing[name]} bytes, not {size}"
        return ""

    # ------------------------------------------------------------ upload and publish

    def wait(self) -> None:
        """Wait for the upload (and, on rank 0, the publish) in flight; raise its error."""
        with self._lock:
            upload, self._inflight = self._inflight, None
        if upload is None:
            return
        upload.thread.join()
        if upload.error is not None:
            error: BaseException | None = upload.error
            if not isinstance(error, BertpipeError) and is_permanent(error):  # a 403
                error = describe(error, fsio.redact(f"{self.url}/{upload.tag}"))
            if isinstance(error, StorageAccessError):  # retrying cannot fix it: exit 2
                raise StorageAccessError(
                    f"checkpoint {upload.tag} was not uploaded: {error}; `latest` still names "
                    "the previous complete checkpoint"
                ) from upload.error
            if isinstance(error, BertpipeError):
                raise error
            raise CheckpointUploadError(
                f"checkpoint {upload.tag} was not uploaded to {self.url}: "
                f"{type(upload.error).__name__}: {_first_line(upload.error)}; `latest` still "
                "names the previous complete checkpoint: rerun the same command to resume"
            ) from upload.error

    @property
    def busy(self) -> str | None:
        """The tag being uploaded, if any."""
        upload = self._inflight
        return upload.tag if upload is not None and upload.thread.is_alive() else None

    def upload(
        self,
        tag: str,
        rank: int,
        world_size: int,
        attempt: str,
        *,
        publish: Callable[[], None] | None = None,
        background: bool = True,
        in_upload: Callable[[str], None] = lambda tag: None,
        checksums: dict[str, str] | None = None,
    ) -> None:
        """Upload this rank's staged files of ``tag``, then its marker; then ``publish``
        (rank 0). In a thread unless ``background`` is false. ``in_upload(tag)`` is called
        after the first file (tests inject faults there). ``checksums``: the CRC-32 of staged
        files already computed (name -> hex); the marker lists one for every file."""
        known = dict(checksums or {})
        self.wait()
        upload = _Upload(tag, threading.Thread())

        def work() -> None:
            try:
                self._upload(tag, rank, world_size, attempt, in_upload, known)
                if publish is not None:
                    publish()
            except BaseException as exc:  # re-raised by wait() in the training thread
                upload.error = exc
                log.error(
                    "checkpoint %s: upload to %s failed: %s: %s",
                    tag,
                    self.url,
                    type(exc).__name__,
                    _first_line(exc),
                )

        if not background:
            self._upload(tag, rank, world_size, attempt, in_upload, known)
            if publish is not None:
                publish()
            return
        upload.thread = threading.Thread(target=work, name=f"upload-{tag}", daemon=True)
        with self._lock:
            self._inflight = upload
        upload.thread.start()

    def _upload(
        self,
        tag: str,
        rank: int,
        world_size: int,
        attempt: str,
        in_upload: Callable[[str], None],
        checksums: dict[str, str],
    ) -> None:
        started = time.monotonic()
        folder = self.staging(rank) / tag
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        listing: dict[str, int] = {}
        crcs: dict[str, str] = {}
        total = 0
        for i, path in enumerate(files):
            name = path.relative_to(folder).as_posix()
            target = self._path(tag, name)
            fsio.retried(
                lambda path=path, target=target: self.fs.put_file(str(path), target),
                f"uploading {self.url}/{tag}/{name}",
            )
            listing[name] = path.stat().st_size
            crcs[name] = checksums.get(name) or crc32_file(path)
            total += listing[name]
            if i == 0:
                in_upload(tag)
        marker = {
            "rank": rank,
            "world_size": world_size,
            "attempt": attempt,
            "files": listing,
            "crc32": crcs,
        }
        self.write_text(f"{tag}/{marker_name(rank)}", json.dumps(marker, indent=1))
        shutil.rmtree(folder, ignore_errors=True)
        seconds = time.monotonic() - started
        log.info(
            "checkpoint %s: rank %d uploaded %d file(s), %.1f MB in %.1f s",
            tag,
            rank,
            len(listing),
            total / 1e6,
            seconds,
        )

    def wait_complete(self, tag: str, world_size: int, attempt: str) -> None:
        """Block until every rank's upload of this attempt of ``tag`` is on the store
        (rank 0, before publishing); a rank that never finishes is an error after
        ``publish_timeout_s``."""
        deadline = time.monotonic() + self.publish_timeout_s
        delay = 0.2
        while True:
            why = self.missing(tag, world_size, attempt)
            if not why:
                return
            if time.monotonic() > deadline:
                raise CheckpointUploadError(
                    f"checkpoint {tag} was not published to {self.url}: {why} after "
                    f"{self.publish_timeout_s:.0f} s (checkpoint.publish_timeout_s); `latest` "
                    "still names the previous complete checkpoint"
                )
            time.sleep(delay)
            delay = min(delay * 1.5, 5.0)

    def publish_latest(self, tag: str) -> None:
        """Write ``latest`` = ``tag`` and read it back (the store's publish step)."""
        self.write_text("latest", tag)
        back = self.read_text("latest")
        if (back or "").strip() != tag:
            raise CheckpointUploadError(
                f"{self.url}/latest reads back {back!r} after writing {tag!r}: another job "
                "writes this checkpoint folder? Give each run its own checkpoint.dir"
            )

    # ------------------------------------------------------------ download

    @contextlib.contextmanager
    def fetched(self, tag: str, rank: int | None, world_size: int | None) -> Iterator[str]:
        """A local folder holding ``<tag>/`` with what rank ``rank`` loads of it (every file
        when ``rank`` is None or the world size differs from the checkpoint's), downloaded
        and checked against the markers' sizes and CRC-32 (a file whose CRC-32 differs is
        downloaded once more, then :class:`CheckpointDamagedError`); deleted afterwards."""
        listing = self._listing(tag)
        if not listing:
            raise FileNotFoundError(f"{self.url}/{tag} does not exist: not a checkpoint")
        try:
            markers = self._markers(tag, listing)
        except ValueError as exc:
            raise CheckpointDamagedError(f"{self.url}/{tag}: {exc}: {_EARLIER}") from exc
        crcs = {n: c for m in markers.values() for n, c in m.get("crc32", {}).items()}
        wanted: dict[str, int] = {}
        if not markers:  # uploaded by hand (e.g. a universal conversion): all of it
            log.warning(
                "%s/%s has no upload markers (not uploaded by bertpipe): downloading all "
                "%d file(s) as they are",
                self.url,
                tag,
                len(listing),
            )
            wanted = dict(listing)
        saved_world = {int(m["world_size"]) for m in markers.values()}
        everything = rank is None or saved_world != {world_size}
        for marker in markers.values():
            for name, size in marker["files"].items():
                owner = file_rank(name)
                if everything or owner is None or owner == rank:
                    wanted[name] = size
        holder = "all" if rank is None else f"{rank:05d}"
        root = Path(str(self.local_dir)) / f"load-rank{holder}-{uuid.uuid4().hex[:8]}"
        try:
            started = time.monotonic()
            for name, size in sorted(wanted.items()):
                local = root / tag / name
                local.parent.mkdir(parents=True, exist_ok=True)
                remote = self._path(tag, name)
                for attempt in (1, 2):  # the file read once: its CRC-32 from the page cache
                    fsio.retried(
                        lambda remote=remote, local=local: self.fs.get_file(remote, str(local)),
                        f"downloading {self.url}/{tag}/{name}",
                    )
                    if local.stat().st_size != size:
                        raise CheckpointUploadError(
                            f"{self.url}/{tag}/{name} downloaded with {local.stat().st_size} "
                            f"bytes, its marker says {size}: rerun to retry"
                        )
                    if name not in crcs or crc32_file(local) == crcs[name]:
                        break
                    if attempt == 2:
                        raise CheckpointDamagedError(
                            f"{self.url}/{tag}/{name} does not have the CRC-32 its rank "
                            f"uploaded ({crcs[name]}), downloaded twice: {_EARLIER}"
                        )
            log.info(
                "checkpoint %s: downloaded %d file(s), %.1f MB in %.1f s",
                tag,
                len(wanted),
                sum(wanted.values()) / 1e6,
                time.monotonic() - started,
            )
            yield str(root)
        finally:
            shutil.rmtree(root, ignore_errors=True)


_EARLIER = (
    "the checkpoint is damaged on the store; resume from an earlier one with "
    "checkpoint.resume=<tag>, or delete this one (resume=auto then takes the newest whole one)"
)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


_STORES: dict[str, RemoteCheckpoints] = {}


def remote_store(
    url: str, local_dir: str | None = None, publish_timeout_s: float | None = None
) -> RemoteCheckpoints:
    """This process's view of checkpoint folder ``url`` (one per folder, so that a save
    waits for the previous save's upload); settings given the first time stick, later calls
    with settings update them."""
    key = url.rstrip("/")
    store = _STORES.get(key)
    if store is None:
        store = _STORES[key] = RemoteCheckpoints(key, local_dir)
    elif local_dir is not None:
        store.local_dir = local_dir
    if publish_timeout_s is not None:
        store.publish_timeout_s = publish_timeout_s
    return store


def wait_all() -> None:
    """Wait for every upload in flight in this process (end of a run); raise the first
    error."""
    errors = []
    for store in list(_STORES.values()):
        try:
            store.wait()
        except BaseException as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
