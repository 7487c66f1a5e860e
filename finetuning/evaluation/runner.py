""":func:`run_suite`: every trial of a suite, resumable and several at a time, and the
suite's MLflow run.

The suite's folder (``output``) holds ``suite.json`` (what the suite is: its tasks, files,
protocol, model; and its MLflow run), ``model/`` (the model every trial reads, when it had to
be exported or downloaded), ``trials/<task>/lr<lr>-seed<seed>/`` (each a ``bertpipe
finetune`` run folder with its ``finetune.yaml``, plus ``result.json`` once it finished) and,
at the end, ``results.json`` and ``table.md``. The folder is held under a lease while the
suite runs (a second suite on it is refused).

**Resume.** Run again with the same command, a suite reuses every trial that has its
``result.json`` and runs the others: a trial stopped with a checkpoint (SIGTERM) continues
from it, one killed without (SIGKILL) starts again from its beginning. Every trial is
deterministic for its seed and thread count, so the suite ends with the same table whether or
not it was stopped. Its MLflow run is reopened; the child runs of trials that were killed are
marked KILLED. A folder holding another suite (other tasks, files, protocol or model) is
refused unless ``overwrite=true``.

**Parallel.** With ``parallel`` > 1 the trials run in that many worker processes (spawned,
each computing on ``threads_per_trial`` threads, one GPU each on a GPU machine), in the same
order; ``parallel=1`` runs them in this process.

Nothing is published for the suite before every trial has finished: a failed trial fails the
suite's run (its error is the command's one line), and the finished trials are kept for the
next attempt.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bertpipe import fsio, tracking
from bertpipe.config import ConfigError, from_dict, to_dict
from bertpipe.finetuning.config import FinetuneConfig
from bertpipe.finetuning.evaluation.config import EvaluateConfig, safe_name
from bertpipe.finetuning.evaluation.model_source import ModelSource, resolve_model
from bertpipe.finetuning.evaluation.pool import parallelism, run_pool
from bertpipe.finetuning.evaluation.scores import SuiteScores, TrialResult, summarise, trial_key
from bertpipe.finetuning.evaluation.suite import Suite, SuiteTask, check_suite, seq_length
from bertpipe.finetuning.evaluation.suite import load_suite as _load_suite
from bertpipe.lease import held

log = logging.getLogger(__name__)

__all__ = [
    "SuiteResult",
    "Trial",
    "TrialStep",
    "default_output",
    "display_label",
    "load_checked_suite",
    "plan_trials",
    "run_suite",
    "trial_config",
]

RECORD = "suite.json"
RESULT = "result.json"
TAG_TRIAL = "bertpipe.trial"
TAG_SUITE = "bertpipe.suite"
LEASE_TIMEOUT_S = 60.0
RANDOM_INIT = "random init"
"""Added to a model's label when the trials start from random weights (``finetune.random_init``)
and no ``model_name`` is given: ``bert-base (random init)``."""


@dataclass(frozen=True)
class Trial:
    """One (task, learning rate, seed) of the suite."""

    task: SuiteTask
    learning_rate: float
    seed: int

    @property
    def key(self) -> str:
        return trial_key(self.task.name, self.learning_rate, self.seed)


@dataclass
class SuiteResult:
    """What :func:`run_suite` produced."""

    run_id: str | None
    """The suite's MLflow run (None without tracking)."""
    output: str
    scores: SuiteScores
    trials: dict[str, TrialResult]
    model: ModelSource
    ran: int
    """Trials run by this call (the others were finished before)."""
    label: str = ""
    """The model's label in the suite's tables and run (:func:`display_label`)."""


def load_checked_suite(cfg: EvaluateConfig) -> Suite:
    """The config's suite, every file read and checked (:func:`~.suite.check_suite`)."""
    return check_suite(_load_suite(cfg.suite, cfg.data, cfg.tasks), cfg.bad_rows)


def plan_trials(cfg: EvaluateConfig, suite: Suite) -> list[Trial]:
    """Every trial, task by task, then learning rate, then seed."""
    protocol = cfg.protocol
    return [
        Trial(task, lr, seed)
        for task in suite.tasks
        for lr in protocol.learning_rates
        for seed in protocol.seeds
    ]


def random_init(cfg: EvaluateConfig) -> bool:
    """Whether the trials start from random weights (``finetune.random_init``)."""
    return cfg.finetune.get("random_init") is True


def display_label(cfg: EvaluateConfig, model: ModelSource) -> str:
    """The model's label in tables (the ``bertpipe.model_name`` tag, the table's title):
    ``model_name`` as given, else the model's short name, with `` (random init)`` when the
    trials start from random weights."""
    if cfg.model_name:
        return cfg.model_name
    return f"{model.label} ({RANDOM_INIT})" if random_init(cfg) else model.label


def model_label(cfg: EvaluateConfig) -> str:
    """The model's short name for folder names (``model_name``, else from ``model`` as
    given, ``-random-init`` added for random weights)."""
    if cfg.model_name:
        return safe_name(cfg.model_name)
    label = _given_label(cfg)
    return safe_name(f"{label}-{RANDOM_INIT}") if random_init(cfg) else label


def _given_label(cfg: EvaluateConfig) -> str:
    given = cfg.model.rstrip("/")
    if given.startswith("models:/"):
        return safe_name(given.removeprefix("models:/"))
    last = given.rsplit("/", 1)[-1]
    if fsio.exists(fsio.join(given, "latest")):
        from bertpipe.training import checkpoint as ckpt

        above = given.rsplit("/", 2)
        run = above[-2] if len(above) > 1 and last == "checkpoints" else last
        return safe_name(f"{run}-{ckpt.latest_tag(given)}")
    if last.startswith("global_step"):
        above = given.rsplit("/", 3)
        run = above[-3] if len(above) > 2 and above[-2] == "checkpoints" else above[-2]
        return safe_name(f"{run}-{last}")
    return safe_name(last)


def default_output(cfg: EvaluateConfig, suite: Suite) -> str:
    """``output``, else ``<output_root>/<suite>-<model>`` (the same for the same command)."""
    if cfg.output:
        return cfg.output
    return os.path.join(cfg.output_root, f"{safe_name(suite.name)}-{model_label(cfg)}")


def trial_config(
    cfg: EvaluateConfig, trial: Trial, init_from: str, output: str, overwrite: bool
) -> FinetuneConfig:
    """The ``bertpipe finetune`` config of ``trial`` (what its ``finetune.yaml`` holds)."""
    protocol = cfg.protocol
    data: dict[str, Any] = {"save_model": False}
    for key, value in cfg.finetune.items():
        _set(data, key.split("."), value)
    task = dict(trial.task.task)
    task.setdefault("max_seq_length", protocol.max_seq_length or seq_length(trial.task))
    tracking_cfg = to_dict(cfg.tracking)
    tracking_cfg["run_name"] = trial.key
    tracking_cfg["tags"] = {**cfg.tracking.tags, TAG_TRIAL: trial.key}
    data.update(
        init_from=init_from,
        output=output,
        overwrite=overwrite,
        task=task,
        learning_rate=trial.learning_rate,
        batch_size=protocol.batch_size,
        epochs=protocol.epochs,
        seed=trial.seed,
        warmup=protocol.warmup,
        tracking=tracking_cfg,
    )
    try:
        return from_dict(FinetuneConfig, data)
    except ConfigError as exc:
        given = {key.split(".")[0] for key in cfg.finetune}
        raise (exc.with_prefix("finetune") if exc.key.split(".")[0] in given else exc) from None
    except TypeError as exc:  # a section given a scalar
        raise ConfigError("finetune", str(exc)) from None


def _set(data: dict[str, Any], path: list[str], value: Any) -> None:
    for step in path[:-1]:
        data = data.setdefault(step, {})
        if not isinstance(data, dict):
            raise ConfigError("finetune", f"{'.'.join(path)}: {step} is not a section")
    data[path[-1]] = value


# --------------------------------------------------------------------------- the folder


def _record(cfg: EvaluateConfig, suite: Suite) -> dict[str, Any]:
    """What makes two suites the same (so that one continues the other)."""
    protocol = to_dict(cfg.protocol)
    return {
        "suite": suite.describe(),
        "protocol": protocol,
        "finetune": cfg.finetune,
        "bad_rows": cfg.bad_rows,
        "model": cfg.model,
    }


def _open_folder(output: Path, record: dict[str, Any], overwrite: bool) -> dict[str, Any]:
    """The folder's ``suite.json`` (made, continued, or replaced with ``overwrite``)."""
    path = output / RECORD
    if path.exists():
        state = json.loads(path.read_text())
        if state.get("record") == record and not overwrite:
            return state
        if not overwrite:
            raise ConfigError(
                "output",
                f"{output} holds another suite's trials (other tasks, files, protocol or "
                "model): choose another output, or pass overwrite=true to replace them",
            )
    elif any(p.name != ".bertpipe-lease.json" for p in output.iterdir()) and not overwrite:
        raise ConfigError(
            "output", f"{output} already holds files: choose another output or overwrite=true"
        )
    for name in ("trials", "model", "results.json", "table.md", RECORD):
        target = output / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    state = {"record": record, "run_id": None}
    fsio.atomic_write_text(str(path), json.dumps(state, indent=2) + "\n")
    return state


def _save_state(output: Path, state: dict[str, Any]) -> None:
    fsio.atomic_write_text(str(output / RECORD), json.dumps(state, indent=2) + "\n")


def _read_result(folder: Path) -> TrialResult | None:
    path = folder / RESULT
    if not path.exists():
        return None
    return TrialResult.from_dict(json.loads(path.read_text()))


# --------------------------------------------------------------------------- one trial


@dataclass(frozen=True)
class TrialStep:
    """A trial to run: its config (as YAML, so that a worker process rebuilds it) and where
    its result goes."""

    key: str
    config_yaml: str
    folder: str
    nested_in: str | None
    epoch: str
    """``last`` or ``best``: which epoch's metrics are the trial's."""


def _epoch_metrics(history: dict[str, float]) -> dict[str, float]:
    """The dev metrics of one epoch of a fine-tuning run's history (``eval/`` prefix off)."""
    return {k.removeprefix("eval/"): float(v) for k, v in history.items() if k.startswith("eval/")}


def run_trial(step: TrialStep) -> dict[str, Any]:
    """Run one trial in this process; its ``result.json`` is written (atomically) before
    this returns."""
    import torch
    import yaml

    from bertpipe.finetuning.run import run_finetuning

    cfg = from_dict(FinetuneConfig, yaml.safe_load(step.config_yaml))
    started = time.monotonic()
    result = run_finetuning(cfg, nested_in=step.nested_in, run_name=step.key, upload_model=False)
    last = _epoch_metrics(result.history[-1]) if result.history else {}
    best = {**result.metrics, "best_epoch": float(result.best_epoch)}
    trial = TrialResult(
        task=step.key.split("/")[0],
        learning_rate=cfg.learning_rate,
        seed=cfg.seed,
        metrics=last if step.epoch == "last" else dict(result.metrics),
        last=last,
        best=best,
        run_id=result.run_id,
        seconds=time.monotonic() - started,
        threads=torch.get_num_threads(),
    )
    payload = trial.to_dict()
    fsio.atomic_write_text(
        os.path.join(step.folder, RESULT), json.dumps(payload, indent=2, sort_keys=True) + "\n"
    )
    return payload


# --------------------------------------------------------------------------- parallelism


def _run_steps(
    cfg: EvaluateConfig, steps: list[TrialStep], done: Callable[[dict[str, Any]], None]
) -> None:
    """Run ``steps`` in order, in this process or in worker processes
    (:mod:`~bertpipe.finetuning.evaluation.pool`); ``done`` sees each result."""
    processes, threads, gpus = parallelism(cfg.parallel, cfg.threads_per_trial, len(steps))
    if processes == 1:
        import torch

        if cfg.threads_per_trial:
            torch.set_num_threads(threads)
        for step in steps:
            done(run_trial(step))
        return
    log.info("evaluate: %d trials, %d at a time, %d threads each", len(steps), processes, threads)
    run_pool(run_trial, steps, done, processes, threads, gpus)


# --------------------------------------------------------------------------- the suite


def run_suite(cfg: EvaluateConfig) -> SuiteResult:
    """Run (or continue) the suite of ``cfg`` and publish its scores."""
    cfg.check_runnable()
    suite = load_checked_suite(cfg)
    output = Path(default_output(cfg, suite)).resolve()
    steps_of = plan_trials(cfg, suite)
    # a SIGTERM raises Terminated (exit 143 once the trials stopped), tracked or not
    with tracking.terminated_raises(), held(str(output), "bertpipe evaluate", LEASE_TIMEOUT_S):
        state = _open_folder(output, _record(cfg, suite), cfg.overwrite)
        uri = cfg.tracking.resolved_uri() if cfg.tracking.enabled else None
        model = resolve_model(cfg.model, output, uri)
        # every trial's config built now: a bad fine-tuning setting fails before any trial
        for trial in steps_of:
            trial_config(cfg, trial, model.folder, str(output / "trials" / trial.key), False)
        return _run(cfg, suite, output, state, model, steps_of)


def _run(
    cfg: EvaluateConfig,
    suite: Suite,
    output: Path,
    state: dict[str, Any],
    model: ModelSource,
    trials: list[Trial],
) -> SuiteResult:
    results: dict[str, TrialResult] = {}
    for trial in trials:
        found = _read_result(output / "trials" / trial.key)
        if found is not None:
            results[trial.key] = found
    pending = [t for t in trials if t.key not in results]
    if results:
        log.info(
            "evaluate: %d of %d trials finished before; running the other %d",
            len(results),
            len(trials),
            len(pending),
        )
    tags = {
        TAG_SUITE: suite.name,
        "bertpipe.model": model.given,
        "bertpipe.model_name": display_label(cfg, model),
        "bertpipe.suite_tasks": ",".join(t.name for t in suite.tasks),
    }
    if model.global_step is not None:
        tags["bertpipe.pretrain_step"] = str(model.global_step)
    context: Any = tracking.start_run(
        cfg.tracking,
        "evaluate",
        config=cfg if state.get("run_id") is None else None,
        run_name=cfg.tracking.run_name or f"{suite.name}-{tags['bertpipe.model_name']}",
        tags=tags,
        parent_run_id=model.pretrain_run_id,
        resume_run_id=state.get("run_id"),
        buffer=tracking.buffer_path(output),
    )
    with context as run:
        run_id = run.info.run_id if run is not None else None
        if run_id is not None and state.get("run_id") != run_id:
            state["run_id"] = run_id
            _save_state(output, state)
        if run_id is not None:
            tracking.log_inputs((), [model.model_id or ""])  # the model it evaluated
            _end_killed_trials(run_id, output)
        steps = [_step(cfg, t, model, output, run_id) for t in pending]

        def done(payload: dict[str, Any]) -> None:
            trial = TrialResult.from_dict(payload)
            results[trial_key(trial.task, trial.learning_rate, trial.seed)] = trial
            log.info(
                "evaluate: %d/%d trials done (%s: %s)",
                len(results),
                len(trials),
                trial_key(trial.task, trial.learning_rate, trial.seed),
                ", ".join(f"{k} {v:.4f}" for k, v in trial.metrics.items() if "/" not in k),
            )

        _run_steps(cfg, steps, done)
        scores = summarise(suite, cfg.protocol.learning_rates, cfg.protocol.seeds, results)
        summary = {
            "suite": suite.name,
            "model": model.to_dict(),
            "protocol": to_dict(cfg.protocol),
            "scores": scores.to_dict(),
            "trials": {k: results[k].to_dict() for k in sorted(results)},
        }
        table = scores.table(f"{suite.name}: {tags['bertpipe.model_name']}", describe(cfg))
        fsio.atomic_write_text(str(output / "table.md"), table)
        fsio.atomic_write_text(
            str(output / "results.json"), json.dumps(_stable(summary), indent=2) + "\n"
        )
        if run is not None:
            tracking.log_metrics(scores.metrics())
            tracking.log_dict(_stable(summary), "suite_results.json")
            tracking.log_text(table, "suite_table.md")
    log.info("evaluate: %s average %.4f ± %.4f", suite.name, scores.average, scores.average_std)
    label = tags["bertpipe.model_name"]
    return SuiteResult(run_id, str(output), scores, results, model, len(pending), label)


def describe(cfg: EvaluateConfig) -> str:
    """What the suite's numbers are, in one line (under its table)."""
    protocol = cfg.protocol
    seeds = len(protocol.seeds)
    grid = "/".join(f"{lr:g}" for lr in protocol.learning_rates)
    return (
        f"Dev scores x100 of the {protocol.epoch} epoch (of {protocol.epochs}), mean ± std over "
        f"{seeds} seed{'s' * (seeds != 1)} at the learning rate with the best mean "
        f"({grid}; batch {protocol.batch_size}); a task's score averages its score metrics."
    )


def _stable(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` without what differs between two runs of the same suite (times)."""
    out = json.loads(json.dumps(summary, default=float))
    for trial in out["trials"].values():
        trial.pop("seconds", None)
    return out


def _step(
    cfg: EvaluateConfig, trial: Trial, model: ModelSource, output: Path, run_id: str | None
) -> TrialStep:
    from bertpipe.config import to_yaml
    from bertpipe.training import checkpoint as ckpt

    folder = output / "trials" / trial.key
    # a trial stopped with a checkpoint continues from it; one killed without starts over
    resumable = folder.exists() and ckpt.has_checkpoints(str(folder / "checkpoints"))
    finetune = trial_config(cfg, trial, model.folder, str(folder), overwrite=not resumable)
    folder.parent.mkdir(parents=True, exist_ok=True)
    return TrialStep(trial.key, to_yaml(finetune), str(folder), run_id, cfg.protocol.epoch)


def _end_killed_trials(run_id: str, output: Path) -> None:
    """Child runs of the suite left RUNNING by a killed process: KILLED, unless their trial
    will continue them from its checkpoint."""
    from bertpipe.training import checkpoint as ckpt

    def continued(key: str) -> bool:
        return bool(key) and ckpt.has_checkpoints(str(output / "trials" / key / "checkpoints"))

    try:
        ended = tracking.end_killed_children(run_id, TAG_TRIAL, continued)
    except Exception as exc:  # tidying only: an unreachable store is no error
        log.warning("evaluate: could not mark killed trials' runs KILLED: %s", exc)
        return
    if ended:
        log.info("evaluate: killed trials' runs marked KILLED: %s", ", ".join(ended))
