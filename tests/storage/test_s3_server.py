"""The test S3 server is real HTTP S3 with authentication: s3fs reaches it through
``AWS_ENDPOINT_URL`` and refuses a wrong key."""

from __future__ import annotations

import pytest


def test_s3fs_round_trip_and_auth(s3) -> None:
    import s3fs

    fs = s3fs.S3FileSystem()
    path = s3.bucket.removeprefix("s3://") + "/a/b.bin"
    fs.pipe(path, b"x" * 1000)
    assert fs.cat(path) == b"x" * 1000
    wrong = s3fs.S3FileSystem(
        key=s3.env["AWS_ACCESS_KEY_ID"], secret="nope", skip_instance_cache=True
    )
    with pytest.raises(PermissionError):
        wrong.ls(s3.bucket.removeprefix("s3://"))
