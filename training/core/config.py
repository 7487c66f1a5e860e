"""The config sections both stages share: the optimizer, ZeRO, the distributed job's
watch over its ranks, checkpoints, and the combinations of them no engine can run.

Pre-training (:mod:`bertpipe.training.pretrain.config`) and fine-tuning
(:mod:`bertpipe.finetuning.config`) hold these sections under the same keys, and the shared
core (:mod:`bertpipe.training.core.engine`) builds an engine from them and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from bertpipe.config import ConfigError

__all__ = [
    "CheckpointConfig",
    "DistributedConfig",
    "OptimizerConfig",
    "ZeroConfig",
    "check_engine_settings",
]


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
class DistributedConfig:
    """How the ranks of a multi-process job watch each other
    (:mod:`bertpipe.training.core.peers`)."""

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
