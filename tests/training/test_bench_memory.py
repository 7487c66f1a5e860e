"""``bertpipe bench memory``: per-rank model-state bytes counted from what DeepSpeed holds,
checked against an independent count, and ZeRO 2's sharding of the optimizer states."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from bertpipe.app.bench.memory_tally import ActivationMeter, StorageTally
from bertpipe.training.models.bert.model import BertModelConfig

REPO = Path(__file__).resolve().parents[2]


def test_storage_tally_counts_a_storage_once() -> None:
    flat = torch.zeros(100, dtype=torch.bfloat16)
    tally = StorageTally()
    tally.add("parameters", flat[:50])
    tally.add("parameters", flat[50:])  # a view of the same buffer: not again
    tally.add("gradients", flat)  # claimed already
    tally.add("gradients", torch.zeros(10))
    assert tally.get("parameters") == 200
    assert tally.get("gradients") == 40


def test_activation_meter_counts_saved_tensors_not_weights() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(4, 16, requires_grad=True)
    with ActivationMeter(model) as meter:
        model(x).sum().backward()
    # the input, the first Linear's output (GELU's input) and GELU's output, fp32
    assert meter.total == 4 * (4 * 16 + 4 * 32 + 4 * 32)


def _bench(*args: str) -> dict:
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update({"DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    proc = subprocess.run(
        [sys.executable, "-m", "bertpipe.app.cli", "bench", "memory", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.integration
@pytest.mark.slow
def test_bench_memory_tiny_zero2_on_two_ranks() -> None:
    result = _bench(
        "--config", "bert-large-lamb", "--preset", "tiny", "--ranks", "2", "--steps", "1",
        "--micro-batch", "4", "--zero", "2",
    )  # fmt: skip
    assert result["ranks"] == 2
    if result["precision"] != "bf16":  # the bench falls back where the CPU cannot run bf16
        pytest.skip(f"this CPU ran the bench in {result['precision']}, not bf16: {result}")
    psi = BertModelConfig.preset("tiny", 30522).num_parameters()
    assert result["num_parameters"] == psi
    (zero2,) = result["stages"]
    assert {"measured", "planned", "ratio", "per_rank"} <= set(zero2)
    for key in ("parameters", "gradients", "optimizer_states", "model_states"):
        assert zero2["measured"][key] > 0 and zero2["planned"][key] > 0
        assert zero2["ratio"][key] == pytest.approx(zero2["measured"][key] / zero2["planned"][key])
    assert zero2["measured"]["activations"] > 0
    assert len(zero2["per_rank"]) == 2
    # counted from the model config, bf16: the 16-bit weights whole on each rank; ZeRO 2
    # shards the optimizer states (4 master + 4 + 4 moments per parameter) over the 2 ranks
    for rank in zero2["per_rank"]:
        assert rank["parameters"] == pytest.approx(2 * psi, rel=1e-4)
        assert rank["optimizer_states"] == pytest.approx(12 * psi / 2, rel=0.01)
