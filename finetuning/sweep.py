"""``bertpipe sweep``: a grid of fine-tuning runs, nested under one MLflow parent run.

The default grid is the BERT paper's (learning rate 5e-5, 4e-5, 3e-5, 2e-5; batch 16, 32;
epochs 2, 3, 4). Every trial is a full :func:`~bertpipe.finetuning.loop.run_finetuning` with its own
output folder and a child run; the parent records the grid, every trial's main metric and,
at the end, the best trial (``best_run_id`` tag, ``best/*`` metrics).
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Any

from bertpipe import fsio, tracking
from bertpipe.finetuning.config import FinetuneConfig
from bertpipe.finetuning.loop import FinetuneResult, load_initialisation, run_finetuning

log = logging.getLogger(__name__)

__all__ = ["SweepResult", "run_sweep", "trials"]


@dataclass
class SweepResult:
    run_id: str | None
    best: FinetuneResult
    best_params: dict[str, Any]
    trials: list[tuple[dict[str, Any], FinetuneResult]]


def trials(cfg: FinetuneConfig) -> list[dict[str, Any]]:
    """The grid in order (learning rate, then batch size, then epochs), capped by max_trials."""
    grid = cfg.sweep
    points = [
        {"learning_rate": lr, "batch_size": bs, "epochs": ep}
        for lr, bs, ep in itertools.product(grid.learning_rate, grid.batch_size, grid.epochs)
    ]
    return points[: grid.max_trials] if grid.max_trials else points


def run_sweep(cfg: FinetuneConfig) -> SweepResult:
    """Run every trial; returns the best by the task's main metric (on the first dev file)."""
    cfg.check_runnable()
    grid = trials(cfg)
    init = load_initialisation(cfg)
    results: list[tuple[dict[str, Any], FinetuneResult]] = []
    with tracking.start_run(
        cfg.tracking,
        "sweep",
        config=cfg,
        run_name=cfg.tracking.run_name or f"sweep-{cfg.task.name}",
        parent_run_id=init.pretrain_run_id,
        tags={"bertpipe.task": cfg.task.name, "bertpipe.sweep_trials": str(len(grid))},
    ) as parent:
        parent_id = parent.info.run_id if parent is not None else None
        for i, point in enumerate(grid):
            trial = copy.deepcopy(cfg)
            trial.learning_rate = point["learning_rate"]
            trial.batch_size = point["batch_size"]
            trial.epochs = point["epochs"]
            trial.micro_batch_size = None
            trial.output = fsio.join(cfg.output, f"trial-{i:03d}")
            name = f"lr{point['learning_rate']:g}-bs{point['batch_size']}-ep{point['epochs']}"
            log.info("sweep trial %d/%d: %s", i + 1, len(grid), name)
            result = run_finetuning(trial, nested_in=parent_id, run_name=name)
            results.append((point, result))
        main, greater = results[0][1].main_metric, results[0][1].greater_is_better
        scored = [(p, r) for p, r in results if math.isfinite(r.metrics.get(main, math.nan))]
        if not scored:
            raise RuntimeError(f"no trial produced {main}")
        point, best = (max if greater else min)(scored, key=lambda pr: pr[1].metrics[main])
        if parent is not None:
            import mlflow

            for i, (_, r) in enumerate(results):
                tracking.log_metrics({f"trial/{main}": r.metrics.get(main, math.nan)}, step=i)
            tracking.log_metrics({f"best/{k}": v for k, v in best.metrics.items()})
            mlflow.set_tags(
                {"bertpipe.best_run_id": best.run_id or "", "bertpipe.main_metric": main}
            )
            mlflow.log_params({f"best.{k}": v for k, v in point.items()})
        log.info("sweep best: %s with %s = %.4f", point, main, best.metrics[main])
    return SweepResult(parent_id, best, point, results)
