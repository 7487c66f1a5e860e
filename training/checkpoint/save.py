"""Saving a checkpoint: every rank writes its part and its completion marker, the ranks check
each other's files, then rank 0 moves ``latest`` (on object storage, once every rank's upload is
on the store); older checkpoints are pruned."""

from __future__ import annotations

import json
import logging
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from bertpipe import fsio
from bertpipe.errors import BertpipeError
from bertpipe.training.checkpoint import disk as disk_space
from bertpipe.training.checkpoint import files as ckpt_files
from bertpipe.training.checkpoint import store as ckpt_store
from bertpipe.training.checkpoint.folder import (
    _Folder,
    _local_path,
    _update_index,
    latest_tag,
    prune,
)
from bertpipe.training.checkpoint.rng import capture_rng
from bertpipe.training.checkpoint.state import (
    STATE_FILE,
    CheckpointDamagedError,
    CheckpointState,
    _rank_file,
)
from bertpipe.training.core.faults import NO_FAULTS, Faults

log = logging.getLogger(__name__)


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
