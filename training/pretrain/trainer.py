"""Pre-training: phases of DeepSpeed steps, each run by the one training loop.

Run by ``bertpipe pretrain`` on every rank (the ``deepspeed`` launcher starts one process per
GPU, on every node). Phases run in order; a later phase builds a fresh engine for its own
batch and schedule and starts from the previous phase's final checkpoint (module weights,
plus optimizer moments with ``optimizer_state: keep``, and a restarted bias correction with
``optimizer.reset_step_per_phase``). ``checkpoint.resume=auto`` continues a run from its
``latest`` checkpoint: model, optimizer, LR schedule (DeepSpeed's state), data position,
every rank's RNG states and the MLflow run id (bertpipe's state), so a resumed run on CPU in
fp32 reproduces the uninterrupted run's losses exactly.

What this module holds is what pre-training adds to the training core it shares with
fine-tuning: its phases (:class:`PhaseStage`, what the loop of
:func:`~bertpipe.training.core.loop.run_loop` asks of a stage: batches from the shard loader,
windows of metrics with MFU, held-out evaluation), which phase and checkpoint a run starts
from, and its MLflow run. The loop (step, non-finite guard, cadence, SIGTERM: exit status
143), the checkpoints (:class:`~bertpipe.training.core.checkpoints.CheckpointManager`: state,
resume checks, restore, the save after an error) and the engine
(:func:`~bertpipe.training.core.engine.build_engine`) are shared.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import torch

from bertpipe import fsio, lease, tracking
from bertpipe.config import ConfigError, redacted, to_dict, to_yaml
from bertpipe.fsio import RetryPolicy
from bertpipe.progress import ProgressLine
from bertpipe.training import checkpoint as ckpt
from bertpipe.training.core import faults as fault_injection
from bertpipe.training.core.cadence import PREEMPTED_EXIT_CODE, Cadence, PreemptedError, StopFlag
from bertpipe.training.core.checkpoints import CheckpointManager, Position, StageState
from bertpipe.training.core.engine import DistInfo, EngineSpec, build_engine, init_distributed
from bertpipe.training.core.faults import Faults
from bertpipe.training.core.guard import NonFiniteError, SkipGuard
from bertpipe.training.core.hardware import check_hardware, local_hardware
from bertpipe.training.core.loop import run_loop
from bertpipe.training.core.optim import client_optimizer
from bertpipe.training.core.peers import watched
from bertpipe.training.core.resume import PRETRAIN_FIXED, mlflow_tags
from bertpipe.training.core.step import StepResult
from bertpipe.training.models.bert.model import compile_layers
from bertpipe.training.models.families import pretraining_model
from bertpipe.training.models.flops import mfu, peak_flops
from bertpipe.training.pretrain.batches import BatchPrep
from bertpipe.training.pretrain.config import PretrainConfig
from bertpipe.training.pretrain.data.loader import build_pretraining_data
from bertpipe.training.pretrain.data.manifest import DataError, PhaseData, read_phase_data
from bertpipe.training.pretrain.metrics import Window, loss_scale, memory_metrics
from bertpipe.training.pretrain.phases import model_config, phase_engine

log = logging.getLogger(__name__)

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "NonFiniteError",
    "PreemptedError",
    "Trainer",
    "run_pretraining",
]


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
        self.faults = faults if faults is not None else fault_injection.for_rank(info.rank)
        self.cadence = Cadence(
            log_every=cfg.log_every_steps,
            eval_every=cfg.eval.every_steps,
            checkpoint_every=cfg.checkpoint.every_steps,
            preemption_every=cfg.checkpoint.preemption_check_steps,
        )
        self.stop = StopFlag()
        self.guard = SkipGuard(cfg.max_bad_steps, log_rank=info.is_main)
        self.checkpoints = CheckpointManager(
            cfg.checkpoint,
            self.folder,
            info,
            self.guard,
            seed=cfg.seed,
            config=redacted(to_dict(cfg)),
            model=asdict(self.model_cfg),
            zero_stage=cfg.zero.stage,
            precision=cfg.precision,
            data_sha256={p.name: d.sha256 for p, d in zip(cfg.phases, self.data, strict=True)},
            faults=self.faults,
        )
        self.progress = self.checkpoints.progress
        self.peak = self._peak_flops()

    # ---------------------------------------------------------------- set-up

    def _peak_flops(self) -> float | None:
        if self.cfg.device_peak_tflops:
            return self.cfg.device_peak_tflops * 1e12
        if self.info.device.type != "cuda":
            return None
        return peak_flops(torch.cuda.get_device_name(self.info.device), self.cfg.precision)

    def new_model(self) -> torch.nn.Module:
        """The phase's model: the same initial weights on every rank, compiled if asked."""
        torch.manual_seed(self.cfg.seed)  # the same initial weights on every rank
        model = pretraining_model(self.model_cfg)
        if self.cfg.model.init_from:
            from bertpipe.training.models.hf import load_hf_folder, load_into

            _, weights = load_hf_folder(self.cfg.model.init_from)
            load_into(model, weights, strict_heads=False)
        torch.manual_seed(self.cfg.seed + 1000 * self.info.rank)  # dropout differs per rank
        if self.cfg.model.compile:
            compile_layers(model)
        return model

    def engine_spec(self, index: int) -> EngineSpec:
        return phase_engine(self.cfg, self.cfg.phases[index], self.world)

    def loader(self, index: int, evaluation: bool = False) -> Any:
        """Phase ``index``'s training loader, or its held-out one (the one factory), from the
        manifest read at start-up."""
        return build_pretraining_data(
            self.cfg.phases[index],
            self.cfg.data,
            rank=self.info.rank,
            world_size=self.world,
            seed=self.cfg.seed,
            evaluation=self.cfg.eval if evaluation else None,
            manifest=self.data[index].parsed,
        )

    def start_point(self) -> tuple[int, ckpt.ResumeState | None]:
        """(first phase to run, the checkpoint to continue from), its state read once."""
        checksums = self.cfg.checkpoint.verify_checksums
        tag = ckpt.resume_tag(self.folder, self.cfg.checkpoint.resume, checksums)
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
                ckpt.check_named(self.folder, tag, checksums)
            return index, None if tag is None else self.checkpoints.read(tag)
        if tag is None:
            return 0, None
        state = self.checkpoints.read(tag)
        return state.state.phase_index + (1 if self._complete(state.state) else 0), state

    def _complete(self, state: ckpt.CheckpointState) -> bool:
        """Whether the checkpoint's phase is done by *this* config's step count (raising
        ``max_steps`` of a finished phase continues it)."""
        return state.phase_step >= self.cfg.phases[state.phase_index].max_steps

    # ---------------------------------------------------------------- the run

    def run(self) -> dict[str, Any]:
        first, resume = self.start_point()
        changes: dict[str, tuple[Any, Any]] = {}
        if resume is not None:
            done = resume.state.phase_index  # its settings are fixed; later phases' are not
            changes = self.checkpoints.continue_from(
                resume, PRETRAIN_FIXED, not_started=lambda key: _later_phase(key, done)
            )
        if self.info.is_main:  # only now: a refused resume leaves the output as it was
            self._write_run_files()
        last = len(self.cfg.phases) - 1 if self.cfg.only_phase is None else first
        summary: dict[str, Any] = {}
        with self.stop, self._tracking(changes), self.checkpoints.uploads_finished():
            for index in range(first, last + 1):
                name = self.cfg.phases[index].name
                summary[name], stopped = self._run_phase(index, resume)
                resume = self.checkpoints.last_saved or resume
                if stopped and index < last:  # saved at the phase's end; the next one waits
                    raise PreemptedError(f"stopped by SIGTERM at the end of {name}")
        return summary

    def _write_run_files(self) -> None:
        """The resolved config (``pretrain.yaml``, what ``--config`` replays) and each phase's
        DeepSpeed config, into the output."""
        fsio.atomic_write_text(fsio.join(self.cfg.output, "pretrain.yaml"), to_yaml(self.cfg))
        for i, phase in enumerate(self.cfg.phases):
            fsio.atomic_write_text(
                fsio.join(self.cfg.output, f"ds_config_{phase.name}.json"),
                json.dumps(self.engine_spec(i).ds_config(), indent=2),
            )

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
        tokenizer_sha256 = self.data[0].manifest.get("tokenizer_sha256")
        if tokenizer_sha256:  # every manifest bertpipe writes has it
            tags[tracking.TAG_TOKENIZER] = tokenizer_sha256
        resumed = self.progress.run_id
        with tracking.start_run(
            self.cfg.tracking,
            "pretrain",
            config=self.cfg if resumed is None else None,
            run_name=self.cfg.tracking.run_name or "pretrain",
            tags=tags,
            parent_run_id=self.cfg.tracking.tags.get(tracking.TAG_PARENT),
            resume_run_id=resumed,
            buffer=tracking.buffer_path(self.cfg.output),
        ) as run:
            if run is not None:
                run_id = self.progress.run_id = run.info.run_id
                tokenizer = tokenizer_sha256 and tracking.find_model(
                    run_id, tracking.TAG_TOKENIZER, tokenizer_sha256
                )
                tracking.log_inputs(
                    [self._dataset(p, d) for p, d in zip(self.cfg.phases, self.data, strict=True)],
                    [tokenizer or "", tracking.export_model_id(self.cfg.model.init_from) or ""],
                )
                tracking.log_dict(asdict(self.model_cfg), "model_config.json")
                if changes:
                    step = self.progress.global_step
                    tracking.set_tags(mlflow_tags(changes, step))
                    tracking.log_text(to_yaml(self.cfg), f"resumed/global_step{step}.yaml")
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
    ) -> tuple[dict[str, Any], bool]:
        """Run phase ``index`` to its end from ``resume`` (its own checkpoint, the previous
        phase's final one, or None); returns its summary and whether a SIGTERM was agreed
        at its last step."""
        phase = self.cfg.phases[index]
        spec = self.engine_spec(index)
        engine, dsconf = build_engine(self.new_model(), spec)
        start, data_state = 0, None
        if (
            resume is not None
            and resume.state.phase_index == index
            and not self._complete(resume.state)
        ):
            restored = self.checkpoints.restore(engine, spec, resume)
            start, data_state = restored.step, restored.data
            if data_state is None:  # saved on another world size
                data_state = _rederived(resume, self.world)
        elif resume is not None:  # a new phase from the previous phase's final checkpoint
            keep = phase.optimizer_state == "keep"
            reset = keep and self.cfg.optimizer.reset_step_per_phase
            self.checkpoints.start_from(engine, spec, resume, keep=keep, reset=reset)
            log.info(
                "%s starts from %s (%s optimizer state%s)",
                phase.name,
                resume.tag,
                "kept" if keep else "fresh",
                ", step counters reset" if reset else "",
            )
        loader = self.loader(index)
        if data_state is not None:
            loader.load_state_dict(data_state)
        if self.info.is_main:
            self._log_phase_start(index, dsconf, loader)
        stage = PhaseStage(self, index, loader, start)
        end = run_loop(
            engine,
            stage,
            self.checkpoints,
            start=Position(start, loader.state_dict()),
            cadence=self.cadence,
            stop=self.stop,
            faults=self.faults,
        )
        del engine
        summary = {"steps": end.at.step, "global_step": self.progress.global_step, **stage.metrics}
        if stage.measured:
            summary["measured"] = stage.measured
        return {**summary, "seq_len": self.data[index].max_seq_length}, end.stopped

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
        if self.progress.run_id is not None:
            tracking.log_dict(dsconf, f"ds_config_{phase.name}.json")


class PhaseStage:
    """A pre-training phase as the training loop's stage: batches from the shard loader, a
    window of metrics logged every ``log_every_steps`` (loss, accuracies, throughput, MFU,
    LAMB's trust ratios, memory), held-out evaluation."""

    def __init__(self, trainer: Trainer, index: int, loader: Any, start: int) -> None:
        phase = trainer.cfg.phases[index]
        self.trainer = trainer
        self.index = index
        self.name = phase.name
        self.max_steps = phase.max_steps
        self.phase = phase
        self.accumulation, self.samples_per_step = self._batch_of(start + 1)
        if phase.batch_warmup_steps > start and trainer.info.is_main:
            log.info(
                "%s: batch warmup, global batch %d at step %d growing to %d from step %d",
                phase.name,
                phase.global_batch_at(start + 1, trainer.world),
                start + 1,
                phase.global_batch_size,
                phase.batch_warmup_steps + 1,
            )
        self.loader = loader
        self.device = trainer.info.device
        self.window = Window(self.device)
        self.prep = BatchPrep(
            trainer.model_cfg,
            self.device,
            unpad=trainer.cfg.model.unpad,
            nsp=trainer.data[index].parsed.objective != "mlm",
        )
        self.bar = (
            ProgressLine(phase.name, phase.max_steps, initial=start, unit="step")
            if trainer.info.is_main
            else None
        )
        self.metrics: dict[str, float] = {}
        """The last evaluation's."""
        self.measured: dict[str, float] = {}
        """The last logged window's memory and step time, beside plan --fit's predictions."""
        self._host: Any = None
        self._batches: Any = None

    def batches(self) -> Iterator[Any]:
        self._host = iter(self.loader)
        self._batches = (self.prep(batch) for batch in self._host)
        return self._batches

    def position(self) -> dict[str, int]:
        return dict(self.loader.state_dict())

    def where(self, step: int, global_step: int) -> str:
        return f"{self.name} step {step} (global {global_step})"

    def _batch_of(self, step: int) -> tuple[int, int]:
        """(micro-batches, sequences) on this rank of the phase's step ``step``: the full
        batch, or less under batch warmup (``PhaseSpec.accumulation_at``)."""
        accumulation = self.phase.accumulation_at(step, self.trainer.world)
        return accumulation, self.phase.micro_batch_size * accumulation

    def on_output(self, output: Any, stats: Any) -> None:
        self.window.add(output, stats, self.accumulation)  # the running step's

    def after_step(self, step: int, result: StepResult) -> None:
        self.window.record(result)
        self.accumulation, self.samples_per_step = self._batch_of(step + 1)  # the loop's next
        if self.bar is not None:  # host only: the bar, or a log line every minute
            self.bar.update(step)

    def state(self, ended: bool) -> StageState:
        return StageState(self.name, self.index, ended)

    def close(self) -> None:
        # stop the loader's workers now (they ignore SIGTERM), not at interpreter exit
        for part in (self._batches, self._host):
            if part is not None:
                part.close()
        if self.bar is not None:
            self.bar.close()

    def log(self, engine: Any, step: int) -> None:
        """Reduce the window over the ranks (every rank calls this) and log it on rank 0."""
        trainer, bar = self.trainer, self.bar
        window, self.window = self.window, Window(self.device)
        metrics = window.reduce(trainer.world)
        metrics["lr"] = window.lr
        grad_norm = engine.get_global_grad_norm()
        if grad_norm is not None:  # inf or NaN after a skipped step: logged as such
            metrics["grad_norm"] = float(grad_norm)
        metrics["skipped_steps"] = trainer.guard.skipped
        lamb = client_optimizer(engine.optimizer)
        if hasattr(lamb, "trust_ratio_stats"):  # LAMB: over all tensors, at log steps only
            for key, value in lamb.trust_ratio_stats().items():
                metrics[f"trust_ratio_{key}"] = value
        scale = loss_scale(engine)
        if trainer.cfg.precision == "fp16" and scale is not None:
            metrics["loss_scale"] = scale
        utilisation = mfu(metrics["tflops_per_device"] * 1e12, trainer.peak)
        if utilisation is not None:
            metrics["mfu"] = utilisation  # on real tokens
            metrics["mfu_padded"] = mfu(metrics["padded_tflops_per_device"] * 1e12, trainer.peak)
        metrics.update(memory_metrics(self.device))
        micro = self.phase.micro_batch_size
        metrics["global_batch_size"] = window.micro_batches * micro * trainer.world  # last step's
        if metrics.get("samples_per_s"):  # measured, beside plan --fit's prediction if given
            metrics["step_s"] = self.phase.global_batch_size / metrics["samples_per_s"]
        for key, value in trainer.cfg.planned.get(self.phase.name, {}).items():
            metrics[f"planned_{key}"] = value
        metrics["phase_step"] = step
        self.measured = {
            k: v for k, v in metrics.items() if k.startswith(("memory_", "planned_", "step_s"))
        }
        if not trainer.info.is_main:
            return
        global_step = trainer.progress.global_step
        if trainer.progress.run_id is not None:
            tracking.log_metrics({f"train/{k}": v for k, v in metrics.items()}, step=global_step)
        if bar is not None and bar.tty:
            bar.update(step, f"loss {metrics['loss']:.4f} lr {metrics['lr']:.2e}", force=True)
            return
        nsp = (
            (f" nsp {metrics['nsp_loss']:.4f}", f" nsp_acc {metrics['nsp_accuracy']:.3f}")
            if "nsp_loss" in metrics
            else ("", "")
        )
        log.info(
            "%s step %d/%d (global %d): loss %.4f mlm %.4f%s mlm_acc %.3f%s lr %.3e "
            "%.1f seq/s | %s",
            self.name,
            step,
            self.max_steps,
            global_step,
            metrics["loss"],
            metrics["mlm_loss"],
            nsp[0],
            metrics["mlm_accuracy"],
            nsp[1],
            metrics["lr"],
            metrics["samples_per_s"],
            bar.line(step) if bar is not None else "",
        )
        if bar is not None:
            bar.touch()

    @torch.no_grad()
    def evaluate(self, engine: Any, step: int) -> None:
        """Loss and accuracies on the phase's held-out split, averaged over all ranks."""
        trainer = self.trainer
        split = trainer.cfg.data.heldout_split
        if not trainer.data[self.index].manifest["splits"].get(split, {}).get("instances"):
            return
        try:
            loader = trainer.loader(self.index, evaluation=True)
        except DataError as exc:  # too little held-out data for this many ranks
            if trainer.info.is_main:
                log.warning("%s: no evaluation: %s", self.name, exc)
            return
        engine.eval()
        window = Window(self.device)
        for host in loader:
            batch, stats = self.prep(host)
            window.add(engine(**batch), stats, 1)
            window.steps += 1
        engine.train()
        metrics = window.reduce(trainer.world)
        keys = ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy")
        self.metrics = {k: metrics[k] for k in keys if k in metrics}
        if trainer.info.is_main:
            global_step = trainer.progress.global_step
            log.info(
                "%s eval at global step %d: %s",
                self.name,
                global_step,
                json.dumps({k: round(v, 4) for k, v in self.metrics.items()}),
            )
            if trainer.progress.run_id is not None:
                tracking.log_metrics(
                    {f"eval/{k}": v for k, v in self.metrics.items()}, step=global_step
                )


def _rederived(resume: ckpt.ResumeState, world: int) -> dict[str, int]:
    """The loader position of ``resume`` (saved on another world size) on ``world`` ranks:
    the same sequences of the epoch consumed (the micro batch is fixed per phase)."""
    data = resume.state.data
    return {"epoch": data["epoch"], "batches": data["batches"] * resume.state.world_size // world}


def _later_phase(key: str, index: int) -> bool:
    """Whether ``key`` is a setting of a phase after phase ``index`` (``phases[2].x``)."""
    if not key.startswith("phases["):
        return False
    return int(key[len("phases[") : key.index("]")]) > index


def run_pretraining(cfg: PretrainConfig, faults: Faults | None = None) -> dict[str, Any]:
    """Join (or form) the distributed job and pre-train; rank 0 returns the summary.

    ``faults``: what tests break (:mod:`bertpipe.training.core.faults`; default: what a test's
    entry point installed, nothing in real runs)."""
    # before the process group: a device that cannot run the config is one line per rank
    check_hardware(local_hardware(), precision=cfg.precision, fused=cfg.optimizer.fused)
    info = init_distributed()
    cfg.check_world(info.world_size)
    timeout = cfg.checkpoint.lease_timeout_s
    with lease.held(cfg.output, "pretrain", timeout, rank=info.rank, world_size=info.world_size):
        trainer = Trainer(cfg, info, faults)
        try:
            with watched(info.rank, info.world_size, cfg.distributed.peer_timeout_s):
                summary = trainer.run()
        except PreemptedError as exc:
            log.warning("%s", exc)
            raise
        if info.is_main:
            summary_url = fsio.join(cfg.output, "summary.json")
            fsio.atomic_write_text(summary_url, json.dumps(summary, indent=2))
    return summary
