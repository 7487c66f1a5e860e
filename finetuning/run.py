"""Fine-tuning: one task head on a pre-trained BERT, trained by the one training loop.

What this module holds is what fine-tuning adds to the training core it shares with
pre-training: the task's model and data, epochs (:class:`EpochStage`, the loop's stage: batches
of the training file, an evaluation of every dev file at each epoch's end, the best epoch by
the task's main metric kept as an HF folder ``<output>/best`` whose metrics are the run's
final ones), and its MLflow run. Runs are deterministic for a seed: head init, dropout and
data order all come from it. Metrics are logged against the optimizer step (``epoch`` is a
metric of its own).

The loop (:func:`~bertpipe.training.core.loop.run_loop`: the guarded step, ``max_bad_steps``,
checkpoints every ``checkpoint.every_steps`` steps and on SIGTERM, exit status 143, the save
of the last good step after an error), the checkpoints
(:class:`~bertpipe.training.core.checkpoints.CheckpointManager`) and the engine are pre-training's.
Started again with the same ``output`` a run continues from the latest checkpoint
(``checkpoint.resume=auto``) with the same batches, dropout, partial epoch loss and best epoch
so far, so it ends with the metrics the uninterrupted run has; on another world size it
continues from the same step. A completed run deletes its checkpoints. Where the encoder comes
from is :mod:`bertpipe.finetuning.initialisation`, the run's folder
:mod:`bertpipe.finetuning.run_folder`, what it publishes :mod:`bertpipe.finetuning.publish`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bertpipe import tracking
from bertpipe.config import ConfigError, redacted, to_dict, to_yaml
from bertpipe.finetuning import publish
from bertpipe.finetuning.config import FinetuneConfig
from bertpipe.finetuning.data import (
    TrainBatches,
    batches,
    load_task,
    model_inputs,
    score,
    write_predictions,
)
from bertpipe.finetuning.heads import BertTaskModel, build_head
from bertpipe.finetuning.initialisation import (
    Initialisation,
    check_tokenizer,
    file_sha256,
    load_initialisation,
    load_task_model,
)
from bertpipe.finetuning.run_folder import run_folder
from bertpipe.training.core import faults as fault_injection
from bertpipe.training.core.cadence import Cadence, PreemptedError, StopFlag
from bertpipe.training.core.checkpoints import CheckpointManager, Position, Restored, StageState
from bertpipe.training.core.engine import (
    DistInfo,
    EngineSpec,
    build_engine,
    engine_spec,
    init_distributed,
)
from bertpipe.training.core.faults import Faults
from bertpipe.training.core.guard import SkipGuard
from bertpipe.training.core.hardware import check_hardware, local_hardware
from bertpipe.training.core.loop import run_loop
from bertpipe.training.core.peers import watched
from bertpipe.training.core.resume import FINETUNE_FIXED, mlflow_tags
from bertpipe.training.core.schedules import warmup_decay
from bertpipe.training.core.step import StepResult
from bertpipe.training.models.families import with_dropout

log = logging.getLogger(__name__)

__all__ = [
    "FinetuneResult",
    "Finetuner",
    "Initialisation",
    "load_initialisation",
    "load_task_model",
    "run_finetuning",
    "run_folder",
]

TAG_SOURCE_RUN = "bertpipe.source_run_id"
"""The pre-training run whose export (or checkpoint) a fine-tuning run starts from."""


@dataclass
class FinetuneResult:
    """What a fine-tuning run produced."""

    run_id: str | None
    metrics: dict[str, float]
    """The best epoch's metrics on the first dev file."""
    best_epoch: int
    main_metric: str
    greater_is_better: bool
    history: list[dict[str, float]] = field(default_factory=list)
    output: str = ""
    best_step: int = 0
    """Optimizer steps done when the best epoch ended (the metrics' step axis)."""
    registered_model: str | None = None
    """``NAME/VERSION`` in MLflow's model registry, when ``register`` was set."""
    model_id: str | None = None
    """The best model as a logged model of the run (``m-...``; ``models:/<id>``), when it was
    logged (``save_model``; a sweep: its best trial's, or every trial's with
    ``keep_models=all``)."""


@dataclass
class _Best:
    """The best epoch so far and every epoch's metrics (the same on every rank; saved in the
    checkpoints, so that a resumed run selects as the uninterrupted one)."""

    metrics: dict[str, float] = field(default_factory=dict)
    epoch: int = 0
    step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)

    @classmethod
    def from_state(cls, loop: dict[str, Any]) -> _Best:
        return cls(
            dict(loop.get("best", {})),
            int(loop.get("best_epoch", 0)),
            int(loop.get("best_step", 0)),
            list(loop.get("history", [])),
        )

    def state(self) -> dict[str, Any]:
        return {
            "best": self.metrics,
            "best_epoch": self.epoch,
            "best_step": self.step,
            "history": self.history,
        }


@dataclass(frozen=True)
class _Schedule:
    """How the training file divides into steps on this world size."""

    inputs: int
    micro: int
    accumulation: int
    steps_per_epoch: int
    epochs: int

    @property
    def total(self) -> int:
        return self.steps_per_epoch * self.epochs


class Finetuner:
    """One fine-tuning run on this rank."""

    def __init__(self, cfg: FinetuneConfig, info: DistInfo, faults: Faults | None = None) -> None:
        from bertpipe.preprocessing.tokenizer import load_tokenizer

        cfg.check_runnable()
        self.cfg = cfg
        self.info = info
        self.micro = cfg.micro_batch(info.world_size)
        self.init = load_initialisation(cfg)
        self.model_cfg = with_dropout(self.init.model_cfg, cfg.hidden_dropout)
        self.tokenizer = load_tokenizer(self.init.tokenizer_dir)
        check_tokenizer(self.tokenizer, self.init, self.model_cfg)
        self.data = load_task(cfg.task, self.tokenizer, self.model_cfg.max_position_embeddings)
        labels = list(self.data.spec.labels)
        if self.init.head_labels is not None and self.init.head_labels != labels:
            raise ConfigError(
                "task.labels",
                f"{cfg.init_from} has a head for labels {self.init.head_labels}, the task has "
                f"{labels}: start from the pre-trained (not fine-tuned) model, or give the "
                "same labels",
            )
        # every rank takes the folder rank 0 chose (a copy: the caller's config is unchanged),
        # held under its lease until close()
        self.closing = contextlib.ExitStack()
        folder = self.closing.enter_context(run_folder(cfg, info))
        try:
            self._set_up(dataclasses.replace(cfg, output=folder), faults)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the run folder's lease."""
        self.closing.close()

    def _set_up(self, cfg: FinetuneConfig, faults: Faults | None) -> None:
        info = self.info
        self.cfg = cfg
        self.output = Path(str(cfg.output))
        self.faults = faults if faults is not None else fault_injection.for_rank(info.rank)
        self.stop = StopFlag()
        self.guard = SkipGuard(cfg.max_bad_steps, log_rank=info.is_main)
        self.train_sha256 = file_sha256(cfg.task.train)
        self.plan = self._schedule()
        self.cadence = Cadence(
            eval_every=self.plan.steps_per_epoch,  # an epoch's end
            checkpoint_every=cfg.checkpoint.every_steps,
            preemption_every=cfg.checkpoint.preemption_check_steps,
            save_at_end=False,  # the result of a complete run is best/, not a checkpoint
        )
        self.checkpoints = CheckpointManager(
            cfg.checkpoint,
            cfg.checkpoint_dir,
            info,
            self.guard,
            seed=cfg.seed,
            config=redacted(to_dict(cfg)),
            model=dataclasses.asdict(self.model_cfg),
            zero_stage=cfg.zero.stage,
            precision=cfg.precision,
            data_sha256={"finetune": self.train_sha256},
            faults=self.faults,
        )
        self.resume = self.checkpoints.resume_point()

    def _model(self) -> BertTaskModel:
        torch.manual_seed(self.cfg.seed)  # the head's initialisation, identical on every rank
        model = build_head(self.data.spec, self.model_cfg, self.cfg.classifier_dropout)
        if not self.cfg.random_init:
            from bertpipe.training.models.hf import load_into

            load_into(model, self.init.weights, strict_heads=False)
        torch.manual_seed(self.cfg.seed + 1000 * self.info.rank)  # dropout
        return model

    def run(
        self, nested_in: str | None = None, run_name: str | None = None, upload_model: bool = True
    ) -> FinetuneResult:
        """Train, evaluate, keep the best epoch; ``upload_model=False`` keeps the best model's
        folder but does not log it to MLflow (a sweep uploads its best trial's only)."""
        cfg, data = self.cfg, self.data
        changes = {}
        if self.resume is not None:
            changes = self.checkpoints.continue_from(self.resume, FINETUNE_FIXED)
        tags = {
            "bertpipe.task": data.spec.name,
            "bertpipe.init": "random" if cfg.random_init else "pretrained",
            "bertpipe.finetune_data_sha256": self.train_sha256,
        }
        for phase, sha in self.init.data_sha256.items():
            tags[f"{tracking.TAG_DATA_CHECKSUM}.{phase}"] = sha
        if self.init.pretrain_run_id:
            tags[TAG_SOURCE_RUN] = self.init.pretrain_run_id
        resumed = self.checkpoints.progress.run_id
        context: Any = contextlib.nullcontext()
        if self.info.is_main:
            self.output.mkdir(parents=True, exist_ok=True)
            (self.output / "finetune.yaml").write_text(to_yaml(cfg))
            context = tracking.start_run(
                cfg.tracking,
                "finetune",
                config=cfg if resumed is None else None,
                run_name=run_name or cfg.tracking.run_name or f"{data.spec.name}",
                tags=tags,
                parent_run_id=self.init.pretrain_run_id,
                resume_run_id=resumed,
                nested_in=nested_in,
                buffer=tracking.buffer_path(self.output),
            )
        with context as run:
            run_id = run.info.run_id if run is not None else None
            if run_id is not None:
                tracking.log_inputs(self._datasets(), [self.init.model_id or ""])
            if run_id is not None and changes:
                tracking.set_tags(mlflow_tags(changes, self.checkpoints.progress.global_step))
            with self.stop, self.checkpoints.uploads_finished():
                result = self._train(run_id)
            if run is not None:
                publish.log_result(result, data, self.output, cfg, upload_model)
        if self.info.is_main:  # complete: best/ and the predictions are the run's result
            removed = self.checkpoints.remove_all()
            if removed:
                log.info("run complete: removed its checkpoints %s", ", ".join(removed))
        return result

    def _datasets(self) -> list[tracking.DatasetRef]:
        """The task's files as the run's dataset inputs: the training file (its sha256 is
        the one the run is tagged with) and each evaluation file."""
        task, name = self.cfg.task, self.data.spec.name
        train = tracking.DatasetRef(
            name=f"{name}/train",
            url=task.train,
            sha256=self.train_sha256,
            profile={"features": len(self.data.train["input_ids"]), "file": task.train},
        )
        dev = [
            tracking.files_dataset(f"{name}/{d.name}", [d.path], content=True, context="evaluation")
            for d in self.data.dev
        ]
        return [train, *dev]

    def _schedule(self) -> _Schedule:
        cfg, world = self.cfg, self.info.world_size
        n = len(self.data.train["input_ids"])
        accumulation = cfg.batch_size // (self.micro * world)
        steps_per_epoch = ((n // world) // self.micro) // accumulation
        if steps_per_epoch < 1:
            raise ConfigError(
                "batch_size", f"{n} training inputs are too few for one batch of {cfg.batch_size}"
            )
        return _Schedule(n, self.micro, accumulation, steps_per_epoch, cfg.epochs)

    def engine_spec(self) -> EngineSpec:
        total = self.plan.total
        return engine_spec(
            self.cfg,
            micro_batch_size=self.micro,
            global_batch_size=self.cfg.batch_size,
            world_size=self.info.world_size,
            learning_rate=self.cfg.learning_rate,
            schedule=warmup_decay(round(self.cfg.warmup * total), total),
        )

    def _train(self, run_id: str | None) -> FinetuneResult:
        """Train to the end (from the resume point, if any), logging to MLflow run
        ``run_id`` (None: not tracked)."""
        self.checkpoints.progress.run_id = run_id
        cfg, data, info, plan = self.cfg, self.data, self.info, self.plan
        spec = self.engine_spec()
        engine, _ = build_engine(self._model(), spec)
        restored = None
        if self.resume is not None:
            restored = self.checkpoints.restore(engine, spec, self.resume)
        stage = EpochStage(self, restored)
        log.info(
            "fine-tuning %s: %d inputs, %d epochs x %d steps of %d (%d x %d x %d), lr %.1e%s",
            data.spec.name,
            plan.inputs,
            cfg.epochs,
            plan.steps_per_epoch,
            cfg.batch_size,
            self.micro,
            plan.accumulation,
            info.world_size,
            cfg.learning_rate,
            f", resumed at step {stage.start}" if stage.start else "",
        )
        if stage.epoch_end_pending():  # saved after an error in its epoch's end
            stage.evaluate(engine, stage.start)
        run_loop(
            engine,
            stage,
            self.checkpoints,
            start=Position(stage.start, stage.position()),
            cadence=self.cadence,
            stop=self.stop,
            faults=self.faults,
        )
        del engine
        best = stage.best
        return FinetuneResult(
            run_id,
            best.metrics,
            best.epoch,
            data.spec.main_metric,
            data.spec.greater_is_better,
            best.history,
            str(self.output),
            best.step,
        )


class EpochStage:
    """A fine-tuning run as the training loop's stage: micro-batches of the training file,
    epoch after epoch; at each epoch's end the training loss, an evaluation of every dev
    file and the best epoch so far (kept as ``best/``)."""

    name = "fine-tuning"

    def __init__(self, run: Finetuner, restored: Restored | None) -> None:
        plan, info = run.plan, run.info
        self.run = run
        self.max_steps = plan.total
        self.accumulation = plan.accumulation
        self.samples_per_step = plan.micro * plan.accumulation
        self.loader = TrainBatches(
            run.data.train,
            plan.micro,
            per_epoch=plan.steps_per_epoch * plan.accumulation,
            seed=run.cfg.seed,
            rank=info.rank,
            world_size=info.world_size,
        )
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)  # this epoch's
        self.loss_from = 0
        """The step from which ``loss_sum`` holds the epoch's losses on this rank."""
        self.best, self.start = _Best(), 0
        if restored is not None:
            assert run.resume is not None
            self.start = restored.step
            self.best = _Best.from_state(run.resume.state.loop)
            if restored.data is not None:
                self.loader.load_state_dict(restored.data)
                self.loss_sum.fill_(float(restored.rank_loop.get("loss_sum", 0.0)))
            else:  # saved on another world size: the same step; the epoch's loss from here on
                self.loader.load_state_dict(self._rederived(run.resume.state.loop))
                self.loss_from = self.start
        self._done_loss = self.loss_sum.clone()
        """``loss_sum`` after the last completed step (what a checkpoint holds)."""
        self.started = time.monotonic()
        self._inputs: Generator[Any, None, None] | None = None

    def _rederived(self, loop: dict[str, Any]) -> dict[str, int]:
        """The loader position of step :attr:`start` on this world size."""
        spe = self.run.plan.steps_per_epoch
        saved = loop.get("steps_per_epoch")
        if saved is not None and int(saved) != spe:
            resume = self.run.resume
            assert resume is not None
            raise ConfigError(
                "checkpoint.resume",
                f"{resume.tag} was saved by {resume.state.world_size} rank(s) with {saved} "
                f"steps per epoch; on {self.run.info.world_size} ranks an epoch has {spe}, so "
                "the schedule would change: resume on as many ranks as it was saved on",
            )
        return {"epoch": self.start // spe + 1, "batches": self.start % spe * self.accumulation}

    def epoch_end_pending(self) -> bool:
        """Whether the run resumed at an epoch's end whose evaluation did not happen."""
        spe = self.run.plan.steps_per_epoch
        if not self.start or self.start % spe or self.start >= self.max_steps:
            return False
        done = [int(h.get("epoch", 0)) for h in self.best.history]
        return max(done, default=0) < self.start // spe

    def batches(self) -> Generator[Any, None, None]:
        device = self.run.info.device
        self._inputs = (model_inputs(b, device, with_labels=True) for b in self.loader)
        return self._inputs

    def position(self) -> dict[str, int]:
        return self.loader.state_dict()

    def where(self, step: int, global_step: int) -> str:
        return f"epoch {(step - 1) // self.run.plan.steps_per_epoch + 1} step {step}"

    def on_output(self, output: Any, extra: Any) -> None:
        self.loss_sum.add_(output.loss.detach().double())

    def after_step(self, step: int, result: StepResult) -> None:
        self._done_loss = self.loss_sum.clone()  # a step's losses, all of them

    def log(self, engine: Any, step: int) -> None:
        """Between epoch ends only a run of skipped steps is news: its count, before the
        loop stops the run at ``max_bad_steps`` (the epoch's end logs the rest)."""
        run = self.run
        tracked = run.info.is_main and run.checkpoints.progress.run_id is not None
        if run.guard.streak and tracked:
            tracking.log_metrics({"train/skipped_steps": run.guard.skipped}, step=step)

    def state(self, ended: bool) -> StageState:
        loop = {**self.best.state(), "steps_per_epoch": self.run.plan.steps_per_epoch}
        rank_loop = {"loss_sum": float(self._done_loss)}
        return StageState("finetune", 0, False, loop, rank_loop)

    def close(self) -> None:
        if self._inputs is not None:
            self._inputs.close()

    def evaluate(self, engine: Any, step: int) -> None:
        """The end of the epoch of step ``step``: evaluate, log, and keep the model if this
        epoch is the best so far."""
        run, cfg, info, plan = self.run, self.run.cfg, self.run.info, self.run.plan
        epoch = step // plan.steps_per_epoch
        dist.all_reduce(self.loss_sum)
        counted = step - max(self.loss_from, step - plan.steps_per_epoch)  # steps of the epoch
        micro_batches = counted * plan.accumulation * info.world_size
        train_loss = float(self.loss_sum) / micro_batches if micro_batches else math.nan
        metrics = self._evaluate(engine, epoch)
        epoch_metrics = {
            "train/loss": train_loss,
            "train/skipped_steps": run.guard.skipped,
            "epoch_seconds": time.monotonic() - self.started,
        }
        epoch_metrics.update({f"eval/{k}": v for k, v in metrics.items()})
        self.best.history.append({"epoch": epoch, "step": step, **epoch_metrics})
        if info.is_main:
            log.info(
                "epoch %d/%d: train loss %.4f, %s",
                epoch,
                cfg.epochs,
                train_loss,
                ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if "/" not in k),
            )
            if run.checkpoints.progress.run_id is not None:
                # the step axis is optimizer steps, as pre-training's; epoch is a metric
                tracking.log_metrics({**epoch_metrics, "epoch": epoch}, step=step)
        main = run.data.spec.main_metric
        value = metrics.get(main, math.nan)
        better = (lambda a, b: a > b) if run.data.spec.greater_is_better else (lambda a, b: a < b)
        best = self.best
        if not best.metrics or (
            math.isfinite(value) and better(value, best.metrics.get(main, math.nan))
        ):
            best.metrics, best.epoch, best.step = metrics, epoch, step
            if cfg.save_model and info.is_main:
                publish.save_best(engine.module, run.output, run.init.tokenizer_dir, run.data.spec)
        dist.barrier()
        self.loss_sum.zero_()
        self._done_loss = self.loss_sum.clone()
        self.started = time.monotonic()

    @torch.no_grad()
    def _evaluate(self, engine: Any, epoch: int) -> dict[str, float]:
        """Every dev file on every rank (all ranks take part in the forward passes, as ZeRO-3
        needs); rank 0 scores and writes the predictions."""
        run = self.run
        engine.eval()
        metrics: dict[str, float] = {}
        per_token = run.data.spec.kind in ("span_qa", "token_labels")
        for i, dev in enumerate(run.data.dev):
            outputs: dict[str, list[np.ndarray]] = {}
            for batch in batches(dev.features, run.cfg.eval_batch_size):
                out = engine(**model_inputs(batch, run.info.device, with_labels=False))
                for key in ("logits", "start_logits", "end_logits"):
                    value = getattr(out, key, None)
                    if value is None:
                        continue
                    array = value.float().cpu().numpy()
                    if per_token:  # one array per input, cut to its real length
                        rows = zip(array, batch["lengths"], strict=True)
                        outputs.setdefault(key, []).extend(row[:n] for row, n in rows)
                    else:
                        outputs.setdefault(key, []).append(array)
            if not run.info.is_main:
                continue
            merged: dict[str, Any] = {
                k: (v if per_token else np.concatenate(v)) for k, v in outputs.items()
            }
            scores, predicted = score(run.data, dev, merged, run.cfg.task)
            folder = run.output / "predictions" / f"epoch{epoch}" / dev.name
            write_predictions(run.data, dev, predicted, folder)
            prefix = "" if i == 0 else f"{dev.name}/"
            metrics.update({f"{prefix}{k}": float(v) for k, v in scores.items()})
        engine.train()
        return metrics


def run_finetuning(
    cfg: FinetuneConfig,
    nested_in: str | None = None,
    run_name: str | None = None,
    upload_model: bool = True,
    faults: Faults | None = None,
) -> FinetuneResult:
    """Join (or form) the distributed job and fine-tune; returns the best epoch's metrics.

    A SIGTERM saves a checkpoint and raises :class:`~bertpipe.training.core.cadence.PreemptedError`
    (``bertpipe finetune`` exits 143). ``faults``: what tests break (default: what a test's
    entry point installed, nothing in real runs)."""
    # before the process group: a device that cannot run the config is one line per rank
    check_hardware(local_hardware(), precision=cfg.precision, fused=cfg.optimizer.fused)
    info = init_distributed()
    cfg.micro_batch(info.world_size)
    finetuner = Finetuner(cfg, info, faults)
    try:
        with watched(info.rank, info.world_size, cfg.distributed.peer_timeout_s):
            return finetuner.run(nested_in=nested_in, run_name=run_name, upload_model=upload_model)
    except PreemptedError as exc:
        log.warning("%s; run the same command (output=%s) to continue", exc, finetuner.output)
        raise
    finally:
        finetuner.close()
