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


@pytest.mark.integration
@pytest.mark.slow
def test_a_frozen_rank_ends_the_job_with_75_and_the_restart_resumes_exactly(
    pretrain_shards: Path, tmp_path: Path
) -> None:
    """Rank 1 of 2 is frozen (SIGSTOP: its process, threads and sockets silent, as behind a
    link that went down) after checkpoint 4: rank 0, stuck in the step's collective, names
    it and exits 75 within the timeout; the relaunch resumes from global_step4 bit for bit."""
    import psutil

    cfg, uri = _setup(pretrain_shards, tmp_path)
    deepspeed = str(Path(sys.executable).parent / "deepspeed")
    bertpipe = str(Path(sys.executable).parent / "bertpipe")
    cmd = [deepspeed, "--num_gpus", "2", "--master_port", str(free_port()), bertpipe,
           "pretrain", "--config", str(cfg), "only_phase=phase1", "zero.stage=1",
           "distributed.peer_timeout_s=6"]  # fmt: skip
    folder = tmp_path / "run" / "checkpoints"
    log_path = tmp_path / "log"
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
        assert proc.wait(timeout=60) == 75, log_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert 6 <= named < 6 + 10, named
    text = log_path.read_text()
    line = next(x for x in text.splitlines() if "bertpipe: error: rank 0: lost rank 1" in x)
    assert "no heartbeat" in line and "distributed.peer_timeout_s=6" in line
    assert ckpt.latest_tag(str(folder)) == "global_step4"
    again = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:]
    _losses_twice_equal(uri, folder, first_logged=0)
