"""Where a run's store and artifacts are: the artifact root of a sqlite store is the
``mlartifacts`` folder beside the database (absolute and relative paths, as root and as a user
who may write only in their home), an older store with the misread root is named, and a
tracking server that cannot be reached is one line naming ``tracking.uri`` within seconds.

Checked through MLflow's own resolution (``mlflow.get_artifact_uri()``, the experiment's
``artifact_location``, MLflow's ``local_file_uri_to_path``) and the files on disk; servers
are real sockets on 127.0.0.1 (refusing, never answering, answering)."""

from __future__ import annotations

import http.server
import json
import logging
import os
import pwd
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bertpipe import tracking
from bertpipe.tracking import client as tracking_client
from tests.conftest import free_port, sqlite_uri

REPO = Path(__file__).resolve().parents[2]


def _local(uri: str) -> Path:
    """The local path MLflow reads from a ``file:`` URI."""
    from mlflow.utils.file_utils import local_file_uri_to_path

    return Path(local_file_uri_to_path(uri))


def _log_one_artifact(cfg: tracking.TrackingConfig) -> tuple[str, str, str]:
    """A run in ``cfg``'s store with one text artifact: (run id, MLflow's artifact URI of the
    run, the experiment's artifact_location)."""
    import mlflow

    with tracking.start_run(cfg, "preprocess") as run:
        assert run is not None
        artifact_uri = mlflow.get_artifact_uri()
        tracking.log_text("hello", "hello.txt")
    client = mlflow.MlflowClient(tracking_uri=cfg.resolved_uri())
    location = client.get_experiment(run.info.experiment_id).artifact_location
    return run.info.run_id, artifact_uri, location


def _misread_target(folder: Path) -> Path:
    """Where the old ``file:///`` + ``//abs`` root sent the artifacts of a store in
    ``folder``: its first path component taken for a host."""
    return Path("/", *folder.parts[2:])


@pytest.mark.parametrize("form", ["absolute", "relative"])
def test_artifacts_of_a_sqlite_store_land_beside_the_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    store = tmp_path / "data" / "runs"
    sqlite_uri(store / "mlflow.db")  # an empty store, copied
    if form == "absolute":
        uri = f"sqlite:///{store / 'mlflow.db'}"  # sqlite:////tmp/...
        assert uri.startswith("sqlite:////")
    else:
        monkeypatch.chdir(tmp_path)
        uri = "sqlite:///data/runs/mlflow.db"
    cfg = tracking.TrackingConfig(uri=uri, experiment=form, system_metrics=False)
    assert tracking_client.sqlite_path(cfg.resolved_uri()) == str(store / "mlflow.db")
    run_id, artifact_uri, location = _log_one_artifact(cfg)
    assert location == (store / "mlartifacts").as_uri()  # file:///tmp/.../mlartifacts
    assert _local(location) == store / "mlartifacts"
    assert _local(artifact_uri) == store / "mlartifacts" / run_id / "artifacts"
    assert (store / "mlartifacts" / run_id / "artifacts" / "hello.txt").read_text() == "hello"
    assert not _misread_target(store).exists()  # nothing where the old root sent it


def test_artifact_root_of_folders_with_spaces_and_hangul(tmp_path: Path) -> None:
    store = tmp_path / "실험 결과"
    cfg = tracking.TrackingConfig(
        uri=sqlite_uri(store / "mlflow.db"), experiment="hangul", system_metrics=False
    )
    run_id, artifact_uri, _ = _log_one_artifact(cfg)
    assert _local(artifact_uri) == store / "mlartifacts" / run_id / "artifacts"
    assert (store / "mlartifacts" / run_id / "artifacts" / "hello.txt").exists()


def test_an_older_store_with_the_misread_root_is_named_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store whose experiment an earlier bertpipe created with ``file:////<abs>``: MLflow
    keeps that root; each connect warns once, naming where the artifacts really go."""
    import mlflow

    uri = sqlite_uri(tmp_path / "mlflow.db")
    old_root = "file://" + str(tmp_path / "mlartifacts").replace("/", "//", 1)
    assert old_root.startswith("file:////")
    mlflow.MlflowClient(uri).create_experiment("old", artifact_location=old_root)
    actual = _misread_target(tmp_path / "mlartifacts")
    assert tracking_client.misread_artifact_root(old_root) == str(actual)
    assert tracking_client.misread_artifact_root((tmp_path / "x").as_uri()) is None
    assert tracking_client.misread_artifact_root("s3://bucket/x") is None
    caplog.set_level(logging.WARNING, logger="bertpipe.tracking")
    tracking.connect(tracking.TrackingConfig(uri=uri, experiment="old"))
    (line,) = [r.getMessage() for r in caplog.records if "artifact root" in r.getMessage()]
    assert old_root in line and f"reads as {actual}" in line and "docs/tracking.md" in line
    caplog.clear()
    tracking.connect(tracking.TrackingConfig(uri=uri, experiment="new"))
    assert not [r for r in caplog.records if "artifact root" in r.getMessage()]


# ------------------------------------------------------------------ as a user who is not root

_CHILD = """
import json, sys
import mlflow
from bertpipe import tracking
cfg = tracking.TrackingConfig(uri=sys.argv[1], experiment="home", system_metrics=False)
with tracking.start_run(cfg, "preprocess") as run:
    artifact_uri = mlflow.get_artifact_uri()
    tracking.log_text("hello", "hello.txt")
exp = mlflow.MlflowClient().get_experiment(run.info.experiment_id)
print(json.dumps({"run_id": run.info.run_id, "artifact_uri": artifact_uri,
                  "location": exp.artifact_location}))
"""


@pytest.fixture
def home_user() -> Iterator[tuple[str, Path]]:
    """A throwaway user (``useradd``) with its home ``/home/<name>``; removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip(f"creating a user needs root (this test runs as uid {os.geteuid()})")
    useradd, userdel, setpriv = (shutil.which(p) for p in ("useradd", "userdel", "setpriv"))
    if not (useradd and userdel and setpriv):
        pytest.skip("useradd, userdel and setpriv are needed to run a step as another user")
    name = f"bp{uuid.uuid4().hex[:10]}"
    home = Path("/home") / name
    made = subprocess.run(
        [useradd, "--no-create-home", "--home-dir", str(home), "--shell", "/bin/sh", name],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"useradd failed: {made.stderr.strip()}")
    try:
        home.mkdir(parents=True)
        entry = pwd.getpwnam(name)
        os.chown(home, entry.pw_uid, entry.pw_gid)
        yield name, home
    finally:
        subprocess.run([userdel, name], capture_output=True)
        shutil.rmtree(home, ignore_errors=True)


def test_a_user_who_is_not_root_keeps_artifacts_beside_a_store_in_their_home(
    home_user: tuple[str, Path],
) -> None:
    """The store ``sqlite:////home/<user>/runs/mlflow.db``, run by that user: MLflow resolves
    the artifacts to ``/home/<user>/runs/mlartifacts`` and writes them there (the old root
    sent them to ``/<user>/runs/...``, which such a user cannot create)."""
    name, home = home_user
    entry = pwd.getpwnam(name)
    for folder in (REPO, Path(sys.executable).parent):
        # checked as the user (os.access as root always succeeds): a clone in a private
        # folder (`mktemp -d` makes one) cannot be run by anyone else
        readable = subprocess.run(
            ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups",
             "test", "-r", str(folder), "-a", "-x", str(folder)],
            capture_output=True,
        )  # fmt: skip
        if readable.returncode != 0:
            pytest.skip(f"{folder} is not readable by the user {name} (a private folder above it)")
    store = home / "runs"
    sqlite_uri(store / "mlflow.db")
    for path in (store, store / "mlflow.db"):
        os.chown(path, entry.pw_uid, entry.pw_gid)
    uri = f"sqlite:///{store / 'mlflow.db'}"
    assert uri.startswith(f"sqlite:////home/{name}/")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "PYTHONDONTWRITEBYTECODE": "1",
        "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
    }
    done = subprocess.run(
        [
            "setpriv",
            f"--reuid={entry.pw_uid}",
            f"--regid={entry.pw_gid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",  # no capability left: the user's own permissions only
            sys.executable,
            "-c",
            _CHILD,
            uri,
        ],
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    beside = store / "mlartifacts"
    assert got["location"] == beside.as_uri()
    assert _local(got["artifact_uri"]) == beside / got["run_id"] / "artifacts"
    written = beside / got["run_id"] / "artifacts" / "hello.txt"
    assert written.read_text() == "hello" and written.stat().st_uid == entry.pw_uid
    assert not Path("/", name).exists()  # where the old root sent them


# ------------------------------------------------------------------ a server that is not there


def test_nothing_listening_at_the_tracking_uri_is_one_line_within_seconds(tmp_path: Path) -> None:
    import mlflow.tracking  # noqa: F401  (imported before the clock starts: seconds on a busy machine)

    uri = f"http://127.0.0.1:{free_port()}"
    cfg = tracking.TrackingConfig(uri=uri, system_metrics=False)
    started = time.monotonic()
    with (
        pytest.raises(tracking_client.TrackingUnreachableError) as info,
        tracking.start_run(cfg, "pretrain"),
    ):
        pytest.fail("a run started without a server")
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert message.startswith(f"tracking.uri: no MLflow tracking server answers at {uri} ")
    assert "connection refused" in message and "\n" not in message
    assert elapsed < tracking_client.PROBE_SECONDS + 5, elapsed


def test_only_rank_0_asks_for_the_server_before_a_new_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 logs to MLflow, the other ranks never: a rank on a node that cannot reach the
    server is not refused (rank 0 is, when the server is not there)."""
    cfg = tracking.TrackingConfig(uri=f"http://127.0.0.1:{free_port()}", system_metrics=False)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("RANK", "1")
    started = time.monotonic()
    tracking_client.check_new_run(cfg)
    assert time.monotonic() - started < tracking_client.PROBE_SECONDS - 1  # no probe
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(tracking_client.TrackingUnreachableError):
        tracking_client.check_new_run(cfg)


def test_a_server_that_never_answers_is_named_after_the_probe_time() -> None:
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)  # connections are queued, never accepted or answered
        uri = f"http://127.0.0.1:{hole.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(tracking_client.TrackingUnreachableError, match="timed out"):
            tracking_client.check_reachable(uri)
        elapsed = time.monotonic() - started
    assert tracking_client.PROBE_SECONDS - 0.5 < elapsed < tracking_client.PROBE_SECONDS + 2


def test_any_http_answer_counts_as_reachable_and_the_env_names_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server that answers the probe with 404 (a proxy, an older server) is left to MLflow's
    own calls; the URI from ``$MLFLOW_TRACKING_URI`` is named as such."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_error(404)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        tracking_client.check_reachable(f"http://127.0.0.1:{server.server_address[1]}")
        assert time.monotonic() - started < 2
    finally:
        server.shutdown()
        server.server_close()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    cfg = tracking.TrackingConfig(system_metrics=False)
    with pytest.raises(tracking_client.TrackingUnreachableError) as info:
        tracking.connect(cfg, probe_seconds=0)
    assert str(info.value).startswith("tracking.uri ($MLFLOW_TRACKING_URI): ")


def test_an_unreachable_mlflow_server_is_not_blamed_on_object_storage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """urllib3's ``NewConnectionError`` is a ``ConnectTimeoutError``, as botocore names its
    own: the storage check must not take an MLflow call's failure for an S3 endpoint's."""
    import mlflow

    from bertpipe.storage_check import describe, is_permanent

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    client = mlflow.MlflowClient(tracking_uri=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(Exception) as info:
        client.search_experiments()
    assert describe(info.value) is None and not is_permanent(info.value)


def test_quick_http_settings_are_restored_when_threads_leave_out_of_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "7")
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    entered, release = threading.Barrier(2), threading.Event()
    seen: list[str | None] = []

    def other() -> None:
        with tracking_client.quick_http():
            entered.wait()
            release.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    with tracking_client.quick_http(upload=True):
        entered.wait()
        seen.append(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT"))  # an upload sets none
    seen.append(os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES"))  # the other is inside
    seen.append(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT"))
    release.set()
    thread.join()
    assert seen == [None, "0", str(tracking_client.HTTP_TIMEOUT)]
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "7"
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ


def test_the_early_check_skips_resumed_runs_and_disabled_tracking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``check_new_run`` (pretrain, finetune and sweep call it before DeepSpeed starts)
    refuses a new run without its server, and leaves a run that will resume from
    ``latest`` to go on while the server is down, as before."""
    monkeypatch.setattr(tracking_client, "PROBE_SECONDS", 0.0)  # one attempt
    cfg = tracking.TrackingConfig(uri=f"http://127.0.0.1:{free_port()}")
    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(tracking_client.TrackingUnreachableError):
        tracking.check_new_run(cfg, str(checkpoints))
    checkpoints.mkdir()
    (checkpoints / "latest").write_text("global_step4")
    tracking.check_new_run(cfg, str(checkpoints))  # resumes: no probe, no error
    tracking.check_new_run(tracking.TrackingConfig(uri=cfg.uri, enabled=False))


_STORE_ERROR = """
import sys
import sqlalchemy, sqlalchemy.orm
from mlflow.exceptions import MlflowException
from mlflow.store.db import utils
from bertpipe.logs import setup_logging
setup_logging("INFO")
engine = sqlalchemy.create_engine("sqlite:///" + sys.argv[1])
sessions = utils._get_managed_session_maker(sqlalchemy.orm.sessionmaker(bind=engine), "sqlite")
try:
    with sessions() as session:  # a real sqlite error through MLflow's session handling
        session.execute(sqlalchemy.text("SELECT * FROM no_such_table"))
except MlflowException as e:
    print("raised:", type(e.__cause__).__name__)
"""


def test_a_store_error_mlflow_raises_to_bertpipe_is_one_line_without_its_traceback(
    tmp_path: Path,
) -> None:
    """MLflow's sqlite store logs a database error with its traceback and raises it; bertpipe
    handles it (retried, or buffered by the outbox and replayed: a ``database is locked``
    while parallel trials write to one store), so the console shows the error's first line."""
    proc = subprocess.run(
        [sys.executable, "-c", _STORE_ERROR, str(tmp_path / "store.db")],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.stdout.strip() == "raised: OperationalError", proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0].endswith(
        " WARNING mlflow.store.db.utils: MLflow store: (sqlite3.OperationalError) no such"
        " table: no_such_table"
    ), lines
