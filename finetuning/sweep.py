"""``bertpipe sweep``: a grid of fine-tuning runs, nested under one MLflow parent run.

The default grid is the BERT paper's (learning rate 5e-5, 4e-5, 3e-5, 2e-5; batch 16, 32;
epochs 2, 3, 4). Every trial is a full :func:`~bertpipe.finetuning.run.run_finetuning` with its own
folder (``<sweep folder>/trial-NNN``) and a child run; the parent records the grid, every
trial's main metric and, at the end, the best trial (``best_run_id`` tag, ``best/*`` metrics).

Models: with ``sweep.keep_models=best`` (the default) only the best trial's model is kept.
A trial's ``best/`` folder is deleted as soon as another trial beats it (or when it does not
beat the best so far), and no trial logs its model while the sweep runs; at the end the
winner's folder is logged as the model output of its own run (MLflow's ``transformers``
flavour) and, with ``register=NAME``, that logged model is registered. ``keep_models=all``
keeps every trial's model and logs it to the trial's run as it ends (the winner's is then the
one registered). Predictions, metrics and params of every trial are kept either way.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from bertpipe import fsio, tracking
from bertpipe.finetuning.config import FinetuneConfig
from bertpipe.finetuning.initialisation import load_initialisation
from bertpipe.finetuning.publish import TAG_REGISTERED, register_best
from bertpipe.finetuning.run import FinetuneResult, run_finetuning
from bertpipe.finetuning.run_folder import run_folder
from bertpipe.training.core.engine import DistInfo, init_distributed

log = logging.getLogger(__name__)

__all__ = ["SweepResult", "run_sweep", "trials"]


@dataclass
class SweepResult:
    run_id: str | None
    best: FinetuneResult
    best_params: dict[str, Any]
    trials: list[tuple[dict[str, Any], FinetuneResult]]
    output: str = ""
    """The sweep's folder (one ``trial-NNN`` folder per trial)."""


def trials(cfg: FinetuneConfig) -> list[dict[str, Any]]:
    """The grid in order (learning rate, then batch size, then epochs), capped by max_trials."""
    grid = cfg.sweep
    points = [
        {"learning_rate": lr, "batch_size": bs, "epochs": ep}
        for lr, bs, ep in itertools.product(grid.learning_rate, grid.batch_size, grid.epochs)
    ]
    return points[: grid.max_trials] if grid.max_trials else points


def _score(result: FinetuneResult) -> float | None:
    value = result.metrics.get(result.main_metric, math.nan)
    return value if math.isfinite(value) else None


def _beats(new: FinetuneResult, old: FinetuneResult | None) -> bool:
    """Whether ``new`` is strictly better than ``old`` (a tie keeps the earlier trial)."""
    score = _score(new)
    if score is None:
        return False
    if old is None or _score(old) is None:
        return True
    previous = _score(old)
    assert previous is not None
    return score > previous if new.greater_is_better else score < previous


def _drop_model(result: FinetuneResult) -> None:
    folder = Path(result.output) / "best"
    if folder.exists():
        shutil.rmtree(folder)
        log.info("sweep: deleted the model of a losing trial (%s)", folder)


def run_sweep(cfg: FinetuneConfig) -> SweepResult:
    """Run every trial; returns the best by the task's main metric (on the first dev file)."""
    cfg.check_runnable()
    info = init_distributed()
    grid = trials(cfg)
    init = load_initialisation(cfg)
    with run_folder(cfg, info, prefix="sweep-") as folder:
        return _run_trials(cfg, info, grid, init, folder)


def _run_trials(
    cfg: FinetuneConfig, info: DistInfo, grid: list[dict[str, Any]], init: Any, folder: str
) -> SweepResult:
    keep_all = cfg.sweep.keep_models == "all"
    results: list[tuple[dict[str, Any], FinetuneResult]] = []
    best_index: int | None = None
    context = (
        tracking.start_run(
            cfg.tracking,
            "sweep",
            config=dataclasses.replace(cfg, output=folder),
            run_name=cfg.tracking.run_name or f"sweep-{cfg.task.name}",
            parent_run_id=init.pretrain_run_id,
            tags={"bertpipe.task": cfg.task.name, "bertpipe.sweep_trials": str(len(grid))},
        )
        if info.is_main
        else contextlib.nullcontext()
    )
    with context as parent:
        parent_id = parent.info.run_id if parent is not None else None
        for i, point in enumerate(grid):
            trial = copy.deepcopy(cfg)
            trial.learning_rate = point["learning_rate"]
            trial.batch_size = point["batch_size"]
            trial.epochs = point["epochs"]
            trial.micro_batch_size = None
            trial.output = fsio.join(folder, f"trial-{i:03d}")
            # every trial checkpoints into its own folder (and deletes them when it is done)
            if cfg.checkpoint.dir:
                trial.checkpoint.dir = fsio.join(cfg.checkpoint.dir, f"trial-{i:03d}")
            trial.register = None  # the sweep registers its best trial's model only
            name = f"lr{point['learning_rate']:g}-bs{point['batch_size']}-ep{point['epochs']}"
            log.info("sweep trial %d/%d: %s", i + 1, len(grid), name)
            result = run_finetuning(
                trial, nested_in=parent_id, run_name=name, upload_model=keep_all
            )
            if info.world_size > 1:  # rank 0 scored it; every rank picks the same best
                shared = [result.metrics]
                dist.broadcast_object_list(shared, src=0)
                result.metrics = shared[0]
            results.append((point, result))
            best = results[best_index][1] if best_index is not None else None
            loser: FinetuneResult | None = result
            if _beats(result, best):
                best_index, loser = i, best
            if loser is not None and not keep_all and info.is_main:
                _drop_model(loser)
        main = results[0][1].main_metric
        if best_index is None:
            raise RuntimeError(f"no trial produced {main}")
        point, best = results[best_index]
        best_model = Path(best.output) / "best"
        if parent is not None:
            for i, (_, r) in enumerate(results):
                tracking.log_metrics({f"trial/{main}": r.metrics.get(main, math.nan)}, step=i)
            tracking.log_metrics({f"best/{k}": v for k, v in best.metrics.items()})
            tags = {"bertpipe.best_run_id": best.run_id or "", "bertpipe.main_metric": main}
            if best_model.exists():
                tags["bertpipe.best_model_path"] = str(best_model.resolve())
                if best.run_id and (cfg.register or best.model_id is None):
                    logged = register_best(best_model, cfg.register, best.run_id, best.model_id)
                    if logged is not None:
                        best.model_id, best.registered_model = logged.model_id, logged.registered
                if best.registered_model:
                    tags[TAG_REGISTERED] = best.registered_model
                if best.model_id:
                    tags["bertpipe.best_model_id"] = best.model_id
            tracking.set_tags(tags)
            tracking.log_params({f"best.{k}": v for k, v in point.items()})
        log.info("sweep best: %s with %s = %.4f", point, main, best.metrics[main])
    return SweepResult(parent_id, best, point, results, folder)
