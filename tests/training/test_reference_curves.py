"""Reference curves (as torchtitan keeps one): a fixed tiny pre-training on the fixture shards,
fp32 on CPU, 200 steps with AdamW and with LAMB. Its loss and MLM-accuracy curve (means of
10-step windows) are committed in ``reference_curves.json`` with the tolerance that reruns
showed; a change that moves a curve beyond it fails here.

Regenerate after an intended change (and say why in the commit)::

    BERTPIPE_WRITE_REFERENCE=1 pytest tests/training/test_reference_curves.py

That runs each optimizer at 1 and at 2 torch threads (the reduction order, and so the last
bits of fp32 sums, changes with the thread count, as it does between machines) and writes
the 1-thread curve with a tolerance of 4x the largest difference seen, at least the floor.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import pytest
import torch

from bertpipe.config import load_config
from bertpipe.training.pretrain.config import PretrainConfig
from bertpipe.training.pretrain.trainer import run_pretraining
from tests.conftest import sqlite_uri

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REFERENCE = Path(__file__).with_name("reference_curves.json")
STEPS = 200
WINDOW = 10
METRICS = ("loss", "mlm_accuracy")
FLOOR = {"loss": 0.01, "mlm_accuracy": 0.005}
RECIPES = {
    "adamw": ["optimizer.name=adamw", "phases[0].learning_rate=2.0e-3"],
    "lamb": [
        "optimizer.name=lamb",
        "phases[0].learning_rate=2.0e-2",
        "phases[0].decay=poly",
        "phases[0].decay_from=start",
    ],
}


def _curve(shards: Path, out: Path, optimizer: str, threads: int) -> dict[str, list[float]]:
    import mlflow

    uri = sqlite_uri(out / "mlflow.db")
    cfg = load_config(
        PretrainConfig,
        None,
        [
            f"output={out / 'run'}",
            "model.preset=tiny",
            "model.max_position_embeddings=128",
            f"phases=[{{name: phase1, data: {shards / 'seq64'}, max_steps: {STEPS},"
            " micro_batch_size: 16, global_batch_size: 16, warmup: 0.1}]",
            "precision=fp32",
            "zero.stage=0",
            "data.num_workers=0",
            f"log_every_steps={WINDOW}",
            f"checkpoint.every_steps={STEPS}",
            "checkpoint.keep_last=1",
            "eval.max_batches=2",
            f"tracking.uri={uri}",
            "tracking.experiment=reference-curves",
            "seed=1234",
            *RECIPES[optimizer],
        ],
    )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run_pretraining(cfg)
    finally:
        torch.set_num_threads(before)
    client = mlflow.MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs(client.get_experiment_by_name("reference-curves").experiment_id)
    curve = {}
    for key in METRICS:
        history = sorted(
            (m.step, m.value) for m in client.get_metric_history(run.info.run_id, f"train/{key}")
        )
        assert [s for s, _ in history] == list(range(WINDOW, STEPS + 1, WINDOW)), history
        curve[key] = [v for _, v in history]
    return curve


@pytest.mark.parametrize("optimizer", sorted(RECIPES))
def test_reference_curve(pretrain_shards: Path, tmp_path: Path, optimizer: str) -> None:
    if os.environ.get("BERTPIPE_WRITE_REFERENCE"):
        _write(pretrain_shards, tmp_path, optimizer)
    reference = json.loads(REFERENCE.read_text())[optimizer]
    curve = _curve(pretrain_shards, tmp_path / "check", optimizer, threads=torch.get_num_threads())
    for key in METRICS:
        tol = reference["tolerance"][key]
        worst = max(abs(a - b) for a, b in zip(curve[key], reference[key], strict=True))
        assert worst <= tol, (
            f"{optimizer} {key} moved from the reference curve by {worst:.4g} (> {tol:.4g}); "
            f"now {[round(v, 4) for v in curve[key]]}, reference {reference[key]}. If the change "
            "is intended, regenerate (see the module docstring)"
        )
    # the curve is a learning curve, not noise: the reference itself falls
    assert reference["loss"][-1] < reference["loss"][0] - 0.3


def _write(shards: Path, tmp: Path, optimizer: str) -> None:
    one = _curve(shards, tmp / "t1", optimizer, threads=1)
    two = _curve(shards, tmp / "t2", optimizer, threads=2)
    again = _curve(shards, tmp / "t1-again", optimizer, threads=1)
    tolerance = {}
    for key in METRICS:
        assert again[key] == one[key], "a rerun at the same thread count is not bit-exact"
        seen = max(abs(a - b) for a, b in zip(one[key], two[key], strict=True))
        tolerance[key] = max(4 * seen, FLOOR[key])
    data = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
    data[optimizer] = {
        "steps": list(range(WINDOW, STEPS + 1, WINDOW)),
        **{key: [round(v, 6) for v in one[key]] for key in METRICS},
        "tolerance": tolerance,
        "largest_difference_1_vs_2_threads": {
            key: max(abs(a - b) for a, b in zip(one[key], two[key], strict=True)) for key in METRICS
        },
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
    }
    REFERENCE.write_text(json.dumps(data, indent=1) + "\n")
