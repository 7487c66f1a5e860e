"""One run per output folder: the lease a run holds on its output while it lives.

Two runs writing one output (a job submitted twice, a requeue while the old job still runs, a
typo) overwrite each other's checkpoints, ``latest`` and summary, and the second reopens the
first's MLflow run. So a run takes a **lease** on its output before any work: the file
``<output>/.bertpipe-lease.json`` (a local folder, a shared file system or object storage),
created exclusively (``O_EXCL`` locally, a conditional ``If-None-Match: *`` put on S3), naming
the holder (host, pid, command, start time) and renewed by a thread every
``timeout_s / 4`` while the run lives. It is deleted when the run ends, however it ends
short of SIGKILL or a lost host.

A second run that finds the lease held is refused before it reads or writes anything, with one
line naming the holder (:class:`OutputInUseError`, exit status 2: the command is wrong, not
the storage). A lease whose holder is gone is **taken over** with a warning, so that a
requeue after a crash resumes:

- on the holder's own host, at once when its process is gone (the pid is not running, or is
  another process than the one that took the lease);
- from another host, when the lease was not renewed for ``timeout_s``: at once when its
  renewal time is that old by this host's clock, else after watching it for the rest of
  ``timeout_s`` on this host's monotonic clock (a renewal seen meanwhile means the holder
  lives: refused).

Object storage without conditional puts (some S3-compatible servers ignore ``If-None-Match``)
leaves a window of one round trip in which two runs started at the same moment both create the
lease; the holder reads it back after creating it and the later writer wins, so only one run
goes on in all but a simultaneous double write.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from bertpipe import fsio
from bertpipe.errors import BertpipeError

log = logging.getLogger(__name__)

__all__ = ["LEASE_NAME", "Holder", "Lease", "OutputInUseError", "OutputUnwritableError", "held"]

LEASE_NAME = ".bertpipe-lease.json"
_ACTIVE: set[str] = set()
"""Tokens of the leases this process holds now (a lease naming this pid but none of these is
a previous run of this process that did not end cleanly)."""


class OutputInUseError(BertpipeError):
    """Another live run holds the output's lease."""


class OutputUnwritableError(BertpipeError):
    """A local output where the lease cannot be written (a file, a read-only folder)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, as its file says."""

    host: str
    pid: int
    command: str
    started: float
    """Wall-clock time the lease was taken (seconds since the epoch)."""
    renewed: float
    """Wall-clock time of the last renewal."""
    token: str
    pid_start: str = ""
    """The holder process's start time (``/proc/<pid>/stat``), to tell a reused pid apart."""

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        return f"`bertpipe {self.command}` (pid {self.pid} on {self.host}, since {since})"


def _pid_start(pid: int) -> str:
    """The start time of process ``pid`` in clock ticks since boot ('' if unknown)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            stat = f.read()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22, counted after the command name


def _running(pid: int, start: str) -> bool:
    """Whether ``pid`` is the live process that started at ``start`` (on this host)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: it exists
    now = _pid_start(pid)
    return not (start and now and now != start)


class Lease:
    """The lease of ``folder`` for a run of ``command``. :meth:`acquire`, then :meth:`release`
    (or use :func:`held`)."""

    def __init__(self, folder: str, command: str, timeout_s: float = 60.0) -> None:
        self.folder = folder
        self.url = fsio.join(folder, LEASE_NAME)
        self.command = command
        self.timeout_s = timeout_s
        self.interval = max(0.5, timeout_s / 4)
        self.holder: Holder | None = None
        self._made: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the file

    def _read(self) -> Holder | None:
        """The lease as stored now; None when there is none. One that does not parse (a
        server that lost half of it) counts as a holder that is gone."""
        try:
            with fsio.open_url(self.url, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        try:
            return Holder(**json.loads(raw))
        except (ValueError, TypeError):
            log.warning("%s does not parse: treating it as a lease whose holder is gone", self.url)
            return Holder("?", -1, "?", 0.0, 0.0, "")

    def _create(self, holder: Holder) -> bool:
        """Write ``holder`` as the lease if there is none; False if one appeared first."""
        data = json.dumps(asdict(holder), indent=1).encode()
        fs, path = fsio.to_fs(self.url)
        if fsio.is_local(fs):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            return True
        try:
            fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        fs.invalidate_cache(path)
        return True

    def _write(self, holder: Holder) -> None:
        fsio.atomic_write_bytes(self.url, json.dumps(asdict(holder), indent=1).encode())

    def _delete(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            fsio.remove([self.url])

    # ------------------------------------------------------------------ taking it

    def _gone(self, other: Holder) -> str | None:
        """Why ``other``'s holder is gone (None: it lives), watching an unexpired lease of
        another host for the rest of its timeout."""
        if other.pid < 0:
            return "its lease file does not parse"
        if other.host == socket.gethostname():
            if other.pid == os.getpid():
                return None if other.token in _ACTIVE else "this process holds it no more"
            if _running(other.pid, other.pid_start):
                return None
            return f"pid {other.pid} is not running on {other.host}"
        age = time.time() - other.renewed
        if age >= self.timeout_s:
            return f"not renewed for {age:.0f} s"
        wait = self.timeout_s - max(age, 0.0)
        log.warning(
            "%s is held by %s, renewed %.0f s ago: waiting up to %.0f s for it to be renewed "
            "(refused) or to expire (taken over)",
            self.folder,
            other.describe(),
            max(age, 0.0),
            wait,
        )
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(min(self.interval / 2, max(0.1, deadline - time.monotonic())))
            now = self._read()
            if now is None or now.token != other.token:
                return "it was released" if now is None else None
            if now.renewed != other.renewed:
                return None
        return f"not renewed for {self.timeout_s:.0f} s"

    def acquire(self) -> None:
        """Take the lease, or raise :class:`OutputInUseError` naming the live holder (a
        local output that cannot be written: one line naming it)."""
        try:
            self._acquire()
        except OSError as exc:
            if not fsio.is_local(fsio.to_fs(self.url)[0]):
                raise
            what = exc.strerror or type(exc).__name__
            raise OutputUnwritableError(
                f"{self.folder} cannot be written ({what}): a run takes a lease on its output "
                "there; choose a writable output"
            ) from None

    def _acquire(self) -> None:
        fs, path = fsio.to_fs(self.folder)
        if fsio.is_local(fs) and not os.path.exists(path):
            self._made = path  # removed again at release if the run left it empty
        for _ in range(5):
            other = self._read()
            if other is not None:
                why = self._gone(other)
                if why is None:
                    latest = self._read() or other
                    raise OutputInUseError(
                        f"{self.folder} is in use by {latest.describe()}: a second run on one "
                        "output would overwrite its checkpoints; wait for it to end, or choose "
                        "another output"
                    )
                log.warning(
                    "%s: taking over the lease of %s (%s)", self.folder, other.describe(), why
                )
                if self._read() == other:
                    self._delete()
            now = time.time()
            mine = Holder(
                socket.gethostname(),
                os.getpid(),
                self.command,
                now,
                now,
                uuid.uuid4().hex,
                _pid_start(os.getpid()),
            )
            if not self._create(mine):
                continue  # another run created it first: look at it again
            back = self._read()  # the later writer wins where puts are not conditional
            if back is not None and back.token != mine.token:
                continue
            self.holder = mine
            _ACTIVE.add(mine.token)
            self._thread = threading.Thread(target=self._renew, name="bertpipe-lease", daemon=True)
            self._thread.start()
            log.info("%s: lease taken (renewed every %.0f s)", self.folder, self.interval)
            return
        raise OutputInUseError(
            f"{self.folder}: could not take its lease ({self.url}) in 5 attempts: other runs "
            "keep taking it; run one job per output"
        )

    def _renew(self) -> None:
        warned = False
        while not self._stop.wait(self.interval):
            assert self.holder is not None
            try:
                current = self._read()
                if current is not None and current.token != self.holder.token:
                    log.error(
                        "%s: the lease was taken over by %s (this run did not renew it for "
                        "%.0f s): two runs may now write this output",
                        self.folder,
                        current.describe(),
                        self.timeout_s,
                    )
                    return
                self.holder = Holder(**{**asdict(self.holder), "renewed": time.time()})
                self._write(self.holder)
                warned = False
            except Exception as exc:  # storage out: keep trying; the run goes on
                if not warned:
                    log.warning(
                        "%s: could not renew the lease: %s", self.url, fsio.redact(str(exc))
                    )
                    warned = True

    def release(self) -> None:
        """Stop renewing and delete the lease (if it is still this run's)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.holder is None:
            return
        _ACTIVE.discard(self.holder.token)
        try:
            current = self._read()
            if current is not None and current.token == self.holder.token:
                self._delete()
        except Exception as exc:  # the next run takes it over as a stale lease
            log.warning("%s: could not remove the lease: %s", self.url, fsio.redact(str(exc)))
        self.holder = None
        if self._made is not None:  # a run refused before any work leaves no empty output
            with contextlib.suppress(OSError):
                os.rmdir(self._made)


@contextlib.contextmanager
def held(
    folder: str, command: str, timeout_s: float, *, rank: int = 0, world_size: int = 1
) -> Iterator[Lease | None]:
    """The block run under the lease of ``folder``, taken by rank 0 of the job; with more
    than one rank the outcome is broadcast (a refusal is the same one-line error on every
    rank, so that no rank waits for a peer that stopped)."""
    lease = Lease(folder, command, timeout_s) if rank == 0 else None
    refusal: list[Any] = [None]
    if lease is not None:
        try:
            with fsio.storage_errors(lease.url):
                lease.acquire()
        except BertpipeError as exc:
            refusal[0] = (type(exc), str(exc))
    if world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        kind, message = refusal[0]
        raise kind(message)
    try:
        yield lease
    finally:
        if lease is not None:
            lease.release()
