"""fsspec helpers shared by every stage: URLs, globs, atomic writes, retried reads.

Everything that touches storage goes through fsspec, so a local path, ``memory://``,
``s3://`` or ``gs://`` behave the same (the cloud ones need their fsspec backend installed:
``s3fs``, ``gcsfs``).

Object storage (S3, MinIO, Ceph) is configured as their users do: ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` (read by botocore), anything else for s3fs
through fsspec's config: the ``FSSPEC_S3`` environment variable (JSON, e.g.
``FSSPEC_S3='{"config_kwargs": {"read_timeout": 60}}'``) or a file in ``~/.config/fsspec``.
Importing this module fills in, under ``fsspec.config.conf["s3"]``, only the keys the user
has not set (:data:`S3_DEFAULTS`, :func:`apply_storage_defaults`):

- ``config_kwargs.retries = {"mode": "standard", "total_max_attempts": 8}``: botocore
  retries throttling (``503 SlowDown``, 429), other 500/502/503/504 answers, connection
  errors and read timeouts, 8 attempts in all, with jittered exponential backoff capped at
  20 s (at most about 70 s of waiting per request). botocore's own default is its
  ``legacy`` mode: 5 attempts, waits up to 1, 2, 4, 8 s. (botocore's ``max_attempts`` key counts
  retries, not attempts; ``AWS_MAX_ATTEMPTS`` counts attempts.)

What is left as it is: s3fs's ``connect_timeout`` (5 s) and ``read_timeout`` (15 s: a stalled
answer is abandoned and retried after 15 s), and s3fs's own retry loop around every call
(5 attempts, 0.1-0.8 s apart), which retries ``SlowDown`` once botocore gave up and, unlike
botocore, a download cut off in the middle of the body (``open``/``get_file`` reads; not
``cat_file`` of an object above the block size, whose parts s3fs 2026.9 reads outside that
loop: the loader's shard reads, which use ``cat_file``, are wrapped in :func:`retried`, to
which that cut-off (aiohttp's ``ClientPayloadError``) is transient). To change a default,
set the key, e.g. ``FSSPEC_S3='{"config_kwargs": {"retries": {"mode": "adaptive",
"total_max_attempts": 10}, "read_timeout": 60}}'`` (a user's ``retries`` replaces the default
one whole).
Storage that refuses bertpipe (missing bucket, credentials refused, endpoint unreachable)
is reported in one line naming the URL (:mod:`bertpipe.storage_check`).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import logging
import os
import posixpath
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import fsspec
from fsspec.core import OpenFile

from bertpipe.errors import BertpipeError, StorageAccessError, TransientError
from bertpipe.storage_check import check_storage, describe, is_permanent

__all__ = [
    "S3_DEFAULTS",
    "NoMatchError",
    "RetryPolicy",
    "StorageAccessError",
    "TransientError",
    "absolute",
    "apply_storage_defaults",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_writer",
    "backoff",
    "check_storage",
    "exists",
    "expand_urls",
    "file_sha256",
    "give_up",
    "is_transient",
    "join",
    "list_files",
    "open_url",
    "redact",
    "remove",
    "retried",
    "storage_errors",
    "to_fs",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


class NoMatchError(BertpipeError, FileNotFoundError):
    """A path or glob matched no file."""


S3_DEFAULTS: dict[str, Any] = {
    "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 8}},
}
"""What bertpipe sets under ``fsspec.config.conf["s3"]`` unless the user set it (module
docstring). Nested dicts are filled key by key; a value the user set is never replaced."""


def _fill(target: dict[str, Any], defaults: dict[str, Any]) -> None:
    for key, value in defaults.items():
        if key not in target:
            target[key] = copy.deepcopy(value)
        elif isinstance(value, dict) and isinstance(target[key], dict) and key != "retries":
            _fill(target[key], value)


def apply_storage_defaults() -> None:
    """Fill :data:`S3_DEFAULTS` into fsspec's config (``FSSPEC_S3``, config files), leaving
    every key the user set. Idempotent; done on import and before opening a filesystem."""
    _fill(fsspec.config.conf.setdefault("s3", {}), S3_DEFAULTS)


apply_storage_defaults()


@contextlib.contextmanager
def storage_errors(url: str) -> Iterator[None]:
    """Turn an object storage refusal raised inside the block (missing bucket, credentials
    refused, endpoint unreachable) into a one-line :class:`StorageAccessError` naming ``url``;
    anything else passes through."""
    try:
        yield
    except BertpipeError:
        raise
    except Exception as exc:
        problem = describe(exc, redact(url))
        if problem is None:
            raise
        raise problem from exc


def to_fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem for ``url`` and the path inside it."""
    apply_storage_defaults()
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path


def open_url(url: str, mode: str = "rb", compression: str | None = None, **kwargs: Any) -> OpenFile:
    """``fsspec.open`` with an explicit compression (``"infer"`` reads it off the extension)."""
    apply_storage_defaults()
    return fsspec.open(url, mode, compression=compression, **kwargs)


def join(base: str, *parts: str) -> str:
    """Join URL/path parts with ``/`` (works for ``s3://b/x`` and local paths alike)."""
    out = base.rstrip("/")
    for part in parts:
        out = posixpath.join(out, part.strip("/"))
    return out


def absolute(url: str) -> str:
    """A URL (``s3://b/x``, ``file:///x``) as it is; a local path made absolute."""
    return url if "://" in url else os.path.abspath(url)


def exists(url: str) -> bool:
    fs, path = to_fs(url)
    with storage_errors(url):
        return bool(fs.exists(path))


def list_files(url: str, suffix: str = "") -> list[str]:
    """Files directly inside folder ``url`` whose names end with ``suffix``, sorted, as URLs."""
    fs, path = to_fs(url)
    with storage_errors(url):
        if not fs.exists(path):
            return []
        names = [p for p in fs.ls(path, detail=False) if p.endswith(suffix) and fs.isfile(p)]
    return sorted(_unstrip(fs, url, p) for p in names)


def expand_urls(patterns: Sequence[str] | str) -> list[str]:
    """Expand paths, folders (recursively) and globs into a sorted, de-duplicated file list.

    Raises :class:`NoMatchError` naming the first pattern that matches no file, or
    :class:`StorageAccessError` when its storage refuses access (a missing bucket, say).
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    found: dict[str, None] = {}
    for pattern in patterns:
        fs, path = to_fs(pattern)
        with storage_errors(pattern):
            if any(ch in path for ch in "*?["):
                matches = [p for p in fs.glob(path) if fs.isfile(p)]
            elif fs.isdir(path):
                matches = [p for p in fs.find(path) if not posixpath.basename(p).startswith(".")]
            elif fs.exists(path):
                matches = [path]
            else:
                matches = []
        if not matches:
            if not is_local(fs):  # s3fs finds nothing in a bucket that does not exist
                check_storage(pattern)
            raise NoMatchError(f"input {redact(pattern)} matches no file: check the path or glob")
        for p in sorted(matches):
            found[_unstrip(fs, pattern, p)] = None
    return list(found)


_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/@\s:]*):[^/@\s]*@")
# query parameters that carry a credential: presigned S3 URLs (X-Amz-Signature,
# X-Amz-Security-Token, X-Amz-Credential), SAS tokens (sig), OAuth tokens, passwords
_SECRET_PARAMS = re.compile(
    r"(?i)(?P<key>[?&;](?:x-amz-signature|x-amz-security-token|x-amz-credential|signature|sig"
    r"|access_token|token|secret|secret_key|password|aws_secret_access_key)=)[^&#\s]*"
)
# values from the environment that must never be written out, wherever they appear
_SECRET_VARS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "MLFLOW_TRACKING_PASSWORD")


def common_root(urls: Sequence[str]) -> str:
    """The folder holding all of ``urls`` (the file's folder for one URL; "" for none)."""
    if not urls:
        return ""
    if len(urls) == 1:
        return posixpath.dirname(urls[0])
    prefix = posixpath.commonprefix(list(urls))
    return prefix[: prefix.rfind("/")] if "/" in prefix else ""


def redact(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ``***``
    (``https://me:secret@host`` -> ``https://me:***@host``), and so are credential query
    parameters (a presigned URL's ``X-Amz-Signature``, ``token=``...) and the values of
    ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN`` and ``MLFLOW_TRACKING_PASSWORD`` from
    the environment: for anything logged or saved. Credentials belong in the environment
    (``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``, the cloud SDKs' own), not
    in a URI."""
    text = _CREDENTIALS.sub(r"\g<scheme>\g<user>:***@", text)
    text = _SECRET_PARAMS.sub(r"\g<key>***", text)
    for var in _SECRET_VARS:
        value = os.environ.get(var, "")
        if len(value) >= 8 and value in text:  # short values would mask common words
            text = text.replace(value, "***")
    return text


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:  # a platform or file system without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(url: str) -> Iterator[IO[bytes]]:
    """A binary file to write ``url`` through, published only when the block exits cleanly.

    Local files are written under a temporary name in the same folder, flushed to disk
    (fsync), renamed into place and the folder synced, so that a power loss leaves the old
    file or the new one, never an empty one; object stores publish an object only when its
    upload completes, so they are written directly. Readers never see a partial file; on
    error nothing is published.
    """
    fs, path = to_fs(url)
    parent = posixpath.dirname(path)
    if not is_local(fs):
        with storage_errors(url):
            if parent:
                fs.makedirs(parent, exist_ok=True)
            with fs.open(path, "wb") as f:
                yield f
        return
    if parent:
        fs.makedirs(parent, exist_ok=True)
    tmp = posixpath.join(parent, f".{posixpath.basename(path)}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(parent)
    finally:
        if fs.exists(tmp):
            fs.rm(tmp)


def atomic_write_bytes(url: str, data: bytes) -> None:
    """Write ``data`` to ``url`` so that readers never see a partial file."""
    with atomic_writer(url) as f:
        f.write(data)


def atomic_write_text(url: str, text: str) -> None:
    atomic_write_bytes(url, text.encode("utf-8"))


def remove(urls: Iterable[str], recursive: bool = False) -> None:
    """Delete files (or folders, with ``recursive``) that exist; missing ones are ignored."""
    for url in urls:
        fs, path = to_fs(url)
        if fs.exists(path):
            fs.rm(path, recursive=recursive)


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def _unstrip(fs: fsspec.AbstractFileSystem, original: str, path: str) -> str:
    """Give ``path`` back the protocol ``original`` was written with (none for local paths)."""
    if "://" not in original:
        return path
    return str(fs.unstrip_protocol(path))


# ---------------------------------------------------------------- retried reads

_TRANSIENT_NAMES = (
    "Timeout",
    "ConnectionError",
    "ConnectError",
    "ServiceUnavailable",
    "Throttl",
    "HTTPClientError",  # botocore: connection closed, response stream cut
    "PayloadError",  # aiohttp: a response body cut off (s3fs's concurrent cat_file)
    "IncompleteRead",
)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a storage error that may go away: an ``OSError`` (I/O error, permission
    or file briefly gone on a shared filesystem, ``TimeoutError``, ``ConnectionError``) or a
    cloud client's timeout / connection error (botocore, aiohttp, fsspec ``FSTimeoutError``).
    Not a corrupt file (``tarfile.TarError``, ``ValueError``), a bad manifest, or object
    storage refusing access (missing bucket, credentials refused:
    :func:`bertpipe.storage_check.is_permanent`)."""
    if isinstance(exc, NoMatchError | BertpipeError) or is_permanent(exc):
        return False
    if isinstance(exc, OSError | TimeoutError):
        return True
    return any(any(part in cls.__name__ for part in _TRANSIENT_NAMES) for cls in type(exc).__mro__)


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff for storage reads: ``retries`` more attempts after the
    first, waiting ``delay`` seconds, doubling each time up to ``max_delay``."""

    retries: int = 4
    delay: float = 0.5
    max_delay: float = 30.0

    def waits(self) -> Iterator[float]:
        wait = self.delay
        for _ in range(self.retries):
            yield min(wait, self.max_delay)
            wait *= 2


STALL_WARN_ENV = "BERTPIPE_STORAGE_STALL_WARN_S"
"""Seconds a storage call may take before it is reported (default 30; 0: never)."""


class _StallWatch:
    """One daemon thread for the process: a storage call (:func:`stall_watch`) still
    running after ``BERTPIPE_STORAGE_STALL_WARN_S`` seconds logs one warning naming it and
    how long it has waited, and again every as many seconds, until it returns. A server
    that stops answering (SIGSTOP, a hung gateway) is retried patiently by botocore and
    s3fs; without this the run would print nothing meanwhile."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: dict[int, list[Any]] = {}
        self.thread: threading.Thread | None = None
        self.ids = itertools.count()

    def add(self, what: str, every: float) -> int:
        key = next(self.ids)
        now = time.monotonic()
        with self.lock:
            self.calls[key] = [what, now, now + every, every]
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="bertpipe-stall", daemon=True)
                self.thread.start()
        return key

    def remove(self, key: int) -> None:
        with self.lock:
            call = self.calls.pop(key, None)
        if call is not None and time.monotonic() >= call[1] + call[3]:
            log.warning("%s: done after %.0f s", call[0], time.monotonic() - call[1])

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            now = time.monotonic()
            with self.lock:
                due = [c for c in self.calls.values() if now >= c[2]]
                for call in due:
                    call[2] = now + call[3]
            for what, started, _, _ in due:
                log.warning(
                    "%s: still waiting after %.0f s (the storage is slow or does not answer; "
                    "it is retried, set %s to change when this is said)",
                    what,
                    now - started,
                    STALL_WARN_ENV,
                )


_STALLS = _StallWatch()


@contextlib.contextmanager
def stall_watch(what: str) -> Iterator[None]:
    """The block (one storage call, ``what`` naming it and its URL) reported while it
    runs longer than ``BERTPIPE_STORAGE_STALL_WARN_S`` (see :class:`_StallWatch`)."""
    try:
        every = float(os.environ.get(STALL_WARN_ENV) or 30.0)
    except ValueError:
        every = 30.0
    if every <= 0:
        yield
        return
    key = _STALLS.add(redact(what), every)
    try:
        yield
    finally:
        _STALLS.remove(key)


def retried(
    fn: Callable[[], T],
    what: str,
    policy: RetryPolicy | None = None,
    transient: Callable[[BaseException], bool] = is_transient,
) -> T:
    """``fn()``, called again after a transient error (:func:`is_transient`) with
    ``policy``'s backoff; other errors pass through at once (an object storage refusal as a
    :class:`StorageAccessError` naming ``what``, which names the URL). Still failing after the
    last retry: :class:`TransientError` naming ``what`` (exit status 75: the job is retried)."""
    policy = policy or RetryPolicy()
    waits = policy.waits()
    attempt = 1
    while True:
        try:
            with stall_watch(what):
                return fn()
        except Exception as exc:
            if not transient(exc):
                permanent = not isinstance(exc, BertpipeError) and is_permanent(exc)
                refused = describe(exc, redact(what)) if permanent else None
                if refused is not None:  # a 403 in any call names what it was doing, and where
                    raise refused from exc
                raise
            wait = next(waits, None)
            if wait is None:
                raise give_up(what, exc, attempt, policy) from exc
            backoff(what, exc, wait, attempt, policy)
            attempt += 1


def give_up(what: str, exc: BaseException, attempts: int, policy: RetryPolicy) -> TransientError:
    """The one-line error after the last retry of ``what`` failed with ``exc``."""
    return TransientError(
        f"{what}: {type(exc).__name__}: {_first_line(exc)} (still failing after {attempts} "
        f"attempt(s) over {sum(policy.waits()):.1f} s); the storage may be unavailable: rerun "
        "the same command to resume"
    )


def backoff(what: str, exc: BaseException, wait: float, attempt: int, policy: RetryPolicy) -> None:
    """Log the failed ``attempt`` of ``what`` and sleep ``wait`` seconds before the next."""
    log.warning(
        "%s: %s: %s; retrying in %.1f s (attempt %d of %d)",
        what,
        type(exc).__name__,
        _first_line(exc),
        wait,
        attempt + 1,
        policy.retries + 1,
    )
    time.sleep(wait)


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return redact(text.splitlines()[0]) if text else type(exc).__name__


class BadFileError(BertpipeError):
    """A file bertpipe wrote (a manifest, a checkpoint's state) that does not parse."""


def parse_json(raw: bytes | str, url: str, advice: str) -> Any:
    """``raw`` (the text of ``url``) decoded as JSON; a file that does not parse (truncated,
    not UTF-8) is a one-line :class:`BadFileError` naming ``url``, where it broke and
    ``advice`` (what to do)."""
    import json

    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        # the decoder's message names what it found, its position where that is (``msg``
        # alone reads "Unterminated string starting at", the position cut off)
        what = exc.msg[:1].lower() + exc.msg[1:]
        at = "" if what.endswith(" at") else " at"
        place = f"line {exc.lineno}, column {exc.colno} (character {exc.pos} of {len(exc.doc)})"
        where = f"{what}{at} {place}"
    except ValueError as exc:  # not UTF-8
        where = str(exc).splitlines()[0]
    raise BadFileError(f"{redact(url)} is not valid JSON: {where}: {advice}")


def file_sha256(url: str) -> str:
    """The sha256 of the file at ``url`` (``hashlib.file_digest``: read in large chunks)."""
    with open_url(url, "rb") as f:
        try:
            return hashlib.file_digest(f, "sha256").hexdigest()  # type: ignore[arg-type]
        except (TypeError, ValueError, AttributeError):  # a file object without readinto
            f.seek(0)
            digest = hashlib.sha256()
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
            return digest.hexdigest()
