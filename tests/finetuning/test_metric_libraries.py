"""The metrics are scikit-learn's, scipy's and seqeval's, and equal to the formulas bertpipe
computed by hand before (kept here as references) on many random draws: every GLUE task's
metric set, regression with ties, entity scores over random tag sequences, and the edge
cases (constant predictions, one class only, no entity at all, a single pair).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from scipy import stats
from seqeval.metrics import classification_report
from seqeval.metrics import f1_score as seqeval_f1
from seqeval.scheme import IOB2
from sklearn import metrics as skm

from bertpipe.finetuning.metrics import compute_task_metrics, f1_at_threshold, rankdata
from bertpipe.finetuning.tasks.base import TaskSpec
from bertpipe.finetuning.tasks.conll import entities, entity_scores
from bertpipe.finetuning.tasks.glue_tasks import glue_task

DRAWS = 300
"""Random draws per test (scikit-learn takes milliseconds per call: the classification tests
draw fewer)."""

# --------------------------------------------------------------------------- the old formulas


def _ref_f1(pred: np.ndarray, gold: np.ndarray, positive: int) -> float:
    tp = int(np.sum((pred == positive) & (gold == positive)))
    fp = int(np.sum((pred == positive) & (gold != positive)))
    fn = int(np.sum((pred != positive) & (gold == positive)))
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def _ref_mcc(pred: np.ndarray, gold: np.ndarray) -> float:
    classes, index = np.unique(np.concatenate([gold, pred]), return_inverse=True)
    confusion = np.zeros((classes.size, classes.size))
    np.add.at(confusion, (index[: gold.size], index[gold.size :]), 1.0)
    t, p = confusion.sum(axis=1), confusion.sum(axis=0)
    c, s = np.trace(confusion), confusion.sum()
    denominator = (s * s - p @ p) * (s * s - t @ t)
    return 0.0 if denominator <= 0 else float((c * s - t @ p) / np.sqrt(denominator))


def _ref_pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x - x.mean(), y - y.mean()
    denominator = np.sqrt((x @ x) * (y @ y))
    return 0.0 if denominator == 0 else float(np.clip((x @ y) / denominator, -1.0, 1.0))


def _ref_rank(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    sorted_x = values[order]
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], values.size]
    ranks = np.empty(values.size)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return ranks


def _ref_entities(tags: list[str]) -> list[tuple[str, int, int]]:
    """conlleval's chunk rules, as bertpipe wrote them before seqeval did the work."""

    def split(tag: str) -> tuple[str, str]:
        return ("O", "") if tag == "O" else tuple(tag.split("-", 1))  # type: ignore[return-value]

    found, prev, prev_type, begin = [], "O", "", -1
    for i, tag in enumerate([*tags, "O"]):
        prefix, kind = split(tag)
        ends = (
            prev in ("E", "S")
            or (prev in ("B", "I") and prefix in ("B", "S", "O"))
            or (prev != "O" and prev_type != kind)
        )
        if begin >= 0 and ends:
            found.append((prev_type, begin, i - 1))
            begin = -1
        starts = (
            prefix in ("B", "S")
            or (prev in ("E", "S", "O") and prefix in ("E", "I"))
            or (prefix != "O" and prev_type != kind)
        )
        if starts:
            begin = i
        prev, prev_type = prefix, kind
    return found


def _ref_entity_scores(gold: list[list[str]], pred: list[list[str]]) -> dict[str, float]:
    def prf(hit: int, n_pred: int, n_gold: int) -> tuple[float, float, float]:
        p = hit / n_pred if n_pred else 0.0
        r = hit / n_gold if n_gold else 0.0
        return p, r, (2 * p * r / (p + r) if p + r else 0.0)

    g_spans = {(i, *e) for i, s in enumerate(gold) for e in _ref_entities(s)}
    p_spans = {(i, *e) for i, s in enumerate(pred) for e in _ref_entities(s)}
    hits = g_spans & p_spans
    tokens = sum(len(s) for s in gold)
    right = sum(a == b for g, p in zip(gold, pred, strict=True) for a, b in zip(g, p, strict=True))
    p, r, f = prf(len(hits), len(p_spans), len(g_spans))
    out = {"precision": p, "recall": r, "f1": f, "token_accuracy": right / tokens}
    for kind in sorted({s[1] for s in g_spans | p_spans}):
        counts = [sum(1 for s in spans if s[1] == kind) for spans in (hits, p_spans, g_spans)]
        tp, tr, tf = prf(*counts)
        out.update({f"{kind}_precision": tp, f"{kind}_recall": tr, f"{kind}_f1": tf})
        out[f"{kind}_support"] = float(counts[2])
    return out


# --------------------------------------------------------------------------- random draws


def _labels(rng: np.random.Generator, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Gold ids and predictions [N], N from 1 to 60; a quarter of the draws are edge cases:
    a constant prediction, one gold class, a perfect prediction, or a single row."""
    n = int(rng.integers(1, 61))
    gold = rng.integers(0, classes, n)
    pred = rng.integers(0, classes, n)
    case = rng.integers(0, 8)
    if case == 0:
        pred[:] = rng.integers(0, classes)
    elif case == 1:
        gold[:] = rng.integers(0, classes)
    elif case == 2:
        pred = gold.copy()
    elif case == 3:
        gold, pred = gold[:1], pred[:1]
    return gold, pred


@pytest.mark.parametrize("task", ["cola", "mrpc", "mnli"])  # GLUE's three metric sets
def test_classification_metrics_equal_sklearn_and_the_old_formulas(task: str) -> None:
    spec = glue_task(task).spec
    classes = len(spec.labels)
    positive = spec.label_to_id[spec.positive_label] if spec.positive_label else 1
    rng = np.random.default_rng(len(task))
    for draw in range(DRAWS // 4):
        gold, pred = _labels(rng, classes)
        logits = rng.normal(size=(pred.size, classes))
        logits[np.arange(pred.size), pred] += 100.0  # argmax is pred: logits are scored too
        for given in (pred, logits) if draw % 5 == 0 else (pred,):
            got = compute_task_metrics(spec, given, gold)
            assert set(got) == set(spec.metrics)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # sklearn's "a single label was found"
                mcc = skm.matthews_corrcoef(gold, pred)
            library = {
                "accuracy": skm.accuracy_score(gold, pred),
                "mcc": mcc,
                "f1": skm.f1_score(gold, pred, pos_label=positive, zero_division=0)
                if classes == 2
                else None,
            }
            old = {
                "accuracy": float((pred == gold).mean()),
                "mcc": _ref_mcc(pred, gold),
                "f1": _ref_f1(pred, gold, positive),
            }
            for name, value in got.items():
                assert value == pytest.approx(library[name], abs=1e-12), (name, gold, pred)
                assert value == pytest.approx(old[name], abs=1e-12), (name, gold, pred)
        if (pred == pred[0]).all() or (gold == gold[0]).all():
            assert compute_task_metrics(glue_task("cola").spec, pred % 2, gold % 2)["mcc"] == 0.0


def test_macro_f1_equals_sklearn_and_the_old_formula() -> None:
    rng = np.random.default_rng(7)
    for _ in range(DRAWS // 3):
        classes = int(rng.integers(2, 8))
        gold, pred = _labels(rng, classes)
        labels = tuple(str(i) for i in range(classes))
        spec = TaskSpec("t", "classification", labels, "macro_f1", True, ("macro_f1",))
        got = compute_task_metrics(spec, pred, gold)["macro_f1"]
        present = np.union1d(gold, pred)
        old = float(np.mean([_ref_f1(pred, gold, int(c)) for c in present]))
        library = skm.f1_score(gold, pred, average="macro", zero_division=0)
        assert got == pytest.approx(library, abs=1e-12) and got == pytest.approx(old, abs=1e-12)


def test_regression_metrics_equal_scipy_and_the_old_formulas() -> None:
    spec = glue_task("stsb").spec.replace(metrics=("spearman", "pearson", "mse"))
    rng = np.random.default_rng(11)
    constant = 0
    for _ in range(DRAWS):
        n = int(rng.integers(1, 50))
        gold = np.round(rng.uniform(0, 5, n), int(rng.integers(0, 3)))  # rounding makes ties
        pred = np.round(gold + rng.normal(0, rng.uniform(0.1, 3), n), int(rng.integers(0, 3)))
        if rng.integers(0, 6) == 0:
            pred[:] = 2.5  # a model that predicts one score: the correlations are undefined
        got = compute_task_metrics(spec, pred[:, None], gold)
        assert got["mse"] == pytest.approx(skm.mean_squared_error(gold, pred), abs=1e-12)
        old_spearman = _ref_pearson(_ref_rank(pred), _ref_rank(gold))
        assert got["pearson"] == pytest.approx(_ref_pearson(pred, gold), abs=1e-9)
        assert got["spearman"] == pytest.approx(old_spearman, abs=1e-9)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # scipy's warnings of constant input
            scipy_pearson = stats.pearsonr(pred, gold).statistic if n >= 2 else math.nan
            scipy_spearman = stats.spearmanr(pred, gold).statistic if n >= 2 else math.nan
        if np.ptp(pred) == 0 or np.ptp(gold) == 0 or n < 2:
            constant += 1  # scipy: NaN; bertpipe: 0.0, so model selection never sees NaN
            assert math.isnan(scipy_pearson) and math.isnan(scipy_spearman)
            assert got["pearson"] == 0.0 and got["spearman"] == 0.0
        else:
            assert got["pearson"] == pytest.approx(scipy_pearson, abs=1e-9)
            assert got["spearman"] == pytest.approx(scipy_spearman, abs=1e-9)
        assert rankdata(pred).tolist() == _ref_rank(pred).tolist()
    assert constant > 20  # the edge case was drawn


def test_threshold_f1_equals_klue_sts_definition() -> None:
    """KLUE-STS's F1: both sides binarised at 3.0, scikit-learn's binary F1."""
    rng = np.random.default_rng(3)
    for _ in range(DRAWS // 3):
        n = int(rng.integers(1, 40))
        gold, pred = rng.uniform(0, 5, n), rng.uniform(0, 5, n)
        if rng.integers(0, 4) == 0:
            gold[:] = 1.0  # no positive pair at all
        expected = skm.f1_score(gold >= 3, pred >= 3, zero_division=0)
        assert f1_at_threshold(pred, gold, 3.0) == pytest.approx(expected, abs=1e-12)
    assert f1_at_threshold([3.0], [3.0], 3.0) == 1.0  # at the threshold is positive


TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG", "E-PER", "S-LOC"]


def _sentences(rng: np.random.Generator, tags: list[str]) -> list[list[str]]:
    return [
        [str(t) for t in rng.choice(tags, int(rng.integers(1, 12)))]
        for _ in range(int(rng.integers(1, 8)))
    ]


def test_entity_scores_equal_seqeval_and_the_old_formulas() -> None:
    """Random tag sequences (I- after O, type changes inside a span, E-/S- tags: every rule
    conlleval has) score alike by seqeval's default mode and the old hand-written rules."""
    rng = np.random.default_rng(5)
    empty = 0
    for draw in range(DRAWS):
        tags = ["O"] if draw % 10 == 0 else TAGS  # no entity on either side
        gold = _sentences(rng, tags)
        pred = [[str(t) for t in rng.choice(tags, len(s))] for s in gold]
        if draw % 7 == 0:
            pred = [list(s) for s in gold]
        got = entity_scores(gold, pred)
        old = _ref_entity_scores(gold, pred)
        assert got.keys() == old.keys()
        for key, value in old.items():
            assert got[key] == pytest.approx(value, abs=1e-12), (key, gold, pred)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # numpy's mean of no types at all
            report = classification_report(gold, pred, output_dict=True, zero_division=0)
        if len(report) > 3:  # types were found (micro, macro and weighted averages always)
            assert got["f1"] == pytest.approx(report["micro avg"]["f1-score"], abs=1e-12)
            for kind in {k for k in report if not k.endswith(" avg")}:
                assert got[f"{kind}_f1"] == pytest.approx(report[kind]["f1-score"], abs=1e-12)
                assert got[f"{kind}_support"] == report[kind]["support"]
        else:
            empty += 1
            assert got["f1"] == got["precision"] == got["recall"] == 0.0
        for sentence in gold:
            assert entities(sentence) == _ref_entities(sentence)
    assert empty >= DRAWS // 10


def test_seqeval_default_mode_is_conlleval_and_strict_iob2_differs() -> None:
    """What each mode makes of a prediction that opens an entity with ``I-``: conlleval (and
    seqeval's default, which bertpipe uses for CoNLL) counts it, strict IOB2 (KLUE-NER's
    scorer) does not."""
    gold = [["O", "B-PER", "I-PER", "O"]]
    pred = [["O", "I-PER", "I-PER", "O"]]
    assert entity_scores(gold, pred)["f1"] == 1.0
    assert seqeval_f1(gold, pred) == 1.0
    assert seqeval_f1(gold, pred, mode="strict", scheme=IOB2) == 0.0
