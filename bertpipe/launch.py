"""Which launcher started this process, and where the process sits in the job.

:func:`detect_launch` reads an environment (a mapping, so it is testable without touching
``os.environ``) and returns a :class:`Launch`: the launcher's name and the variables torch's
``env://`` rendezvous needs (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). Precedence, first match wins:

1. ``RANK``/``WORLD_SIZE`` as set by the ``deepspeed`` launcher, torchrun, Kubernetes
   operators, or torchrun/deepspeed started by ``srun`` with one task per node;
2. MPI: OpenMPI (``OMPI_COMM_WORLD_*``), MPICH and Intel MPI's Hydra (``PMI_RANK``,
   ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``), PMIx (``PMIX_RANK``). MPI does
   not say where rank 0 runs: ``MASTER_ADDR`` comes from the environment (``mpirun -x`` /
   ``-genv``) unless every rank is on one node (127.0.0.1); ``MASTER_PORT`` from the
   environment, else 29500. ``PMI_RANK``/``PMIX_RANK`` set by srun's own PMI plugins (same
   rank and size as the SLURM step) count as srun;
3. SLURM, ``srun`` with one task per GPU: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (else
   ``SLURM_NTASKS``), ``SLURM_LOCALID``; MASTER_ADDR is the first host of the step's node
   list, MASTER_PORT ``20000 + SLURM_JOB_ID % 20000`` (so every task agrees without talking);
4. none: one process, rank 0 of 1.

An environment that shows several tasks but gives this process no rank (``SLURM_NTASKS=8``
in a batch script, outside srun; ``WORLD_SIZE=8`` without ``RANK``...) raises
:class:`LaunchError` rather than starting N independent one-process runs that would write
the same checkpoints.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from bertpipe.errors import BertpipeError

__all__ = [
    "DEFAULT_MPI_PORT",
    "Launch",
    "LaunchError",
    "detect_launch",
    "first_host",
    "slurm_port",
]

DEFAULT_MPI_PORT = 29500
"""MASTER_PORT under mpirun when the environment sets none."""

_HINT = (
    "start one task per GPU with srun (srun --ntasks-per-node=GPUS ...), or use "
    "torchrun/deepspeed, or mpirun; or run one process without these variables"
)


class LaunchError(BertpipeError):
    """The environment shows a multi-process launch this process cannot place itself in."""


@dataclass(frozen=True)
class Launch:
    """Where this process sits in the job, and what started it."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None
    master_addr: str
    master_port: int | None
    """None: any free local port (only for a job of one process)."""

    def variables(self) -> dict[str, str]:
        """The environment torch's ``env://`` rendezvous reads (MASTER_PORT must be known)."""
        if self.master_port is None:
            raise ValueError("master_port is not chosen yet")
        out = {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }
        if self.local_world_size is not None:
            out["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        return out

    def describe(self) -> str:
        """``launcher: srun, rank 3 of 8, local 3, master gpu-003:29512``."""
        port = "(free port)" if self.master_port is None else str(self.master_port)
        return (
            f"launcher: {self.launcher}, rank {self.rank} of {self.world_size}, "
            f"local {self.local_rank}, master {self.master_addr}:{port}"
        )


def detect_launch(environ: Mapping[str, str]) -> Launch:
    """The launch ``environ`` describes; raises :class:`LaunchError` when it is ambiguous."""
    env = {k: v.strip() for k, v in environ.items()}
    if "RANK" in env or "WORLD_SIZE" in env:
        launch = _from_rank_variables(env)
        if launch is not None:
            return launch
    mpi = _from_mpi(env)
    if mpi is not None:
        return mpi
    slurm = _from_slurm(env)
    if slurm is not None:
        return slurm
    return _single(env, "none (one process)")


# --- helpers -------------------------------------------------------------------------------


def _int(env: Mapping[str, str], name: str, *, minimum: int = 0) -> int | None:
    """``env[name]`` as an int (None when absent or empty); a malformed value is an error."""
    raw = env.get(name, "")
    if raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise LaunchError(f"{name}={raw} must be >= {minimum}")
    return value


def _first(env: Mapping[str, str], *names: str, minimum: int = 0) -> tuple[str, int] | None:
    """The first of ``names`` that is set: (name, value)."""
    for name in names:
        value = _int(env, name, minimum=minimum)
        if value is not None:
            return name, value
    return None


def _shown(env: Mapping[str, str], names: tuple[str, ...]) -> str:
    seen = [f"{n}={env[n]}" for n in names if env.get(n, "") != ""]
    return ", ".join(seen) if seen else "none of " + "/".join(names)


def _port(env: Mapping[str, str], default: int | None) -> int | None:
    port = _int(env, "MASTER_PORT", minimum=1)
    if port is not None and port > 65535:
        raise LaunchError(f"MASTER_PORT={port} is not a port number")
    return default if port is None else port


def _check_rank(launcher: str, rank_var: str, rank: int, size_var: str, size: int) -> None:
    if size < 1:
        raise LaunchError(f"{launcher}: {size_var}={size} must be >= 1")
    if rank >= size:
        raise LaunchError(f"{launcher}: {rank_var}={rank} is not below {size_var}={size}")


def _single(env: Mapping[str, str], launcher: str) -> Launch:
    """Rank 0 of 1: the environment's MASTER_ADDR/PORT if set, else 127.0.0.1 and a port
    chosen when the store binds it (:func:`bertpipe.training.core.engine.init_distributed`)."""
    return Launch(
        launcher=launcher,
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
        master_port=_port(env, None),
    )


# --- 1. RANK / WORLD_SIZE (deepspeed, torchrun, ...) ---------------------------------------


def _from_rank_variables(env: Mapping[str, str]) -> Launch | None:
    rank = _int(env, "RANK")
    world = _int(env, "WORLD_SIZE", minimum=1)
    if rank is None:
        if world is None or world == 1:
            return None  # WORLD_SIZE=1 alone says nothing: look further
        raise LaunchError(
            f"WORLD_SIZE={world} is set but RANK is not: this process cannot tell its rank; {_HINT}"
        )
    if world is None:
        raise LaunchError(f"RANK={rank} is set but WORLD_SIZE is not; {_HINT}")
    _check_rank("environment", "RANK", rank, "WORLD_SIZE", world)
    if "TORCHELASTIC_RUN_ID" in env:
        launcher = "torchrun"
    elif "CROSS_RANK" in env and "LOCAL_SIZE" in env:
        launcher = "deepspeed"
    else:
        launcher = "environment (RANK/WORLD_SIZE)"
    if world == 1:
        return _single(env, launcher)
    local = _first(env, "LOCAL_WORLD_SIZE", "LOCAL_SIZE", minimum=1)
    local_rank = _int(env, "LOCAL_RANK")
    missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not env.get(n)]
    if missing:
        raise LaunchError(
            f"{launcher}: RANK={rank} of WORLD_SIZE={world} but {' and '.join(missing)} "
            "not set: the launcher sets them (torchrun, deepspeed); set them by hand otherwise"
        )
    return Launch(
        launcher=launcher,
        rank=rank,
        world_size=world,
        # one process per node or pod (e.g. a Kubernetes operator) sets no LOCAL_RANK
        local_rank=0 if local_rank is None else local_rank,
        local_world_size=None if local is None else local[1],
        master_addr=env["MASTER_ADDR"],
        master_port=_port(env, None),
    )


# --- 2. MPI --------------------------------------------------------------------------------

_OMPI = (
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
)
_HYDRA = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
_PMIX = ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE")
# srun's PMI plugins export PMI_RANK/PMIX_RANK, not always a size: the step's task count
_SLURM_SIZES = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
_MPI_HINT = (
    "several nodes under mpirun need the host of rank 0 in MASTER_ADDR (and a free "
    "MASTER_PORT, default 29500) on every rank: OpenMPI `mpirun -x MASTER_ADDR=HOST "
    "-x MASTER_PORT=PORT ...`, MPICH/Intel MPI `mpirun -genv MASTER_ADDR HOST "
    "-genv MASTER_PORT PORT ...`"
)


def _from_mpi(env: Mapping[str, str]) -> Launch | None:
    if any(env.get(n) for n in _OMPI):
        return _mpi(env, "mpirun (OpenMPI)", _OMPI, size_fallback=())
    if env.get("PMI_RANK") or env.get("PMI_SIZE"):
        intel = any(k.startswith("I_MPI_") for k in env)
        name = "mpirun (Intel MPI)" if intel else "mpirun (MPICH)"
        return _mpi(env, name, _HYDRA, size_fallback=_SLURM_SIZES)
    if env.get("PMIX_RANK"):
        return _mpi(env, "mpirun (PMIx)", _PMIX, size_fallback=_SLURM_SIZES)
    return None


def _mpi(
    env: Mapping[str, str], launcher: str, names: tuple[str, ...], size_fallback: tuple[str, ...]
) -> Launch:
    rank_var, size_var, local_rank_var, local_size_var = names
    rank = _int(env, rank_var)
    size_item = _first(env, size_var, *size_fallback, minimum=1)
    slurm = _slurm_step_or_none(env)
    # srun's own PMI/PMIx plugins set these in every task: that is srun, not mpirun
    if (
        rank_var in ("PMI_RANK", "PMIX_RANK")
        and slurm is not None
        and rank == slurm.rank
        and (size_item is None or size_item[1] == slurm.world_size)
    ):
        return slurm
    if rank is None:
        if size_item is not None and size_item[1] > 1:
            raise LaunchError(
                f"{launcher}: {_shown(env, names)}: {size_item[1]} processes but {rank_var} "
                f"is not set, so this process cannot tell its rank; {_HINT}"
            )
        return _single(env, launcher)
    if size_item is None:
        raise LaunchError(
            f"{launcher}: {rank_var}={rank} is set but no world size "
            f"({'/'.join((size_var, *size_fallback))}); set RANK, WORLD_SIZE, LOCAL_RANK, "
            "MASTER_ADDR and MASTER_PORT yourself, or use srun/torchrun/deepspeed"
        )
    size_name, world = size_item
    _check_rank(launcher, rank_var, rank, size_name, world)
    if world == 1:
        in_step = bool(env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"))
        return _single(env, "srun" if in_step and rank_var != _OMPI[0] else launcher)
    local_rank = _int(env, local_rank_var)
    local_world = _int(env, local_size_var, minimum=1)
    if local_rank is None:
        raise LaunchError(
            f"{launcher}: {rank_var}={rank} of {size_name}={world} but no {local_rank_var}: "
            f"cannot tell which device this process uses; {_HINT}"
        )
    if local_world is not None and local_rank >= local_world:
        local_world = None
    one_node = local_world == world
    addr = env.get("MASTER_ADDR") or ("127.0.0.1" if one_node else "")
    if not addr:
        seen = _shown(env, names)
        raise LaunchError(f"{launcher}: {seen} and MASTER_ADDR is not set; {_MPI_HINT}")
    return Launch(
        launcher=launcher,
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        master_addr=addr,
        master_port=_port(env, DEFAULT_MPI_PORT),
    )


# --- 3. SLURM ------------------------------------------------------------------------------

_SLURM_SHOWN = (
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_NTASKS",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_PROCID",
)


def _slurm_step_or_none(env: Mapping[str, str]) -> Launch | None:
    """The srun step's launch when this is one (several tasks), else None; never raises."""
    try:
        launch = _from_slurm(env)
    except LaunchError:
        return None
    return launch if launch is not None and launch.launcher == "srun" else None


def _from_slurm(env: Mapping[str, str]) -> Launch | None:
    if not any(k.startswith("SLURM_") for k in env):
        return None
    in_step = bool(env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"))
    size_names = ("SLURM_NTASKS", "SLURM_NPROCS")
    if in_step:
        size_names = ("SLURM_STEP_NUM_TASKS", *size_names)
    size_item = _first(env, *size_names, minimum=1)
    size_name, world = size_item if size_item is not None else ("SLURM_NTASKS", 1)
    rank = _int(env, "SLURM_PROCID")
    if not in_step:
        if world > 1:
            raise LaunchError(
                f"SLURM: {_shown(env, _SLURM_SHOWN)}: {world} tasks but no SLURM_STEP_ID, so "
                "this is the batch script (or salloc shell) of the allocation, outside srun, "
                f"and cannot tell its rank; {_HINT}"
            )
        return None
    if rank is None:
        if world > 1:
            raise LaunchError(
                f"SLURM: {_shown(env, _SLURM_SHOWN)}: {world} tasks but SLURM_PROCID is not "
                f"set, so this process cannot tell its rank; {_HINT}"
            )
        return None
    if size_item is None and rank > 0:
        raise LaunchError(f"srun: SLURM_PROCID={rank} but no SLURM_NTASKS; {_HINT}")
    _check_rank("srun", "SLURM_PROCID", rank, size_name, world)
    if world == 1:
        return None  # a one-task step (srun -n1, srun --pty bash): one process as usual
    local_rank = _int(env, "SLURM_LOCALID")
    if local_rank is None:
        raise LaunchError(
            f"srun: SLURM_PROCID={rank} of {size_name}={world} but SLURM_LOCALID is not "
            "set: cannot tell which device this process uses"
        )
    local_world = _slurm_local_world(env)
    if local_world is not None and local_rank >= local_world:
        local_world = None
    addr = env.get("MASTER_ADDR", "")
    if not addr:
        for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            if env.get(name):
                addr = first_host(env[name])
                break
    if not addr:
        if local_world != world:
            raise LaunchError(
                "srun: no node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST) to find the "
                "host of rank 0; set MASTER_ADDR"
            )
        addr = "127.0.0.1"
    return Launch(
        launcher="srun",
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        master_addr=addr,
        master_port=_port(env, slurm_port(env.get("SLURM_JOB_ID", ""))),
    )


def slurm_port(job_id: str) -> int:
    """``20000 + job_id % 20000``: a port every task of the job derives alike (29500 without
    a numeric job id)."""
    match = re.match(r"\d+", job_id or "")
    return 20000 + int(match.group()) % 20000 if match else DEFAULT_MPI_PORT


def _slurm_local_world(env: Mapping[str, str]) -> int | None:
    """Tasks on this node: SLURM_STEP_TASKS_PER_NODE (``8(x4),4``: per node of the step, in
    node-list order; this node is SLURM_NODEID), else SLURM_NTASKS_PER_NODE."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        counts = _tasks_per_node(env.get(name, ""))
        if not counts:
            continue
        if len(set(counts)) == 1:
            return counts[0]
        node = env.get("SLURM_NODEID", "")
        if node.isdigit() and int(node) < len(counts):
            return counts[int(node)]
    return None


def _tasks_per_node(value: str) -> list[int]:
    """``2(x3),1`` -> [2, 2, 2, 1]; [] when it does not parse."""
    counts: list[int] = []
    for item in value.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", item)
        if not match:
            return []
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts if all(c > 0 for c in counts) else []


def first_host(nodelist: str) -> str:
    """The first host of a SLURM compressed host list, zero padding kept.

    ``gpu-[003-005,009],login1`` -> ``gpu-003``; ``rack[2-3]-n[08-09]`` -> ``rack2-n08``.
    """
    text = nodelist.strip()
    depth = 0
    for i, char in enumerate(text):  # the first entry: up to a comma outside brackets
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            text = text[:i]
            break

    def first(match: re.Match[str]) -> str:
        return re.split(r"[,-]", match.group(1), maxsplit=1)[0].strip()

    host = re.sub(r"\[([^\]]*)\]", first, text).strip()
    if not host or "[" in host or "]" in host:
        raise LaunchError(f"cannot read the first host of the SLURM node list {nodelist!r}")
    return host
