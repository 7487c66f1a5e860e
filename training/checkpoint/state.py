"""What a checkpoint records beside DeepSpeed's files: the run's state (phase, steps, data
position, MLflow run id, config) written by rank 0, each rank's own part, the names of the
files, and the check that a resume reads the data it was trained on."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from bertpipe.errors import BertpipeError

log = logging.getLogger(__name__)


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
        from bertpipe.training.checkpoint.folder import read_state  # reads through the folder

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
