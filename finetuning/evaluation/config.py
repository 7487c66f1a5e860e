"""``bertpipe evaluate``: the typed config (the model, the suite, the protocol, the watcher)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from bertpipe.config import ConfigError
from bertpipe.tracking import TrackingConfig

__all__ = ["PAPER_LEARNING_RATES", "EvaluateConfig", "ProtocolConfig", "WatchConfig"]

PAPER_LEARNING_RATES = [5e-5, 4e-5, 3e-5, 2e-5]
"""The BERT paper's fine-tuning grid (Devlin et al. 2019, section 4.1 and appendix A.3)."""


@dataclass
class ProtocolConfig:
    """How every task is fine-tuned and scored. The defaults are the BERT paper's: per task
    the learning-rate grid 5e-5, 4e-5, 3e-5, 2e-5 with batch 32 for 3 epochs, the best
    learning rate chosen on dev; N seeds (random restarts) per setting."""

    learning_rates: list[float] = field(default_factory=lambda: list(PAPER_LEARNING_RATES))
    """The grid searched per task (the paper's)."""
    batch_size: int = 32
    """Sequences per optimizer step (the paper's 32)."""
    epochs: int = 3
    """Fine-tuning epochs (the paper's 3)."""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """One trial per seed and setting. The setting with the highest mean dev score over the
    seeds is chosen; a task's result is that setting's mean and standard deviation over them
    (MosaicBERT reports the mean of 5 seeds; the paper kept the best of several restarts of
    BERT-Large on the small sets)."""
    epoch: Literal["last", "best"] = "last"
    """Which epoch's dev scores a trial gives: the last (the paper fine-tunes a fixed number
    of epochs) or the best of its epochs (``bertpipe finetune``'s kept model)."""
    warmup: float = 0.1
    """Fraction of a trial's steps spent warming up (then linear decay to zero)."""
    max_seq_length: int | None = None
    """Tokens per input; null: 128 for sentence (pair) and token tasks, 384 for SQuAD."""

    def __post_init__(self) -> None:
        if not self.learning_rates or any(lr <= 0 for lr in self.learning_rates):
            raise ConfigError("learning_rates", "give at least one positive learning rate")
        if len(set(self.learning_rates)) != len(self.learning_rates):
            raise ConfigError("learning_rates", "lists a learning rate twice")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError("seeds", "give at least one seed, each once")
        if self.batch_size < 1 or self.epochs < 1:
            raise ConfigError("batch_size", "batch_size and epochs must be >= 1")
        if not 0 <= self.warmup < 1:
            raise ConfigError("warmup", "is a fraction of the steps in [0, 1)")


@dataclass
class WatchConfig:
    """``bertpipe evaluate --watch CHECKPOINTS``: the suite on new checkpoints while a
    pre-training run writes them."""

    every: int = 1
    """Evaluate every Kth checkpoint that appears (1: each one), counted in step order."""
    poll_s: float = 30.0
    """Seconds between two looks at the checkpoint folder."""
    idle_timeout_s: float = 3600.0
    """Stop after this long without a new checkpoint while the pre-training run is not known
    to have ended (a run that is FINISHED, FAILED or KILLED in MLflow ends the watch once
    its last checkpoint is done)."""
    log_to_pretrain_run: bool = True
    """Log ``downstream/<suite>/average`` (and each task's score) into the pre-training run
    at the checkpoint's global step."""

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ConfigError("every", "must be >= 1")
        if not self.poll_s > 0 or not self.idle_timeout_s > 0:
            raise ConfigError("poll_s", "poll_s and idle_timeout_s must be > 0 seconds")


@dataclass
class EvaluateConfig:
    """``bertpipe evaluate``: a model's downstream scores on a suite of tasks."""

    model: str = ""
    """What to evaluate: a ``bertpipe export`` folder (any transformers BERT folder), a
    pre-training checkpoint folder (its ``latest``) or one checkpoint in it
    (``.../checkpoints/global_step1000``), or a model in MLflow's registry
    (``models:/NAME/VERSION``); local or object storage."""
    suite: str = "glue"
    """``glue``, ``squad``, ``conll``, ``klue``, or a YAML file naming the tasks
    (docs/evaluation.md)."""
    data: str = ""
    """The suite's data: for ``glue`` the folder of the task folders as GLUE's download lays
    them out (CoLA/, SST-2/, MRPC/, STS-B/, QQP/, MNLI/, QNLI/, RTE/; WNLI is left out as the
    paper does); for ``squad`` a folder with train-v1.1.json and dev-v1.1.json (or v2.0);
    for ``conll`` a folder with train.txt and dev.txt (CoNLL-2003's eng.train/eng.testa also
    found); for ``klue`` KLUE's ``klue_benchmark`` folder (ynat-v1.1/, klue-sts-v1.1/,
    klue-nli-v1.1/, klue-ner-v1.1/, klue-mrc-v1.1/ as its release lays them out); for a YAML
    suite, the folder its relative paths start from (default: the YAML's)."""
    tasks: list[str] = field(default_factory=list)
    """Only these tasks of the suite (names as the suite gives them); empty: every task whose
    files are present."""
    output: str | None = None
    """The suite's folder (one folder per trial, the results, the table). Null:
    ``<output_root>/<suite>-<model name>``, the same for the same command, so that a killed
    suite continues when the command is run again."""
    output_root: str = "runs/evaluate"
    """Where the folders of suites without ``output`` are made."""
    overwrite: bool = False
    """Start afresh in an ``output`` that holds another suite's (or another protocol's) trials,
    deleting them. Without it such a folder is refused; the same suite continues."""
    protocol: ProtocolConfig = field(default_factory=ProtocolConfig)
    finetune: dict[str, Any] = field(default_factory=dict)
    """More fine-tuning settings for every trial, as ``bertpipe finetune`` keys
    (``{precision: bf16, eval_batch_size: 128, random_init: true}``); the protocol's own
    (learning rate, batch, epochs, seed, warmup, task) cannot be set here."""
    bad_rows: Literal["fail", "skip"] = "fail"
    """A row of a task file that cannot be read (wrong column count, unknown label):
    ``fail`` stops before any trial with one line naming the file and line; ``skip`` drops
    such rows (counted in the trials' read reports). A dev label (or entity type) that the
    training file lacks stops the suite either way: a model never predicts a class it was
    not trained on."""
    parallel: int | None = None
    """Trials run at the same time, each in a process of its own. Null: one per GPU; on CPU
    one per 4 cores (at least 1). 1 runs the trials in this process."""
    threads_per_trial: int | None = None
    """CPU threads of each trial; null: the cores divided by ``parallel``."""
    model_name: str | None = None
    """The label of the model in tables (the suite's table, ``runs compare --suites``), as
    given; null: the folder name (``global_stepN`` with the folder above it for a checkpoint,
    NAME-VERSION for a registered model), `` (random init)`` added with
    ``finetune.random_init``."""
    watch: WatchConfig = field(default_factory=WatchConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if self.parallel is not None and self.parallel < 1:
            raise ConfigError("parallel", "must be >= 1 (or null: chosen from the machine)")
        if self.threads_per_trial is not None and self.threads_per_trial < 1:
            raise ConfigError("threads_per_trial", "must be >= 1 (or null)")
        fixed = {"learning_rate", "batch_size", "epochs", "seed", "warmup", "output", "task"}
        for key in self.finetune:
            if key.split(".")[0] in fixed:
                raise ConfigError(
                    f"finetune.{key}",
                    "is the protocol's: set protocol.* (or the suite's task) instead",
                )

    def check_runnable(self) -> None:
        if not self.model:
            raise ConfigError("model", "give an export folder, a checkpoint or models:/NAME/N")
        if not self.suite:
            raise ConfigError("suite", "give glue, squad, conll, klue or a suite YAML file")
        if self.suite in ("glue", "squad", "conll", "klue") and not self.data:
            raise ConfigError("data", f"give the folder of the {self.suite} data")


def safe_name(text: str) -> str:
    """``text`` as one folder name (letters, digits, ``.``, ``_``, ``-``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "model"
