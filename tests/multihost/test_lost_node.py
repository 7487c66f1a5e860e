"""A lost node, across two test hosts, at ZeRO stage 3: host 2's link goes down in the
middle of a phase; the rank on host 1 names it and exits 75 within
``distributed.peer_timeout_s``; both hosts relaunched resume from ``latest`` bit for bit; and
``export`` gathers the stage-3 partitions into the logits of the same training at stage 0.

The first run has ``deepspeed --no_ssh --node_rank N`` on each host (one rank each, AdamW,
fp32): the exit status 75 must come through DeepSpeed's launcher. The two resumes start
``bertpipe pretrain`` directly on each host with the variables ``srun`` gives a task, as a
requeued SLURM job does (two interpreters fewer per host than DeepSpeed's launcher, which
``tests/multihost/test_launch_paths.py`` covers). The checkpoint folder is shared (one
machine), as a shared filesystem or object storage is.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from bertpipe.config import to_yaml
from bertpipe.training import checkpoint as ckpt
from tests.conftest import free_port, sqlite_uri
from tests.multihost.test_launch_paths import BIN, MASTER, TIMEOUT_S, _host_env, srun_env
from tests.netns import TestHosts, host_names
from tests.training.test_crash_faults import _losses_twice_equal
from tests.training.test_pretrain import _cfg, _env

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.multihost]

PEER_TIMEOUT_S = 6


def _config(shards: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cfg = _cfg(
        shards,
        out / "run",
        sqlite_uri(out / "mlflow.db"),
        steps=8,
        checkpoint__every_steps=4,
        checkpoint__keep_last=5,
        eval__max_batches=1,
    )
    path = out / "cfg.yaml"
    path.write_text(to_yaml(cfg))
    return path


def _start(
    hosts: TestHosts, cfg: Path, out: Path, tag: str, *extra: str
) -> dict[int, subprocess.Popen]:  # type: ignore[type-arg]
    hostfile = out / "hostfile"
    hostfile.write_text("".join(f"{n} slots=1\n" for n in host_names(hosts)))
    port = str(free_port())
    procs = {}
    for i in range(2):
        cmd = [str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh",
               "--node_rank", str(i), "--num_nodes", "2", "--num_gpus", "1",
               "--master_addr", MASTER, "--master_port", port,
               str(BIN / "bertpipe"), "pretrain", "--config", str(cfg), "only_phase=phase1",
               "zero.stage=3", f"distributed.peer_timeout_s={PEER_TIMEOUT_S}", *extra]  # fmt: skip
        procs[i] = hosts.popen(i, cmd, env=_host_env(), log=out / f"{tag}-host{i}.log", cwd=out)
    return procs


def _start_as_srun(
    hosts: TestHosts, cfg: Path, out: Path, tag: str, job_id: int, *extra: str
) -> dict[int, subprocess.Popen]:  # type: ignore[type-arg]
    """The job relaunched as ``srun --nodes 2 --ntasks-per-node 1`` starts it: each task is
    ``bertpipe pretrain`` itself with srun's variables (the master is the node list's first
    address, the port 20000 + job id % 20000)."""
    procs = {}
    for i in range(2):
        cmd = [str(BIN / "bertpipe"), "pretrain", "--config", str(cfg), "only_phase=phase1",
               "zero.stage=3", f"distributed.peer_timeout_s={PEER_TIMEOUT_S}", *extra]  # fmt: skip
        procs[i] = hosts.popen(
            i, cmd, env=srun_env(i, job_id), log=out / f"{tag}-host{i}.log", cwd=out
        )
    return procs


def test_lost_node_exits_75_and_zero3_resumes_and_exports(
    netns_hosts: TestHosts, pretrain_shards: Path, tmp_path: Path
) -> None:
    import torch

    hosts = netns_hosts
    cfg = _config(pretrain_shards, tmp_path)
    folder = tmp_path / "run" / "checkpoints"
    procs = _start(hosts, cfg, tmp_path, "first")
    log0 = tmp_path / "first-host0.log"
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while ckpt.latest_tag(str(folder)) != "global_step4":
            assert all(p.poll() is None for p in procs.values()), log0.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.2)
        hosts.link_down(1)  # host 2 unplugged in the middle of step 5 or 6
        cut = time.monotonic()
        code = procs[0].wait(timeout=PEER_TIMEOUT_S + 60)
        named = time.monotonic() - cut
    finally:
        hosts.kill_host(1)  # what the scheduler does with the lost node
        hosts.kill_host(0)
        hosts.link_up(1)
    text = log0.read_text()
    assert code == 75, text[-3000:]
    assert PEER_TIMEOUT_S <= named < PEER_TIMEOUT_S + 40, named
    line = next(x for x in text.splitlines() if "bertpipe: error: rank 0: lost rank 1 on" in x)
    assert "(192.0.2.2)" in line and f"distributed.peer_timeout_s={PEER_TIMEOUT_S}" in line
    assert ckpt.latest_tag(str(folder)) == "global_step4"  # nothing half-saved is used

    shutil.copytree(folder, tmp_path / "flap" / "checkpoints")  # latest: global_step4
    again = _start_as_srun(hosts, cfg, tmp_path, "again", 4301)
    for i, proc in again.items():
        assert proc.wait(timeout=TIMEOUT_S) == 0, (tmp_path / f"again-host{i}.log").read_text()[
            -3000:
        ]
    names = {p.name for p in (folder / "global_step8").iterdir()}
    assert {f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (0, 1)} <= names
    _losses_twice_equal(sqlite_uri(tmp_path / "mlflow.db"), folder, first_logged=0, last_step=8)

    # the same resume, host 2's link down for 0.6 x peer_timeout_s in the middle: survived,
    # steps 5-8 bit-equal to the resume above (both log into the checkpoint's MLflow run)
    flap = _start_as_srun(hosts, cfg, tmp_path, "flap", 4302, f"output={tmp_path / 'flap'}")
    log_flap = tmp_path / "flap-host0.log"
    deadline = time.monotonic() + TIMEOUT_S
    while "step 5/8" not in (log_flap.read_text() if log_flap.exists() else ""):
        assert all(p.poll() is None for p in flap.values()), log_flap.read_text()[-3000:]
        assert time.monotonic() < deadline, "the resumed run did not reach step 5"
        time.sleep(0.05)
    hosts.link_down(1)
    time.sleep(0.6 * PEER_TIMEOUT_S)
    hosts.link_up(1)
    for i, proc in flap.items():
        text = (tmp_path / f"flap-host{i}.log").read_text()
        assert proc.wait(timeout=TIMEOUT_S) == 0, text[-3000:]
    host2 = (tmp_path / "flap-host1.log").read_text()
    assert "the job's store at" in host2 and "answers again after" in host2  # it was cut off
    _losses_twice_equal(
        sqlite_uri(tmp_path / "mlflow.db"), tmp_path / "flap" / "checkpoints", 4, last_step=8
    )

    # the same training at stage 0 (2 ranks on one host): export gives the same logits
    zero0 = tmp_path / "zero0"
    cfg0 = _config(pretrain_shards, zero0)
    torchrun = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port())]
    done = subprocess.run(
        [*torchrun, str(BIN / "bertpipe"), "pretrain", "--config", str(cfg0),
         "only_phase=phase1", "zero.stage=0"],
        env={**_env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    logits = [
        _export_logits(f, tmp_path / f"hf{i}")
        for i, f in enumerate((folder, zero0 / "run" / "checkpoints"))
    ]
    assert torch.allclose(logits[0], logits[1], atol=2e-4, rtol=1e-4), (
        (logits[0] - logits[1]).abs().max()
    )


def _export_logits(folder: Path, out: Path):  # type: ignore[no-untyped-def]
    """``export`` of ``folder``'s latest checkpoint, loaded back: its MLM logits on a fixed
    batch."""
    import torch

    from bertpipe.training.export import export_checkpoint
    from bertpipe.training.models.bert.model import BertForPreTraining
    from bertpipe.training.models.hf import load_hf_folder, load_into

    export_checkpoint(str(folder), str(out), track=False)
    model_cfg, weights = load_hf_folder(out)
    model = BertForPreTraining(model_cfg)
    load_into(model, weights)
    model.eval()
    ids = torch.randint(
        5, model_cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).mlm_logits
