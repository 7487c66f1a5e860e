"""Evaluation metrics, numpy only: accuracy, F1, Matthews correlation, Pearson, Spearman,
MSE, and :func:`compute_task_metrics`, which picks a task's metric set from its spec.

Classification and regression scores are fractions (accuracy 0.84, not 84); SQuAD scores
are percentages, as the official script reports them (see :mod:`bertpipe.finetuning.tasks.squad`).
A correlation that is undefined (one side constant) is reported as 0.0, as scikit-learn does
for the Matthews correlation, so that model selection never sees NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from bertpipe.finetuning.tasks.base import TaskSpec
from bertpipe.finetuning.tasks.conll import entity_scores
from bertpipe.finetuning.tasks.squad import squad_metrics

__all__ = [
    "accuracy",
    "compute_task_metrics",
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
    return float((pred == gold).mean())


def _f1(pred: np.ndarray, gold: np.ndarray, positive: int) -> float:
    tp = int(np.sum((pred == positive) & (gold == positive)))
    fp = int(np.sum((pred == positive) & (gold != positive)))
    fn = int(np.sum((pred != positive) & (gold == positive)))
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def f1_binary(predictions: Any, labels: Any, positive: int = 1) -> float:
    """F1 of class ``positive`` (0.0 when it has no true positive)."""
    pred, gold = _pair(predictions, labels)
    return _f1(pred, gold, positive)


def f1_macro(predictions: Any, labels: Any, classes: Sequence[int] | None = None) -> float:
    """Unweighted mean of per-class F1 over ``classes`` (default: classes in either array)."""
    pred, gold = _pair(predictions, labels)
    chosen = np.union1d(pred, gold) if classes is None else np.asarray(classes)
    return float(np.mean([_f1(pred, gold, int(c)) for c in chosen]))


def matthews_corrcoef(predictions: Any, labels: Any) -> float:
    """Matthews correlation, general multi-class form (Gorodkin's R_K); 0.0 when undefined.

    With confusion matrix C: (c * s - t . p) / sqrt((s^2 - p . p) (s^2 - t . t)), where t and
    p are true and predicted counts per class, c the trace and s the total.
    """
    pred, gold = _pair(predictions, labels)
    classes, index = np.unique(np.concatenate([gold, pred]), return_inverse=True)
    gold_idx, pred_idx = index[: gold.size], index[gold.size :]
    confusion = np.zeros((classes.size, classes.size), dtype=np.float64)
    np.add.at(confusion, (gold_idx, pred_idx), 1.0)
    t = confusion.sum(axis=1)
    p = confusion.sum(axis=0)
    c = np.trace(confusion)
    s = confusion.sum()
    denominator = (s * s - p @ p) * (s * s - t @ t)
    if denominator <= 0:
        return 0.0
    return float((c * s - t @ p) / np.sqrt(denominator))


def pearson(predictions: Any, labels: Any) -> float:
    """Pearson correlation; 0.0 when either side is constant."""
    x, y = _pair(predictions, labels, np.float64)
    x = x - x.mean()
    y = y - y.mean()
    denominator = np.sqrt((x @ x) * (y @ y))
    if denominator == 0:
        return 0.0
    return float(np.clip((x @ y) / denominator, -1.0, 1.0))


def rankdata(values: Any) -> np.ndarray:
    """Ranks 1..N of ``values`` [N]; ties get the average of the ranks they span."""
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], x.size]
    average = (starts + ends + 1) / 2.0
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = np.repeat(average, ends - starts)
    return ranks


def spearman(predictions: Any, labels: Any) -> float:
    """Spearman rank correlation (Pearson of average ranks); 0.0 when either side is constant."""
    x, y = _pair(predictions, labels, np.float64)
    return pearson(rankdata(x), rankdata(y))


def mse(predictions: Any, labels: Any) -> float:
    """Mean squared error."""
    x, y = _pair(predictions, labels, np.float64)
    return float(np.mean((x - y) ** 2))


def _classification(spec: TaskSpec) -> dict[str, Callable[[Any, Any], float]]:
    positive = spec.label_to_id[spec.positive_label] if spec.positive_label else 1
    return {
        "accuracy": accuracy,
        "f1": lambda p, g: f1_binary(p, g, positive),
        "macro_f1": f1_macro,
        "mcc": matthews_corrcoef,
    }


_REGRESSION: dict[str, Callable[[Any, Any], float]] = {
    "pearson": pearson,
    "spearman": spearman,
    "mse": mse,
}


def compute_task_metrics(spec: TaskSpec, predictions: Any, labels: Any) -> dict[str, float]:
    """Every metric in ``spec.metrics`` (GLUE's set for GLUE tasks), as name -> value.

    ``predictions``/``labels`` by kind: classification, class ids [N] or logits [N, C] vs
    ids [N]; regression, scores [N] or [N, 1] vs [N]; token_labels, word-level label
    sequences (from ``conll.align_predictions``) vs gold sequences; span_qa, qid -> answer
    text vs qid -> gold texts (``squad.gold_answers``).
    """
    if spec.kind == "token_labels":
        return entity_scores(labels, predictions)
    if spec.kind == "span_qa":
        if not isinstance(predictions, Mapping) or not isinstance(labels, Mapping):
            raise TypeError("span_qa metrics need dicts: qid -> prediction, qid -> gold texts")
        return squad_metrics(predictions, labels)
    table = _classification(spec) if spec.kind == "classification" else _REGRESSION
    unknown = [name for name in spec.metrics if name not in table]
    if unknown:
        raise ValueError(f"task {spec.name}: no {spec.kind} metric named {unknown}")
    return {name: table[name](predictions, labels) for name in spec.metrics}
