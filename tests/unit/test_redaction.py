"""Credentials in URLs never reach logs, MLflow params or written configs; atomic writes are
synced to disk before they replace the old file."""

from __future__ import annotations

from pathlib import Path

from bertpipe import fsio
from bertpipe.config import load_config, to_yaml
from bertpipe.tracking import config_params
from bertpipe.training.pretrain.config import PretrainConfig

SECRET = "hunter2-s3cr3t"


def test_redact_keeps_user_and_host_drops_password():
    assert fsio.redact(f"https://ann:{SECRET}@mlflow.example:5000/x") == (
        "https://ann:***@mlflow.example:5000/x"
    )
    text = f"a postgresql://u:{SECRET}@db/m and s3://bucket/k and file:///tmp/a"
    assert SECRET not in fsio.redact(text) and "s3://bucket/k" in fsio.redact(text)
    assert fsio.redact("sqlite:///runs/mlflow.db") == "sqlite:///runs/mlflow.db"


def test_config_yaml_and_params_hold_no_password():
    cfg = load_config(PretrainConfig, None, [f"tracking.uri=https://ann:{SECRET}@host:5000"])
    assert SECRET not in to_yaml(cfg)
    params = config_params(cfg)
    assert params["tracking.uri"] == "https://ann:***@host:5000"
    assert all(SECRET not in v for v in params.values())


def test_atomic_write_replaces_and_leaves_no_temporary(tmp_path: Path):
    target = tmp_path / "latest"
    fsio.atomic_write_text(str(target), "global_step1")
    fsio.atomic_write_text(str(target), "global_step2")
    assert target.read_text() == "global_step2"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]
