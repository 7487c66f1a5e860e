"""SQuAD reader, doc-stride windows, span decoding, EM/F1 and prediction files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bertpipe.config import ConfigError
from bertpipe.finetuning.tasks.squad import (
    SquadAnswer,
    SquadExample,
    check_squad_lengths,
    decode,
    featurize_squad,
    read_squad,
    write_squad_predictions,
)
from bertpipe.finetuning.tasks.squad_scores import (
    exact_match,
    f1_score,
    gold_answers,
    normalize_answer,
    squad_metrics,
)

CONTEXT = 'In 1999, New-York\'s Mayor said: "Hello!" The cat sat on the mat.'


def _qa(qid: str, question: str, *answers: tuple[str, int], **extra: object) -> dict:
    found = [{"text": t, "answer_start": s} for t, s in answers]
    return {"id": qid, "question": question, "answers": found, **extra}


def _squad_file(write, qas: list[dict], version: str = "1.1") -> str:
    data = {
        "version": version,
        "data": [{"title": "T", "paragraphs": [{"context": CONTEXT, "qas": qas}]}],
    }
    return write("squad.json", json.dumps(data, indent=2))


def test_reader_reports_mismatch_keeps_it_for_eval_skips_it_for_training(write, tokenizer):
    mayor = CONTEXT.index("New-York")
    mat = CONTEXT.index("the mat")
    path = _squad_file(
        write,
        [
            _qa("q1", "Who said hello?", ("New-York's Mayor", mayor)),
            _qa("q2", "What sat?", ("cat", 3)),  # wrong offset
            _qa("q3", "Where?", ("the mat", mat), ("mat", 0)),  # second answer mismatches
            _qa("q4", "  ", ("cat", CONTEXT.index("cat"))),
            _qa("q1", "Duplicate?", ("cat", CONTEXT.index("cat"))),
        ],
    )
    examples, report = read_squad(path)
    assert [e.qid for e in examples] == ["q1", "q2", "q3"]
    assert (report.rows_read, report.rows_kept, len(report.problems)) == (5, 3, 4)
    reasons = [p.reason for p in report.problems]
    assert (
        "q2" in reasons[0]
        and "does not match" in reasons[0]
        and "kept for evaluation" in reasons[0]
    )
    assert "q3" in reasons[1] and "'mat'" in reasons[1]
    assert "empty question" in reasons[2] and "duplicate" in reasons[3]
    lines = Path(path).read_text().split("\n")
    assert '"id": "q2"' in lines[report.problems[0].line - 1]
    assert examples[1].train_answer is None and examples[2].train_answer.text == "the mat"
    assert gold_answers(examples)["q2"] == ["cat"]

    train = featurize_squad(
        tokenizer, examples, max_seq_length=64, max_query_length=16, training=True
    )
    assert train["example_index"].tolist() == [0, 2]
    row = train["input_ids"][0]
    start, end = train["start_positions"][0], train["end_positions"][0]
    tokens = [tokenizer.id_to_token(i) for i in row[start : end + 1]]
    assert tokens == ["new", "-", "york", "'", "[UNK]", "mayor"]
    evaluation = featurize_squad(
        tokenizer, examples, max_seq_length=64, max_query_length=16, training=False
    )
    assert evaluation["example_index"].tolist() == [0, 1, 2]
    assert "start_positions" not in evaluation


def test_whole_file_errors(write):
    from bertpipe.finetuning.tasks.base import TaskDataError

    with pytest.raises(TaskDataError, match=r"bad\.json: invalid JSON at line 1"):
        read_squad(write("bad.json", "{oops"))
    with pytest.raises(TaskDataError, match="no top-level 'data'"):
        read_squad(write("list.json", "[]"))


def _bert_is_max_context(spans, span_index, position):
    """The BERT reference's _check_is_max_context."""
    best_score, best_index = None, None
    for index, (start, length) in enumerate(spans):
        end = start + length - 1
        if position < start or position > end:
            continue
        score = min(position - start, end - position) + 0.01 * length
        if best_score is None or score > best_score:
            best_score, best_index = score, index
    return span_index == best_index


WINDOW_CONTEXT = "one two three four five six seven eight nine ten"


def test_windows_with_doc_stride_find_answer_where_it_fits(tokenizer):
    start = WINDOW_CONTEXT.index("four five")
    example = SquadExample(
        "w",
        "what",
        WINDOW_CONTEXT,
        (SquadAnswer("four five", start),),
        False,
        SquadAnswer("four five", start),
    )
    # 8 = [CLS] what [SEP] + 4 context tokens + [SEP]; stride 2 -> windows at 0, 2, 4, 6
    features = featurize_squad(
        tokenizer, [example], max_seq_length=8, doc_stride=2, max_query_length=4, training=True
    )
    spans = [(0, 4), (2, 4), (4, 4), (6, 4)]
    assert len(features["input_ids"]) == 4
    words = WINDOW_CONTEXT.split()
    for k, (span_start, _) in enumerate(spans):
        tokens = [tokenizer.id_to_token(i) for i in features["input_ids"][k]]
        assert tokens == ["[CLS]", "what", "[SEP]", *words[span_start : span_start + 4], "[SEP]"]
        assert features["token_type_ids"][k].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
        for j in range(4):
            expected = _bert_is_max_context(spans, k, span_start + j)
            assert features["token_is_max_context"][k, 3 + j] == expected
        assert not features["token_is_max_context"][k, [0, 1, 2, 7]].any()
        assert features["offset_mapping"][k, 1].tolist() == [-1, -1]
    # "four five" = tokens 3-4: split in windows 0 and 2, whole in window 1 (rows 4, 5)
    assert features["start_positions"].tolist() == [0, 4, 0, 0]
    assert features["end_positions"].tolist() == [0, 5, 0, 0]
    assert features["offset_mapping"][1, 4].tolist() == [start, start + 4]


def _logits_for(features, row, char_start, char_end, high=10.0):
    """Zero logits except a high start at char_start and a high end at char_end."""
    starts = np.zeros(features["input_ids"].shape, dtype=np.float32)
    ends = np.zeros_like(starts)
    offsets = features["offset_mapping"][row]
    starts[row, np.flatnonzero(offsets[:, 0] == char_start)[0]] = high
    ends[row, np.flatnonzero(offsets[:, 1] == char_end)[0]] = high
    return starts, ends


def test_decode_returns_exact_original_substring(tokenizer):
    example = SquadExample("q", "who said hello?", CONTEXT, (), False, None)
    features = featurize_squad(
        tokenizer, [example], max_seq_length=64, max_query_length=16, training=False
    )
    begin = CONTEXT.index("New-York")
    end = CONTEXT.index(" said")
    starts, ends = _logits_for(features, 0, begin, end)
    predictions, nbest, null_odds = decode([example], features, starts, ends)
    assert predictions == {"q": "New-York's Mayor"}
    assert nbest["q"][0]["text"] == "New-York's Mayor" and nbest["q"][0]["start_char"] == begin
    assert sum(x["probability"] for x in nbest["q"]) == pytest.approx(1.0)
    assert null_odds["q"] == pytest.approx(-20.0)
    # quote and exclamation mark come back as written
    quote = CONTEXT.index('"Hello')
    starts, ends = _logits_for(features, 0, quote, quote + len('"Hello!"'))
    per_row = [starts[0, :40], ends[0, :40]]  # per-row arrays of another width also work
    predictions, _, _ = decode([example], features, [per_row[0]], [per_row[1]])
    assert predictions["q"] == '"Hello!"'
    # character offsets, not bytes: accents and astral characters before the answer
    accented = SquadExample("c", "what?", "Café 😀 in Paris, France.", (), False, None)
    features = featurize_squad(
        tokenizer, [accented], max_seq_length=32, max_query_length=8, training=False
    )
    starts, ends = _logits_for(features, 0, 10, 23)
    predictions, _, _ = decode([accented], features, starts, ends)
    assert predictions["c"] == "Paris, France"


def test_decode_uses_max_context_window(tokenizer):
    example = SquadExample("w", "what", WINDOW_CONTEXT, (), False, None)
    features = featurize_squad(
        tokenizer, [example], max_seq_length=8, doc_stride=2, max_query_length=4, training=False
    )
    # "three" (token 2) has its max context in window 0 (row position 5); in window 1 it
    # sits at the window's edge. A high start logit there must be ignored.
    starts = np.zeros(features["input_ids"].shape)
    ends = np.zeros_like(starts)
    starts[1, 3] = 50.0  # "three" in window 1: not max context
    ends[1, 3] = 50.0
    starts[0, 4], ends[0, 5] = 5.0, 5.0  # "two three" in window 0
    predictions, nbest, _ = decode([example], features, starts, ends, max_answer_length=3)
    assert predictions["w"] == "two three"
    assert all(x["text"] != "three" or x["start_logit"] < 50 for x in nbest["w"])


def test_version_2_null_threshold(tokenizer):
    example = SquadExample("n", "what sat?", CONTEXT, (), True, None)
    features = featurize_squad(
        tokenizer, [example], max_seq_length=64, max_query_length=16, training=True
    )
    assert features["start_positions"].tolist() == [0]
    cat = CONTEXT.index("cat")
    starts, ends = _logits_for(features, 0, cat, cat + 3, high=1.5)
    starts[0, 0] = ends[0, 0] = 2.0  # null score 4, best span 3 -> odds 1
    kwargs = {"version_2": True}
    predictions, nbest, odds = decode([example], features, starts, ends, **kwargs)
    assert predictions["n"] == "" and odds["n"] == pytest.approx(1.0)
    assert nbest["n"][0]["text"] == "" and nbest["n"][1]["text"] == "cat"
    predictions, _, _ = decode(
        [example], features, starts, ends, null_score_diff_threshold=2.0, **kwargs
    )
    assert predictions["n"] == "cat"
    predictions, _, _ = decode([example], features, starts, ends)  # v1 never answers ""
    assert predictions["n"] == "cat"


def test_em_f1_normalisation():
    assert normalize_answer("The  Cat!") == "cat"
    assert exact_match("The  Cat!", "cat") == 1.0
    # pred {cat, sat} vs gold {cat, on, mat}: P 1/2, R 1/3 -> F1 0.4
    assert f1_score("the cat sat", "cat on mat") == pytest.approx(0.4)
    assert f1_score("", "") == 1.0 and f1_score("a", "cat") == 0.0


def test_squad_metrics_with_no_answer_breakdown():
    gold = {"q1": ["The Cat", "a dog"], "q2": [], "q3": ["cat on mat"], "q4": ["cat"]}
    predictions = {"q1": "The  Cat!", "q2": "", "q3": "the cat sat"}
    scores = squad_metrics(predictions, gold)  # q4 missing: scored 0
    assert scores["exact"] == pytest.approx(50.0)
    assert scores["f1"] == pytest.approx(100 * (1 + 1 + 0.4 + 0) / 4)
    assert scores["HasAns_exact"] == pytest.approx(100 / 3)
    assert scores["HasAns_f1"] == pytest.approx(100 * 1.4 / 3)
    assert (scores["NoAns_exact"], scores["NoAns_total"], scores["total"]) == (100.0, 1.0, 4.0)
    wrong = squad_metrics({"q2": "cat"}, {"q2": []})
    assert wrong["exact"] == 0.0 and "HasAns_exact" not in wrong


def test_check_lengths_and_write_files(tmp_path):
    with pytest.raises(ConfigError, match=r"task\.max_query_length"):
        check_squad_lengths(64, 64, 16)
    with pytest.raises(ConfigError, match=r"task\.doc_stride"):
        check_squad_lengths(384, 64, 0)
    paths = write_squad_predictions(
        str(tmp_path / "out"), {"q": "Cat"}, {"q": [{"text": "Cat"}]}, {"q": 1.5}
    )
    assert [p.rsplit("/", 1)[1] for p in paths] == [
        "predictions.json",
        "nbest_predictions.json",
        "null_odds.json",
    ]
    assert json.loads((tmp_path / "out" / "predictions.json").read_text()) == {"q": "Cat"}
    assert json.loads((tmp_path / "out" / "null_odds.json").read_text()) == {"q": 1.5}
