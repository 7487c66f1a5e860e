"""A run's checkpoints, as both stages keep them: what one holds, whether a run continues from
one, and how.

One :class:`CheckpointManager` per run (a pre-training job, a fine-tuning run) owns its
checkpoint folder (:mod:`bertpipe.training.checkpoint`: DeepSpeed's layout plus bertpipe's
JSON state, on a local folder or object storage):

- **Whether to continue** (:meth:`~CheckpointManager.resume_point`,
  :meth:`~CheckpointManager.continue_from`): the checkpoint ``checkpoint.resume`` names, its
  data checked against this run's (:func:`~bertpipe.training.checkpoint.check_data`), its
  config against this one (:mod:`bertpipe.training.core.resume`: changes logged, fixed settings
  refused); the run's counters (:class:`Progress`) and skipped-step count come from it.
- **How** (:meth:`~CheckpointManager.restore`): the engine's state, this config's optimizer
  settings and schedule over it, and on the same world size every rank's RNG states and
  loader position. On another world size (``checkpoint.universal``, or ZeRO 0) the RNG
  streams restart and the stage re-derives its loader position from the step reached; both
  stages take it this way.
- **What a checkpoint holds** (:meth:`~CheckpointManager.save`): the run's counters, the
  stage's part (:class:`StageState`: phase, loop values such as fine-tuning's best epoch)
  and the loader position of the last completed step (:class:`Position`).
- After an unexpected error, :meth:`~CheckpointManager.save_after_error` saves the last
  completed step; :meth:`~CheckpointManager.uploads_finished` makes sure uploads in flight
  are on the store before the run returns, without hiding the error that ended it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bertpipe.training import checkpoint as ckpt
from bertpipe.training.checkpoint import disk as disk_space
from bertpipe.training.core.config import CheckpointConfig
from bertpipe.training.core.engine import DistInfo, EngineSpec
from bertpipe.training.core.faults import NO_FAULTS, Faults
from bertpipe.training.core.guard import SkipGuard, weights_finite
from bertpipe.training.core.optim import apply_settings, reset_step_counters
from bertpipe.training.core.resume import (
    changed_settings,
    check_changes,
    log_changes,
    with_model_shape,
)

log = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "Position", "Progress", "Restored", "StageState"]


@dataclass
class Progress:
    """The run's counters and MLflow run, carried from checkpoint to checkpoint."""

    global_step: int = 0
    """Optimizer steps done over the whole run (all phases)."""
    samples_seen: int = 0
    """Sequences consumed per rank over the whole run."""
    run_id: str | None = None


@dataclass(frozen=True)
class Position:
    """A completed step of a stage and this rank's loader position after it."""

    step: int
    data: dict[str, int]


@dataclass(frozen=True)
class StageState:
    """What a stage's checkpoint holds beyond the run's counters and the loader position."""

    phase: str
    phase_index: int = 0
    phase_complete: bool = False
    loop: dict[str, Any] = field(default_factory=dict)
    """Values of the stage's loop, the same on every rank (fine-tuning: best epoch, history)."""
    rank_loop: dict[str, Any] | None = None
    """This rank's own loop values (fine-tuning: the epoch's partial loss)."""


@dataclass(frozen=True)
class Restored:
    """Where a restored stage continues."""

    step: int
    """The stage's last completed step."""
    data: dict[str, int] | None
    """This rank's loader position; None on another world size (the stage derives it)."""
    rank_loop: dict[str, Any] = field(default_factory=dict)
    """This rank's own loop values (empty on another world size)."""


class CheckpointManager:
    """The checkpoints of one run on this rank (see the module docstring).

    ``config``: the run's resolved config as a redacted dict (saved in every checkpoint and
    compared at a resume); ``model``: the model config as a dict; ``data_sha256``: the data
    of the run by name (pre-training: each phase's manifest; fine-tuning: its training file).
    """

    def __init__(
        self,
        settings: CheckpointConfig,
        folder: str,
        info: DistInfo,
        guard: SkipGuard,
        *,
        seed: int,
        config: dict[str, Any],
        model: dict[str, Any],
        zero_stage: int,
        precision: str,
        data_sha256: dict[str, str],
        faults: Faults = NO_FAULTS,
    ) -> None:
        self.settings = settings
        self.folder = folder
        self.info = info
        self.guard = guard
        self.seed = seed
        self.config = config
        self.model = model
        self.zero_stage = zero_stage
        self.precision = precision
        self.data_sha256 = data_sha256
        self.faults = faults
        self.progress = Progress()
        self.last_saved: ckpt.ResumeState | None = None
        """The checkpoint this run saved last (what a next pre-training phase starts from)."""
        ckpt.configure(folder, settings.local_dir, settings.publish_timeout_s)

    # ------------------------------------------------------------ whether to continue

    def resume_point(self) -> ckpt.ResumeState | None:
        """The checkpoint ``checkpoint.resume`` names, its state read once (None: start)."""
        tag = ckpt.resume_tag(self.folder, self.settings.resume, self.settings.verify_checksums)
        return None if tag is None else self.read(tag)

    def read(self, tag: str) -> ckpt.ResumeState:
        return ckpt.ResumeState.read(self.folder, tag, self.info.rank)

    def continue_from(
        self,
        resume: ckpt.ResumeState,
        fixed: Sequence[str],
        *,
        not_started: Callable[[str], bool] = lambda key: False,
    ) -> dict[str, tuple[Any, Any]]:
        """Check ``resume`` against this run and take the run's counters from it; returns
        every setting that changed since (``key -> (old, new)``).

        Data that changed since is refused (:func:`~bertpipe.training.checkpoint.
        check_data`), so are changes of a ``fixed`` setting that ``checkpoint.allow_changes``
        does not list; keys for which ``not_started`` is true (settings of a pre-training
        phase after the checkpoint's) may change freely."""
        state = resume.state
        ckpt.check_data(state, self.data_sha256, resume.tag, self.settings.allow_data_change)
        changes = changed_settings(state.config, self.config)
        changes = with_model_shape(changes, state.model, self.model)
        started = {k: v for k, v in changes.items() if not not_started(k)}
        check_changes(started, fixed, self.settings.allow_changes, resume.tag)
        if self.info.is_main:
            log_changes(changes, resume.tag)
        disk_space.check_room(self.folder, resume.tag)  # not after training up to the next save
        self.progress.global_step = state.global_step
        self.progress.samples_seen = state.samples_seen
        self.progress.run_id = state.mlflow_run_id
        self.guard.skipped = state.skipped_steps
        return changes

    # ------------------------------------------------------------ how

    def restore(self, engine: Any, spec: EngineSpec, resume: ckpt.ResumeState) -> Restored:
        """Continue the checkpoint's own stage: the engine's state, ``spec``'s optimizer
        settings and schedule over it; on the world size it was saved on, this rank's RNG
        states and loader position, on another one fresh RNG streams (the stage derives its
        loader position from the step, :attr:`Restored.data` is None)."""
        state = resume.state
        self._load(engine, resume.tag)
        # this config's hyperparameters, peak rate and schedule (changed at resume?) over the
        # ones the checkpoint restored
        engine.lr_scheduler = apply_settings(
            engine.lr_scheduler, spec.optimizer, spec.learning_rate, spec.schedule
        )
        world = self.info.world_size
        log.info("resumed %s at step %d from %s", state.phase, state.phase_step, resume.tag)
        if resume.same_world(world):
            assert resume.rank_state is not None
            ckpt.restore_rng(resume.rank_state["rng"])
            return Restored(
                state.phase_step, resume.rank_state["data"], resume.rank_state.get("loop", {})
            )
        torch.manual_seed(self.seed + 1000 * self.info.rank + state.global_step)
        log.warning("resuming on %d ranks from %d: RNG streams restart", world, state.world_size)
        return Restored(state.phase_step, None)

    def start_from(
        self, engine: Any, spec: EngineSpec, resume: ckpt.ResumeState, *, keep: bool, reset: bool
    ) -> None:
        """Start a new stage (a later pre-training phase) from ``resume``, the previous one's
        final checkpoint: its weights, and its optimizer moments if ``keep`` (their step
        counters restarted if ``reset``, as NVIDIA's phase 2 does); the schedule is
        ``spec``'s own, from its first step."""
        self._load(
            engine,
            resume.tag,
            load_optimizer_states=keep,
            load_lr_scheduler_states=False,
            load_module_only=not keep,
        )
        engine.lr_scheduler = apply_settings(
            engine.lr_scheduler, spec.optimizer, spec.learning_rate, spec.schedule
        )
        if reset:
            reset_step_counters(engine.optimizer)

    def _load(self, engine: Any, tag: str, **options: bool) -> None:
        with ckpt.loadable(self.folder, tag, self.info.rank, self.info.world_size) as local:
            engine.load_checkpoint(local, tag=tag, **options)

    # ------------------------------------------------------------ what a checkpoint holds

    def save(
        self,
        engine: Any,
        stage: StageState,
        at: Position,
        *,
        where: str,
        good: bool = True,
        wait: bool = False,
    ) -> ckpt.ResumeState:
        """Checkpoint the run at the completed step ``at`` (every rank; ``where`` names it in
        errors). On object storage the upload goes on in the background unless ``wait``."""
        progress = self.progress
        state = ckpt.CheckpointState(
            phase=stage.phase,
            phase_index=stage.phase_index,
            phase_step=at.step,
            global_step=progress.global_step,
            phase_complete=stage.phase_complete,
            data=at.data,
            world_size=self.info.world_size,
            mlflow_run_id=progress.run_id,
            samples_seen=progress.samples_seen,
            model=self.model,
            zero_stage=self.zero_stage,
            precision=self.precision,
            data_sha256=self.data_sha256,
            config=self.config,
            skipped_steps=self.guard.skipped,
            loop=stage.loop,
        )
        tag = ckpt.save_and_prune(
            engine,
            self.folder,
            state,
            self.info.rank,
            keep_last=self.settings.keep_last,
            where=where,
            good=good,
            rank_extra=stage.rank_loop,
            faults=self.faults,
            wait=wait,
            checksums=self.settings.verify_checksums,
        )
        self.last_saved = ckpt.ResumeState(tag, state, None)
        return self.last_saved

    def save_after_error(
        self, engine: Any, stage: StageState, at: Position, *, name: str, ran: bool
    ) -> None:
        """After an unexpected exception in the loop: save the last completed step ``at`` if
        a step ran since the stage started or resumed (``ran``), its state is finite and it
        is not saved yet, so the run resumes from there (not bit for bit: the RNG states are
        those at the error). One process only: with several ranks the others may be inside
        a collective of the step, and a save would hang. Never raises."""
        tag = f"global_step{self.progress.global_step}"
        try:  # the storage may be what failed: its error must not replace the first one
            latest = ckpt.latest_tag(self.folder)
        except Exception as exc:
            log.error(
                "%s: no checkpoint after the error (cannot read %s: %s)", name, self.folder, exc
            )
            return
        if not ran or latest == tag:
            log.error("%s: no step ran since %s: nothing new to save", name, latest or "the start")
            return
        if self.info.world_size > 1:
            log.error(
                "%s: no checkpoint after the error (%d ranks: the others may be waiting in a "
                "collective); resume from %s",
                name,
                self.info.world_size,
                latest,
            )
            return
        try:
            if self.guard.streak or not weights_finite(engine, collective=False):
                log.error("%s: the state is not finite: no checkpoint after the error", name)
                return
            self.save(engine, stage, at, where=f"{name} step {at.step}", wait=True)
            log.error("%s: saved %s after an error at step %d", name, tag, at.step + 1)
        except Exception:
            log.exception("%s: could not save a checkpoint after the error", name)

    @contextlib.contextmanager
    def uploads_finished(self) -> Iterator[None]:
        """Checkpoint uploads still in flight (object storage) are finished and published
        before the block is left; after an error too, so that an error in a step loses no
        checkpoint already saved (an upload's own failure then is logged, the first error
        propagates)."""
        try:
            yield
        except BaseException:
            try:
                ckpt.wait_uploads()
            except Exception as exc:
                log.error("a checkpoint upload failed too: %s", exc)
            raise
        ckpt.wait_uploads()

    def remove_all(self) -> list[str]:
        """Delete the run's checkpoints (rank 0; a completed fine-tuning run's)."""
        return ckpt.remove_all(self.folder)
