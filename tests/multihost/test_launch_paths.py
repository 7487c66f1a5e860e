"""One 2-rank pre-training job with its ranks on two hosts, under each launch path.

The hosts are network namespaces (:mod:`tests.netns`): 192.0.2.1 and 192.0.2.2, one rank
each, talking only over their link. Every path must train the same steps as two ranks on one
host (the reference: ``deepspeed --num_gpus 2`` on host 1), bit for bit; rank i must be
found running on host i, and rank 0 logs where it sits (``launcher: ..., rank 0 of 2, ...,
master 192.0.2.1:PORT``).

- torchrun with the c10d rendezvous on host 1, started on both hosts;
- ``deepspeed --no_ssh --node_rank N`` on both hosts (Kubernetes, SLURM one task per node);
- srun's environment: ``bertpipe pretrain`` started directly on both hosts with the variables
  srun gives each task (the node list holds addresses: the test cannot edit /etc/hosts);
- ``deepspeed --hostfile`` from host 1 with its default runner, pdsh over ssh, to an sshd on
  each host.

Ports are fixed: each test's namespaces are private to its pytest worker.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from filelock import FileLock

from bertpipe.config import to_yaml
from bertpipe.training import checkpoint as ckpt
from tests.conftest import sqlite_uri
from tests.netns import NetnsUnavailableError, SshKeys, TestHosts, host_names, start_sshd
from tests.training.test_pretrain import _cfg, _env, _history

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.multihost]

BIN = Path(sys.executable).parent  # the environment's scripts, activated or not
STEPS = 3
MASTER = "192.0.2.1"
TIMEOUT_S = 240  # per launch; a hung rendezvous fails the test instead of the suite
_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "I_MPI_", "TORCHELASTIC_")
_LAUNCHER_NAMES = {"GROUP_RANK", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE"}
_PLACEMENT = re.compile(
    r"^(?:(?P<node>\S+): )?.*launcher: (?P<launcher>[^,]+), rank (?P<rank>\d+) of (?P<world>\d+),"
    r" local (?P<local>\d+), master (?P<addr>[^:\s]+):(?P<port>\d+)",
    re.MULTILINE,
)

Losses = list[tuple[int, float]]


def _host_env(**extra: str) -> dict[str, str]:
    """A rank's environment: no launcher's variables from this process, one thread per rank
    (the same in every run: a thread count can change float sums), gloo on the host's link."""
    env = {
        k: v
        for k, v in _env().items()
        if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_NAMES
    }
    return {**env, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0", **extra}


def srun_env(task: int, job_id: int) -> dict[str, str]:
    """Task ``task``'s environment (one rank per host, as ``_host_env``) with the variables
    ``srun --nodes 2 --ntasks-per-node 1`` gives it: the master is the node list's first
    address, the port 20000 + job id % 20000 (addresses: names would need /etc/hosts)."""
    return _host_env(
        SLURM_JOB_ID=str(job_id),
        SLURM_STEP_ID="0",
        SLURM_PROCID=str(task),
        SLURM_LOCALID="0",
        SLURM_NODEID=str(task),
        SLURM_NTASKS="2",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_STEP_TASKS_PER_NODE="1(x2)",
        SLURM_STEP_NODELIST="192.0.2.[1-2]",
        SLURM_JOB_NODELIST="192.0.2.[1-2]",
    )


def _job(shards: Path, out: Path) -> list[str]:
    """``bertpipe pretrain`` of phase 1 for STEPS steps (8 samples per rank and step)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = _cfg(
        shards,
        out / "run",
        sqlite_uri(out / "mlflow.db"),
        steps=STEPS,
        eval__max_batches=1,
        checkpoint__every_steps=1000,
    )
    (out / "cfg.yaml").write_text(to_yaml(cfg))
    return [
        str(BIN / "bertpipe"),
        "pretrain",
        "--config",
        str(out / "cfg.yaml"),
        "only_phase=phase1",
    ]


def _rank_of(pid: int) -> int | None:
    """The rank a process was started as (RANK from torchrun/deepspeed, SLURM_PROCID from
    srun), None for launchers and anything else; read from /proc, so no log is needed."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    if b"pretrain" not in cmdline or not any(a.endswith(b"bertpipe") for a in cmdline):
        return None
    env = dict(item.split(b"=", 1) for item in environ if b"=" in item)
    value = env.get(b"RANK") or env.get(b"SLURM_PROCID")
    return None if value is None else int(value)


def _wait(hosts: TestHosts, procs: dict[Path, subprocess.Popen[bytes]]) -> list[set[int]]:
    """Wait for every process (exit 0 each) within TIMEOUT_S, noting meanwhile which ranks
    run on which host (by namespace); returns those ranks per host."""
    deadline = time.monotonic() + TIMEOUT_S
    ranks: list[set[int]] = [set() for _ in hosts.names]
    while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
        for i, found in enumerate(ranks):
            found.update(r for r in map(_rank_of, hosts.pids(i)) if r is not None)
        time.sleep(0.5)
    failed = {log: p.poll() for log, p in procs.items() if p.poll() != 0}
    if failed:
        for i in range(len(hosts.names)):
            hosts.kill_host(i)
        logs = "\n".join(f"--- {p}:\n{p.read_text()[-2500:]}" for p in procs if p.exists())
        pytest.fail(f"exit status (None: still running after {TIMEOUT_S} s): {failed}\n{logs}")
    return ranks


def _losses(out: Path) -> Losses:
    """train/loss per step from the job's MLflow store, and the checkpoint is a 2-rank one."""
    state, _ = ckpt.read_state(str(out / "run" / "checkpoints"), f"global_step{STEPS}", 0)
    assert state.world_size == 2
    return _history(sqlite_uri(out / "mlflow.db"), state.mlflow_run_id, "train/loss")


def _placements(text: str) -> list[dict[str, str]]:
    return [m.groupdict() for m in _PLACEMENT.finditer(text)]


def _assert_on_two_hosts(
    ranks: list[set[int]],
    logs: Sequence[Path],
    launcher: str,
    port: int,
    nodes: Sequence[str] | None = None,
) -> None:
    """Rank i ran on host i, and every placement line names the launcher, 2 ranks and the
    master 192.0.2.1:PORT, in host i's log (``logs[i]``) or, with ``nodes`` (one log of
    pdsh's output), behind host i's name. Rank 0's line must be there; other ranks log at
    WARNING and above only (``bertpipe.logs.setup_logging``), so theirs is checked if shown."""
    assert ranks == [{0}, {1}], f"ranks seen per host: {ranks}"
    seen = []
    for host, log in enumerate(logs):
        for line in _placements(log.read_text()):
            where = host if nodes is None else nodes.index(line["node"])
            seen.append(line)
            assert where == int(line["rank"]), (log, line)
            assert (line["launcher"], line["world"]) == (launcher, "2"), (log, line)
            assert (line["addr"], line["port"]) == (MASTER, str(port)), (log, line)
    assert "0" in [line["rank"] for line in seen], [str(p) for p in logs]


def _shards_key(shards: Path) -> str:
    digest = hashlib.sha256(f"steps={STEPS}".encode())
    for path in sorted((shards / "seq64").glob("*.tar")):  # the manifest names local paths
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


@pytest.fixture(autouse=True)
def _clean_hosts(netns_hosts: TestHosts) -> Iterator[None]:
    """Whatever a test started on the hosts ends with it."""
    yield
    for i in range(len(netns_hosts.names)):
        netns_hosts.kill_host(i)


@pytest.fixture(scope="module")
def reference(
    netns_hosts: TestHosts, pretrain_shards: Path, tmp_path_factory: pytest.TempPathFactory
) -> Losses:
    """The losses of 2 ranks on host 1 alone (``torchrun --nproc_per_node 2``). Computed once
    per test run: pytest-xdist workers share it through the run's temporary folder when their
    shards are byte-identical."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    result = shared / f"multihost-reference-{_shards_key(pretrain_shards)}.json"
    with FileLock(str(result) + ".lock", timeout=2 * TIMEOUT_S):
        if result.exists():
            return [(step, loss) for step, loss in json.loads(result.read_text())]
        out = tmp_path_factory.mktemp("reference")
        # torchrun: the ranks are the same; two interpreter start-ups fewer than deepspeed's
        cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", "29500"]
        log = out / "log"
        proc = netns_hosts.popen(
            0,
            [*cmd, *_job(pretrain_shards, out)],
            env=_host_env(GLOO_SOCKET_IFNAME="lo"),
            log=log,
            cwd=out,
        )
        _wait(netns_hosts, {log: proc})
        losses = _losses(out)
        assert [step for step, _ in losses] == list(range(1, STEPS + 1))
        result.write_text(json.dumps(losses))
        return losses


def test_hosts_reach_each_other_only(netns_hosts: TestHosts) -> None:
    """The test hosts: each reaches the other, no route leads elsewhere, an unplugged link
    cuts a host off, and killing a host ends what runs there."""
    connect = (
        "import socket, sys\n"
        "try:\n    socket.create_connection((sys.argv[1], 9), timeout=1)\n"
        "except ConnectionRefusedError:\n    print('refused')\n"  # reached: nothing listens
        "except OSError as err:\n    print(type(err).__name__)\n"
    )
    env = _host_env()

    def reach(host: int, addr: str) -> str:
        return netns_hosts.run(host, [sys.executable, "-c", connect, addr], env=env).stdout.strip()

    assert reach(1, MASTER) == "refused" and reach(0, "192.0.2.2") == "refused"
    routes = netns_hosts.run(0, ["ip", "route", "show", "table", "all"], env=env).stdout
    assert "default" not in routes, routes
    assert reach(0, "198.51.100.1") != "refused"  # another network: no route
    netns_hosts.link_down(1)
    try:
        assert reach(0, "192.0.2.2") != "refused"
    finally:
        netns_hosts.link_up(1)
    sleeper = netns_hosts.popen(1, ["sleep", "60"], env=env)
    entered = time.monotonic() + 5  # `ip netns exec` enters the namespace, then execs sleep
    while sleeper.pid not in netns_hosts.pids(1) and time.monotonic() < entered:
        time.sleep(0.05)
    assert sleeper.pid in netns_hosts.pids(1) and sleeper.pid not in netns_hosts.pids(0)
    netns_hosts.kill_host(1)
    assert sleeper.poll() is not None and netns_hosts.pids(1) == []
    deadline = time.monotonic() + 10  # the link is back
    while reach(0, "192.0.2.2") != "refused":
        assert time.monotonic() < deadline, "192.0.2.2 unreachable after link_up"


def test_torchrun_c10d_rendezvous(
    netns_hosts: TestHosts, reference: Losses, pretrain_shards: Path, tmp_path: Path
) -> None:
    """``torchrun --nnodes 2 --rdzv-backend c10d`` on each host; host 1 holds the rendezvous
    store (``is_host``: its address is not what its host name resolves to) and gives its
    address as the master (``--local-addr``)."""
    job = _job(pretrain_shards, tmp_path)
    procs = {}
    for i, addr in enumerate(netns_hosts.addrs):
        cmd = [
            str(BIN / "torchrun"),
            "--nnodes", "2",
            "--nproc_per_node", "1",
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{MASTER}:29400",
            "--rdzv-id", "bertpipe-multihost",
            "--rdzv-conf", f"is_host={int(i == 0)}",
            "--local-addr", addr,
            *job,
        ]  # fmt: skip
        log = tmp_path / f"host{i}.log"
        procs[log] = netns_hosts.popen(i, cmd, env=_host_env(), log=log, cwd=tmp_path)
    ranks = _wait(netns_hosts, procs)
    _assert_on_two_hosts(ranks, list(procs), "torchrun", _master_port(next(iter(procs))))
    assert _losses(tmp_path) == reference


def _master_port(log: Path) -> int:
    """The port rank 0 logged (torchrun picks a free one for the job's own store)."""
    return int(_placements(log.read_text())[0]["port"])


def test_deepspeed_no_ssh_node_rank(
    netns_hosts: TestHosts, reference: Losses, pretrain_shards: Path, tmp_path: Path
) -> None:
    """``deepspeed --no_ssh --node_rank N`` on each host, as a Kubernetes pod or one SLURM
    task per node runs it."""
    job = _job(pretrain_shards, tmp_path)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{n} slots=1\n" for n in host_names(netns_hosts)))
    procs = {}
    for i in range(2):
        cmd = [
            str(BIN / "deepspeed"),
            "--hostfile", str(hostfile),
            "--no_ssh",
            "--node_rank", str(i),
            "--num_nodes", "2",
            "--num_gpus", "1",
            "--master_addr", MASTER,
            "--master_port", "29501",
            *job,
        ]  # fmt: skip
        log = tmp_path / f"host{i}.log"
        procs[log] = netns_hosts.popen(i, cmd, env=_host_env(), log=log, cwd=tmp_path)
    ranks = _wait(netns_hosts, procs)
    _assert_on_two_hosts(ranks, list(procs), "deepspeed", 29501)
    assert _losses(tmp_path) == reference


def test_srun_environment(
    netns_hosts: TestHosts, reference: Losses, pretrain_shards: Path, tmp_path: Path
) -> None:
    """``bertpipe pretrain`` itself on each host with the variables ``srun --nodes 2
    --ntasks-per-node 1`` gives each task: the master is the node list's first host, the
    port 20000 + SLURM_JOB_ID % 20000. The node list holds the hosts' addresses (names
    would need /etc/hosts entries)."""
    job = _job(pretrain_shards, tmp_path)
    procs = {}
    for i in range(2):
        log = tmp_path / f"host{i}.log"
        procs[log] = netns_hosts.popen(i, job, env=srun_env(i, 4242), log=log, cwd=tmp_path)
    ranks = _wait(netns_hosts, procs)
    _assert_on_two_hosts(ranks, list(procs), "srun", 24242)
    assert _losses(tmp_path) == reference


def test_deepspeed_hostfile_over_pdsh_and_ssh(
    netns_hosts: TestHosts, reference: Losses, pretrain_shards: Path, tmp_path: Path
) -> None:
    """``deepspeed --hostfile`` on host 1 reaches both hosts with pdsh over ssh (an sshd on
    each host, keys made here). The remote ranks get only what DeepSpeed exports: PYTHON*,
    MLFLOW* and the lines of its environment file (``DS_ENV_FILE``)."""
    if shutil.which("pdsh") is None or shutil.which("ssh") is None:
        pytest.skip("pdsh and an ssh client are needed (apt-get install pdsh openssh-client)")
    try:
        keys = SshKeys(tmp_path / "ssh", netns_hosts)
    except NetnsUnavailableError as err:
        pytest.skip(str(err))
    for i in range(2):
        start_sshd(netns_hosts, i, keys)
    # `ssh` as DeepSpeed's reachability check and pdsh call it, with the test's client config
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "ssh").write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {keys.client_config} "$@"\n')
    (tools / "ssh").chmod(0o755)
    remote = _host_env()
    ds_env = tmp_path / "deepspeed_env"
    ds_env.write_text(
        "".join(
            f"{k}={remote[k]}\n"
            for k in (
                "DS_ACCELERATOR",
                "TORCH_EXTENSIONS_DIR",
                "TOKENIZERS_PARALLELISM",
                "OMP_NUM_THREADS",
                "GLOO_SOCKET_IFNAME",
                "PATH",  # the environment's ninja first, as where the CPU op was built
            )
            if k in remote
        )
    )
    hostfile = tmp_path / "hostfile"
    nodes = host_names(netns_hosts)
    hostfile.write_text("".join(f"{n} slots=1\n" for n in nodes))
    job = _job(pretrain_shards, tmp_path)
    cmd = [
        str(BIN / "deepspeed"),
        "--hostfile", str(hostfile),
        "--master_addr", MASTER,
        "--master_port", "29502",
        *job,
    ]  # fmt: skip
    env = _host_env(
        PATH=f"{tools}{os.pathsep}{remote['PATH']}",
        DS_ENV_FILE=str(ds_env),
        PDSH_RCMD_TYPE="ssh",
    )
    log = tmp_path / "launcher.log"
    procs = {log: netns_hosts.popen(0, cmd, env=env, log=log, cwd=tmp_path)}
    ranks = _wait(netns_hosts, procs)
    _assert_on_two_hosts(ranks, [log], "deepspeed", 29502, nodes=nodes)
    assert _losses(tmp_path) == reference
