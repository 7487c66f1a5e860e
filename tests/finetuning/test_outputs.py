"""Where fine-tuning runs write: one folder per run, no silent overwrite, sweeps that keep
only the best trial's model (on disk and in MLflow)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from bertpipe.config import ConfigError, load_config
from bertpipe.finetuning.config import FinetuneConfig
from bertpipe.finetuning.run import load_task_model, run_finetuning
from bertpipe.finetuning.sweep import SweepResult
from tests.conftest import sqlite_uri
from tests.finetuning.test_loop import _cfg

pytestmark = pytest.mark.integration


def test_default_output_is_a_new_folder_per_run(pretrained: Path, tmp_path: Path) -> None:
    uri = sqlite_uri(tmp_path / "mlflow.db")
    cfg = _cfg(pretrained, tmp_path, uri, "glue", "epochs=1", f"output_root={tmp_path / 'runs'}")
    cfg.output = None  # _cfg gives one; the default is none
    first = run_finetuning(cfg)
    second = run_finetuning(cfg)
    assert cfg.output is None  # the caller's config is left as it was
    assert first.output != second.output
    for result in (first, second):
        folder = Path(result.output)
        assert folder.parent == tmp_path / "runs"
        assert re.fullmatch(r"sst-2-\d{8}-\d{6}(-\d+)?", folder.name), folder.name
        assert (folder / "best" / "config.json").exists() and (folder / "finetune.yaml").exists()
        assert f"output: {folder}" in (folder / "finetune.yaml").read_text()
    import mlflow

    run = mlflow.MlflowClient(tracking_uri=uri).get_run(second.run_id)
    assert run.data.params["output"] == second.output  # the folder actually used


def test_existing_output_is_refused_unless_overwrite(pretrained: Path, tmp_path: Path) -> None:
    uri = sqlite_uri(tmp_path / "mlflow.db")
    out = tmp_path / "out"
    stale = out / "predictions" / "epoch9"
    stale.mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError) as info:
        run_finetuning(_cfg(pretrained, tmp_path, uri, "glue", "epochs=1"))
    assert info.value.key == "output"
    message = str(info.value)
    assert "\n" not in message and "output=" in message and "overwrite=true" in message
    assert stale.exists()  # nothing was touched
    result = run_finetuning(_cfg(pretrained, tmp_path, uri, "glue", "epochs=1", "overwrite=true"))
    assert result.output == str(out)
    assert not stale.exists() and (out / "predictions" / "epoch1").exists()
    assert (out / "notes.txt").read_text() == "mine"  # only the previous run's outputs go


def test_an_output_a_live_run_holds_is_refused_even_with_overwrite(
    pretrained: Path, tmp_path: Path
) -> None:
    """Another process holds the output's lease (a run still going there): ``overwrite=true``
    deletes nothing and the run is refused with one line naming the holder; once the holder
    is gone (killed), the same command runs."""
    import subprocess
    import sys

    from bertpipe.lease import OutputInUseError
    from tests.unit.test_lease import HOLD

    out = tmp_path / "out"
    stale = out / "predictions" / "epoch9"
    stale.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out), "30"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        uri = sqlite_uri(tmp_path / "mlflow.db")
        cfg = _cfg(pretrained, tmp_path, uri, "glue", "epochs=1", "overwrite=true")
        with pytest.raises(OutputInUseError, match=f"in use by .* \\(pid {holder.pid} on "):
            run_finetuning(cfg)
        assert stale.exists()  # nothing deleted
    finally:
        holder.kill()
        holder.wait()
    assert run_finetuning(cfg).output == str(out)
    assert not stale.exists() and not (out / ".bertpipe-lease.json").exists()


def test_output_is_a_file(pretrained: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        run_finetuning(
            _cfg(pretrained, tmp_path, "sqlite:///unused.db", "glue", f"output={tmp_path}/file")
        )


def test_register_needs_a_saved_model_and_tracking() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(FinetuneConfig, None, ["register=m", "save_model=false"])
    assert info.value.key == "register"
    with pytest.raises(ConfigError) as info:
        load_config(FinetuneConfig, None, ["register=m", "tracking.enabled=false"])
    assert info.value.key == "register"


def _sweep(pretrained: Path, tmp_path: Path, uri: str, *extra: str) -> SweepResult:
    from bertpipe.finetuning.sweep import run_sweep

    cfg = _cfg(
        pretrained,
        tmp_path,
        uri,
        "glue",
        "sweep.learning_rate=[1e-5, 2e-3, 5e-3]",
        "sweep.batch_size=[8]",
        "sweep.epochs=[1]",
        *extra,
    )
    cfg.output = None
    cfg.output_root = str(tmp_path / "runs")
    return run_sweep(cfg)


def test_sweep_keeps_only_the_best_trials_model(pretrained: Path, tmp_path: Path) -> None:
    import mlflow
    import mlflow.transformers

    uri = sqlite_uri(tmp_path / "mlflow.db")
    result = _sweep(pretrained, tmp_path, uri, "register=sweep-best")  # keep_models: best
    folder = Path(result.output)
    assert folder.parent == tmp_path / "runs" and folder.name.startswith("sweep-sst-2-")
    trials = sorted(folder.glob("trial-*"))
    assert [t.name for t in trials] == ["trial-000", "trial-001", "trial-002"]
    with_model = [t for t in trials if (t / "best").exists()]
    assert with_model == [Path(result.best.output)]  # only the winner's model is kept
    for trial in trials:  # every trial keeps its predictions
        assert (trial / "predictions" / "epoch1").exists() and (trial / "finetune.yaml").exists()
    # the kept model loads from its folder
    model = load_task_model(Path(result.best.output) / "best")
    ids = torch.tensor([[2, 10, 11, 3]])
    assert model(ids).logits.shape == (1, 2)
    client = mlflow.MlflowClient(tracking_uri=uri)
    parent = client.get_run(result.run_id)
    assert parent.data.tags["bertpipe.best_run_id"] == result.best.run_id
    assert parent.data.tags["bertpipe.best_model_path"] == str(
        (Path(result.best.output) / "best").resolve()
    )
    for _, trial in result.trials:  # metrics and params for all, the model for the best only
        run = client.get_run(trial.run_id)
        assert "best/accuracy" in run.data.metrics and "learning_rate" in run.data.params
        assert "predictions" in {a.path for a in client.list_artifacts(trial.run_id)}
        outputs = [m.model_id for m in run.outputs.model_outputs]
        is_best = trial.run_id == result.best.run_id
        assert outputs == ([result.best.model_id] if is_best else []), trial.output
    assert result.best.model_id and parent.data.tags["bertpipe.best_model_id"]
    # register=NAME on a sweep: the best trial's logged model only, from the best trial's run
    assert result.best.registered_model == "sweep-best/1"
    assert parent.data.tags["bertpipe.registered_model"] == "sweep-best/1"
    version = client.get_model_version("sweep-best", "1")
    assert version.run_id == result.best.run_id
    assert version.source == f"models:/{result.best.model_id}"
    assert [str(v.version) for v in client.search_model_versions("name='sweep-best'")] == ["1"]
    mlflow.set_tracking_uri(uri)
    loaded = mlflow.transformers.load_model("models:/sweep-best/1", return_type="components")
    assert type(loaded["model"]).__name__ == "BertForSequenceClassification"
    batch = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids)}
    batch["attention_mask"] = torch.ones_like(ids)
    with torch.no_grad():  # transformers' BERT computes bertpipe's logits (other fp32 kernels)
        got, want = loaded["model"](**batch).logits, model(**batch).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_sweep_keep_models_all(pretrained: Path, tmp_path: Path) -> None:
    import mlflow

    uri = sqlite_uri(tmp_path / "mlflow.db")
    result = _sweep(pretrained, tmp_path, uri, "sweep.keep_models=all")
    client = mlflow.MlflowClient(tracking_uri=uri)
    for _, trial in result.trials:  # every trial's model is a logged model of its run
        assert (Path(trial.output) / "best" / "config.json").exists()
        outputs = client.get_run(trial.run_id).outputs.model_outputs
        assert trial.model_id and [m.model_id for m in outputs] == [trial.model_id]
    assert result.best.registered_model is None


def test_sweep_deletes_a_model_once_a_better_trial_is_known(
    pretrained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The order of deletions, with trials whose scores are set (0.5, then better 0.7, then
    worse 0.6): each losing model is gone right after the trial that decides it."""
    from bertpipe.finetuning import sweep
    from bertpipe.finetuning.run import FinetuneResult

    scores = iter([0.5, 0.7, 0.6])
    seen: list[list[str]] = []

    def fake_run(trial: FinetuneConfig, **kwargs: object) -> FinetuneResult:
        assert kwargs["upload_model"] is False and trial.register is None
        seen.append(sorted(p.parent.name for p in Path(trial.output).parent.glob("*/best")))
        (Path(str(trial.output)) / "best").mkdir(parents=True)
        metrics = {"accuracy": next(scores)}
        return FinetuneResult(None, metrics, 1, "accuracy", True, [], str(trial.output))

    monkeypatch.setattr(sweep, "run_finetuning", fake_run)
    cfg = _cfg(
        pretrained,
        tmp_path,
        "sqlite:///unused.db",
        "glue",
        "sweep.learning_rate=[1e-5, 2e-5, 3e-5]",
        "sweep.batch_size=[8]",
        "sweep.epochs=[1]",
        "tracking.enabled=false",
    )
    result = sweep.run_sweep(cfg)
    assert seen == [[], ["trial-000"], ["trial-001"]]  # trial-000 went once trial-001 beat it
    assert result.best.output.endswith("trial-001") and result.best_params["learning_rate"] == 2e-5
    assert sorted(p.parent.name for p in Path(result.output).glob("*/best")) == ["trial-001"]
