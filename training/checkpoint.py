"""Checkpoints: DeepSpeed's own layout plus bertpipe's state, published atomically.

Layout under the checkpoint folder::

    global_step300/            DeepSpeed's files (model, optimizer partitions per rank)
      bertpipe_state.json      phase, steps, data position, MLflow run id, config (rank 0)
      bertpipe_rank00001.json  this rank's RNG states and data position (every rank)
    latest                     the newest COMPLETE checkpoint's tag
    bertpipe_index.json        every kept checkpoint: tag, phase, step, phase_end

Every rank writes its part, then all ranks meet at a barrier, and only then does rank 0
rewrite ``latest`` (temporary file + rename). A job killed while saving therefore resumes
from the previous checkpoint, never from half of one. Older checkpoints beyond ``keep_last``
are deleted after that, except the final checkpoint of each phase (phase 2 and exports start
from it) and the newest good one (see :func:`save`'s ``good``). Our own state is JSON (RNG
states base64-encoded): nothing of ours is pickled.
"""

from __future__ import annotations

import base64
import json
import logging
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bertpipe import fsio
from bertpipe.errors import BertpipeError
from bertpipe.training.faults import FAULT_IN_SAVE, NO_FAULTS, Faults

log = logging.getLogger(__name__)

__all__ = [
    "FAULT_IN_SAVE",
    "CheckpointState",
    "DataChangedError",
    "ResumeState",
    "capture_rng",
    "check_data",
    "latest_tag",
    "prune",
    "read_state",
    "remove_all",
    "restore_rng",
    "resume_tag",
    "save",
    "save_and_prune",
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


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as JSON-safe values."""
    state: dict[str, Any] = {
        "python": _jsonable(random.getstate()),
        "numpy": _numpy_state(),
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
    }
    if torch.cuda.is_available():
        state["cuda"] = [
            base64.b64encode(s.numpy().tobytes()).decode("ascii")
            for s in torch.cuda.get_rng_state_all()
        ]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(_tupled(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(
        torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8)
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [
                torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
                for s in state["cuda"]
            ]
        )


def _numpy_state() -> list[Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    return [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value


def _tupled(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tupled(v) for v in value)
    return value


def _rank_file(rank: int) -> str:
    return f"bertpipe_rank{rank:05d}.json"


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
) -> None:
    """Save ``engine`` and ``state`` under ``folder/tag``; move ``latest`` once all ranks are
    done. ``good=False`` marks a checkpoint saved while steps were being skipped for
    non-finite values (on preemption or at a phase end): :func:`prune` always keeps the
    newest good one. ``rank_extra``: this rank's own loop values, saved beside its RNG
    states and data position."""
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    local = _local_path(folder)
    # what DeepSpeed's ds_to_universal needs to convert the checkpoint for another world size
    client_state = {
        UNIVERSAL_CHECKPOINT_INFO: {
            UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE
        }
    }
    engine.save_checkpoint(str(local), tag=tag, client_state=client_state, save_latest=False)
    faults.in_checkpoint_save(tag)
    rank_state = {"rng": capture_rng(), "data": state.data, "samples_seen": state.samples_seen}
    if rank_extra:
        rank_state["loop"] = rank_extra
    (local / tag).mkdir(parents=True, exist_ok=True)
    fsio.atomic_write_text(str(local / tag / _rank_file(rank)), json.dumps(rank_state))
    if rank == 0:
        fsio.atomic_write_text(str(local / tag / STATE_FILE), json.dumps(asdict(state), indent=1))
    dist.barrier()
    if rank == 0:
        fsio.atomic_write_text(str(local / "latest"), tag)
        _update_index(local, tag, state, good)
    dist.barrier()
    log.info("checkpoint %s saved in %s", tag, local)


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
) -> str:
    """A run's checkpoint of its ``global_step``, as both training loops save one: refused
    if any weight is not finite (all ranks agree; ``where`` names the step in the error),
    saved and published by :func:`save`, older ones pruned (rank 0); every rank returns the
    tag once all are done."""
    from bertpipe.training.guard import NonFiniteError, weights_finite

    tag = f"global_step{state.global_step}"
    if not weights_finite(engine):  # never publish NaN weights
        raise NonFiniteError(
            f"{where}: the weights are not finite, so {tag} was not saved; the latest "
            f"checkpoint is {latest_tag(folder) or 'none'}"
        )
    save(engine, folder, tag, state, rank, good=good, rank_extra=rank_extra, faults=faults)
    if rank == 0:
        prune(folder, keep_last)
    dist.barrier()
    return tag


def resume_tag(folder: str, resume: str) -> str | None:
    """The checkpoint ``checkpoint.resume`` names: ``auto`` the latest (None if there is
    none), ``none`` None (refused if ``folder`` holds checkpoints, which a new run would
    mix with its own), else the tag itself."""
    from bertpipe.config import ConfigError

    if resume == "auto":
        return latest_tag(folder)
    if resume == "none":
        if has_checkpoints(folder):
            raise ConfigError(
                "checkpoint.resume",
                f"is none but {folder} holds checkpoints: resume with auto, or use another "
                "output / checkpoint.dir",
            )
        return None
    return resume


def latest_tag(folder: str) -> str | None:
    path = _local_path(folder) / "latest"
    return path.read_text().strip() if path.exists() else None


def has_checkpoints(folder: str) -> bool:
    local = _local_path(folder)
    return local.exists() and any(
        p.is_dir() and p.name.startswith("global_step") for p in local.iterdir()
    )


def read_state(folder: str, tag: str, rank: int) -> tuple[CheckpointState, dict[str, Any] | None]:
    """bertpipe's state of checkpoint ``tag`` and this rank's own part (None if absent, e.g.
    after a universal conversion to another world size)."""
    local = _local_path(folder) / tag
    path = local / STATE_FILE
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: {tag} was not written by bertpipe or is incomplete; "
            "choose another checkpoint with checkpoint.resume=<tag>"
        )
    raw = json.loads(path.read_text())
    if raw.get("version") != STATE_VERSION:
        raise ValueError(f"{path} has state version {raw.get('version')}, expected {STATE_VERSION}")
    state = CheckpointState(**raw)
    rank_path = local / _rank_file(rank)
    rank_state = json.loads(rank_path.read_text()) if rank_path.exists() else None
    return state, rank_state


def _update_index(local: Path, tag: str, state: CheckpointState, good: bool = True) -> None:
    index = _read_index(local)
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
    fsio.atomic_write_text(str(local / INDEX_FILE), json.dumps(index, indent=1))


def _read_index(local: Path) -> list[dict[str, Any]]:
    path = local / INDEX_FILE
    return json.loads(path.read_text()) if path.exists() else []


def prune(folder: str, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` checkpoints, keeping every phase end, ``latest``
    and the newest good checkpoint (one not saved during a run of skipped non-finite steps;
    entries without the mark count as good) (rank 0)."""
    local = _local_path(folder)
    index = _read_index(local)
    latest = latest_tag(folder)
    good = [e for e in index if e.get("good", True)]
    last_good = max(good, key=lambda e: e["global_step"])["tag"] if good else None
    ordinary = [e for e in index if not e["phase_end"] and e["tag"] not in (latest, last_good)]
    newest = {e["tag"] for e in sorted(index, key=lambda e: e["global_step"])[-keep_last:]}
    removed = []
    for entry in ordinary:
        if entry["tag"] not in newest:
            shutil.rmtree(local / entry["tag"], ignore_errors=True)
            removed.append(entry["tag"])
    if removed:
        remaining = [e for e in index if e["tag"] not in removed]
        fsio.atomic_write_text(str(local / INDEX_FILE), json.dumps(remaining, indent=1))
        log.info("removed old checkpoints %s", ", ".join(removed))
    return removed


def phase_end_tag(folder: str, phase: str) -> str | None:
    """The final checkpoint of ``phase`` (from the index), if it was saved."""
    for entry in reversed(_read_index(_local_path(folder))):
        if entry["phase"] == phase and entry["phase_end"]:
            return str(entry["tag"])
    return None


def remove_all(folder: str) -> list[str]:
    """Delete every checkpoint bertpipe wrote in ``folder`` (its ``global_step*`` folders,
    ``latest`` and the index), and the folder if that leaves it empty (rank 0). For runs
    whose product is elsewhere once they complete (fine-tuning keeps ``best/``)."""
    local = _local_path(folder)
    if not local.is_dir():
        return []
    removed = []
    for path in sorted(local.iterdir()):
        if path.is_dir() and path.name.startswith("global_step"):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    for name in ("latest", INDEX_FILE):
        (local / name).unlink(missing_ok=True)
    if not any(local.iterdir()):
        local.rmdir()
    return removed


def _local_path(folder: str) -> Path:
    """DeepSpeed saves to a local (or mounted shared) filesystem path."""
    fs, path = fsio.to_fs(folder)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol not in ("file", "local"):
        raise ValueError(
            f"checkpoint folder {folder} must be a local or mounted path (DeepSpeed writes "
            "checkpoints with torch.save); sync it to object storage separately"
        )
    return Path(path)
