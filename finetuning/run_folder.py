"""A fine-tuning run's folder: chosen once, the same on every rank, never silently reused.

``output`` if given: a folder that already holds files is refused unless it holds a stopped
run's checkpoint that ``checkpoint.resume`` continues (not for sweeps), or ``overwrite=true``
deletes the previous run's outputs (:data:`RUN_OUTPUTS`, ``trial-*``) first. Without
``output``: a new folder ``<output_root>/<prefix><task name>-<UTC time>`` per run.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from bertpipe.config import ConfigError
from bertpipe.errors import StorageAccessError
from bertpipe.finetuning.config import FinetuneConfig
from bertpipe.fsio import storage_errors
from bertpipe.lease import LEASE_NAME, Lease, OutputInUseError, OutputUnwritableError
from bertpipe.training import checkpoint as ckpt
from bertpipe.training.core.engine import DistInfo

log = logging.getLogger(__name__)

__all__ = ["RUN_OUTPUTS", "run_folder"]

RUN_OUTPUTS = ("best", "predictions", "checkpoints", "finetune.yaml")
"""What a fine-tuning run writes in its folder (a sweep: ``trial-*`` folders of these)."""


@contextlib.contextmanager
def run_folder(cfg: FinetuneConfig, info: DistInfo, prefix: str = "") -> Iterator[str]:
    """The run's folder, the same on every rank: chosen (and made) by rank 0, broadcast, and
    held under rank 0's lease (:mod:`bertpipe.lease`) until the block ends.

    ``cfg.output`` if given; its lease is taken first (a live run there: an
    :class:`~bertpipe.lease.OutputInUseError` on every rank, nothing touched). A folder that
    already holds files is refused (a :class:`ConfigError` on every rank) unless it holds a
    stopped run's checkpoint that ``checkpoint.resume`` continues (not for sweeps), or
    ``overwrite=true``, which deletes the previous run's outputs (:data:`RUN_OUTPUTS`,
    ``trial-*``) first. Without ``output``: a new folder ``<output_root>/<prefix><task
    name>-<UTC time>`` (``-2``, ``-3``... if taken).
    """
    decision: list[Any] = [None]
    held: Lease | None = None
    if info.is_main:
        try:
            if cfg.output:
                if Path(cfg.output).exists() and not Path(cfg.output).is_dir():
                    raise ConfigError("output", f"{cfg.output} is a file: choose a folder")
                held = _lease(cfg.output, cfg)
            folder = _choose_folder(cfg, prefix)
            held = held or _lease(folder, cfg)
            decision[0] = ("ok", folder)
        except ConfigError as exc:
            decision[0] = ("error", ConfigError, exc.key, exc.message)
        except (OutputInUseError, OutputUnwritableError, StorageAccessError) as exc:
            decision[0] = ("error", type(exc), "", str(exc))
        if decision[0][0] == "error" and held is not None:
            held.release()
    if info.world_size > 1:
        dist.broadcast_object_list(decision, src=0)
    kind, *rest = decision[0]
    if kind == "error":
        error, key, message = rest
        raise ConfigError(key, message) if error is ConfigError else error(message)
    try:
        yield str(rest[0])
    finally:
        if held is not None:
            held.release()


def _lease(folder: str, cfg: FinetuneConfig) -> Lease:
    lease = Lease(folder, "finetune", cfg.checkpoint.lease_timeout_s)
    with storage_errors(lease.url):
        lease.acquire()
    return lease


def _choose_folder(cfg: FinetuneConfig, prefix: str) -> str:
    if cfg.output:
        folder = Path(cfg.output)
        if folder.exists() and not folder.is_dir():
            raise ConfigError("output", f"{folder} is a file: choose a folder for output=")
        if folder.is_dir() and any(p.name != LEASE_NAME for p in folder.iterdir()):
            if not cfg.overwrite and not prefix and _resumable(cfg, folder):
                log.info("%s holds a stopped run's checkpoint: continuing it", folder)
                return str(folder)
            if not cfg.overwrite:
                raise ConfigError(
                    "output",
                    f"{folder} already holds files (a previous run?): choose a new output= (or "
                    "leave it unset for a new folder under output_root), or set overwrite=true "
                    "to replace that run's outputs",
                )
            for path in sorted(folder.iterdir()):
                if path.name not in RUN_OUTPUTS and not re.fullmatch(r"trial-\d+", path.name):
                    continue
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
            if cfg.checkpoint.dir:  # elsewhere: the previous run's checkpoints go too
                ckpt.remove_all(cfg.checkpoint.dir)
            log.warning("overwrite=true: replacing the previous run's outputs in %s", folder)
        folder.mkdir(parents=True, exist_ok=True)
        return str(folder)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", cfg.task.name).strip("-.") or "task"
    base = f"{prefix}{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    root = Path(cfg.output_root)
    root.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        folder = root / (base if n == 1 else f"{base}-{n}")
        try:
            folder.mkdir()  # atomic: two runs started in the same second get two folders
        except FileExistsError:
            continue
        return str(folder)
    raise AssertionError("unreachable")


def _resumable(cfg: FinetuneConfig, folder: Path) -> bool:
    """Whether ``folder`` (a run's ``output``) has a checkpoint that ``checkpoint.resume``
    continues from."""
    if cfg.checkpoint.resume == "none":
        return False
    checkpoints = cfg.checkpoint.dir or str(folder / "checkpoints")
    if cfg.checkpoint.resume == "auto":
        return ckpt.latest_tag(checkpoints) is not None
    return cfg.checkpoint.resume in ckpt.tags(checkpoints)
