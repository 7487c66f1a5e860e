"""``bertpipe pretrain`` / ``bertpipe plan``: the typed pre-training config.

One file describes the whole run: the model, one or two phases (each with its data, batch,
steps and learning-rate schedule), the optimizer, ZeRO and precision, checkpoints, evaluation
and tracking. The DeepSpeed JSON is generated from it (:mod:`bertpipe.training.core.engine`), never
kept by hand. Everything that can be checked without GPUs is checked here, before any process is
launched: batch arithmetic against the world size, schedule lengths, optimizer/ZeRO
combinations, sequence lengths against the model's positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
from bertpipe.training.models.spec import ModelSpec

__all__ = ["DataConfig", "EvalConfig", "PhaseSpec", "PretrainConfig"]


@dataclass
class PhaseSpec:
    """One pre-training phase: its data, batch, length and learning-rate schedule."""

    name: str = "phase1"
    """Name used in logs, checkpoints and MLflow metrics (``phase1/loss``)."""
    data: str = "runs/shards/seq128"
    """Folder of the phase's shards (with manifest.json), any fsspec URL."""
    max_steps: int = 1000
    """Optimizer steps in this phase."""
    micro_batch_size: int = 32
    """Sequences per GPU per forward pass."""
    global_batch_size: int = 256
    """Sequences per optimizer step over all GPUs: micro x accumulation x world size."""
    batch_warmup_steps: int = 0
    """Batch-size warmup (GPT-3, ModernBERT): over the phase's first N optimizer steps the
    global batch grows linearly from ``batch_warmup_start`` to ``global_batch_size``, in whole
    micro-batches per rank (the micro batch stays; the accumulation grows); step N + 1 on
    takes the full batch. 0: the full batch from the first step."""
    batch_warmup_start: int | None = None
    """The global batch of the phase's first step under batch warmup: a multiple of
    micro_batch_size x world size, at most ``global_batch_size``. Null: one micro-batch per
    rank (micro_batch_size x world size)."""
    learning_rate: float = 1e-4
    """Peak learning rate, reached at the end of warmup."""
    warmup: float = 0.01
    """Warmup length: a fraction of max_steps if < 1, else a number of steps."""
    decay: Literal["linear", "poly", "wsd"] = "linear"
    """After warmup, decay to zero linearly (the paper) or as (1 - progress)^power (NVIDIA);
    or ``wsd``, warmup-stable-decay (a trapezoid: ModernBERT; Hägele et al. 2024; MiniCPM):
    held at the peak, then a cooldown over the last ``decay_fraction`` of the steps, shaped
    by ``decay_shape``, to ``min_lr_ratio`` of the peak."""
    decay_power: float = 0.5
    """Exponent of the poly decay."""
    decay_from: Literal["warmup", "start"] = "warmup"
    """``start``: the decay curve is (1 - u/total)^power of update u from the first update, and
    warmup ramps linearly to the peak under it, so the first update after warmup is already
    below the peak, as in NVIDIA's PolyWarmUpScheduler (and Google's BERT, whose TF code reads
    the curve one update earlier). ``warmup``: the decay starts at the peak after warmup
    (``wsd`` takes only this)."""
    decay_fraction: float = 0.2
    """``wsd``: the cooldown's share of the steps (of all phases' with schedule=continuous),
    in (0, 1]; at least one step. Hägele et al. find 10-20 % enough."""
    decay_shape: Literal["1-sqrt", "linear"] = "1-sqrt"
    """``wsd``: the cooldown's curve in its progress p (0 -> 1): ``1-sqrt``, 1 - sqrt(p)
    (Hägele et al.'s best, ModernBERT's), or ``linear``, 1 - p."""
    min_lr_ratio: float = 0.0
    """``wsd``: where the cooldown ends, a fraction of the peak in [0, 1]."""
    optimizer_state: Literal["keep", "reset"] = "keep"
    """For a phase after the first: keep the optimizer moments of the previous phase (as
    NVIDIA's BERT recipe does) or start them afresh. The schedule restarts unless the run's
    ``schedule`` is ``continuous``."""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ConfigError("name", "must be a plain name such as phase1")
        for key in ("max_steps", "micro_batch_size", "global_batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(key, "must be at least 1")
        if self.learning_rate <= 0:
            raise ConfigError("learning_rate", "must be positive")
        if self.warmup < 0:
            raise ConfigError("warmup", "must not be negative")
        if self.warmup >= 1 and self.warmup != int(self.warmup):
            raise ConfigError("warmup", "is a fraction (< 1) or a whole number of steps")
        if self.warmup_steps() > self.max_steps:
            raise ConfigError("warmup", f"{self.warmup_steps()} steps exceed max_steps")
        self._check_wsd()
        self._check_batch_warmup()

    def _check_wsd(self) -> None:
        if not 0.0 < self.decay_fraction <= 1.0:
            raise ConfigError("decay_fraction", f"{self.decay_fraction} must be in (0, 1]")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("min_lr_ratio", f"{self.min_lr_ratio} must be in [0, 1]")
        if self.decay != "wsd":
            if self.min_lr_ratio:
                raise ConfigError(
                    "min_lr_ratio", f"applies to decay=wsd; {self.decay} decays to 0: set it to 0"
                )
            return
        if self.decay_from != "warmup":
            raise ConfigError(
                "decay_from",
                "wsd holds the peak after warmup, then cools down: use decay_from=warmup",
            )

    def _check_batch_warmup(self) -> None:
        if self.batch_warmup_steps < 0:
            raise ConfigError("batch_warmup_steps", "must be at least 0")
        if self.batch_warmup_steps > self.max_steps:
            raise ConfigError(
                "batch_warmup_steps",
                f"{self.batch_warmup_steps} exceeds max_steps ({self.max_steps})",
            )
        start = self.batch_warmup_start
        if start is None:
            return
        if not self.batch_warmup_steps:
            raise ConfigError(
                "batch_warmup_start",
                "is set but batch_warmup_steps is 0: give the steps the batch grows over",
            )
        if not self.micro_batch_size <= start <= self.global_batch_size:
            raise ConfigError(
                "batch_warmup_start",
                f"{start} must be between micro_batch_size ({self.micro_batch_size}) and "
                f"global_batch_size ({self.global_batch_size})",
            )

    def warmup_steps(self) -> int:
        return round(self.warmup * self.max_steps) if self.warmup < 1 else int(self.warmup)

    def cooldown_steps(self, total: int) -> int:
        """``wsd``: the cooldown's length in optimizer steps, ``decay_fraction`` of ``total``
        (this phase's ``max_steps``, or all phases' with schedule=continuous), at least 1."""
        return max(1, round(self.decay_fraction * total))

    def check_cooldown(self, total: int) -> None:
        """``wsd``: the warmup and the cooldown must fit in ``total`` steps (one line naming
        ``decay_fraction`` otherwise)."""
        if self.decay != "wsd":
            return
        warmup, cooldown = self.warmup_steps(), self.cooldown_steps(total)
        if warmup + cooldown > total:
            raise ConfigError(
                "decay_fraction",
                f"the cooldown ({cooldown} steps, {self.decay_fraction:g} of {total}) overlaps "
                f"the warmup ({warmup} steps): lower decay_fraction or warmup",
            )

    def accumulation(self, world_size: int) -> int:
        """Gradient accumulation steps for ``world_size`` at the full batch; raises if the
        batch (or the batch warmup's first batch) does not divide."""
        per_step = self.micro_batch_size * world_size
        if self.global_batch_size % per_step:
            raise ConfigError(
                "global_batch_size",
                f"{self.global_batch_size} is not a multiple of micro_batch_size x world size = "
                f"{self.micro_batch_size} x {world_size} = {per_step}; choose a multiple, e.g. "
                f"{per_step * max(1, round(self.global_batch_size / per_step))}",
            )
        start = self.batch_warmup_start
        if start is not None and start % per_step:
            raise ConfigError(
                "batch_warmup_start",
                f"{start} is not a multiple of micro_batch_size x world size = "
                f"{self.micro_batch_size} x {world_size} = {per_step}; choose a multiple, e.g. "
                f"{per_step * max(1, round(start / per_step))}",
            )
        return self.global_batch_size // per_step

    def accumulation_at(self, step: int, world_size: int) -> int:
        """Micro-batches per rank of the phase's optimizer step ``step`` (from 1) on
        ``world_size`` ranks: under batch warmup ``a0 + (a - a0) * (step - 1) //
        batch_warmup_steps`` for the first ``batch_warmup_steps`` steps (``a0`` that of
        ``batch_warmup_start``, ``a`` the full accumulation: a linear ramp of the global
        batch, rounded down to whole micro-batches per rank), ``a`` after them."""
        full = self.accumulation(world_size)
        if step > self.batch_warmup_steps:
            return full
        per_step = self.micro_batch_size * world_size
        first = (self.batch_warmup_start or per_step) // per_step
        return first + (full - first) * (step - 1) // self.batch_warmup_steps

    def global_batch_at(self, step: int, world_size: int) -> int:
        """Sequences over all ranks of the phase's optimizer step ``step`` (from 1)."""
        return self.accumulation_at(step, world_size) * self.micro_batch_size * world_size


@dataclass
class DataConfig:
    """How batches are read."""

    num_workers: int = 2
    """Loader worker processes per rank (0: read in the training process)."""
    shuffle_blocks: int = 4
    """Blocks (samples of instances) mixed in a rank's shuffle buffer."""
    heldout_split: str = "heldout"
    """Split evaluated during pre-training."""
    read_retries: int = 4
    """Retries of a shard or manifest read that failed with an error that may be transient
    (I/O error, file briefly unreadable or gone, timeout, lost connection), with exponential
    backoff: ``read_retry_delay`` seconds, doubling, at most 30 s between attempts. Still
    failing: exit status 75 (the job is retried). A corrupt shard is not retried (exit 2)."""
    read_retry_delay: float = 0.5
    """First wait before a retried read, in seconds (doubles with every retry)."""
    verify_checksums: bool = True
    """Check each shard's sha256 against its manifest when a loader process first opens it
    (and again if the file changes); false skips it, for trusted storage."""

    def __post_init__(self) -> None:
        if self.read_retries < 0:
            raise ConfigError("read_retries", "must be at least 0")
        if self.read_retry_delay < 0:
            raise ConfigError("read_retry_delay", "must be at least 0")


@dataclass
class EvalConfig:
    """Periodic evaluation on the held-out shards."""

    every_steps: int = 0
    """Evaluate every N optimizer steps and at the end of each phase (0: only at the end)."""
    max_batches: int = 50
    """Batches per rank per evaluation (0: the whole held-out split)."""


# the settings of a phase's learning-rate curve: one curve over all phases with
# schedule=continuous, so every phase must repeat phase 1's
_CURVE_KEYS = (
    "decay",
    "decay_power",
    "decay_from",
    "decay_fraction",
    "decay_shape",
    "min_lr_ratio",
)


@dataclass
class PretrainConfig:
    """``bertpipe pretrain``: BERT pre-training with DeepSpeed, one or two phases."""

    output: str = "runs/pretrain"
    """Run folder: resolved config, checkpoints, exports."""
    model: ModelSpec = field(default_factory=ModelSpec)
    phases: list[PhaseSpec] = field(default_factory=lambda: [PhaseSpec()])
    """Phases in order; a later phase starts from the previous phase's weights."""
    only_phase: str | None = None
    """Run just this phase (it resumes from the previous phase's final checkpoint)."""
    schedule: Literal["per_phase", "continuous"] = "per_phase"
    """``per_phase``: each phase has its own warmup and decay (NVIDIA's recipe).
    ``continuous``: one warmup (phase 1's) and one decay over the steps of all phases, at
    phase 1's peak learning rate (the BERT paper: 1M steps, 90% of them at 128 tokens); with
    ``decay: wsd`` the cooldown is the last ``decay_fraction`` of all phases' steps."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: Literal["fp32", "fp16", "bf16"] = "bf16"
    """fp16 uses a dynamic loss scale; bf16 and fp32 none."""
    mixed_precision: Literal["weights", "autocast"] = "weights"
    """With bf16: ``weights`` keeps the model in bf16 with fp32 master weights in the
    optimizer (DeepSpeed's ``bf16`` section); ``autocast`` keeps fp32 weights and runs the
    matmuls in bf16 under ``torch.autocast`` (DeepSpeed's ``torch_autocast``): more memory,
    fp32 accumulation of gradients."""
    loss_scale_power: int = 16
    """fp16: the initial dynamic loss scale is 2^this."""
    seed: int = 42
    """Seeds the model init, dropout and the data order."""
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    log_every_steps: int = 10
    """Log metrics every N optimizer steps."""
    max_bad_steps: int = 20
    """Stop (exit status 2) after this many consecutive optimizer steps with a non-finite loss
    or gradient. Such a step is never applied: the weights, optimizer state and learning rate
    stay as they were; it is counted in ``train/skipped_steps``."""
    device_peak_tflops: float | None = None
    """Peak dense TFLOP/s of one device at the chosen precision, for MFU; null: looked up
    from the device name (unknown devices get no MFU)."""
    planned: dict[str, dict[str, float]] = field(default_factory=dict)
    """What ``bertpipe plan --fit --write`` predicted per phase (``step_s``, ``memory_gib``,
    and the ``budget_gib`` it fitted into); the run logs each as ``train/planned_<key>``
    beside what it measures (``train/step_s``, ``train/memory_*``)."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if not self.phases:
            raise ConfigError("phases", "list at least one phase")
        names = [p.name for p in self.phases]
        if len(set(names)) != len(names):
            raise ConfigError("phases", f"phase names must be unique, got {names}")
        if self.schedule == "continuous":
            first = self.phases[0]
            for i, phase in enumerate(self.phases[1:], start=1):
                if phase.learning_rate != first.learning_rate:
                    raise ConfigError(
                        f"phases[{i}].learning_rate",
                        "with schedule=continuous every phase runs on phase 1's curve: set it "
                        f"to {first.learning_rate:g} like phases[0], or use schedule=per_phase",
                    )
                if phase.warmup_steps():
                    raise ConfigError(
                        f"phases[{i}].warmup",
                        "with schedule=continuous only the first phase warms up: set it to 0",
                    )
                for key in _CURVE_KEYS:
                    if getattr(phase, key) != getattr(first, key):
                        raise ConfigError(
                            f"phases[{i}].{key}",
                            f"with schedule=continuous it must equal phases[0].{key}",
                        )
        self._check_cooldowns()
        if self.only_phase is not None and self.only_phase not in names:
            raise ConfigError("only_phase", f"must be one of {names}")
        check_engine_settings(self.optimizer, self.zero, self.precision, self.mixed_precision)
        if self.log_every_steps < 1:
            raise ConfigError("log_every_steps", "must be at least 1")
        if self.max_bad_steps < 1:
            raise ConfigError("max_bad_steps", "must be at least 1")

    def _check_cooldowns(self) -> None:
        """``wsd``: warmup and cooldown fit in each phase (one curve over all phases' steps
        with schedule=continuous)."""
        if self.schedule == "continuous":
            spans = [(0, self.phases[0], sum(p.max_steps for p in self.phases))]
        else:
            spans = [(i, p, p.max_steps) for i, p in enumerate(self.phases)]
        for i, phase, total in spans:
            try:
                phase.check_cooldown(total)
            except ConfigError as exc:
                raise exc.with_prefix(f"phases[{i}]") from None

    @property
    def checkpoint_dir(self) -> str:
        from bertpipe import fsio

        return self.checkpoint.dir or fsio.join(self.output, "checkpoints")

    def check_world(self, world_size: int) -> dict[str, int]:
        """Batch arithmetic for ``world_size``: phase name -> accumulation steps."""
        out = {}
        for i, phase in enumerate(self.phases):
            try:
                out[phase.name] = phase.accumulation(world_size)
            except ConfigError as exc:
                raise exc.with_prefix(f"phases[{i}]") from None
        return out
