"""The driver's watch on a Dask cluster while a ``bertpipe preprocess`` job runs on it.

Dask reschedules the tasks of a worker it drops (killed, or silent for
``distributed.scheduler.worker-ttl``), and usually the job goes on. Not always: a surviving
worker that was fetching a result from the lost one can be left waiting for it for good
(measured on the test hosts of ``tests/multihost/test_dask_hosts.py``: after a worker's link
was cut in the shard stage, the other worker ran nothing more; the class of dask/distributed
#6263 and #8006). Beam's Dask runner then waits for ever. The watch ends such a job instead:
when the cluster has had work left and has neither run nor finished a task for
``stall_timeout_s`` (by the scheduler: its transition counter did not move, no worker reports
a task executing, and every worker holding a task of the job has reported so twice since the
quiet began), it cancels the job's tasks, and the driver exits with status 75 and one
line naming the workers the job lost. The output keeps what the job finished, so the same
command continues it (the tasks it cancelled are released, which frees a worker that waited
on them).

A task that runs for longer than the timeout does not trip it: a worker reports it executing.
A worker reports what it executes only in its heartbeats (every 0.5 s on a small cluster, up to
seconds on a large or loaded one): until a worker holding a task has been heard from since the
cluster went quiet, the scheduler's "nothing executing" is stale news, not a stall (a task that
had just started was once taken for a stall on a loaded machine with a 0.5 s bound).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from bertpipe.errors import TransientError

log = logging.getLogger(__name__)

POLL_S = 2.0
"""How often the watch asks the scheduler (a cheap call: a few counters)."""


class ClusterStalledError(TransientError):
    """The Dask cluster stopped running the job's tasks (exit status 75: rerun to continue)."""


def _scheduler_state(dask_scheduler: Any) -> dict[str, Any]:
    """Runs on the scheduler: its progress counter, its workers, whether any runs a task and
    how many tasks wait for a worker or run."""
    from distributed.metrics import time as clock  # the clock of ``last_seen``

    waiting = ("processing", "no-worker", "queued", "waiting")
    workers = dask_scheduler.workers.values()
    return {
        "transitions": dask_scheduler.transition_counter,
        "workers": {ws.address: str(ws.name) for ws in workers},
        # a worker's last report of what it executes, less what has finished since
        "executing": sum(ts in ws.processing for ws in workers for ts in ws.executing),
        "unfinished": sum(ts.state in waiting for ts in dask_scheduler.tasks.values()),
        # when each worker holding a task last reported (its heartbeat), on the scheduler's clock
        "reported": {ws.address: ws.last_seen for ws in workers if ws.processing},
        "now": clock(),
        "worker_ttl": dask_scheduler.worker_ttl or None,  # after which it drops a silent worker
    }


HEARD_TWICE = 3
"""Reports of a worker the watch must have seen before calling a quiet cluster stalled: the
one it had when the quiet began and two since (a heartbeat composed just before the worker
received its task arrives after the quiet began, and says nothing about that task)."""


def wait_until_finish(result: Any, stall_timeout_s: float) -> None:
    """Beam's ``result.wait_until_finish()``; on Beam's Dask runner (a result with a
    ``client``) under a :class:`DaskWatch`, which may end it with :class:`ClusterStalledError`."""
    if not hasattr(result, "client"):
        result.wait_until_finish()
        return
    with DaskWatch(result, stall_timeout_s) as watch:
        try:  # a cancelled job's wait may return or raise: the stall is why it ended
            result.wait_until_finish()
        finally:
            watch.check()


class DaskWatch:
    """``with DaskWatch(result, timeout_s): result.wait_until_finish()``, then :meth:`check`
    however the wait ended (a cancelled job's wait can return as if it had finished): it
    raises the stall if the watch cancelled the job.

    ``result`` is Beam's ``DaskRunnerResult`` (its ``client`` and ``cancel``).
    """

    def __init__(self, result: Any, timeout_s: float, poll_s: float = POLL_S) -> None:
        self._result = result
        self._client = result.client
        self._timeout_s = timeout_s
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dask-watch", daemon=True)
        self.lost: dict[str, tuple[str, float]] = {}
        """Address -> (name, when it left) of the workers gone since the job started."""
        self.stalled: str | None = None
        """The one-line reason, once the watch cancelled the job."""
        self._seen: dict[str, str] = {}

    def __enter__(self) -> DaskWatch:
        if self._timeout_s > 0:
            state = self._state()  # the workers the job starts with
            self._seen = dict(state["workers"]) if state else {}
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def check(self) -> None:
        """Raise :class:`ClusterStalledError` if the watch stopped the job."""
        if self.stalled is not None:
            raise ClusterStalledError(self.stalled)

    def _state(self) -> dict[str, Any] | None:
        try:
            return dict(self._client.run_on_scheduler(_scheduler_state))
        except Exception as error:  # the scheduler itself gone: Beam's wait reports that
            log.debug("dask watch: no scheduler state: %s", error)
            return None

    def _run(self) -> None:
        seen = self._seen
        last_transitions, quiet_since = -1, time.monotonic()
        heard: dict[str, list[float]] = {}  # worker -> its report times since the quiet began
        while not self._stop.wait(self._poll_s):
            state = self._state()
            if state is None:
                continue
            now = time.monotonic()
            for address, name in seen.items():
                if address not in state["workers"] and address not in self.lost:
                    self.lost[address] = (name, time.time())
                    log.warning("preprocess: Dask worker %s (%s) left the cluster", name, address)
            seen.update(state["workers"])
            busy = state["executing"] > 0 or state["unfinished"] == 0
            reported: dict[str, float] = state["reported"]
            if state["transitions"] != last_transitions or busy:
                last_transitions, quiet_since = state["transitions"], now
                heard = {address: [when] for address, when in reported.items()}
                continue
            for address, when in reported.items():
                times = heard.setdefault(address, [])
                if not times or times[-1] != when:
                    times.append(when)
            # word is awaited from a worker while Dask deems it alive (it drops one silent for
            # its worker-ttl, which restarts the quiet); with no ttl, for the watch's bound
            alive_s = state["worker_ttl"] or self._timeout_s
            unheard = [
                address
                for address, when in reported.items()
                if len(heard[address]) < HEARD_TWICE and state["now"] - when < alive_s
            ]
            if now - quiet_since >= self._timeout_s and not unheard:
                self.stalled = self._reason(state, now - quiet_since)
                log.error("%s", self.stalled)
                try:
                    self._result.cancel()
                except Exception as error:  # the wait ends anyway once the driver exits
                    log.debug("dask watch: cancel failed: %s", error)
                return

    def _reason(self, state: dict[str, Any], quiet_s: float) -> str:
        if self.lost:
            gone = ", ".join(
                f"{name} ({address}, left {time.strftime('%H:%M:%S', time.localtime(when))})"
                for address, (name, when) in self.lost.items()
            )
            after = f"after the job lost worker(s) {gone}"
        else:
            after = "with no worker lost"
        return (
            f"preprocess: the Dask cluster ran no task of the job for {quiet_s:.0f} s "
            f"({state['unfinished']} task(s) left, {len(state['workers'])} worker(s)) {after}; "
            "the job is stopped and its finished work kept: run the same command again to "
            "continue (restart the workers if it stalls again; stall_timeout_s sets the bound)"
        )
