"""Task models on a ModernBERT encoder, named and computed as transformers'
``ModernBertFor{SequenceClassification,TokenClassification,QuestionAnswering}``: the encoder
(``model.*``), its prediction head (``head.*``: dense, GELU, LayerNorm, which a pre-trained MLM
checkpoint provides, as transformers loads it), dropout and a ``classifier`` Linear. Sequence
classification pools the ``[CLS]`` state (transformers' default ``classifier_pooling``).

They take the batches and return the outputs of :mod:`bertpipe.finetuning.heads` (segment ids,
which ModernBERT has none of, are accepted and ignored), so the fine-tuning loop, the best
model's export and the evaluation suite run on either family.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from bertpipe.finetuning.heads import (
    IGNORE_INDEX,
    BertTaskModel,
    QuestionAnsweringOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from bertpipe.training.models.bert.model import Dropout
from bertpipe.training.models.modernbert.model import (
    ModernBertModel,
    ModernBertModelConfig,
    ModernBertPredictionHead,
    init_modern_weights,
)

__all__ = [
    "ModernBertForQuestionAnswering",
    "ModernBertForSequenceClassification",
    "ModernBertForTokenClassification",
]


class _ModernTaskModel(BertTaskModel):
    """Encoder + prediction head + dropout + ``classifier`` with ``outputs`` features."""

    config: ModernBertModelConfig  # type: ignore[assignment]

    def __init__(
        self, cfg: ModernBertModelConfig, outputs: int, classifier_dropout: float | None
    ) -> None:
        super().__init__()
        self.config = cfg
        self.model = ModernBertModel(cfg)
        self.head = ModernBertPredictionHead(cfg)
        self.drop = Dropout(0.0 if classifier_dropout is None else classifier_dropout)
        self.classifier = nn.Linear(cfg.hidden_size, outputs)
        init_modern_weights(self, cfg)
        # transformers' "final_out" init of task classifiers: std hidden^-1/2, truncated
        std = cfg.hidden_size**-0.5
        cutoff = cfg.initializer_cutoff_factor * std
        nn.init.trunc_normal_(self.classifier.weight, std=std, a=-cutoff, b=cutoff)
        nn.init.zeros_(self.classifier.bias)

    def _states(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        """[B, S, H] after the prediction head and dropout."""
        return self.drop(self.head(self.model(input_ids, attention_mask)))


class ModernBertForSequenceClassification(_ModernTaskModel):
    """Classifier (or regressor when ``num_labels == 1``) on the ``[CLS]`` state."""

    def __init__(
        self, cfg: ModernBertModelConfig, num_labels: int, classifier_dropout: float | None = None
    ) -> None:
        if num_labels < 1:
            raise ValueError(f"num_labels must be at least 1, got {num_labels}")
        super().__init__(cfg, num_labels, classifier_dropout)
        self.num_labels = num_labels

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> SequenceClassifierOutput:
        states = self.model(input_ids, attention_mask)[:, 0]
        logits = self.classifier(self.drop(self.head(states)))
        loss = None
        if labels is not None:
            if self.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1).float(), labels.float())
            else:
                loss = F.cross_entropy(logits.float(), labels)
        return SequenceClassifierOutput(logits=logits, loss=loss)


class ModernBertForTokenClassification(_ModernTaskModel):
    """A label for every token."""

    def __init__(
        self, cfg: ModernBertModelConfig, num_labels: int, classifier_dropout: float | None = None
    ) -> None:
        if num_labels < 1:
            raise ValueError(f"num_labels must be at least 1, got {num_labels}")
        super().__init__(cfg, num_labels, classifier_dropout)
        self.num_labels = num_labels

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> TokenClassifierOutput:
        logits = self.classifier(self._states(input_ids, attention_mask))
        loss = None
        if labels is not None:
            flat = logits.reshape(-1, self.num_labels).float()
            loss = F.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE_INDEX)
        return TokenClassifierOutput(logits=logits, loss=loss)


class ModernBertForQuestionAnswering(_ModernTaskModel):
    """Extractive QA: a start and an end logit for every token."""

    def __init__(self, cfg: ModernBertModelConfig, classifier_dropout: float | None = None) -> None:
        super().__init__(cfg, 2, classifier_dropout)
        self.num_labels = 2

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        start_positions: Tensor | None = None,
        end_positions: Tensor | None = None,
    ) -> QuestionAnsweringOutput:
        start_logits, end_logits = self.classifier(self._states(input_ids, attention_mask)).unbind(
            -1
        )
        loss = None
        if start_positions is not None and end_positions is not None:
            S = start_logits.shape[1]
            start = F.cross_entropy(
                start_logits.float(), start_positions.clamp(0, S), ignore_index=S
            )
            end = F.cross_entropy(end_logits.float(), end_positions.clamp(0, S), ignore_index=S)
            loss = (start + end) / 2
        return QuestionAnsweringOutput(start_logits=start_logits, end_logits=end_logits, loss=loss)
