"""Task heads: forward/backward on tiny inputs, encoder copied from a pre-training model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch

from bertpipe.finetuning.heads import (
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertTaskModel,
)
from bertpipe.training.models.bert.model import BertForPreTraining, BertModelConfig
from bertpipe.training.models.hf import export_state_dict, save_hf_folder

VOCAB = 203


def tiny_config() -> BertModelConfig:
    return BertModelConfig(
        vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, max_position_embeddings=32
    )


def inputs() -> dict[str, torch.Tensor]:
    """B=4 rows of S=9 tokens, one padded."""
    B, S = 4, 9
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, 5:] = 0
    return {
        "input_ids": torch.randint(1, VOCAB, (B, S), generator=g) * mask,
        "token_type_ids": torch.zeros(B, S, dtype=torch.long),
        "attention_mask": mask,
    }


def check_backward(model: torch.nn.Module, loss: torch.Tensor | None) -> None:
    assert loss is not None and loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "pooler" not in n)


@pytest.mark.parametrize("num_labels", [3, 1])
def test_sequence_classification(num_labels: int) -> None:
    torch.manual_seed(0)
    model = BertForSequenceClassification(tiny_config(), num_labels=num_labels).train()
    labels = torch.tensor([0, 2, 1, 0]) if num_labels > 1 else torch.randn(4)
    out = model(**inputs(), labels=labels)
    assert out.logits.shape == (4, num_labels)
    check_backward(model, out.loss)
    if num_labels == 1:
        expected = torch.nn.functional.mse_loss(out.logits.squeeze(-1), labels)
        torch.testing.assert_close(out.loss, expected)


def test_question_answering() -> None:
    torch.manual_seed(0)
    model = BertForQuestionAnswering(tiny_config()).train()
    assert "bert.pooler.dense.weight" not in model.state_dict()
    out = model(
        **inputs(),
        start_positions=torch.tensor([1, 2, 3, 50]),
        end_positions=torch.tensor([2, 2, 5, 50]),
    )
    assert out.start_logits.shape == (4, 9) and out.end_logits.shape == (4, 9)
    check_backward(model, out.loss)
    # the out-of-range example (position 50) is ignored
    start = torch.nn.functional.cross_entropy(out.start_logits[:3], torch.tensor([1, 2, 3]))
    end = torch.nn.functional.cross_entropy(out.end_logits[:3], torch.tensor([2, 2, 5]))
    torch.testing.assert_close(out.loss, (start + end) / 2)


def test_token_classification() -> None:
    torch.manual_seed(0)
    model = BertForTokenClassification(tiny_config(), num_labels=5).train()
    batch = inputs()
    labels = torch.randint(0, 5, (4, 9))
    labels[batch["attention_mask"] == 0] = -100
    out = model(**batch, labels=labels)
    assert out.logits.shape == (4, 9, 5)
    check_backward(model, out.loss)


@pytest.mark.parametrize("exported", [False, True], ids=["ours", "transformers_names"])
def test_encoder_weights_come_from_pretraining(exported: bool) -> None:
    torch.manual_seed(0)
    pretrained = BertForPreTraining(tiny_config())
    state = export_state_dict(pretrained) if exported else pretrained.state_dict()
    tasks: list[tuple[type[BertTaskModel], dict[str, Any]]] = [
        (BertForSequenceClassification, {"num_labels": 3}),
        (BertForQuestionAnswering, {}),
        (BertForTokenClassification, {"num_labels": 4}),
    ]
    for cls, kwargs in tasks:
        torch.manual_seed(1)
        model = cls.from_pretrained_state(tiny_config(), state, **kwargs)
        ours = model.state_dict()
        for key, value in pretrained.state_dict().items():
            if key.startswith("bert.") and key in ours:
                torch.testing.assert_close(ours[key], value, rtol=0, atol=0, msg=key)
        name = "qa_outputs" if cls is BertForQuestionAnswering else "classifier"
        head = cast(torch.nn.Linear, model.get_submodule(name))
        assert head.weight.std().item() == pytest.approx(0.02, rel=0.5)
        assert torch.all(head.bias == 0)
        model.eval()
        with torch.no_grad():
            encoded = model.bert(**inputs()).sequence_output
            expected = pretrained.eval().bert(**inputs()).sequence_output
        torch.testing.assert_close(encoded, expected)


def test_missing_encoder_weights_raise() -> None:
    state = BertForPreTraining(tiny_config()).state_dict()
    del state["bert.encoder.layer.0.output.dense.weight"]
    with pytest.raises(ValueError, match=r"encoder\.layer\.0\.output\.dense\.weight"):
        BertForTokenClassification.from_pretrained_state(tiny_config(), state, num_labels=2)


@pytest.mark.integration
def test_exported_heads_load_into_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    models: list[BertTaskModel] = [
        BertForSequenceClassification(tiny_config(), num_labels=3),
        BertForQuestionAnswering(tiny_config()),
        BertForTokenClassification(tiny_config(), num_labels=4),
    ]
    for model in models:
        model.eval()
        folder = tmp_path / type(model).__name__
        save_hf_folder(model, folder)
        hf_class = getattr(transformers, type(model).__name__)
        theirs, info = hf_class.from_pretrained(folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        with torch.no_grad():
            ours_out, hf_out = model(**inputs()), theirs.eval()(**inputs())
        if isinstance(model, BertForQuestionAnswering):
            torch.testing.assert_close(ours_out.start_logits, hf_out.start_logits)
            torch.testing.assert_close(ours_out.end_logits, hf_out.end_logits)
        else:
            torch.testing.assert_close(ours_out.logits, hf_out.logits)
