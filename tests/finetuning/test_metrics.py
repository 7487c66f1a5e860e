"""Metrics against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bertpipe.finetuning.metrics import (
    accuracy,
    compute_task_metrics,
    f1_binary,
    f1_macro,
    matthews_corrcoef,
    mse,
    pearson,
    rankdata,
    spearman,
)
from bertpipe.finetuning.tasks.base import TaskSpec
from bertpipe.finetuning.tasks.conll import conll_spec
from bertpipe.finetuning.tasks.glue_tasks import glue_task
from bertpipe.finetuning.tasks.squad import squad_spec


def test_accuracy_takes_ids_or_logits():
    assert accuracy([1, 0, 1, 1], [1, 1, 1, 0]) == 0.5
    logits = np.array([[0.1, 0.9], [2.0, -1.0], [0.0, 1.0], [1.0, 0.0]])
    assert accuracy(logits, [1, 1, 1, 0]) == 0.75
    with pytest.raises(ValueError, match="3 predictions but 2 labels"):
        accuracy([1, 0, 1], [1, 0])


def test_binary_and_macro_f1():
    pred = [1, 1, 0, 0, 0]
    gold = [1, 0, 0, 0, 1]
    # class 1: tp 1, fp 1, fn 1 -> 0.5; class 0: tp 2, fp 1, fn 1 -> 2/3
    assert f1_binary(pred, gold) == pytest.approx(0.5)
    assert f1_binary(pred, gold, positive=0) == pytest.approx(2 / 3)
    assert f1_macro(pred, gold) == pytest.approx(7 / 12)
    assert f1_binary([0, 0], [1, 1]) == 0.0


def test_matthews_binary_and_multiclass():
    # tp 2, fp 1, tn 2, fn 1 -> (2*2 - 1*1) / sqrt(3*3*3*3) = 1/3
    assert matthews_corrcoef([1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 1, 1]) == pytest.approx(1 / 3)
    # confusion rows=true [[1,0,0],[0,1,1],[0,0,1]]: t=[1,2,1], p=[1,1,2], c=3, s=4
    # (3*4 - 5) / sqrt((16 - 6) * (16 - 6)) = 0.7
    assert matthews_corrcoef([0, 1, 2, 2], [0, 1, 1, 2]) == pytest.approx(0.7)
    assert matthews_corrcoef([1, 1, 1], [0, 1, 1]) == 0.0  # constant prediction: undefined
    assert matthews_corrcoef([0, 1, 0, 1], [1, 0, 1, 0]) == pytest.approx(-1.0)


def test_pearson_spearman_with_ties():
    # dx=[-1.5,-.5,.5,1.5], dy=[-3,-1,0,4]: 11 / sqrt(5 * 26)
    assert pearson([1, 2, 3, 4], [2, 4, 5, 9]) == pytest.approx(11 / math.sqrt(130))
    assert rankdata([10, 20, 20, 5]).tolist() == [2.0, 3.5, 3.5, 1.0]
    assert rankdata([3, 3, 3]).tolist() == [2.0, 2.0, 2.0]
    # ranks x=[1,2.5,2.5,4], y=[1,3,2,4]: 4.5 / sqrt(4.5 * 5)
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / math.sqrt(22.5))
    assert pearson([1, 1, 1], [1, 2, 3]) == 0.0
    assert mse([1.0, 2.0], [2.0, 4.0]) == pytest.approx(2.5)


def test_compute_task_metrics_per_glue_task():
    cola = compute_task_metrics(glue_task("cola").spec, [1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 1, 1])
    assert cola == pytest.approx({"mcc": 1 / 3, "accuracy": 4 / 6})
    mrpc = compute_task_metrics(glue_task("mrpc").spec, [1, 1, 0, 0, 0], [1, 0, 0, 0, 1])
    assert mrpc == pytest.approx({"f1": 0.5, "accuracy": 0.6})
    stsb = compute_task_metrics(
        glue_task("stsb").spec, np.array([[1.0], [2.0], [2.0], [3.0]]), [1.0, 3.0, 2.0, 4.0]
    )
    assert stsb == pytest.approx({"spearman": 4.5 / math.sqrt(22.5), "pearson": 0.9486832980})
    mnli = compute_task_metrics(glue_task("mnli").spec, [0, 1, 2], [0, 1, 1])
    assert mnli == pytest.approx({"accuracy": 2 / 3})
    qqp = glue_task("qqp").spec
    assert qqp.main_metric == "f1" and qqp.positive_label == "1"


def test_compute_task_metrics_other_kinds():
    ner = compute_task_metrics(
        conll_spec("ner", labels=["O", "B-PER", "I-PER"]), [["B-PER", "O"]], [["B-PER", "I-PER"]]
    )
    assert ner["f1"] == 0.0 and ner["token_accuracy"] == 0.5
    qa = compute_task_metrics(squad_spec(False), {"q": "The cat"}, {"q": ["cat"]})
    assert qa["exact"] == 100.0 and qa["f1"] == 100.0
    spec = TaskSpec("x", "classification", ("a", "b"), "accuracy", True, ("accuracy", "auc"))
    with pytest.raises(ValueError, match="no classification metric named \\['auc'\\]"):
        compute_task_metrics(spec, [0], [0])
