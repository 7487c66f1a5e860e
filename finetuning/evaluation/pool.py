"""A suite's trials in worker processes (``parallel`` > 1): :func:`run_pool`, how many at once
(:func:`parallelism`), and what a SIGTERM does to them.

Each worker is spawned, is a one-process job of its own (not the launcher's job the suite may
have been started in) and computes on its threads and, on a GPU machine, its own GPU.

**SIGTERM.** A scheduler's SIGTERM reaches the suite's process and, sent to the process group,
its workers; the suite exits 143 once every worker has ended, and no worker starts another
trial. A worker in a trial stops it at its next step with a checkpoint (the trial's own
handler: :class:`~bertpipe.training.core.cadence.StopFlag`; a SIGTERM that came while the
trial was starting is handed to it by :class:`~bertpipe.training.core.cadence.SigtermLatch`)
and ends when the trial returns; a worker between trials ends at once. The suite passes the
signal on to its workers, so a SIGTERM sent to the suite's process alone stops the trials too.
Ctrl-C does the same (workers ignore SIGINT; the suite sends them a SIGTERM) and exits 130.
``concurrent.futures`` alone hangs here: a worker that dies between trials breaks the pool, the
pool signals the other workers and waits for them, and one that has saved its stopped trial
then waits for its next trial for ever (seen in CI, reproduced in
``tests/finetuning/test_trial_pool.py``).

A worker that ends for another reason (killed, out of memory) fails the suite with one line;
the finished trials are kept for the next attempt.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from bertpipe.config import ConfigError
from bertpipe.errors import TERMINATED_EXIT_CODE, Terminated, TransientError
from bertpipe.training.core.cadence import SigtermLatch

log = logging.getLogger(__name__)

__all__ = ["TrialWorkerLostError", "parallelism", "run_pool"]


class TrialWorkerLostError(TransientError):
    """A trial's worker process ended before its trial did (exit status 75: rerun)."""


def _devices() -> int:
    """GPUs this process can use (0 on CPU)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return accelerator.device_count() if accelerator.device_name() == "cuda" else 0


def parallelism(parallel: int, threads_per_trial: int, pending: int) -> tuple[int, int, int]:
    """(processes, threads per trial, GPUs): ``parallel`` or one per GPU, else one per 4
    cores; never more processes than pending trials."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    gpus = _devices()
    processes = parallel or (gpus if gpus else max(1, cores // 4))
    if gpus and processes > gpus:
        raise ConfigError("parallel", f"{processes} trials at once need a GPU each: {gpus} here")
    processes = max(1, min(processes, pending))
    threads = threads_per_trial or max(1, cores // processes)
    return processes, threads, gpus


class _WorkerSigterm(SigtermLatch):
    """A worker's SIGTERM: remembered during a trial (whose own handler takes over once it
    trains), the worker's end between trials."""

    in_trial = False

    def __call__(self, signum: int, frame: object) -> None:
        super().__call__(signum, frame)
        if not self.in_trial:  # nothing to save; ending now is what keeps the suite from waiting
            os._exit(TERMINATED_EXIT_CODE)


_sigterm = _WorkerSigterm()


def _worker_init(threads: int, devices: Any, level: int) -> None:
    """A trial worker: its SIGTERM handler, a one-process job of its own, its threads, its GPU
    (one each), the parent's log level."""
    signal.signal(signal.SIGTERM, _sigterm)
    # Ctrl-C reaches the whole foreground group: the suite turns it into a SIGTERM for its
    # workers (a checkpoint at the next step) instead of a KeyboardInterrupt anywhere in them
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from bertpipe.logs import setup_logging

    # a one-process job of its own, whatever launcher started the suite: no MASTER_PORT, so
    # init_distributed's store binds a port the kernel assigns (workers start together: a
    # port found free beforehand could be taken by the other worker first)
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1"
    )
    os.environ.pop("MASTER_PORT", None)
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(devices.get())
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    setup_logging(logging.getLevelName(level))


def _in_worker(trial: Callable[[Any], dict[str, Any]], step: Any) -> dict[str, Any]:
    """``trial(step)`` in a worker; a worker that got a SIGTERM ends when its trial returns
    (a stopped trial's result is its checkpoint, on disk)."""
    _sigterm.in_trial = True
    try:
        return trial(step)
    finally:
        _sigterm.in_trial = False
        if _sigterm.received:
            os._exit(TERMINATED_EXIT_CODE)


def _stop_workers(futures: Sequence[concurrent.futures.Future[Any]], workers: set[int]) -> None:
    """No trial that has not started starts; the workers get the SIGTERM too (a SIGTERM sent
    to the suite's process alone reaches none of them)."""
    for future in futures:
        future.cancel()
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):  # ended already
            os.kill(pid, signal.SIGTERM)


def run_pool(
    trial: Callable[[Any], dict[str, Any]],
    steps: Sequence[Any],
    done: Callable[[dict[str, Any]], None],
    processes: int,
    threads: int,
    gpus: int,
) -> None:
    """``trial(step)`` for every step, ``processes`` at a time in spawned workers of
    ``threads`` threads (and a GPU each when ``gpus``); ``done`` sees each result, in order.
    ``trial`` must be importable by name (a module's function)."""
    context = multiprocessing.get_context("spawn")
    devices = None
    if gpus:
        devices = context.Queue()
        for i in range(processes):
            devices.put(i)
    level = logging.getLogger("bertpipe").getEffectiveLevel()
    others = {p.pid for p in multiprocessing.active_children() if p.pid}
    with concurrent.futures.ProcessPoolExecutor(
        processes, mp_context=context, initializer=_worker_init, initargs=(threads, devices, level)
    ) as pool:
        futures: list[concurrent.futures.Future[dict[str, Any]]] = []

        def workers() -> set[int]:
            children = multiprocessing.active_children()
            return {p.pid for p in children if p.pid and p.pid not in others}

        try:
            futures.extend(pool.submit(_in_worker, trial, step) for step in steps)
            for future in futures:  # in order: the first failure is the one reported
                done(future.result())
        except KeyboardInterrupt as stop:  # SIGTERM (Terminated) or Ctrl-C
            why = "SIGTERM" if isinstance(stop, Terminated) else "interrupted"
            log.warning("evaluate: %s: the trials in progress stop at their next step", why)
            _stop_workers(futures, workers())
            raise
        except BrokenProcessPool:
            _stop_workers(futures, workers())
            raise TrialWorkerLostError(
                "evaluate: a trial worker process ended before its trial did (killed, or out "
                "of memory?); the finished trials are kept: run the same command again to "
                "continue"
            ) from None
        except BaseException:
            for future in futures:
                future.cancel()
            raise
