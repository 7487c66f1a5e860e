"""The machine's CPU, memory, disk, network and GPU use as ``system/*`` metrics of the open run,
sampled by MLflow's own monitors and sent through the run's outbox.

MLflow's :class:`~mlflow.system_metrics.system_metrics_monitor.SystemMetricsMonitor` samples
in a thread and logs each aggregate with its own client; while the store is down its calls
fail and its thread stops for good (it also asks the store for the run's status before every
sample, and gives up at the first failure), so the points of an outage, and every later one,
are lost. :class:`OutboxSystemMetrics` keeps MLflow's samplers, node id, interval and step
counter, and hands each aggregate to the run's :class:`~bertpipe.tracking.outbox.Outbox`
instead: buffered with the stage's own metrics while the store is down and replayed with
their timestamps when it answers again. The thread lives as long as the run is open in
:func:`~bertpipe.tracking.lifecycle.start_run`; the samples taken since the last aggregate
are sent when it ends, so a run shorter than the interval still has one point.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

from bertpipe.tracking.client import quick_http
from bertpipe.tracking.outbox import SYSTEM_PREFIX, Outbox, encode_value, read_buffer

log = logging.getLogger(__name__)

__all__ = ["OutboxSystemMetrics", "next_system_step"]


class OutboxSystemMetrics(SystemMetricsMonitor):
    """MLflow's system-metrics monitor for the run of ``outbox``, sending through it.

    ``first_step`` is the step of the first aggregate (after the last one of a resumed run:
    :func:`next_system_step`). MLflow's environment variables
    (``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL``, ``..._SAMPLES_BEFORE_LOGGING``,
    ``..._NODE_ID``) apply as to its own monitor."""

    def __init__(self, outbox: Outbox, sampling_interval: float, first_step: int = 0) -> None:
        super().__init__(outbox.run_id, sampling_interval=sampling_interval)
        self.outbox = outbox
        self._logging_step = first_step
        self._samples = 0

    def monitor(self) -> None:
        """Sample every interval; every ``samples_before_logging`` samples, send their
        aggregate; on shutdown, send what was sampled since the last one."""
        try:
            while not self._shutdown_event.is_set():
                self.collect_metrics()
                self._samples += 1
                stopping = self._shutdown_event.wait(self.sampling_interval)
                if self._samples >= self.samples_before_logging or stopping:
                    self.publish_metrics(self.aggregate_metrics())
        except Exception as exc:  # a sampler that broke: the run goes on without it
            log.warning("system metrics stopped for run %s: %s", self.outbox.run_id, exc)

    def publish_metrics(self, metrics: dict[str, Any]) -> None:
        """Send one aggregate (``system/<name>``, or ``system/<node id>/<name>``) at the next
        step, timestamped now."""
        self._samples = 0
        for monitor in self.monitors:
            monitor.clear_metrics()
        if not metrics:
            return
        prefix = SYSTEM_PREFIX + (f"{self.node_id}/" if self.node_id else "")
        timestamp = int(time.time() * 1000)
        self.outbox.send(
            [
                {
                    "kind": "metric",
                    "run_id": self.outbox.run_id,
                    "key": prefix + key,
                    "value": encode_value(float(value)),
                    "step": self._logging_step,
                    "timestamp": timestamp,
                }
                for key, value in metrics.items()
            ]
        )
        self._logging_step += 1

    def finish(self) -> None:
        """Stop the thread after its last aggregate is sent (or buffered)."""
        if self._process is None:
            return
        self._shutdown_event.set()
        self._process.join()
        self._process = None


def next_system_step(outbox: Outbox, resumed: bool) -> int:
    """The step of a run's next system-metrics aggregate: 0 for a new run; for a resumed one,
    one past the last step in the store (asked once, without retries) and in the buffer."""
    if not resumed:
        return 0
    last = -1
    try:
        import mlflow

        with quick_http():
            run = mlflow.MlflowClient().get_run(outbox.run_id)
        for metric in getattr(run.data, "_metric_objs", None) or []:  # each key's last point
            if metric.key.startswith(SYSTEM_PREFIX):
                last = max(last, int(metric.step))
    except Exception as exc:  # the store is down: the buffer tells what it holds
        log.debug("system metrics: last step of run %s unknown (%s)", outbox.run_id, exc)
    if outbox.pending():
        for r in read_buffer(outbox.path):
            if r["kind"] == "metric" and str(r["key"]).startswith(SYSTEM_PREFIX):
                last = max(last, int(r["step"]))
    return last + 1
