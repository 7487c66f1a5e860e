"""bertpipe's S3 client rides out what object storage does under load: throttling
(``503 SlowDown``), connections reset before or in the middle of an answer, and stalled
answers. Every request goes over HTTP through :class:`tests.faultproxy.FaultProxy` to the
real test server; the proxy counts the faults it served, so each test shows they happened."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from bertpipe import fsio
from tests.faultproxy import FaultProxy

MiB = 2**20
PART = 5 * MiB  # S3's smallest multipart part


@pytest.fixture
def proxy(s3, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """A fault proxy in front of the test server, ``AWS_ENDPOINT_URL`` pointed at it."""
    import s3fs

    with FaultProxy(s3.server.url) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
        s3fs.S3FileSystem.clear_instance_cache()
        yield p
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3_conf(monkeypatch: pytest.MonkeyPatch) -> dict:
    """fsspec's ``s3`` config for this test only (what ``FSSPEC_S3`` sets), defaults filled."""
    conf: dict = {}
    monkeypatch.setitem(fsspec.config.conf, "s3", conf)
    fsio.apply_storage_defaults()
    return conf


def _data(size: int, seed: int = 0) -> bytes:
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _put_plain(s3, name: str, data: bytes) -> str:
    """Write ``data`` straight to the server (no proxy); return its s3:// URL."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3.server.url, skip_instance_cache=True)
    url = f"{s3.bucket}/{name}"
    fs.pipe(url, data)
    return url


def test_defaults_reach_the_client_and_user_settings_win(s3, s3_conf) -> None:
    fs, _ = fsio.to_fs(s3.bucket)
    fs.ls(s3.bucket)
    assert fs.s3.meta.config.retries == {"mode": "standard", "total_max_attempts": 8}
    # a user's FSSPEC_S3 is read when fsspec is imported: their keys stay, the rest is filled
    user = {
        "config_kwargs": {"retries": {"mode": "adaptive", "max_attempts": 3}, "read_timeout": 7}
    }
    code = "import json, fsspec, bertpipe.fsio; print(json.dumps(fsspec.config.conf['s3']))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "FSSPEC_S3": json.dumps(user)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out) == user


def test_reads_survive_throttling_and_resets(s3, s3_conf, proxy) -> None:
    data = _data(6 * MiB)
    url = _put_plain(s3, "big.bin", data)
    # one request meets them in turn (botocore's backoff doubles: keep the test short)
    proxy.inject("503", count=1, method="GET")
    proxy.inject("reset", count=1, method="GET")
    proxy.inject("reset_mid", count=2, method="GET", after_bytes=256 * 1024)
    with fsio.open_url(url, "rb") as f:  # how the stages read
        assert f.read() == data
    assert proxy.served == {"503": 1, "reset": 1, "reset_mid": 2}

    proxy.inject("reset_mid", count=1, method="GET", after_bytes=64 * 1024)
    proxy.inject("503", count=1, method="GET")
    fs, path = fsio.to_fs(url)
    with fs.open(path, "rb", block_size=MiB) as f:  # many small ranged reads
        got = b"".join(iter(lambda: f.read(MiB // 2), b""))
    assert got == data
    assert proxy.served == {"503": 2, "reset": 1, "reset_mid": 3}
    assert proxy.pending == 0


def test_download_to_a_file_survives_resets(s3, s3_conf, proxy, tmp_path: Path) -> None:
    data = _data(3 * MiB, seed=1)
    url = _put_plain(s3, "get.bin", data)
    proxy.inject("reset_mid", count=2, method="GET", after_bytes=128 * 1024)
    proxy.inject("503", count=1, method="GET")
    fs, path = fsio.to_fs(url)
    fs.get_file(path, str(tmp_path / "got.bin"))
    assert (tmp_path / "got.bin").read_bytes() == data
    assert proxy.served == {"reset_mid": 2, "503": 1}


@pytest.mark.xfail(
    strict=True,
    reason="s3fs 2026.9 cat_file of an object above its block size reads the part bodies "
    "outside its retry loop: a reset mid-body fails it (bertpipe's shard reads, cat_file, "
    "are retried by bertpipe's own loop: aiohttp's PayloadError is transient)",
)
def test_concurrent_cat_file_survives_a_reset_mid_body(s3, s3_conf, proxy) -> None:
    data = _data(4 * MiB, seed=2)
    url = _put_plain(s3, "cat.bin", data)
    s3_conf["default_block_size"] = MiB
    proxy.inject("reset_mid", count=1, method="GET", after_bytes=64 * 1024)
    fs, path = fsio.to_fs(url)
    assert fs.cat_file(path) == data


def test_multipart_uploads_survive_throttling_and_resets(s3, s3_conf, proxy, tmp_path) -> None:
    import s3fs

    s3_conf["default_block_size"] = PART  # what FSSPEC_S3 sets: multipart above 5 MiB
    data = _data(2 * PART + MiB, seed=3)  # three parts
    local = tmp_path / "upload.bin"
    local.write_bytes(data)
    plain = s3fs.S3FileSystem(endpoint_url=s3.server.url, skip_instance_cache=True)
    fs, root = fsio.to_fs(s3.bucket)
    parts = r"partNumber="

    proxy.inject("503", count=2, method="PUT", path_regex=parts)
    proxy.inject("reset", count=2, method="PUT", path_regex=parts)
    fs.put_file(str(local), f"{root}/put.bin", chunksize=PART)
    assert proxy.served == {"503": 2, "reset": 2}

    proxy.inject("503", count=1, method="PUT", path_regex=parts)
    proxy.inject("reset", count=1, method="PUT", path_regex=parts)
    fs.pipe(f"{root}/pipe.bin", data, chunksize=PART)
    assert proxy.served == {"503": 3, "reset": 3}

    proxy.inject("reset", count=1, method="PUT", path_regex=parts)
    proxy.inject("503", count=1, method="PUT", path_regex=parts)
    proxy.inject("503", count=1, method="POST", path_regex=r"uploadId=")  # the completion
    fsio.atomic_write_bytes(f"{s3.bucket}/atomic/out.bin", data)
    assert proxy.served == {"503": 5, "reset": 4}
    assert proxy.pending == 0

    uploads = [t for m, t in proxy.requests if m == "PUT" and "partNumber=" in t]
    assert len(uploads) >= 9 + 6  # three parts per upload, and the retries
    for name in ("put.bin", "pipe.bin", "atomic/out.bin"):
        assert plain.cat_file(f"{root}/{name}") == data, name


def test_a_stall_beyond_the_read_timeout_is_retried(s3, s3_conf, proxy) -> None:
    s3_conf["config_kwargs"]["read_timeout"] = 1  # FSSPEC_S3='{"config_kwargs": {...}}'
    data = _data(100_000, seed=4)
    url = _put_plain(s3, "slow.bin", data)
    proxy.inject("stall", count=1, method="GET", seconds=6)
    start = time.monotonic()
    with fsio.open_url(url, "rb") as f:
        assert f.read() == data
    elapsed = time.monotonic() - start
    assert proxy.served == {"stall": 1}
    assert 1 <= elapsed < 5  # abandoned after the 1 s timeout, not waited out
    assert sum(m == "GET" for m, _ in proxy.requests) == 2


def test_a_storage_call_stalled_by_the_server_is_reported_while_it_waits(
    s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The S3 server stopped (SIGSTOP) during an upload for 3.5 s, with the report threshold
    at 1 s: the upload waits and succeeds (as botocore retries it), and meanwhile the log
    says every second which URL it waits for and for how long."""
    import logging
    import signal
    import threading

    import s3fs

    monkeypatch.setenv(fsio.STALL_WARN_ENV, "1")
    source = tmp_path / "part.bin"
    source.write_bytes(_data(1 << 20))
    url = f"{s3.bucket}/stalled/part.bin"
    fs = s3fs.S3FileSystem()
    fs.pipe_file(f"{s3.bucket}/stalled/warm".removeprefix("s3://"), b"x")  # a live connection
    assert s3.server.proc is not None
    pid = s3.server.proc.pid
    os.kill(pid, signal.SIGSTOP)
    resume = threading.Timer(3.5, os.kill, [pid, signal.SIGCONT])
    resume.start()
    try:
        with caplog.at_level(logging.WARNING, "bertpipe.fsio"):
            fsio.retried(lambda: fs.put_file(str(source), url), f"uploading {url}")
    finally:
        resume.cancel()
        os.kill(pid, signal.SIGCONT)
    waiting = [r.getMessage() for r in caplog.records if "still waiting after" in r.getMessage()]
    assert len(waiting) >= 2, caplog.text
    assert all(m.startswith(f"uploading {url}: still waiting after ") for m in waiting)
    assert f"uploading {url}: done after" in caplog.text
    assert fs.cat_file(url.removeprefix("s3://")) == source.read_bytes()
