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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bertpipe import fsio
from bertpipe.config import ConfigError, to_dict
from bertpipe.errors import BertpipeError
from bertpipe.preprocessing.config import OPERATIONAL_KEYS, PreprocessConfig
from bertpipe.preprocessing.dedup import quality_folder, samples_folder
from bertpipe.preprocessing.pipeline import (
    Plan,
    manifest_url,
    parts_folder,
    progress_folder,
    resume_folder,
    spill_folder,
)
from bertpipe.preprocessing.ranges import ReadRange

log = logging.getLogger(__name__)

__all__ = [
    "OutputExistsError",
    "check_output",
    "check_writable",
    "job_identity",
    "remove_scratch",
    "start_output",
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
