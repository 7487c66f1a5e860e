"""Fine-tuning on the training loop it shares with pre-training (issue 24): what pre-training
already did, fine-tuning now does the same way.

- An unexpected error in a step saves the last completed step, and the same command resumes
  from it to the uninterrupted run's result; so does an error in an epoch's end (its
  evaluation runs again at the resume).
- A checkpoint upload that fails (credentials without write permission on the store: 403)
  does not hide the error that ended the run.
- A run saved by one rank continues on two (ZeRO 0), from the same step.

Real DeepSpeed on CPU, real checkpoints, a real S3 server; the errors come from the fault
seam (``Faults``), a real 403 and a real SIGTERM.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bertpipe.config import load_config, to_yaml
from bertpipe.finetuning.config import FinetuneConfig
from bertpipe.finetuning.run import FinetuneResult, run_finetuning
from bertpipe.training import checkpoint as ckpt
from bertpipe.training.core.cadence import PreemptedError
from bertpipe.training.core.faults import Faults
from tests.conftest import free_port, sqlite_uri
from tests.finetuning.test_loop import _glue_files
from tests.training.test_pretrain import _env

pytestmark = pytest.mark.integration


def _cfg(pretrained: Path, folder: Path, *extra: str) -> FinetuneConfig:
    """40 rows: 10 steps of 4 per epoch, 20 in all; no periodic checkpoint."""
    train, dev = _glue_files(folder)
    return load_config(
        FinetuneConfig,
        None,
        [
            f"init_from={pretrained}",
            "task.family=glue",
            "task.name=sst-2",
            f"task.train={train}",
            f"task.dev=[{dev}]",
            "epochs=2",
            "batch_size=4",
            "learning_rate=2e-3",
            "eval_batch_size=16",
            "checkpoint.every_steps=0",
            f"output={folder / 'out'}",
            f"tracking.uri={sqlite_uri(folder / 'mlflow.db')}",
            "tracking.experiment=finetune-errors",
            *extra,
        ],
    )


def _epochs(result: FinetuneResult) -> list[dict[str, Any]]:
    return [{k: v for k, v in h.items() if k != "epoch_seconds"} for h in result.history]


@pytest.fixture(scope="module")
def reference(pretrained: Path, tmp_path_factory: pytest.TempPathFactory) -> FinetuneResult:
    return run_finetuning(_cfg(pretrained, tmp_path_factory.mktemp("reference")))


def test_an_error_in_a_step_saves_the_last_step_and_resumes_to_the_same_result(
    pretrained: Path, reference: FinetuneResult, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _cfg(pretrained, tmp_path)
    folder = str(tmp_path / "out" / "checkpoints")
    with pytest.raises(RuntimeError, match="fault injection"):
        run_finetuning(cfg, faults=Faults(raise_step=7))
    assert ckpt.latest_tag(folder) == "global_step6"
    assert "saved global_step6 after an error at step 7" in caplog.text
    state, _ = ckpt.read_state(folder, "global_step6", 0)
    assert state.data == {"epoch": 1, "batches": 6} and not state.loop["history"]
    resumed = run_finetuning(cfg)
    assert resumed.metrics == reference.metrics and resumed.best_epoch == reference.best_epoch
    assert _epochs(resumed) == _epochs(reference)
    assert resumed.run_id == state.mlflow_run_id


def test_an_error_in_an_epochs_end_is_evaluated_again_at_the_resume(
    pretrained: Path,
    reference: FinetuneResult,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first epoch's predictions cannot be written (the writer raises ENOSPC once): the
    run saves step 10, the end of epoch 1, and the resume evaluates epoch 1 before step 11."""
    from bertpipe.finetuning import run as finetune_run

    real = finetune_run.write_predictions
    calls = {"n": 0}

    def full_once(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "predictions")
        return real(*args, **kwargs)

    monkeypatch.setattr(finetune_run, "write_predictions", full_once)
    cfg = _cfg(pretrained, tmp_path)
    folder = str(tmp_path / "out" / "checkpoints")
    with pytest.raises(OSError, match="No space left"):
        run_finetuning(cfg)
    assert ckpt.latest_tag(folder) == "global_step10"
    state, _ = ckpt.read_state(folder, "global_step10", 0)
    assert state.data == {"epoch": 2, "batches": 0} and not state.loop["history"]
    resumed = run_finetuning(cfg)
    assert [h["epoch"] for h in resumed.history] == [1, 2]
    assert resumed.metrics == reference.metrics and _epochs(resumed) == _epochs(reference)


def test_a_failed_upload_does_not_hide_the_error(
    pretrained: Path, tmp_path: Path, s3: Any, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """Checkpoints on S3 with credentials that may read but not write: the upload of step 2
    fails with 403 in the background; step 3 raises. The step's error is what the run
    raises; the upload's is logged."""
    reader = s3.server.user_env("reader", ["s3:GetObject", "s3:ListBucket"])
    for name, value in reader.items():
        monkeypatch.setenv(name, value)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    cfg = _cfg(
        pretrained,
        tmp_path,
        f"checkpoint.dir={s3.bucket}/ft/checkpoints",
        f"checkpoint.local_dir={tmp_path / 'staging'}",
        "checkpoint.every_steps=2",
    )
    caplog.set_level(logging.INFO)
    with pytest.raises(RuntimeError, match="fault injection"):
        run_finetuning(cfg, faults=Faults(raise_step=3))
    assert "checkpoint global_step2 was not uploaded" in caplog.text  # logged, not raised
    assert ckpt.latest_tag(f"{s3.bucket}/ft/checkpoints") is None  # nothing was published


@pytest.mark.slow
def test_a_run_saved_by_one_rank_continues_on_two(pretrained: Path, tmp_path: Path) -> None:
    """Stopped by SIGTERM at step 5 on one rank; the same config on two ranks (torchrun)
    continues from step 5: the same epochs and steps, one MLflow run, RNG streams new."""
    cfg = _cfg(pretrained, tmp_path, "checkpoint.preemption_check_steps=1")
    with pytest.raises(PreemptedError):
        run_finetuning(cfg, faults=Faults(signal_step=(signal.SIGTERM, 5)))
    folder = str(tmp_path / "out" / "checkpoints")
    assert ckpt.latest_tag(folder) == "global_step5"
    state, _ = ckpt.read_state(folder, "global_step5", 0)
    (tmp_path / "cfg.yaml").write_text(to_yaml(cfg))
    bin_dir = Path(sys.executable).parent
    cmd = [str(bin_dir / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port())]
    cmd += [str(bin_dir / "bertpipe"), "finetune", "--config", str(tmp_path / "cfg.yaml")]
    proc = subprocess.run(
        cmd, env={**_env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "resuming on 2 ranks from 1: RNG streams restart" in proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["run_id"] == state.mlflow_run_id
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=cfg.tracking.uri)
    epochs = client.get_metric_history(summary["run_id"], "epoch")
    assert sorted((m.step, m.value) for m in epochs) == [(10, 1.0), (20, 2.0)]
    assert not Path(folder).exists()  # complete
