"""Launcher detection (bertpipe.launch): the environments each launcher gives a process."""

from __future__ import annotations

import pytest

from bertpipe.errors import BertpipeError
from bertpipe.launch import Launch, LaunchError, detect_launch, first_host, slurm_port

# what `srun --ntasks-per-node=4 --gpus-per-node=4` (2 nodes) gives task 3
SRUN = {
    "SLURM_JOB_ID": "49512",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "3",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "gpu-[003-005,009],login1",
    "SLURM_STEP_NODELIST": "gpu-[003-004]",
    "SLURM_NODELIST": "gpu-[003-004]",
}
# the batch script of `sbatch --nodes=2 --ntasks-per-node=4`: no step, the allocation's tasks
BATCH = {
    "SLURM_JOB_ID": "49512",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NTASKS": "8",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_JOB_NODELIST": "gpu-[003-004]",
}


def L(  # noqa: N802 - a table row
    launcher: str,
    rank: int,
    world: int,
    local: int,
    local_world: int | None,
    addr: str,
    port: int | None,
) -> Launch:
    return Launch(launcher, rank, world, local, local_world, addr, port)


CASES = {
    # no launcher
    "none": ({}, L("none (one process)", 0, 1, 0, 1, "127.0.0.1", None)),
    "none, port set": (
        {"MASTER_PORT": "1234"},
        L("none (one process)", 0, 1, 0, 1, "127.0.0.1", 1234),
    ),
    "WORLD_SIZE=1 alone": (
        {"WORLD_SIZE": "1"},
        L("none (one process)", 0, 1, 0, 1, "127.0.0.1", None),
    ),
    # RANK / WORLD_SIZE: torchrun, deepspeed, a Kubernetes operator
    "torchrun": (
        {
            "RANK": "5",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "node1",
            "MASTER_PORT": "29400",
            "TORCHELASTIC_RUN_ID": "none",
        },
        L("torchrun", 5, 8, 1, 4, "node1", 29400),
    ),
    "deepspeed": (
        {
            "RANK": "9",
            "WORLD_SIZE": "16",
            "LOCAL_RANK": "1",
            "LOCAL_SIZE": "8",
            "CROSS_RANK": "1",
            "CROSS_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500",
        },
        L("deepspeed", 9, 16, 1, 8, "10.0.0.1", 29500),
    ),
    "one process per pod, no LOCAL_RANK": (
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "job-0.svc", "MASTER_PORT": "23456"},
        L("environment (RANK/WORLD_SIZE)", 1, 2, 0, None, "job-0.svc", 23456),
    ),
    "RANK=0 WORLD_SIZE=1": (
        {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"},
        L("environment (RANK/WORLD_SIZE)", 0, 1, 0, 1, "127.0.0.1", None),
    ),
    # torchrun started by srun, one task per node: RANK wins over SLURM_PROCID
    "torchrun under srun": (
        {
            **SRUN,
            "SLURM_PROCID": "1",
            "SLURM_NTASKS": "2",
            "SLURM_STEP_NUM_TASKS": "2",
            "RANK": "12",
            "WORLD_SIZE": "16",
            "LOCAL_RANK": "4",
            "LOCAL_WORLD_SIZE": "8",
            "MASTER_ADDR": "gpu-003",
            "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "49512",
        },
        L("torchrun", 12, 16, 4, 8, "gpu-003", 29500),
    ),
    # the deepspeed launcher from a multi-task batch script: its ranks have RANK
    "deepspeed in a batch script": (
        {
            **BATCH,
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "3",
            "LOCAL_SIZE": "8",
            "CROSS_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
        },
        L("deepspeed", 3, 8, 3, 8, "127.0.0.1", 29500),
    ),
    # srun, one task per GPU
    "srun": (SRUN, L("srun", 3, 8, 3, 4, "gpu-003", 29512)),
    "srun, MASTER_ADDR/PORT given": (
        {**SRUN, "MASTER_ADDR": "ib-gpu-003", "MASTER_PORT": "31000"},
        L("srun", 3, 8, 3, 4, "ib-gpu-003", 31000),
    ),
    "srun, step smaller than the allocation": (
        {**SRUN, "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "8"},
        L("srun", 3, 8, 3, 4, "gpu-003", 29512),
    ),
    "srun, job node list only, several groups": (
        {k: v for k, v in SRUN.items() if k not in ("SLURM_STEP_NODELIST", "SLURM_NODELIST")},
        L("srun", 3, 8, 3, 4, "gpu-003", 29512),
    ),
    "srun, two-dimensional host list": (
        {**SRUN, "SLURM_STEP_NODELIST": "rack[07-08]-n[0010-0012,0020]"},
        L("srun", 3, 8, 3, 4, "rack07-n0010", 29512),
    ),
    "srun, uneven tasks per node": (
        {
            **SRUN,
            "SLURM_PROCID": "6",
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": "3",
            "SLURM_NTASKS": "7",
            "SLURM_STEP_NUM_TASKS": "7",
            "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
            "SLURM_NTASKS_PER_NODE": "",
        },
        L("srun", 6, 7, 0, 1, "gpu-003", 29512),
    ),
    "srun, tasks per node unknown": (
        {
            k: v
            for k, v in SRUN.items()
            if k not in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
        },
        L("srun", 3, 8, 3, None, "gpu-003", 29512),
    ),
    "srun, PMIx plugin (MpiDefault=pmix)": (
        {**SRUN, "PMIX_RANK": "3", "PMIX_NAMESPACE": "slurm.pmix.49512.0"},
        L("srun", 3, 8, 3, 4, "gpu-003", 29512),
    ),
    "srun --mpi=pmi2": (
        {**SRUN, "PMI_RANK": "3", "PMI_SIZE": "8", "PMI_FD": "5"},
        L("srun", 3, 8, 3, 4, "gpu-003", 29512),
    ),
    "srun -n1": (
        {
            **SRUN,
            "SLURM_PROCID": "0",
            "SLURM_LOCALID": "0",
            "SLURM_NTASKS": "1",
            "SLURM_STEP_NUM_TASKS": "1",
        },
        L("none (one process)", 0, 1, 0, 1, "127.0.0.1", None),
    ),
    "srun -n1, PMIx plugin": (
        {
            **SRUN,
            "SLURM_PROCID": "0",
            "SLURM_LOCALID": "0",
            "SLURM_NTASKS": "1",
            "SLURM_STEP_NUM_TASKS": "1",
            "PMIX_RANK": "0",
        },
        L("srun", 0, 1, 0, 1, "127.0.0.1", None),
    ),
    "batch script, one task": (
        {**BATCH, "SLURM_NTASKS": "1"},
        L("none (one process)", 0, 1, 0, 1, "127.0.0.1", None),
    ),
    "batch script, no task count": (
        {k: v for k, v in BATCH.items() if k != "SLURM_NTASKS"},
        L("none (one process)", 0, 1, 0, 1, "127.0.0.1", None),
    ),
    # OpenMPI
    "OpenMPI, one node": (
        {
            "OMPI_COMM_WORLD_RANK": "1",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        },
        L("mpirun (OpenMPI)", 1, 4, 1, 4, "127.0.0.1", 29500),
    ),
    "OpenMPI, two nodes, -x MASTER_ADDR -x MASTER_PORT": (
        {
            "OMPI_COMM_WORLD_RANK": "9",
            "OMPI_COMM_WORLD_SIZE": "16",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "8",
            "PMIX_RANK": "9",
            "MASTER_ADDR": "node01",
            "MASTER_PORT": "29600",
        },
        L("mpirun (OpenMPI)", 9, 16, 1, 8, "node01", 29600),
    ),
    "OpenMPI in a multi-task batch script": (
        {
            **BATCH,
            "OMPI_COMM_WORLD_RANK": "2",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        },
        L("mpirun (OpenMPI)", 2, 4, 2, 4, "127.0.0.1", 29500),
    ),
    # MPICH and Intel MPI (Hydra)
    "MPICH, one node": (
        {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4"},
        L("mpirun (MPICH)", 2, 4, 2, 4, "127.0.0.1", 29500),
    ),
    "MPICH, two nodes, -genv": (
        {
            "PMI_RANK": "5",
            "PMI_SIZE": "8",
            "MPI_LOCALRANKID": "1",
            "MPI_LOCALNRANKS": "4",
            "MASTER_ADDR": "node01",
        },
        L("mpirun (MPICH)", 5, 8, 1, 4, "node01", 29500),
    ),
    "Intel MPI, two nodes": (
        {
            "PMI_RANK": "7",
            "PMI_SIZE": "8",
            "MPI_LOCALRANKID": "3",
            "MPI_LOCALNRANKS": "4",
            "I_MPI_ROOT": "/opt/intel/mpi",
            "MASTER_ADDR": "node01",
            "MASTER_PORT": "29700",
        },
        L("mpirun (Intel MPI)", 7, 8, 3, 4, "node01", 29700),
    ),
    # PMIx with a known size
    "PMIx": (
        {"PMIX_RANK": "1", "PMIX_SIZE": "2", "PMIX_LOCAL_RANK": "1", "PMIX_LOCAL_SIZE": "2"},
        L("mpirun (PMIx)", 1, 2, 1, 2, "127.0.0.1", 29500),
    ),
}


@pytest.mark.parametrize(("environ", "expected"), CASES.values(), ids=CASES.keys())
def test_detect_launch(environ: dict[str, str], expected: Launch) -> None:
    assert detect_launch(environ) == expected


ERRORS = {
    "WORLD_SIZE without RANK": ({"WORLD_SIZE": "8"}, ["WORLD_SIZE=8", "RANK"]),
    "RANK without WORLD_SIZE": ({"RANK": "1"}, ["RANK=1", "WORLD_SIZE"]),
    "RANK beyond WORLD_SIZE": (
        {"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "a", "MASTER_PORT": "1"},
        ["RANK=4", "WORLD_SIZE=4"],
    ),
    "RANK without MASTER_ADDR": ({"RANK": "1", "WORLD_SIZE": "2"}, ["MASTER_ADDR"]),
    "bad RANK": ({"RANK": "one", "WORLD_SIZE": "2"}, ["RANK='one'"]),
    "SLURM_NTASKS without SLURM_PROCID": (
        {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8"},
        ["SLURM_NTASKS=8", "SLURM_PROCID", "srun"],
    ),
    "multi-task batch script": (
        BATCH,
        ["SLURM_JOB_ID=49512", "SLURM_NTASKS=8", "SLURM_STEP_ID", "batch script", "srun"],
    ),
    "salloc shell": (
        {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[1-2]"},
        ["SLURM_NTASKS=8", "SLURM_STEP_ID", "torchrun/deepspeed"],
    ),
    "srun without SLURM_LOCALID": (
        {k: v for k, v in SRUN.items() if k != "SLURM_LOCALID"},
        ["SLURM_LOCALID"],
    ),
    "srun without a node list": (
        {k: v for k, v in SRUN.items() if not k.endswith("NODELIST")},
        ["MASTER_ADDR"],
    ),
    "OpenMPI size without rank": (
        {"OMPI_COMM_WORLD_SIZE": "4"},
        ["OMPI_COMM_WORLD_SIZE=4", "OMPI_COMM_WORLD_RANK"],
    ),
    "OpenMPI, two nodes, no MASTER_ADDR": (
        {
            "OMPI_COMM_WORLD_RANK": "9",
            "OMPI_COMM_WORLD_SIZE": "16",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "8",
        },
        ["OMPI_COMM_WORLD_SIZE=16", "MASTER_ADDR", "-x MASTER_ADDR", "-genv MASTER_ADDR"],
    ),
    "MPICH size without rank": ({"PMI_SIZE": "4"}, ["PMI_SIZE=4", "PMI_RANK"]),
    "MPICH without a local rank": (
        {"PMI_RANK": "1", "PMI_SIZE": "4", "MASTER_ADDR": "node01"},
        ["MPI_LOCALRANKID"],
    ),
    "PMIx without a size": ({"PMIX_RANK": "1"}, ["PMIX_RANK=1", "world size"]),
}


@pytest.mark.parametrize(("environ", "fragments"), ERRORS.values(), ids=ERRORS.keys())
def test_errors_name_the_variables(environ: dict[str, str], fragments: list[str]) -> None:
    with pytest.raises(LaunchError) as info:
        detect_launch(environ)
    message = str(info.value)
    assert isinstance(info.value, BertpipeError)  # the CLI prints it as one line, exit 2
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [
        ("localhost", "localhost"),
        ("gpu-[003-005,009],login1", "gpu-003"),
        ("login1,gpu-[003-005]", "login1"),
        ("node[09-11]", "node09"),
        ("node[7,3-4]", "node7"),
        ("rack[07-08]-n[0010-0012,0020]", "rack07-n0010"),
        (" n001 ", "n001"),
    ],
)
def test_first_host(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def test_first_host_rejects_garbage() -> None:
    with pytest.raises(LaunchError, match="node list"):
        first_host("gpu-[003")


def test_slurm_port_is_derived_from_the_job() -> None:
    assert slurm_port("49512") == 29512
    assert slurm_port("20000") == 20000
    assert slurm_port("") == 29500
    # every task of a job derives the same port
    tasks = [{**SRUN, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % 4)} for r in range(8)]
    assert {detect_launch(env).master_port for env in tasks} == {29512}


def test_variables_and_description() -> None:
    launch = detect_launch(SRUN)
    assert launch.variables() == {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "3",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu-003",
        "MASTER_PORT": "29512",
    }
    assert launch.describe() == "launcher: srun, rank 3 of 8, local 3, master gpu-003:29512"
    single = detect_launch({})
    with pytest.raises(ValueError):
        single.variables()  # the port is chosen by the caller (a free one)


def test_init_distributed_refuses_before_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check runs before DeepSpeed or a process group are touched."""
    import sys

    from bertpipe.training.core import engine

    for key in list(engine.os.environ):
        if key.startswith(("SLURM_", "OMPI_", "PMI", "MPI_LOCAL")) or key in (
            "RANK",
            "WORLD_SIZE",
        ):
            monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # importing it would fail
    monkeypatch.setattr(engine.dist, "is_initialized", lambda: False)  # as in a fresh process
    with pytest.raises(LaunchError, match="SLURM_NTASKS=8"):
        engine.init_distributed()
