"""Task models on the pre-trained encoder of either family, named and computed as
transformers' ``BertFor*`` and ``ModernBertFor*`` task classes.

A task model is the family's encoder as transformers names it (``bert.*``; ModernBERT's
``model.*`` and its prediction head ``head.*``), dropout, and one task layer: the sequence
classifier (or regressor) on the pooled ``[CLS]`` state, a label for every token, or a start
and an end logit for every token (span QA). What differs by family (the encoder, its
features, the dropout's default, the init of the new layer, the QA layer's name) is the
family's (:func:`~bertpipe.training.models.bert.model.task_encoder` and the functions beside
it, looked up through :mod:`bertpipe.training.models.families`); the losses and outputs are
written once here. Each model starts from a pre-training state dict with
:meth:`BertTaskModel.from_pretrained_state`. Shapes: B batch, S sequence length, H hidden
size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch.nn.functional as F
from torch import Tensor, nn

from bertpipe.training.models.bert.model import Dropout
from bertpipe.training.models.families import family_of
from bertpipe.training.models.hf import load_into

if TYPE_CHECKING:
    from bertpipe.finetuning.tasks.base import TaskSpec

__all__ = [
    "TASK_MODELS",
    "BertForQuestionAnswering",
    "BertForSequenceClassification",
    "BertForTokenClassification",
    "BertTaskModel",
    "ModernBertForQuestionAnswering",
    "ModernBertForSequenceClassification",
    "ModernBertForTokenClassification",
    "QuestionAnsweringOutput",
    "SequenceClassifierOutput",
    "TokenClassifierOutput",
    "build_head",
]

IGNORE_INDEX = -100
M = TypeVar("M", bound="BertTaskModel")


class BertTaskModel(nn.Module):
    """A task model of either family: its encoder (attributes as transformers names them),
    ``dropout`` and the task layer with ``outputs`` features."""

    task: ClassVar[str]
    """transformers' task suffix: ``ForSequenceClassification``..."""
    pooled: ClassVar[bool] = False
    """The layer reads the pooled ``[CLS]`` state, not every token's."""
    span_qa: ClassVar[bool] = False

    def __init__(self, cfg: Any, outputs: int, classifier_dropout: float | None) -> None:
        super().__init__()
        family = family_of(cfg)
        if type(self).__name__ != f"{family.class_prefix}{self.task}":
            raise TypeError(f"{type(self).__name__} is not a {family.title} model: use build_head")
        if outputs < 1:
            raise ValueError(f"num_labels must be at least 1, got {outputs}")
        self.config = cfg
        self.num_labels = outputs
        for name, module in self._family.task_encoder(cfg, self.pooled).items():
            self.add_module(name, module)
        self.dropout = Dropout(self._family.task_dropout(cfg, self.span_qa, classifier_dropout))
        layer = nn.Linear(cfg.hidden_size, outputs)
        self.add_module(self._family.QA_LAYER if self.span_qa else "classifier", layer)
        self._family.init_task_layer(self, layer, cfg)

    @property
    def _family(self) -> ModuleType:
        """The family's ``model`` module (its task pieces)."""
        return family_of(self.config).module("model")

    @classmethod
    def from_pretrained_state(
        cls: type[M], cfg: Any, state_dict: Mapping[str, Tensor], **kwargs: Any
    ) -> M:
        """Build ``cls(cfg, **kwargs)`` and copy the encoder from ``state_dict`` (ours or
        transformers' names, vocab padded or not); the task layer stays freshly initialised.
        Raises ValueError when embedding or encoder weights are missing or do not fit."""
        model = cls(cfg, **kwargs)
        load_into(model, state_dict, strict_heads=False)
        return model

    def _features(
        self, input_ids: Tensor, token_type_ids: Tensor | None, attention_mask: Tensor | None
    ) -> Tensor:
        """The encoder's features for the task layer, after dropout."""
        states = self._family.task_features(
            self, input_ids, token_type_ids, attention_mask, self.pooled
        )
        return self.dropout(states)


@dataclasses.dataclass
class SequenceClassifierOutput:
    logits: Tensor
    """[B, num_labels] ([B, 1] for regression)."""
    loss: Tensor | None = None
    """Mean fp32 cross-entropy, or mean squared error when num_labels == 1."""


class _SequenceClassification(BertTaskModel):
    """Classifier (or regressor when ``num_labels == 1``) on the pooled ``[CLS]`` state."""

    task = "ForSequenceClassification"
    pooled = True

    def __init__(self, cfg: Any, num_labels: int, classifier_dropout: float | None = None) -> None:
        super().__init__(cfg, num_labels, classifier_dropout)

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> SequenceClassifierOutput:
        """``labels``: long [B] class ids, or float [B] targets for regression."""
        logits = self.classifier(self._features(input_ids, token_type_ids, attention_mask))
        loss = None
        if labels is not None:
            if self.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1).float(), labels.float())
            else:
                loss = F.cross_entropy(logits.float(), labels)
        return SequenceClassifierOutput(logits=logits, loss=loss)


@dataclasses.dataclass
class TokenClassifierOutput:
    logits: Tensor
    """[B, S, num_labels]."""
    loss: Tensor | None = None
    """Mean fp32 cross-entropy over the labels that are not -100."""


class _TokenClassification(BertTaskModel):
    """A label for every token (NER, POS tagging)."""

    task = "ForTokenClassification"

    def __init__(self, cfg: Any, num_labels: int, classifier_dropout: float | None = None) -> None:
        super().__init__(cfg, num_labels, classifier_dropout)

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> TokenClassifierOutput:
        """``labels``: long [B, S], -100 at tokens without a label (padding, sub-words)."""
        logits = self.classifier(self._features(input_ids, token_type_ids, attention_mask))
        loss = None
        if labels is not None:
            flat = logits.reshape(-1, self.num_labels).float()
            loss = F.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE_INDEX)
        return TokenClassifierOutput(logits=logits, loss=loss)


@dataclasses.dataclass
class QuestionAnsweringOutput:
    start_logits: Tensor
    """[B, S] score of each token starting the answer."""
    end_logits: Tensor
    """[B, S] score of each token ending the answer."""
    loss: Tensor | None = None
    """Mean of the start and end fp32 cross-entropies."""


class _QuestionAnswering(BertTaskModel):
    """Extractive QA (SQuAD): a start and an end logit for every token."""

    task = "ForQuestionAnswering"
    span_qa = True

    def __init__(self, cfg: Any, classifier_dropout: float | None = None) -> None:
        super().__init__(cfg, 2, classifier_dropout)

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
        layer = getattr(self, self._family.QA_LAYER)
        start_logits, end_logits = layer(
            self._features(input_ids, token_type_ids, attention_mask)
        ).unbind(-1)
        loss = None
        if start_positions is not None and end_positions is not None:
            S = start_logits.shape[1]
            start = F.cross_entropy(
                start_logits.float(), start_positions.clamp(0, S), ignore_index=S
            )
            end = F.cross_entropy(end_logits.float(), end_positions.clamp(0, S), ignore_index=S)
            loss = (start + end) / 2
        return QuestionAnsweringOutput(start_logits=start_logits, end_logits=end_logits, loss=loss)


# transformers' class names, which the exported config.json records as the architecture
class BertForSequenceClassification(_SequenceClassification):
    """transformers' ``BertForSequenceClassification``: the pooler's output, dropout, a Linear."""


class BertForTokenClassification(_TokenClassification):
    """transformers' ``BertForTokenClassification``."""


class BertForQuestionAnswering(_QuestionAnswering):
    """transformers' ``BertForQuestionAnswering`` (``qa_outputs``, no dropout before it)."""


class ModernBertForSequenceClassification(_SequenceClassification):
    """transformers' ``ModernBertForSequenceClassification`` (``[CLS]`` pooling)."""


class ModernBertForTokenClassification(_TokenClassification):
    """transformers' ``ModernBertForTokenClassification``."""


class ModernBertForQuestionAnswering(_QuestionAnswering):
    """transformers' ``ModernBertForQuestionAnswering``."""


TASK_MODELS: Mapping[str, type[BertTaskModel]] = {
    cls.__name__: cls
    for cls in (
        BertForSequenceClassification,
        BertForTokenClassification,
        BertForQuestionAnswering,
        ModernBertForSequenceClassification,
        ModernBertForTokenClassification,
        ModernBertForQuestionAnswering,
    )
}
"""Every task model by its transformers class name (a saved model's ``architectures``)."""

_TASKS = {"span_qa": _QuestionAnswering, "token_labels": _TokenClassification}


def build_head(spec: TaskSpec, config: Any, dropout: float | None) -> BertTaskModel:
    """The task model of ``spec``'s kind for ``config``'s family (freshly initialised): span
    QA, token labels, or sequence classification/regression with ``spec.num_labels`` outputs;
    ``dropout`` before the task layer (None: the family's default)."""
    base = _TASKS.get(spec.kind, _SequenceClassification)
    cls = TASK_MODELS[f"{family_of(config).class_prefix}{base.task}"]
    if base is _QuestionAnswering:
        return cls(config, classifier_dropout=dropout)
    return cls(config, spec.num_labels, dropout)
