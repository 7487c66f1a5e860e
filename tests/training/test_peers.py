"""A lost rank ends the job with exit 75 within ``distributed.peer_timeout_s`` instead of a
hang until the process group's timeout (:mod:`bertpipe.training.peers`)."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bertpipe.training import checkpoint as ckpt
from bertpipe.training.peers import PeerMonitor
from tests.conftest import free_port
from tests.training.test_crash_faults import _losses_twice_equal, _setup
from tests.training.test_pretrain import _env


def _store(port: int):  # the job's rendezvous store, as rank 0 hosts it
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=10),
        wait_for_workers=False,
    )  # fmt: skip


def test_a_silent_peer_is_named_within_the_timeout() -> None:
    port = free_port()
    store = _store(port)
    monitors = [PeerMonitor(r, 3, 2.0, "127.0.0.1", port, exit=False) for r in range(3)]
    for m in monitors:
        m.start()
    try:
        time.sleep(1.0)
        assert not any(m.found.is_set() for m in monitors)  # all beating
        monitors[2].stop()  # done: not lost
        silent = time.monotonic()
        monitors[1]._stop.set()  # its thread stops beating, as a frozen or dead process's
        assert monitors[0].found.wait(10)
        assert 2.0 <= time.monotonic() - silent < 6.0
        lost = monitors[0].lost
        assert lost is not None and lost.rank == 1 and "no heartbeat" in lost.why
        line = lost.line(0, 2.0)
        assert line.startswith("rank 0: lost rank 1 on ") and "exiting with status 75" in line
    finally:
        for m in monitors:
            m.stop()
        del store


def test_a_store_that_stops_answering_is_rank_0_lost() -> None:
    port = free_port()
    store = _store(port)
    monitor = PeerMonitor(1, 2, 2.0, "127.0.0.1", port, exit=False)
    monitor.start()
    try:
        del store  # rank 0's process (and the store it hosts) is gone
        assert monitor.found.wait(10)
        assert monitor.lost is not None and monitor.lost.rank == 0
        assert "does not answer" in monitor.lost.why
    finally:
        monitor.stop()


def _launch(cfg: Path, *extra: str) -> list[str]:
    deepspeed = str(Path(sys.executable).parent / "deepspeed")
    bertpipe = str(Path(sys.executable).parent / "bertpipe")
    return [deepspeed, "--num_gpus", "2", "--master_port", str(free_port()), bertpipe,
            "pretrain", "--config", str(cfg), "only_phase=phase1", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def zero3_lost_rank(pretrain_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:  # type: ignore[type-arg]
    """A 2-rank ZeRO-3 run (AdamW) whose rank 1 is frozen (SIGSTOP: its process, threads and
    sockets silent, as behind a link that went down) after checkpoint 4, then relaunched."""
    import psutil

    tmp = tmp_path_factory.mktemp("zero3-lost-rank")
    cfg, uri = _setup(pretrain_shards, tmp)
    cmd = _launch(cfg, "zero.stage=3", "distributed.peer_timeout_s=6")
    folder = tmp / "run" / "checkpoints"
    log_path = tmp / "log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 300
        while ckpt.latest_tag(str(folder)) != "global_step4":
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.2)
        ranks = {
            a.removeprefix("--local_rank="): p
            for p in psutil.Process(proc.pid).children(recursive=True)
            for a in p.cmdline() if a.startswith("--local_rank=")
        }  # fmt: skip
        assert set(ranks) == {"0", "1"}, ranks
        os.kill(ranks["1"].pid, signal.SIGSTOP)
        frozen = time.monotonic()
        while "lost rank 1" not in log_path.read_text():
            assert time.monotonic() - frozen < 60, log_path.read_text()[-3000:]
            time.sleep(0.2)
        named = time.monotonic() - frozen
        ranks["0"].wait(timeout=30)  # rank 0 ended (75, as the launcher reports below)
        os.kill(ranks["1"].pid, signal.SIGKILL)  # what the scheduler does with the lost node
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    latest = ckpt.latest_tag(str(folder))
    again = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    return {
        "code": code, "named": named, "log": log_path.read_text(), "latest": latest,
        "again": again, "folder": folder, "uri": uri, "cfg": cfg,
    }  # fmt: skip


@pytest.mark.integration
@pytest.mark.slow
def test_a_frozen_rank_ends_the_job_with_75_and_the_restart_resumes_exactly(
    zero3_lost_rank: dict,  # type: ignore[type-arg]
) -> None:
    """Rank 0, stuck in the step's collective, names the frozen rank and exits 75 within the
    timeout; the relaunch resumes from global_step4 and re-runs steps 5-8 bit for bit, at
    ZeRO stage 3 (every rank's own partition of the parameters saved and loaded)."""
    run = zero3_lost_rank
    assert run["code"] == 75, run["log"][-3000:]
    assert 6 <= run["named"] < 6 + 30, run["named"]  # the timeout, then a busy 2-core host
    line = next(x for x in run["log"].splitlines() if "bertpipe: error: rank 0: lost rank 1" in x)
    assert "no heartbeat" in line and "distributed.peer_timeout_s=6" in line
    assert run["latest"] == "global_step4"
    assert run["again"].returncode == 0, run["again"].stdout[-3000:]
    assert "zero_pp_rank_1_mp_rank_00_model_states.pt" in {
        p.name for p in (run["folder"] / "global_step12").iterdir()
    }  # stage 3: each rank saved its own partition of the weights
    _losses_twice_equal(run["uri"], run["folder"], first_logged=0)


@pytest.mark.integration
@pytest.mark.slow
def test_zero3_export_gathers_the_partitions_and_equals_zero0(
    zero3_lost_rank: dict,  # type: ignore[type-arg]
    tmp_path: Path,
) -> None:
    """``export`` of the ZeRO-3 run (parameters gathered from both ranks' partitions) gives
    the logits of the same training at stage 0, within fp32 reduction-order tolerance."""
    import torch

    from bertpipe.training.export import export_checkpoint
    from bertpipe.training.hf import load_hf_folder, load_into
    from bertpipe.training.model import BertForPreTraining

    run = zero3_lost_rank
    assert run["again"].returncode == 0
    zero0 = tmp_path / "zero0"
    cfg0 = run["cfg"].read_text().replace(f"{run['folder'].parent}", str(zero0))
    (tmp_path / "cfg0.yaml").write_text(cfg0)
    done = subprocess.run(
        _launch(tmp_path / "cfg0.yaml", "zero.stage=0"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    logits = []
    for folder in (run["folder"], zero0 / "checkpoints"):
        out = tmp_path / f"hf-{len(logits)}"
        export_checkpoint(str(folder), str(out), track=False)
        model_cfg, weights = load_hf_folder(out)
        model = BertForPreTraining(model_cfg)
        load_into(model, weights)
        model.eval()
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(5, model_cfg.vocab_size, (2, 12), generator=generator)
        with torch.no_grad():
            logits.append(model(input_ids=ids, attention_mask=torch.ones_like(ids)).mlm_logits)
    assert logits[0].shape == logits[1].shape
    assert torch.allclose(logits[0], logits[1], atol=2e-4, rtol=1e-4), (
        (logits[0] - logits[1]).abs().max()
    )
