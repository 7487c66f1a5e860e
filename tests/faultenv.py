"""Faults asked for through the environment, for runs the tests cannot pass a ``Faults`` to.

The test suite's entry points install :func:`from_environ` as the fault provider of
:mod:`bertpipe.training.core.faults`: ``tests/conftest.py`` in the pytest process (a test sets a
variable with ``monkeypatch.setenv`` and runs in-process), ``tests/faultinject/
sitecustomize.py`` in the child processes tests start with ``tests/faultinject`` on
``PYTHONPATH`` (:func:`child_pythonpath`; every rank a launcher starts inherits it).
bertpipe itself reads none of these variables:

``BERTPIPE_FAULT_NAN_STEPS``
    ``5,6``, ``3-4`` or ``8-`` (optimizer steps of the run counted from 1; ``8-`` is every
    step from 8 on): those steps' loss is multiplied by NaN.
``BERTPIPE_FAULT_RAISE_STEP``
    ``6``: ``RuntimeError`` before step 6's first forward pass.
``BERTPIPE_FAULT_SIGNAL``
    ``TERM:5`` or ``KILL:13``: the process sends itself that signal before step 5 (13)
    starts: a preemption (the run saves at its next SIGTERM check) or a crash at a known
    point of a run.
``BERTPIPE_FAULT_RANK``
    ``1``: the three faults above on that rank only (default: every rank).
``BERTPIPE_FAULT_IN_SAVE``
    ``kill:TAG`` kills the process (SIGKILL) after DeepSpeed wrote checkpoint TAG's files
    and before bertpipe's state and ``latest``: a crash in the middle of a save (a full disk
    is a real small tmpfs: ``tests/training/test_crash_faults.py``). On object storage,
    ``kill-upload:TAG`` (SIGKILL) and ``term-upload:TAG`` (SIGTERM) hit the process after
    the first file of TAG's upload reached the store: a crash or a preemption mid-upload.
``BERTPIPE_FAULT_PREPROCESS_TERM``
    ``1``: a ``bertpipe preprocess`` job's driver gets SIGTERM once a process of the job
    has written that many shards (a preemption in the shard stage).
``BERTPIPE_FAULT_PREPROCESS_STALL``
    ``ReadTokenize:FILE`` or ``WriteShards:FILE``: the first element this process gets in
    that step of a ``bertpipe preprocess`` job writes FILE (its pid) and then waits, at most
    ``BERTPIPE_FAULT_STALL_S`` seconds (default 300), before it does the work: the test
    knows a worker holds a task of that stage, and loses the worker's host there.
``BERTPIPE_FAULT_PREPROCESS_HOLD``
    ``WriteShards:FILE``: while FILE exists, each element this process gets in that step
    waits (at most ``BERTPIPE_FAULT_STALL_S`` seconds) before it does the work, and
    ``FILE.held`` says it began to: a worker that cannot finish the stage before the test
    removes FILE.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from pathlib import Path

from bertpipe.training.core import faults

FAULT_NAN_STEPS = "BERTPIPE_FAULT_NAN_STEPS"
FAULT_RAISE_STEP = "BERTPIPE_FAULT_RAISE_STEP"
FAULT_RANK = "BERTPIPE_FAULT_RANK"
FAULT_SIGNAL = "BERTPIPE_FAULT_SIGNAL"
FAULT_IN_SAVE = "BERTPIPE_FAULT_IN_SAVE"
FAULT_PREPROCESS_TERM = "BERTPIPE_FAULT_PREPROCESS_TERM"
FAULT_PREPROCESS_STALL = "BERTPIPE_FAULT_PREPROCESS_STALL"
FAULT_PREPROCESS_HOLD = "BERTPIPE_FAULT_PREPROCESS_HOLD"
PREFIX = "BERTPIPE_FAULT_"

_INJECT = Path(__file__).resolve().parent / "faultinject"


def from_environ(rank: int, environ: Mapping[str, str] | None = None) -> faults.Faults:
    """The faults the environment (default: ``os.environ`` now) asks of rank ``rank``."""
    environ = os.environ if environ is None else environ
    source = {k: v for k, v in environ.items() if k.startswith(PREFIX)}
    kind, _, tag = environ.get(FAULT_IN_SAVE, "").partition(":")
    kinds = ("kill", "kill-upload", "term-upload")
    in_save = (kind, tag) if kind in kinds and tag else None
    only = environ.get(FAULT_RANK)
    if only is not None and int(only) != rank:
        return faults.Faults(in_save=in_save, source=source)
    nan_steps: set[int] = set()
    nan_from = None
    for item in filter(None, environ.get(FAULT_NAN_STEPS, "").replace(" ", "").split(",")):
        if item.endswith("-"):
            nan_from = int(item[:-1])
        elif "-" in item:
            first, last = (int(x) for x in item.split("-"))
            nan_steps.update(range(first, last + 1))
        else:
            nan_steps.add(int(item))
    raise_step = environ.get(FAULT_RAISE_STEP)
    signal_step = None
    if environ.get(FAULT_SIGNAL):
        name, _, step = environ[FAULT_SIGNAL].partition(":")
        signal_step = (int(getattr(signal, f"SIG{name.upper()}")), int(step))
    return faults.Faults(
        frozenset(nan_steps),
        nan_from,
        int(raise_step) if raise_step else None,
        in_save,
        signal_step,
        source,
    )


def install_from_environ() -> None:
    """Make this process's runs take their faults from the environment."""
    faults.install(from_environ)
    after = os.environ.get(FAULT_PREPROCESS_TERM)
    if after:
        _term_after_shards(int(after))
    limit_s = float(os.environ.get("BERTPIPE_FAULT_STALL_S", "300"))
    for name, hold in ((FAULT_PREPROCESS_STALL, False), (FAULT_PREPROCESS_HOLD, True)):
        value = os.environ.get(name)
        if value:
            step, _, path = value.partition(":")
            _stall_in(step, Path(path), limit_s, hold=hold)


def _stall_in(step: str, path: Path, limit_s: float, *, hold: bool) -> None:
    """The first element of that step in this process writes ``path`` and waits (``hold``
    false), or each element waits while ``path`` exists (``hold`` true); bounded, then the
    real work."""
    import time

    from bertpipe.preprocessing import pipeline

    cls = {"ReadTokenize": pipeline.ReadTokenizeFn, "WriteShards": pipeline.WriteShardFn}[step]
    real = cls.process
    stalled = [False]

    def process(self, element):  # type: ignore[no-untyped-def]
        if hold or not stalled[0]:
            stalled[0] = True
            deadline = time.monotonic() + limit_s
            if not hold:
                path.write_text(str(os.getpid()))
            elif path.exists():
                path.with_name(path.name + ".held").write_text(str(os.getpid()))
            while time.monotonic() < deadline and (path.exists() if hold else True):
                time.sleep(0.1)
        yield from real(self, element)

    cls.process = process  # type: ignore[method-assign]


def _term_after_shards(count: int) -> None:
    """``BERTPIPE_FAULT_PREPROCESS_TERM=N``: once this process has written N shards of a
    ``bertpipe preprocess`` job, the job's driver gets SIGTERM (a preemption in the middle
    of the shard stage): the driver itself, or the parent of a Beam SDK worker process."""
    from bertpipe.preprocessing import pipeline

    real = pipeline.WriteShardFn.process
    written = [0]

    def process(self, element):  # type: ignore[no-untyped-def]
        yield from real(self, element)
        written[0] += 1
        if written[0] == count:
            os.kill(_driver(), signal.SIGTERM)

    pipeline.WriteShardFn.process = process  # type: ignore[method-assign]


def _driver() -> int:
    """The ``bertpipe`` process this one belongs to: itself, or the ancestor of a Beam SDK
    worker (which the runner starts through ``sh -c``)."""
    pid = os.getpid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
        if b"bertpipe" in command and b"sdk_worker_main" not in command:
            return pid
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    return os.getpid()


def child_pythonpath(*folders: str | Path) -> str:
    """``PYTHONPATH`` for a child process that honours the fault variables: the injection
    hook's folder, then ``folders``."""
    return os.pathsep.join([str(_INJECT), *(str(f) for f in folders)])
