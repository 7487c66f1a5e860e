"""Fine-tuning a ModernBERT: the task models are transformers' ModernBertFor* (same names,
same logits), and the fine-tuning loop trains them from a ModernBERT export."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bertpipe.finetuning.heads import (
    BertTaskModel,
    ModernBertForQuestionAnswering,
    ModernBertForSequenceClassification,
    ModernBertForTokenClassification,
)
from bertpipe.finetuning.initialisation import load_task_model
from bertpipe.finetuning.run import run_finetuning
from bertpipe.training.models.hf import load_hf_folder, save_hf_folder
from tests.conftest import sqlite_uri
from tests.finetuning.test_loop import _cfg

transformers = pytest.importorskip("transformers")


def _inputs(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, vocab, (3, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    mask[2, 6:] = 0
    return {"input_ids": ids * mask, "attention_mask": mask}


@pytest.mark.integration
def test_modern_task_models_are_transformers_own(modern_pretrained: Path, tmp_path: Path) -> None:
    cfg, weights = load_hf_folder(modern_pretrained)
    torch.manual_seed(0)
    models: list[BertTaskModel] = [
        ModernBertForSequenceClassification.from_pretrained_state(cfg, weights, num_labels=3),
        ModernBertForQuestionAnswering.from_pretrained_state(cfg, weights),
        ModernBertForTokenClassification.from_pretrained_state(cfg, weights, num_labels=4),
    ]
    inputs = _inputs(cfg.vocab_size)
    real = inputs["attention_mask"].bool()
    for model in models:
        model.eval()
        folder = tmp_path / type(model).__name__
        save_hf_folder(model, folder)
        hf_class = getattr(transformers, type(model).__name__)
        theirs, info = hf_class.from_pretrained(folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        with torch.no_grad():
            ours, hf = model(**inputs), theirs.eval()(**inputs)
        if isinstance(model, ModernBertForQuestionAnswering):
            torch.testing.assert_close(ours.start_logits[real], hf.start_logits[real])
            torch.testing.assert_close(ours.end_logits[real], hf.end_logits[real])
        elif isinstance(model, ModernBertForTokenClassification):
            torch.testing.assert_close(ours.logits[real], hf.logits[real])
        else:
            torch.testing.assert_close(ours.logits, hf.logits)
        assert type(load_task_model(folder)) is type(model)


@pytest.mark.integration
@pytest.mark.parametrize("family", ["glue"])  # the heads test covers QA and tokens
def test_finetuning_trains_a_modernbert_export(
    modern_pretrained: Path, tmp_path: Path, family: str
) -> None:
    uri = sqlite_uri(tmp_path / "mlflow.db")
    result = run_finetuning(_cfg(modern_pretrained, tmp_path, uri, family, "epochs=3"))
    losses = [h["train/loss"] for h in result.history]
    assert len(losses) == 3 and losses[-1] < losses[0]  # it learns
    best = tmp_path / "out" / "best"
    hf = transformers.AutoConfig.from_pretrained(best)
    want = (
        "ModernBertForSequenceClassification"
        if family == "glue"
        else "ModernBertForQuestionAnswering"
    )
    assert hf.architectures == [want]
    model = load_task_model(best)
    theirs = getattr(transformers, want).from_pretrained(best).eval()
    inputs = _inputs(model.config.vocab_size)
    with torch.no_grad():
        ours, hf_out = model(**inputs), theirs(**inputs)
    if family == "glue":
        torch.testing.assert_close(ours.logits, hf_out.logits)
    else:
        real = inputs["attention_mask"].bool()
        torch.testing.assert_close(ours.start_logits[real], hf_out.start_logits[real])
