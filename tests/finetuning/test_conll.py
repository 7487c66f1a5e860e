"""CoNLL reader, IOB1 -> IOB2, first-sub-token features, alignment and entity scores."""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest

from bertpipe.finetuning.tasks.conll import (
    Sentence,
    align_predictions,
    conll_spec,
    entities,
    entity_scores,
    featurize_conll,
    iob1_to_iob2,
    read_conll,
    write_conll_predictions,
)

CONLL_IOB1 = """-DOCSTART- -X- -X- O

EU NNP B-NP I-ORG
rejects VBZ B-VP O
German JJ B-NP I-MISC
call NN I-NP O
to TO B-VP O
boycott VB I-VP O
British JJ B-NP I-MISC
lamb NN I-NP O
. . O O

Peter NNP B-NP I-PER
Blackburn NNP I-NP I-PER

John NNP I-PER
London NNP B-NP I-LOC

Japan NNP B-NP I-LOC
won VBD B-VP O
cup NN B-NP X-FOO
"""


def test_read_conll2003_iob1(write):
    sentences, report = read_conll(write("train.txt", CONLL_IOB1))
    assert [s.words for s in sentences] == [
        ("EU", "rejects", "German", "call", "to", "boycott", "British", "lamb", "."),
        ("Peter", "Blackburn"),
    ]
    assert sentences[0].labels == ("B-ORG", "O", "B-MISC", "O", "O", "O", "B-MISC", "O", "O")
    assert sentences[1].labels == ("B-PER", "I-PER") and sentences[1].line == 13
    assert (report.rows_read, report.rows_kept) == (4, 2)
    assert [p.line for p in report.problems] == [16, 21]
    assert "columns" in report.problems[0].reason and "X-FOO" in report.problems[1].reason
    spec = conll_spec("conll2003", sentences)
    assert spec.labels == ("O", "B-MISC", "I-MISC", "B-ORG", "I-ORG", "B-PER", "I-PER")
    assert spec.kind == "token_labels" and spec.main_metric == "f1"


def test_two_column_file_with_given_labels(write):
    text = "Peter B-PER\nlives O\n\nin O\nLondon B-LOC\n"
    sentences, report = read_conll(write("dev.txt", text), labels=["O", "B-PER", "I-PER"])
    # a label outside the list is reported, but its sentence is kept (evaluation scores it)
    assert [s.words for s in sentences] == [("Peter", "lives"), ("in", "London")]
    assert report.problems[0].line == 5 and "unknown label 'B-LOC'" in report.problems[0].reason


def test_iob1_to_iob2():
    labels = ["I-PER", "B-PER", "I-PER", "O", "I-LOC", "I-ORG", "I-ORG"]
    assert iob1_to_iob2(labels) == ["B-PER", "B-PER", "I-PER", "O", "B-LOC", "B-ORG", "I-ORG"]
    iob2 = ["B-PER", "I-PER", "O", "B-LOC"]
    assert iob1_to_iob2(iob2) == iob2


SPEC = conll_spec("ner", labels=["O", "B-LOC", "I-LOC", "B-MISC", "I-MISC"])
SENTENCE = Sentence(
    ("playing", "cats", "\u200b", "New", "York"), ("O", "B-MISC", "O", "B-LOC", "I-LOC"), 1
)


def test_first_subtoken_labels(tokenizer):
    features = featurize_conll(tokenizer, [SENTENCE], SPEC, max_seq_length=16)
    ids = features["input_ids"][0, : features["lengths"][0]]
    tokens = [tokenizer.id_to_token(i) for i in ids]
    assert tokens == ["[CLS]", "play", "##ing", "cats", "[UNK]", "new", "york", "[SEP]"]
    label = SPEC.label_to_id
    expected = [-100, label["O"], -100, label["B-MISC"], label["O"], label["B-LOC"]]
    assert features["labels"][0, :8].tolist() == [*expected, label["I-LOC"], -100]
    assert features["word_ids"][0, :8].tolist() == [-1, 0, -1, 1, 2, 3, 4, -1]
    assert features["labels"].dtype == np.int64 and not features["truncated"][0]
    # gold ids at the first sub-tokens align back to the gold words
    assert align_predictions(features, features["labels"].clip(0), [SENTENCE], SPEC) == [
        list(SENTENCE.labels)
    ]


def test_truncation_is_counted_and_scored_as_o(tokenizer, caplog):
    with caplog.at_level(logging.WARNING):
        features = featurize_conll(tokenizer, [SENTENCE], SPEC, max_seq_length=5)
    assert features["truncated"].tolist() == [True]
    assert "1 of 1 sentences" in caplog.text and "3 words" in caplog.text
    tokens = [tokenizer.id_to_token(i) for i in features["input_ids"][0]]
    assert tokens == ["[CLS]", "play", "##ing", "cats", "[SEP]"]
    logits = np.zeros((1, 5, len(SPEC.labels)))
    logits[0, :, SPEC.label_to_id["B-MISC"]] = 1.0
    aligned = align_predictions(features, logits, [SENTENCE], SPEC)
    assert aligned == [["B-MISC", "B-MISC", "O", "O", "O"]]


def test_entity_scores_hand_computed():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O", "B-MISC", "I-MISC"]]
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "O", "B-MISC", "O"]]
    scores = entity_scores(gold, pred)
    # gold 4 entities, predicted 4, exact matches 2 (PER 0-1, ORG 0)
    assert (scores["precision"], scores["recall"], scores["f1"]) == (0.5, 0.5, 0.5)
    assert scores["token_accuracy"] == 0.75
    assert (scores["PER_precision"], scores["PER_recall"], scores["PER_f1"]) == (1.0, 1.0, 1.0)
    assert scores["ORG_precision"] == 0.5 and scores["ORG_recall"] == 1.0
    assert scores["ORG_f1"] == pytest.approx(2 / 3)
    assert (scores["LOC_f1"], scores["LOC_support"], scores["MISC_f1"]) == (0.0, 1.0, 0.0)


def test_entities_follow_conlleval_rules():
    assert entities(["O", "I-PER", "I-PER", "B-PER", "I-LOC"]) == [
        ("PER", 1, 2),
        ("PER", 3, 3),
        ("LOC", 4, 4),
    ]
    assert entity_scores([["O", "B-PER", "I-PER"]], [["O", "I-PER", "I-PER"]])["f1"] == 1.0
    assert entity_scores([["O"]], [["O"]])["f1"] == 0.0


def test_write_conll_predictions():
    out = io.StringIO()
    sentence = Sentence(("Peter", "lives"), ("B-PER", "O"), 1)
    write_conll_predictions(out, [sentence], [["B-PER", "B-LOC"]])
    assert out.getvalue() == "Peter B-PER B-PER\nlives O B-LOC\n\n"
