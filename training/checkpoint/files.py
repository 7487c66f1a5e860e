"""What makes a checkpoint whole: each rank's list of the files it wrote, with their sizes and
CRC-32 checksums, and the check of a checkpoint against those lists.

Every rank's completion marker lists the files it wrote (``files`` in its
``bertpipe_rankNNNNN.json``, written after them: DeepSpeed's files that rank owns and, on
rank 0, ``bertpipe_state.json``), each with its size and CRC-32, computed right after
DeepSpeed wrote them (they are still in the page cache). A checkpoint is *whole* when every
rank's marker parses and every file it lists is there with its size (a ``stat``: always
checked) and, for a *deep* check, its CRC-32 (a read: done at resume on the checkpoint about
to be loaded, each rank reading the files of its share of the markers).

CRC-32 rather than sha256: the threat is damage (a truncated copy, a half-written file, bit
rot), not a forger, and ``zlib.crc32`` runs at about 4x the speed of ``hashlib.sha256`` on
the machines measured (docs/training.md, "Checkpoints and resuming"). A truncated file is
caught by its size alone.

Checkpoints saved before the lists existed (no ``files`` in the markers) are checked for
presence only, as before, with a log line saying so.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import zlib
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "agree",
    "crc32_file",
    "file_rank",
    "owned_files",
    "record",
    "verify",
]

_RANK_OF_FILE = re.compile(r"(?:_pp_rank_|bertpipe_rank|bertpipe_upload_rank)0*(\d+)[_.]")
_CHUNK = 8 << 20


def file_rank(name: str) -> int | None:
    """The rank a checkpoint file belongs to (DeepSpeed's ``*_pp_rank_N_*`` partitions and
    bertpipe's per-rank files); None for files one rank writes for all (model states at ZeRO
    0-2, bertpipe's state), which rank 0 writes and lists."""
    match = _RANK_OF_FILE.search(posixpath.basename(name))
    return int(match.group(1)) if match else None


def crc32_file(path: Path | str) -> str:
    """The CRC-32 of the file at ``path`` as 8 hex digits, read in 8 MB chunks."""
    value = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            value = zlib.crc32(view[:n], value)
    return f"{value:08x}"


def owned_files(folder: Path, rank: int, exclude: tuple[str, ...] = ()) -> list[str]:
    """The files under ``folder`` (a checkpoint's tag folder, relative POSIX names) that rank
    ``rank`` wrote: those named for it, and on rank 0 those named for no rank. Temporary files
    of atomic writes (dot files) and ``exclude`` are left out."""
    names = []
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if not path.is_file() or name in exclude or any(p.startswith(".") for p in name.split("/")):
            continue
        owner = file_rank(name)
        if owner == rank or (owner is None and rank == 0):
            names.append(name)
    return names


def record(folder: Path, names: list[str], checksums: bool = True) -> dict[str, dict[str, Any]]:
    """``{name: {"size": bytes, "crc32": hex}}`` of ``names`` under ``folder`` (sizes only
    without ``checksums``)."""
    listed: dict[str, dict[str, Any]] = {}
    for name in names:
        listed[name] = {"size": (folder / name).stat().st_size}
        if checksums:
            listed[name]["crc32"] = crc32_file(folder / name)
    return listed


def verify(folder: Path, files: dict[str, Any], deep: bool) -> str:
    """Why the files ``files`` (a marker's list: name -> ``{"size", "crc32"}``, or name ->
    size as object storage markers list them) under ``folder`` are not whole ('' when they
    are): missing, another size, or (``deep``) another CRC-32."""
    for name, entry in files.items():
        size = entry["size"] if isinstance(entry, dict) else int(entry)
        path = folder / name
        try:
            with open(path, "rb") as f:  # opened, not stat'ed: NFS revalidates its size
                found = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if found != size:
            return f"{name} has {found} bytes, not {size}"
        crc = entry.get("crc32") if isinstance(entry, dict) else None
        if deep and crc and crc32_file(path) != crc:
            return f"{name} has another CRC-32 than when it was saved ({size} bytes)"
    return ""


def agree(why: str) -> str:
    """The first rank's non-empty ``why`` (every rank gets the same answer; a collective when
    the process group has more than one rank)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return why
    answers: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(answers, why)
    return next((a for a in answers if a), "")
