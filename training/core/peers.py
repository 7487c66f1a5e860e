"""A lost node ends the job with exit status 75 within ``distributed.peer_timeout_s``, not
a hang until the process-group timeout.

When a node dies mid-step, the survivors sit in a collective. gloo and NCCL give up only at
the process group's timeout (30 minutes by default: on 32 nodes 16 GPU-hours per incident,
and no SLURM requeue or k8s restart until then), or at once if the peer's TCP connections
were reset, with an error that names neither the lost rank nor the cure. Lowering the
process-group timeout is no answer: it bounds every collective, including the barrier in
which the other ranks wait while rank 0 writes or uploads a checkpoint for minutes.

So each rank runs a **heartbeat** (:class:`PeerMonitor`): a thread that every
``peer_timeout_s / 20`` increments its key in the job's rendezvous store (the TCPStore at
``MASTER_ADDR:MASTER_PORT`` that every launcher sets up; a separate client connection) and
reads everyone else's. Python threads keep running while the training thread is inside a
collective or a long save, so a rank's heartbeat stops only when its process or its host
does. A peer whose counter has not moved for ``peer_timeout_s`` plus the heartbeat's own
slack (:attr:`PeerMonitor.limit_s`: two beats and two store request timeouts, about ``1.2 x
peer_timeout_s``; judged on this host's own monotonic clock: no clock sync needed), or a
store that has not answered for as long (rank 0's host is the one lost), is a lost peer. A
link that goes down for less than ``peer_timeout_s`` is survived: a store request that timed
out is abandoned with its connection, and the next one goes out on a new connection as soon
as the link is back (not after TCP's retransmission backoff of the old one), so that the
silence the others see stays under the limit. A lost peer: the rank logs one line naming the
lost rank, its host and address, and exits at once with status 75 (``EX_TEMPFAIL``), which
SLURM requeue (``--requeue`` with the sbatch's exit-code handling), a k8s Job's
``podFailurePolicy`` and torchrun ``--max-restarts`` treat as "start it again". The restart
resumes from ``latest``; a checkpoint that was being written is never published (``latest``
moves only after every rank finished it).

A collective that fails at once because a peer's connections closed is reported the same way
(:func:`lost_peer_error`): the trainer asks the monitor which peer is gone, waiting at most
``peer_timeout_s`` for its heartbeat to go stale.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from bertpipe.errors import TransientError

log = logging.getLogger(__name__)

__all__ = ["PeerLostError", "PeerMonitor", "is_comm_error", "lost_peer_error", "watched"]

PREFIX = "bertpipe/peers"
EXIT_CODE = 75
DONE = "done"


class PeerLostError(TransientError):
    """A rank of the job stopped answering: exit 75, the job is restarted from ``latest``."""


@dataclass(frozen=True)
class Lost:
    rank: int
    host: str
    why: str

    def line(self, me: int, timeout: float) -> str:
        return (
            f"rank {me}: lost rank {self.rank} on {self.host}: {self.why} "
            f"(distributed.peer_timeout_s={timeout:g}); exiting with status {EXIT_CODE} so "
            "that the scheduler restarts the job, which resumes from the latest checkpoint"
        )


def _address_towards(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except OSError:
        return "?"


class PeerMonitor:
    """The heartbeat of one rank (see the module doc). ``exit`` (default true) ends the
    process with status 75 on a lost peer; tests may set it false and read :attr:`lost`."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout_s: float,
        master_addr: str,
        master_port: int,
        *,
        exit: bool = True,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.master = (master_addr, master_port)
        self.exit = exit
        self.interval = max(0.2, timeout_s / 20)
        self.op_timeout = max(0.5, self.interval)
        # a silence of timeout_s is seen up to a beat late, and a store request lost with a
        # link that went down takes up to two request timeouts to come back (the request,
        # then a new connection): a link back within timeout_s is never a lost peer
        self.limit_s = timeout_s + 2 * (self.interval + self.op_timeout)
        self.lost: Lost | None = None
        self.found = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hosts: dict[int, str] = {}

    @classmethod
    def for_job(cls, rank: int, world_size: int, timeout_s: float) -> PeerMonitor | None:
        """The monitor of this rank, from the launcher's environment (None for one process
        or when disabled with ``timeout_s`` 0)."""
        if world_size < 2 or timeout_s <= 0:
            return None
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            return None
        monitor = cls(rank, world_size, timeout_s, addr, int(port))
        monitor.start()
        return monitor

    def start(self) -> None:
        addr, port = self.master
        self._store = self._connect(max(1.0, self.timeout_s / 2))
        me = f"{socket.gethostname()} ({_address_towards(addr, port)})"
        self._store.set(f"{PREFIX}/host/{self.rank}", me)
        self._store.set(f"{PREFIX}/beat/{self.rank}", "0")
        self._thread = threading.Thread(target=self._run, name="bertpipe-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating, and tell the others this rank is done (not lost)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval * 2 + 1)
        with contextlib.suppress(Exception):  # the store may be gone already
            self._store.set(f"{PREFIX}/beat/{self.rank}", DONE)

    def host(self, rank: int) -> str:
        if rank not in self._hosts:
            try:
                self._hosts[rank] = self._store.get(f"{PREFIX}/host/{rank}").decode()
            except Exception:
                return f"the host of rank {rank}"
        return self._hosts[rank]

    def _connect(self, timeout: float) -> Any:
        """A client of the job's store of its own (the process group's connection stays the
        trainer's); its requests give up after :attr:`op_timeout`."""
        import torch.distributed as dist

        addr, port = self.master
        store = dist.TCPStore(
            addr,
            port,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout),
            wait_for_workers=False,
        )
        store.set_timeout(datetime.timedelta(seconds=self.op_timeout))
        return store

    def _run(self) -> None:
        beat = 0
        peers = [r for r in range(self.world_size) if r != self.rank]
        keys = [f"{PREFIX}/beat/{r}" for r in peers]
        last: dict[int, bytes] = {}
        changed = dict.fromkeys(peers, time.monotonic())
        contact = time.monotonic()  # the last request the store answered
        store: Any = self._store
        out_since: float | None = None
        while not self._stop.wait(self.interval):
            try:
                if store is None:
                    store = self._store = self._connect(self.op_timeout)
                beat += 1
                store.set(f"{PREFIX}/beat/{self.rank}", str(beat))
                values = store.multi_get(keys)
            except Exception as exc:  # the store lives with rank 0 (or the launcher's agent)
                if self._stop.is_set():
                    return
                # a request that timed out leaves its connection out of step: a new one, whose
                # first packets do not wait out TCP's retransmission backoff of the old one
                store = None
                now = time.monotonic()
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                if now - contact > self.limit_s:
                    self._verdict(
                        Lost(
                            0,
                            self.host(0) if 0 in self._hosts else f"{self.master[0]}",
                            f"the job's store at {self.master[0]}:{self.master[1]} has not "
                            f"answered for {now - contact:.0f} s ({first[:120]})",
                        )
                    )
                    return
                if out_since is None:
                    out_since = contact
                    log.warning(
                        "rank %d: the job's store at %s:%d does not answer (%s): retrying for "
                        "up to %.0f s",
                        self.rank,
                        *self.master,
                        first[:120],
                        self.limit_s,
                    )
                continue
            now = time.monotonic()
            if out_since is not None:
                log.warning(
                    "rank %d: the job's store answers again after %.1f s",
                    self.rank,
                    now - out_since,
                )
                out_since = None
            contact = now
            for rank, value in zip(peers, values, strict=True):
                if value == DONE.encode():  # finished its run: not watched any more
                    changed[rank] = now
                elif last.get(rank) != value:
                    last[rank] = value
                    changed[rank] = now
                    if rank not in self._hosts:
                        self.host(rank)
                elif now - changed[rank] > self.limit_s:
                    self._verdict(
                        Lost(rank, self.host(rank), f"no heartbeat for {now - changed[rank]:.0f} s")
                    )
                    return

    def _verdict(self, lost: Lost) -> None:
        self.lost = lost
        self.found.set()
        line = lost.line(self.rank, self.timeout_s)
        log.error("%s", line)
        if self.exit:
            print(f"bertpipe: error: {line}", file=sys.stderr, flush=True)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(EXIT_CODE)  # the training thread may be blocked inside a collective


@contextlib.contextmanager
def watched(rank: int, world_size: int, timeout_s: float) -> Iterator[PeerMonitor | None]:
    """A run of this rank under its heartbeat (:meth:`PeerMonitor.for_job`): a collective
    that fails in the block because a peer went away becomes :class:`PeerLostError` (exit
    75); the heartbeat stops when the block ends, before the ranks' last barrier, so that no
    rank outlives its peers' heartbeats."""
    monitor = PeerMonitor.for_job(rank, world_size, timeout_s)
    try:
        yield monitor
    except Exception as exc:
        lost = lost_peer_error(monitor, exc)
        if lost is not None:
            raise lost from exc
        raise
    finally:
        if monitor is not None:
            monitor.stop()


_COMM_WORDS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "socket")


def is_comm_error(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a collective that failed because a peer went away."""
    text = f"{type(exc).__name__} {exc}".lower()
    return isinstance(exc, RuntimeError | ConnectionError | OSError) and any(
        w in text for w in _COMM_WORDS
    )


def lost_peer_error(monitor: PeerMonitor | None, exc: BaseException) -> PeerLostError | None:
    """For a collective that failed with ``exc``: the :class:`PeerLostError` naming the lost
    peer once the heartbeat finds it (waiting up to the timeout), else None."""
    if monitor is None or not is_comm_error(exc):
        return None
    monitor.exit = False  # this thread reports it, with the run's own error handling
    if not monitor.found.wait(monitor.timeout_s + 2 * monitor.interval):
        return None
    assert monitor.lost is not None
    return PeerLostError(monitor.lost.line(monitor.rank, monitor.timeout_s))
