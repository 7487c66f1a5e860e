"""How configs become MLflow params: dotted keys, one key per phase field, MLflow's limits;
checked in a real (sqlite) MLflow store."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bertpipe import tracking
from bertpipe.config import load_config
from bertpipe.training.pretrain.config import PretrainConfig
from tests.conftest import sqlite_uri


@dataclass
class Item:
    name: str = "a"
    rate: float = 0.5


@dataclass
class Odd:
    items: list[Item] = field(default_factory=lambda: [Item("x", 1.0), Item("y", 2.0)])
    sizes: list[int] = field(default_factory=lambda: [1, 2, 3])
    empty: list[Item] = field(default_factory=list)
    text: str = "z" * 600
    nested: dict[str, dict[str, str]] = field(
        default_factory=lambda: {"k" * 240: {"deep" + "x" * 20: "v", "deep" + "y" * 20: "w"}}
    )


def test_lists_of_sections_get_index_keys_and_limits_hold() -> None:
    params = tracking.config_params(Odd())
    assert params["items.0.name"] == "x" and params["items.1.rate"] == "2.0"
    assert "items" not in params
    assert params["sizes"] == "[1, 2, 3]" and params["empty"] == "[]"  # other lists as text
    assert len(params["text"]) == tracking.MAX_PARAM_VALUE and params["text"].endswith("...")
    long_keys = [k for k in params if k.startswith("nested.")]
    assert len(long_keys) == 2  # shortened, and still distinct
    assert all(len(k) <= tracking.MAX_PARAM_KEY for k in long_keys)


def test_pretrain_phases_are_logged_flat_to_a_real_store(tmp_path: Path) -> None:
    import mlflow

    uri = sqlite_uri(tmp_path / "mlflow.db")
    cfg = load_config(
        PretrainConfig,
        "pretrain-demo",
        [f"tracking.uri={uri}", "tracking.experiment=params", f"output={tmp_path / 'out'}"],
    )
    with tracking.start_run(cfg.tracking, "pretrain", config=cfg) as run:
        assert run is not None
        run_id = run.info.run_id
    params = mlflow.MlflowClient(tracking_uri=uri).get_run(run_id).data.params
    assert "phases" not in params
    assert params["phases.0.learning_rate"] == str(cfg.phases[0].learning_rate)
    assert params["phases.1.max_steps"] == str(cfg.phases[1].max_steps)
    assert params["phases.1.name"] == cfg.phases[1].name
    assert params["zero.stage"] == str(cfg.zero.stage)  # nested sections as before
    assert params == tracking.config_params(cfg)  # every param made it (over 100: batched)


def test_a_registry_failure_is_one_line_naming_the_uri_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import mlflow

    from tests.conftest import free_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    try:
        with pytest.raises(tracking.RegistryError) as info:
            tracking.log_hf_model(
                tmp_path, task="fill-mask", run_id="r", register="m", uri_key="tracking.uri"
            )
    finally:
        mlflow.set_tracking_uri(previous)
    message = str(info.value)
    assert message.startswith("tracking.uri: ") and "\n" not in message
    assert "127.0.0.1" in message and "'m'" in message


def test_sigterm_ends_a_stage_run_killed_and_the_cli_exits_143(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGTERM while a stage's run is open (a tokenizer or Beam job being stopped) ends the
    run KILLED instead of leaving it RUNNING, restores the default handler, and the command
    line exits 143 as a killed process would."""
    import os
    import signal
    import threading
    import time

    import mlflow

    from bertpipe.app.cli import main
    from bertpipe.errors import Terminated

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread (this pytest runs tests elsewhere)")
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        pytest.skip("this process already handles SIGTERM")
    uri = sqlite_uri(tmp_path / "mlflow.db")
    cfg = tracking.TrackingConfig(uri=uri, system_metrics=False)
    run_id = None
    with pytest.raises(Terminated), tracking.start_run(cfg, "preprocess") as run:
        run_id = run.info.run_id
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # interrupted by the handler
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert mlflow.MlflowClient(uri).get_run(run_id).info.status == "KILLED"

    def stopped(cfg: object) -> None:
        raise Terminated()

    monkeypatch.setattr("bertpipe.preprocessing.vocab.train_tokenizer", stopped)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a b c\n")
    argv = ["tokenizer", "train", f"input.paths=[{corpus}]", f"output={tmp_path / 'tok'}"]
    assert main([*argv, "tracking.enabled=false"]) == 143


def test_experiments_carry_mlflows_kind_tag_existing_ones_on_first_use(tmp_path: Path) -> None:
    """New experiments are created with MLflow's kind tag for model training; one created
    without it (by an older bertpipe, or by hand) gets it on first use; a kind someone chose
    is kept."""
    import mlflow

    uri = sqlite_uri(tmp_path / "mlflow.db")
    client = mlflow.MlflowClient(uri)
    old = client.create_experiment("old", artifact_location=str(tmp_path / "a"))
    chosen = client.create_experiment(
        "chosen", artifact_location=str(tmp_path / "b"), tags={"mlflow.experimentKind": "x"}
    )
    ids = {
        name: tracking.connect(tracking.TrackingConfig(uri=uri, experiment=name))
        for name in ("new", "old", "chosen")
    }
    assert ids["old"] == old and ids["chosen"] == chosen
    kinds = {n: client.get_experiment(i).tags.get("mlflow.experimentKind") for n, i in ids.items()}
    assert kinds == {"new": "custom_model_development", "old": "custom_model_development"} | {
        "chosen": "x"
    }
