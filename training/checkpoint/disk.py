"""A checkpoint that does not fit: said before the save where it can be, and as one line
naming the folder, the bytes (or inodes) needed and free when the file system fills up in the
middle of one.

A full disk is any of: no bytes left, no inodes left (bytes free, but no file can be
created), or the user's quota reached (``EDQUOT``). torch's writer does not report these as
an ``OSError``: a ``torch.save`` onto a file system without bytes raises ``RuntimeError:
basic_ios::clear: iostream error``, then ``[enforce fail at inline_container.cc] unexpected
pos`` while closing the archive, with "No space left on device" nowhere; one without inodes
raises ``RuntimeError: [enforce fail at inline_container.cc] . open file failed with
strerror: No space left on device``. So :func:`full_error` takes an ``ENOSPC``/``EDQUOT``
anywhere in the error's chain, their text in a message, or a file system that has (almost)
no bytes or no inodes left after the failure.

A full disk ends the run with :data:`~bertpipe.errors.DISK_FULL_EXIT_CODE` (74,
``EX_IOERR``), not 75: a requeue would meet the same full volume after training up to the
next save again. ``latest`` still names the last complete checkpoint: free space (or lower
``checkpoint.keep_last``: the newest checkpoint is written before the oldest is pruned) and
run the same command, which resumes from it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from bertpipe.errors import DiskFullError

__all__ = [
    "any_rank",
    "check_room",
    "folder_bytes",
    "folder_inodes",
    "full_disk",
    "full_error",
    "human",
    "shortfall",
]

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = {os.strerror(errno.ENOSPC): errno.ENOSPC, os.strerror(errno.EDQUOT): errno.EDQUOT}
MARGIN = 1.05
"""A checkpoint may grow a little (the RNG and loader state); ask for 5% more than the last."""
SPARE_INODES = 2
"""Inodes a save needs beyond its files: the temporary files of ``latest`` and the index."""


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def folder_bytes(path: Path) -> int:
    """The bytes of the files under ``path`` (0 if it is not there)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # removed meanwhile
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def folder_inodes(path: Path) -> int:
    """The inodes the folder ``path`` takes: itself, its folders and files (0 if absent)."""
    if not path.is_dir():
        return 0
    return 1 + sum(len(dirs) + len(files) for _, dirs, files in os.walk(path))


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(_existing(path)).free


def shortfall(
    folder: Path, need: int, tag: str, resume_from: str | None, inodes: int = 0
) -> str | None:
    """Why checkpoint ``tag`` (about ``need`` bytes and ``inodes`` inodes: the size of the
    last one) will not fit in ``folder``; None when it fits or ``need`` is unknown (0)."""
    if need <= 0:
        return None
    free = free_bytes(folder)
    if free < need * MARGIN:
        what = f"needs about {human(need)} (as the last one), {human(free)} free"
        return _line(folder, tag, what, resume_from)
    if inodes <= 0:
        return None
    stats = os.statvfs(_existing(folder))
    if stats.f_files == 0 or stats.f_favail >= inodes + SPARE_INODES:  # 0: no inode limit
        return None
    what = (
        f"needs {inodes + SPARE_INODES} inodes (files and folders, as the last one), "
        f"{stats.f_favail} free of {stats.f_files} ({human(free)} free)"
    )
    return _line(folder, tag, what, resume_from)


def _full_errno(exc: BaseException) -> int | None:
    """``ENOSPC`` or ``EDQUOT`` when ``exc`` or an error in its chain is one (as an errno or,
    from torch's writer, as the text of one), else None."""
    chained: BaseException | None = exc
    for _ in range(10):
        if chained is None:
            break
        if isinstance(chained, OSError) and chained.errno in _FULL_ERRNOS:
            return int(chained.errno)
        text = str(chained)
        for message, code in _FULL_TEXTS.items():
            if message in text:
                return code
        chained = chained.__cause__ or chained.__context__
    return None


def full_error(
    exc: BaseException, folder: Path, tag: str, need: int, resume_from: str | None
) -> DiskFullError | None:
    """``exc`` (raised while writing checkpoint ``tag`` into ``folder``) as a
    :class:`DiskFullError`, when it is a full disk: an ``ENOSPC``/``EDQUOT`` anywhere in its
    chain (or its text), or any error with under 1 MB (or 0.5% of the file system) or no
    inode left free. The line says which: bytes, inodes or the quota."""
    code = _full_errno(exc)
    try:
        stats = os.statvfs(_existing(folder))
    except OSError:
        return None
    free = stats.f_bavail * stats.f_frsize
    total = stats.f_blocks * stats.f_frsize
    no_bytes = free < max(1 << 20, total // 200)
    no_inodes = stats.f_files > 0 and stats.f_favail == 0
    if code is None and not no_bytes and not no_inodes:
        return None
    needs = f"needs about {human(need)}, " if need > 0 else ""
    if code == errno.EDQUOT:
        what = f"disk quota exceeded ({needs}{human(free)} free on the file system)"
    elif no_inodes and not no_bytes:
        what = (
            f"no inodes left on device (all {stats.f_files} files and folders in use, "
            f"{human(free)} free of {human(total)})"
        )
    else:
        what = f"no space left on device ({needs}{human(free)} free of {human(total)})"
    return DiskFullError(_line(folder, tag, what, resume_from))


def _line(folder: Path, tag: str, what: str, resume_from: str | None) -> str:
    then = f"it resumes from {resume_from}" if resume_from else "it starts again"
    return (
        f"checkpoint {tag} does not fit in {folder}: {what}; free space there (or lower "
        f"checkpoint.keep_last) and rerun the same command: {then}"
    )


@contextlib.contextmanager
def room_for(
    folder: Path,
    target: Path,
    need: int,
    resume_from: str | None,
    engine: object,
    *,
    inodes: int = 0,
) -> Iterator[None]:
    """The block writes checkpoint ``target`` (``<folder>/<tag>`` or a staging folder):
    refused first on every rank when any rank's ``folder`` has less free than ``need`` bytes
    or ``inodes`` inodes (the last checkpoint's); a full disk in the middle is a
    :class:`DiskFullError` (one process: its partial files removed, the disk has room
    again)."""
    import torch.distributed as dist

    tag = target.name
    short = shortfall(folder, need, tag, resume_from, inodes)
    if any_rank(short is not None, engine):  # every rank stops, none waits in a barrier
        raise DiskFullError(short or f"checkpoint {tag} does not fit on another rank's disk")
    alone = not dist.is_initialized() or dist.get_world_size() == 1
    with full_disk(folder, target, resume_from, need=need, remove=alone):
        yield


@contextlib.contextmanager
def full_disk(
    folder: Path, target: Path, resume_from: str | None, *, need: int = 0, remove: bool = True
) -> Iterator[None]:
    """A full disk (bytes, inodes, quota: :func:`full_error`) while the block writes
    checkpoint ``target`` into ``folder`` is a :class:`DiskFullError`, ``target`` removed
    first if ``remove`` (no other rank still writes into it) and it is not ``resume_from``;
    other errors pass."""
    tag = target.name
    try:
        yield
    except Exception as exc:
        full = full_error(exc, folder, tag, need, resume_from)
        if full is None:
            raise
        if tag != resume_from and remove:
            shutil.rmtree(target, ignore_errors=True)
        raise full from exc


def check_room(folder: str, tag: str) -> None:
    """Refuse (:class:`DiskFullError`, every rank) a resume whose local checkpoint folder
    has no room for another checkpoint the size of ``tag``: the run would fail at its
    first save, after training up to it. (On object storage each save measures its own
    staging folder: see :func:`shortfall`.)"""
    from bertpipe import fsio
    from bertpipe.staging import is_remote

    short = None
    if not is_remote(folder):
        local = Path(fsio.to_fs(folder)[1])
        short = shortfall(
            local, folder_bytes(local / tag), "the next", tag, folder_inodes(local / tag)
        )
    if any_rank(short is not None, None):
        raise DiskFullError(short or "the next checkpoint does not fit on another rank's disk")


def any_rank(flag: bool, engine: object) -> bool:
    """Whether ``flag`` holds on any rank (a collective with more than one rank; on
    ``engine``'s device, or the process group's)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    device = getattr(engine, "device", None)
    if device is None:
        nccl = "nccl" in str(dist.get_backend()).lower()
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)
