"""Tracking never stops a run: calls that fail while a run is open go to the local buffer and
are replayed (original steps and timestamps) when the store answers again, at the end of the
run, or by the next run using the buffer. The store is made unavailable by pointing MLflow at
a closed local port (connection refused) while the run is open in a real sqlite store."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from bertpipe import tracking
from bertpipe.tracking import client as tracking_client
from bertpipe.tracking import lifecycle as tracking_lifecycle
from bertpipe.tracking import outbox as tracking_outbox
from tests.conftest import free_port, sqlite_uri

pytestmark = pytest.mark.filterwarnings("ignore")


def _setup(
    tmp_path: Path, system_metrics: bool = False
) -> tuple[tracking.TrackingConfig, str, str, Path]:
    """A store, its config (system metrics off unless asked: they would add records to the
    buffers these tests read), a URI where nothing listens, and the buffer's path."""
    uri = sqlite_uri(tmp_path / "mlflow.db")
    cfg = tracking.TrackingConfig(
        uri=uri,
        experiment="buffer",
        system_metrics=system_metrics,
        system_metrics_interval_s=0.1,
    )
    return cfg, uri, f"http://127.0.0.1:{free_port()}", tmp_path / "out" / tracking.BUFFER_NAME


def _history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def _messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_outage_is_buffered_and_replayed_with_its_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import mlflow

    cfg, uri, down, buffer = _setup(tmp_path)
    monkeypatch.setattr(tracking_outbox, "RETRY_SECONDS", 3600.0)  # no retry unless forced
    sent = []
    real_send = tracking_outbox.send_records
    monkeypatch.setattr(
        tracking_outbox, "send_records", lambda records: (sent.append(1), real_send(records))
    )
    caplog.set_level(logging.WARNING, logger="bertpipe.tracking")
    with tracking.start_run(cfg, "pretrain", buffer=str(buffer)) as run:
        assert run is not None
        run_id = run.info.run_id
        tracking.log_metrics({"train/loss": 3.0}, step=1)
        mlflow.set_tracking_uri(down)  # the store goes away
        tracking.log_metrics({"train/loss": 2.5, "train/grad_norm": math.inf}, step=2)
        calls = len(sent)
        tracking.log_metrics({"train/loss": math.nan}, step=3)
        tracking.log_dict({"a": 1}, "ds_config_phase1.json")
        tracking.set_tags({"t": "v"})
        tracking.log_metrics({"train/loss": 2.0}, step=4)
        assert len(sent) == calls  # down: no attempt before RETRY_SECONDS
        records = [json.loads(line) for line in buffer.read_text().splitlines()]
        assert [r["step"] for r in records if r.get("key") == "train/loss"] == [2, 3, 4]
        assert {r["value"] for r in records if r.get("key") == "train/grad_norm"} == {"inf"}
        assert all(r["run_id"] == run_id for r in records)
        assert len(_messages(caplog, "MLflow call failed")) == 1
        mlflow.set_tracking_uri(uri)  # back
        outbox = tracking_lifecycle.current_outbox()
        assert outbox is not None
        outbox.next_try = 0.0  # the retry time has come
        tracking.log_metrics({"train/loss": 1.5}, step=5)
        assert not buffer.exists()
    history = _history(uri, run_id, "train/loss")
    assert [s for s, _ in history] == [1, 2, 3, 4, 5]
    assert math.isnan(history[2][1]) and history[3][1] == 2.0
    assert _history(uri, run_id, "train/grad_norm")[0][1] > 1e300
    client = mlflow.MlflowClient(tracking_uri=uri)
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and got.data.tags["t"] == "v"
    assert got.data.metrics["tracking/replayed_metrics"] == 4
    assert got.data.metrics["tracking/failed_calls"] >= 1
    assert "ds_config_phase1.json" in [a.path for a in client.list_artifacts(run_id)]
    assert len(_messages(caplog, "MLflow call failed")) == 1
    assert len(_messages(caplog, "MLflow reachable again")) == 1


def test_down_at_the_end_leaves_the_buffer_for_the_resumed_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import mlflow

    cfg, uri, down, buffer = _setup(tmp_path)
    caplog.set_level(logging.WARNING, logger="bertpipe.tracking")
    with tracking.start_run(cfg, "pretrain", buffer=str(buffer)) as run:
        assert run is not None
        run_id = run.info.run_id
        tracking.log_metrics({"train/loss": 3.0}, step=1)
        mlflow.set_tracking_uri(down)
        for step in (2, 3):
            tracking.log_metrics({"train/loss": 3.0 - step / 10}, step=step)
    assert buffer.exists()
    (line,) = _messages(caplog, "MLflow unreachable at the end")
    assert "stays RUNNING" in line and str(buffer) in line
    client = mlflow.MlflowClient(tracking_uri=uri)
    assert client.get_run(run_id).info.status == "RUNNING"
    # the resumed run (the store is back) replays the buffer first, its old end is void
    with tracking.start_run(cfg, "pretrain", resume_run_id=run_id, buffer=str(buffer)):
        assert not buffer.exists()
        assert client.get_run(run_id).info.status == "RUNNING"
        tracking.log_metrics({"train/loss": 2.0}, step=4)
    assert [s for s, _ in _history(uri, run_id, "train/loss")] == [1, 2, 3, 4]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_replay_buffer_of_a_finished_run_sets_its_status(tmp_path: Path) -> None:
    import mlflow

    cfg, uri, down, buffer = _setup(tmp_path)
    failing = pytest.raises(RuntimeError)
    with failing, tracking.start_run(cfg, "finetune", buffer=str(buffer)) as run:
        assert run is not None
        run_id = run.info.run_id
        mlflow.set_tracking_uri(down)
        tracking.log_metrics({"eval/accuracy": 0.5}, step=10)
        raise RuntimeError("the body fails while the store is down")
    kinds = [json.loads(line)["kind"] for line in buffer.read_text().splitlines()]
    assert kinds == ["metric", "end"]
    assert tracking.replay_buffer(str(buffer), uri) == 1
    assert not buffer.exists()
    got = mlflow.MlflowClient(tracking_uri=uri).get_run(run_id)
    assert got.info.status == "FAILED" and got.data.metrics["eval/accuracy"] == 0.5


def test_a_record_the_store_refuses_is_dropped_not_retried_forever(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import mlflow

    cfg, uri, _, buffer = _setup(tmp_path)
    caplog.set_level(logging.WARNING, logger="bertpipe.tracking")
    with tracking.start_run(cfg, "pretrain", buffer=str(buffer)) as run:
        assert run is not None
        tracking.log_params({"p": "1"})
        tracking.log_params({"p": "2"})  # MLflow refuses to change a param
        tracking.log_metrics({"train/loss": 1.0}, step=1)
    assert not buffer.exists() and _messages(caplog, "MLflow refused")
    got = mlflow.MlflowClient(tracking_uri=uri).get_run(run.info.run_id)
    assert got.data.params["p"] == "1" and got.data.metrics["train/loss"] == 1.0
    assert got.info.status == "FINISHED"


def test_buffer_path_is_local_only(tmp_path: Path) -> None:
    assert tracking.buffer_path(tmp_path) == str(tmp_path / tracking.BUFFER_NAME)
    assert tracking.buffer_path("s3://bucket/run") is None


def test_a_server_that_never_answers_costs_one_short_attempt_per_retry_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 must not stall the loop (and the other ranks in the next collective) on a store
    that accepts connections but never answers."""
    import socket
    import time

    import mlflow

    cfg, uri, _, buffer = _setup(tmp_path)
    monkeypatch.setattr(tracking_client, "HTTP_TIMEOUT", 1)
    monkeypatch.setattr(tracking_outbox, "RETRY_SECONDS", 3600.0)
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)  # connections are queued, never accepted or answered
        with tracking.start_run(cfg, "pretrain", buffer=str(buffer)) as run:
            assert run is not None
            mlflow.set_tracking_uri(f"http://127.0.0.1:{hole.getsockname()[1]}")
            started = time.monotonic()
            tracking.log_metrics({"train/loss": 1.0}, step=1)
            first = time.monotonic() - started
            started = time.monotonic()
            for step in range(2, 50):
                tracking.log_metrics({"train/loss": 1.0}, step=step)
            rest = time.monotonic() - started
            mlflow.set_tracking_uri(uri)
    assert first < 5 and rest < 1
    history = _history(uri, run.info.run_id, "train/loss")
    assert [s for s, _ in history] == list(range(1, 50))  # replayed at the end


def test_resume_while_the_store_is_down_goes_on_and_buffers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A preempted pre-training resumed while MLflow is down: the run id is known (from the
    checkpoint), so the run goes on and its records wait in the buffer."""
    import dataclasses
    import time

    import mlflow

    cfg, uri, down, buffer = _setup(tmp_path)
    with tracking.start_run(cfg, "pretrain", buffer=str(buffer)) as run:
        assert run is not None
        run_id = run.info.run_id
        tracking.log_metrics({"train/loss": 3.0}, step=1)
    caplog.set_level(logging.WARNING, logger="bertpipe.tracking")
    started = time.monotonic()
    down_cfg = dataclasses.replace(cfg, uri=down)
    with tracking.start_run(down_cfg, "pretrain", resume_run_id=run_id, buffer=str(buffer)) as run:
        assert run is not None and run.info.run_id == run_id
        tracking.log_metrics({"train/loss": 2.0}, step=2)
        tracking.log_dict({"a": 1}, "ds_config_phase2.json")
    assert time.monotonic() - started < 10
    assert len(_messages(caplog, "MLflow call failed")) == 1
    (line,) = _messages(caplog, "MLflow unreachable at the end")
    assert "status is set then" in line
    kinds = [json.loads(line)["kind"] for line in buffer.read_text().splitlines()]
    assert kinds == ["tags", "metric", "dict", "end"]
    assert tracking.replay_buffer(str(buffer), uri) == 1
    assert [s for s, _ in _history(uri, run_id, "train/loss")] == [1, 2]
    client = mlflow.MlflowClient(tracking_uri=uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert "ds_config_phase2.json" in [a.path for a in client.list_artifacts(run_id)]


def _system_points(uri: str, run_id: str) -> list[tuple[int, int]]:
    """(step, timestamp) of the run's ``system/cpu_utilization_percentage`` points."""
    import mlflow

    history = mlflow.MlflowClient(tracking_uri=uri).get_metric_history(
        run_id, "system/cpu_utilization_percentage"
    )
    return sorted((m.step, m.timestamp) for m in history)


def test_system_metrics_of_an_outage_are_buffered_and_replayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow's samplers in a thread, through the outbox: while the store is down their
    points wait in the buffer with the stage's and arrive with their own timestamps, and the
    sampling goes on after it (MLflow's own monitor stops at its first failed call). A
    resumed run's system steps continue after the last one."""
    import time

    import mlflow

    cfg, uri, down, buffer = _setup(tmp_path, system_metrics=True)
    monkeypatch.setattr(tracking_outbox, "RETRY_SECONDS", 3600.0)
    with tracking.start_run(cfg, "pretrain", buffer=str(buffer)) as run:
        assert run is not None
        run_id = run.info.run_id
        time.sleep(0.5)
        mlflow.set_tracking_uri(down)
        outage = int(time.time() * 1000)
        tracking.log_metrics({"train/loss": 2.0}, step=1)
        time.sleep(0.6)
        buffered = [json.loads(line) for line in buffer.read_text().splitlines()]
        system = [r for r in buffered if r["key"] == "system/cpu_utilization_percentage"]
        assert len(system) >= 2 and all(r["timestamp"] >= outage for r in system)
        back = int(time.time() * 1000)
        mlflow.set_tracking_uri(uri)
        outbox = tracking_lifecycle.current_outbox()
        assert outbox is not None
        outbox.next_try = 0.0
        deadline = time.monotonic() + 10
        while buffer.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # the sampler's next send replays the buffer
        assert not buffer.exists()
        time.sleep(0.3)
    points = _system_points(uri, run_id)
    steps = [s for s, _ in points]
    assert steps == list(range(len(steps)))  # each aggregate once, none lost
    during = [t for _, t in points if outage <= t <= back]
    assert len(during) >= len(system)
    assert [t for _, t in points if t > back]  # sampling went on after the outage
    assert _history(uri, run_id, "train/loss") == [(1, 2.0)]
    with tracking.start_run(cfg, "pretrain", resume_run_id=run_id, buffer=str(buffer)):
        time.sleep(0.25)
    again = [s for s, _ in _system_points(uri, run_id)]
    assert (
        again[: len(steps)] == steps
        and again == list(range(len(again)))
        and len(again) > len(steps)
    )
