"""The outage buffer: what MLflow could not take waits in a local file and is sent later.

An :class:`Outbox` is the sender of the open run. While the store answers, records go
straight to it; once a call fails they are appended to a buffer (a JSONL file, by default
``<output>/mlflow-buffer.jsonl``: one record per metric point with its run id, key, value,
step and timestamp, or per param/tag/artifact call) and replayed, with the original steps and
timestamps, when the store answers again (tried at most every :data:`RETRY_SECONDS`), at the
end of the run, or when a later run with the same buffer starts (a resumed pre-training).
One warning when tracking fails, one when it recovers; ``tracking/failed_calls`` and
``tracking/replayed_metrics`` are logged once it works again. :func:`replay_buffer` sends
what a run left behind by hand. An outbox is shared by the stage's thread and the run's
system-metrics sampler (:mod:`~bertpipe.tracking.system_metrics`): one sends at a time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from typing import Any

from bertpipe import fsio
from bertpipe.tracking.client import quick_http

log = logging.getLogger(__name__)

__all__ = [
    "BATCH_METRICS",
    "BUFFER_NAME",
    "RETRY_SECONDS",
    "SYSTEM_PREFIX",
    "Outbox",
    "buffer_path",
    "encode_value",
    "read_buffer",
    "replay_buffer",
    "send_one",
    "send_records",
]

BUFFER_NAME = "mlflow-buffer.jsonl"
"""The buffer of unsent tracking records in a run's output folder."""
SYSTEM_PREFIX = "system/"
"""The key prefix of MLflow's system metrics (sampled with their own step counter)."""
RETRY_SECONDS = 60.0
"""While the store is down, how often a call tries it again (the others go to the buffer)."""
BATCH_METRICS = 1000
"""Metric points per ``log_batch`` call of a replay (MLflow's limit)."""
_REFUSED = {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_ALREADY_EXISTS", "INVALID_STATE"}


def buffer_path(output: Any) -> str | None:
    """The tracking buffer of a run writing to ``output``: ``<output>/mlflow-buffer.jsonl``
    for a local folder; None (the default under ``runs/mlflow-buffer``) for a remote one."""
    text = str(output)
    if "://" in text and not text.startswith("file://"):
        return None
    return os.path.join(os.path.abspath(text.removeprefix("file://")), BUFFER_NAME)


def encode_value(value: float) -> float | str:
    """A metric value for the JSON buffer: non-finite values as ``"nan"``, ``"inf"``..."""
    return value if math.isfinite(value) else str(value)


class Outbox:
    """The open run's sender: straight to MLflow while it answers, else to the buffer file
    (append-only JSONL), replayed when the store answers again. Thread-safe (the stage's
    thread and the system-metrics sampler share it): the buffer, a replay and the close are
    handled under a lock, so records keep their order in the buffer and, once the store
    failed, it is tried at most once per ``retry_seconds`` whichever thread tries; a direct
    send (nothing buffered) is made outside the lock."""

    def __init__(self, run_id: str, path: str, retry_seconds: float | None = None) -> None:
        self.run_id = run_id
        self.path = path
        self.retry_seconds = RETRY_SECONDS if retry_seconds is None else retry_seconds
        self.next_try = 0.0
        self.down = False
        self.failed_calls = 0
        self.replayed = 0
        self.last_step = 0
        self.detached = False
        """The run was never reopened in MLflow (store down at resume): its end is a record."""
        self._lock = threading.RLock()

    def pending(self) -> bool:
        """Whether the buffer file holds records."""
        return os.path.exists(self.path) and os.path.getsize(self.path) > 0

    def send(self, records: list[dict[str, Any]]) -> None:
        """Send ``records`` (after what the buffer holds), or append them to the buffer.

        The buffer and the replay are handled under the lock; a direct send (nothing
        buffered) is made outside it, so that one thread's call in flight (a sampler's, or a
        store that is slow to answer) never holds up another's."""
        with self._lock:
            for r in records:
                if r["kind"] == "metric" and not str(r["key"]).startswith(SYSTEM_PREFIX):
                    self.last_step = max(self.last_step, int(r["step"]))  # the stage's steps
            if self.pending() and not self.replay():
                self._append(records)
                return
        todo = list(records)
        try:
            send_records(todo)
        except Exception as exc:
            with self._lock:
                self.failed(exc)
                self._append(todo)

    def replay(self, force: bool = False, resuming: bool = False) -> bool:
        """Send what the buffer holds (at most every ``retry_seconds`` unless ``force``);
        True when the buffer is empty after it. Never raises."""
        with self._lock:
            return self._replay(force, resuming)

    def _replay(self, force: bool, resuming: bool) -> bool:
        if not self.pending():
            return True
        if not force and time.monotonic() < self.next_try:
            return False
        try:
            records = read_buffer(self.path)
        except OSError as exc:
            self.failed(exc)
            return False
        if resuming:  # this run is open again: its earlier end is void
            records = [
                r for r in records if not (r["kind"] == "end" and r["run_id"] == self.run_id)
            ]
        metrics = sum(1 for r in records if r["kind"] == "metric")
        try:
            send_records(records)
        except Exception as exc:
            self.failed(exc)
            _rewrite(self.path, records)  # the unsent rest
            return False
        os.remove(self.path)
        self.replayed += metrics
        log.warning(
            "MLflow reachable again: replayed %d metric points%s from %s (%d failed calls)",
            metrics,
            " of an earlier run" if resuming else "",
            self.path,
            self.failed_calls,
        )
        self.down = False
        counters = {
            "tracking/failed_calls": float(self.failed_calls),
            "tracking/replayed_metrics": float(self.replayed),
        }
        with contextlib.suppress(Exception):
            send_records(
                [
                    {
                        "kind": "metric",
                        "run_id": self.run_id,
                        "key": k,
                        "value": v,
                        "step": self.last_step,
                        "timestamp": int(time.time() * 1000),
                    }
                    for k, v in counters.items()
                ]
            )
        return True

    def close(self, status: str) -> None:
        """End the run: replay the buffer, set the run's status; if the store is still down,
        leave both in the buffer (one warning)."""
        with self._lock:
            self._close(status)

    def _close(self, status: str) -> None:
        import mlflow

        self.replay(force=True)
        end = {
            "kind": "end",
            "run_id": self.run_id,
            "status": status,
            "timestamp": int(time.time() * 1000),
        }
        if self.detached:  # never reopened in MLflow: its end is one more record
            self.send([end])
        else:
            try:
                active = mlflow.active_run()
                if active is not None and active.info.run_id == self.run_id:
                    with quick_http():
                        mlflow.end_run(status)
            except Exception as exc:
                self.failed(exc, warn=False)
                self._append([end])
        if self.pending():
            records = read_buffer(self.path)
            unended = any(r["kind"] == "end" and r["run_id"] == self.run_id for r in records)
            log.warning(
                "MLflow unreachable at the end of run %s: %d tracking records left in %s, "
                "replayed by the next run started with this buffer (a resumed pre-training) or "
                "bertpipe.tracking.replay_buffer(path, uri)%s",
                self.run_id,
                len(records),
                self.path,
                ""
                if not unended
                else "; the run's status is set then"
                if self.detached
                else "; the run stays RUNNING in MLflow until then",
            )

    def failed(self, exc: BaseException, warn: bool = True) -> None:
        """Count a failed call; the store is tried again in ``retry_seconds`` (one warning
        when it goes down)."""
        self.failed_calls += 1
        self.next_try = time.monotonic() + self.retry_seconds
        if warn and not self.down:
            log.warning(
                "MLflow call failed (%s: %s); training goes on, tracking records are kept in "
                "%s and replayed when the store answers again (tried every %.0f s)",
                type(exc).__name__,
                fsio.redact(" ".join(str(exc).split())[:200]),
                self.path,
                self.retry_seconds,
            )
        self.down = True

    def _append(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("".join(json.dumps(r) + "\n" for r in records))
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            log.error(
                "MLflow buffer %s not writable (%s): %d records lost", self.path, exc, len(records)
            )


def send_records(records: list[dict[str, Any]]) -> None:
    """Send records to the current tracking URI in order (consecutive metric points of a run
    in batches); raises the first failure after dropping what was sent from ``records`` (so
    the caller keeps the rest). Records the store refuses (it answered: sending them again
    would fail the same way) are dropped with a warning."""
    import mlflow
    from mlflow.entities import Metric

    client = mlflow.MlflowClient()
    with quick_http():
        while records:
            first = records[0]
            n = 1
            if first["kind"] == "metric":
                n = 0
                while (
                    n < len(records)
                    and n < BATCH_METRICS
                    and records[n]["kind"] == "metric"
                    and records[n]["run_id"] == first["run_id"]
                ):
                    n += 1
            try:
                if first["kind"] == "metric":
                    metrics = [
                        Metric(r["key"], float(r["value"]), int(r["timestamp"]), int(r["step"]))
                        for r in records[:n]
                    ]
                    client.log_batch(first["run_id"], metrics=metrics)
                else:
                    send_one(client, first)
            except Exception as exc:
                if getattr(exc, "error_code", None) not in _REFUSED:
                    raise
                log.warning(
                    "MLflow refused %d %s record(s) of run %s, dropped: %s",
                    n,
                    first["kind"],
                    first["run_id"],
                    " ".join(str(exc).split())[:200],
                )
            del records[:n]


def send_one(client: Any, record: dict[str, Any]) -> None:
    """Send one non-metric record (params, tags, dict, text, artifacts, inputs, end) with ``client``
    (an ``mlflow.MlflowClient``)."""
    kind, run_id = record["kind"], record["run_id"]
    if kind == "params":
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in record["params"].items()]
        for i in range(0, len(params), 100):
            client.log_batch(run_id, params=params[i : i + 100])
    elif kind == "tags":
        from mlflow.entities import RunTag

        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in record["tags"].items()])
    elif kind == "dict":
        client.log_dict(run_id, record["data"], record["name"])
    elif kind == "text":
        client.log_text(run_id, record["text"], record["name"])
    elif kind == "artifacts":
        if os.path.isdir(record["local_dir"]):
            with quick_http(upload=True):
                client.log_artifacts(run_id, record["local_dir"], record["artifact_path"])
        else:
            log.warning("MLflow: %s is gone, not uploaded to run %s", record["local_dir"], run_id)
    elif kind == "inputs":
        _send_inputs(client, run_id, record)
    elif kind == "end":
        client.set_terminated(run_id, record["status"], end_time=record["timestamp"])
    else:
        log.warning("MLflow buffer: unknown record kind %r skipped", kind)


def _send_inputs(client: Any, run_id: str, record: dict[str, Any]) -> None:
    """Datasets (see :class:`~bertpipe.tracking.inputs.DatasetRef`) and logged models (ids)
    as inputs of the run."""
    from mlflow.entities import Dataset, DatasetInput, InputTag, LoggedModelInput

    datasets = [
        DatasetInput(
            Dataset(
                name=d["name"],
                digest=d["digest"],
                source_type=d["source_type"],
                source=d["source"],
                profile=d["profile"],
            ),
            tags=[InputTag("mlflow.data.context", d["context"])],
        )
        for d in record.get("datasets", [])
    ]
    models = [LoggedModelInput(model_id) for model_id in record.get("models", [])]
    client.log_inputs(run_id, datasets=datasets or None, models=models or None)


def read_buffer(path: str) -> list[dict[str, Any]]:
    """The records of a buffer file; a line cut by a crash while appending is skipped."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("MLflow buffer %s: an unreadable line skipped", path)
    return records


def _rewrite(path: str, records: list[dict[str, Any]]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def replay_buffer(path: str, uri: str | None = None) -> int:
    """Send what a buffer file left by a run holds to ``uri`` (default: the current tracking
    URI); returns the number of metric points sent. Raises when the store is still down
    (the unsent rest stays in the file)."""
    import mlflow

    if uri:
        mlflow.set_tracking_uri(uri)
    records = read_buffer(path)
    metrics = sum(1 for r in records if r["kind"] == "metric")
    try:
        send_records(records)
    except Exception:
        _rewrite(path, records)
        raise
    os.remove(path)
    return metrics
