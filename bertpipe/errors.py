"""The base class of errors caused by the user's input rather than by a bug.

The command line prints these as one line (``bertpipe: error: ...``) and exits with status 2;
anything else is a bug and keeps its traceback. :class:`TransientError` (storage that stayed
unreadable after the retries) exits with 75 (``EX_TEMPFAIL``) instead: rerunning the same
command may succeed, so schedulers retry it (docs/training.md, "Exit codes");
:class:`DiskFullError` (a checkpoint that does not fit) with 74 (``EX_IOERR``).
"""

from __future__ import annotations

__all__ = [
    "DISK_FULL_EXIT_CODE",
    "TEMPFAIL_EXIT_CODE",
    "TERMINATED_EXIT_CODE",
    "BertpipeError",
    "DiskFullError",
    "StorageAccessError",
    "Terminated",
    "TransientError",
]

TEMPFAIL_EXIT_CODE = 75
"""``EX_TEMPFAIL`` of sysexits.h: a temporary failure, the same command may succeed later."""
DISK_FULL_EXIT_CODE = 74
"""``EX_IOERR`` of sysexits.h: the disk is full (a checkpoint did not fit). Not retried by the
schedulers: a requeue would meet the same full volume."""
TERMINATED_EXIT_CODE = 143
"""128 + SIGTERM: what a shell and the schedulers report for a process stopped by SIGTERM."""


class BertpipeError(Exception):
    """Bad input, config or environment; the message says which and what to do."""


class TransientError(BertpipeError):
    """Storage that may come back (an I/O error, a timeout, a lost connection) still failed
    after the configured retries; exit status 75, the job is retried (not bad input)."""

    exit_code = TEMPFAIL_EXIT_CODE


class DiskFullError(BertpipeError):
    """A checkpoint does not fit on its file system (exit status 74): free space, rerun."""

    exit_code = DISK_FULL_EXIT_CODE


class StorageAccessError(BertpipeError):
    """Storage that refuses bertpipe for a reason retrying cannot fix: a missing bucket,
    credentials it does not accept, no permission, an endpoint that cannot be reached. The
    message names the URL and the setting to check, never a secret."""


class Terminated(KeyboardInterrupt):
    """A SIGTERM turned into an exception (see :func:`bertpipe.tracking.lifecycle.start_run`),
    so that ``finally`` blocks run and the stage's MLflow run ends KILLED instead of staying
    RUNNING; the command line exits with :data:`TERMINATED_EXIT_CODE`."""
