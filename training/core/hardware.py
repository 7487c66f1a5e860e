"""Can this device run the config's precision and optimizer? Checked before anything starts.

``bertpipe plan`` checks against the GPU named by ``--gpu`` (or the local one), and every
rank of ``bertpipe pretrain``/``finetune`` checks its own device at start-up, before the
process group and DeepSpeed: a config the hardware cannot run ends in one line naming the
key and what to use instead, not in a traceback from every rank.

- fp16 on a CPU needs what DeepSpeed's CPU accelerator asks oneDNN for (AVX-512 FP16 or
  AMX-FP16; most CPUs have neither); on a GPU it is always there.
- bf16 on a GPU needs compute capability 8.0 (Ampere) or newer; CPUs run it (slowly without
  AVX-512 BF16 or AMX, but correctly).
- ``optimizer.fused=deepspeed`` (DeepSpeed's FusedAdam) needs CUDA; ``fused=torch`` needs a
  device torch has fused AdamW kernels for.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from bertpipe.config import ConfigError
from bertpipe.training.models.flops import PEAK_TFLOPS

__all__ = ["Hardware", "check_hardware", "gpu_by_name", "local_hardware"]


@dataclass(frozen=True)
class Hardware:
    name: str
    kind: str  # "cuda", "cpu", or another torch device type
    fp16: bool | None  # None: unknown (then not checked)
    bf16: bool | None
    why_not: str = ""  # what the device lacks, for the message


def cpu_fp16_supported() -> bool:
    """The probe DeepSpeed's CPU accelerator uses (``is_fp16_supported``)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # an older or CPU-less torch build: DeepSpeed says no as well
        return False


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "CPU"


def local_hardware(local_rank: int | None = None) -> Hardware:
    """This process's device, as DeepSpeed will pick it (``DS_ACCELERATOR=cpu`` forces the
    CPU; else CUDA device ``LOCAL_RANK`` when there is one)."""
    import torch

    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    wants_cpu = os.environ.get("DS_ACCELERATOR", "").lower() == "cpu"
    if not wants_cpu and torch.cuda.is_available():
        index = local_rank % max(1, torch.cuda.device_count())
        name = torch.cuda.get_device_name(index)
        major, minor = torch.cuda.get_device_capability(index)
        bf16 = (major, minor) >= (8, 0)
        return Hardware(
            name, "cuda", fp16=True, bf16=bf16, why_not=f"compute capability {major}.{minor}"
        )
    fp16 = cpu_fp16_supported()
    return Hardware(
        f"CPU {_cpu_name()}",
        "cpu",
        fp16=fp16,
        bf16=True,
        why_not="" if fp16 else "no AVX-512 FP16 or AMX-FP16 (oneDNN's fp16 probe says no)",
    )


def gpu_by_name(name: str) -> Hardware | None:
    """A GPU named as ``bertpipe plan --gpu`` takes it (h100, v100-32g, ...), from the data
    sheet table of training/models/flops.py; None when the name is unknown."""
    short = name.lower().split("-")[0]
    for pattern, table in PEAK_TFLOPS:
        if re.search(pattern, short, flags=re.IGNORECASE):
            has_bf16 = "bf16" in table
            why = "" if has_bf16 else "older than Ampere, compute capability < 8.0"
            return Hardware(name, "cuda", fp16="fp16" in table, bf16=has_bf16, why_not=why)
    return None


def _fused_devices() -> list[str]:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return list(_get_fused_kernels_supported_devices())


def check_hardware(
    hw: Hardware, *, precision: str, fused: str | None = None, prefix: str = ""
) -> None:
    """Raise a :class:`ConfigError` naming the key when ``hw`` cannot run the config."""
    if precision == "fp16" and hw.fp16 is False:
        raise ConfigError(
            f"{prefix}precision",
            f"fp16 is not supported on {hw.name} ({hw.why_not}); use precision=bf16 (or fp32)",
        )
    if precision == "bf16" and hw.bf16 is False:
        raise ConfigError(
            f"{prefix}precision",
            f"bf16 is not supported on {hw.name} ({hw.why_not}); use precision=fp16 (or fp32)",
        )
    if fused == "deepspeed" and hw.kind != "cuda":
        raise ConfigError(
            f"{prefix}optimizer.fused",
            f"DeepSpeed's FusedAdam needs a CUDA GPU, this is {hw.name}; use fused=auto",
        )
    if fused == "torch" and hw.kind not in _fused_devices():
        raise ConfigError(
            f"{prefix}optimizer.fused",
            f"torch has no fused AdamW for {hw.kind} ({hw.name}); use fused=auto",
        )
