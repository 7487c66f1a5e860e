"""Task models on the pre-trained encoder, named as transformers' (``bert.*`` + head).

Each model starts from a pre-training state dict with :meth:`BertTaskModel.from_pretrained_state`:
the encoder weights are copied, the new head keeps BERT's init (N(0, initializer_range),
zero bias). Shapes: B batch, S sequence length, H hidden size.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch.nn.functional as F
from torch import Tensor, nn

from bertpipe.training.models.bert.hf import load_into
from bertpipe.training.models.bert.model import BertModel, BertModelConfig, Dropout, init_weights

if TYPE_CHECKING:
    from bertpipe.finetuning.tasks.base import TaskSpec

__all__ = [
    "BertForQuestionAnswering",
    "BertForSequenceClassification",
    "BertForTokenClassification",
    "BertTaskModel",
    "QuestionAnsweringOutput",
    "SequenceClassifierOutput",
    "TokenClassifierOutput",
    "build_head",
]

IGNORE_INDEX = -100
M = TypeVar("M", bound="BertTaskModel")


class BertTaskModel(nn.Module):
    """Base of the task models: holds ``config`` and loads a pre-trained encoder."""

    config: BertModelConfig
    bert: BertModel

    @classmethod
    def from_pretrained_state(
        cls: type[M], cfg: BertModelConfig, state_dict: Mapping[str, Tensor], **kwargs: Any
    ) -> M:
        """Build ``cls(cfg, **kwargs)`` and copy the encoder (``bert.*``) from ``state_dict``
        (ours or transformers' names, vocab padded or not); the head stays freshly initialised.
        Raises ValueError when embedding or encoder weights are missing or do not fit."""
        model = cls(cfg, **kwargs)
        load_into(model, state_dict, strict_heads=False)
        return model

    def _init_head(self, *modules: nn.Module) -> None:
        for module in modules:
            module.apply(functools.partial(init_weights, std=self.config.initializer_range))


@dataclasses.dataclass
class SequenceClassifierOutput:
    logits: Tensor
    """[B, num_labels] ([B, 1] for regression)."""
    loss: Tensor | None = None
    """Mean fp32 cross-entropy, or mean squared error when num_labels == 1."""


class BertForSequenceClassification(BertTaskModel):
    """Classifier (or regressor when ``num_labels == 1``) on the pooled [CLS] state."""

    def __init__(
        self, cfg: BertModelConfig, num_labels: int, classifier_dropout: float | None = None
    ) -> None:
        super().__init__()
        if num_labels < 1:
            raise ValueError(f"num_labels must be at least 1, got {num_labels}")
        self.config = cfg
        self.num_labels = num_labels
        self.bert = BertModel(cfg)
        drop = cfg.hidden_dropout if classifier_dropout is None else classifier_dropout
        self.dropout = Dropout(drop)
        self.classifier = nn.Linear(cfg.hidden_size, num_labels)
        self._init_head(self.classifier)

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> SequenceClassifierOutput:
        """Inputs as :meth:`BertModel.forward`; ``labels``: long [B] class ids, or float [B]
        targets for regression."""
        pooled = self.bert(input_ids, token_type_ids, attention_mask).pooled_output
        assert pooled is not None
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            if self.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1).float(), labels.float())
            else:
                loss = F.cross_entropy(logits.float(), labels)
        return SequenceClassifierOutput(logits=logits, loss=loss)


@dataclasses.dataclass
class QuestionAnsweringOutput:
    start_logits: Tensor
    """[B, S] score of each token starting the answer."""
    end_logits: Tensor
    """[B, S] score of each token ending the answer."""
    loss: Tensor | None = None
    """Mean of the start and end fp32 cross-entropies."""


class BertForQuestionAnswering(BertTaskModel):
    """Extractive QA (SQuAD): a start and an end logit for every token."""

    def __init__(self, cfg: BertModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.num_labels = 2
        self.bert = BertModel(cfg, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(cfg.hidden_size, 2)
        self._init_head(self.qa_outputs)

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        start_positions: Tensor | None = None,
        end_positions: Tensor | None = None,
    ) -> QuestionAnsweringOutput:
        """``start_positions``/``end_positions``: long [B] token indices of the answer span;
        positions outside [0, S) are clamped to S and ignored (as transformers does). Logits
        are not masked here: the caller masks question and padding tokens when decoding."""
        tokens = self.bert(input_ids, token_type_ids, attention_mask).sequence_output
        start_logits, end_logits = self.qa_outputs(tokens).unbind(-1)
        loss = None
        if start_positions is not None and end_positions is not None:
            S = start_logits.shape[1]
            start = F.cross_entropy(
                start_logits.float(), start_positions.clamp(0, S), ignore_index=S
            )
            end = F.cross_entropy(end_logits.float(), end_positions.clamp(0, S), ignore_index=S)
            loss = (start + end) / 2
        return QuestionAnsweringOutput(start_logits=start_logits, end_logits=end_logits, loss=loss)


@dataclasses.dataclass
class TokenClassifierOutput:
    logits: Tensor
    """[B, S, num_labels]."""
    loss: Tensor | None = None
    """Mean fp32 cross-entropy over the labels that are not -100."""


class BertForTokenClassification(BertTaskModel):
    """A label for every token (NER, POS tagging)."""

    def __init__(
        self, cfg: BertModelConfig, num_labels: int, classifier_dropout: float | None = None
    ) -> None:
        super().__init__()
        if num_labels < 1:
            raise ValueError(f"num_labels must be at least 1, got {num_labels}")
        self.config = cfg
        self.num_labels = num_labels
        self.bert = BertModel(cfg, add_pooling_layer=False)
        drop = cfg.hidden_dropout if classifier_dropout is None else classifier_dropout
        self.dropout = Dropout(drop)
        self.classifier = nn.Linear(cfg.hidden_size, num_labels)
        self._init_head(self.classifier)

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> TokenClassifierOutput:
        """``labels``: long [B, S], -100 at tokens without a label (padding, sub-words)."""
        tokens = self.bert(input_ids, token_type_ids, attention_mask).sequence_output
        logits = self.classifier(self.dropout(tokens))
        loss = None
        if labels is not None:
            flat = logits.reshape(-1, self.num_labels).float()
            loss = F.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE_INDEX)
        return TokenClassifierOutput(logits=logits, loss=loss)


def build_head(spec: TaskSpec, config: Any, dropout: float | None) -> BertTaskModel:
    """The task model of ``spec``'s kind (freshly initialised): span QA, token labels, or
    sequence classification/regression with ``spec.num_labels`` outputs; ``dropout`` before
    the task layer (None: the encoder's hidden dropout; 0 for ModernBERT, transformers'
    default). A ModernBERT config gets the ``ModernBertFor*`` models of
    :mod:`bertpipe.finetuning.modern_heads`."""
    if getattr(config, "family", "bert") == "modernbert":
        from bertpipe.finetuning import modern_heads as modern

        if spec.kind == "span_qa":
            return modern.ModernBertForQuestionAnswering(config, dropout)
        if spec.kind == "token_labels":
            return modern.ModernBertForTokenClassification(config, spec.num_labels, dropout)
        return modern.ModernBertForSequenceClassification(config, spec.num_labels, dropout)
    if spec.kind == "span_qa":
        return BertForQuestionAnswering(config)
    if spec.kind == "token_labels":
        return BertForTokenClassification(config, spec.num_labels, dropout)
    return BertForSequenceClassification(config, spec.num_labels, dropout)
