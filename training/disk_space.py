"""A checkpoint that does not fit: said before the save where it can be, and as one line
naming the folder, the bytes needed and the bytes free when the file system fills up in the
middle of one.

torch's writer does not report a full disk as ``ENOSPC``: a ``torch.save`` onto a full file
system raises ``RuntimeError: basic_ios::clear: iostream error``, then ``[enforce fail at
inline_container.cc] unexpected pos`` while closing the archive, with "No space left on
device" nowhere. So :func:`full_error` also asks the file system: a save that failed with
(almost) nothing free left is a full disk.

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

__all__ = ["any_rank", "check_room", "folder_bytes", "full_error", "human", "shortfall"]

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
MARGIN = 1.05
"""A checkpoint may grow a little (the RNG and loader state); ask for 5% more than the last."""


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


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(_existing(path)).free


def shortfall(folder: Path, need: int, tag: str, resume_from: str | None) -> str | None:
    """Why checkpoint ``tag`` (about ``need`` bytes: the size of the last one) will not fit
    in ``folder``; None when it fits or ``need`` is unknown (0)."""
    if need <= 0:
        return None
    free = free_bytes(folder)
    if free >= need * MARGIN:
        return None
    return _line(
        folder, tag, f"needs about {human(need)} (as the last one), {human(free)} free", resume_from
    )


def full_error(
    exc: BaseException, folder: Path, tag: str, need: int, resume_from: str | None
) -> DiskFullError | None:
    """``exc`` (raised while writing checkpoint ``tag`` into ``folder``) as a
    :class:`DiskFullError`, when it is a full disk: an ``ENOSPC``/``EDQUOT`` anywhere in its
    chain, or any error with under 1 MB (or 0.5% of the file system) left free."""
    chained: BaseException | None = exc
    seen = 0
    full = False
    while chained is not None and seen < 10:
        if isinstance(chained, OSError) and chained.errno in _FULL_ERRNOS:
            full = True
        chained = chained.__cause__ or chained.__context__
        seen += 1
    try:
        usage = shutil.disk_usage(_existing(folder))
    except OSError:
        return None
    if not full and usage.free >= max(1 << 20, usage.total // 200):
        return None
    needs = f"needs about {human(need)}, " if need > 0 else ""
    what = f"no space left on device ({needs}{human(usage.free)} free of {human(usage.total)})"
    return DiskFullError(_line(folder, tag, what, resume_from))


def _line(folder: Path, tag: str, what: str, resume_from: str | None) -> str:
    then = f"it resumes from {resume_from}" if resume_from else "it starts again"
    return (
        f"checkpoint {tag} does not fit in {folder}: {what}; free space there (or lower "
        f"checkpoint.keep_last) and rerun the same command: {then}"
    )


@contextlib.contextmanager
def room_for(
    folder: Path, target: Path, need: int, resume_from: str | None, engine: object
) -> Iterator[None]:
    """The block writes checkpoint ``target`` (``<folder>/<tag>`` or a staging folder):
    refused first on every rank when any rank's ``folder`` has less free than ``need`` (the
    last checkpoint's size); a full disk in the middle is a :class:`DiskFullError` (one
    process: its partial files removed, the disk has room again)."""
    import torch.distributed as dist

    tag = target.name
    short = shortfall(folder, need, tag, resume_from)
    if any_rank(short is not None, engine):  # every rank stops, none waits in a barrier
        raise DiskFullError(short or f"checkpoint {tag} does not fit on another rank's disk")
    try:
        yield
    except Exception as exc:
        full = full_error(exc, folder, tag, need, resume_from)
        if full is None:
            raise
        alone = not dist.is_initialized() or dist.get_world_size() == 1
        if tag != resume_from and alone:
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
        short = shortfall(local, folder_bytes(local / tag), "the next", tag)
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
