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
from bertpipe.training.models.spec import ModelSpec

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "DistributedConfig",
    "EvalConfig",
    "ModelSpec",
    "OptimizerConfig",
    "PhaseSpec",
    "PretrainConfig",
    "ZeroConfig",
    "check_engine_settings",
]


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
class OptimizerConfig:
    """The optimizer, the same section in pre-training (shared by all phases; each phase has
    its own peak learning rate) and fine-tuning (its peak is ``learning_rate``)."""

    name: Literal["adamw", "lamb"] = "adamw"
    """``adamw``: AdamW as ``fused`` says, DeepSpeed's CPU Adam with optimizer offload.
    ``lamb``: LAMB as NVIDIA's BERT recipe runs it: per-tensor trust ratios on the tensors with
    weight decay, a plain Adam step for the others (ZeRO stages 0-2, see training/core/optim.py)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Decay rates of the first and second moment estimates."""
    eps: float = 1e-6
    """BERT's epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay; never applied to biases and LayerNorm weights."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm (0 disables)."""
    max_trust_ratio: float | None = None
    """LAMB: cap on ||w|| / ||update||; null: no cap (NVIDIA's LAMB has none)."""
    trust_ratio: Literal["decayed", "all"] = "decayed"
    """LAMB: which tensors get the trust ratio. ``decayed``: those with weight decay, the others
    a plain Adam step (apex FusedLAMB, NVIDIA's recipe); ``all``: every tensor (apex's
    ``use_nvlamb``, the LAMB paper)."""
    fused: Literal["auto", "torch", "deepspeed", "none"] = "auto"
    """AdamW's implementation. ``auto``: torch's fused AdamW on GPU, its multi-tensor (foreach)
    AdamW on CPU. ``torch``: torch's fused AdamW (GPU or CPU). ``deepspeed``: DeepSpeed's
    FusedAdam (CUDA only; JIT-compiles a CUDA op at start, minutes on a fresh machine).
    ``none``: torch's foreach AdamW. With optimizer offload only ``auto`` (DeepSpeed's CPU
    Adam). LAMB always runs its own multi-tensor step and refuses ``deepspeed``."""
    reset_step_per_phase: bool = False
    """A phase that keeps the previous phase's moments (``optimizer_state: keep``) restarts
    the optimizer's step counter at 0, so bias correction starts over on the kept moments,
    as NVIDIA's BERT phase 2 does; false: the count continues from the previous phase. A
    resume within a phase always continues its count."""

    def __post_init__(self) -> None:
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError("betas", "must be in [0, 1)")
        if self.eps <= 0 or self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ConfigError("eps", "eps must be positive, weight_decay and max_grad_norm >= 0")
        if self.max_trust_ratio is not None and self.max_trust_ratio <= 0:
            raise ConfigError("max_trust_ratio", "must be positive, or null for no cap")
        if self.name == "lamb" and self.fused == "deepspeed":
            raise ConfigError(
                "fused",
                "lamb has no DeepSpeed implementation: DeepSpeed's FusedLamb has other "
                "semantics (its trust ratio is also clamped below, at 0.01); use fused=auto "
                "(LAMB runs its own multi-tensor step)",
            )


@dataclass
class ZeroConfig:
    """DeepSpeed ZeRO."""

    stage: int = 1
    """0 (plain data parallel), 1 (optimizer states), 2 (+ gradients), 3 (+ parameters)."""
    offload_optimizer: Literal["none", "cpu"] = "none"
    """Keep optimizer states and step on the CPU (stages 1-3)."""
    overlap_comm: bool = True
    """Overlap gradient reduction with the backward pass (DeepSpeed's ``overlap_comm``)."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation)."""
    bucket_size: int = 50_000_000
    """Elements per reduce/all-gather bucket."""

    def __post_init__(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError("stage", "must be 0, 1, 2 or 3")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ConfigError("offload_optimizer", "needs ZeRO stage 1, 2 or 3")


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


@dataclass
class DistributedConfig:
    """How the ranks of a multi-process job watch each other (:mod:`bertpipe.training.core.peers`)."""

    peer_timeout_s: float = 120.0
    """A rank whose heartbeat has not moved for this long (its process or host is gone, or
    its link down) ends the job: every other rank prints one line naming it and exits with
    status 75, for the scheduler to restart the job from ``latest``; it is named within
    about 1.2 times this (the heartbeat beats every twentieth of it and gives a store
    request as long to answer). A link down for less than this is survived. Well under the
    process group's 30-minute timeout. 0: no heartbeat (only the process group's timeout)."""

    def __post_init__(self) -> None:
        if self.peer_timeout_s < 0:
            raise ConfigError("peer_timeout_s", "must be 0 (off) or a number of seconds")
        if 0 < self.peer_timeout_s < 2:
            raise ConfigError("peer_timeout_s", "must be at least 2 seconds (or 0: off)")


@dataclass
class CheckpointConfig:
    """DeepSpeed checkpoints: the engine's own layout plus bertpipe's client state."""

    dir: str | None = None
    """Checkpoint folder; null: ``<output>/checkpoints``. A local or mounted folder, or object
    storage (``s3://bucket/run/checkpoints``, ``gs://…``): each rank then writes into
    ``local_dir`` and uploads in the background; ``latest`` moves once every rank's upload
    is on the store."""
    local_dir: str | None = None
    """With ``dir`` on object storage: the local folder each rank writes a checkpoint into
    before uploading it (room for one checkpoint of the rank's share; a node-local disk, a k8s
    ``emptyDir``). null: ``<system temp>/bertpipe-checkpoints/<hash of dir>``."""
    publish_timeout_s: float = 1800.0
    """With ``dir`` on object storage: how long rank 0 waits for every rank's upload of a
    checkpoint before giving up on publishing it (the run then fails with exit 75)."""
    every_steps: int = 500
    """Save every N optimizer steps (0: only at phase ends and on SIGTERM)."""
    keep_last: int = 3
    """Keep this many newest checkpoints (phase-end ones are always kept)."""
    preemption_check_steps: int = 10
    """Every N optimizer steps (and at every log step) the ranks agree on whether a SIGTERM
    arrived, which makes each rank wait for its device once; a SIGTERM is acted on within
    N steps."""
    resume: str = "auto"
    """``auto``: continue from ``latest`` if there is one; ``none``: start fresh (refuses a
    folder that holds checkpoints); or a checkpoint tag such as ``global_step300``."""
    universal: bool = False
    """Resume from a universal checkpoint, to continue on another world size. Convert first
    with DeepSpeed's ``python -m deepspeed.checkpoint.ds_to_universal --input_folder
    <dir>/global_stepN --output_folder <dir>/global_stepN_universal``, then resume with
    ``checkpoint.resume=global_stepN_universal checkpoint.universal=true``."""
    verify_checksums: bool = True
    """Record each checkpoint file's CRC-32 when saving it (beside its size, in the rank's
    completion marker) and check them at a resume: every rank reads its share of the
    checkpoint about to be loaded once, and a file that differs makes the resume fall back to
    the previous whole checkpoint. false: sizes only (a truncated file is still caught). On
    object storage the CRC-32 is checked as each file is downloaded."""
    allow_data_change: bool = False
    """Resume even if a phase's data manifest differs from the one the checkpoint was trained
    on (its sha256 is stored in the checkpoint). By default such a resume is refused: the
    saved data position would point into other data."""
    lease_timeout_s: float = 60.0
    """A run holds a lease on its output (``<output>/.bertpipe-lease.json``), renewed every
    quarter of this; a second run on the same output is refused (exit 2) while the holder
    lives. A lease not renewed for this long (on the holder's own host: at once once its
    process is gone) is taken over with a warning, so a requeue after a crash resumes; a
    requeue on another host waits up to this long for the old lease to expire."""
    allow_changes: list[str] = field(default_factory=list)
    """Settings a resume may change although they fix what the checkpoint is (the model's
    shape, the batch, the seed, precision, ZeRO stage, the optimizer's kind), e.g.
    ``[precision]`` or ``[model]`` for a whole section. Other changed settings (learning rate
    and schedule, weight decay, clipping, cadences...) need nothing: they are applied from
    the new config and logged as ``changed at resume``."""

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ConfigError("keep_last", "must be at least 1")
        if self.preemption_check_steps < 1:
            raise ConfigError("preemption_check_steps", "must be at least 1")
        if self.publish_timeout_s <= 0:
            raise ConfigError("publish_timeout_s", "must be positive")
        if self.lease_timeout_s <= 0:
            raise ConfigError("lease_timeout_s", "must be positive")
        if self.local_dir is not None and "://" in self.local_dir:
            raise ConfigError("local_dir", f"{self.local_dir} must be a local folder")


def check_engine_settings(
    optimizer: OptimizerConfig, zero: ZeroConfig, precision: str, mixed_precision: str
) -> None:
    """The combinations of optimizer, ZeRO and precision that no engine can run (both
    stages' configs check them)."""
    if optimizer.name == "lamb" and zero.stage > 2:
        raise ConfigError(
            "zero.stage",
            "lamb runs at ZeRO stages 0-2 (whole-tensor trust ratios are reassembled from "
            "the stage 1/2 partitions); stage 3 is not supported: use zero.stage=1 or 2",
        )
    if optimizer.name == "lamb" and zero.offload_optimizer != "none":
        raise ConfigError(
            "zero.offload_optimizer",
            "an offloaded optimizer is DeepSpeed's CPU Adam, not LAMB: use "
            "offload_optimizer=none with lamb, or optimizer.name=adamw",
        )
    if mixed_precision == "autocast" and precision != "bf16":
        raise ConfigError(
            "mixed_precision",
            f"autocast needs precision=bf16 (got {precision}); use mixed_precision=weights",
        )


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
