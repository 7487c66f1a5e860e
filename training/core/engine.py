"""DeepSpeed: distributed set-up, the generated ds_config, and the one engine builder.

Pre-training (one engine per phase) and fine-tuning (one per run) describe their engine as an
:class:`EngineSpec`, made from the same config sections by :func:`engine_spec`, and build it
with :func:`build_engine`, the only ``deepspeed.initialize`` in bertpipe. The DeepSpeed JSON
is a function of the spec (:func:`deepspeed_config`), logged with every run; there are no
hand-kept JSON files. The learning rate follows a ``LambdaLR`` schedule that DeepSpeed steps
once per optimizer step and saves in its checkpoints; it is set in one place,
:func:`bertpipe.training.core.optim.schedule_learning_rate`, at build and at resume.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from bertpipe.errors import BertpipeError
from bertpipe.launch import detect_launch
from bertpipe.training.core.config import CheckpointConfig, OptimizerConfig, ZeroConfig
from bertpipe.training.core.optim import (
    Lamb,
    attach_zero_partitions,
    build_optimizer,
    schedule_learning_rate,
)

log = logging.getLogger(__name__)


class UnsafeCheckpointError(BertpipeError):
    """A checkpoint file holds pickled objects beyond tensors and plain data."""


__all__ = [
    "DistInfo",
    "EngineSettings",
    "EngineSpec",
    "build_engine",
    "deepspeed_config",
    "engine_spec",
    "import_deepspeed",
    "import_deepspeed_muon_uncompiled",
    "init_distributed",
]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def import_deepspeed() -> ModuleType:
    """``import deepspeed``, without the MLflow import DeepSpeed makes on the way.

    DeepSpeed's package import reaches ``deepspeed.autotuning.autotuner``, which imports MLflow
    if it is installed, for the experiment logging of DeepSpeed's autotuner (the launcher's
    ``--autotuning``, which runs in the launcher's process, not in the ranks): ~2 s of CPU in
    every rank, those that log nothing included (all but rank 0). A ``None`` in
    ``sys.modules`` makes that optional import fail as if MLflow were absent (Python's
    documented way to block an import); it is removed as soon as DeepSpeed is imported, so
    bertpipe's tracking imports MLflow where it logs, as before.
    """
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed

        return deepspeed
    sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        import deepspeed
    finally:
        if "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    return deepspeed


_DEEPSPEED_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_deepspeed_muon_uncompiled() -> None:
    """Import DeepSpeed's Muon optimizer with its ``torch.compile`` decorators as no-ops.

    Every DeepSpeed engine under ZeRO (its support check, the stage 1/2 and 3 optimizers, the
    bf16 optimizer) imports ``deepspeed.runtime.zero.muon.muon_optimizer`` to test whether the
    client optimizer is Muon. That module's kernels are decorated with ``torch.compile``,
    and decorating looks up the Inductor backend: ~2 s of CPU importing TorchInductor in every
    rank, for kernels that run only for Muon, which bertpipe never builds (its optimizers are
    AdamW and LAMB). ``TORCHDYNAMO_DISABLE=1``, read by ``torch.compile`` when it decorates,
    turns those three decorators into no-ops for this one import and is restored at once; a
    model compiled later (``model.compile``) is compiled as before. Nothing happens when the
    module is already imported (a user's own code may use Muon, compiled) or does not exist
    (another DeepSpeed version).
    """
    if _DEEPSPEED_MUON in sys.modules:
        return
    import importlib

    previous = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        importlib.import_module(_DEEPSPEED_MUON)
    except ImportError:
        pass
    finally:
        if previous is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = previous


def init_distributed(timeout_minutes: int = 30) -> DistInfo:
    """Join the job started by a launcher, or form a one-process job when run directly.

    :func:`bertpipe.launch.detect_launch` reads the launcher's environment: RANK/WORLD_SIZE
    (the ``deepspeed`` launcher, torchrun), MPI (``mpirun``: OpenMPI, MPICH, Intel MPI), SLURM
    (``srun`` with one task per GPU), else this process is rank 0 of 1. A one-process job
    with no MASTER_PORT gets its rendezvous store on a port the kernel assigns as the store
    binds it, so one-process runs started together (a sweep's or an evaluation's trials on one
    machine) never race for a port found free a moment earlier. An environment showing
    several tasks but no rank for this one raises :class:`~bertpipe.launch.LaunchError`
    before DeepSpeed is imported. NCCL on GPUs, gloo on CPU.
    """
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store = None
    if not dist.is_initialized():  # else already in the job (called again in one process)
        launch = detect_launch(os.environ)
        if launch.master_port is None:  # one process: the store binds a port and keeps it
            store = dist.TCPStore(launch.master_addr, 0, 1, is_master=True, timeout=timeout)
            launch = dataclasses.replace(launch, master_port=store.port)
        os.environ.update(launch.variables())
        log.info("%s", launch.describe())
    deepspeed = import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = accelerator.communication_backend_name()
        if store is not None:  # DeepSpeed adopts a process group made beforehand
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    if accelerator.device_name() == "cuda":
        # srun --gpus-per-task=1 (or --gpu-bind) leaves each task one visible GPU: index 0
        index = local_rank % max(1, torch.cuda.device_count())
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device(accelerator.device_name())
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device)


def deepspeed_config(
    *,
    micro_batch_size: int,
    global_batch_size: int,
    world_size: int,
    zero: ZeroConfig,
    precision: str,
    max_grad_norm: float,
    loss_scale_power: int = 16,
    universal: bool = False,
    mixed_precision: str = "weights",
) -> dict[str, Any]:
    """A DeepSpeed JSON config (pre-training and fine-tuning share it)."""
    accumulation = global_batch_size // (micro_batch_size * world_size)
    zero_section: dict[str, Any] = {
        "stage": zero.stage,
        "overlap_comm": zero.overlap_comm,
        "contiguous_gradients": zero.contiguous_gradients,
        "reduce_bucket_size": zero.bucket_size,
        "allgather_bucket_size": zero.bucket_size,
    }
    if zero.offload_optimizer == "cpu":
        zero_section["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_batch_size": global_batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        # DeepSpeed's default is 1.0: always say what the config says
        "gradient_clipping": max_grad_norm,
        "zero_optimization": zero_section,
        # torch's AdamW and bertpipe's LAMB are client optimizers; ZeRO needs to be told
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,  # bertpipe logs; DeepSpeed stays quiet
        "wall_clock_breakdown": False,
        "checkpoint": {"load_universal": universal},
    }
    if precision == "fp16":
        config["fp16"] = {
            "enabled": True,
            "loss_scale": 0,  # dynamic
            "initial_scale_power": loss_scale_power,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    elif precision == "bf16" and mixed_precision == "autocast":
        # fp32 weights and optimizer; Linear layers run in bf16 under torch.autocast
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


class EngineSettings(Protocol):
    """The config sections an engine is built from, the same in both stages' configs
    (``PretrainConfig``, ``FinetuneConfig``)."""

    @property
    def optimizer(self) -> OptimizerConfig: ...
    @property
    def zero(self) -> ZeroConfig: ...
    @property
    def precision(self) -> str: ...
    @property
    def mixed_precision(self) -> str: ...
    @property
    def loss_scale_power(self) -> int: ...
    @property
    def checkpoint(self) -> CheckpointConfig: ...


@dataclass(frozen=True)
class EngineSpec:
    """Everything an engine is built from: the batch, ZeRO and precision (the DeepSpeed
    config), the optimizer and its learning-rate schedule. Made by :func:`engine_spec`:
    pre-training one per phase (:func:`bertpipe.training.pretrain.phases.phase_engine`),
    fine-tuning one per run."""

    micro_batch_size: int
    global_batch_size: int
    world_size: int
    zero: ZeroConfig
    precision: str
    optimizer: OptimizerConfig
    learning_rate: float
    """Peak learning rate: the schedule's multipliers are relative to it."""
    schedule: Callable[[int], float]
    """Multiplier of the peak after N optimizer steps (``LambdaLR``)."""
    mixed_precision: str = "weights"
    loss_scale_power: int = 16
    universal: bool = False

    @property
    def accumulation(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.world_size)

    def ds_config(self) -> dict[str, Any]:
        return deepspeed_config(
            micro_batch_size=self.micro_batch_size,
            global_batch_size=self.global_batch_size,
            world_size=self.world_size,
            zero=self.zero,
            precision=self.precision,
            max_grad_norm=self.optimizer.max_grad_norm,
            loss_scale_power=self.loss_scale_power,
            universal=self.universal,
            mixed_precision=self.mixed_precision,
        )


def engine_spec(
    settings: EngineSettings,
    *,
    micro_batch_size: int,
    global_batch_size: int,
    world_size: int,
    learning_rate: float,
    schedule: Callable[[int], float],
) -> EngineSpec:
    """A stage's engine: its config's engine sections (``settings``) with the batch and the
    learning-rate schedule of the phase or run. The one way both stages make an
    :class:`EngineSpec`."""
    return EngineSpec(
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        world_size=world_size,
        zero=settings.zero,
        precision=settings.precision,
        optimizer=settings.optimizer,
        learning_rate=learning_rate,
        schedule=schedule,
        mixed_precision=settings.mixed_precision,
        loss_scale_power=settings.loss_scale_power,
        universal=settings.checkpoint.universal,
    )


def build_engine(model: nn.Module, spec: EngineSpec) -> tuple[Any, dict[str, Any]]:
    """Wrap ``model`` in a DeepSpeed engine; returns (engine, ds_config).

    The one place where bertpipe calls ``deepspeed.initialize``: pre-training, fine-tuning,
    ``bertpipe bench train`` and the tests build their engines here, so each gets the same
    optimizer set-up, learning-rate schedule (:func:`~bertpipe.training.core.optim.
    schedule_learning_rate`), LAMB's whole-tensor trust ratios under ZeRO and weights-only
    checkpoint loading (the non-finite guard is the step's:
    :class:`bertpipe.training.core.step.OptimizerStep`).
    """
    deepspeed = import_deepspeed()
    import_deepspeed_muon_uncompiled()

    config = spec.ds_config()
    optimizer = build_optimizer(
        model, spec.optimizer, spec.learning_rate, offload=spec.zero.offload_optimizer == "cpu"
    )
    scheduler = schedule_learning_rate(optimizer, spec.learning_rate, spec.schedule)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
    )
    if isinstance(optimizer, Lamb):
        _whole_tensor_trust_ratios(engine, optimizer, model, spec.zero.stage)
    weights_only_checkpoints(engine)
    return engine, config


# What DeepSpeed's own checkpoints hold besides tensors and plain data (found by loading
# every ZeRO 0/1/2 x fp32/bf16 x AdamW/LAMB checkpoint with weights_only=True); fp16 adds
# the dynamic loss scaler.
_CHECKPOINT_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def _checkpoint_globals() -> list[Any]:
    import importlib

    found = []
    for name in _CHECKPOINT_GLOBALS:
        module, _, attr = name.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):  # another DeepSpeed version: not allowed then
            continue
    return found


def weights_only_checkpoints(engine: Any) -> None:
    """Make DeepSpeed load this engine's checkpoints with ``torch.load(weights_only=True)``.

    DeepSpeed 0.19's ``TorchCheckpointEngine.load`` unpickles with ``weights_only=False``:
    whoever can write a checkpoint folder on shared storage would run code on every rank at
    resume. Its ``load_checkpoint`` takes no loading arguments, so the engine's ``load`` is
    replaced: tensors, plain data and the few DeepSpeed classes above, nothing else; any
    other object in a checkpoint file is refused with the file's name.
    """
    checkpoint_engine = getattr(engine, "checkpoint_engine", None)
    if type(checkpoint_engine).__name__ != "TorchCheckpointEngine":
        return  # another engine (Nebula, decoupled): its own loading, left as it is
    import pickle

    allowed = _checkpoint_globals()

    def load(path: str, map_location: Any = None) -> Any:
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise UnsafeCheckpointError(
                f"{path}: holds objects a checkpoint must not ({first[:200]}); refusing to "
                "unpickle it. Checkpoints hold tensors and plain data only: was this folder "
                "written by someone else?"
            ) from None

    checkpoint_engine.load = load


def _whole_tensor_trust_ratios(engine: Any, lamb: Lamb, model: nn.Module, stage: int) -> None:
    """LAMB's ratios must be per tensor: at stages 1-2 tell it where the tensors lie in the
    ZeRO partitions; at stage 0 make sure DeepSpeed handed it whole tensors (its mixed-
    precision wrappers of some versions flatten them, which would silently make the ratio
    one per flat buffer)."""
    if stage in (1, 2):
        attach_zero_partitions(lamb, engine.optimizer)
        return
    held = sorted(tuple(p.shape) for g in lamb.param_groups for p in g["params"])
    model_shapes = sorted(tuple(p.shape) for p in model.parameters() if p.requires_grad)
    if held != model_shapes:
        raise RuntimeError(
            "DeepSpeed handed LAMB flattened tensors at ZeRO stage 0, so trust ratios would "
            "not be per tensor: upgrade deepspeed (tested: the version in constraints.txt)"
        )
