"""GLUE layouts, the generic table reader, pair featurization and submission files."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from bertpipe.config import ConfigError
from bertpipe.finetuning.tasks.base import TaskDataError, check_max_seq_length, take
from bertpipe.finetuning.tasks.glue import (
    TableColumns,
    encode_pairs,
    featurize_pairs,
    read_glue,
    read_table,
    table_spec,
    truncate_pair_lengths,
    write_glue_predictions,
)
from bertpipe.finetuning.tasks.glue_tasks import glue_file, glue_task

MNLI_TRAIN = [
    "index",
    "promptID",
    "pairID",
    "genre",
    "sentence1_binary_parse",
    "sentence2_binary_parse",
    "sentence1_parse",
    "sentence2_parse",
    "sentence1",
    "sentence2",
    "label1",
    "gold_label",
]
STSB = [
    "index",
    "genre",
    "filename",
    "year",
    "old_index",
    "source1",
    "source2",
    "sentence1",
    "sentence2",
    "score",
]

# task -> (header, text_a column, text_b column, label column, a valid label)
LAYOUTS = {
    "sst2": (["sentence", "label"], "sentence", None, "label", "1"),
    "mrpc": (
        ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"],
        "#1 String",
        "#2 String",
        "Quality",
        "1",
    ),
    "stsb": (STSB, "sentence1", "sentence2", "score", "3.800"),
    "qqp": (
        ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
        "question1",
        "question2",
        "is_duplicate",
        "1",
    ),
    "mnli": (MNLI_TRAIN, "sentence1", "sentence2", "gold_label", "neutral"),
    "qnli": (
        ["index", "question", "sentence", "label"],
        "question",
        "sentence",
        "label",
        "entailment",
    ),
    "rte": (
        ["index", "sentence1", "sentence2", "label"],
        "sentence1",
        "sentence2",
        "label",
        "not_entailment",
    ),
    "wnli": (["index", "sentence1", "sentence2", "label"], "sentence1", "sentence2", "label", "0"),
}


def _row(header: list[str], values: dict[str, str]) -> str:
    return "\t".join(values.get(column, f"{column}-{i}") for i, column in enumerate(header))


@pytest.mark.parametrize("task", sorted(LAYOUTS))
def test_glue_train_layout_counts_bad_rows_by_line(task: str, write) -> None:
    header, col_a, col_b, col_label, label = LAYOUTS[task]
    good = {col_a: "The cat sat.", col_label: label}
    quoted = {col_a: 'He said "hello', col_label: label}
    if col_b:
        good[col_b] = "A dog sat on the mat."
        quoted[col_b] = 'the "mat'
    lines = [
        "\t".join(header),  # 1
        _row(header, good),  # 2
        _row(header, good).rsplit("\t", 1)[0],  # 3: a column short
        _row(header, {**good, col_label: "maybe"}),  # 4: unknown label
        _row(header, {**good, col_a: "  "}),  # 5: empty text
        _row(header, quoted),  # 6: unbalanced quotes are plain text
    ]
    path = write(f"{task}_train.tsv", "\n".join(lines) + "\n")
    examples, report = read_glue(task, path)
    assert (report.rows_read, report.rows_kept) == (5, 2)
    assert [(p.file, p.line) for p in report.problems] == [(path, 3), (path, 4), (path, 5)]
    assert "columns" in report.problems[0].reason
    assert "label" in report.problems[1].reason
    assert "empty" in report.problems[2].reason
    assert examples[1].text_a == 'He said "hello'
    assert examples[1].line == 6
    spec = glue_task(task).spec
    if spec.kind == "regression":
        assert examples[0].label == pytest.approx(3.8)
    else:
        assert spec.labels[examples[0].label] == label
    assert (examples[0].text_b is None) == (col_b is None)
    assert "3 problems" in report.summary()


TEST_LAYOUTS = {
    "cola": ["index", "sentence"],
    "sst2": ["index", "sentence"],
    "mrpc": ["index", "#1 ID", "#2 ID", "#1 String", "#2 String"],
    "stsb": STSB[:-1],
    "qqp": ["id", "question1", "question2"],
    "mnli": MNLI_TRAIN[:-2],
    "qnli": ["index", "question", "sentence"],
    "rte": ["index", "sentence1", "sentence2"],
    "wnli": ["index", "sentence1", "sentence2"],
}


@pytest.mark.parametrize("task", sorted(TEST_LAYOUTS))
def test_glue_test_layout_has_ids_and_no_labels(task: str, write) -> None:
    header = TEST_LAYOUTS[task]
    rows = [_row(header, {"index": str(i), "id": str(i)}) for i in (7, 8)]
    path = write("test.tsv", "\n".join(["\t".join(header), *rows]) + "\n")
    examples, report = read_glue(task, path)
    assert [e.guid for e in examples] == ["7", "8"]
    assert all(e.label is None for e in examples)
    assert report.rows_kept == 2 and not report.problems


def test_cola_train_has_no_header(write) -> None:
    text = (
        "gj04\t1\t\tThe cat sat on the mat.\n"
        "gj04\t0\t*\tCat the sat.\n"
        "gj04\t1\t\n"
        "gj04\t2\t*\tThe dog sat.\n"
        "gj04\t0\t*\t \n"
    )
    examples, report = read_glue("CoLA", write("train.tsv", text))
    assert [(e.text_a, e.label, e.line) for e in examples] == [
        ("The cat sat on the mat.", 1, 1),
        ("Cat the sat.", 0, 2),
    ]
    assert [p.line for p in report.problems] == [3, 4, 5]
    assert glue_task("cola").spec.main_metric == "mcc"


def test_mrpc_with_byte_order_mark(tmp_path) -> None:
    path = tmp_path / "msr.tsv"
    header = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    path.write_bytes(("\ufeff" + header + "1\t1\t2\tThe cat.\tA cat.\n").encode())
    examples, _ = read_glue("mrpc", str(path))
    assert examples[0].label == 1


def test_stsb_label_range_and_number(write) -> None:
    header = "\t".join(STSB)
    rows = [_row(STSB, {"sentence1": "a", "sentence2": "b", "score": s}) for s in ("5.0", "7", "x")]
    _, report = read_glue("sts-b", write("dev.tsv", "\n".join([header, *rows])))
    assert report.rows_kept == 1
    assert "outside" in report.problems[0].reason and "number" in report.problems[1].reason


def test_whole_file_errors_name_the_file(write, tmp_path) -> None:
    with pytest.raises(TaskDataError, match=r"missing\.tsv: file not found"):
        read_glue("rte", str(tmp_path / "missing.tsv"))
    wrong = write("wrong.tsv", "a\tb\n1\t2\n")
    with pytest.raises(TaskDataError, match=r"wrong\.tsv: header .* no column 'sentence1'"):
        read_glue("rte", wrong)
    all_bad = write("bad.tsv", "index\tsentence1\tsentence2\tlabel\n1\ta\tb\tmaybe\n")
    with pytest.raises(TaskDataError, match=r"bad\.tsv: no usable rows"):
        read_glue("rte", all_bad)
    latin = tmp_path / "latin.tsv"
    latin.write_bytes("sentence\tlabel\ncaf\xe9\t1\n".encode("latin-1"))
    with pytest.raises(TaskDataError, match="not UTF-8"):
        read_glue("sst2", str(latin))
    with pytest.raises(ValueError, match="unknown GLUE task"):
        glue_task("squad")


def test_glue_file_names() -> None:
    assert glue_file("mnli", "dev") == "dev_matched.tsv"
    assert glue_file("MNLI", "dev_mismatched") == "dev_mismatched.tsv"
    assert glue_file("qqp", "test") == "test.tsv"


def _bert_truncate(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """BERT's _truncate_seq_pair, token by token."""
    while len_a + len_b > budget:
        if len_a > len_b:
            len_a -= 1
        else:
            len_b -= 1
    return len_a, len_b


def test_truncate_pair_lengths_matches_bert_loop() -> None:
    for budget in range(2, 14):
        for len_a in range(0, 16):
            for len_b in range(0, 16):
                got = truncate_pair_lengths(len_a, len_b, budget)
                assert got == _bert_truncate(len_a, len_b, budget), (len_a, len_b, budget)


def test_encode_pairs_truncates_longer_side_first(tokenizer) -> None:
    ids = tokenizer.token_to_id
    features = encode_pairs(
        tokenizer, ["The cat sat on the mat", "a dog"], ["the dog", "the cat"], max_seq_length=8
    )
    # budget 5: A has 6 tokens, B 2 -> A keeps 3, B keeps 2
    first = [ids(t) for t in ["[CLS]", "the", "cat", "sat", "[SEP]", "the", "dog", "[SEP]"]]
    assert features["input_ids"][0].tolist() == first
    assert features["token_type_ids"][0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    second = [ids(t) for t in ["[CLS]", "a", "dog", "[SEP]", "the", "cat", "[SEP]"]]
    assert features["input_ids"][1, :7].tolist() == second
    assert features["input_ids"][1, 7] == ids("[PAD]") == 0
    assert features["attention_mask"][1].tolist() == [1] * 7 + [0]
    assert features["lengths"].tolist() == [8, 7]
    assert features["truncated"].tolist() == [True, False]
    assert features["input_ids"].dtype == np.int32


def test_encode_single_text_and_tokenizer_left_alone(tokenizer) -> None:
    tokenizer.enable_truncation(max_length=3)
    try:
        features = encode_pairs(tokenizer, ["the cat sat on the mat"], None, max_seq_length=6)
        assert tokenizer.truncation is not None
    finally:
        tokenizer.no_truncation()
    tokens = [tokenizer.id_to_token(i) for i in features["input_ids"][0]]
    assert tokens == ["[CLS]", "the", "cat", "sat", "on", "[SEP]"]
    assert features["token_type_ids"][0].tolist() == [0] * 6


def test_featurize_labels_and_take(tokenizer, write) -> None:
    header = "index\tsentence1\tsentence2\tscore"
    rows = ["0\tthe cat\tthe dog sat on the mat\t1.5", "1\ta cat\tthe cat\t4.0"]
    spec = table_spec("sim", "regression", write("t.tsv", ""), TableColumns("sentence1"))
    examples, _ = read_table(
        write("sim.tsv", "\n".join([header, *rows])),
        TableColumns("sentence1", "sentence2", "score", "index"),
        spec,
    )
    features = featurize_pairs(tokenizer, examples, spec, max_seq_length=32)
    assert features["labels"].dtype == np.float32
    assert features["labels"].tolist() == [1.5, 4.0]
    batch = take(features, [1])
    assert batch["input_ids"].shape == (1, 7) and batch["labels"].tolist() == [4.0]


def test_generic_csv_reader_infers_sorted_labels(write) -> None:
    train = write(
        "train.csv",
        'id,text,label\n1,"good, great movie",pos\n2,bad movie,neg\n3,,pos\n4,ok,pos,extra\n',
    )
    columns = TableColumns("text", label="label", index="id")
    spec = table_spec("sentiment", "classification", train, columns)
    assert spec.labels == ("neg", "pos") and spec.positive_label == "pos"
    examples, report = read_table(train, columns, spec)
    assert [(e.guid, e.text_a, e.label) for e in examples] == [
        ("1", "good, great movie", 1),
        ("2", "bad movie", 0),
    ]
    assert [(p.line, "empty" in p.reason or "columns" in p.reason) for p in report.problems] == [
        (4, True),
        (5, True),
    ]
    dev = write("dev.csv", "id,text,label\n9,fine,neutral\n10,good,pos\n")
    _, dev_report = read_table(dev, columns, spec)
    assert dev_report.problems[0].line == 2 and "unknown label" in dev_report.problems[0].reason


def test_generic_jsonl_reader(write) -> None:
    lines = [
        {"premise": "a man", "hypothesis": "a woman", "label": 2},
        {"premise": "a man", "hypothesis": "one man", "label": 10},
        "not json",
        {"premise": "a man", "label": 2},
        {"premise": "a man", "hypothesis": "men", "label": 3},
    ]
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n"
    path = write("train.jsonl", text)
    columns = TableColumns("premise", "hypothesis", "label")
    spec = table_spec("nli", "classification", path, columns)
    assert spec.labels == ("2", "3", "10")  # integers sort numerically
    examples, report = read_table(path, columns, spec)
    assert [e.label for e in examples] == [0, 2, 1]
    assert [p.line for p in report.problems] == [3, 4]
    unlabeled, _ = read_table(path, columns, spec, labeled=False)
    assert all(e.label is None for e in unlabeled)


def test_check_max_seq_length() -> None:
    check_max_seq_length(128, 512)
    with pytest.raises(ConfigError) as err:
        check_max_seq_length(1024, 512)
    assert err.value.key == "task.max_seq_length" and "512" in str(err.value)


def test_write_glue_predictions() -> None:
    out = io.StringIO()
    spec = glue_task("mnli").spec
    logits = np.array([[0.1, 2.0, 0.0], [3.0, 0.0, 0.0]])
    write_glue_predictions(out, ["0", "1"], logits, spec)
    assert out.getvalue() == "index\tprediction\n0\tentailment\n1\tcontradiction\n"
    out = io.StringIO()
    write_glue_predictions(out, ["0"], np.array([[3.14159]]), glue_task("stsb").spec)
    assert out.getvalue().splitlines()[1] == "0\t3.142"
