"""The fine-tuning loop: one task head on a pre-trained BERT, with DeepSpeed, logged to MLflow.

The engine set-up is pre-training's (:mod:`bertpipe.training.engine`: the same distributed init and
generated DeepSpeed config); the optimizer is AdamW with linear warmup and decay. Each epoch
ends with an evaluation of every dev file; the best epoch by the task's main metric is kept
as an HF folder (``<output>/best``) and its metrics are the run's final ones. Predictions are
written for every evaluation. Runs are deterministic for a seed: head init, dropout and data
order all come from it.

Every run has its own folder (:func:`run_folder`): ``output`` if given, never silently
replacing a previous run's files, else a new ``<output_root>/<task>-<UTC time>`` chosen on
rank 0 and broadcast. Metrics are logged against the optimizer step (``epoch`` is a metric of
its own).

The training core is pre-training's: the engine (:func:`~bertpipe.training.engine.
build_engine`), the guarded optimizer step (:class:`~bertpipe.training.step.OptimizerStep`:
non-finite steps skipped, counted and bounded by ``max_bad_steps``), the cadence of
checkpoints and SIGTERM checks and the checkpoints themselves. A run checkpoints every
``checkpoint.every_steps`` steps and on SIGTERM (exit status 143); started again with the
same ``output`` it continues from the latest checkpoint (``checkpoint.resume=auto``) with the
same batches, dropout, partial epoch loss and best epoch so far, so it ends with the metrics
the uninterrupted run has. A completed run deletes its checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bertpipe import fsio, staging, tracking
from bertpipe.config import ConfigError, redacted, to_dict, to_yaml
from bertpipe.finetuning.config import FinetuneConfig
from bertpipe.finetuning.data import (
    TaskData,
    TrainBatches,
    batches,
    load_task,
    model_inputs,
    score,
    write_predictions,
)
from bertpipe.finetuning.heads import (
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertTaskModel,
)
from bertpipe.training import checkpoint as ckpt
from bertpipe.training.cadence import Cadence, PreemptedError, StopFlag
from bertpipe.training.config import OptimizerConfig
from bertpipe.training.engine import DistInfo, EngineSpec, build_engine, init_distributed
from bertpipe.training.export import TOKENIZER_FILES
from bertpipe.training.faults import Faults
from bertpipe.training.guard import SkipGuard
from bertpipe.training.hardware import check_hardware, local_hardware
from bertpipe.training.model import BertModelConfig
from bertpipe.training.optim import warmup_decay
from bertpipe.training.peers import watched
from bertpipe.training.resume import (
    FINETUNE_FIXED,
    changed_settings,
    check_changes,
    log_changes,
    mlflow_tags,
)
from bertpipe.training.step import OptimizerStep

log = logging.getLogger(__name__)

__all__ = [
    "FinetuneResult",
    "Initialisation",
    "load_initialisation",
    "load_task_model",
    "register_best",
    "run_finetuning",
    "run_folder",
]

TAG_SOURCE_RUN = "bertpipe.source_run_id"
"""The pre-training run whose export (or checkpoint) a fine-tuning run starts from."""
TAG_REGISTERED = "bertpipe.registered_model"
RUN_OUTPUTS = ("best", "predictions", "checkpoints", "finetune.yaml")
"""What a fine-tuning run writes in its folder (a sweep: ``trial-*`` folders of these)."""


@dataclass
class Initialisation:
    """Where the encoder comes from and the lineage that goes with it."""

    model_cfg: BertModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer_dir: str
    pretrain_run_id: str | None
    """The pre-training MLflow run (``source_run_id`` of an export, or the checkpoint's)."""
    data_sha256: dict[str, str]
    head_labels: list[str] | None
    """Label names of a task head already in ``init_from`` (a fine-tuned model), if any."""
    own_tokenizer_dir: str | None = None
    """The tokenizer that came with ``init_from`` (the export's, or the pre-training's)."""
    model_id: str | None = None
    """The MLflow logged model of ``init_from`` (``mlflow_model_id`` of an export), if any."""


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


def load_initialisation(cfg: FinetuneConfig) -> Initialisation:
    """Read ``init_from``: an HF BERT folder (an export) or a pre-training checkpoint folder,
    local or on object storage (an export there is downloaded to be read)."""
    url = str(cfg.init_from)
    if staging.is_remote(url):
        if fsio.exists(fsio.join(url, "config.json")):
            with staging.local_copy(url) as local:
                return _load_hf_initialisation(cfg, local, url)
        if ckpt.latest_tag(url) is not None:
            return _load_checkpoint_initialisation(cfg, url)
        raise ConfigError(
            "init_from",
            f"{url} is neither an HF BERT folder (config.json) nor a checkpoint folder (latest)",
        )
    source = Path(url)
    if (source / "config.json").exists():
        return _load_hf_initialisation(cfg, source, str(source))
    if (source / "latest").exists():
        return _load_checkpoint_initialisation(cfg, str(source))
    raise ConfigError(
        "init_from",
        f"{source} is neither an HF BERT folder (config.json) nor a checkpoint folder (latest)",
    )


def _load_hf_initialisation(cfg: FinetuneConfig, source: Path, url: str) -> Initialisation:
    """An export read from local folder ``source`` (a copy of ``url``)."""
    from bertpipe.training.hf import load_hf_folder

    model_cfg, weights = load_hf_folder(source)
    lineage = {}
    if (source / "bertpipe_export.json").exists():
        lineage = json.loads((source / "bertpipe_export.json").read_text())
    hf_config = json.loads((source / "config.json").read_text())
    labels = None
    if any(a != "BertForPreTraining" for a in hf_config.get("architectures", [])):
        id2label = hf_config.get("id2label") or {}
        labels = [id2label[k] for k in sorted(id2label, key=int)] or None
    return Initialisation(
        model_cfg,
        weights,
        cfg.tokenizer or url,
        lineage.get("source_run_id") or lineage.get("mlflow_run_id"),
        lineage.get("data_sha256", {}),
        labels,
        url,
        lineage.get("mlflow_model_id"),
    )


def _load_checkpoint_initialisation(cfg: FinetuneConfig, folder: str) -> Initialisation:
    from bertpipe.training.export import load_checkpoint_model, tokenizer_folder

    model, state = load_checkpoint_model(folder)
    own = tokenizer_folder(state, None)
    return Initialisation(
        model.config,
        model.state_dict(),
        cfg.tokenizer or own,
        state.mlflow_run_id,
        state.data_sha256,
        None,
        own,
    )


def load_task_model(folder: str | Path) -> BertTaskModel:
    """The fine-tuned model saved in ``folder`` (a run's ``best/``) as its bertpipe task model,
    in eval mode."""
    from bertpipe.training.hf import load_hf_folder, load_into

    hf_config = json.loads((Path(folder) / "config.json").read_text())
    architecture = (hf_config.get("architectures") or [""])[0]
    model_cfg, weights = load_hf_folder(folder)
    num_labels = len(hf_config.get("id2label") or {}) or 1
    model: BertTaskModel
    if architecture == "BertForQuestionAnswering":
        model = BertForQuestionAnswering(model_cfg)
    elif architecture == "BertForTokenClassification":
        model = BertForTokenClassification(model_cfg, num_labels)
    elif architecture == "BertForSequenceClassification":
        model = BertForSequenceClassification(model_cfg, num_labels)
    else:
        raise ValueError(f"{folder} holds a {architecture or 'non-task'} model, not a task model")
    load_into(model, weights, strict_heads=True)
    return model.eval()


def run_folder(cfg: FinetuneConfig, info: DistInfo, prefix: str = "") -> str:
    """The run's folder, the same on every rank: chosen (and made) by rank 0, broadcast.

    ``cfg.output`` if given; a folder that already holds files is refused (a
    :class:`ConfigError` on every rank) unless it holds a stopped run's checkpoint that
    ``checkpoint.resume`` continues (not for sweeps), or ``overwrite=true``, which deletes the
    previous run's outputs (:data:`RUN_OUTPUTS`, ``trial-*``) first. Without ``output``: a new
    folder ``<output_root>/<prefix><task name>-<UTC time>`` (``-2``, ``-3``... if taken).
    """
    decision: list[Any] = [None]
    if info.is_main:
        try:
            decision[0] = ("ok", _choose_folder(cfg, prefix))
        except ConfigError as exc:
            decision[0] = ("error", exc.key, exc.message)
    if info.world_size > 1:
        dist.broadcast_object_list(decision, src=0)
    kind, *rest = decision[0]
    if kind == "error":
        raise ConfigError(*rest)
    return str(rest[0])


def _choose_folder(cfg: FinetuneConfig, prefix: str) -> str:
    if cfg.output:
        folder = Path(cfg.output)
        if folder.exists() and not folder.is_dir():
            raise ConfigError("output", f"{folder} is a file: choose a folder for output=")
        if folder.is_dir() and any(folder.iterdir()):
            if not cfg.overwrite and not prefix and _resumable(cfg, folder):
                log.info("%s holds a stopped run's checkpoint: continuing it", folder)
                return str(folder)
            if not cfg.overwrite:
                raise ConfigError(
                    "output",
                    f"{folder} already holds files (a previous run?): choose a new output= (or "
                    "leave it unset for a new folder under output_root), or set overwrite=true "
                    "to replace that run's outputs",
                )
            for path in sorted(folder.iterdir()):
                if path.name not in RUN_OUTPUTS and not re.fullmatch(r"trial-\d+", path.name):
                    continue
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
            if cfg.checkpoint.dir:  # elsewhere: the previous run's checkpoints go too
                ckpt.remove_all(cfg.checkpoint.dir)
            log.warning("overwrite=true: replacing the previous run's outputs in %s", folder)
        folder.mkdir(parents=True, exist_ok=True)
        return str(folder)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", cfg.task.name).strip("-.") or "task"
    base = f"{prefix}{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    root = Path(cfg.output_root)
    root.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        folder = root / (base if n == 1 else f"{base}-{n}")
        try:
            folder.mkdir()  # atomic: two runs started in the same second get two folders
        except FileExistsError:
            continue
        return str(folder)
    raise AssertionError("unreachable")


def _resumable(cfg: FinetuneConfig, folder: Path) -> bool:
    """Whether ``folder`` (a run's ``output``) has a checkpoint that ``checkpoint.resume``
    continues from."""
    if cfg.checkpoint.resume == "none":
        return False
    checkpoints = cfg.checkpoint.dir or str(folder / "checkpoints")
    if cfg.checkpoint.resume == "auto":
        return ckpt.latest_tag(checkpoints) is not None
    return cfg.checkpoint.resume in ckpt.tags(checkpoints)


def _build_head(data: TaskData, model_cfg: BertModelConfig, cfg: FinetuneConfig) -> BertTaskModel:
    kind = data.spec.kind
    if kind == "span_qa":
        return BertForQuestionAnswering(model_cfg)
    if kind == "token_labels":
        return BertForTokenClassification(model_cfg, data.spec.num_labels, cfg.classifier_dropout)
    return BertForSequenceClassification(model_cfg, data.spec.num_labels, cfg.classifier_dropout)


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with fsio.open_url(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _vocab_fingerprint(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def _check_tokenizer(tokenizer: Any, init: Initialisation, model_cfg: BertModelConfig) -> None:
    """The tokenizer must be the one the encoder was pre-trained with: ids of another vocabulary
    index the wrong embeddings (or none at all), the run would still "work", and ``best/``
    would ship the wrong tokenizer."""
    from bertpipe.preprocessing.tokenizer import load_tokenizer

    size = tokenizer.get_vocab_size()
    if size > model_cfg.vocab_size:
        raise ConfigError(
            "tokenizer",
            f"{init.tokenizer_dir} has {size} tokens, the model's embeddings "
            f"{model_cfg.vocab_size}: use the tokenizer the model was pre-trained with (leave "
            "tokenizer unset)",
        )
    own = init.own_tokenizer_dir
    if own is None or Path(own).resolve() == Path(init.tokenizer_dir).resolve():
        return
    try:
        theirs = load_tokenizer(own)
    except Exception:  # the source ships no tokenizer: nothing to compare with
        return
    mine, expected = _vocab_fingerprint(tokenizer), _vocab_fingerprint(theirs)
    if mine != expected:
        raise ConfigError(
            "tokenizer",
            f"{init.tokenizer_dir} is not the tokenizer of {own} (vocabulary sha256 "
            f"{mine[:12]} vs {expected[:12]}): leave tokenizer unset to use the model's own",
        )


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
        changes: dict[str, Any] = {}
        if cfg.hidden_dropout is not None:
            changes["hidden_dropout"] = changes["attention_dropout"] = cfg.hidden_dropout
        self.model_cfg = dataclasses.replace(self.init.model_cfg, **changes)
        self.tokenizer = load_tokenizer(self.init.tokenizer_dir)
        _check_tokenizer(self.tokenizer, self.init, self.model_cfg)
        self.data = load_task(cfg.task, self.tokenizer, self.model_cfg.max_position_embeddings)
        labels = list(self.data.spec.labels)
        if self.init.head_labels is not None and self.init.head_labels != labels:
            raise ConfigError(
                "task.labels",
                f"{cfg.init_from} has a head for labels {self.init.head_labels}, the task has "
                f"{labels}: start from the pre-trained (not fine-tuned) model, or give the "
                "same labels",
            )
        # every rank takes the folder rank 0 chose (a copy: the caller's config is unchanged)
        self.cfg = cfg = dataclasses.replace(cfg, output=run_folder(cfg, info))
        self.output = Path(str(cfg.output))
        self.folder = cfg.checkpoint_dir
        ckpt.configure(self.folder, cfg.checkpoint.local_dir, cfg.checkpoint.publish_timeout_s)
        self.faults = faults if faults is not None else Faults.from_environ(info.rank)
        self.stop = StopFlag()
        self.cadence = Cadence(
            checkpoint_every=cfg.checkpoint.every_steps,
            preemption_every=cfg.checkpoint.preemption_check_steps,
        )
        self.guard = SkipGuard(cfg.max_bad_steps, log_rank=info.is_main)
        self.train_sha256 = _file_sha256(cfg.task.train)
        self.plan = self._schedule()
        self.resume = self._resume_point()
        self.run_id: str | None = None

    def _resume_point(self) -> ckpt.ResumeState | None:
        """The checkpoint to continue from, read once (None: a fresh run)."""
        tag = ckpt.resume_tag(self.folder, self.cfg.checkpoint.resume)
        return None if tag is None else ckpt.ResumeState.read(self.folder, tag, self.info.rank)

    def _continue_from(self, resume: ckpt.ResumeState) -> dict[str, tuple[Any, Any]]:
        """Check a resume against this run (ranks, data, settings); returns the settings
        that changed since the checkpoint."""
        state = resume.state
        if not resume.same_world(self.info.world_size):
            raise ConfigError(
                "checkpoint.resume",
                f"{resume.tag} was saved by {state.world_size} rank(s), this run has "
                f"{self.info.world_size}: fine-tuning resumes on as many ranks as it was "
                "saved on",
            )
        current = {"finetune": self.train_sha256}
        ckpt.check_data(state, current, resume.tag, self.cfg.checkpoint.allow_data_change)
        changes = changed_settings(state.config, redacted(to_dict(self.cfg)))
        check_changes(changes, FINETUNE_FIXED, self.cfg.checkpoint.allow_changes, resume.tag)
        if self.info.is_main:
            log_changes(changes, resume.tag)
        self.run_id = state.mlflow_run_id
        self.guard.skipped = state.skipped_steps
        return changes

    def _model(self) -> BertTaskModel:
        torch.manual_seed(self.cfg.seed)  # the head's initialisation, identical on every rank
        model = _build_head(self.data, self.model_cfg, self.cfg)
        if not self.cfg.random_init:
            from bertpipe.training.hf import load_into

            load_into(model, self.init.weights, strict_heads=False)
        torch.manual_seed(self.cfg.seed + 1000 * self.info.rank)  # dropout
        return model

    def run(
        self, nested_in: str | None = None, run_name: str | None = None, upload_model: bool = True
    ) -> FinetuneResult:
        """Train, evaluate, keep the best epoch; ``upload_model=False`` keeps the best model's
        folder but does not log it to MLflow (a sweep uploads its best trial's only)."""
        cfg, data = self.cfg, self.data
        changes = self._continue_from(self.resume) if self.resume is not None else {}
        tags = {
            "bertpipe.task": data.spec.name,
            "bertpipe.init": "random" if cfg.random_init else "pretrained",
            "bertpipe.finetune_data_sha256": self.train_sha256,
        }
        for phase, sha in self.init.data_sha256.items():
            tags[f"{tracking.TAG_DATA_CHECKSUM}.{phase}"] = sha
        if self.init.pretrain_run_id:
            tags[TAG_SOURCE_RUN] = self.init.pretrain_run_id
        context: Any = contextlib.nullcontext()
        if self.info.is_main:
            self.output.mkdir(parents=True, exist_ok=True)
            (self.output / "finetune.yaml").write_text(to_yaml(cfg))
            context = tracking.start_run(
                cfg.tracking,
                "finetune",
                config=cfg if self.run_id is None else None,
                run_name=run_name or cfg.tracking.run_name or f"{data.spec.name}",
                tags=tags,
                parent_run_id=self.init.pretrain_run_id,
                resume_run_id=self.run_id,
                nested_in=nested_in,
                buffer=tracking.buffer_path(self.output),
            )
        with context as run:
            run_id = run.info.run_id if run is not None else None
            if run_id is not None:
                tracking.log_inputs(self._datasets(), [self.init.model_id or ""])
            if run_id is not None and changes:
                step = self.resume.state.global_step if self.resume else 0
                tracking.set_tags(mlflow_tags(changes, step))
            with self.stop:
                try:
                    result = self._train(run_id)
                finally:  # checkpoint uploads in flight (object storage) end first
                    ckpt.wait_uploads()
            if run is not None:
                self._log_final(result, upload_model)
        if self.info.is_main:  # complete: best/ and the predictions are the run's result
            removed = ckpt.remove_all(self.folder)
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

    # ---------------------------------------------------------------- training

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

    def engine_spec(self, plan: _Schedule) -> EngineSpec:
        cfg = self.cfg
        return EngineSpec(
            micro_batch_size=self.micro,
            global_batch_size=cfg.batch_size,
            world_size=self.info.world_size,
            zero=cfg.zero,
            precision=cfg.precision,
            optimizer=OptimizerConfig(
                weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm
            ),
            learning_rate=cfg.learning_rate,
            schedule=warmup_decay(round(cfg.warmup * plan.total), plan.total),
            universal=cfg.checkpoint.universal,
        )

    def _train(self, run_id: str | None) -> FinetuneResult:
        """Train to the end (from the resume point, if any), logging to MLflow run
        ``run_id`` (None: not tracked)."""
        self.run_id = run_id
        cfg, data, info = self.cfg, self.data, self.info
        plan = self.plan
        spec = self.engine_spec(plan)
        engine, _ = build_engine(self._model(), spec)
        loader = TrainBatches(
            data.train,
            self.micro,
            per_epoch=plan.steps_per_epoch * plan.accumulation,
            seed=cfg.seed,
            rank=info.rank,
            world_size=info.world_size,
        )
        loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)  # this epoch's
        best, step = _Best(), 0
        if self.resume is not None:
            best, step = self._restore(engine, spec, loader, loss_sum)
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
            f", resumed at step {step}" if step else "",
        )
        optimizer_step = OptimizerStep(
            engine,
            plan.accumulation,
            faults=self.faults,
            on_output=lambda out, _: loss_sum.add_(out.loss.detach().double()),
        )
        inputs = (model_inputs(batch, info.device, with_labels=True) for batch in loader)
        started = time.monotonic()
        while step < plan.total:
            epoch = loader.epoch  # the epoch of this step's batches
            result = optimizer_step(step + 1, inputs)
            step += 1
            where = f"epoch {epoch} step {step}"
            self.guard.record(result.skipped, where)
            ended = step >= plan.total
            due = self.cadence.after_step(
                step,
                ended=ended,
                streak=self.guard.streak,
                exhausted=self.guard.exhausted,
                stop=self.stop,
                device=info.device,
            )
            if self.guard.exhausted:
                raise self.guard.error(where, ckpt.latest_tag(self.folder))
            if step % plan.steps_per_epoch == 0:
                self._end_epoch(engine, epoch, step, plan, loss_sum, best, started)
                loss_sum.zero_()
                started = time.monotonic()
            if ended:  # no checkpoint of a complete run
                break
            if due.deferred and info.is_main:
                log.warning("%s: checkpoint deferred, the last steps were skipped", where)
            if due.save:
                self._save(
                    engine, step, loader, best, loss_sum, good=not self.guard.streak, wait=due.stop
                )
            if due.stop:
                raise PreemptedError(f"stopped by SIGTERM at {where}")
        del engine
        return FinetuneResult(
            self.run_id,
            best.metrics,
            best.epoch,
            data.spec.main_metric,
            data.spec.greater_is_better,
            best.history,
            str(self.output),
            best.step,
        )

    def _restore(
        self, engine: Any, spec: EngineSpec, loader: TrainBatches, loss_sum: torch.Tensor
    ) -> tuple[_Best, int]:
        """Continue from :attr:`resume`: engine, this config's rates and schedule, RNG states,
        data position, the epoch's partial loss and the best epoch so far."""
        resume = self.resume
        assert resume is not None and resume.rank_state is not None
        with ckpt.loadable(self.folder, resume.tag, self.info.rank, self.info.world_size) as local:
            engine.load_checkpoint(local, tag=resume.tag)
        spec.apply_to(engine)
        ckpt.restore_rng(resume.rank_state["rng"])
        loader.load_state_dict(resume.rank_state["data"])
        loss_sum.fill_(float(resume.rank_state.get("loop", {}).get("loss_sum", 0.0)))
        log.info("resumed fine-tuning at step %d from %s", resume.state.global_step, resume.tag)
        return _Best.from_state(resume.state.loop), resume.state.global_step

    def _end_epoch(
        self,
        engine: Any,
        epoch: int,
        step: int,
        plan: _Schedule,
        loss_sum: torch.Tensor,
        best: _Best,
        started: float,
    ) -> None:
        """Evaluate, log, and keep the model if this epoch is the best so far."""
        cfg, info = self.cfg, self.info
        dist.all_reduce(loss_sum)
        micro_steps = plan.steps_per_epoch * plan.accumulation
        train_loss = float(loss_sum) / max(1, micro_steps * info.world_size)
        metrics = self._evaluate(engine, epoch)
        epoch_metrics = {
            "train/loss": train_loss,
            "train/skipped_steps": self.guard.skipped,
            "epoch_seconds": time.monotonic() - started,
        }
        epoch_metrics.update({f"eval/{k}": v for k, v in metrics.items()})
        best.history.append({"epoch": epoch, "step": step, **epoch_metrics})
        if info.is_main:
            log.info(
                "epoch %d/%d: train loss %.4f, %s",
                epoch,
                cfg.epochs,
                train_loss,
                ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if "/" not in k),
            )
            if self.run_id is not None:
                # the step axis is optimizer steps, as pre-training's; epoch is a metric
                tracking.log_metrics({**epoch_metrics, "epoch": epoch}, step=step)
        main = self.data.spec.main_metric
        value = metrics.get(main, math.nan)
        better = (lambda a, b: a > b) if self.data.spec.greater_is_better else (lambda a, b: a < b)
        if not best.metrics or (
            math.isfinite(value) and better(value, best.metrics.get(main, math.nan))
        ):
            best.metrics, best.epoch, best.step = metrics, epoch, step
            if cfg.save_model:
                self._save_best(engine)
        dist.barrier()

    def _save(
        self,
        engine: Any,
        step: int,
        loader: TrainBatches,
        best: _Best,
        loss_sum: torch.Tensor,
        *,
        good: bool,
        wait: bool = False,
    ) -> None:
        state = ckpt.CheckpointState(
            phase="finetune",
            phase_index=0,
            phase_step=step,
            global_step=step,
            phase_complete=False,
            data=loader.state_dict(),
            world_size=self.info.world_size,
            mlflow_run_id=self.run_id,
            samples_seen=step * self.micro * self.plan.accumulation,
            model=dataclasses.asdict(self.model_cfg),
            zero_stage=self.cfg.zero.stage,
            precision=self.cfg.precision,
            data_sha256={"finetune": self.train_sha256},
            config=redacted(to_dict(self.cfg)),
            skipped_steps=self.guard.skipped,
            loop=best.state(),
        )
        ckpt.save_and_prune(
            engine,
            self.folder,
            state,
            self.info.rank,
            keep_last=self.cfg.checkpoint.keep_last,
            where=f"step {step}",
            good=good,
            rank_extra={"loss_sum": float(loss_sum)},
            faults=self.faults,
            wait=wait,
        )

    @torch.no_grad()
    def _evaluate(self, engine: Any, epoch: int) -> dict[str, float]:
        """Every dev file on every rank (all ranks take part in the forward passes, as ZeRO-3
        needs); rank 0 scores and writes the predictions."""
        engine.eval()
        metrics: dict[str, float] = {}
        per_token = self.data.spec.kind in ("span_qa", "token_labels")
        for i, dev in enumerate(self.data.dev):
            outputs: dict[str, list[np.ndarray]] = {}
            for batch in batches(dev.features, self.cfg.eval_batch_size):
                out = engine(**model_inputs(batch, self.info.device, with_labels=False))
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
            if not self.info.is_main:
                continue
            merged: dict[str, Any] = {
                k: (v if per_token else np.concatenate(v)) for k, v in outputs.items()
            }
            scores, predicted = score(self.data, dev, merged, self.cfg.task)
            folder = self.output / "predictions" / f"epoch{epoch}" / dev.name
            write_predictions(self.data, dev, predicted, folder)
            prefix = "" if i == 0 else f"{dev.name}/"
            metrics.update({f"{prefix}{k}": float(v) for k, v in scores.items()})
        engine.train()
        return metrics

    def _save_best(self, engine: Any) -> None:
        if not self.info.is_main:
            return
        from bertpipe.training.hf import save_hf_folder

        best = self.output / "best"
        if best.exists():
            shutil.rmtree(best)
        extra = {}
        for name in TOKENIZER_FILES:
            path = Path(self.init.tokenizer_dir) / name
            if path.exists():
                extra[name] = path.read_bytes()
        save_hf_folder(engine.module, best, extra_files=extra)
        if self.data.spec.labels:
            config = json.loads((best / "config.json").read_text())
            config["id2label"] = {str(i): label for i, label in enumerate(self.data.spec.labels)}
            config["label2id"] = {label: i for i, label in enumerate(self.data.spec.labels)}
            (best / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    def _log_final(self, result: FinetuneResult, upload_model: bool) -> None:
        tracking.log_metrics({f"best/{k}": v for k, v in result.metrics.items()})
        tracking.log_metrics({"best/epoch": result.best_epoch, "best/step": result.best_step})
        tracking.log_dict(
            {
                "task": self.data.spec.name,
                "kind": self.data.spec.kind,
                "labels": list(self.data.spec.labels),
                "main_metric": self.data.spec.main_metric,
                "read_reports": [r.summary() for r in self.data.reports],
                "history": result.history,
            },
            "finetune_summary.json",
        )
        if (self.output / "predictions").exists():
            tracking.log_artifacts(str(self.output / "predictions"), "predictions")
        best = self.output / "best"
        wanted = self.cfg.register or (self.cfg.save_model and upload_model)
        if wanted and best.exists() and result.run_id is not None:
            logged = register_best(best, self.cfg.register, result.run_id)
            if logged is not None:
                result.model_id, result.registered_model = logged.model_id, logged.registered


def register_best(
    folder: Path, name: str | None, run_id: str, model_id: str | None = None
) -> tracking.LoggedModelRef | None:
    """Log the fine-tuned model in ``folder`` as the model output of run ``run_id`` (MLflow's
    ``transformers`` flavour, the pipeline task of its head) and, with ``name``, register it as
    a new version of ``name`` (the run gets a ``bertpipe.registered_model`` tag). A model
    already logged (``model_id``: a sweep trial's) is registered, not logged again.

    Without ``name`` tracking never stops the run: while the store is down (the open run's
    buffer cannot be replayed), or if logging fails, the folder goes to the run as plain
    artifacts ``model`` instead, through the buffer, and None is returned. With ``name`` any
    failure is a :class:`~bertpipe.tracking.RegistryError` naming ``tracking.uri``."""
    import mlflow

    from bertpipe.tracking.client import quick_http
    from bertpipe.tracking.lifecycle import current_outbox

    if model_id is not None:  # logged already: register it (or nothing to do)
        if name is None:
            return tracking.LoggedModelRef(model_id, f"models:/{model_id}")
        with quick_http(upload=True):
            registered = tracking.register_logged_model(model_id, name, uri_key="tracking.uri")
        mlflow.MlflowClient().set_tag(run_id, TAG_REGISTERED, registered)
        return tracking.LoggedModelRef(model_id, f"models:/{model_id}", registered)
    outbox = current_outbox()
    if outbox is not None and outbox.run_id != run_id:
        outbox = None  # another run's (a sweep's parent): no buffer for this run
    logged: tracking.LoggedModelRef | None = None
    if name is None and outbox is not None and outbox.pending() and not outbox.replay():
        log.warning("MLflow is down: the model of run %s is buffered as artifacts `model`", run_id)
    else:
        with quick_http(upload=True):
            logged = tracking.log_hf_model(
                folder,
                task=tracking.hf_task(folder),
                run_id=run_id,
                name="model",
                register=name,
                uri_key="tracking.uri",
            )
    if logged is None:
        if outbox is not None:  # the files at least, when the store answers again
            log.info("uploading %s to run %s as plain artifacts `model` instead", folder, run_id)
            tracking.log_artifacts(str(folder), "model")
        return None
    if logged.registered:
        mlflow.MlflowClient().set_tag(run_id, TAG_REGISTERED, logged.registered)
    return logged


def run_finetuning(
    cfg: FinetuneConfig,
    nested_in: str | None = None,
    run_name: str | None = None,
    upload_model: bool = True,
    faults: Faults | None = None,
) -> FinetuneResult:
    """Join (or form) the distributed job and fine-tune; returns the best epoch's metrics.

    A SIGTERM saves a checkpoint and raises :class:`~bertpipe.training.cadence.PreemptedError`
    (``bertpipe finetune`` exits 143). ``faults``: what tests break (default: what the
    environment asks, nothing in real runs)."""
    # before the process group: a device that cannot run the precision is one line per rank
    check_hardware(local_hardware(), precision=cfg.precision)
    info = init_distributed()
    cfg.micro_batch(info.world_size)
    finetuner = Finetuner(cfg, info, faults)
    try:
        with watched(info.rank, info.world_size, cfg.distributed.peer_timeout_s):
            return finetuner.run(nested_in=nested_in, run_name=run_name, upload_model=upload_model)
    except PreemptedError as exc:
        log.warning("%s; run the same command (output=%s) to continue", exc, finetuner.output)
        raise
