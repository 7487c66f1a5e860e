"""A checkpoint folder, local or on object storage: its ``latest`` tag, its index, which
checkpoints are whole (sizes and CRC-32 of what every rank's marker lists), which one a resume
takes, reading a checkpoint's state, making one loadable locally, pruning."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from bertpipe import fsio
from bertpipe.training.checkpoint import files as ckpt_files
from bertpipe.training.checkpoint import store as ckpt_store
from bertpipe.training.checkpoint.state import (
    INDEX_FILE,
    STATE_FILE,
    STATE_VERSION,
    CheckpointDamagedError,
    CheckpointState,
    _rank_file,
)

log = logging.getLogger(__name__)


def resume_tag(folder: str, resume: str, checksums: bool = True) -> str | None:
    """The checkpoint ``checkpoint.resume`` names: ``auto`` the latest whole one (None if
    there is none; see :func:`latest_complete_tag`), ``none`` None (refused if ``folder``
    holds checkpoints, which a new run would mix with its own), else the tag itself, refused
    (:class:`CheckpointDamagedError`) if it is damaged. ``checksums``: the CRC-32 of the
    files are checked too (``checkpoint.verify_checksums``), not only their sizes."""
    from bertpipe.config import ConfigError

    if resume == "auto":
        return latest_complete_tag(folder, checksums)
    if resume == "none":
        if has_checkpoints(folder):
            raise ConfigError(
                "checkpoint.resume",
                f"is none but {folder} holds checkpoints: resume with auto, or use another "
                "output / checkpoint.dir",
            )
        return None
    check_named(folder, resume, checksums)
    return resume


def check_named(folder: str, tag: str, checksums: bool = True) -> None:
    """Refuse checkpoint ``tag``, named by the user or the index (a phase's end), if what
    its markers list is damaged (one line naming it, exit 2). A checkpoint without markers
    (a universal conversion) or without bertpipe's state (:func:`read_state` names that)
    passes."""
    where = _Folder(folder)
    if where.read_text(f"{tag}/{STATE_FILE}") is None:
        return
    why = ckpt_files.agree(where.damaged(tag, deep=checksums, every_rank=False))
    if why:
        raise CheckpointDamagedError(
            f"checkpoint {tag} in {folder} is incomplete or damaged ({why}): choose another "
            "one with checkpoint.resume=<tag>, or resume=auto for the newest whole one"
        )


class _Folder:
    """The small files of a checkpoint folder, local or on object storage."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.remote = ckpt_store.remote_store(folder) if ckpt_store.is_remote(folder) else None

    def read_text(self, name: str) -> str | None:
        if self.remote is not None:
            return self.remote.read_text(name)
        path = _local_path(self.folder) / name
        return path.read_text() if path.exists() else None

    def write_text(self, name: str, text: str) -> None:
        if self.remote is not None:
            self.remote.write_text(name, text)
        else:
            fsio.atomic_write_text(str(_local_path(self.folder) / name), text)

    def tags(self) -> list[str]:
        if self.remote is not None:
            return self.remote.tags()
        local = _local_path(self.folder)
        if not local.exists():
            return []
        return sorted(
            p.name for p in local.iterdir() if p.is_dir() and p.name.startswith("global_step")
        )

    def remove_tag(self, tag: str) -> None:
        if self.remote is not None:
            self.remote.remove_tag(tag)
        else:
            shutil.rmtree(_local_path(self.folder) / tag, ignore_errors=True)

    def remove(self, name: str) -> None:
        if self.remote is not None:
            self.remote.remove(name)
        else:
            (_local_path(self.folder) / name).unlink(missing_ok=True)

    def damaged(self, tag: str, *, deep: bool, every_rank: bool = True) -> str:
        """Why checkpoint ``tag`` is not whole ('' if it is): bertpipe's state parses and,
        on a local folder, every rank's completion marker is there (with ``every_rank``;
        a universal conversion has none) and the files of this process's share of the
        markers check (:meth:`damaged_markers`); on object storage every rank's upload marker
        and every file it lists with its size (:meth:`RemoteCheckpoints.missing`; their
        CRC-32 is checked as they are downloaded). Combine the ranks' answers with
        :func:`~bertpipe.training.checkpoint.files.agree`."""
        if self.remote is not None:
            why = self.remote.missing(tag, markers_required=every_rank)
            if why:
                return why
        raw = self.read_text(f"{tag}/{STATE_FILE}")
        if raw is None:
            return f"{STATE_FILE} is missing"
        try:
            world = int(json.loads(raw).get("world_size", 1))
        except (ValueError, AttributeError, TypeError):
            return f"{STATE_FILE} does not parse (truncated?)"
        if self.remote is not None:
            return ""
        local = _local_path(self.folder) / tag
        if every_rank:
            for rank in range(world):
                if not (local / _rank_file(rank)).exists():
                    return f"rank {rank}'s file {_rank_file(rank)} is missing"
        size, me = _process_share()
        share = [rank for rank in range(world) if rank % size == me]
        return self.damaged_markers(tag, share, deep=deep, every_rank=every_rank)

    def damaged_markers(
        self, tag: str, ranks: list[int], *, deep: bool, every_rank: bool = True
    ) -> str:
        """Why the completion markers of ``ranks`` in local checkpoint ``tag`` or the files
        they list are not whole ('' if they are): a marker that does not parse, a file
        missing or of another size, with ``deep`` one of another CRC-32. Markers saved
        before the lists existed are checked for presence only (logged)."""
        local = _local_path(self.folder) / tag
        unlisted = False
        for rank in ranks:
            name = _rank_file(rank)
            try:
                raw = (local / name).read_bytes()  # opened: fresh sizes on NFS too
            except FileNotFoundError:
                if every_rank:
                    return f"rank {rank}'s file {name} is missing"
                continue
            try:
                files = json.loads(raw).get("files")
            except (ValueError, AttributeError):
                return f"{name} does not parse (truncated?)"
            if files is None:
                unlisted = True
                continue
            why = ckpt_files.verify(local, files, deep)
            if why:
                return why
        if unlisted:
            log.info(
                "checkpoint %s was saved without file sizes (by an older bertpipe): its "
                "files were checked for presence only",
                tag,
            )
        return ""


def _process_share() -> tuple[int, int]:
    """(world size, rank) of this process's job; (1, 0) outside one."""
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def latest_tag(folder: str) -> str | None:
    """The tag ``latest`` names (None without one)."""
    text = _Folder(folder).read_text("latest")
    return text.strip() if text else None


def latest_complete_tag(
    folder: str, checksums: bool = True, taking: str = "resuming from"
) -> str | None:
    """``latest`` if that checkpoint is whole (:meth:`_Folder.damaged`: sizes, and the CRC-32
    of its files with ``checksums``), else the newest whole one of the index, with one
    warning line naming what was damaged; None if the folder has no checkpoint. Every rank
    gets the same answer. No whole checkpoint at all: :class:`CheckpointDamagedError`
    (exit 2)."""
    where = _Folder(folder)
    latest = latest_tag(folder)
    index = sorted(_read_index(folder), key=lambda e: e["global_step"], reverse=True)
    present = set(where.tags()) if index else set()
    candidates = [latest] if latest else []
    candidates += [e["tag"] for e in index if e["tag"] != latest and e["tag"] in present]
    skipped: list[tuple[str, str]] = []  # (tag, why)
    for tag in candidates:
        why = ckpt_files.agree(where.damaged(tag, deep=checksums))
        if not why:
            if skipped and _process_share()[1] == 0:  # one line, not one per rank
                log.warning(
                    "%s: %s %s, the newest whole checkpoint",
                    _damaged_line(folder, skipped),
                    taking,
                    tag,
                )
            return tag
        skipped.append((tag, why))
    if not skipped:
        return None
    raise CheckpointDamagedError(
        f"{folder} has no whole checkpoint to resume from: {_damaged_line(folder, skipped)}; "
        "restore a checkpoint's files and resume from it with checkpoint.resume=<tag>, or "
        "start afresh with another checkpoint.dir"
    )


def _damaged_line(folder: str, skipped: list[tuple[str, str]]) -> str:
    if len(skipped) == 1:
        tag, why = skipped[0]
        return f"checkpoint {tag} in {folder} is incomplete or damaged ({why})"
    listed = ", ".join(f"{tag} ({why})" for tag, why in skipped)
    return f"checkpoints {listed} in {folder} are incomplete or damaged"


def has_checkpoints(folder: str) -> bool:
    return bool(_Folder(folder).tags())


def tags(folder: str) -> list[str]:
    """The ``global_step*`` checkpoints in ``folder`` (complete or not)."""
    return _Folder(folder).tags()


def published_tags(folder: str) -> list[str]:
    """The checkpoints in ``folder`` that were published whole (``latest`` moved to them: the
    index lists them) from a good step and are still there, oldest first. What a reader that
    is not the run (a watcher) may take: a tag folder being written is not among them."""
    present = set(tags(folder))
    index = sorted(_read_index(folder), key=lambda e: e["global_step"])
    return [e["tag"] for e in index if e["tag"] in present and e.get("good", True)]


def read_state(folder: str, tag: str, rank: int) -> tuple[CheckpointState, dict[str, Any] | None]:
    """bertpipe's state of checkpoint ``tag`` and this rank's own part (None if absent, e.g.
    after a universal conversion to another world size)."""
    where = _Folder(folder)
    raw_text = where.read_text(f"{tag}/{STATE_FILE}")
    path = fsio.join(folder, tag, STATE_FILE)
    if raw_text is None:
        raise FileNotFoundError(
            f"{path} is missing: {tag} was not written by bertpipe or is incomplete; "
            "choose another checkpoint with checkpoint.resume=<tag>"
        )
    redo = "choose another checkpoint with checkpoint.resume=<tag>"
    raw = fsio.parse_json(raw_text, path, redo)
    if raw.get("version") != STATE_VERSION:
        raise ValueError(f"{path} has state version {raw.get('version')}, expected {STATE_VERSION}")
    state = CheckpointState(**raw)
    rank_text = where.read_text(f"{tag}/{_rank_file(rank)}")
    rank_url = fsio.join(folder, tag, _rank_file(rank))
    rank_state = fsio.parse_json(rank_text, rank_url, redo) if rank_text is not None else None
    return state, rank_state


@contextlib.contextmanager
def loadable(folder: str, tag: str, rank: int | None, world_size: int | None) -> Iterator[str]:
    """A local folder from which DeepSpeed loads checkpoint ``tag`` on rank ``rank``: the
    folder itself, or on object storage a download of what that rank needs (all of it with
    ``rank`` None: an export), removed after the block."""
    if not ckpt_store.is_remote(folder):
        yield str(_local_path(folder))
        return
    with ckpt_store.remote_store(folder).fetched(tag, rank, world_size) as local:
        yield local


def _update_index(folder: str, tag: str, state: CheckpointState, good: bool = True) -> None:
    index = _read_index(folder)
    index = [e for e in index if e["tag"] != tag]
    index.append(
        {
            "tag": tag,
            "phase": state.phase,
            "global_step": state.global_step,
            "phase_end": state.phase_complete,
            "good": good,
        }
    )
    index.sort(key=lambda e: e["global_step"])
    _Folder(folder).write_text(INDEX_FILE, json.dumps(index, indent=1))


def _read_index(folder: str) -> list[dict[str, Any]]:
    text = _Folder(folder).read_text(INDEX_FILE)
    advice = "delete it (bertpipe writes it again; pruning forgets the older checkpoints)"
    return fsio.parse_json(text, fsio.join(folder, INDEX_FILE), advice) if text else []


def prune(folder: str, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` checkpoints, keeping every phase end, ``latest``
    and the newest good checkpoint (one not saved during a run of skipped non-finite steps;
    entries without the mark count as good) (rank 0)."""
    where = _Folder(folder)
    index = _read_index(folder)
    latest = latest_tag(folder)
    good = [e for e in index if e.get("good", True)]
    last_good = max(good, key=lambda e: e["global_step"])["tag"] if good else None
    ordinary = [e for e in index if not e["phase_end"] and e["tag"] not in (latest, last_good)]
    newest = {e["tag"] for e in sorted(index, key=lambda e: e["global_step"])[-keep_last:]}
    removed = []
    for entry in ordinary:
        if entry["tag"] not in newest:
            removed.append(entry["tag"])
    if removed:
        # the index first: a crash in between leaves folders no index names, never the reverse
        remaining = [e for e in index if e["tag"] not in removed]
        where.write_text(INDEX_FILE, json.dumps(remaining, indent=1))
        for tag in removed:
            where.remove_tag(tag)
        log.info("removed old checkpoints %s", ", ".join(removed))
    return removed


def phase_end_tag(folder: str, phase: str) -> str | None:
    """The final checkpoint of ``phase`` (from the index), if it was saved."""
    for entry in reversed(_read_index(folder)):
        if entry["phase"] == phase and entry["phase_end"]:
            return str(entry["tag"])
    return None


def remove_all(folder: str) -> list[str]:
    """Delete every checkpoint bertpipe wrote in ``folder`` (its ``global_step*`` folders,
    ``latest`` and the index), and the folder if that leaves it empty (rank 0). For runs
    whose product is elsewhere once they complete (fine-tuning keeps ``best/``)."""
    where = _Folder(folder)
    if where.remote is not None:
        where.remote.wait()
    removed = where.tags()
    for tag in removed:
        where.remove_tag(tag)
    for name in ("latest", INDEX_FILE):
        where.remove(name)
    if where.remote is None:
        local = _local_path(folder)
        if local.is_dir() and not any(local.iterdir()):
            local.rmdir()
    return removed


def _local_path(folder: str) -> Path:
    """A local (or mounted shared) checkpoint folder as a path."""
    _, path = fsio.to_fs(folder)
    return Path(path)
