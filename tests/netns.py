"""Test hosts: Linux network namespaces on one bridge, so a test can place ranks on separate
"machines" with their own addresses, ports and links.

:class:`TestHosts` makes ``count`` namespaces (``bpnet-<pid>-<n>-h<i>``), each with loopback
up and one interface ``eth0`` holding ``192.0.2.<i+1>/24`` (TEST-NET-1, reserved for
documentation: nothing else uses it), joined by veth pairs to a bridge in a namespace of its
own (``...-br``). No route leads anywhere else: the hosts reach each other and nothing more.
The file system, users and host name stay shared, as on nodes with one shared file system.

Commands run on host ``i`` through ``ip netns exec`` (:meth:`TestHosts.popen`), each in a
process group of its own that :meth:`TestHosts.kill_host` and :meth:`TestHosts.close` end,
together with anything else left in the namespace (``ip netns pids``). Names carry the pid of
the process that made them: parallel pytest workers never clash, and namespaces left by a
killed run are removed by the next one (:func:`remove_stale`). :func:`start_sshd` starts an
OpenSSH server on a host for launchers that reach nodes over ssh (pdsh).

Needs root and iproute2; :func:`netns_hosts` (a pytest fixture) skips with the reason when
either is missing or the kernel refuses namespaces.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

import pytest

PREFIX = "bpnet-"
SUBNET = "192.0.2"
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-\d+-(?:h\d+|br)$")
_SEQUENCE = itertools.count()  # several TestHosts in one process get distinct names


class NetnsUnavailableError(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip``, or the kernel refused)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise subprocess.CalledProcessError(
            result.returncode, ["ip", *args], result.stdout, result.stderr
        )
    return result


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace(name: str) -> None:
    """SIGKILL every process in namespace ``name`` (all of them were started by a test)."""
    for _ in range(50):
        pids = [int(p) for p in _ip("netns", "pids", name, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _delete(name: str) -> None:
    _kill_namespace(name)
    _ip("netns", "delete", name, check=False)


def remove_stale() -> list[str]:
    """Delete our namespaces whose creating process is gone (a killed test run); returns them."""
    removed = []
    for name in _namespaces():
        match = _NAME.match(name)
        if match and not _alive(int(match.group(1))):
            _delete(name)
            removed.append(name)
    return removed


class TestHosts:
    """``count`` test hosts on one bridge; a context manager (``with TestHosts(2) as hosts``)."""

    __test__ = False  # not a test class, whatever its name

    def __init__(self, count: int = 2) -> None:
        if not 1 <= count <= 250:
            raise ValueError(f"count={count}: 1 to 250 hosts")
        base = f"{PREFIX}{os.getpid()}-{next(_SEQUENCE)}"
        self.names = [f"{base}-h{i}" for i in range(count)]
        self.bridge = f"{base}-br"
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(count)]
        self._procs: list[list[subprocess.Popen[bytes]]] = [[] for _ in range(count)]

    # --- lifetime -----------------------------------------------------------------------

    def __enter__(self) -> TestHosts:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Make the namespaces, veth pairs and bridge; raises :class:`NetnsUnavailableError`."""
        if os.geteuid() != 0:
            raise NetnsUnavailableError("network namespaces need root (this is not root)")
        if shutil.which("ip") is None:
            raise NetnsUnavailableError("`ip` (iproute2) is not installed")
        remove_stale()
        try:
            _ip("netns", "add", self.bridge)
            _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                _ip("netns", "add", name)
                _ip("-n", name, "link", "set", "lo", "up")
                _ip(
                    "link", "add", "eth0", "netns", name, "type", "veth",
                    "peer", "name", f"v{i}", "netns", self.bridge,
                )  # fmt: skip
                _ip("-n", self.bridge, "link", "set", f"v{i}", "master", "br0")
                _ip("-n", self.bridge, "link", "set", f"v{i}", "up")
                _ip("-n", name, "addr", "add", f"{self.addrs[i]}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
            self.close()
            detail = getattr(err, "stderr", "") or ""
            raise NetnsUnavailableError(f"cannot make network namespaces: {err} {detail}") from err

    def close(self) -> None:
        """End every process on every host and delete the namespaces (idempotent)."""
        for i in range(len(self.names)):
            self.kill_host(i)
        for name in [*self.names, self.bridge]:
            _delete(name)

    # --- running things -----------------------------------------------------------------

    def popen(
        self,
        host: int,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str],
        log: Path | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd`` on host ``host`` with exactly ``env``, in a process group of its own;
        stdout and stderr go to ``log`` (appended) or are dropped."""
        out: IO[bytes] | int = log.open("ab") if log is not None else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.names[host], *cmd],
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            if not isinstance(out, int):
                out.close()  # the child holds its own copy
        self._procs[host].append(proc)
        return proc

    def run(
        self, host: int, cmd: Sequence[str], *, env: Mapping[str, str], timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` on host ``host`` to its end and capture its output."""
        return subprocess.run(
            ["ip", "netns", "exec", self.names[host], *cmd],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def pids(self, host: int) -> list[int]:
        """Every process in host ``host``'s namespace."""
        out = _ip("netns", "pids", self.names[host], check=False).stdout
        return [int(p) for p in out.split()]

    def kill_host(self, host: int, sig: signal.Signals = signal.SIGKILL) -> None:
        """Send ``sig`` to every process group started on ``host`` and, for SIGKILL, to every
        process left in its namespace (a machine losing power); reaps what it started."""
        for proc in self._procs[host]:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
        if sig == signal.SIGKILL:
            _kill_namespace(self.names[host])
            for proc in self._procs[host]:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)

    def link_down(self, host: int) -> None:
        """Unplug host ``host``'s cable (its bridge port goes down: nothing in or out)."""
        _ip("-n", self.bridge, "link", "set", f"v{host}", "down")

    def link_up(self, host: int) -> None:
        """Plug the cable back in."""
        _ip("-n", self.bridge, "link", "set", f"v{host}", "up")


@pytest.fixture(scope="module")
def netns_hosts() -> Iterator[TestHosts]:
    """Two test hosts (192.0.2.1 and 192.0.2.2) for the module; skips where they cannot be
    made (not root, no ``ip``, namespaces refused)."""
    try:
        hosts = TestHosts(2)
        hosts.open()
    except NetnsUnavailableError as err:
        pytest.skip(str(err))
    try:
        yield hosts
    finally:
        hosts.close()


# --- ssh -------------------------------------------------------------------------------------

SSHD = "/usr/sbin/sshd"


class SshKeys:
    """A client key, host keys and configs in ``folder``: what :func:`start_sshd` serves and
    ``ssh -F <config>`` (or pdsh with ``PDSH_SSH_ARGS``) uses to log in as root."""

    def __init__(self, folder: Path, hosts: TestHosts) -> None:
        if shutil.which("ssh-keygen") is None or not Path(SSHD).exists():
            raise NetnsUnavailableError(f"openssh-server is not installed (no {SSHD}, ssh-keygen)")
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.identity = folder / "id_ed25519"
        self.host_key = folder / "host_ed25519"
        for key in (self.identity, self.host_key):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
                check=True,
                timeout=30,
            )
        self.authorized = folder / "authorized_keys"
        self.authorized.write_text(self.identity.with_suffix(".pub").read_text())
        self.client_config = folder / "ssh_config"
        self.client_config.write_text(
            "".join(
                f"Host {name}\n    HostName {addr}\n"
                for name, addr in zip(host_names(hosts), hosts.addrs, strict=True)
            )
            + "Host *\n"
            f"    User root\n    IdentityFile {self.identity}\n    IdentitiesOnly yes\n"
            "    UserKnownHostsFile /dev/null\n    StrictHostKeyChecking no\n"
            "    LogLevel ERROR\n    BatchMode yes\n    ConnectTimeout 10\n"
        )
        for path in (self.identity, self.host_key):
            path.chmod(0o600)


def host_names(hosts: TestHosts) -> list[str]:
    """``node1``, ``node2``, ...: names the ssh config resolves to the hosts' addresses."""
    return [f"node{i + 1}" for i in range(len(hosts.names))]


def start_sshd(hosts: TestHosts, host: int, keys: SshKeys, timeout: float = 20) -> None:
    """An OpenSSH server on ``host``'s address, port 22, accepting ``keys``' client key for root;
    returns once it accepts connections."""
    config = keys.folder / f"sshd_config.{host}"
    config.write_text(
        f"ListenAddress {hosts.addrs[host]}:22\n"
        f"HostKey {keys.host_key}\n"
        f"PidFile {keys.folder / f'sshd.{host}.pid'}\n"
        f"AuthorizedKeysFile {keys.authorized}\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        "PermitUserEnvironment no\nX11Forwarding no\nPrintMotd no\nUseDNS no\n"
        "LogLevel ERROR\n"
    )
    # sshd refuses to start without its privilege separation folder (a service makes it)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    log = keys.folder / f"sshd.{host}.log"
    proc = hosts.popen(host, [SSHD, "-D", "-e", "-f", str(config)], env=os.environ, log=log)
    deadline = time.monotonic() + timeout
    probe = ["ssh", "-F", str(keys.client_config), host_names(hosts)[host], "true"]
    while True:
        result = hosts.run(host, probe, env=os.environ, timeout=timeout)
        if result.returncode == 0:
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"sshd on {hosts.addrs[host]} did not accept a login: {result.stderr.strip()}; "
                f"sshd log: {log.read_text()[-2000:] if log.exists() else ''}"
            )
        time.sleep(0.2)
