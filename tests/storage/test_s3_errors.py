"""Object storage that refuses bertpipe is reported in one line naming the URL and what to
check, never the secret: a missing bucket, a wrong secret, an unknown access key, an
unreachable endpoint. Against the real test server, over HTTP; the CLI as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from bertpipe import fsio
from bertpipe.errors import StorageAccessError
from bertpipe.storage_check import check_storage, describe, is_permanent
from tests.conftest import free_port

BERTPIPE = [sys.executable, "-m", "bertpipe.app.cli"]


def _tokenizer(s3, tmp_path: Path, inputs: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *BERTPIPE,
            "tokenizer",
            "train",
            f"input.paths=[{inputs}]",
            f"output={tmp_path / 'tok'}",
            "tracking.enabled=false",
        ],
        env=s3.child_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _one_line_error(proc: subprocess.CompletedProcess[str], *secrets: str) -> str:
    assert proc.returncode == 2, proc.stderr
    for secret in secrets:
        assert secret not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("bertpipe: error: ")
    return last


def test_cli_missing_bucket(s3, tmp_path: Path) -> None:
    url = f"s3://missing-{uuid.uuid4().hex[:10]}/corpus"
    last = _one_line_error(_tokenizer(s3, tmp_path, url), s3.env["AWS_SECRET_ACCESS_KEY"])
    assert url in last and "check the bucket name" in last
    assert s3.server.url in last  # the endpoint it asked


def test_cli_wrong_secret(s3, tmp_path: Path) -> None:
    wrong = "wrong-" + uuid.uuid4().hex
    url = f"{s3.bucket}/corpus"
    proc = _tokenizer(s3, tmp_path, url, AWS_SECRET_ACCESS_KEY=wrong)
    last = _one_line_error(proc, wrong, s3.env["AWS_SECRET_ACCESS_KEY"])
    assert url in last and "SignatureDoesNotMatch" in last
    assert "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in last
    # botocore's INFO lines on every start are quiet
    assert "Found credentials" not in proc.stderr


def test_check_storage_passes_and_leaves_nothing(s3) -> None:
    check_storage(f"{s3.bucket}/out", write=True)
    check_storage(f"{s3.bucket}/in/*.txt")
    fs, root = fsio.to_fs(s3.bucket)
    assert fs.find(root) == []  # the probe object is gone


def test_check_storage_missing_bucket(s3) -> None:
    url = f"s3://missing-{uuid.uuid4().hex[:10]}/out"
    with pytest.raises(StorageAccessError, match="check the bucket name") as info:
        check_storage(url, write=True)
    assert str(info.value).startswith(f"{url}: bucket missing-")


@pytest.mark.parametrize(
    ("var", "code"),
    [
        ("AWS_SECRET_ACCESS_KEY", "SignatureDoesNotMatch"),
        ("AWS_ACCESS_KEY_ID", "InvalidAccessKeyId"),
    ],
)
def test_check_storage_refused_credentials(s3, monkeypatch, var: str, code: str) -> None:
    import s3fs

    wrong = "WRONG" + uuid.uuid4().hex.upper()
    monkeypatch.setenv(var, wrong)
    s3fs.S3FileSystem.clear_instance_cache()
    url = f"{s3.bucket}/out"
    with pytest.raises(StorageAccessError) as info:
        check_storage(url)
    message = str(info.value)
    assert message.startswith(f"{url}: ") and f"({code})" in message
    assert "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in message
    assert wrong not in message and s3.env["AWS_SECRET_ACCESS_KEY"] not in message
    assert len(message.splitlines()) == 1
    # not transient: a storage read gives up at once, with the same line
    assert is_permanent(info.value.__cause__)
    start = time.monotonic()
    with pytest.raises(StorageAccessError, match="check AWS_ACCESS_KEY_ID") as listed:
        fsio.retried(lambda: fsio.list_files(url), "listing")  # a HEAD: 403 without a code
    assert str(listed.value).startswith(f"{url}: ")
    assert time.monotonic() - start < 5


def test_check_storage_unreachable_endpoint(s3, monkeypatch) -> None:
    import s3fs

    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    s3fs.S3FileSystem.clear_instance_cache()
    start = time.monotonic()
    with pytest.raises(StorageAccessError) as info:
        check_storage(f"{s3.bucket}/out", write=True)
    assert time.monotonic() - start < 10  # one retry, not the pipeline's eight attempts
    assert str(info.value) == (
        f"{s3.bucket}/out: cannot reach the storage endpoint {endpoint}: check "
        "AWS_ENDPOINT_URL and that the server is up"
    )


def test_raw_s3fs_errors_are_described(s3) -> None:
    """What the CLI's main() prints for an error a stage let through from s3fs."""
    import s3fs

    bucket = f"missing-{uuid.uuid4().hex[:10]}"
    with pytest.raises(FileNotFoundError) as missing:
        s3fs.S3FileSystem().cat_file(f"{bucket}/x")
    assert str(describe(missing.value)).startswith(f"s3://{bucket}: bucket {bucket} does not")
    wrong = s3fs.S3FileSystem(
        key=s3.env["AWS_ACCESS_KEY_ID"],
        secret="not-the-secret-" + uuid.uuid4().hex,
        skip_instance_cache=True,
    )
    with pytest.raises(PermissionError) as refused:
        wrong.cat_file(f"{s3.bucket}/x")
    assert "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in str(describe(refused.value))
    assert describe(ValueError("unrelated")) is None
    assert not fsio.is_transient(refused.value)


def test_check_storage_local_and_memory(tmp_path: Path) -> None:
    check_storage(str(tmp_path / "new" / "folder"), write=True)
    check_storage("memory://anything/x", write=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageAccessError, match="is a file, not a folder"):
        check_storage(str(tmp_path / "file" / "out"), write=True)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(StorageAccessError, match="permission denied"):
            check_storage(str(locked / "out"), write=True)


def test_redact_hides_credentials(monkeypatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value-123")
    assert fsio.redact("s3://key:pass@bucket/x") == "s3://key:***@bucket/x"
    assert (
        fsio.redact("https://h/b/k?X-Amz-Credential=AK%2F1&X-Amz-Signature=ab12&x=1")
        == "https://h/b/k?X-Amz-Credential=***&X-Amz-Signature=***&x=1"
    )
    assert fsio.redact("secret: s3cr3t-value-123") == "secret: ***"
