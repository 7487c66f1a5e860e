"""Lineage and the MLflow model registry against a real `mlflow server`: pre-train -> `bertpipe
export --register` -> `bertpipe finetune register=...` from that export; both registered
models load back with `mlflow.pytorch.load_model` and compute what the originals compute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bertpipe.app.cli import main
from bertpipe.config import load_config
from tests.conftest import free_port, parity_task

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("keep_logging")]


def _pretrain(shards: Path, out: Path, uri: str) -> Path:
    """Two steps of a tiny BERT (one phase, ZeRO 0), tracked at ``uri``; the checkpoints."""
    from bertpipe.training.config import PretrainConfig
    from bertpipe.training.trainer import run_pretraining

    cfg = load_config(
        PretrainConfig,
        None,
        [
            f"output={out}",
            "model.preset=tiny",
            "model.max_position_embeddings=128",
            f"phases=[{{name: phase1, data: {shards / 'seq64'}, max_steps: 2, "
            "micro_batch_size: 8, global_batch_size: 8, learning_rate: 1.0e-3, warmup: 0.5}]",
            "precision=fp32",
            "zero.stage=0",
            "data.num_workers=0",
            "log_every_steps=1",
            "eval.max_batches=1",
            f"tracking.uri={uri}",
            "tracking.experiment=registry-tests",
        ],
    )
    run_pretraining(cfg)
    return Path(cfg.checkpoint_dir)


def _inputs(vocab_size: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab_size, (2, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": mask}


def test_export_and_finetune_register_models_that_load_back(
    pretrain_shards: Path,
    tmp_path: Path,
    mlflow_server: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mlflow
    import mlflow.pytorch

    from bertpipe.finetuning.config import FinetuneConfig
    from bertpipe.finetuning.loop import load_task_model, run_finetuning
    from bertpipe.training import checkpoint as ckpt
    from bertpipe.training.export import load_checkpoint_model

    uri = mlflow_server
    checkpoints = _pretrain(pretrain_shards, tmp_path / "pretrain", uri)
    state, _ = ckpt.read_state(str(checkpoints), ckpt.latest_tag(str(checkpoints)), 0)
    pretrain_run = state.mlflow_run_id
    assert pretrain_run

    # export: the tracking URI comes from the checkpoint's config
    export = tmp_path / "hf"
    assert main(["export", str(checkpoints), str(export), "--register", "bert-pre"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["source_run_id"] == pretrain_run and info["registered_model"] == "bert-pre/1"
    on_disk = json.loads((export / "bertpipe_export.json").read_text())
    assert on_disk["source_run_id"] == pretrain_run and on_disk["tracking_uri"] == uri
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run(pretrain_run)
    assert run.data.tags["bertpipe.export.path"] == str(export.resolve())
    assert run.data.tags["bertpipe.registered_model"] == "bert-pre/1"
    assert run.info.status == "FINISHED"  # recording the export does not reopen the run
    tag = ckpt.latest_tag(str(checkpoints))
    exported = {a.path for a in client.list_artifacts(pretrain_run, f"exports/{tag}")}
    assert f"exports/{tag}/bertpipe_export.json" in exported
    assert [str(v.version) for v in client.search_model_versions("name='bert-pre'")] == ["1"]
    assert client.get_registered_model("bert-pre").name == "bert-pre"

    mlflow.set_tracking_uri(uri)
    original, _ = load_checkpoint_model(str(checkpoints))
    loaded = mlflow.pytorch.load_model("models:/bert-pre/1")
    assert type(loaded).__name__ == "BertForPreTraining"
    batch = _inputs(original.config.vocab_size)
    with torch.no_grad():
        want, got = original(**batch), loaded(**batch)
    assert torch.equal(want.mlm_logits, got.mlm_logits)
    assert torch.equal(want.nsp_logits, got.nsp_logits)

    # fine-tune from the export: lineage tag, and the best model registered
    train, dev = parity_task(tmp_path / "task")
    cfg = load_config(
        FinetuneConfig,
        None,
        [
            f"init_from={export}",
            f"output_root={tmp_path / 'finetune'}",
            "task.family=table",
            "task.name=parity",
            f"task.train={train}",
            f"task.dev=[{dev}]",
            "epochs=2",
            "batch_size=8",
            "learning_rate=1e-3",
            f"tracking.uri={uri}",
            "tracking.experiment=registry-tests",
            "register=bert-task",
        ],
    )
    result = run_finetuning(cfg)
    assert result.registered_model == "bert-task/1"
    run = client.get_run(result.run_id)
    assert run.data.tags["bertpipe.source_run_id"] == pretrain_run
    assert run.data.tags["bertpipe.parent_run_id"] == pretrain_run
    assert run.data.tags["bertpipe.registered_model"] == "bert-task/1"
    assert [str(v.version) for v in client.search_model_versions("name='bert-task'")] == ["1"]
    original_task = load_task_model(Path(result.output) / "best")
    loaded_task = mlflow.pytorch.load_model("models:/bert-task/1")
    assert type(loaded_task).__name__ == "BertForSequenceClassification"
    with torch.no_grad():
        want_logits = original_task(**batch).logits
        got_logits = loaded_task(**batch).logits
    assert torch.equal(want_logits, got_logits)

    # an unreachable registry: one line naming the option that holds the tracking URI
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    dead = f"http://127.0.0.1:{free_port()}"
    argv = ["export", str(checkpoints), str(tmp_path / "hf2"), "--register", "x"]
    capsys.readouterr()
    assert main([*argv, "--tracking-uri", dead]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("bertpipe: error: --tracking-uri: ") and dead in last
