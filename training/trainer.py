"""The pre-training loop: phases of DeepSpeed steps, with metrics, evaluation and checkpoints.

Run by ``bertpipe pretrain`` on every rank (the ``deepspeed`` launcher starts one process per
GPU, on every node). Phases run in order; a later phase builds a fresh engine for its own
batch and schedule and starts from the previous phase's final checkpoint (module weights,
plus optimizer moments with ``optimizer_state: keep``, and a restarted bias correction with
``optimizer.reset_step_per_phase``). ``checkpoint.resume=auto`` continues a run from its
``latest`` checkpoint: model, optimizer, LR schedule (DeepSpeed's state), data position,
every rank's RNG states and the MLflow run id (bertpipe's state), so a resumed run on CPU in
fp32 reproduces the uninterrupted run's losses exactly. The checkpoint's state is read once
(:class:`~bertpipe.training.checkpoint.ResumeState`); a config that changed since is applied
or refused by :mod:`bertpipe.training.resume`.

The parts are shared with fine-tuning: the engine (:func:`~bertpipe.training.engine.
build_engine`), the guarded optimizer step (:class:`~bertpipe.training.step.OptimizerStep`,
:mod:`bertpipe.training.guard`), what happens after a step (:class:`~bertpipe.training.
cadence.Cadence`: log, evaluate, checkpoint, SIGTERM) and the checkpoints
(:mod:`bertpipe.training.checkpoint`). A SIGTERM saves a checkpoint and exits with status
143; ``max_bad_steps`` non-finite steps in a row stop the run without saving them.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from bertpipe import fsio, tracking
from bertpipe.config import ConfigError, redacted, to_dict, to_yaml
from bertpipe.fsio import RetryPolicy
from bertpipe.progress import ProgressLine
from bertpipe.training import checkpoint as ckpt
from bertpipe.training.cadence import PREEMPTED_EXIT_CODE, Cadence, PreemptedError, StopFlag
from bertpipe.training.config import PretrainConfig
from bertpipe.training.data import DataError, build_pretraining_data
from bertpipe.training.engine import DistInfo, EngineSpec, build_engine, init_distributed
from bertpipe.training.faults import Faults
from bertpipe.training.flops import mfu, peak_flops
from bertpipe.training.guard import NonFiniteError, SkipGuard, weights_finite
from bertpipe.training.hardware import check_hardware, local_hardware
from bertpipe.training.metrics import Window, loss_scale, memory_metrics
from bertpipe.training.model import BertForPreTraining, compile_layers
from bertpipe.training.optim import client_optimizer, reset_step_counters
from bertpipe.training.peers import watched
from bertpipe.training.phases import PhaseData, model_config, read_phase_data
from bertpipe.training.resume import (
    PRETRAIN_FIXED,
    changed_settings,
    check_changes,
    log_changes,
    mlflow_tags,
    with_model_shape,
)
from bertpipe.training.step import BatchPrep, OptimizerStep

log = logging.getLogger(__name__)

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "NonFiniteError",
    "PreemptedError",
    "Trainer",
    "run_pretraining",
]


@dataclass
class _Position:
    """The last completed step of a phase and the loader position after it."""

    phase_step: int
    data: dict[str, int]


class Trainer:
    """One pre-training job on this rank. Build it, then call :meth:`run`."""

    def __init__(self, cfg: PretrainConfig, info: DistInfo, faults: Faults | None = None) -> None:
        self.cfg = cfg
        self.info = info
        self.world = info.world_size
        self.accumulation = cfg.check_world(self.world)
        retry = RetryPolicy(cfg.data.read_retries, cfg.data.read_retry_delay)
        self.data = [read_phase_data(p, f"phases[{i}]", retry) for i, p in enumerate(cfg.phases)]
        self.model_cfg = model_config(cfg, self.data)
        self.folder = cfg.checkpoint_dir
        ckpt.configure(self.folder, cfg.checkpoint.local_dir, cfg.checkpoint.publish_timeout_s)
        self.faults = faults if faults is not None else Faults.from_environ(info.rank)
        self.cadence = Cadence(
            log_every=cfg.log_every_steps,
            eval_every=cfg.eval.every_steps,
            checkpoint_every=cfg.checkpoint.every_steps,
            preemption_every=cfg.checkpoint.preemption_check_steps,
        )
        self.stop = StopFlag()
        self.guard = SkipGuard(cfg.max_bad_steps, log_rank=info.is_main)
        self.run_id: str | None = None
        self.global_step = 0
        self.samples_seen = 0
        self.peak = self._peak_flops()

    # ---------------------------------------------------------------- set-up

    def _peak_flops(self) -> float | None:
        if self.cfg.device_peak_tflops:
            return self.cfg.device_peak_tflops * 1e12
        if self.info.device.type != "cuda":
            return None
        return peak_flops(torch.cuda.get_device_name(self.info.device), self.cfg.precision)

    def new_model(self) -> BertForPreTraining:
        """The phase's model: the same initial weights on every rank, compiled if asked."""
        torch.manual_seed(self.cfg.seed)  # the same initial weights on every rank
        model = BertForPreTraining(self.model_cfg)
        if self.cfg.model.init_from:
            from bertpipe.training.hf import load_hf_folder, load_into

            _, weights = load_hf_folder(self.cfg.model.init_from)
            load_into(model, weights, strict_heads=False)
        torch.manual_seed(self.cfg.seed + 1000 * self.info.rank)  # dropout differs per rank
        if self.cfg.model.compile:
            compile_layers(model)
        return model

    def engine_spec(self, index: int) -> EngineSpec:
        return EngineSpec.for_phase(self.cfg, self.cfg.phases[index], self.world)

    def loader(self, index: int, evaluation: bool = False) -> Any:
        """Phase ``index``'s training loader, or its held-out one (the one factory)."""
        return build_pretraining_data(
            self.cfg.phases[index],
            self.cfg.data,
            rank=self.info.rank,
            world_size=self.world,
            seed=self.cfg.seed,
            evaluation=self.cfg.eval if evaluation else None,
        )

    def start_point(self) -> tuple[int, ckpt.ResumeState | None]:
        """(first phase to run, the checkpoint to continue from), its state read once."""
        tag = ckpt.resume_tag(self.folder, self.cfg.checkpoint.resume)
        names = [p.name for p in self.cfg.phases]
        if self.cfg.only_phase is not None:
            index = names.index(self.cfg.only_phase)
            if tag is None and index > 0:
                tag = ckpt.phase_end_tag(self.folder, names[index - 1])
                if tag is None:
                    raise ConfigError(
                        "only_phase",
                        f"{self.cfg.only_phase} starts from {names[index - 1]}'s final checkpoint, "
                        f"which is not in {self.folder}: run {names[index - 1]} first",
                    )
            state = None if tag is None else ckpt.ResumeState.read(self.folder, tag, self.info.rank)
            return index, state
        if tag is None:
            return 0, None
        state = ckpt.ResumeState.read(self.folder, tag, self.info.rank)
        return state.state.phase_index + (1 if self._complete(state.state) else 0), state

    def _complete(self, state: ckpt.CheckpointState) -> bool:
        """Whether the checkpoint's phase is done by *this* config's step count (raising
        ``max_steps`` of a finished phase continues it)."""
        return state.phase_step >= self.cfg.phases[state.phase_index].max_steps

    def _continue_from(self, resume: ckpt.ResumeState) -> dict[str, tuple[Any, Any]]:
        """Check a resume against this config (data, settings) and take the run's counters
        from it; returns the settings that changed since the checkpoint."""
        state = resume.state
        current = {p.name: d.sha256 for p, d in zip(self.cfg.phases, self.data, strict=True)}
        ckpt.check_data(state, current, resume.tag, self.cfg.checkpoint.allow_data_change)
        changes = changed_settings(state.config, redacted(to_dict(self.cfg)))
        changes = with_model_shape(changes, state.model, asdict(self.model_cfg))
        # phases after the checkpoint's have not started: any of their settings may change
        started = {k: v for k, v in changes.items() if not _later_phase(k, state.phase_index)}
        check_changes(started, PRETRAIN_FIXED, self.cfg.checkpoint.allow_changes, resume.tag)
        if self.info.is_main:
            log_changes(changes, resume.tag)
        self.run_id = state.mlflow_run_id
        self.global_step = state.global_step
        self.samples_seen = state.samples_seen
        self.guard.skipped = state.skipped_steps
        return changes

    # ---------------------------------------------------------------- the run

    def run(self) -> dict[str, Any]:
        first, resume = self.start_point()
        changes = self._continue_from(resume) if resume is not None else {}
        last = len(self.cfg.phases) - 1 if self.cfg.only_phase is None else first
        summary: dict[str, Any] = {}
        with self.stop, self._tracking(changes), _uploads_finished():
            for index in range(first, last + 1):
                summary[self.cfg.phases[index].name], resume = self._run_phase(index, resume)
        return summary

    @contextlib.contextmanager
    def _tracking(self, changes: dict[str, tuple[Any, Any]]) -> Iterator[None]:
        """The MLflow run (rank 0 only): the one recorded in the checkpoint, or a new one."""
        if not self.info.is_main:
            yield
            return
        tags = {
            f"{tracking.TAG_DATA_CHECKSUM}.{p.name}": d.sha256
            for p, d in zip(self.cfg.phases, self.data, strict=True)
        }
        tags[tracking.TAG_TOKENIZER] = self.data[0].manifest["tokenizer_sha256"]
        with tracking.start_run(
            self.cfg.tracking,
            "pretrain",
            config=self.cfg if self.run_id is None else None,
            run_name=self.cfg.tracking.run_name or "pretrain",
            tags=tags,
            parent_run_id=self.cfg.tracking.tags.get(tracking.TAG_PARENT),
            resume_run_id=self.run_id,
            buffer=tracking.buffer_path(self.cfg.output),
        ) as run:
            if run is not None:
                self.run_id = run.info.run_id
                tokenizer = tracking.find_model(
                    self.run_id, tracking.TAG_TOKENIZER, tags[tracking.TAG_TOKENIZER]
                )
                tracking.log_inputs(
                    [self._dataset(p, d) for p, d in zip(self.cfg.phases, self.data, strict=True)],
                    [tokenizer or "", tracking.export_model_id(self.cfg.model.init_from) or ""],
                )
                tracking.log_dict(asdict(self.model_cfg), "model_config.json")
                if changes:
                    tracking.set_tags(mlflow_tags(changes, self.global_step))
                    tracking.log_text(
                        to_yaml(self.cfg), f"resumed/global_step{self.global_step}.yaml"
                    )
            yield

    @staticmethod
    def _dataset(phase: Any, data: PhaseData) -> tracking.DatasetRef:
        """A phase's shards as a dataset input: its manifest, named by its sha256."""
        splits = data.manifest["splits"]
        return tracking.DatasetRef(
            name=f"{phase.name}-shards",
            url=fsio.join(data.url, "manifest.json"),
            sha256=data.sha256,
            profile={
                "phase": phase.name,
                "max_seq_length": data.max_seq_length,
                **{f"{k}_instances": int(v.get("instances", 0)) for k, v in splits.items()},
                **{f"{k}_shards": int(v.get("num_shards", 0)) for k, v in splits.items()},
            },
        )

    def _run_phase(
        self, index: int, resume: ckpt.ResumeState | None
    ) -> tuple[dict[str, Any], ckpt.ResumeState | None]:
        """Run phase ``index`` to its end; returns its summary and its final checkpoint."""
        cfg, phase = self.cfg, self.cfg.phases[index]
        spec = self.engine_spec(index)
        engine, dsconf = build_engine(self.new_model(), spec)
        start, data_state = self._restore(engine, spec, index, resume) if resume else (0, None)
        loader = self.loader(index)
        if data_state is not None:
            loader.load_state_dict(data_state)
        if self.info.is_main:
            self._log_phase_start(index, dsconf, loader)
        progress = (
            ProgressLine(phase.name, phase.max_steps, initial=start, unit="step")
            if self.info.is_main
            else None
        )
        window = Window(self.info.device)
        prep = BatchPrep(self.model_cfg, self.info.device, unpad=cfg.model.unpad)
        accumulation = spec.accumulation
        step = OptimizerStep(
            engine,
            accumulation,
            faults=self.faults,
            on_output=lambda out, stats: window.add(out, stats, accumulation),
        )
        host = iter(loader)
        batches = (prep(batch) for batch in host)
        done = _Position(start, loader.state_dict())  # the last completed step
        try:
            while done.phase_step < phase.max_steps:
                result = step(self.global_step + 1, batches)
                self.global_step += 1
                self.samples_seen += phase.micro_batch_size * accumulation
                done = _Position(done.phase_step + 1, loader.state_dict())
                window.record(result)
                where = f"{phase.name} step {done.phase_step} (global {self.global_step})"
                self.guard.record(result.skipped, where)
                ended = done.phase_step >= phase.max_steps
                if progress is not None:  # host only: the bar, or a log line every minute
                    progress.update(done.phase_step)
                due = self.cadence.after_step(
                    done.phase_step,
                    ended=ended,
                    streak=self.guard.streak,
                    exhausted=self.guard.exhausted,
                    stop=self.stop,
                    device=self.info.device,
                )
                if due.log:
                    self._log_window(engine, window, index, done.phase_step, progress)
                    window = Window(self.info.device)
                if self.guard.exhausted:
                    raise self.guard.error(where, ckpt.latest_tag(self.folder), unit="steps")
                if due.evaluate:
                    self._evaluate(engine, index)
                if due.deferred and self.info.is_main:
                    log.warning(
                        "%s: checkpoint deferred, the last %d steps were skipped",
                        where,
                        self.guard.streak,
                    )
                if due.save:
                    resume = self._save(
                        engine, index, done, ended, good=not self.guard.streak, wait=due.stop
                    )
                if due.stop:
                    raise PreemptedError(
                        f"stopped by SIGTERM at {phase.name} step {done.phase_step}"
                    )
        except (PreemptedError, NonFiniteError):
            raise
        except Exception:
            self._save_after_error(engine, index, done, ran=done.phase_step > start)
            raise
        finally:
            # stop the loader's workers now (they ignore SIGTERM), not at interpreter exit
            batches.close()
            host.close()
            if progress is not None:
                progress.close()
        metrics = self._evaluate(engine, index)
        del engine
        summary = {"steps": done.phase_step, "global_step": self.global_step, **metrics}
        return {**summary, "seq_len": self.data[index].max_seq_length}, resume

    def _restore(
        self, engine: Any, spec: EngineSpec, index: int, resume: ckpt.ResumeState
    ) -> tuple[int, dict[str, int] | None]:
        """Load ``resume`` into this phase's engine; returns (phase step, data state)."""
        phase = self.cfg.phases[index]
        state = resume.state
        if state.phase_index == index and not self._complete(state):
            with ckpt.loadable(self.folder, resume.tag, self.info.rank, self.world) as local:
                engine.load_checkpoint(local, tag=resume.tag)
            spec.apply_to(engine)  # this config's rates and schedule (changed at resume?)
            if resume.same_world(self.world):
                assert resume.rank_state is not None
                ckpt.restore_rng(resume.rank_state["rng"])
                data = resume.rank_state["data"]
            else:  # another world size: same data position in samples, fresh RNG streams
                consumed = state.data["batches"] * state.world_size // self.world
                data = {"epoch": state.data["epoch"], "batches": consumed}
                torch.manual_seed(self.cfg.seed + 1000 * self.info.rank + state.global_step)
                log.warning(
                    "resuming on %d ranks from %d: RNG streams restart",
                    self.world,
                    state.world_size,
                )
            log.info("resumed %s at step %d from %s", phase.name, state.phase_step, resume.tag)
            return state.phase_step, data
        # a new phase from the previous phase's final checkpoint
        keep = phase.optimizer_state == "keep"
        with ckpt.loadable(self.folder, resume.tag, self.info.rank, self.world) as local:
            engine.load_checkpoint(
                local,
                tag=resume.tag,
                load_optimizer_states=keep,
                load_lr_scheduler_states=False,
                load_module_only=not keep,
            )
        spec.apply_to(engine)  # the phase's own peak rate, schedule from its first step
        reset = keep and self.cfg.optimizer.reset_step_per_phase
        if reset:  # NVIDIA's phase 2: bias correction restarts on the kept moments
            reset_step_counters(engine.optimizer)
        log.info(
            "%s starts from %s (%s optimizer state%s)",
            phase.name,
            resume.tag,
            "kept" if keep else "fresh",
            ", step counters reset" if reset else "",
        )
        return 0, None

    def _save(
        self,
        engine: Any,
        index: int,
        at: _Position,
        ended: bool,
        *,
        good: bool = True,
        wait: bool = False,
    ) -> ckpt.ResumeState:
        """Checkpoint the step ``at``; on object storage the upload goes on in the background
        unless ``wait`` or the phase ``ended`` (the next phase loads it)."""
        phase = self.cfg.phases[index]
        state = ckpt.CheckpointState(
            phase=phase.name,
            phase_index=index,
            phase_step=at.phase_step,
            global_step=self.global_step,
            phase_complete=ended,
            data=at.data,
            world_size=self.world,
            mlflow_run_id=self.run_id,
            samples_seen=self.samples_seen,
            model=asdict(self.model_cfg),
            zero_stage=self.cfg.zero.stage,
            precision=self.cfg.precision,
            data_sha256={p.name: d.sha256 for p, d in zip(self.cfg.phases, self.data, strict=True)},
            config=redacted(to_dict(self.cfg)),
            skipped_steps=self.guard.skipped,
        )
        tag = ckpt.save_and_prune(
            engine,
            self.folder,
            state,
            self.info.rank,
            keep_last=self.cfg.checkpoint.keep_last,
            where=f"{phase.name} step {at.phase_step}",
            good=good,
            faults=self.faults,
            wait=wait or ended,
        )
        return ckpt.ResumeState(tag, state, None)

    def _save_after_error(self, engine: Any, index: int, at: _Position, *, ran: bool) -> None:
        """After an unexpected exception in the loop: save the last completed step if a step
        ran since the phase started or resumed, its state is finite and it is not saved yet,
        so the run resumes from there (not bit for bit: the RNG states are those at the
        error). One process only: with several ranks the others may be inside a collective
        of the step, and a save would hang."""
        phase = self.cfg.phases[index]
        tag = f"global_step{self.global_step}"
        latest = ckpt.latest_tag(self.folder)
        if not ran or latest == tag:
            log.error(
                "%s: no step ran since %s: nothing new to save", phase.name, latest or "the start"
            )
            return
        if self.world > 1:
            log.error(
                "%s: no checkpoint after the error (%d ranks: the others may be waiting in a "
                "collective); resume from %s",
                phase.name,
                self.world,
                latest,
            )
            return
        try:
            if self.guard.streak or not weights_finite(engine, collective=False):
                log.error("%s: the state is not finite: no checkpoint after the error", phase.name)
                return
            self._save(engine, index, at, at.phase_step >= phase.max_steps, wait=True)
            log.error("%s: saved %s after an error at step %d", phase.name, tag, at.phase_step + 1)
        except Exception:
            log.exception("%s: could not save a checkpoint after the error", phase.name)

    # ---------------------------------------------------------------- metrics

    def _log_phase_start(self, index: int, dsconf: dict[str, Any], loader: Any) -> None:
        phase = self.cfg.phases[index]
        log.info(
            "%s: %d steps, %d x %d x %d = %d sequences/step of %d tokens, %d batches per rank per "
            "epoch, ds_config %s",
            phase.name,
            phase.max_steps,
            phase.micro_batch_size,
            self.accumulation[phase.name],
            self.world,
            phase.global_batch_size,
            self.data[index].max_seq_length,
            loader.batches_per_epoch,
            json.dumps(dsconf),
        )
        if self.run_id is not None:
            tracking.log_dict(dsconf, f"ds_config_{phase.name}.json")

    def _log_window(
        self,
        engine: Any,
        window: Window,
        index: int,
        phase_step: int,
        progress: ProgressLine | None,
    ) -> None:
        """Reduce the window over the ranks (every rank calls this) and log it on rank 0."""
        phase = self.cfg.phases[index]
        metrics = window.reduce(self.world)
        metrics["lr"] = window.lr
        grad_norm = engine.get_global_grad_norm()
        if grad_norm is not None:  # inf or NaN after a skipped step: logged as such
            metrics["grad_norm"] = float(grad_norm)
        metrics["skipped_steps"] = self.guard.skipped
        lamb = client_optimizer(engine.optimizer)
        if hasattr(lamb, "trust_ratio_stats"):  # LAMB: over all tensors, at log steps only
            for key, value in lamb.trust_ratio_stats().items():
                metrics[f"trust_ratio_{key}"] = value
        scale = loss_scale(engine)
        if self.cfg.precision == "fp16" and scale is not None:
            metrics["loss_scale"] = scale
        utilisation = mfu(metrics["tflops_per_device"] * 1e12, self.peak)
        if utilisation is not None:
            metrics["mfu"] = utilisation  # on real tokens
            metrics["mfu_padded"] = mfu(metrics["padded_tflops_per_device"] * 1e12, self.peak)
        metrics.update(memory_metrics(self.info.device))
        metrics["phase_step"] = phase_step
        if not self.info.is_main:
            return
        if self.run_id is not None:
            tracking.log_metrics(
                {f"train/{k}": v for k, v in metrics.items()}, step=self.global_step
            )
        if progress is not None and progress.tty:
            progress.update(
                phase_step, f"loss {metrics['loss']:.4f} lr {metrics['lr']:.2e}", force=True
            )
            return
        log.info(
            "%s step %d/%d (global %d): loss %.4f mlm %.4f nsp %.4f mlm_acc %.3f nsp_acc %.3f "
            "lr %.3e %.1f seq/s | %s",
            phase.name,
            phase_step,
            phase.max_steps,
            self.global_step,
            metrics["loss"],
            metrics["mlm_loss"],
            metrics["nsp_loss"],
            metrics["mlm_accuracy"],
            metrics["nsp_accuracy"],
            metrics["lr"],
            metrics["samples_per_s"],
            progress.line(phase_step) if progress is not None else "",
        )
        if progress is not None:
            progress.touch()

    @torch.no_grad()
    def _evaluate(self, engine: Any, index: int) -> dict[str, float]:
        """Loss and accuracies on the phase's held-out split, averaged over all ranks."""
        phase = self.cfg.phases[index]
        split = self.cfg.data.heldout_split
        if not self.data[index].manifest["splits"].get(split, {}).get("instances"):
            return {}
        try:
            loader = self.loader(index, evaluation=True)
        except DataError as exc:  # too little held-out data for this many ranks
            if self.info.is_main:
                log.warning("%s: no evaluation: %s", phase.name, exc)
            return {}
        engine.eval()
        window = Window(self.info.device)
        prep = BatchPrep(self.model_cfg, self.info.device, unpad=self.cfg.model.unpad)
        for host in loader:
            batch, stats = prep(host)
            window.add(engine(**batch), stats, 1)
            window.steps += 1
        engine.train()
        metrics = window.reduce(self.world)
        keys = ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy")
        result = {k: metrics[k] for k in keys}
        if self.info.is_main:
            log.info(
                "%s eval at global step %d: %s",
                phase.name,
                self.global_step,
                json.dumps({k: round(v, 4) for k, v in result.items()}),
            )
            if self.run_id is not None:
                tracking.log_metrics(
                    {f"eval/{k}": v for k, v in result.items()}, step=self.global_step
                )
        return result


@contextlib.contextmanager
def _uploads_finished() -> Iterator[None]:
    """Checkpoint uploads still in flight (object storage) are finished and published before
    the run returns; after an error too, so that an error in a step loses no checkpoint
    already saved (an upload's own failure then is logged, the first error propagates)."""
    try:
        yield
    except BaseException:
        try:
            ckpt.wait_uploads()
        except Exception as exc:
            log.error("a checkpoint upload failed too: %s", exc)
        raise
    ckpt.wait_uploads()


def _later_phase(key: str, index: int) -> bool:
    """Whether ``key`` is a setting of a phase after phase ``index`` (``phases[2].x``)."""
    if not key.startswith("phases["):
        return False
    return int(key[len("phases[") : key.index("]")]) > index


def run_pretraining(cfg: PretrainConfig, faults: Faults | None = None) -> dict[str, Any]:
    """Join (or form) the distributed job and pre-train; rank 0 returns the summary.

    ``faults``: what tests break (:mod:`bertpipe.training.faults`; default: what the
    environment asks, nothing in real runs)."""
    # before the process group: a device that cannot run the config is one line per rank
    check_hardware(local_hardware(), precision=cfg.precision, fused=cfg.optimizer.fused)
    info = init_distributed()
    cfg.check_world(info.world_size)
    trainer = Trainer(cfg, info, faults)
    if info.is_main:
        fsio.atomic_write_text(fsio.join(cfg.output, "pretrain.yaml"), to_yaml(cfg))
        for i, phase in enumerate(cfg.phases):
            fsio.atomic_write_text(
                fsio.join(cfg.output, f"ds_config_{phase.name}.json"),
                json.dumps(trainer.engine_spec(i).ds_config(), indent=2),
            )
    try:
        with watched(info.rank, info.world_size, cfg.distributed.peer_timeout_s):
            summary = trainer.run()
    except PreemptedError as exc:
        log.warning("%s", exc)
        raise
    if info.is_main:
        fsio.atomic_write_text(fsio.join(cfg.output, "summary.json"), json.dumps(summary, indent=2))
    return summary
