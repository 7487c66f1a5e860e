"""Time of a planned pre-training step: compute at an assumed MFU plus the communication
ZeRO's stage sends over the slowest link, less what overlaps.

Part of ``bertpipe plan`` (:mod:`bertpipe.training.plan.plan`). Symbols: Ψ parameters, N world
size (GPUs), e bytes per 16/32-bit element.
"""

from __future__ import annotations

from dataclasses import dataclass

from bertpipe.errors import BertpipeError
from bertpipe.training.plan.memory import element_bytes

__all__ = ["StepTime", "comm_bytes_per_step", "comm_passes_per_step", "step_time"]


def comm_passes_per_step(zero_stage: int, accumulation: int) -> int:
    """Full passes of Ψ elements over the ring per optimizer step (each pass sends
    (N-1)/N·Ψ elements per GPU, as a reduce-scatter or all-gather does).

    * stage 0: one all-reduce of the gradients at the accumulation boundary = 2 passes
      (a ring all-reduce is a reduce-scatter plus an all-gather);
    * stage 1: reduce-scatter of the gradients at the boundary + all-gather of the
      updated parameters = 2;
    * stage 2: DeepSpeed reduce-scatters the gradients after every micro batch (they are
      partitioned, so they cannot wait for the boundary) + one all-gather = accumulation + 1;
    * stage 3: per micro batch, all-gather of the parameters in the forward and again in
      the backward pass + reduce-scatter of the gradients = 3·accumulation.

    With accumulation 1 these are ZeRO's 2Ψ (stages 0-2) and 3Ψ (stage 3).
    """
    if zero_stage <= 1:
        return 2
    if zero_stage == 2:
        return accumulation + 1
    return 3 * accumulation


def comm_bytes_per_step(
    num_params: int, zero_stage: int, world_size: int, accumulation: int, precision: str
) -> float:
    """Bytes each GPU sends per optimizer step over its slowest link:
    ``passes · (N-1)/N · Ψ · e`` (passes from :func:`comm_passes_per_step`; for the stage 0
    all-reduce this is the ring factor 2(N-1)/N). Zero on one GPU."""
    if world_size == 1:
        return 0.0
    ring = (world_size - 1) / world_size
    passes = comm_passes_per_step(zero_stage, accumulation)
    return passes * ring * num_params * element_bytes(precision)


@dataclass(frozen=True)
class StepTime:
    """Estimated time of one optimizer step and of a whole phase."""

    flops_per_step: float
    """Training FLOPs of a global batch (hardware FLOPs: with recomputation if checkpointing)."""
    compute_s: float
    comm_bytes_per_gpu: float
    link: str
    """``none`` (one GPU), ``intra-node`` (NVLink) or ``inter-node``."""
    bandwidth_gbps: float | None
    comm_s: float
    exposed_comm_s: float
    step_s: float
    phase_s: float


def step_time(
    *,
    flops_per_step: float,
    world_size: int,
    peak_flops_per_gpu: float,
    mfu: float,
    comm_bytes: float,
    link: str,
    bandwidth_gbps: float | None,
    overlap: float,
    steps: int,
) -> StepTime:
    """Time per step = compute + non-overlapped communication::

        compute = flops_per_step / (N · peak · MFU)
        comm    = comm_bytes / (bandwidth_gbps · 1e9 / 8)
        step    = compute + (1 - overlap) · comm
        phase   = steps · step

    N is the world size, peak the dense FLOP/s of one GPU.
    """
    compute = flops_per_step / (world_size * peak_flops_per_gpu * mfu)
    comm = 0.0
    if comm_bytes > 0:
        if bandwidth_gbps is None or bandwidth_gbps <= 0:
            raise BertpipeError("a positive bandwidth is needed when GPUs communicate")
        comm = comm_bytes / (bandwidth_gbps * 1e9 / 8)
    exposed = (1.0 - overlap) * comm
    step = compute + exposed
    return StepTime(
        flops_per_step=flops_per_step,
        compute_s=compute,
        comm_bytes_per_gpu=comm_bytes,
        link=link,
        bandwidth_gbps=bandwidth_gbps,
        comm_s=comm,
        exposed_comm_s=exposed,
        step_s=step,
        phase_s=step * steps,
    )
