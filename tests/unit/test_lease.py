"""The output lease (:mod:`bertpipe.lease`) between real processes, on a local folder and on
the S3 test server: a live holder refuses a second run with one line naming it; a holder
whose process died (same host) is taken over at once; one on another host (a process in its
own UTS namespace, with another host name) is refused while it renews and taken over once it
stops renewing for the timeout."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bertpipe import fsio
from bertpipe.lease import LEASE_NAME, Lease, OutputInUseError

HOLD = """
import sys, time
from bertpipe.lease import Lease
lease = Lease(sys.argv[1], "pretrain", float(sys.argv[2]))
lease.acquire()
print("held", flush=True)
time.sleep(120)
"""


@pytest.fixture(params=["local", "s3"])
def folder(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "run")
    s3 = request.getfixturevalue("s3")
    return f"{s3.bucket}/run"


def _holder(folder: str, timeout: float, other_host: bool = False) -> subprocess.Popen[str]:
    command = [sys.executable, "-c", HOLD, folder, str(timeout)]
    if other_host:
        rename = 'hostname other-host && exec "$@"'
        command = ["unshare", "--uts", "sh", "-c", rename, "-", *command]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def test_a_live_holder_refuses_and_a_dead_one_is_taken_over(
    folder: str, procs: list[subprocess.Popen[str]], caplog: pytest.LogCaptureFixture
) -> None:
    holder = _holder(folder, 30)
    procs.append(holder)
    with pytest.raises(OutputInUseError) as error:
        Lease(folder, "pretrain", 30).acquire()
    message = str(error.value)
    assert "\n" not in message and f"pid {holder.pid} on {os.uname().nodename}" in message
    assert message.startswith(f"{folder} is in use by `bertpipe pretrain`")
    holder.send_signal(signal.SIGKILL)  # a crash: the lease stays behind
    holder.wait()
    assert fsio.exists(fsio.join(folder, LEASE_NAME))
    lease = Lease(folder, "pretrain", 30)
    with caplog.at_level(logging.WARNING, "bertpipe.lease"):
        lease.acquire()
    assert f"pid {holder.pid} is not running" in caplog.text
    lease.release()
    assert not fsio.exists(fsio.join(folder, LEASE_NAME))


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) for another host")
def test_a_holder_on_another_host_is_refused_while_it_renews_then_taken_over(
    folder: str, procs: list[subprocess.Popen[str]], caplog: pytest.LogCaptureFixture
) -> None:
    try:
        holder = _holder(folder, 2.0, other_host=True)
    except AssertionError:
        pytest.skip("cannot make a UTS namespace here (unshare --uts needs root)")
    procs.append(holder)
    started = time.monotonic()
    with pytest.raises(OutputInUseError, match="on other-host"):
        Lease(folder, "pretrain", 2.0).acquire()  # watches it until it is renewed
    assert time.monotonic() - started < 2.5
    holder.send_signal(signal.SIGSTOP)  # a host that stopped answering: no more renewals
    try:
        lease = Lease(folder, "pretrain", 2.0)
        with caplog.at_level(logging.WARNING, "bertpipe.lease"):
            lease.acquire()
        assert "not renewed for 2 s" in caplog.text
        with fsio.open_url(fsio.join(folder, LEASE_NAME), "rb") as f:
            assert json.loads(f.read())["pid"] == os.getpid()
        lease.release()
    finally:
        holder.send_signal(signal.SIGCONT)


def test_an_expired_lease_of_another_host_is_taken_over_at_once(folder: str) -> None:
    stale = {
        "host": "gone-host",
        "pid": 1,
        "command": "pretrain",
        "started": time.time() - 600,
        "renewed": time.time() - 300,
        "token": "x",
    }
    fsio.atomic_write_text(fsio.join(folder, LEASE_NAME), json.dumps(stale))
    started = time.monotonic()
    lease = Lease(folder, "finetune", 60)
    lease.acquire()
    assert time.monotonic() - started < 5
    lease.release()
