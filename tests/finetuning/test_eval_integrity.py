"""Evaluation never scores a subset, and training never takes an answer from outside the text.

- CoNLL: a dev sentence with an entity type the training file lacks is kept; its gold entity,
  which the model cannot predict, counts as a false negative in entity-level F1.
- SQuAD: an ``answer_start`` outside the context (negative, or past its end) or an empty
  answer is reported with its line and question id and never used for training.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bertpipe.finetuning.config import TaskConfig
from bertpipe.finetuning.data import load_task, score
from bertpipe.finetuning.tasks.base import IGNORE_INDEX
from bertpipe.finetuning.tasks.conll import (
    conll_spec,
    entity_scores,
    featurize_conll,
    read_conll,
)
from bertpipe.finetuning.tasks.squad import featurize_squad, read_squad
from bertpipe.finetuning.tasks.squad_scores import gold_answers

TRAIN = "Peter B-PER\nlives O\n\nJohn B-PER\nwon O\n"
# sentence 2 holds a LOC entity: a type the training file never has
DEV = "Peter B-PER\nsaid O\n\nJohn B-PER\nlives O\nin O\nLondon B-LOC\n"


def test_conll_dev_sentence_with_unknown_type_is_kept_and_reported(write, tokenizer):
    train, _ = read_conll(write("train.txt", TRAIN))
    spec = conll_spec("ner", train)
    assert spec.labels == ("O", "B-PER", "I-PER")
    dev, report = read_conll(write("dev.txt", DEV), spec.labels)
    assert [s.words for s in dev] == [("Peter", "said"), ("John", "lives", "in", "London")]
    assert dev[1].labels[-1] == "B-LOC"  # the gold label is kept for scoring
    assert (report.rows_read, report.rows_kept) == (2, 2)
    (problem,) = report.problems
    assert problem.line == 7 and "unknown label 'B-LOC'" in problem.reason
    assert "sentence kept" in problem.reason
    features = featurize_conll(tokenizer, dev, spec, 16)
    o_id = spec.label_to_id["O"]
    # "London" (first sub-token at position 4) is O for the loss, never an out-of-range id
    assert features["labels"][1, 4] == o_id
    assert set(np.unique(features["labels"])) <= {IGNORE_INDEX, *range(spec.num_labels)}


def test_conll_f1_is_computed_on_the_full_dev_set(write, tokenizer):
    """A perfect model on the known labels: gold entities PER, PER, LOC; predicted PER, PER.

    Hand-computed: precision 2/2, recall 2/3, F1 = 2 * 1 * (2/3) / (1 + 2/3) = 0.8. Dropping
    the LOC sentence (the old behaviour) reported F1 = 1.0 on a subset.
    """
    cfg = TaskConfig(
        family="conll",
        name="ner",
        train=write("train.txt", TRAIN),
        dev=[write("dev.txt", DEV)],
        max_seq_length=16,
    )
    data = load_task(cfg, tokenizer, max_positions=64)
    (dev,) = data.dev
    assert len(dev.examples) == 2 and len(dev.features["input_ids"]) == 2
    # logits of a model that predicts every known gold label, and O where the gold is LOC
    labels = dev.features["labels"]
    logits = np.zeros((*labels.shape, data.spec.num_labels), dtype=np.float32)
    rows, cols = np.nonzero(labels >= 0)
    logits[rows, cols, labels[rows, cols]] = 1.0
    metrics, predicted = score(data, dev, {"logits": list(logits)}, cfg)
    assert predicted["labels"] == [["B-PER", "O"], ["B-PER", "O", "O", "O"]]
    assert metrics["precision"] == pytest.approx(1.0)
    assert metrics["recall"] == pytest.approx(2 / 3)
    assert metrics["f1"] == pytest.approx(0.8)
    assert metrics["LOC_recall"] == 0.0 and metrics["LOC_support"] == 1.0
    assert metrics["token_accuracy"] == pytest.approx(5 / 6)
    gold = [s.labels for s in dev.examples]
    assert entity_scores(gold, predicted["labels"])["f1"] == pytest.approx(0.8)


CONTEXT = "The cat sat on the mat."


def _squad(write, qas: list[dict]) -> str:
    paragraph = {"context": CONTEXT, "qas": qas}
    data = {"version": "1.1", "data": [{"title": "T", "paragraphs": [paragraph]}]}
    return write("squad.json", json.dumps(data, indent=2))


def _qa(qid: str, *answers: tuple[str, int]) -> dict:
    found = [{"text": t, "answer_start": s} for t, s in answers]
    return {"id": qid, "question": "What?", "answers": found}


def test_squad_answer_start_outside_the_context_is_reported_not_trained(write, tokenizer):
    mat = CONTEXT.index("mat")
    assert CONTEXT[-4:-1] == "mat"  # slicing with a negative start "matches" the text
    path = _squad(
        write,
        [
            _qa("neg", ("mat", -4)),
            _qa("neg-then-good", ("mat", -4), ("mat", mat)),
            _qa("past-end", ("mat.", len(CONTEXT) - 2)),
            _qa("beyond", ("", len(CONTEXT) + 5)),
            _qa("empty", ("", 3)),
            _qa("good", ("cat", CONTEXT.index("cat"))),
        ],
    )
    examples, report = read_squad(path)
    # every question is kept for evaluation, with all its gold texts
    assert [e.qid for e in examples] == [
        "neg",
        "neg-then-good",
        "past-end",
        "beyond",
        "empty",
        "good",
    ]
    assert gold_answers(examples)["neg"] == ["mat"]
    train_answers = {e.qid: e.train_answer for e in examples}
    assert train_answers["neg"] is None
    assert train_answers["neg-then-good"].start == mat
    assert train_answers["past-end"] is None and train_answers["beyond"] is None
    assert train_answers["empty"] is None
    assert train_answers["good"].text == "cat"
    reasons = {p.reason.split()[1]: p for p in report.problems}
    assert set(reasons) == {"neg", "neg-then-good", "past-end", "beyond", "empty"}
    assert "answer_start -4, outside the context (23 characters)" in reasons["neg"].reason
    assert "past the end of the context" in reasons["past-end"].reason
    assert "outside the context" in reasons["beyond"].reason
    assert "is empty" in reasons["empty"].reason
    assert all("skipped for training, kept for evaluation" in p.reason for p in report.problems)
    lines = Path(path).read_text().split("\n")
    for qid, problem in reasons.items():  # the line of the question's id
        assert f'"id": "{qid}"' in lines[problem.line - 1]
    train = featurize_squad(
        tokenizer, examples, max_seq_length=32, max_query_length=8, training=True
    )
    assert sorted(set(train["example_index"].tolist())) == [1, 5]
    row = train["input_ids"][0]
    start, end = train["start_positions"][0], train["end_positions"][0]
    assert [tokenizer.id_to_token(i) for i in row[start : end + 1]] == ["mat"]
