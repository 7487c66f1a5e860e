"""``bertpipe finetune`` / ``bertpipe sweep``: the typed fine-tuning config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from bertpipe.config import ConfigError
from bertpipe.tracking import TrackingConfig
from bertpipe.training.core.config import (
    CheckpointConfig,
    DistributedConfig,
    OptimizerConfig,
    ZeroConfig,
    check_engine_settings,
)

__all__ = ["FinetuneConfig", "SweepSpec", "TaskConfig"]

TaskFamily = Literal["glue", "table", "squad", "conll", "klue"]


@dataclass
class TaskConfig:
    """The task: its family, files and how examples become model inputs."""

    family: TaskFamily = "table"
    """``glue`` (the nine GLUE TSV layouts), ``table`` (CSV/TSV/JSONL with named columns),
    ``squad`` (SQuAD v1.1/v2.0 JSON), ``conll`` (CoNLL-2003 token labels) or ``klue`` (a
    KLUE task's files as its release lays them out: ``ynat``, ``sts``, ``nli``, ``ner``,
    ``mrc``)."""
    name: str = "task"
    """GLUE task name (``sst-2``, ``mnli``...), KLUE task name (``ynat``, ``sts``, ``nli``,
    ``ner``, ``mrc``) or a name for the others (used in metrics)."""
    train: str = ""
    """Training file."""
    dev: list[str] = field(default_factory=list)
    """Evaluation file(s); MNLI: matched and mismatched. Metrics of the first pick the best
    epoch; the others are logged with their file name as prefix."""
    kind: Literal["classification", "regression"] = "classification"
    """table: a class per row, or a number (regression)."""
    text_a: str = "text"
    """table: column of the first text."""
    text_b: str | None = None
    """table: column of the second text (sentence pairs)."""
    label: str = "label"
    """table: column of the label."""
    labels: list[str] | None = None
    """table/conll: the label names in id order; null: sorted from the training file."""
    main_metric: str | None = None
    """Metric that picks the best epoch; null: the task's default."""
    max_seq_length: int = 128
    """Tokens per input, specials included; must not exceed the model's positions."""
    version_2: bool | None = None
    """squad: SQuAD 2.0 (unanswerable questions); null: detected from the file."""
    doc_stride: int = 128
    """squad: step between context windows."""
    max_query_length: int = 64
    """squad: longest question, in tokens."""
    max_answer_length: int = 30
    """squad: longest predicted answer, in tokens."""
    n_best_size: int = 20
    """squad: candidate spans considered per question."""
    null_score_diff_threshold: float = 0.0
    """squad v2: predict "no answer" when the null score beats the best span by more."""
    language: str = "en"
    """squad: the answers' language for exact match and F1. ``en``: the official SQuAD
    script's normalisation; any other code (``ko``, ``zh``, ``ja``, ``de``...): MLQA's
    multilingual one (Unicode punctuation, the language's articles, CJK characters as
    tokens)."""

    def check_runnable(self) -> None:
        if not self.train:
            raise ConfigError("task.train", "give the training file")
        if not self.dev:
            raise ConfigError("task.dev", "give at least one evaluation file")

    def __post_init__(self) -> None:
        if self.max_seq_length < 8:
            raise ConfigError("max_seq_length", "must be at least 8")


@dataclass
class SweepSpec:
    """``bertpipe sweep``: the grid of trials, each a nested MLflow run under one parent."""

    learning_rate: list[float] = field(default_factory=lambda: [5e-5, 4e-5, 3e-5, 2e-5])
    """The BERT paper's grid."""
    batch_size: list[int] = field(default_factory=lambda: [16, 32])
    """Values of ``batch_size`` to try."""
    epochs: list[int] = field(default_factory=lambda: [2, 3, 4])
    """Values of ``epochs`` to try."""
    max_trials: int | None = None
    """Run only the first N trials of the grid (in grid order)."""
    keep_models: Literal["best", "all"] = "best"
    """``best``: only the best trial's model is kept (its ``best/`` folder, uploaded to its
    MLflow run once the sweep ends); the other trials' model files are deleted as soon as a
    better trial is known. ``all``: every trial keeps and uploads its model. Predictions,
    metrics and params are kept for every trial either way."""

    def __post_init__(self) -> None:
        if not (self.learning_rate and self.batch_size and self.epochs):
            raise ConfigError("learning_rate", "every grid axis needs at least one value")


@dataclass
class FinetuneConfig:
    """``bertpipe finetune``: one task, one output layer on top of a pre-trained BERT."""

    output: str | None = None
    """Run folder: best model, predictions, resolved config. Null: a new folder
    ``<output_root>/<task name>-<UTC time>`` (``sweep-<task name>-<UTC time>`` for sweeps)
    per run. A given folder that already holds files is refused unless ``overwrite=true``,
    or it holds a stopped run's checkpoint (``checkpoint.resume=auto`` continues it)."""
    output_root: str = "runs/finetune"
    """Where the run folders of runs without ``output`` are made."""
    overwrite: bool = False
    """Let ``output`` name a folder that holds a previous run: its ``best/``,
    ``predictions/``, ``checkpoints/``, ``trial-*/`` and ``finetune.yaml`` are deleted first
    (other files are left alone); it starts afresh even if it holds a checkpoint."""
    init_from: str | None = None
    """Where the encoder comes from: a transformers BERT folder (``bertpipe export``'s or
    any HF BERT), or a bertpipe pre-training checkpoint folder (with ``latest``)."""
    random_init: bool = False
    """Keep the architecture of ``init_from`` but start from random weights (a baseline)."""
    tokenizer: str | None = None
    """Tokenizer folder; null: the one in ``init_from`` (exports carry theirs)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    learning_rate: float = 3e-5
    """Peak learning rate (linear warmup, then linear decay to zero)."""
    batch_size: int = 32
    """Sequences per optimizer step, all ranks together."""
    micro_batch_size: int | None = None
    """Sequences per rank per forward pass; null: batch_size / world size."""
    epochs: int = 3
    """Passes over the training file; every epoch is evaluated."""
    warmup: float = 0.1
    """Fraction of the optimizer steps spent warming up."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer, the same section as pre-training's: AdamW (default) or LAMB, betas,
    eps, weight decay, gradient clipping, fused kernels."""
    weight_decay: float | None = None
    """Alias of ``optimizer.weight_decay`` (the key of configs written before the optimizer
    section); set, it is moved there. Null: ``optimizer.weight_decay`` (0.01)."""
    max_grad_norm: float | None = None
    """Alias of ``optimizer.max_grad_norm``, as ``weight_decay``. Null: that (1.0)."""
    max_bad_steps: int = 20
    """Stop (exit status 2) after this many consecutive optimizer steps with a non-finite loss
    or gradient; such a step is never applied and is counted in ``train/skipped_steps``."""
    hidden_dropout: float | None = None
    """Override the encoder's dropout; null keeps the checkpoint's."""
    classifier_dropout: float | None = None
    """Dropout before the task layer; null: the encoder's hidden dropout."""
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"
    """Training precision; fp16 uses a dynamic loss scale."""
    mixed_precision: Literal["weights", "autocast"] = "weights"
    """With bf16, as pre-training's: bf16 weights with fp32 master weights (``weights``), or
    fp32 weights with bf16 matmuls under ``torch.autocast`` (``autocast``)."""
    loss_scale_power: int = 16
    """fp16: the initial dynamic loss scale is 2^this."""
    zero: ZeroConfig = field(default_factory=lambda: ZeroConfig(stage=0))
    seed: int = 42
    """Seeds the head's init, dropout and the data order: a run is reproducible."""
    eval_batch_size: int = 64
    """Sequences per evaluation forward pass (every rank runs the whole dev set)."""
    save_model: bool = True
    """Save the best epoch's model (an HF folder) and log it to MLflow."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Checkpoints of the run, as pre-training's: every ``every_steps`` optimizer steps and
    on SIGTERM (then exit status 143), in ``<output>/checkpoints`` unless ``dir`` is set. A
    run started again with the same ``output`` continues from the latest one
    (``resume=auto``) exactly: same batches, dropout and metrics as without the stop. They
    are deleted when the run completes (``best/`` and the predictions are its result)."""
    register: str | None = None
    """Register the best epoch's model under this name in MLflow's model registry (the
    ``transformers`` flavour, safetensors weights:
    ``mlflow.transformers.load_model("models:/NAME/VERSION")`` loads it back without
    bertpipe). A sweep registers its best trial's model only."""
    sweep: SweepSpec = field(default_factory=SweepSpec)
    """Used by ``bertpipe sweep`` only."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def check_runnable(self) -> None:
        if not self.init_from:
            raise ConfigError("init_from", "give an exported model folder or a checkpoint folder")
        self.task.check_runnable()

    def __post_init__(self) -> None:
        aliases = {k: getattr(self, k) for k in ("weight_decay", "max_grad_norm")}
        if any(v is not None for v in aliases.values()):  # one place in the resolved config
            given = {k: v for k, v in aliases.items() if v is not None}
            try:
                self.optimizer = dataclasses.replace(self.optimizer, **given)
            except ConfigError as exc:
                raise ConfigError(next(iter(given)), exc.message) from None
            self.weight_decay = self.max_grad_norm = None
        check_engine_settings(self.optimizer, self.zero, self.precision, self.mixed_precision)
        if self.learning_rate <= 0:
            raise ConfigError("learning_rate", "must be positive")
        if self.batch_size < 1 or self.epochs < 1 or self.eval_batch_size < 1:
            raise ConfigError("batch_size", "batch_size, epochs and eval_batch_size must be >= 1")
        if not 0 <= self.warmup < 1:
            raise ConfigError("warmup", "is a fraction of the steps in [0, 1)")
        if self.register is not None:
            if not self.register.strip():
                raise ConfigError("register", "give a model name, or leave it unset (null)")
            if not self.save_model:
                raise ConfigError(
                    "register", "registers the best epoch's model: set save_model=true"
                )
            if not self.tracking.enabled:
                raise ConfigError(
                    "register", "needs MLflow: set tracking.enabled=true (and tracking.uri)"
                )

    @property
    def checkpoint_dir(self) -> str:
        """``checkpoint.dir``, else ``<output>/checkpoints`` (once ``output`` is set)."""
        if self.checkpoint.dir:
            return self.checkpoint.dir
        if not self.output:
            raise ConfigError("output", "the run's folder is chosen before its checkpoints")
        return str(Path(self.output) / "checkpoints")

    def micro_batch(self, world_size: int) -> int:
        micro = self.micro_batch_size or max(1, self.batch_size // world_size)
        if self.batch_size % (micro * world_size):
            raise ConfigError(
                "batch_size",
                f"{self.batch_size} is not a multiple of micro_batch_size x world size = "
                f"{micro} x {world_size}",
            )
        return micro
