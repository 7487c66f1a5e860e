"""The driver's watch on a Dask cluster (:mod:`bertpipe.preprocessing.dask_watch`) on a real
in-process Dask cluster and Beam's own ``DaskRunnerResult``: a job whose cluster runs none of
its tasks is stopped with one line naming the workers it lost; a task that runs longer than
the bound is not a stall. (The stall after a lost host itself: tests/multihost.)"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from bertpipe.errors import TEMPFAIL_EXIT_CODE
from bertpipe.preprocessing.dask_watch import ClusterStalledError, DaskWatch, wait_until_finish

distributed = pytest.importorskip("distributed")
dask_runner = pytest.importorskip("apache_beam.runners.dask.dask_runner")


@pytest.fixture(scope="module")
def client() -> Iterator[distributed.Client]:
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as made,
    ):
        yield made


def _slow(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _reported_executing(dask_scheduler: distributed.Scheduler) -> int:
    return sum(len(ws.executing) for ws in dask_scheduler.workers.values())


def _heartbeats(on: bool, dask_worker: distributed.Worker) -> None:
    beat = dask_worker.periodic_callbacks["heartbeat"]
    beat.start() if on else beat.stop()


def test_a_task_no_worker_can_run_stops_the_job_naming_the_lost_worker(
    client: distributed.Client,
) -> None:
    workers = sorted(client.scheduler_info()["workers"])
    gone = client.scheduler_info()["workers"][workers[1]]["name"]
    # a task that needs a resource no worker has: Dask waits for ever, nothing runs
    future = client.submit(_slow, 0.0, resources={"TPU": 1}, pure=False)
    result = dask_runner.DaskRunnerResult(client, [future])
    started = time.monotonic()
    with DaskWatch(result, timeout_s=1.5, poll_s=0.2) as watch:
        client.retire_workers([workers[1]], close_workers=True)
        # Beam's wait returns or raises once the watch cancelled the job's tasks
        with contextlib.suppress(Exception):
            result.wait_until_finish()
    assert 1.5 <= time.monotonic() - started < 30
    with pytest.raises(ClusterStalledError) as err:
        watch.check()
    line = str(err.value)
    assert "\n" not in line and "ran no task of the job for" in line
    assert f"lost worker(s) {gone} ({workers[1]}" in line, line
    assert "run the same command again" in line and "stall_timeout_s" in line
    assert err.value.exit_code == TEMPFAIL_EXIT_CODE
    assert future.status == "cancelled"


def test_a_task_running_longer_than_the_bound_is_not_a_stall(client: distributed.Client) -> None:
    future = client.submit(_slow, 2.0, pure=False)
    result = dask_runner.DaskRunnerResult(client, [future])
    with DaskWatch(result, timeout_s=0.5, poll_s=0.1) as watch:
        result.wait_until_finish()
    watch.check()  # no error
    assert future.result() == 2.0
    assert watch.stalled is None


def test_a_worker_not_heard_from_since_the_quiet_began_is_not_a_stall(
    client: distributed.Client,
) -> None:
    """A worker reports what it executes only in its heartbeats: one that has not reported
    since its task started (a loaded machine; here its heartbeats are held) leaves the
    scheduler's "nothing executing" stale; the watch waits for word (until Dask's worker-ttl
    would drop it) instead of stopping a running job."""
    deadline = time.monotonic() + 10  # the reports of earlier tests' tasks are cleared
    while client.run_on_scheduler(_reported_executing) and time.monotonic() < deadline:
        time.sleep(0.1)
    client.run(_heartbeats, False)  # on each worker's event loop
    try:
        future = client.submit(_slow, 2.0, pure=False)
        result = dask_runner.DaskRunnerResult(client, [future])
        with DaskWatch(result, timeout_s=0.5, poll_s=0.1) as watch:
            result.wait_until_finish()
    finally:
        client.run(_heartbeats, True)
    watch.check()  # no error
    assert future.result() == 2.0 and watch.stalled is None


def test_zero_means_no_watch(client: distributed.Client) -> None:
    future = client.submit(_slow, 0.0, pure=False)
    result = dask_runner.DaskRunnerResult(client, [future])
    with DaskWatch(result, timeout_s=0) as watch:
        result.wait_until_finish()
    assert not watch._thread.is_alive() and watch.stalled is None


def test_the_drivers_wait_raises_the_stall(client: distributed.Client) -> None:
    """What ``bertpipe preprocess`` calls: Beam's wait under the watch."""
    future = client.submit(_slow, 0.0, resources={"TPU": 1}, pure=False)
    result = dask_runner.DaskRunnerResult(client, [future])
    with pytest.raises(ClusterStalledError, match=r"ran no task .* with no worker lost"):
        wait_until_finish(result, 1.0)
    assert future.status == "cancelled"
