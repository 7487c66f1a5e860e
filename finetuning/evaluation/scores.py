"""Trials' results into the suite's scores: the protocol's choice of setting per task, the
mean and standard deviation over seeds, and the GLUE-style average.

A trial's **score** for its task is the mean of the task's score metrics (GLUE's rule: MRPC's
F1 and accuracy, STS-B's Pearson and Spearman, MNLI's matched and mismatched accuracy). Per
task, the learning rate with the highest mean score over the seeds is chosen (ties: the first
in the grid); the task's result is that setting's mean and sample standard deviation over the
seeds (0 with one seed). The suite's **average** is the mean of the tasks' scores; its
standard deviation is that of the per-seed averages (seed i's average is the mean over tasks
of seed i's score at each task's chosen setting).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bertpipe.finetuning.evaluation.suite import Suite, SuiteTask

__all__ = ["SuiteScores", "TaskScore", "TrialResult", "summarise", "task_score", "trial_key"]


def trial_key(task: str, learning_rate: float, seed: int) -> str:
    """A trial's name and folder: ``<task>/lr<lr>-seed<seed>`` (``mrpc/lr2e-05-seed1``)."""
    return f"{task}/lr{learning_rate:g}-seed{seed}"


@dataclass
class TrialResult:
    """What one trial gave (its ``result.json``)."""

    task: str
    learning_rate: float
    seed: int
    metrics: dict[str, float]
    """The protocol's epoch's dev metrics (the last epoch's, or the best's)."""
    last: dict[str, float] = field(default_factory=dict)
    """The last epoch's dev metrics."""
    best: dict[str, float] = field(default_factory=dict)
    """The best epoch's dev metrics (by the task's main metric) and ``best_epoch``."""
    run_id: str | None = None
    seconds: float = 0.0
    threads: int = 0
    """CPU threads the trial computed with (the same count gives the same bits)."""

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TrialResult:
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def task_score(task: SuiteTask, metrics: Mapping[str, float]) -> float:
    """The mean of ``task``'s score metrics in ``metrics`` (nan if one is missing)."""
    values = [float(metrics.get(name, math.nan)) for name in task.score]
    return sum(values) / len(values)


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values or any(not math.isfinite(v) for v in values):
        return math.nan, math.nan
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0


@dataclass
class TaskScore:
    """A task's result under the protocol."""

    task: str
    learning_rate: float
    """The chosen setting."""
    mean: float
    std: float
    scores: list[float]
    """The chosen setting's score per seed (in the protocol's seed order)."""
    metrics: dict[str, tuple[float, float]]
    """Each metric's mean and standard deviation over seeds at the chosen setting."""
    grid: dict[str, tuple[float, float]]
    """Each learning rate (``f"{lr:g}"``) and its score's mean and standard deviation."""


@dataclass
class SuiteScores:
    """The suite's result: every task's, and the average."""

    suite: str
    tasks: list[TaskScore]
    average: float
    average_std: float
    seed_averages: list[float]

    def metrics(self) -> dict[str, float]:
        """The suite run's MLflow metrics (the names of the package's contract)."""
        out: dict[str, float] = {"average": self.average, "average_std": self.average_std}
        for t in self.tasks:
            out[f"{t.task}/score"], out[f"{t.task}/score_std"] = t.mean, t.std
            out[f"{t.task}/learning_rate"] = t.learning_rate
            for name, (mean, std) in t.metrics.items():
                out[f"{t.task}/{name}"], out[f"{t.task}/{name}_std"] = mean, std
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self, title: str = "", note: str = "") -> str:
        """The result as a Markdown table (scores x100, mean ± std over seeds), with
        ``note`` (what the numbers are) under the title."""

        def pct(mean: float, std: float) -> str:
            return "-" if not math.isfinite(mean) else f"{100 * mean:.1f} ± {100 * std:.1f}"

        lines = [f"### {title}", ""] if title else []
        lines += [note, ""] if note else []
        lines += ["| task | score | metrics | learning rate |", "|---|---|---|---|"]
        for t in self.tasks:
            metrics = ", ".join(f"{name} {pct(*v)}" for name, v in t.metrics.items())
            lines.append(f"| {t.task} | {pct(t.mean, t.std)} | {metrics} | {t.learning_rate:g} |")
        lines.append(f"| **average** | {pct(self.average, self.average_std)} | | |")
        return "\n".join(lines) + "\n"


def summarise(
    suite: Suite,
    learning_rates: Sequence[float],
    seeds: Sequence[int],
    results: Mapping[str, TrialResult],
) -> SuiteScores:
    """The suite's scores from every trial's result (keyed by :func:`trial_key`)."""
    tasks = []
    for task in suite.tasks:
        grid: dict[str, tuple[float, float]] = {}
        per_lr: dict[float, list[float]] = {}
        for lr in learning_rates:
            scores = [task_score(task, results[trial_key(task.name, lr, s)].metrics) for s in seeds]
            per_lr[lr] = scores
            grid[f"{lr:g}"] = _mean_std(scores)
        chosen = learning_rates[0]
        for lr in learning_rates[1:]:  # the highest mean; ties keep the earlier setting
            mean, best = grid[f"{lr:g}"][0], grid[f"{chosen:g}"][0]
            if math.isfinite(mean) and (not math.isfinite(best) or mean > best):
                chosen = lr
        trials = [results[trial_key(task.name, chosen, s)] for s in seeds]
        metrics = {
            name: _mean_std([float(t.metrics.get(name, math.nan)) for t in trials])
            for name in task.metrics or task.score
        }
        mean, std = grid[f"{chosen:g}"]
        tasks.append(TaskScore(task.name, chosen, mean, std, per_lr[chosen], metrics, grid))
    seed_averages = [statistics.fmean(t.scores[i] for t in tasks) for i in range(len(seeds))]
    average = statistics.fmean(t.mean for t in tasks)
    _, average_std = _mean_std(seed_averages)
    return SuiteScores(suite.name, tasks, average, average_std, seed_averages)
