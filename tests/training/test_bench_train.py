"""``bertpipe bench train`` runs the real trainer path on CPU and prints its figures."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.cli_runner import run_cli

KEYS = {
    "seq_per_s",
    "real_tokens_per_s",
    "tflops",
    "tflops_padded",
    "mfu_real",
    "mfu_padded",
    "peak_memory_gb",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "data_wait_s",
    "padding_fraction",
    "loss_first",
    "loss_last",
}


def _bench(*args: str) -> dict[str, object]:
    """``bertpipe bench train ARGS`` on one thread, in this process (the GPU check's smoke run
    starts it as a process of its own: tests/test_gpu_check.py)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = run_cli(["bench", "train", *args], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert isinstance(result, dict)
    return result


COMMON = ("--preset", "tiny", "--seq-len", "128", "--micro-batch", "8", "--warmup", "1")


@pytest.mark.integration
@pytest.mark.slow
def test_bench_train_unpadded_equals_padded_losses_on_cpu() -> None:
    """Smoke test of the benchmark; without dropout both paths give the same losses."""
    runs = {
        padding: _bench(*COMMON, "--steps", "3", "--dropout", "0", "--padding", padding)
        for padding in ("unpad", "pad")
    }
    for result in runs.values():
        assert set(result) >= KEYS
        assert result["seq_per_s"] > 0 and result["forward_s"] > 0
        assert result["mfu_real"] is None  # no peak known for a CPU
        assert 0 < result["padding_fraction"] < 0.5  # the synthetic lengths have padding
        assert result["tflops_padded"] > result["tflops"]
    unpad, pad = runs["unpad"], runs["pad"]
    assert unpad["steps"] == 3 and unpad["padding"] == "unpad"
    np.testing.assert_allclose(unpad["loss_first"], pad["loss_first"], rtol=1e-5)
    np.testing.assert_allclose(unpad["loss_last"], pad["loss_last"], rtol=1e-4)


@pytest.mark.integration
def test_bench_train_reference_and_peak() -> None:
    """transformers' model as the reference, and MFU once a peak is given."""
    hf = _bench(*COMMON, "--steps", "2", "--model", "hf", "--peak-tflops", "1")
    assert hf["model"] == "hf" and hf["padding"] == "pad"
    assert hf["seq_per_s"] > 0
    assert hf["mfu_real"] == pytest.approx(hf["tflops"], rel=1e-6)
