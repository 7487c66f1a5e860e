"""LAMB under ZeRO stages 1 and 2 takes the same steps as on one rank with whole tensors:
2 ranks at ZeRO 1 and at ZeRO 2 end with the weights of 1 rank at ZeRO 0 after 20 steps
(fp32, relative tolerance 1e-6), with partitions that cut through tensors and the step
counters reset after 12 steps (NVIDIA's phase-2 reset, on every rank's partitions); every
rank reports the trust-ratio statistics of one rank; bf16 trains."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("lamb_zero_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(
    tmp: Path, ranks: int, stage: int, precision: str = "fp32", reset_at: int = 0
) -> tuple[dict, dict]:
    out = tmp / f"zero{stage}-{ranks}-{precision}.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "MASTER_", "LOCAL_"))}
    env.pop("WORLD_SIZE", None)
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
        "--master_port", str(_free_port()), str(WORKER),
        "--stage", str(stage), "--precision", precision, "--out", str(out),
        "--reset-at", str(reset_at),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out), json.loads(Path(str(out) + ".json").read_text())


@pytest.mark.integration
@pytest.mark.slow
def test_lamb_zero1_and_zero2_on_two_ranks_equal_one_rank_without_zero(tmp_path: Path) -> None:
    reference, ref_info = _run(tmp_path, 1, 0, reset_at=12)
    assert ref_info["losses"][-1] < ref_info["losses"][0]
    assert ref_info["ratios"]["max"] != pytest.approx(1.0)  # trust ratios were at work
    assert ref_info["steps_per_rank"] == [[8]]  # 20 steps, counted again from 0 after 12
    for stage in (1, 2):
        weights, info = _run(tmp_path, 2, stage, reset_at=12)
        assert info["steps_per_rank"] == [[8], [8]]
        # per group, [first tensor, tensors held] on each rank: the last tensor of rank 0 is
        # the first of rank 1 in the decayed group, so its norms need both ranks' pieces
        (first0, held0), (first1, _) = info["layout"][0][0], info["layout"][1][0]
        assert first0 + held0 - 1 == first1
        for name, want in reference.items():
            got = weights[name]
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), (name, stage)
            assert float((got - want).norm() / want.norm()) < 1e-6, (name, stage)
        assert info["ratios"]["min"] < info["ratios"]["max"]  # whole-tensor ratios, several
        # the statistics cover all tensors (the split one once) on each rank: those of 1 rank
        for rank, stats in enumerate(info["ratios_per_rank"]):
            assert stats == pytest.approx(ref_info["ratios"], rel=1e-5), (stage, rank)


@pytest.mark.integration
@pytest.mark.slow
def test_lamb_zero1_bf16_on_two_ranks_trains(tmp_path: Path) -> None:
    _, info = _run(tmp_path, 2, 1, "bf16")
    losses = info["losses"]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
