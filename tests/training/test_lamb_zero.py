"""LAMB under ZeRO stages 1 and 2 takes the same steps as on one rank with whole tensors:
2 ranks at ZeRO 1 and at ZeRO 2 end with the weights of 1 rank at ZeRO 0 after 20 steps
(fp32, relative tolerance 1e-6), with partitions that cut through tensors and the step
counters reset after 12 steps (NVIDIA's phase-2 reset, on every rank's partitions); every
rank reports the trust-ratio statistics of one rank; bf16 trains.

The 2-rank runs share one torchrun job (``lamb_zero_worker.py`` does them one after the
other), made once per test run and shared by the pytest workers through the run's temporary
folder; the 1-rank reference runs in the test process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from filelock import FileLock

WORKER = Path(__file__).with_name("lamb_zero_worker.py")
ROOT = Path(__file__).resolve().parents[2]
# the 2-rank runs: (stage, precision, reset_at)
RUNS = ((1, "fp32", 12), (2, "fp32", 12), (1, "bf16", 0))

Result = tuple[dict, dict]  # type: ignore[type-arg]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _name(stage: int, precision: str, reset_at: int) -> str:
    return f"zero{stage}-2-{precision}-reset{reset_at}.pt"


def _two_rank_runs(out: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "MASTER_", "LOCAL_"))}
    env.pop("WORLD_SIZE", None)
    env.update({"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(_free_port()), str(WORKER),
    ]  # fmt: skip
    for run in RUNS:
        cmd += ["--job", ":".join(map(str, run)) + f":{out / _name(*run)}"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str, int], Result]:
    """Every run of :data:`RUNS` on 2 ranks: (final weights, what the ranks saw)."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "lamb-zero"
    shared.mkdir(exist_ok=True)
    with FileLock(str(shared) + ".lock", timeout=600):
        if not all((shared / (_name(*run) + ".json")).exists() for run in RUNS):
            _two_rank_runs(shared)
    return {
        run: (
            torch.load(shared / _name(*run)),
            json.loads((shared / (_name(*run) + ".json")).read_text()),
        )
        for run in RUNS
    }


def _one_rank_without_zero() -> Result:
    from bertpipe.training.core.engine import init_distributed
    from tests.training.lamb_zero_worker import train

    info = init_distributed()
    assert info.world_size == 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank of the 2-rank job computes
    try:
        result = train(info, 0, reset_at=12)
    finally:
        torch.set_num_threads(threads)
    assert result is not None
    return result


@pytest.mark.integration
@pytest.mark.slow
def test_lamb_zero1_and_zero2_on_two_ranks_equal_one_rank_without_zero(
    two_ranks: dict[tuple[int, str, int], Result],
) -> None:
    reference, ref_info = _one_rank_without_zero()
    assert ref_info["losses"][-1] < ref_info["losses"][0]
    assert ref_info["ratios"]["max"] != pytest.approx(1.0)  # trust ratios were at work
    assert ref_info["steps_per_rank"] == [[8]]  # 20 steps, counted again from 0 after 12
    for stage in (1, 2):
        weights, info = two_ranks[(stage, "fp32", 12)]
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
def test_lamb_zero1_bf16_on_two_ranks_trains(
    two_ranks: dict[tuple[int, str, int], Result],
) -> None:
    _, info = two_ranks[(1, "bf16", 0)]
    losses = info["losses"]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
