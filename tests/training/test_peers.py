"""A lost rank ends the job with exit 75 within ``distributed.peer_timeout_s`` instead of a
hang until the process group's timeout (:mod:`bertpipe.training.core.peers`): the heartbeat on a
real TCPStore. A node lost across two test hosts, with the relaunch: tests/multihost/
test_lost_node.py."""

from __future__ import annotations

import datetime
import time

from bertpipe.training.core.peers import PeerMonitor
from tests.conftest import free_port


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
        assert "has not answered for" in monitor.lost.why
    finally:
        monitor.stop()
