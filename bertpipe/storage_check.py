"""Object storage that refuses bertpipe, said in one line; and a cheap check before a run.

A missing bucket, credentials the server does not accept, no permission, or an endpoint that
cannot be reached are not transient: retrying will not help, and s3fs reports them as a bare
``PermissionError`` / ``FileNotFoundError`` (or botocore's ``EndpointConnectionError``) that
names neither the URL nor the setting to fix. :func:`describe` turns such an error into a
:class:`~bertpipe.errors.StorageAccessError` whose message names the URL, the endpoint and
what to check (the bucket name, ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY``,
``AWS_ENDPOINT_URL``), never a secret. :func:`check_storage` asks the storage once, before a
stage starts, so that a wrong setting fails in seconds rather than after the retries.

This module imports no cloud SDK: errors are recognised by the S3 error code they carry
(``ClientError.response``, kept by s3fs as the ``__cause__``) and by class name.
"""

from __future__ import annotations

import os
import posixpath
import uuid
from collections.abc import Iterator, Sequence
from urllib.parse import urlsplit

import fsspec

from bertpipe.errors import StorageAccessError

__all__ = [
    "CREDENTIAL_CODES",
    "DENIED_CODES",
    "FORBIDDEN_CODES",
    "MISSING_BUCKET_CODES",
    "check_storage",
    "describe",
    "error_code",
    "is_permanent",
]

CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AuthorizationHeaderMalformed",
    }
)
"""S3 error codes for credentials the server does not accept."""

DENIED_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "AccountProblem"})
"""S3 error codes for valid credentials without the permission asked for."""

MISSING_BUCKET_CODES = frozenset({"NoSuchBucket"})

FORBIDDEN_CODES = frozenset({"403", "Forbidden"})
"""What botocore reports for a 403 answer without a body (``HEAD``): credentials refused or
access denied, the server does not say which."""

_BOTOCORE = frozenset({"botocore", "aiobotocore"})
_NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError")
_UNREACHABLE = ("EndpointConnectionError", "ConnectTimeoutError")
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "az", "adl", "oss"})
_PROBE = b"bertpipe write check\n"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, each once."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [current.__cause__, current.__context__]


def _named(exc: BaseException, names: tuple[str, ...]) -> BaseException | None:
    """The first exception in ``exc``'s chain of a botocore class named in ``names``. Only
    botocore's: urllib3 has a ``ConnectTimeoutError`` too (the base of its
    ``NewConnectionError``), which an MLflow server that cannot be reached raises, and that
    is no object storage."""
    for current in _chain(exc):
        if any(
            cls.__name__ in names and cls.__module__.split(".")[0] in _BOTOCORE
            for cls in type(current).__mro__
        ):
            return current
    return None


def error_code(exc: BaseException) -> tuple[str, dict[str, str]] | None:
    """The S3 error code (``NoSuchBucket``, ``SignatureDoesNotMatch``...) and error fields
    that ``exc`` or its cause carries (botocore's ``ClientError.response["Error"]``)."""
    for current in _chain(exc):
        response = getattr(current, "response", None)
        if isinstance(response, dict) and isinstance(response.get("Error"), dict):
            error = response["Error"]
            if error.get("Code"):
                return str(error["Code"]), error
    return None


def is_permanent(exc: BaseException) -> bool:
    """Whether ``exc`` is a storage refusal that retrying cannot fix (missing bucket,
    credentials refused or missing, access denied). An unreachable endpoint is not: the
    server may come back."""
    found = error_code(exc)
    permanent = CREDENTIAL_CODES | DENIED_CODES | FORBIDDEN_CODES | MISSING_BUCKET_CODES
    if found is not None and found[0] in permanent:
        return True
    return _named(exc, _NO_CREDENTIALS) is not None


def _without_userinfo(url: str) -> str:
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc:
        return url
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"


def _endpoint(exc: BaseException | None = None) -> str:
    """The S3 endpoint in use, as a user would recognise it, with no userinfo."""
    if exc is not None:
        failed = _named(exc, _UNREACHABLE)
        url = getattr(failed, "kwargs", {}).get("endpoint_url") if failed else None
        if url:
            return _without_userinfo(str(url))
    conf = fsspec.config.conf.get("s3", {})
    configured = conf.get("endpoint_url") or (conf.get("client_kwargs") or {}).get("endpoint_url")
    if configured:
        return f"{_without_userinfo(str(configured))} (fsspec config)"
    for var in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(var):
            return f"{_without_userinfo(os.environ[var])} ({var})"
    return "AWS S3 (AWS_ENDPOINT_URL not set)"


def describe(exc: BaseException, url: str | None = None) -> StorageAccessError | None:
    """``exc`` as a one-line :class:`StorageAccessError` naming ``url`` (or the bucket the
    server named), when it is an object storage refusal or an unreachable endpoint; None for
    anything else."""
    found = error_code(exc)
    code, fields = found if found is not None else ("", {})
    bucket = fields.get("BucketName", "")
    where = url or (f"s3://{bucket}" if bucket else "object storage")
    if code in MISSING_BUCKET_CODES:
        if not bucket and url and "://" in url:
            bucket = url.split("://", 1)[1].split("/", 1)[0]
        return StorageAccessError(
            f"{where}: bucket {bucket or '(unknown)'} does not exist at {_endpoint()}: check "
            "the bucket name (and AWS_ENDPOINT_URL), or create the bucket"
        )
    if code in CREDENTIAL_CODES:
        return StorageAccessError(
            f"{where}: the storage at {_endpoint()} refused the credentials ({code}): check "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        )
    if code in DENIED_CODES:
        return StorageAccessError(
            f"{where}: access denied by the storage at {_endpoint()} ({code}): check that the "
            "user of AWS_ACCESS_KEY_ID may read and write there (bucket policy, user policy)"
        )
    if code in FORBIDDEN_CODES:
        return StorageAccessError(
            f"{where}: the storage at {_endpoint()} refused access (403 Forbidden): check "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, and that this user may access there"
        )
    if _named(exc, _NO_CREDENTIALS) is not None:
        return StorageAccessError(
            f"{where}: no credentials for the storage at {_endpoint()}: set AWS_ACCESS_KEY_ID "
            "and AWS_SECRET_ACCESS_KEY (or an AWS profile)"
        )
    if _named(exc, _UNREACHABLE) is not None:
        return StorageAccessError(
            f"{where}: cannot reach the storage endpoint {_endpoint(exc)}: check "
            "AWS_ENDPOINT_URL and that the server is up"
        )
    return None


# ---------------------------------------------------------------- the check before a run


def _protocol(fs: fsspec.AbstractFileSystem) -> str:
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


def _quick_fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem for ``url``; for S3 a private client that gives up after one retry,
    so that a wrong endpoint fails in seconds (the pipeline's own client retries longer)."""
    fs, path = fsspec.core.url_to_fs(url)
    if _protocol(fs) in ("s3", "s3a"):
        options = dict(fs.storage_options)
        config = dict(options.get("config_kwargs") or {})
        config["retries"] = {"mode": "standard", "total_max_attempts": 2}
        options.update(config_kwargs=config, skip_instance_cache=True)
        fs = type(fs)(**options)
    return fs, path


def _fixed_prefix(path: str) -> str:
    """``path`` up to its first glob character."""
    cut = min((path.index(ch) for ch in "*?[" if ch in path), default=len(path))
    return path[:cut]


def _check_local(path: str, write: bool) -> None:
    if not write:
        return
    path = os.path.abspath(path)
    current = path
    while not os.path.exists(current):
        parent = os.path.dirname(current)
        if parent == current:
            return
        current = parent
    if os.path.isfile(current) and current != path:
        raise StorageAccessError(f"{path}: {current} is a file, not a folder: choose another path")
    folder = current if os.path.isdir(current) else os.path.dirname(current)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise StorageAccessError(
            f"{path}: cannot write in {folder} (permission denied): choose another path or fix "
            "its permissions"
        )


def check_storage(url: str, write: bool = False) -> None:
    """Ask the storage behind ``url`` once whether bertpipe may use it; raise a one-line
    :class:`StorageAccessError` (naming ``url``, never a secret) when it may not.

    Object storage (``s3://``, ``gs://``...): lists at most one key under ``url``'s bucket and
    prefix (up to the first glob character); with ``write``, also writes and deletes a small
    probe object under ``url`` taken as a folder. Local paths: with ``write``, checks that the
    nearest existing folder is writable; without, nothing (inputs are checked when expanded).
    Other filesystems (``memory://``): nothing.
    """
    from bertpipe.fsio import redact  # fsio imports this module

    fs, path = fsspec.core.url_to_fs(url)
    protocol = _protocol(fs)
    if protocol in ("file", "local"):
        _check_local(path, write)
        return
    if protocol not in _OBJECT_STORES:
        return
    try:
        fs, path = _quick_fs(url)
        prefix = _fixed_prefix(path)
        if protocol in ("s3", "s3a"):
            bucket, _, key = prefix.partition("/")
            fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=key, MaxKeys=1)
        else:
            fs.exists(prefix.rstrip("/") or prefix)
        if write:
            probe = posixpath.join(path.rstrip("/"), f".bertpipe-write-check-{uuid.uuid4().hex}")
            fs.pipe_file(probe, _PROBE)
            fs.rm_file(probe)
    except Exception as exc:
        problem = describe(exc, redact(url))
        if problem is not None:
            raise problem from exc
        if isinstance(exc, OSError):  # s3fs's translation of any other S3 error
            first = redact((str(exc).splitlines() or [type(exc).__name__])[0])
            raise StorageAccessError(
                f"{redact(url)}: the storage at {_endpoint(exc)} answered {type(exc).__name__}: "
                f"{first}: check the URL and the storage settings"
            ) from exc
        raise


def preflight(reads: Sequence[tuple[str, str]], writes: Sequence[tuple[str, str]] = ()) -> None:
    """Check, before any work, every storage location a command will use: ``(config key,
    URL)`` pairs it reads and writes (:func:`check_storage`). The first one refused raises a
    one-line :class:`StorageAccessError` that starts with its config key. Only object storage
    costs a request; local paths are checked for writability only."""
    for key, url in reads:
        _checked(key, url, write=False)
    for key, url in writes:
        _checked(key, url, write=True)


def _checked(key: str, url: str, write: bool) -> None:
    try:
        check_storage(str(url), write=write)
    except StorageAccessError as exc:
        raise StorageAccessError(f"{key}: {exc}") from exc
