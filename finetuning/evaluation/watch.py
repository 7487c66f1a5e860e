""":func:`watch_checkpoints`: a suite on new checkpoints of a pre-training run while it trains.

``bertpipe evaluate --watch CHECKPOINTS`` looks at the checkpoint folder (local or object
storage) every ``watch.poll_s`` seconds. A checkpoint counts once the run has published it
whole (``latest`` moved to it: :func:`~bertpipe.training.checkpoint.published_tags`), so a
folder still being written is never read. Every ``watch.every``-th checkpoint, in step order,
is evaluated with the suite (:func:`~.runner.run_suite`, its own folder ``<output>/<tag>``
and MLflow run, linked to the pre-training run and step), and the suite's average and each
task's score are logged into the pre-training run as ``downstream/<suite>/average`` and
``downstream/<suite>/<task>`` at the checkpoint's global step: MLflow shows downstream score
against steps beside the loss.

The watcher shares nothing with the ranks: it reads published files, takes no lock the run
takes, and computes on its own devices or threads (``parallel``, ``threads_per_trial``), so
the run's losses are those it has without it. A checkpoint pruned by the run before the
watcher got to it is one line and skipped. Its state (the checkpoints listed, evaluated and
skipped) is ``<output>/watch.json``: killed, the same command continues (a suite killed
half-way continues its trials). It ends when the pre-training run has ended in MLflow
(FINISHED, FAILED or KILLED) and every checkpoint it published is done, or after
``watch.idle_timeout_s`` without a new checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from bertpipe import fsio, tracking
from bertpipe.finetuning.evaluation.config import EvaluateConfig, safe_name
from bertpipe.finetuning.evaluation.runner import (
    LEASE_TIMEOUT_S,
    SuiteResult,
    load_checked_suite,
    run_suite,
)
from bertpipe.lease import held
from bertpipe.training import checkpoint as ckpt

log = logging.getLogger(__name__)

__all__ = ["STATE", "due", "watch_checkpoints"]

STATE = "watch.json"
ENDED = ("FINISHED", "FAILED", "KILLED")


def due(listed: list[str], every: int, done: dict[str, Any]) -> list[str]:
    """The checkpoints to evaluate: every ``every``-th of ``listed`` (1-based: the
    ``every``-th, the ``2 x every``-th...) not yet ``done``."""
    return [tag for i, tag in enumerate(listed, 1) if i % every == 0 and tag not in done]


def _default_output(cfg: EvaluateConfig, checkpoints: str) -> str:
    if cfg.output:
        return cfg.output
    parts = checkpoints.rstrip("/").rsplit("/", 2)
    run = parts[-2] if len(parts) > 1 and parts[-1] == "checkpoints" else parts[-1]
    suite = Path(cfg.suite).stem if cfg.suite.endswith((".yaml", ".yml")) else cfg.suite
    return os.path.join(cfg.output_root, f"watch-{safe_name(suite)}-{safe_name(run)}")


class _State:
    """``watch.json``: the checkpoints listed (in step order), and what became of each."""

    def __init__(self, path: Path) -> None:
        self.path = path
        raw = json.loads(path.read_text()) if path.exists() else {}
        self.listed: list[str] = list(raw.get("listed", []))
        self.done: dict[str, dict[str, Any]] = dict(raw.get("done", {}))
        self.run_id: str | None = raw.get("pretrain_run_id")

    def save(self) -> None:
        data = {"listed": self.listed, "done": self.done, "pretrain_run_id": self.run_id}
        fsio.atomic_write_text(str(self.path), json.dumps(data, indent=2) + "\n")

    def evaluated(self) -> list[int]:
        return sorted(int(d["step"]) for d in self.done.values() if "step" in d)


def watch_checkpoints(cfg: EvaluateConfig, checkpoints: str) -> list[int]:
    """Watch ``checkpoints`` until the pre-training run has ended (or the idle timeout);
    returns the global steps evaluated (this call and before)."""
    load_checked_suite(cfg)  # bad task files: one line now, not at the first checkpoint
    output = Path(_default_output(cfg, checkpoints)).resolve()
    watch = cfg.watch
    with held(str(output), "bertpipe evaluate --watch", LEASE_TIMEOUT_S):
        state = _State(output / STATE)
        log.info(
            "evaluate --watch: %s, every %d checkpoint(s), suite %s, into %s",
            checkpoints,
            watch.every,
            cfg.suite,
            output,
        )
        last_news = time.monotonic()
        while True:
            new = [t for t in ckpt.published_tags(checkpoints) if t not in state.listed]
            if new:
                state.listed += new
                if state.run_id is None:
                    state.run_id = _run_id(checkpoints, new[0])
                state.save()
                last_news = time.monotonic()
            for tag in due(state.listed, watch.every, state.done):
                state.done[tag] = _evaluate(cfg, checkpoints, tag, output, state.run_id)
                state.save()
                last_news = time.monotonic()
            if new:
                continue  # look again at once: more may have come while evaluating
            if _ended(cfg, state.run_id):
                log.info("evaluate --watch: the pre-training run has ended; done")
                break
            if time.monotonic() - last_news > watch.idle_timeout_s:
                log.warning(
                    "evaluate --watch: no new checkpoint in %s for %.0f s "
                    "(watch.idle_timeout_s); stopping",
                    checkpoints,
                    watch.idle_timeout_s,
                )
                break
            time.sleep(watch.poll_s)
        return state.evaluated()


def _run_id(checkpoints: str, tag: str) -> str | None:
    """The pre-training MLflow run that wrote ``tag`` (None if unknown or unreadable)."""
    try:
        return ckpt.read_state(checkpoints, tag, 0)[0].mlflow_run_id
    except Exception:  # pruned already: the next checkpoint says
        return None


def _ended(cfg: EvaluateConfig, run_id: str | None) -> bool:
    if run_id is None or not cfg.tracking.enabled:
        return False
    with_uri = cfg.tracking.resolved_uri()
    try:
        tracking.connect_to_run(with_uri, run_id)
    except Exception:
        return False
    return tracking.run_status(run_id) in ENDED


def _evaluate(
    cfg: EvaluateConfig, checkpoints: str, tag: str, output: Path, run_id: str | None
) -> dict[str, Any]:
    """The suite on checkpoint ``tag``; what ``watch.json`` keeps of it."""
    one = dataclasses.replace(
        cfg, model=fsio.join(checkpoints, tag), output=str(output / tag), overwrite=False
    )
    try:
        result = run_suite(one)
    except Exception:
        if tag not in ckpt.tags(checkpoints):
            log.warning(
                "evaluate --watch: %s was pruned by the run before it was evaluated: skipped",
                tag,
            )
            return {"skipped": "pruned before it was evaluated"}
        raise
    step = result.model.global_step
    _log_into_run(cfg, run_id or result.model.pretrain_run_id, result)
    log.info(
        "evaluate --watch: %s (step %s): %s average %.4f",
        tag,
        step,
        result.scores.suite,
        result.scores.average,
    )
    return {"step": step, "average": result.scores.average, "suite_run_id": result.run_id}


def _log_into_run(cfg: EvaluateConfig, run_id: str | None, result: SuiteResult) -> None:
    """The suite's average and each task's score into the pre-training run, at the step."""
    step = result.model.global_step
    if run_id is None or step is None or not cfg.watch.log_to_pretrain_run:
        return
    if not cfg.tracking.enabled:
        return
    scores = result.scores
    name = safe_name(scores.suite)
    metrics = {f"downstream/{name}/average": scores.average}
    metrics.update({f"downstream/{name}/{t.task}": t.mean for t in scores.tasks})
    try:
        tracking.connect_to_run(cfg.tracking.resolved_uri(), run_id)
        tracking.log_run_metrics(run_id, metrics, step)
    except Exception as exc:  # the suite's own run has the scores; this is a copy
        log.warning(
            "evaluate --watch: could not log the scores into the pre-training run %s: %s",
            run_id,
            exc,
        )
