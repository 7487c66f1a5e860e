"""A real S3 server for the tests: moto's server mode (a full HTTP S3 API) in a subprocess on
127.0.0.1, with authentication on, so that clients talk to it exactly as to MinIO or Ceph:
through s3fs/boto3 with ``AWS_ENDPOINT_URL`` and an access key of a user it knows.

Nothing here mocks a client: every request is HTTP to the server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

REGION = "us-east-1"
# moto checks signatures only after its first unauthenticated actions: the three that make
# the test user (create_user, create_access_key, put_user_policy)
_SETUP_ACTIONS = 3


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """``python -m moto.server`` on a free port of 127.0.0.1, with one IAM user allowed
    everything; :meth:`env` gives the variables a client (or a child process) needs."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = ""
        self.secret = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(_SETUP_ACTIONS))
        log = open(self.log_dir / "moto.log", "wb")  # noqa: SIM115 (kept for the process)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/moto-api/", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(
                        f"moto server did not start: {self.log_dir}/moto.log"
                    ) from None
                time.sleep(0.1)
        self._make_user()

    def _make_user(self) -> None:
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id="setup",
            aws_secret_access_key="setup",
        )
        iam.create_user(UserName="bertpipe-test")
        key = iam.create_access_key(UserName="bertpipe-test")["AccessKey"]
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
        }
        iam.put_user_policy(
            UserName="bertpipe-test", PolicyName="all", PolicyDocument=json.dumps(policy)
        )
        self.key, self.secret = key["AccessKeyId"], key["SecretAccessKey"]

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """What a client needs: the endpoint (the server, or ``endpoint``: a proxy in front
        of it), the user's keys and a region. No AWS config file is read."""
        return {
            "AWS_ENDPOINT_URL": endpoint or self.url,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def user_env(self, name: str, actions: list[str]) -> dict[str, str]:
        """A new user allowed only ``actions`` (``s3:GetObject``...), and :meth:`env` with its
        keys: what a job whose credentials lost a permission meets (403 AccessDenied)."""
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
        )
        iam.create_user(UserName=name)
        key = iam.create_access_key(UserName=name)["AccessKey"]
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}],
        }
        iam.put_user_policy(UserName=name, PolicyName="only", PolicyDocument=json.dumps(policy))
        return {
            **self.env(),
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
        }

    def make_bucket(self, prefix: str = "bp") -> str:
        """A new, empty bucket; returns its ``s3://`` URL."""
        import boto3

        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id=self.key,
            aws_secret_access_key=self.secret,
        ).create_bucket(Bucket=name)
        return f"s3://{name}"

    def stop(self) -> None:
        if self.proc is None:
            return
        from tests.conftest import end_process_group

        proc, self.proc = self.proc, None
        end_process_group(proc, 20)


def running_server(log_dir: Path) -> Iterator[S3Server]:
    server = S3Server(log_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()
