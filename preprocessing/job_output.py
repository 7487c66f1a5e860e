"""A preprocessing job's output folder: checked before any work, continued after a
preemption, and the runner's processes stopped when the job is.

**Up front** (:func:`check_writable`): every folder the job writes (``output``, each phase
folder, the scratch folders ``_spill``, ``_progress``, ``_resume`` and each phase's
``_parts``) must take a file before anything is read or deleted: an ``output`` that is a file,
a read-only phase folder or mount fails with one line naming it (exit 2), and ``--overwrite``
has deleted nothing yet (the earlier dataset's manifests stay).

**Continuing** (:func:`check_output`): the job's identity (:func:`job_identity`: the config
that decides the data, the tokenizer's checksum, the read ranges of the input files as
planned, the buckets and shards) is written to ``_resume/job.json`` before the pipeline
starts; each finished task (a read range, a bucket, a shard) records what it made under
``_resume/`` (:func:`bertpipe.preprocessing.pipeline.finished`). The same command on an
output that holds a stopped job of the same identity, and no manifest, continues it: the
partial files of the tasks that were cut off (``.<name>.tmp-<uuid>``) are removed, finished
tasks are not run again, and the output is byte-identical to an uninterrupted run's. A
manifest means a finished dataset: refused without ``--overwrite`` as before; a stopped job of
another config or input is refused with one line (``--overwrite`` starts over).

**The workers' log** (:func:`worker_log_path`, :func:`beam_logs_to`): Beam's own logging and
the output of the direct runner's worker processes go to ``logs/<output name>-preprocess.log``
beside the output (not inside it: readers list the output's folders), not to the console. A
failed job's console keeps one line (:func:`worker_failure`) naming the input, the cause and
that log, which holds the workers' tracebacks.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import json
import logging
import os
import posixpath
import re
import shlex
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from apache_beam.portability import python_urns
from apache_beam.runners.portability.fn_api_runner import FnApiRunner

from bertpipe import fsio
from bertpipe.config import ConfigError, to_dict
from bertpipe.errors import BertpipeError, DiskFullError
from bertpipe.preprocessing.config import OPERATIONAL_KEYS, PreprocessConfig
from bertpipe.preprocessing.dedup import quality_folder, samples_folder
from bertpipe.preprocessing.pipeline import (
    Plan,
    TaskFailedError,
    manifest_url,
    parts_folder,
    progress_folder,
    resume_folder,
    spill_folder,
)
from bertpipe.preprocessing.ranges import ReadRange
from bertpipe.preprocessing.readers import InputGoneError
from bertpipe.preprocessing.tokenizer import TokenizerMismatchError

log = logging.getLogger(__name__)

__all__ = [
    "LoggedFnApiRunner",
    "OutputExistsError",
    "beam_logs_to",
    "check_output",
    "check_writable",
    "job_identity",
    "remove_scratch",
    "start_output",
    "worker_failure",
    "worker_log_path",
    "workers_stopped",
]

JOB_FILE = "job.json"


class OutputExistsError(BertpipeError, FileExistsError):
    """The output already holds results and ``overwrite`` is not set."""


def job_identity(plan: Plan, ranges: Sequence[ReadRange]) -> dict[str, Any]:
    """What makes two runs the same job (a continued job must be this one)."""
    config = {k: v for k, v in to_dict(plan.cfg).items() if k not in OPERATIONAL_KEYS}
    if not plan.cfg.quality.enabled:
        config.pop("quality", None)
    return {
        "config": config,
        "tokenizer_sha256": plan.tokenizer_sha256,
        "num_buckets": plan.num_buckets,
        "shards": plan.shards,
        "ranges": [[r.url, r.start, r.end, r.index, r.split, r.text_bytes] for r in ranges],
    }


def _digest(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def _stopped_job(cfg: PreprocessConfig) -> str | None:
    """The digest of the stopped job in ``cfg.output`` (None: none there)."""
    url = fsio.join(resume_folder(cfg.output), JOB_FILE)
    try:
        with fsio.open_url(url, "rb") as f:
            return str(json.loads(f.read())["digest"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def check_output(cfg: PreprocessConfig, identity: dict[str, Any], shard_file: Any) -> bool:
    """Whether the job continues a stopped one in ``cfg.output`` (see the module doc);
    raises :class:`OutputExistsError` for a finished dataset or another job's shards."""
    stopped = _stopped_job(cfg)
    same = stopped == _digest(identity)
    for phase in cfg.phases:
        folder = fsio.join(cfg.output, phase.name)
        existing = [u for u in fsio.list_files(folder) if shard_file.match(u.rsplit("/", 1)[-1])]
        has_manifest = fsio.exists(manifest_url(cfg.output, phase.name))
        if cfg.overwrite or not (existing or has_manifest) or (same and not has_manifest):
            continue
        if stopped is not None and not has_manifest:
            raise OutputExistsError(
                f"{folder} holds {len(existing)} shard(s) of a stopped job with another config "
                "or input: run it with its own config to continue it, pass --overwrite to start "
                "over, or choose another `output`"
            )
        raise OutputExistsError(
            f"{folder} already holds {len(existing)} shard(s)"
            f"{' and a manifest' if has_manifest else ''}: pass --overwrite to replace them "
            "or choose another `output`"
        )
    return same and not cfg.overwrite


def _writable_folders(cfg: PreprocessConfig) -> list[str]:
    folders = [cfg.output, spill_folder(cfg.output), progress_folder(cfg.output)]
    folders.append(resume_folder(cfg.output))
    if cfg.quality.enabled:
        folders += [quality_folder(cfg.output), samples_folder(cfg.output)]
    for phase in cfg.phases:
        folders += [fsio.join(cfg.output, phase.name), parts_folder(cfg.output, phase.name)]
    return folders


def check_writable(cfg: PreprocessConfig) -> None:
    """Every local folder the job writes takes a file (made if missing, a probe written and
    removed, the folders it made removed again); one line naming the first that does not
    (exit 2). Object storage is probed by the command's preflight."""
    for url in _writable_folders(cfg):
        fs, path = fsio.to_fs(url)
        if not fsio.is_local(fs):
            continue
        folder = Path(path)
        made = [p for p in (folder, *folder.parents) if not p.exists()]
        probe = folder / f".bertpipe-probe-{uuid.uuid4().hex}"
        try:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                probe.write_bytes(b"")
                probe.unlink()
            finally:
                for created in made:  # deepest first
                    with contextlib.suppress(OSError):
                        created.rmdir()
        except OSError as exc:
            what = exc.strerror or type(exc).__name__
            raise ConfigError(
                "output",
                f"{path} cannot be written ({what}): the job writes its shards and scratch "
                "files there; choose a writable output (nothing was read or deleted)",
            ) from None


def remove_scratch(cfg: PreprocessConfig) -> None:
    """The job's scratch folders (a finished or restarted job's)."""
    folders = [parts_folder(cfg.output, p.name) for p in cfg.phases]
    folders += [spill_folder(cfg.output), progress_folder(cfg.output), resume_folder(cfg.output)]
    folders.append(quality_folder(cfg.output))
    fsio.remove(folders, recursive=True)


def start_output(cfg: PreprocessConfig, identity: dict[str, Any], continuing: bool) -> None:
    """Make the output ready for the pipeline: a continued job loses only its tasks' partial
    files; a new one starts from empty scratch folders and records its identity."""
    if continuing:
        partial = _partial_files(cfg)
        fsio.remove(partial)
        log.info(
            "preprocess: continuing the stopped job in %s (finished tasks are kept; %d partial "
            "file(s) removed)",
            cfg.output,
            len(partial),
        )
        return
    if cfg.overwrite:  # readers must never pair an old manifest with new shards
        fsio.remove(manifest_url(cfg.output, p.name) for p in cfg.phases)
        fsio.remove([samples_folder(cfg.output)], recursive=True)
    remove_scratch(cfg)
    fsio.remove(_partial_files(cfg))
    record = {"digest": _digest(identity), "identity": identity}
    fsio.atomic_write_text(fsio.join(resume_folder(cfg.output), JOB_FILE), json.dumps(record))


def _partial_files(cfg: PreprocessConfig) -> list[str]:
    """Files a task was writing when the job stopped (``fsio.atomic_writer``'s temporaries)."""
    found = []
    folders = [quality_folder(cfg.output)]
    for phase in cfg.phases:
        folders += [fsio.join(cfg.output, phase.name), parts_folder(cfg.output, phase.name)]
    for folder in folders:
        found += [u for u in fsio.list_files(folder) if ".tmp-" in u.rsplit("/", 1)[-1]]
    return found


@contextlib.contextmanager
def workers_stopped(grace_s: float = 3.0) -> Iterator[None]:
    """If the block ends with an exception (a SIGTERM, a failed stage), the processes the
    runner started (the direct runner's SDK workers: the processes that appeared under this
    one in the block) are stopped before it propagates: SIGTERM, then SIGKILL after
    ``grace_s``; none finishes a shard after the driver is gone."""
    before = set(_descendants(os.getpid()))
    try:
        yield
    except BaseException:
        children = [pid for pid in _descendants(os.getpid()) if pid not in before]
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(pid) for pid in children):
            time.sleep(0.05)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if children:
            log.info("preprocess: stopped %d worker process(es)", len(children))
        raise


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux ``/proc``; none found elsewhere)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [child for child, ppid in parents.items() if ppid == parent]
        found += kids
        todo += kids
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --------------------------------------------------------------------------- the workers' log

LOG_FOLDER = "logs"
"""The folder beside a local output that holds its jobs' logs."""


def worker_log_path(output: str, kind: str = "preprocess") -> Path | None:
    """The local file, started afresh, for a job's Beam log and worker output:
    ``<parent>/logs/<name>-<kind>.log`` beside a local ``output`` (not inside it: the
    output's folders are what readers list and what reruns compare), else under the
    temporary folder (an output on object storage, a parent that cannot be written).
    None if neither can be written (the log stays on the console)."""
    fs, path = fsio.to_fs(output)
    name = posixpath.basename(path.rstrip("/")) or "output"
    candidates = []
    if fsio.is_local(fs):
        candidates.append(Path(path).resolve().parent / LOG_FOLDER / f"{name}-{kind}.log")
    digest = hashlib.sha256(output.encode()).hexdigest()[:8]
    temp = Path(tempfile.gettempdir()) / "bertpipe-logs" / f"{name}-{digest}-{kind}.log"
    for candidate in [*candidates, temp]:
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        try:
            candidate.parent.mkdir(parents=True, exist_ok=True)
            candidate.write_text(f"# bertpipe {kind} of {fsio.redact(output)}, {started}\n")
        except OSError:
            continue
        return candidate
    return None


class LoggedFnApiRunner(FnApiRunner):
    """Beam's FnApiRunner (what the direct runner runs on) whose SDK worker processes
    (``direct_running_mode=multi_processing``) write their stdout and stderr, where their
    logging and tracebacks go, to :attr:`worker_log` when it is set, not to the console.

    The runner starts each worker with ``sh -c <command>`` (``SubprocessSdkWorker``); the
    command of the pipeline's subprocess environments is given a redirection."""

    worker_log: Path | None = None

    def run_via_runner_api(self, pipeline_proto: Any, options: Any) -> Any:
        if self.worker_log is not None:
            target = shlex.quote(str(self.worker_log))
            for env in pipeline_proto.components.environments.values():
                if env.urn == python_urns.SUBPROCESS_SDK:
                    command = env.payload.decode("utf-8")
                    env.payload = f"{command} >>{target} 2>&1".encode()
        return super().run_via_runner_api(pipeline_proto, options)


@contextlib.contextmanager
def beam_logs_to(pipeline: Any, path: Path | None) -> Iterator[list[str]]:
    """For the block, Beam's logging in this process (the in-process workers' errors, the
    worker processes' log entries the runner relays) goes to ``path`` instead of the
    console, and so does the output of the direct runner's worker processes. Yields the
    list that collects the warnings bertpipe's own code logged in worker processes (a
    skipped file), which the console would otherwise not see."""
    if path is None:
        yield []
        return
    runner = getattr(pipeline, "runner", None)
    if isinstance(runner, LoggedFnApiRunner):
        runner.worker_log = path
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    beam = logging.getLogger("apache_beam")
    relay = logging.getLogger("apache_beam.runners.portability.local_job_service")
    warnings = _WorkerWarnings()
    propagate = beam.propagate
    beam.addHandler(handler)
    relay.addHandler(warnings)
    beam.propagate = False
    try:
        yield warnings.messages
    finally:
        beam.removeHandler(handler)
        relay.removeHandler(warnings)
        beam.propagate = propagate
        handler.close()


class _WorkerWarnings(logging.Handler):
    """Collects the warnings logged by bertpipe's code in the direct runner's worker
    processes, from the log entries the runner relays (``Worker: <LogEntry as text>``)."""

    _SEVERITY = re.compile(r"\bseverity: WARN\b")
    _FIELD = r'\b{}: "((?:[^"\\]|\\.)*)"'

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        import bertpipe
        import bertpipe.preprocessing

        # where bertpipe's modules are (the workers run the same installation)
        packages = (bertpipe, bertpipe.preprocessing)
        self._roots = tuple({str(Path(str(m.__file__)).parent) + os.sep for m in packages})
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if not self._SEVERITY.search(text):
            return
        where = re.search(self._FIELD.format("log_location"), text)
        message = re.search(self._FIELD.format("message"), text)
        if where and message and _unescape(where.group(1)).startswith(self._roots):
            self.messages.append(_unescape(message.group(1)))


def _unescape(text: str) -> str:
    """A string of protobuf's text format (C escapes, UTF-8 bytes as octal) as text."""
    return codecs.escape_decode(text.encode("utf-8"))[0].decode("utf-8", "replace")


_KNOWN = (InputGoneError, TokenizerMismatchError, TaskFailedError)
"""Errors of the workers that already name their input and cause (kept as they are)."""
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Exit)): (.+)$", re.MULTILINE)
_BEAM_STEP = re.compile(r" \[while running '[^']*'\]")
"""What Beam appends to a worker's error message (the step's name)."""
_DISK_FULL = ("No space left on device", "Disk quota exceeded")


def worker_failure(exc: BaseException, log_path: Path | None) -> BertpipeError:
    """The one-line error of a job whose worker failed with ``exc`` (as the runner raised
    it: the worker's exception, wrapped, or its traceback as text), naming the log that
    holds the workers' tracebacks: an input gone stays exit 75, a full disk is exit 74,
    anything else a :class:`TaskFailedError` (exit 1)."""
    where = f"; the workers' tracebacks are in {log_path}" if log_path else ""
    for kind in _KNOWN:
        message = worker_error(exc, kind)
        if message is not None:
            return kind(_BEAM_STEP.sub("", message) + where)
    text = "\n".join(str(e) for e in _chain(exc))
    found = _ERROR_LINE.findall(text)
    cause = f"{found[-1][0]}: {found[-1][1].strip()}" if found else _first_line(exc)
    cause = _BEAM_STEP.sub("", cause)
    if any(marker in text for marker in _DISK_FULL):
        return DiskFullError(f"a preprocessing worker ran out of disk space ({cause}){where}")
    return TaskFailedError(f"a preprocessing worker failed: {cause}{where}")


def worker_error(exc: BaseException, kind: type[BaseException]) -> str | None:
    """The message of a ``kind`` error raised in a worker, found in ``exc`` (the runner
    re-raises it, wraps it, or carries its traceback as text), or None."""
    for seen in _chain(exc):
        if isinstance(seen, kind):
            return str(seen)
        found = re.search(rf"{kind.__name__}: ([^\n]+)", str(seen))
        if found:
            return found.group(1).strip().strip("'\"")
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(seen) < 10 and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
