"""Folders on object storage used through libraries that need local files.

safetensors, ``torch.load`` and DeepSpeed read and write local paths. A model folder on
object storage (an export, ``init_from=s3://…``) is therefore downloaded into a temporary
folder to be read (:func:`local_copy`), and written into one and then uploaded
(:func:`writable_copy`). Checkpoints have their own protocol
(:mod:`bertpipe.training.checkpoint.store`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bertpipe import fsio

log = logging.getLogger(__name__)

__all__ = ["is_remote", "local_copy", "upload_folder", "writable_copy"]


def is_remote(url: str | os.PathLike[str]) -> bool:
    """Whether ``url`` is on object storage (not a local or ``file://`` path)."""
    text = str(url)
    if "://" not in text or text.startswith("file://"):
        return False
    fs, _ = fsio.to_fs(text)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol not in ("file", "local")


@contextlib.contextmanager
def local_copy(url: str | os.PathLike[str]) -> Iterator[Path]:
    """``url`` as a local folder: itself if local, else a download of it (every file under
    it, retried on transient errors) removed after the block."""
    if not is_remote(url):
        yield Path(fsio.to_fs(str(url))[1])
        return
    fs, root = fsio.to_fs(str(url))
    files = fsio.retried(lambda: fs.find(root), f"listing {url}")
    if not files:
        raise FileNotFoundError(f"{url} holds no files")
    tmp = Path(tempfile.mkdtemp(prefix="bertpipe-download-"))
    try:
        started = time.monotonic()
        for path in files:
            local = tmp / posixpath.relpath(path, root)
            local.parent.mkdir(parents=True, exist_ok=True)
            fsio.retried(
                lambda path=path, local=local: fs.get_file(path, str(local)),
                f"downloading {fs.unstrip_protocol(path)}",
            )
        log.info(
            "downloaded %s (%d file(s)) in %.1f s", url, len(files), time.monotonic() - started
        )
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def upload_folder(local: str | os.PathLike[str], url: str) -> None:
    """Upload every file under ``local`` to folder ``url`` (same relative names)."""
    fs, root = fsio.to_fs(url)
    base = Path(local)
    files = sorted(p for p in base.rglob("*") if p.is_file())
    for path in files:
        target = posixpath.join(root, path.relative_to(base).as_posix())
        fsio.retried(
            lambda path=path, target=target: fs.put_file(str(path), target),
            f"uploading {fs.unstrip_protocol(target)}",
        )
    fs.invalidate_cache(root)
    log.info("uploaded %d file(s) to %s", len(files), url)


@contextlib.contextmanager
def writable_copy(url: str | os.PathLike[str]) -> Iterator[Path]:
    """A local folder to write ``url`` into: itself if local, else a temporary folder
    uploaded to ``url`` when the block ends without error (and removed)."""
    if not is_remote(url):
        path = Path(fsio.to_fs(str(url))[1])
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    tmp = Path(tempfile.mkdtemp(prefix="bertpipe-upload-"))
    try:
        yield tmp
        upload_folder(tmp, str(url))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
