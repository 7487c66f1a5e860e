"""The life of a pre-training loader's DataLoader workers: started, stopped, killed if need be.

A worker's error reaches the training process as its own class with its one-line message
(:func:`_from_worker`), after the workers were stopped. Workers ignore SIGTERM and SIGINT
(preemption signals the whole process group; the trainer saves first), so nothing may leave
them to multiprocessing's exit hook, which sends SIGTERM and then waits forever: they are
stopped when the loader's generator (:func:`worker_batches`) ends or is closed, at
interpreter exit for loaders still alive then, and killed if they do not stop within
:data:`WORKER_STOP_GRACE` seconds (:func:`_stop_workers`); a worker whose parent dies is
killed by the kernel (:func:`_die_with_parent`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import logging
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Generator
from typing import Any

from torch.utils.data import DataLoader

from bertpipe.errors import BertpipeError

__all__ = ["WORKER_STOP_GRACE", "worker_batches", "worker_init_fn"]

log = logging.getLogger(__name__)

WORKER_STOP_GRACE = 3.0
"""Seconds loader workers get to finish the batch in hand once asked to stop (a long read,
a retry's backoff); then they are killed (SIGKILL: they ignore SIGTERM)."""


def worker_init_fn() -> Callable[[int], None]:
    """The ``worker_init_fn`` for a DataLoader whose workers this thread will fork (when it
    calls ``iter()`` on it): each worker ignores the stop signals and, if this is the main
    thread, dies with this process (:func:`_init_worker`)."""
    return functools.partial(
        _init_worker,
        os.getpid(),
        # the parent-death signal follows the thread that forks the workers
        threading.current_thread() is threading.main_thread(),
    )


def worker_batches(loader: DataLoader) -> Generator[Any, None, None]:
    """What ``loader`` (``num_workers`` >= 1, built with :func:`worker_init_fn`) yields: its
    workers are forked on the first ``next()`` and stopped (:func:`_stop_workers`) when the
    loader is exhausted, this generator is closed or a worker fails. A worker's
    :class:`~bertpipe.errors.BertpipeError` is raised here as its own class with its one-line
    message (:func:`_from_worker`), once the workers are stopped. Close the generator
    explicitly (``contextlib.closing``): that stops the workers at once."""
    iterator = iter(loader)  # forks the workers
    _track(iterator)
    error: BaseException | None = None
    try:
        # a loop, not `yield from`: closing this generator must not reach torch's iterator
        for batch in iterator:  # noqa: UP028
            yield batch
    except BertpipeError as exc:  # re-raised by torch with the worker's traceback inside
        error = _from_worker(exc)
        # torch's ExceptionWrapper.reraise() holds the exception it raises in a local of
        # its own frame: exception -> traceback -> that frame -> exception, a cycle that
        # also holds the frames of the iterator's __next__ (and so the iterator). Only
        # the cycle collector would free it, maybe never before exit.
        exc.__traceback__ = None
    finally:
        # Stop the workers here, not when the iterator is freed: freed by the cycle
        # collector, its queues are closed (weakref finalizers) before its __del__ asks
        # the workers to stop, and at exit multiprocessing waits forever for workers
        # that ignore SIGTERM.
        _stop_workers(iterator)
    if error is not None:
        try:
            raise error  # outside the except clause: no __context__ keeps torch's error
        finally:
            error = None  # no cycle through this frame either


def _from_worker(exc: BertpipeError) -> BertpipeError:
    """A worker's error as it was raised there: torch re-raises it in the training process
    as ``Caught DataError in DataLoader worker process 0.`` + its traceback, whose last
    line holds the one-line message the command line should print. The class is kept
    (:class:`~bertpipe.errors.TransientError` exits with 75, other errors with 2)."""
    text = str(exc).rstrip()
    prefix = f"{type(exc).__name__}: "
    if not text.startswith("Caught "):
        return exc
    last = text.splitlines()[-1]
    message = last.split(prefix, 1)[1] if prefix in last else last
    try:
        return type(exc)(message)
    except TypeError:  # an error class with another constructor
        return exc


_live_iterators: weakref.WeakSet[Any] = weakref.WeakSet()
"""DataLoader iterators whose workers may still run; stopped at interpreter exit."""
_live_lock = threading.Lock()
_exit_hook_registered = False


def _track(iterator: Any) -> None:
    """Remember ``iterator`` (weakly) so that its workers are stopped at exit at the latest."""
    global _exit_hook_registered
    with _live_lock:
        _live_iterators.add(iterator)
        if not _exit_hook_registered:
            # atexit runs its hooks last registered first: ours runs before multiprocessing's
            # (which joins every child forever, after a SIGTERM the workers ignore) and
            # before torch's (after which _shutdown_workers does nothing); both registered
            # theirs when imported, which happened before
            import multiprocessing.util  # noqa: F401

            atexit.register(_stop_all_workers)
            _exit_hook_registered = True


def _stop_all_workers() -> None:
    """At interpreter exit: stop the workers of every iterator still alive (held by a global,
    an uncaught exception's traceback, a reference cycle), within one grace period."""
    with _live_lock:
        iterators = list(_live_iterators)
    deadline = time.monotonic() + WORKER_STOP_GRACE
    for iterator in iterators:
        _stop_workers(iterator, deadline)


def _stop_workers(iterator: Any, deadline: float | None = None) -> None:
    """Stop the worker processes of a DataLoader iterator now; the workers still running at
    ``deadline`` (default: :data:`WORKER_STOP_GRACE` from now) are killed. Returns with no
    worker of ``iterator`` alive and never raises (it runs while an error propagates).

    Torch's own ``_shutdown_workers`` joins each worker for up to 5 s and then only sends
    SIGTERM, which the workers ignore; so they are asked to stop as it asks them (its done
    event, a ``None`` on each index queue), given until ``deadline``, killed if need be, and
    only then is ``_shutdown_workers`` called, to join them and close the queues. No thread
    is started: this also runs in an atexit hook, where Python 3.12 refuses new threads.
    """
    with _live_lock:
        _live_iterators.discard(iterator)
    workers = list(getattr(iterator, "_workers", ()))
    if not any(_running(w) for w in workers):
        if workers and not getattr(iterator, "_shutdown", True):
            with contextlib.suppress(Exception):
                iterator._shutdown_workers()  # close the queues
        return
    if sys.is_finalizing():  # after the exit hooks: the queues' threads are gone
        _kill_workers(iterator)
        return
    try:  # the first half of _shutdown_workers, without its joins
        iterator._workers_done_event.set()
        for worker_id, active in enumerate(iterator._workers_status):
            if active:
                iterator._mark_worker_as_unavailable(worker_id, shutdown=True)
    except Exception:  # another torch version: they are killed at the deadline
        log.debug("asking the loader's workers to stop", exc_info=True)
    limit = time.monotonic() + WORKER_STOP_GRACE if deadline is None else deadline
    pending = [w for w in workers if _running(w)]
    while pending and (left := limit - time.monotonic()) > 0:
        multiprocessing.connection.wait([w.sentinel for w in pending], timeout=left)
        pending = [w for w in pending if w.exitcode is None]
    if pending:
        _kill_workers(iterator)
    try:
        iterator._shutdown_workers()  # joins them (at once now) and closes the queues
    except Exception:
        log.debug("shutting the loader's workers down", exc_info=True)


def _running(worker: Any) -> bool:
    """Started and not yet reaped (without polling: the check of a process not our own)."""
    popen = getattr(worker, "_popen", None)
    return popen is not None and popen.returncode is None


def _kill_workers(iterator: Any) -> None:
    """SIGKILL the iterator's workers that are still running, and wait for them."""
    if getattr(iterator, "_worker_pids_set", False):
        # torch's SIGCHLD handler would raise "DataLoader worker exited unexpectedly" in
        # the main thread for a killed worker whose pid it still watches
        iterator._worker_pids_set = False
        with contextlib.suppress(Exception):
            from torch.utils.data._utils.signal_handling import _remove_worker_pids

            _remove_worker_pids(id(iterator))
    workers = [w for w in getattr(iterator, "_workers", ()) if _running(w)]
    for w in workers:
        log.warning(
            "loader worker (pid %d) did not stop within %.0f s: killing it",
            w.pid,
            WORKER_STOP_GRACE,
        )
        with contextlib.suppress(ProcessLookupError):
            os.kill(w.pid, signal.SIGKILL)
    for w in workers:
        with contextlib.suppress(Exception):
            w.join(timeout=5.0)


def _init_worker(parent: int, die_with_parent: bool, worker_id: int) -> None:
    """The loader's ``worker_init_fn``: runs in each worker before its first batch."""
    _ignore_stop_signals()
    if die_with_parent:
        _die_with_parent(parent)


def _ignore_stop_signals() -> None:
    """Loader workers ignore SIGTERM and SIGINT: SLURM preemption, ``scancel`` and Ctrl-C
    signal the whole process group, and a worker that died first would fail the trainer's next
    batch before it could save. The trainer acts on the signal, saves and stops its workers
    (:func:`_stop_workers`); a worker whose parent is gone dies (:func:`_die_with_parent`)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this worker when its parent dies (Linux ``prctl``
    ``PR_SET_PDEATHSIG``; strictly: when the parent's thread that forked it ends): a worker
    busy in a read or a retry's backoff never reaches the check of its parent that torch's
    worker loop makes between batches (every 5 s when idle), and an orphan would hold the
    job's process group (and the scheduler's slot) open. Exits at once if the parent is
    already gone."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), 0, 0, 0) != 0:
                log.debug("prctl(PR_SET_PDEATHSIG): errno %d", ctypes.get_errno())
        except (OSError, AttributeError):  # no libc symbol: rely on torch's parent check
            log.debug("prctl is not available", exc_info=True)
    if os.getppid() != parent:  # died before the signal was armed
        os._exit(1)
