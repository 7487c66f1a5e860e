"""Evaluation metrics, computed by the libraries the community scores with: scikit-learn
(accuracy, F1, macro F1, Matthews correlation, MSE), scipy (Pearson, Spearman, ranks) and
seqeval (entity-level scores, in :mod:`bertpipe.finetuning.tasks.conll`); and
:func:`compute_task_metrics`, which picks a task's metric set from its spec.

Classification and regression scores are fractions (accuracy 0.84, not 84); SQuAD scores
are percentages, as the official script reports them (see :mod:`bertpipe.finetuning.tasks.squad`).
A correlation that is undefined (one side constant, or fewer than two pairs) is reported as
0.0, as scikit-learn does for the Matthews correlation, so that model selection never sees
NaN (scipy gives NaN and a warning there). A class with no true positive has F1 0.0
(scikit-learn's ``zero_division=0``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from scipy import stats
from sklearn import metrics as skm

from bertpipe.finetuning.tasks.base import TaskSpec
from bertpipe.finetuning.tasks.conll import entity_scores
from bertpipe.finetuning.tasks.squad_scores import squad_metrics

__all__ = [
    "accuracy",
    "compute_task_metrics",
    "f1_at_threshold",
    "f1_binary",
    "f1_macro",
    "matthews_corrcoef",
    "mse",
    "pearson",
    "rankdata",
    "spearman",
]


def _pair(predictions: Any, labels: Any, dtype: type = np.int64) -> tuple[np.ndarray, np.ndarray]:
    """Flat [N] arrays of predictions and labels; logits [N, C] become their argmax."""
    pred = np.asarray(predictions)
    gold = np.asarray(labels)
    if dtype is np.int64 and pred.ndim == 2:
        pred = pred.argmax(axis=-1)
    pred = pred.reshape(-1).astype(dtype)
    gold = gold.reshape(-1).astype(dtype)
    if pred.shape != gold.shape:
        raise ValueError(f"{pred.shape[0]} predictions but {gold.shape[0]} labels")
    if pred.size == 0:
        raise ValueError("no predictions to score")
    return pred, gold


def accuracy(predictions: Any, labels: Any) -> float:
    """Share of predictions equal to the label. ``predictions``: ids [N] or logits [N, C]."""
    pred, gold = _pair(predictions, labels)
    return float(skm.accuracy_score(gold, pred))


def f1_binary(predictions: Any, labels: Any, positive: int = 1) -> float:
    """F1 of class ``positive`` (0.0 when it has no true positive), the other classes taken
    together as negative; any number of classes."""
    pred, gold = _pair(predictions, labels)
    return float(skm.f1_score(gold, pred, labels=[positive], average="macro", zero_division=0))


def f1_macro(predictions: Any, labels: Any, classes: Sequence[int] | None = None) -> float:
    """Unweighted mean of per-class F1 over ``classes`` (default: classes in either array)."""
    pred, gold = _pair(predictions, labels)
    chosen = None if classes is None else list(classes)
    return float(skm.f1_score(gold, pred, labels=chosen, average="macro", zero_division=0))


def matthews_corrcoef(predictions: Any, labels: Any) -> float:
    """Matthews correlation, general multi-class form (Gorodkin's R_K); 0.0 when undefined
    (a constant prediction or label)."""
    pred, gold = _pair(predictions, labels)
    if np.union1d(gold, pred).size < 2:  # one class in all: undefined (sklearn warns)
        return 0.0
    return float(skm.matthews_corrcoef(gold, pred))


def _defined(x: np.ndarray, y: np.ndarray) -> bool:
    """A correlation of ``x`` and ``y`` exists: two pairs or more, neither side constant."""
    return x.size >= 2 and bool(np.ptp(x) > 0) and bool(np.ptp(y) > 0)


def pearson(predictions: Any, labels: Any) -> float:
    """Pearson correlation (scipy); 0.0 when either side is constant."""
    x, y = _pair(predictions, labels, np.float64)
    if not _defined(x, y):
        return 0.0
    with warnings.catch_warnings():  # scipy warns of near-constant input it still scores
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        return float(stats.pearsonr(x, y).statistic)


def rankdata(values: Any) -> np.ndarray:
    """Ranks 1..N of ``values`` [N]; ties get the average of the ranks they span (scipy)."""
    return stats.rankdata(np.asarray(values, dtype=np.float64).reshape(-1), method="average")


def spearman(predictions: Any, labels: Any) -> float:
    """Spearman rank correlation (scipy: Pearson of average ranks); 0.0 when either side is
    constant."""
    x, y = _pair(predictions, labels, np.float64)
    if not _defined(x, y):
        return 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        return float(stats.spearmanr(x, y).statistic)


def mse(predictions: Any, labels: Any) -> float:
    """Mean squared error."""
    x, y = _pair(predictions, labels, np.float64)
    return float(skm.mean_squared_error(y, x))


def f1_at_threshold(predictions: Any, labels: Any, threshold: float) -> float:
    """F1 of the pairs scored ``threshold`` or more, on both sides (KLUE-STS: 3.0), by
    scikit-learn's binary F1 (0.0 without a true positive)."""
    x, y = _pair(predictions, labels, np.float64)
    return float(skm.f1_score(y >= threshold, x >= threshold, zero_division=0))


def _classification(spec: TaskSpec) -> dict[str, Callable[[Any, Any], float]]:
    positive = spec.label_to_id[spec.positive_label] if spec.positive_label else 1
    return {
        "accuracy": accuracy,
        "f1": lambda p, g: f1_binary(p, g, positive),
        "macro_f1": f1_macro,
        "mcc": matthews_corrcoef,
    }


def _regression(spec: TaskSpec) -> dict[str, Callable[[Any, Any], float]]:
    table: dict[str, Callable[[Any, Any], float]] = {
        "pearson": pearson,
        "spearman": spearman,
        "mse": mse,
    }
    if spec.threshold is not None:
        threshold = spec.threshold
        table["f1"] = lambda p, g: f1_at_threshold(p, g, threshold)
    return table


def compute_task_metrics(spec: TaskSpec, predictions: Any, labels: Any) -> dict[str, float]:
    """Every metric in ``spec.metrics`` (GLUE's set for GLUE tasks), as name -> value.

    ``predictions``/``labels`` by kind: classification, class ids [N] or logits [N, C] vs
    ids [N]; regression, scores [N] or [N, 1] vs [N]; token_labels, word-level label
    sequences (from ``conll.align_predictions``) vs gold sequences; span_qa, qid -> answer
    text vs qid -> gold texts (``squad_scores.gold_answers``).
    """
    if spec.kind == "token_labels":
        return entity_scores(labels, predictions)
    if spec.kind == "span_qa":
        if not isinstance(predictions, Mapping) or not isinstance(labels, Mapping):
            raise TypeError("span_qa metrics need dicts: qid -> prediction, qid -> gold texts")
        return squad_metrics(predictions, labels)
    table = _classification(spec) if spec.kind == "classification" else _regression(spec)
    unknown = [name for name in spec.metrics if name not in table]
    if unknown:
        raise ValueError(f"task {spec.name}: no {spec.kind} metric named {unknown}")
    return {name: table[name](predictions, labels) for name in spec.metrics}
