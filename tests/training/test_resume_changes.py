"""Resuming pre-training with a changed config, and what a resume must never do.

A lower learning rate or another weight decay at a resume trains with the new values (checked
against the same checkpoint continued by hand with those values); a changed model shape or
batch is refused with one line; an error before the first step writes no checkpoint; phase 2
restarts the optimizer's step counter when the recipe says so. Real DeepSpeed on CPU, fp32.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bertpipe import tracking
from bertpipe.config import ConfigError
from bertpipe.lease import LEASE_NAME
from bertpipe.training import checkpoint as ckpt
from bertpipe.training.core.faults import Faults
from bertpipe.training.pretrain.trainer import run_pretraining
from tests.cli_runner import run_cli
from tests.conftest import sqlite_uri
from tests.faultenv import FAULT_SIGNAL
from tests.training.test_pretrain import _cfg, _env, _overrides

pytestmark = pytest.mark.integration

ONE_MICRO_BATCH = {"phases[0].global_batch_size": 8, "only_phase": "phase1"}


def _spy_losses(monkeypatch: pytest.MonkeyPatch) -> dict[int, float]:
    """``train/loss`` by step as the trainer logs it (MLflow still gets every call)."""
    seen: dict[int, float] = {}
    real = tracking.log_metrics

    def spy(metrics: Any, step: int | None = None) -> None:
        if "train/loss" in metrics and step is not None:
            seen[step] = metrics["train/loss"]
        real(metrics, step=step)

    monkeypatch.setattr(tracking, "log_metrics", spy)
    return seen


def _kw(**extra: Any) -> dict[str, Any]:
    base = {"checkpoint__every_steps": 4, "checkpoint__keep_last": 5}
    return {**base, **{k.replace(".", "__"): v for k, v in ONE_MICRO_BATCH.items()}, **extra}


@pytest.fixture(scope="module")
def run_to_8(pretrain_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Phase 1, 8 steps of one micro-batch, checkpoints at steps 4 and 8."""
    out = tmp_path_factory.mktemp("resume-changes")
    uri = sqlite_uri(out / "mlflow.db")
    seen: dict[int, float] = {}
    with pytest.MonkeyPatch.context() as mp:
        seen = _spy_losses(mp)
        run_pretraining(_cfg(pretrain_shards, out / "a", uri, steps=8, **_kw()))
    return {"out": out, "uri": uri, "losses": dict(seen)}


def _resume_at_4(run_to_8: dict[str, Any], name: str) -> Path:
    """A copy of the run's checkpoints with ``latest`` at step 4."""
    source = run_to_8["out"] / "a" / "checkpoints"
    target = run_to_8["out"] / name / "checkpoints"
    shutil.copytree(source / "global_step4", target / "global_step4")
    (target / "latest").write_text("global_step4")
    for run_file in source.parent.glob("*.*"):  # pretrain.yaml, ds_config_*.json, summary.json
        shutil.copy2(run_file, target.parent / run_file.name)
    return target.parent


def _files(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` and its sha256."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_lower_learning_rate_and_other_weight_decay_apply_at_resume(
    pretrain_shards: Path, run_to_8: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    new = {"phases[0].learning_rate": 5.0e-4, "optimizer.weight_decay": 0.1}
    out = _resume_at_4(run_to_8, "changed")
    seen = _spy_losses(monkeypatch)
    cfg = _cfg(pretrain_shards, out, run_to_8["uri"], steps=8, **_kw(**_dotted(new)))
    run_pretraining(cfg)
    resumed = [seen[s] for s in range(5, 9)]
    unchanged = [run_to_8["losses"][s] for s in range(5, 9)]
    assert resumed[0] == unchanged[0]  # step 5's loss comes before its update
    assert resumed[1:] != unchanged[1:]  # the new values were used from step 5 on

    # the reference: the same checkpoint continued in this process, the values set by hand
    reference = _continue_by_hand(cfg, out / "checkpoints", lr=5.0e-4, weight_decay=0.1)
    assert resumed == reference

    import mlflow

    state, _ = ckpt.read_state(str(out / "checkpoints"), "global_step8", 0)
    assert state.config["optimizer"]["weight_decay"] == 0.1
    tags = mlflow.MlflowClient(tracking_uri=run_to_8["uri"]).get_run(state.mlflow_run_id).data.tags
    assert (
        tags["bertpipe.changed_at_resume.phases.0.learning_rate"] == "0.002 -> 0.0005 (from step 4)"
    )
    assert tags["bertpipe.changed_at_resume.optimizer.weight_decay"].startswith("0.01 -> 0.1")


def _dotted(values: dict[str, Any]) -> dict[str, Any]:
    return {k.replace(".", "__"): v for k, v in values.items()}


def _continue_by_hand(cfg: Any, folder: Path, *, lr: float, weight_decay: float) -> list[float]:
    """Steps 5-8 from ``global_step4``: engine, RNG and data position restored, then the new
    peak rate and weight decay written into the optimizer and schedule directly."""
    from bertpipe.training.core.engine import build_engine, init_distributed
    from bertpipe.training.core.step import OptimizerStep
    from bertpipe.training.pretrain.batches import BatchPrep
    from bertpipe.training.pretrain.trainer import Trainer

    trainer = Trainer(cfg, init_distributed())
    engine, _ = build_engine(trainer.new_model(), trainer.engine_spec(0))
    engine.load_checkpoint(str(folder), tag="global_step4")
    scheduler = engine.lr_scheduler
    groups = scheduler.optimizer.param_groups
    scheduler.base_lrs = [lr] * len(groups)
    for group in groups:
        group["lr"] = lr * scheduler.lr_lambdas[0](scheduler.last_epoch)
    groups[0]["weight_decay"] = weight_decay  # the decayed group; biases/LayerNorm keep 0
    _, rank_state = ckpt.read_state(str(folder), "global_step4", 0)
    assert rank_state is not None
    ckpt.restore_rng(rank_state["rng"])
    loader = trainer.loader(0)
    loader.load_state_dict(rank_state["data"])
    prep = BatchPrep(trainer.model_cfg, torch.device("cpu"), unpad=cfg.model.unpad)
    losses: list[float] = []
    step = OptimizerStep(
        engine, 1, on_output=lambda out, _: losses.append(float(out.loss.detach()))
    )
    batches = (prep(batch) for batch in loader)
    for n in range(5, 9):
        step(n, batches)
    return losses


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"model.hidden_size": 64}, "model.hidden_size"),
        ({"phases[0].global_batch_size": 16}, "phases[0].global_batch_size"),
    ],
)
def test_a_changed_shape_or_batch_is_refused_with_one_line(
    pretrain_shards: Path, run_to_8: dict[str, Any], change: dict[str, Any], key: str
) -> None:
    out = _resume_at_4(run_to_8, f"refused-{key}")
    kw = _kw()
    kw.update(_dotted(change))
    before = _files(out)
    assert "pretrain.yaml" in before and "ds_config_phase1.json" in before
    with pytest.raises(ConfigError) as error:
        run_pretraining(_cfg(pretrain_shards, out, run_to_8["uri"], steps=8, **kw))
    message = str(error.value)
    assert "\n" not in message and key in message and "checkpoint.allow_changes" in message
    assert _files(out) == before  # nothing written: `--config <output>/pretrain.yaml` replays
    assert ckpt.latest_tag(str(out / "checkpoints")) == "global_step4"  # the checkpoint's run


def test_an_error_before_the_first_step_writes_no_checkpoint(
    pretrain_shards: Path, tmp_path: Path
) -> None:
    uri = sqlite_uri(tmp_path / "mlflow.db")
    cfg = _cfg(pretrain_shards, tmp_path / "run", uri, steps=4, **_kw())
    with pytest.raises(RuntimeError, match="fault injection"):
        run_pretraining(cfg, faults=Faults(raise_step=1))
    assert not ckpt.has_checkpoints(cfg.checkpoint_dir)  # no global_step0 of untrained weights


def test_phase_two_restarts_the_step_counter_when_asked(
    pretrain_shards: Path, tmp_path: Path
) -> None:
    """Phase 1's 4 steps, then phase 2's 4 on the kept moments: with
    ``optimizer.reset_step_per_phase`` (NVIDIA's phase 2) the saved optimizer state counts
    phase 2's 4 steps, not 8 (the optimizer-level tests compare the update itself with
    apex's bias correction)."""
    uri = sqlite_uri(tmp_path / "mlflow.db")
    cfg = _cfg(
        pretrain_shards,
        tmp_path / "run",
        uri,
        steps=4,
        optimizer__reset_step_per_phase="true",
        tracking__enabled="false",
    )
    run_pretraining(cfg)
    (optim,) = (Path(cfg.checkpoint_dir) / "global_step8").glob("*optim_states.pt")
    assert _step_counts(torch.load(optim, weights_only=False)) == {4}
    (optim,) = (Path(cfg.checkpoint_dir) / "global_step4").glob("*optim_states.pt")
    assert _step_counts(torch.load(optim, weights_only=False)) == {4}  # phase 1's own


def _step_counts(value: Any) -> set[int]:
    """Every optimizer ``step`` counter found next to Adam moments in a saved state."""
    found: set[int] = set()
    if isinstance(value, dict):
        if "step" in value and "exp_avg" in value:
            found.add(int(value["step"]))
        for item in value.values():
            found |= _step_counts(item)
    elif isinstance(value, list | tuple):
        for item in value:
            found |= _step_counts(item)
    return found


def _wait(what: str, until: Any, proc: subprocess.Popen[bytes], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert proc.poll() is None, f"the first run ended ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.1)


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_a_second_run_on_one_output_is_refused_and_a_dead_runs_lease_taken_over(
    pretrain_shards: Path,
    run_to_8: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Run A (a child) is joined by run B on its output twice: while A starts, and once A
    saved step 4 (A is stopped there, before step 6). B is refused both times with one line
    naming A (exit 2), and touches nothing. Then A is killed, leaving its lease behind: the
    requeued run takes it over and resumes A's checkpoint exactly, steps 1-8 equal to the
    same run alone."""
    out, uri = tmp_path / "run", sqlite_uri(tmp_path / "mlflow.db")
    args = ["pretrain", *_overrides(pretrain_shards, out, uri, steps=8, **_kw())]
    env = {**_env(), FAULT_SIGNAL: "STOP:6"}  # A stops itself before step 6
    first = subprocess.Popen([sys.executable, "-m", "bertpipe.app.cli", *args], env=env)
    try:
        _wait("lease", (out / LEASE_NAME).exists, first)
        refused = run_cli(args, _env())
        assert refused.returncode == 2, refused.stderr[-2000:]
        line = refused.stderr.strip().splitlines()[-1]
        assert line.startswith(f"bertpipe: error: {out} is in use by `bertpipe pretrain` (pid ")
        assert f"pid {first.pid} on " in line
        _wait("stop before step 6", lambda: _stopped(first.pid), first)
        before = _files(out)
        assert ckpt.latest_tag(str(out / "checkpoints")) == "global_step4"
        again = run_cli(args, _env())
        assert again.returncode == 2 and f"pid {first.pid} on " in again.stderr
        assert _files(out) == before  # the refused run wrote nothing
    finally:
        first.kill()
        first.wait()
    seen = _spy_losses(monkeypatch)
    with caplog.at_level(logging.WARNING, "bertpipe.lease"):
        run_pretraining(_cfg(pretrain_shards, out, uri, steps=8, **_kw()))
    assert f"taking over the lease of `bertpipe pretrain` (pid {first.pid}" in caplog.text
    assert not (out / LEASE_NAME).exists()  # released at the end
    assert {s: seen[s] for s in range(5, 9)} == {s: run_to_8["losses"][s] for s in range(5, 9)}
    state, _ = ckpt.read_state(str(out / "checkpoints"), "global_step8", 0)
    import mlflow

    history = mlflow.MlflowClient(uri).get_metric_history(state.mlflow_run_id, "train/loss")
    first_run = {m.step: m.value for m in history if m.step <= 4}
    assert first_run == {s: run_to_8["losses"][s] for s in range(1, 5)}  # A, undisturbed
