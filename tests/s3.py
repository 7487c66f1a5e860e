"""A real S3 server for the tests: moto's server mode (a full HTTP S3 API) in a subprocess on
127.0.0.1, with authentication on, so that clients talk to it exactly as to MinIO or Ceph:
through s3fs/boto3 with ``AWS_ENDPOINT_URL`` and an access key of a user it knows.

``S3Server(log_dir, host=ADDR, netns=NAME)`` runs it on a test host instead (a network
namespace of :mod:`tests.netns`, listening on that host's address): the object storage of a
multi-host test, which this process cannot reach, so its own requests (the readiness probe,
users, buckets) run as ``python -c`` on that host.

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
from typing import Any

REGION = "us-east-1"
# moto checks signatures only after its first unauthenticated actions: the three that make
# the test user (create_user, create_access_key, put_user_policy)
_SETUP_ACTIONS = 3


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/moto-api/", timeout=2):
                return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)


def _create_user(
    url: str, name: str, actions: list[str] | str, key: str, secret: str
) -> tuple[str, str]:
    """A user allowed ``actions`` (``"*"``: everything); its access key and secret."""
    import boto3

    iam = boto3.client(
        "iam",
        endpoint_url=url,
        region_name=REGION,
        aws_access_key_id=key,
        aws_secret_access_key=secret,
    )
    iam.create_user(UserName=name)
    made = iam.create_access_key(UserName=name)["AccessKey"]
    policy = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}],
    }
    iam.put_user_policy(UserName=name, PolicyName="policy", PolicyDocument=json.dumps(policy))
    return made["AccessKeyId"], made["SecretAccessKey"]


def _create_bucket(url: str, name: str, key: str, secret: str) -> None:
    import boto3

    boto3.client(
        "s3",
        endpoint_url=url,
        region_name=REGION,
        aws_access_key_id=key,
        aws_secret_access_key=secret,
    ).create_bucket(Bucket=name)


class S3Server:
    """``python -m moto.server`` on a free port of 127.0.0.1 (or ``host`` in network namespace
    ``netns``), with one IAM user allowed everything; :meth:`env` gives the variables a
    client (or a child process) needs."""

    def __init__(self, log_dir: Path, host: str = "127.0.0.1", netns: str | None = None) -> None:
        self.log_dir = log_dir
        self.netns = netns
        self._on_host = ["ip", "netns", "exec", netns] if netns else []
        self.port = _free_port() if netns is None else 9000
        self.url = f"http://{host}:{self.port}"
        self.host = host
        self.key = ""
        self.secret = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def _call(self, name: str, *args: Any, timeout: float = 60) -> Any:
        """Module function ``name`` of this file called with ``args`` where the server is
        reachable: here, or as ``python -c`` on the server's test host."""
        if self.netns is None:
            return globals()[name](*args)
        code = (
            "import json, sys\n"
            "from tests import s3\n"
            f"print(json.dumps(getattr(s3, {name!r})(*json.loads(sys.argv[1]))))\n"
        )
        done = subprocess.run(
            [*self._on_host, sys.executable, "-c", code, json.dumps(args)],
            capture_output=True,
            text=True,
            timeout=timeout + 30,
            cwd=Path(__file__).resolve().parent.parent,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{name} on {self.netns}: {done.stderr[-2000:]}")
        return json.loads(done.stdout.splitlines()[-1])

    def start(self) -> None:
        env = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(_SETUP_ACTIONS))
        log = open(self.log_dir / "moto.log", "wb")  # noqa: SIM115 (kept for the process)
        self.proc = subprocess.Popen(
            [*self._on_host, sys.executable, "-m", "moto.server", "-H", self.host,
             "-p", str(self.port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        if not self._call("_wait_ready", self.url, 60) or self.proc.poll() is not None:
            raise RuntimeError(f"moto server did not start: {self.log_dir}/moto.log")
        self.key, self.secret = self._call(
            "_create_user", self.url, "bertpipe-test", "*", "setup", "setup"
        )

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
        key, secret = self._call("_create_user", self.url, name, actions, self.key, self.secret)
        return {**self.env(), "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}

    def make_bucket(self, prefix: str = "bp") -> str:
        """A new, empty bucket; returns its ``s3://`` URL."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self._call("_create_bucket", self.url, name, self.key, self.secret)
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
