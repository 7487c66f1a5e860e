"""Trials' results into the suite's scores: the protocol's choice of setting per task, the
mean and standard deviation over seeds, and the GLUE-style average.

A trial's **score** for its task is the mean of the task's score metrics (GLUE's rule: MRPC's
F1 and accuracy, STS-B's Pearson and Spearman, MNLI's matched and mismatched accuracy). Per
task, the learning rate with the highest mean score over the seeds is chosen (ties: the first
in the grid); the task's result is that setting's mean and sample standard deviation over the
seeds (0 with one seed). The suite's **average** is the mean of the tasks' scores; its
standard deviation is that of the per-seed averages (seed i's average is the mean over tasks
of seed i's score at each task's chosen setting).

**One scale.** A trial's metrics are what its fine-tuning run logged, each on its reference
scorer's scale: fractions (accuracy 0.843) for every family but SQuAD, whose exact match and
F1 are percentages (84.3), as the official ``evaluate-v2.0.py`` gives them
(:data:`PERCENT_METRICS`). Every score here is a fraction: a trial's metrics are put on that
scale (:func:`as_fractions`) before any mean, choice or average, so a suite that mixes SQuAD
with GLUE averages like with like, and every table shows the same x100.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bertpipe.finetuning.evaluation.suite import Suite, SuiteTask

__all__ = [
    "PERCENT_METRICS",
    "SuiteScores",
    "TaskScore",
    "TrialResult",
    "as_fractions",
    "summarise",
    "task_score",
    "trial_key",
]

PERCENT_METRICS = {"squad": frozenset({"exact", "f1"})}
"""By task family, the metrics its fine-tuning runs log in percent: SQuAD's exact match and
F1 (also as ``HasAns_``/``NoAns_`` breakdowns and under a later dev file's prefix), as
:func:`~bertpipe.finetuning.tasks.squad_scores.squad_metrics` and the official script report them.
Every other metric is a fraction."""


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
    """The protocol's epoch's dev metrics (the last epoch's, or the best's), as the trial's
    fine-tuning run logged them (SQuAD's in percent: :data:`PERCENT_METRICS`)."""
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


def _in_percent(task: SuiteTask, name: str) -> bool:
    metric = name.rsplit("/", 1)[-1].removeprefix("HasAns_").removeprefix("NoAns_")
    return metric in PERCENT_METRICS.get(task.family, ())


def as_fractions(task: SuiteTask, metrics: Mapping[str, float]) -> dict[str, float]:
    """A trial's ``metrics`` (as its fine-tuning run logged them) with every score a fraction:
    those :data:`PERCENT_METRICS` names for ``task``'s family divided by 100."""
    return {
        name: float(value) / 100.0 if _in_percent(task, name) else float(value)
        for name, value in metrics.items()
    }


def task_score(task: SuiteTask, metrics: Mapping[str, float]) -> float:
    """The mean of ``task``'s score metrics in a trial's ``metrics`` (as logged), as a
    fraction (nan if one is missing)."""
    scaled = as_fractions(task, metrics)
    values = [scaled.get(name, math.nan) for name in task.score]
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
    """Each metric's mean and standard deviation over seeds at the chosen setting
    (fractions, SQuAD's too)."""
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
        scaled = [as_fractions(task, t.metrics) for t in trials]
        metrics = {
            name: _mean_std([m.get(name, math.nan) for m in scaled])
            for name in task.metrics or task.score
        }
        mean, std = grid[f"{chosen:g}"]
        tasks.append(TaskScore(task.name, chosen, mean, std, per_lr[chosen], metrics, grid))
    seed_averages = [statistics.fmean(t.scores[i] for t in tasks) for i in range(len(seeds))]
    average = statistics.fmean(t.mean for t in tasks)
    _, average_std = _mean_std(seed_averages)
    return SuiteScores(suite.name, tasks, average, average_std, seed_averages)
