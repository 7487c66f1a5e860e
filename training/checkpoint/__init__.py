"""Checkpoints: DeepSpeed's own layout plus bertpipe's state, published atomically.

Layout under the checkpoint folder::

    global_step300/            DeepSpeed's files (model, optimizer partitions per rank)
      bertpipe_state.json      phase, steps, data position, MLflow run id, config (rank 0)
      bertpipe_rank00001.json  this rank's completion marker: RNG states, data position and
                               the files it wrote with their sizes and CRC-32 (every rank)
    latest                     the newest WHOLE checkpoint's tag
    bertpipe_index.json        every kept checkpoint: tag, phase, step, phase_end

Every rank writes its part, its completion marker last, then all ranks meet at a barrier,
each checks another rank's marker against the files it sees, and only then does rank 0
rewrite ``latest`` (temporary file + rename). A job killed while saving therefore resumes
from the previous checkpoint, never from half of one. A checkpoint damaged afterwards (a
truncated file, a changed byte) is found at the resume (:func:`latest_complete_tag`, file
checks in :mod:`bertpipe.training.checkpoint.files`), which falls back to the newest whole one.
On object storage (``s3://``, ``gs://``) ranks write locally and upload, and ``latest``
moves once every rank's upload is on the store (:mod:`bertpipe.training.checkpoint.store`). Older
checkpoints beyond ``keep_last`` are deleted after that, except the final checkpoint of each
phase (phase 2 and exports start from it) and the newest good one (see :func:`save`'s
``good``). Our own state is JSON (RNG states base64-encoded): nothing of ours is pickled.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from bertpipe import fsio
from bertpipe.errors import BertpipeError
from bertpipe.training.checkpoint import disk as disk_space
from bertpipe.training.checkpoint import files as ckpt_files
from bertpipe.training.checkpoint import store as ckpt_store
from bertpipe.training.checkpoint.rng import capture_rng, restore_rng
from bertpipe.training.core.faults import NO_FAULTS, Faults

log = logging.getLogger(__name__)

__all__ = [
    "CheckpointDamagedError",
    "CheckpointState",
    "DataChangedError",
    "ResumeState",
    "capture_rng",
    "check_data",
    "check_named",
    "configure",
    "latest_complete_tag",
    "latest_tag",
    "loadable",
    "prune",
    "published_tags",
    "read_state",
    "remove_all",
    "restore_rng",
    "resume_tag",
    "save",
    "save_and_prune",
    "tags",
    "wait_uploads",
]

STATE_FILE = "bertpipe_state.json"
INDEX_FILE = "bertpipe_index.json"
STATE_VERSION = 1


@dataclass
class CheckpointState:
    """What bertpipe needs, beyond DeepSpeed's engine state, to continue a run exactly."""

    phase: str
    phase_index: int
    phase_step: int
    """Optimizer steps done in this phase."""
    global_step: int
    """Optimizer steps done over all phases."""
    phase_complete: bool
    data: dict[str, int]
    """The loader position: epoch and batches consumed (the same on every rank)."""
    world_size: int
    mlflow_run_id: str | None
    samples_seen: int
    """Sequences consumed per rank, over all phases."""
    model: dict[str, Any] = field(default_factory=dict)
    """The ``BertModelConfig`` (what ``bertpipe export`` rebuilds the model from)."""
    zero_stage: int = 0
    precision: str = "fp32"
    data_sha256: dict[str, str] = field(default_factory=dict)
    """sha256 of each phase's data manifest (lineage for exports and fine-tuning runs)."""
    config: dict[str, Any] = field(default_factory=dict)
    skipped_steps: int = 0
    """Optimizer steps skipped for a non-finite loss or gradient, over all phases."""
    loop: dict[str, Any] = field(default_factory=dict)
    """What the loop that saved the checkpoint needs beyond the above, the same on every rank
    (fine-tuning: the best epoch so far and the history of evaluations)."""
    version: int = STATE_VERSION


@dataclass
class ResumeState:
    """A checkpoint to continue from, read once at start-up and passed to whoever needs it."""

    tag: str
    state: CheckpointState
    rank_state: dict[str, Any] | None
    """This rank's own part: RNG states, data position, per-rank loop values (None after a
    universal conversion to another world size)."""

    @classmethod
    def read(cls, folder: str, tag: str, rank: int) -> ResumeState:
        state, rank_state = read_state(folder, tag, rank)
        return cls(tag, state, rank_state)

    def same_world(self, world_size: int) -> bool:
        return self.rank_state is not None and self.state.world_size == world_size


class CheckpointDamagedError(BertpipeError):
    """No whole checkpoint to resume from (every one damaged or incomplete), the one
    ``checkpoint.resume`` names is damaged, or one was not whole after saving: exit 2."""


class DataChangedError(BertpipeError):
    """A resume whose data manifest differs from the one the checkpoint was trained on."""


def check_data(
    state: CheckpointState, current: dict[str, str], tag: str, allow: bool = False
) -> list[str]:
    """Compare the manifest sha256 of every phase the checkpoint has trained on (its phase
    and the ones before it) with ``current`` (phase name -> sha256 of the manifest now).

    A difference raises :class:`DataChangedError` (one line naming the phase and both
    checksums) unless ``allow`` (``checkpoint.allow_data_change``), which logs a warning
    instead. Returns the phases that differ. Checkpoints without checksums pass.
    """
    phases = list(state.data_sha256)
    trained = phases[: state.phase_index + 1] if state.phase in phases else phases
    changed = [p for p in trained if p in current and state.data_sha256[p] != current[p]]
    for phase in changed:
        message = (
            f"checkpoint {tag} was trained on {phase} data with manifest sha256 "
            f"{state.data_sha256[phase]}, the phase's data now has manifest sha256 "
            f"{current[phase]}"
        )
        if not allow:
            raise DataChangedError(
                f"{message}: the data changed since (regenerated?), so the saved data position "
                "would point into other data; restore the data it was trained on, or resume "
                "anyway with checkpoint.allow_data_change=true"
            )
        log.warning("%s; resuming anyway (checkpoint.allow_data_change=true)", message)
    return changed


def _rank_file(rank: int) -> str:
    return f"bertpipe_rank{rank:05d}.json"


def configure(folder: str, local_dir: str | None, publish_timeout_s: float | None) -> None:
    """Settings of a checkpoint folder on object storage (``checkpoint.local_dir``,
    ``checkpoint.publish_timeout_s``); nothing for a local folder."""
    if ckpt_store.is_remote(folder):
        ckpt_store.remote_store(folder, local_dir, publish_timeout_s)


def _attempt_id() -> str:
    """A fresh id of this save, the same on every rank (rank 0's, broadcast)."""
    box = [uuid.uuid4().hex]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return str(box[0])


def save(
    engine: Any,
    folder: str,
    tag: str,
    state: CheckpointState,
    rank: int,
    *,
    good: bool = True,
    rank_extra: dict[str, Any] | None = None,
    faults: Faults = NO_FAULTS,
    keep_last: int | None = None,
    wait: bool = False,
    checksums: bool = True,
) -> None:
    """Save ``engine`` and ``state`` under ``folder/tag``; move ``latest`` once all ranks are
    done. ``good=False`` marks a checkpoint saved while steps were being skipped for
    non-finite values (on preemption or at a phase end): :func:`prune` always keeps the
    newest good one. ``rank_extra``: this rank's own loop values, saved beside its RNG
    states and data position.

    On object storage (:mod:`bertpipe.training.checkpoint.store`) each rank saves into its local
    staging folder and uploads it in the background; rank 0 publishes ``latest`` and prunes
    to ``keep_last`` once every rank's upload is on the store. ``wait``: return only once
    it is published (a phase end, a SIGTERM, the end of a run). ``checksums``: each rank's
    completion marker lists its files' CRC-32 beside their sizes."""
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    remote = ckpt_store.remote_store(folder) if ckpt_store.is_remote(folder) else None
    resume_from = latest_tag(folder)
    if remote is not None:
        remote.wait()  # one checkpoint in flight: the previous one is on the store first
        local = remote.staging(rank)
        need = disk_space.folder_bytes(local)  # this rank's last save (uploaded by now)
        inodes = disk_space.folder_inodes(local)
        shutil.rmtree(local, ignore_errors=True)  # nothing in flight: leftovers of killed saves
        (local / tag).mkdir(parents=True, exist_ok=True)
        attempt = _attempt_id()
    else:
        local = _local_path(folder)
        need = disk_space.folder_bytes(local / resume_from) if resume_from else 0
        inodes = disk_space.folder_inodes(local / resume_from) if resume_from else 0
    # what DeepSpeed's ds_to_universal needs to convert the checkpoint for another world size
    client_state = {
        UNIVERSAL_CHECKPOINT_INFO: {
            UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE
        }
    }
    where = local if remote is None else local / tag
    with disk_space.room_for(where, local / tag, need, resume_from, engine, inodes=inodes):
        engine.save_checkpoint(str(local), tag=tag, client_state=client_state, save_latest=False)
        faults.in_checkpoint_save(tag)
        files = _write_own_part(local / tag, state, rank, rank_extra, checksums)
    if remote is None:
        dist.barrier()
        _publish_local(engine, folder, tag, state, rank, good=good, resume_from=resume_from)
        log.info("checkpoint %s saved in %s", tag, local)
        return
    world = state.world_size

    def publish() -> None:
        assert remote is not None
        remote.wait_complete(tag, world, attempt)
        remote.publish_latest(tag)
        _update_index(folder, tag, state, good)
        if keep_last is not None:
            prune(folder, keep_last)
        log.info("checkpoint %s published in %s", tag, folder)

    remote.upload(
        tag,
        rank,
        world,
        attempt,
        publish=publish if rank == 0 else None,
        background=not wait,
        in_upload=faults.in_checkpoint_upload,
        checksums={n: e["crc32"] for n, e in files.items() if "crc32" in e},
    )
    if wait:
        dist.barrier()  # every rank returns once rank 0 has published
    else:
        log.debug("checkpoint %s saved locally, uploading to %s", tag, folder)


def _write_own_part(
    folder: Path,
    state: CheckpointState,
    rank: int,
    rank_extra: dict[str, Any] | None,
    checksums: bool,
) -> dict[str, dict[str, Any]]:
    """This rank's part of a checkpoint beside DeepSpeed's files in ``folder`` (the tag's):
    bertpipe's state (rank 0), then the rank's completion marker, its RNG states, data
    position and the files it wrote with their sizes and CRC-32 (:mod:`.ckpt_files`); returns
    that list."""
    folder.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        fsio.atomic_write_text(str(folder / STATE_FILE), json.dumps(asdict(state), indent=1))
    rank_name = _rank_file(rank)
    own = ckpt_files.owned_files(folder, rank, exclude=(rank_name,))
    files = ckpt_files.record(folder, own, checksums)
    rank_state = {"rng": capture_rng(), "data": state.data, "samples_seen": state.samples_seen}
    if rank_extra:
        rank_state["loop"] = rank_extra
    rank_state["files"] = files
    fsio.atomic_write_text(str(folder / rank_name), json.dumps(rank_state))
    return files


def _publish_local(
    engine: Any,
    folder: str,
    tag: str,
    state: CheckpointState,
    rank: int,
    *,
    good: bool,
    resume_from: str | None,
) -> None:
    """Move ``latest`` to ``tag`` once every rank wrote its part (after a barrier): each rank
    first checks another rank's marker against the files it sees (sizes; a rank whose files
    the others cannot see, such as a folder local to each node, is caught at the first save),
    then rank 0 writes ``latest`` and the index. A full disk there is the save's
    :class:`~bertpipe.errors.DiskFullError`, with ``tag`` removed."""
    where = _Folder(folder)
    neighbour = (rank + 1) % state.world_size
    why = ckpt_files.agree(where.damaged_markers(tag, [neighbour], deep=False))
    if why:
        raise CheckpointDamagedError(
            f"checkpoint {tag} in {folder} is not whole after every rank saved it ({why}): "
            "checkpoint.dir must be one folder every rank sees (a shared file system) or "
            f"object storage; `latest` still names {resume_from or 'nothing'}"
        )
    local = _local_path(folder)
    failed: BaseException | None = None
    if rank == 0:
        try:  # every rank is done writing: rank 0 may remove the tag on a full disk
            with disk_space.full_disk(local, local / tag, resume_from):
                fsio.atomic_write_text(str(local / "latest"), tag)
                _update_index(folder, tag, state, good)
        except Exception as exc:  # re-raised below, once every rank knows
            failed = exc
    if disk_space.any_rank(failed is not None, engine):
        if failed is not None:
            raise failed
        raise BertpipeError(f"checkpoint {tag}: rank 0 could not publish it (see its error)")


def wait_uploads() -> None:
    """Wait for this process's checkpoint uploads in flight (and, on rank 0, their publish);
    raise the first one's error. Call before a run ends."""
    ckpt_store.wait_all()


def save_and_prune(
    engine: Any,
    folder: str,
    state: CheckpointState,
    rank: int,
    *,
    keep_last: int,
    where: str,
    good: bool = True,
    rank_extra: dict[str, Any] | None = None,
    faults: Faults = NO_FAULTS,
    wait: bool = False,
    checksums: bool = True,
) -> str:
    """A run's checkpoint of its ``global_step``, as both training loops save one: refused
    if any weight is not finite (all ranks agree; ``where`` names the step in the error),
    saved and published by :func:`save`, older ones pruned (rank 0); every rank returns the
    tag once all are done (on object storage: once saved locally and, with ``wait``,
    published)."""
    from bertpipe.training.core.guard import NonFiniteError, weights_finite

    tag = f"global_step{state.global_step}"
    if not weights_finite(engine):  # never publish NaN weights
        raise NonFiniteError(
            f"{where}: the weights are not finite, so {tag} was not saved; the latest "
            f"checkpoint is {latest_tag(folder) or 'none'}"
        )
    if ckpt_store.is_remote(folder):  # published and pruned by rank 0 after the uploads
        save(
            engine,
            folder,
            tag,
            state,
            rank,
            good=good,
            rank_extra=rank_extra,
            faults=faults,
            keep_last=keep_last,
            wait=wait,
            checksums=checksums,
        )
        return tag
    save(
        engine,
        folder,
        tag,
        state,
        rank,
        good=good,
        rank_extra=rank_extra,
        faults=faults,
        checksums=checksums,
    )
    if rank == 0:
        prune(folder, keep_last)
    dist.barrier()
    return tag


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
