"""The modernbert family through the real trainer (DeepSpeed on CPU): it learns, resumes
exactly, exports a folder transformers loads as ModernBertForMaskedLM with bertpipe's logits,
and that folder starts a continued pre-training."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from bertpipe.config import ConfigError, load_config
from bertpipe.training import checkpoint as ckpt
from bertpipe.training.pretrain.config import PretrainConfig
from bertpipe.training.pretrain.trainer import run_pretraining
from tests.conftest import sqlite_uri

pytestmark = pytest.mark.integration


def _cfg(
    shards: Path, out: Path, uri: str, steps: int = 12, family: str = "modernbert", **extra: object
) -> PretrainConfig:
    items = [
        f"output={out}",
        f"model.family={family}",
        "model.preset=tiny",
        "model.max_position_embeddings=128",
    ]
    if family == "modernbert":
        items.append("model.local_attention=16")  # the data's 64-token sequences exceed it
    items += [
        f"phases=[{{name: phase1, data: {shards}/seq64, max_steps: {steps}, micro_batch_size: 8,"
        " global_batch_size: 16, learning_rate: 3.0e-3, warmup: 0.25}]",
        "precision=fp32",
        "zero.stage=1",
        "data.num_workers=0",
        "log_every_steps=1",
        "checkpoint.every_steps=4",
        "checkpoint.keep_last=3",
        "eval.max_batches=2",
        f"tracking.uri={uri}",
        "tracking.experiment=modern-tests",
    ]
    items += [f"{k.replace('__', '.')}={v}" for k, v in extra.items()]
    return load_config(PretrainConfig, None, items)  # type: ignore[return-value]


def _losses(uri: str, run_id: str) -> list[tuple[int, float]]:
    import mlflow

    history = mlflow.MlflowClient(tracking_uri=uri).get_metric_history(run_id, "train/loss")
    return sorted((m.step, m.value) for m in history)


def test_modernbert_trains_resumes_exactly_exports_and_continues(
    mlm_shards: Path, tmp_path: Path
) -> None:
    import mlflow
    import transformers

    from bertpipe.training.export import export_checkpoint, load_checkpoint_model

    uri = sqlite_uri(tmp_path / "mlflow.db")
    cfg = _cfg(mlm_shards, tmp_path / "run", uri)
    run_pretraining(cfg)
    folder = Path(cfg.checkpoint_dir)
    state, _ = ckpt.read_state(str(folder), "global_step12", 0)
    assert state.model["family"] == "modernbert"
    losses = [v for _, v in _losses(uri, state.mlflow_run_id)]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3]) - 0.3
    metrics = mlflow.MlflowClient(tracking_uri=uri).get_run(state.mlflow_run_id).data.metrics
    assert "train/mlm_accuracy" in metrics and "eval/mlm_loss" in metrics
    assert not any("nsp" in key for key in metrics)  # no NSP head: no NSP numbers

    # exact resume: back to step 8, the same command again
    shutil.rmtree(folder / "global_step12")
    (folder / "latest").write_text("global_step8")
    run_pretraining(_cfg(mlm_shards, tmp_path / "run", uri))
    again = [v for s, v in _losses(uri, state.mlflow_run_id) if s > 8]
    assert len(again) == 8 and again[0::2] == again[1::2]  # steps 9-12 twice, bit for bit

    # export: transformers' ModernBertForMaskedLM with bertpipe's logits
    export_checkpoint(str(folder), str(tmp_path / "hf"), track=False)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "modernbert" and config["local_attention"] == 16
    ours, _ = load_checkpoint_model(str(folder))
    hf = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert config["cls_token_id"] == tok.cls_token_id and config["sep_token_id"] == tok.sep_token_id
    text = ["The state government said it was important. " * 4, "Early"]
    enc = tok(text, return_tensors="pt", padding=True)
    assert enc["input_ids"].shape[1] > 17  # longer than the window
    with torch.no_grad():
        theirs = hf(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
        mine = ours(enc["input_ids"], attention_mask=enc["attention_mask"]).mlm_logits
    real = enc["attention_mask"].bool()
    torch.testing.assert_close(mine[real], theirs[real], atol=2e-5, rtol=1e-4)

    # continued pre-training from the exported folder: same architecture, its weights
    cont = _cfg(mlm_shards, tmp_path / "cont", uri, steps=2, model__init_from=tmp_path / "hf")
    summary = run_pretraining(cont)
    assert summary["phase1"]["steps"] == 2
    first = _losses(uri, ckpt.read_state(cont.checkpoint_dir, "global_step2", 0)[0].mlflow_run_id)
    assert first[0][1] < losses[0] - 0.3  # starts where the export left off, not from scratch


def test_bert_on_mlm_data_trains_without_nsp(mlm_shards: Path, tmp_path: Path) -> None:
    """The paper's architecture on the mlm objective (RoBERTa's recipe): no NSP labels reach
    the model, so no NSP loss or accuracy is logged, and the masks are the 30% of the data."""
    import mlflow

    uri = sqlite_uri(tmp_path / "mlflow.db")
    cfg = _cfg(mlm_shards, tmp_path / "run", uri, steps=2, family="bert")
    run_pretraining(cfg)
    state, _ = ckpt.read_state(cfg.checkpoint_dir, "global_step2", 0)
    assert "family" not in state.model
    metrics = mlflow.MlflowClient(tracking_uri=uri).get_run(state.mlflow_run_id).data.metrics
    assert "train/mlm_loss" in metrics and not any("nsp" in key for key in metrics)


def test_family_settings_are_checked_before_anything_runs(tmp_path: Path) -> None:
    def load(*items: str) -> PretrainConfig:
        return load_config(PretrainConfig, None, [f"output={tmp_path}", *items])  # type: ignore[return-value]

    assert load("model.preset=modernbert-base").model.resolved_family == "modernbert"
    assert load("model.preset=base").model.resolved_family == "bert"
    with pytest.raises(ConfigError, match=r"model.preset.*family=modernbert"):
        load("model.family=bert", "model.preset=modernbert-large")
    with pytest.raises(ConfigError, match=r"model.pre_layer_norm.*bert setting"):
        load("model.family=modernbert", "model.pre_layer_norm=true")
    with pytest.raises(ConfigError, match=r"model.local_attention.*modernbert setting"):
        load("model.local_attention=64")
