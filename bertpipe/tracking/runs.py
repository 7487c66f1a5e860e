"""Calls on runs other than the one a stage has open: a suite's trials left RUNNING by a
killed process, metrics logged into another process's run at a step of its own (a watcher's
scores in the pre-training run), a run's status, a registered model's files."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from bertpipe.tracking.client import quick_http

log = logging.getLogger(__name__)

__all__ = [
    "download_model",
    "end_killed_children",
    "log_run_metrics",
    "model_version_run",
    "run_status",
]


def download_model(model_uri: str, dst: str, tracking_uri: str | None = None) -> None:
    """Download the files of ``model_uri`` (``models:/NAME/VERSION``) into folder ``dst``."""
    import mlflow

    if tracking_uri:  # as connect() does; the registry is the tracking store's (not set apart)
        mlflow.set_tracking_uri(tracking_uri)
    mlflow.artifacts.download_artifacts(
        artifact_uri=model_uri, dst_path=dst, tracking_uri=tracking_uri, registry_uri=tracking_uri
    )


def model_version_run(model_uri: str, tracking_uri: str | None = None) -> str | None:
    """The run that logged the registered model ``models:/NAME/VERSION`` (None if unknown)."""
    import mlflow

    name, _, version = model_uri.removeprefix("models:/").rpartition("/")
    try:
        client = mlflow.MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        run_id = client.get_model_version(name, version).run_id
    except Exception as exc:  # an alias, or a registry without it: the lineage stays unknown
        log.debug("%s: no run found (%s)", model_uri, exc)
        return None
    return str(run_id) if run_id else None


def end_killed_children(parent_run_id: str, tag: str, keep: Callable[[str], bool]) -> list[str]:
    """Mark KILLED the child runs of ``parent_run_id`` still RUNNING whose tag ``tag`` does not
    satisfy ``keep`` (runs a killed process left behind); returns their ids."""
    import mlflow

    client = mlflow.MlflowClient()
    parent = client.get_run(parent_run_id)
    children = client.search_runs(
        [parent.info.experiment_id],
        filter_string=(
            f"tags.mlflow.parentRunId = '{parent_run_id}' and attributes.status = 'RUNNING'"
        ),
    )
    ended = []
    for child in children:
        if not keep(child.data.tags.get(tag, "")):
            client.set_terminated(child.info.run_id, "KILLED")
            ended.append(child.info.run_id)
    return ended


def log_run_metrics(run_id: str, metrics: Mapping[str, float], step: int) -> None:
    """Log ``metrics`` into run ``run_id`` (open in another process, or ended) at ``step``;
    MLflow takes them whatever the run's status."""
    import time

    import mlflow
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    with quick_http():
        mlflow.MlflowClient().log_batch(
            run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()]
        )


def run_status(run_id: str) -> str | None:
    """The status of run ``run_id`` (``RUNNING``, ``FINISHED``...), None if it cannot be read."""
    import mlflow

    try:
        with quick_http():
            return str(mlflow.MlflowClient().get_run(run_id).info.status)
    except Exception as exc:  # the store is down or the run unknown: not known to have ended
        log.debug("run %s: status unknown (%s)", run_id, exc)
        return None
