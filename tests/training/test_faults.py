"""Injected faults in real pre-training runs (DeepSpeed on CPU, fp32): non-finite losses,
preemption of the whole process group with loader workers, an exception in the loop.

NaN losses come from the trainer's fault-injection hook (``BERTPIPE_FAULT_NAN_STEPS``), the
exception from ``BERTPIPE_FAULT_RAISE_STEP``; the signals are real signals to real processes.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from bertpipe.training import checkpoint as ckpt
from bertpipe.training.core.guard import guard_updates as _skip_nonfinite_updates
from bertpipe.training.core.guard import poisoned as _poisoned
from bertpipe.training.core.guard import weights_finite as _weights_finite
from bertpipe.training.pretrain.trainer import run_pretraining
from tests.cli_runner import run_cli
from tests.conftest import free_port, sqlite_uri
from tests.faultenv import FAULT_NAN_STEPS, FAULT_RAISE_STEP, FAULT_RANK
from tests.training.test_pretrain import _cfg, _env, _history, _overrides, _pretrain_cmd

pytestmark = pytest.mark.integration


def _module_weights(folder: Path, tag: str) -> dict[str, torch.Tensor]:
    states = torch.load(folder / tag / "mp_rank_00_model_states.pt", weights_only=False)
    return states["module"]


def _all_finite(weights: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in weights.values() if t.is_floating_point())


# ----------------------------------------------------------------- a step is skipped, exactly


def test_poisoned_loss_is_exact_when_finite_and_nan_grads_when_not() -> None:
    w = torch.tensor([1.5, -2.0], requires_grad=True)
    loss = (w * w).sum() / 3
    _poisoned(loss).backward()
    assert torch.equal(w.grad, 2 * w.detach() / 3)  # bit for bit
    # an infinite loss whose own gradient is finite (w * inf has the gradient inf, but this
    # one: a finite term plus an infinite constant) must still poison the gradient
    w.grad = None
    loss = (w * w).sum() + torch.tensor(math.inf)
    _poisoned(loss).backward()
    assert torch.isnan(w.grad).all()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_nonfinite_step_leaves_weights_optimizer_and_lr_untouched(
    stage: int, pretrain_shards: Path, tmp_path: Path
) -> None:
    """A real engine: one good step, then a step whose loss is NaN. At ZeRO 1/2 DeepSpeed skips
    it (fp32 too: its gradient-norm check); at ZeRO 0 the trainer's guard does. Either way the
    weights, the optimizer state and the LR are those of before, and ``skipped_steps`` is 1."""
    from bertpipe.training.core.engine import build_engine, init_distributed
    from bertpipe.training.models.bert.model import BertForPreTraining
    from bertpipe.training.pretrain.batches import BatchPrep
    from bertpipe.training.pretrain.data.loader import PretrainingData
    from bertpipe.training.pretrain.data.manifest import read_phase_data
    from bertpipe.training.pretrain.phases import model_config, phase_engine

    cfg = _cfg(pretrain_shards, tmp_path, f"sqlite:///{tmp_path / 'db'}", zero__stage=stage)
    phase = cfg.phases[0]
    phase.global_batch_size = phase.micro_batch_size  # one micro-batch per step
    init_distributed()
    torch.manual_seed(0)
    model_cfg = model_config(cfg, [read_phase_data(phase, "phases[0]")])
    engine, _ = build_engine(BertForPreTraining(model_cfg), phase_engine(cfg, phase, 1))
    assert _skip_nonfinite_updates(engine) == (stage == 0)
    loader = PretrainingData(phase.data, "train", micro_batch_size=phase.micro_batch_size)
    batch, _ = BatchPrep(model_cfg, torch.device("cpu"), unpad=True)(next(iter(loader)))

    def step(nan: bool) -> None:
        out = engine(**batch)
        loss = out.loss * math.nan if nan else out.loss
        engine.backward(_poisoned(loss))
        engine.step()

    step(False)
    weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    moments = [
        t.clone()
        for s in _optimizer_states(engine)
        for t in s.values()
        if isinstance(t, torch.Tensor)
    ]
    lr = engine.optimizer.param_groups[0]["lr"]
    step(True)
    assert engine.skipped_steps == 1
    assert _weights_finite(engine)
    for k, v in engine.module.state_dict().items():
        assert torch.equal(v, weights[k]), k
    after = [
        t for s in _optimizer_states(engine) for t in s.values() if isinstance(t, torch.Tensor)
    ]
    assert all(torch.equal(a, b) for a, b in zip(after, moments, strict=True))
    assert engine.optimizer.param_groups[0]["lr"] == lr
    step(False)  # and training goes on
    assert engine.skipped_steps == 1 and _weights_finite(engine)
    assert not all(torch.equal(v, weights[k]) for k, v in engine.module.state_dict().items())


def _optimizer_states(engine: object) -> list[dict]:
    """The per-tensor states of the torch optimizer inside the engine (ZeRO wraps it)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return list(inner.state.values())


# ----------------------------------------------------------------- non-finite losses in a run


@pytest.mark.parametrize("stage", [0, 1])
def test_nan_burst_is_skipped_and_the_run_completes(
    stage: int, pretrain_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_NAN_STEPS, "3,4")
    uri = sqlite_uri(tmp_path / "mlflow.db")
    cfg = _cfg(
        pretrain_shards,
        tmp_path / "run",
        uri,
        steps=8,
        zero__stage=stage,
        only_phase="phase1",
        checkpoint__every_steps=2,
        checkpoint__keep_last=10,
    )
    summary = run_pretraining(cfg)
    assert summary["phase1"]["steps"] == 8
    folder = Path(cfg.checkpoint_dir)
    assert (folder / "latest").read_text() == "global_step8"
    # no checkpoint while steps were being skipped (4 is deferred), every one finite
    tags = sorted(p.name for p in folder.iterdir() if p.name.startswith("global_step"))
    assert tags == ["global_step2", "global_step6", "global_step8"]
    for tag in tags:
        assert _all_finite(_module_weights(folder, tag)), tag
    state, _ = ckpt.read_state(str(folder), "global_step8", 0)
    assert state.skipped_steps == 2
    skipped = _history(uri, state.mlflow_run_id, "train/skipped_steps")
    assert skipped == [(1, 0), (2, 0), (3, 1), (4, 2), (5, 2), (6, 2), (7, 2), (8, 2)]
    # the LR schedule stands still on skipped steps: updates 3, 4, 5 use the same rate
    lrs = dict(_history(uri, state.mlflow_run_id, "train/lr"))
    assert lrs[3] == lrs[4] == lrs[5] and lrs[6] != lrs[5]
    losses = dict(_history(uri, state.mlflow_run_id, "train/loss"))
    assert all(math.isfinite(losses[s]) for s in (1, 2, 5, 6, 7, 8))
    # DeepSpeed's own count, saved in its checkpoint
    assert (
        torch.load(folder / "global_step8" / "mp_rank_00_model_states.pt", weights_only=False)[
            "skipped_steps"
        ]
        == 2
    )


def test_nonfinite_losses_are_logged_as_nan(
    pretrain_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NaN points reach MLflow as NaN (not dropped), as does the inf gradient norm DeepSpeed
    reports for a skipped step (MLflow's SQL store keeps NaN and stores inf as the largest
    float)."""
    monkeypatch.setenv(FAULT_NAN_STEPS, "2")
    uri = sqlite_uri(tmp_path / "mlflow.db")
    cfg = _cfg(pretrain_shards, tmp_path / "run", uri, steps=3, only_phase="phase1")
    run_pretraining(cfg)
    state, _ = ckpt.read_state(cfg.checkpoint_dir, "global_step3", 0)
    losses = dict(_history(uri, state.mlflow_run_id, "train/loss"))
    assert sorted(losses) == [1, 2, 3], "the NaN point was dropped (bertpipe/tracking.py)"
    assert math.isnan(losses[2])
    norms = dict(_history(uri, state.mlflow_run_id, "train/grad_norm"))
    assert norms[2] >= 1.7e308  # inf, or what the SQL store makes of it


@pytest.mark.slow
def test_persistent_nan_stops_with_one_line_and_keeps_the_last_good_checkpoint(
    pretrain_shards: Path, tmp_path: Path
) -> None:
    env = {**_env(), FAULT_NAN_STEPS: "6-"}
    uri = sqlite_uri(tmp_path / "mlflow.db")
    args = _overrides(pretrain_shards, tmp_path / "run", uri, steps=24)
    args += ["only_phase=phase1", "max_bad_steps=3", "checkpoint.every_steps=4"]
    proc = run_cli(["pretrain", *args], env)  # in this process: no signal, no ranks
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("bertpipe: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "3 optimizer steps in a row had a non-finite loss" in errors[0]
    assert "max_bad_steps=3" in errors[0] and "global_step4" in errors[0]
    folder = tmp_path / "run" / "checkpoints"
    assert (folder / "latest").read_text() == "global_step4"  # steps 6-8 were never saved
    tags = sorted(p.name for p in folder.iterdir() if p.name.startswith("global_step"))
    assert tags == ["global_step4"]
    assert _all_finite(_module_weights(folder, "global_step4"))
    state, _ = ckpt.read_state(str(folder), "global_step4", 0)
    import mlflow

    run = mlflow.MlflowClient(tracking_uri=uri).get_run(state.mlflow_run_id)
    assert run.info.status == "FAILED"
    assert run.data.metrics["train/skipped_steps"] == 3
    # the same command without the fault resumes from the good checkpoint
    proc = run_cli(["pretrain", *args], _env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (folder / "latest").read_text() == "global_step24"


NAN_ON_ONE_RANK_STAGES = (0, 1)


@pytest.fixture(scope="module")
def nan_on_one_rank(pretrain_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks (torchrun), a NaN loss at step 3 on rank 1 only, a run of 6 steps at each ZeRO
    stage of :data:`NAN_ON_ONE_RANK_STAGES`, one after the other in the same two processes
    (``cli_sequence_worker.py``: two interpreter start-ups per rank fewer). Made once per
    test run, shared by the pytest workers through the run's temporary folder; returns the
    folder with ``zero<stage>/`` (``run/``, ``mlflow.db``) for each."""
    import shlex
    import sys

    from filelock import FileLock

    from bertpipe.config import to_yaml

    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "nan-on-one-rank"
    with FileLock(str(shared) + ".lock", timeout=900):
        if (shared / "done").exists():
            return shared
        shared.mkdir(exist_ok=True)
        commands = []
        for stage in NAN_ON_ONE_RANK_STAGES:
            out = shared / f"zero{stage}"
            out.mkdir(exist_ok=True)
            uri = sqlite_uri(out / "mlflow.db")
            cfg = _cfg(pretrain_shards, out / "run", uri, steps=6, zero__stage=stage)
            (out / "cfg.yaml").write_text(to_yaml(cfg))
            commands.append(shlex.join(["pretrain", "--config", str(out / "cfg.yaml"),
                                        "only_phase=phase1"]))  # fmt: skip
        bin_dir = Path(sys.executable).parent
        env = {**_env(), FAULT_NAN_STEPS: "3", FAULT_RANK: "1"}
        # torchrun: two interpreter start-ups fewer than the deepspeed launcher (which the
        # launcher tests cover)
        cmd = [str(bin_dir / "torchrun"), "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(Path(__file__).with_name("cli_sequence_worker.py")),
               *commands]  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        (shared / "done").write_text("")
    return shared


@pytest.mark.slow
@pytest.mark.parametrize("stage", NAN_ON_ONE_RANK_STAGES)
def test_nan_on_one_rank_is_skipped_on_both(stage: int, nan_on_one_rank: Path) -> None:
    """2 ranks, a NaN loss on rank 1 only: both ranks skip the same step (the flag travels in
    the gradients' own reduction), the run completes and the ranks stay in step."""
    out = nan_on_one_rank / f"zero{stage}"
    uri = sqlite_uri(out / "mlflow.db")
    folder = out / "run" / "checkpoints"
    state, _ = ckpt.read_state(str(folder), "global_step6", 0)
    assert state.world_size == 2 and state.skipped_steps == 1
    assert _all_finite(_module_weights(folder, "global_step6"))
    skipped = _history(uri, state.mlflow_run_id, "train/skipped_steps")
    assert [v for _, v in skipped] == [0, 0, 1, 1, 1, 1]


def test_prune_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    """Checkpoints saved during a run of skipped steps (on preemption) are marked not good:
    the newest good one survives pruning even beyond ``keep_last``."""
    index = []
    for step, good in ((4, True), (8, False), (12, False)):
        (tmp_path / f"global_step{step}").mkdir()
        index.append(
            {"tag": f"global_step{step}", "phase": "p", "global_step": step, "phase_end": False}
            | {"good": good}
        )
    (tmp_path / ckpt.INDEX_FILE).write_text(json.dumps(index))
    (tmp_path / "latest").write_text("global_step12")
    assert ckpt.prune(str(tmp_path), keep_last=1) == ["global_step8"]
    assert (tmp_path / "global_step4").is_dir() and (tmp_path / "global_step12").is_dir()


# ----------------------------------------------------------------- preemption, exceptions


@pytest.mark.slow
def test_process_group_sigterm_with_loader_workers_saves_and_exits_143(
    pretrain_shards: Path, tmp_path: Path
) -> None:
    """SIGTERM to the whole process group (SLURM preemption, scancel) with 2 loader workers:
    the workers ignore it, the trainer saves, shuts them down and exits 143; a resume then
    finishes the phase."""
    uri = sqlite_uri(tmp_path / "mlflow.db")
    args = _overrides(pretrain_shards, tmp_path / "run", uri, steps=24)
    args += ["only_phase=phase1", "data.num_workers=2"]
    proc = subprocess.Popen(
        _pretrain_cmd(args),
        env=_env(),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "phase1 step 3/" in line:
            os.killpg(proc.pid, signal.SIGTERM)
            break
    rest = proc.stderr.read()
    assert proc.wait(timeout=300) == 143, "".join(seen)[-3000:] + rest[-3000:]
    assert "DataLoader worker" not in rest, rest[-3000:]
    folder = tmp_path / "run" / "checkpoints"
    stopped_at = int((folder / "latest").read_text().removeprefix("global_step"))
    assert 3 <= stopped_at < 24
    # no worker is left behind in the job's process group
    deadline = time.monotonic() + 20
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "loader workers outlived the trainer"
        time.sleep(0.2)
    proc2 = run_cli(["pretrain", *args], _env())  # the resume needs no process group
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert (folder / "latest").read_text() == "global_step24"


def test_exception_in_the_loop_saves_the_last_step_and_reraises(
    pretrain_shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = sqlite_uri(tmp_path / "mlflow.db")
    kw = {"steps": 8, "only_phase": "phase1", "checkpoint__every_steps": 4}
    monkeypatch.setenv(FAULT_RAISE_STEP, "6")
    with pytest.raises(RuntimeError, match="fault injection"):
        run_pretraining(_cfg(pretrain_shards, tmp_path / "run", uri, **kw))
    folder = tmp_path / "run" / "checkpoints"
    assert (folder / "latest").read_text() == "global_step5"
    state, _ = ckpt.read_state(str(folder), "global_step5", 0)
    assert state.phase_step == 5 and not state.phase_complete
    assert _all_finite(_module_weights(folder, "global_step5"))
    monkeypatch.delenv(FAULT_RAISE_STEP)
    summary = run_pretraining(_cfg(pretrain_shards, tmp_path / "run", uri, **kw))
    assert summary["phase1"]["global_step"] == 8
    history = _history(uri, state.mlflow_run_id, "train/loss")
    assert [s for s, _ in history] == list(range(1, 9))  # one run, every step once
