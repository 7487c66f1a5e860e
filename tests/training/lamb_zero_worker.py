"""The runs of the LAMB-under-ZeRO check (tests/training/test_lamb_zero.py): a small model
trained 20 LAMB steps through bertpipe's own engine set-up (build_engine), the global batch
split over the ranks, optionally with the step counters reset after some steps (as at the
start of NVIDIA's phase 2). :func:`train` is one run on the job this process is in (the test
calls it for the 1-rank reference); run as a script under torchrun, each rank does the runs
``--job STAGE:PRECISION:RESET_AT:OUT`` one after the other (one interpreter per rank for all
of them), and rank 0 writes each run's final weights, losses, partition layout, every rank's
trust-ratio statistics and step counters."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
from torch import nn

from bertpipe.config import load_config
from bertpipe.training.core.engine import DistInfo, build_engine, init_distributed
from bertpipe.training.core.optim import client_optimizer, reset_step_counters, zero_partitions
from bertpipe.training.pretrain.config import PretrainConfig
from bertpipe.training.pretrain.phases import phase_engine

GLOBAL_BATCH = 8


class Net(nn.Module):
    """Odd sizes, so that ZeRO's partition boundaries cut through tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(13, 37)
        self.LayerNorm = nn.LayerNorm(37)
        self.mid = nn.Linear(37, 29)
        self.out = nn.Linear(29, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.LayerNorm(self.emb(x)))))


def train(
    info: DistInfo, stage: int, precision: str = "fp32", reset_at: int = 0, steps: int = 20
) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """One run on every rank of the job; rank 0 gets (final weights, what the ranks saw)."""
    micro = GLOBAL_BATCH // info.world_size
    cfg = load_config(
        PretrainConfig,
        None,
        [
            f"precision={precision}",
            f"zero.stage={stage}",
            "optimizer.name=lamb",
            "optimizer.weight_decay=0.01",
            "optimizer.max_grad_norm=1.0",
            f"phases=[{{name: p, max_steps: {steps}, micro_batch_size: {micro}, "
            f"global_batch_size: {GLOBAL_BATCH}, learning_rate: 0.02, warmup: 0.2}}]",
        ],
    )
    torch.manual_seed(0)
    model = Net()
    engine, _ = build_engine(model, phase_engine(cfg, cfg.phases[0], info.world_size))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    data = torch.Generator().manual_seed(1)
    target = nn.Linear(13, 7)
    losses = []
    for step in range(steps):
        if step and step == reset_at:
            reset_step_counters(engine.optimizer)
        x = torch.randn(GLOBAL_BATCH, 13, generator=data)
        y = target(x).detach()
        mine = slice(info.rank * micro, (info.rank + 1) * micro)
        loss = (engine(x[mine].to(dtype)).float() - y[mine]).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    layout = []
    if stage in (1, 2):
        layout = [[part.first, len(part.segments)] for _, part in zero_partitions(engine.optimizer)]
    lamb = client_optimizer(engine.optimizer)
    # every rank asks, on its own: no collective behind it
    ratios = getattr(lamb, "trust_ratio_stats", dict)()
    counters = sorted({int(state["step"]) for state in lamb.state.values()})
    gathered: list[Any] = [None] * info.world_size
    torch.distributed.all_gather_object(gathered, [layout, ratios, counters])
    torch.distributed.barrier()
    if info.rank != 0:
        return None
    weights = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return weights, {
        "losses": losses,
        "layout": [g[0] for g in gathered],
        "ratios": gathered[0][1],
        "ratios_per_rank": [g[1] for g in gathered],
        "steps_per_rank": [g[2] for g in gathered],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--job", action="append", required=True, help="STAGE:PRECISION:RESET_AT:OUT"
    )
    args = parser.parse_args()
    info = init_distributed()
    for run in args.job:
        stage, precision, reset_at, out = run.split(":", 3)
        result = train(info, int(stage), precision, int(reset_at))
        if result is not None:
            torch.save(result[0], out)
            with open(out + ".json", "w") as f:
                json.dump(result[1], f)
    # leave without interpreter teardown: gloo's threads can abort a process at exit
    # ("terminate called without an active exception") after the work is done
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
