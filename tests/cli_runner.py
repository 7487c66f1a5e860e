"""``bertpipe`` run in the test process, for the runs that need no process of their own.

A ``bertpipe pretrain`` child costs ~15 s before its first step on 2 cores (torch, DeepSpeed and
MLflow imported again) whatever it trains; the same command in the test process starts at
once. :func:`run_cli` runs :func:`bertpipe.app.cli.main` with a child's environment, output and
exit status, so a test written against ``subprocess.run`` asserts the same things. What still
needs a real process keeps one: a signal the run sends itself (SIGKILL, or a SIGTERM whose
handler is the test's subject), ranks of a launcher, a process group, a killed upload.

The process's state is the child's as far as the run can see it: ``os.environ`` is replaced
by ``env`` for the call (the fault provider installed by ``tests/conftest.py`` reads it then),
torch computes on ``OMP_NUM_THREADS`` threads as a child would, logging starts from nothing
and the test's own handlers (pytest's capture) are put back after.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence

import torch

# the one-process job this process belongs to (formed by its first run, kept by torch until
# the process ends): every run here joins it, whatever a child's environment would say
_JOB = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update({k: saved[k] for k in _JOB if k in saved})
    try:
        yield
    finally:
        job = {k: os.environ[k] for k in _JOB if k in os.environ}
        os.environ.clear()
        os.environ.update(saved)
        os.environ.update(job)


@contextlib.contextmanager
def _fresh_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    for handler in handlers:
        root.removeHandler(handler)
    try:
        yield
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            if getattr(handler, "_bertpipe", False):
                handler.close()
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def run_cli(
    args: Sequence[str], env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``bertpipe ARGS`` in this process: the exit status and the text it wrote, as
    ``subprocess.run(..., capture_output=True, text=True)`` gives a child's. An error
    ``bertpipe`` does not turn into a message (a child's traceback and status 1) comes back the
    same way."""
    from bertpipe.app.cli import main

    env = dict(os.environ if env is None else env)
    threads = int(env.get("OMP_NUM_THREADS") or torch.get_num_threads())
    out, err = io.StringIO(), io.StringIO()
    with (
        _environment(env),
        _fresh_logging(),
        _threads(threads),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's refusals, --help
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
            if isinstance(exc.code, str):
                print(exc.code, file=sys.stderr)
        except Exception:  # a child prints the traceback and exits 1
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(
        ["bertpipe", *args], code, stdout=out.getvalue(), stderr=err.getvalue()
    )
