"""Two `bertpipe pretrain` processes form ONE 2-rank job under each launcher's environment.

srun and mpirun are not needed: the processes get the variables srun (one task per GPU)
and OpenMPI's mpirun set for each task. torchrun runs for real. The deepspeed launcher is
covered by tests/training/test_pretrain.py.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bertpipe.config import to_yaml
from bertpipe.training import checkpoint as ckpt
from tests.conftest import sqlite_uri
from tests.training.test_pretrain import _cfg, _env, _history

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BIN = Path(sys.executable).parent  # the environment's scripts, activated or not
_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "I_MPI_", "TORCHELASTIC_")
_LAUNCHER_NAMES = {"GROUP_RANK", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE"}


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port(low: int = 20000, high: int = 40000) -> int:
    for port in random.sample(range(low, high), 200):
        if _port_is_free(port):
            return port
    raise RuntimeError("no free port")


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without any launcher's variables, plus ``extra``."""
    env = {
        k: v
        for k, v in _env().items()
        if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_NAMES
    }
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _job(shards: Path, out: Path) -> list[str]:
    """A tiny phase 1 of 2 steps (global batch 16 = 8 per rank x 2 ranks)."""
    out.mkdir(parents=True)
    cfg = _cfg(shards, out / "run", sqlite_uri(out / "mlflow.db"), steps=2, eval__max_batches=1)
    (out / "cfg.yaml").write_text(to_yaml(cfg))
    return ["pretrain", "--config", str(out / "cfg.yaml"), "only_phase=phase1"]


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def _wait(procs: dict[Path, subprocess.Popen[bytes]]) -> None:
    try:
        for log, proc in procs.items():
            rc = proc.wait(timeout=300)
            assert rc == 0, f"{log}: exit {rc}\n{log.read_text()[-3000:]}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()


def _assert_one_two_rank_job(out: Path, rank0_log: str, launcher_line: str) -> None:
    folder = out / "run" / "checkpoints"
    assert (folder / "latest").read_text() == "global_step2"
    state, _ = ckpt.read_state(str(folder), "global_step2", 0)
    assert state.world_size == 2
    # both ranks wrote their part of the one checkpoint
    assert sorted(p.name for p in (folder / "global_step2").glob("bertpipe_rank*.json")) == [
        "bertpipe_rank00000.json",
        "bertpipe_rank00001.json",
    ]
    history = _history(sqlite_uri(out / "mlflow.db"), state.mlflow_run_id, "train/loss")
    assert [step for step, _ in history] == [1, 2]
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["phase1"]["steps"] == 2
    assert launcher_line in rank0_log, rank0_log[-3000:]


def test_mpirun_environment_forms_one_job(pretrain_shards: Path, tmp_path: Path) -> None:
    """Two processes with OpenMPI's variables form one 2-rank job (srun's variables, and
    torchrun: across two test hosts, tests/multihost/test_launch_paths.py)."""
    bertpipe = str(BIN / "bertpipe")
    assert Path(bertpipe).exists(), "bertpipe must be installed (make install)"
    mpi_port = _free_port(40000, 50000)
    procs: dict[Path, subprocess.Popen[bytes]] = {}
    job = tmp_path / "mpirun"
    cmd = [bertpipe, *_job(pretrain_shards, job)]
    for rank in (0, 1):
        extra = {
            "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "MASTER_PORT": str(mpi_port),  # `mpirun -x MASTER_PORT=...`
        }
        log = job / f"log{rank}"
        procs[log] = _start(cmd, _child_env(extra), log)
    _wait(procs)
    _assert_one_two_rank_job(
        job,
        (job / "log0").read_text(),
        f"launcher: mpirun (OpenMPI), rank 0 of 2, local 0, master 127.0.0.1:{mpi_port}",
    )


def test_multi_task_batch_script_is_refused(pretrain_shards: Path, tmp_path: Path) -> None:
    """`bertpipe pretrain` in the batch script of a multi-task allocation: one line, exit 2,
    nothing written."""
    env = _child_env({"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "8", "SLURM_PROCID": "0"})
    result = subprocess.run(
        [str(BIN / "bertpipe"), *_job(pretrain_shards, tmp_path / "job")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("bertpipe: error:")]
    assert len(errors) == 1 and "SLURM_NTASKS=8" in errors[0] and "srun" in errors[0]
    assert not (tmp_path / "job" / "run").exists()
