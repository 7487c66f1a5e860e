"""Read ranges: a file cut anywhere yields each document once, with the ids of a whole read;
parquet by row groups; the plan of ranges from sizes and footers."""

from __future__ import annotations

import gzip
import json
import logging
import os
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bertpipe.config import ConfigError
from bertpipe.preprocessing.ranges import ReadRange, plan_ranges
from bertpipe.preprocessing.readers import InputConfig, read_documents

# awkward on purpose: leading blank lines, whitespace-only and CRLF lines between and inside
# documents, a line of non-ASCII spaces (blank to str.strip), multi-byte text, long lines, a
# document of one line, no newline at the end
SENTENCES = (
    "\n\n  \nAlpha one.\nAlpha two is longer than the others by far, far, far.\n"
    " \t \nBeta one.\r\nBeta two.\r\n\r\nGamma only.\n\u3000\u00a0\nDelta \u00e9t\u00e9.\n"
    "Delta 2.\nDelta 3.\n\n\n\nEpsilon one.\n\u00a0x not blank\nEpsilon three."
)
JSONL = "\n".join(
    [json.dumps({"text": f"Record {i} says {'ü' * (i % 5)} a thing. Then more."}) for i in range(9)]
    + ["", "{broken", json.dumps({"text": "Last one. Really."})]
)


def _docs(  # type: ignore[no-untyped-def]
    path: Path, cfg: InputConfig, start: int = 0, end: int | None = None, offset_ids: bool = True
):
    counts: Counter[str] = Counter()
    docs = read_documents(
        str(path), cfg, counts, root=str(path.parent), start=start, end=end, offset_ids=offset_ids
    )
    return [(d.doc_id, d.sentences) for d in docs], counts


@pytest.mark.parametrize(
    ("name", "text", "fmt"), [("s.txt", SENTENCES, "sentences"), ("r.jsonl", JSONL, "jsonl")]
)
def test_any_cut_yields_each_document_once_with_whole_file_ids(
    tmp_path: Path, name: str, text: str, fmt: str
) -> None:
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    size = path.stat().st_size
    cfg = InputConfig(format=fmt)  # type: ignore[arg-type]
    whole, whole_counts = _docs(path, cfg)
    assert len(whole) >= 5
    # the same documents and counts as a plain whole-file read, which names them by ordinal
    plain, plain_counts = _docs(path, cfg, offset_ids=False)
    assert [s for _, s in plain] == [s for _, s in whole] and plain_counts == whole_counts
    assert all(":" in d for d, _ in plain) and all("@" in d for d, _ in whole)
    # every cut point, and every range size: the pieces add up to the whole read
    for cut in range(1, size):
        first, c1 = _docs(path, cfg, 0, cut)
        second, c2 = _docs(path, cfg, cut, None)
        assert first + second == whole, f"cut at byte {cut}"
        assert c1 + c2 == whole_counts, f"cut at byte {cut}"
    for step in (1, 2, 3, 7, 16, 50):
        pieces = []
        for start in range(0, size, step):
            pieces += _docs(path, cfg, start, min(size, start + step))[0]
        assert pieces == whole, f"ranges of {step} bytes"


def test_sentence_ids_are_byte_offsets(tmp_path: Path) -> None:
    path = tmp_path / "s.txt"
    path.write_bytes(SENTENCES.encode("utf-8"))
    data = path.read_bytes()
    for doc_id, sentences in _docs(path, InputConfig())[0]:
        offset = int(doc_id.split("@")[1])
        assert data[offset:].decode("utf-8").startswith(sentences[0])


def test_plan_splits_big_plain_files_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    big = tmp_path / "big.txt"
    big.write_bytes(b"x.\n\n" * 2500)  # 10,000 bytes
    small = tmp_path / "small.txt"
    small.write_bytes(b"y.\n" * 10)
    packed = tmp_path / "packed.txt.gz"
    packed.write_bytes(gzip.compress(os.urandom(10_000).hex().encode()))  # ~35 KB of text
    with caplog.at_level(logging.WARNING):
        ranges = plan_ranges([str(big), str(packed), str(small)], InputConfig(), 3000)
    assert [(r.url.rsplit("/", 1)[1], r.start, r.end, r.split) for r in ranges] == [
        ("big.txt", 0, 2500, True),
        ("big.txt", 2500, 5000, True),
        ("big.txt", 5000, 7500, True),
        ("big.txt", 7500, None, True),
        ("packed.txt.gz", 0, None, False),
        ("small.txt", 0, None, False),
    ]
    assert [r.index for r in ranges] == list(range(6))
    assert sum(r.text_bytes for r in ranges[:4]) == 10_000
    assert "packed.txt.gz is gzip-compressed and cannot be split" in caplog.text
    assert "many files" in caplog.text


def _parquet(path: Path, rows: list[dict], row_group_size: int) -> None:  # type: ignore[type-arg]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)


def test_parquet_rows_in_row_group_ranges(tmp_path: Path) -> None:
    rows = [
        {"title": f"t{i}", "body": f"Row {i} has text. And a second sentence."} for i in range(10)
    ]
    rows[4]["body"] = None  # a null text is a malformed record
    path = tmp_path / "wiki" / "train-0.parquet"
    path.parent.mkdir()
    _parquet(path, rows, row_group_size=3)
    cfg = InputConfig(format="parquet", text_field="body")
    whole, counts = _docs(path, cfg, offset_ids=False)
    assert [d for d, _ in whole] == [f"train-0.parquet#{i}" for i in range(10) if i != 4]
    assert whole[0][1] == ["Row 0 has text.", "And a second sentence."]
    assert counts["records_malformed"] == 1 and counts["files_read"] == 1
    ranges = plan_ranges([str(path)], cfg, range_bytes=100)  # about one row group each
    assert len(ranges) > 1 and ranges[-1].end == 4
    pieces, total = [], Counter()
    for r in ranges:
        docs, c = _docs(path, cfg, r.start, r.end, offset_ids=False)
        pieces += docs
        total += c
    assert pieces == whole and total == counts
    with_ids, _ = _docs(
        path, InputConfig(format="parquet", text_field="body", id_field="title"), offset_ids=False
    )
    assert [d for d, _ in with_ids][:2] == ["t0", "t1"]


def test_parquet_without_the_text_column_fails_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    _parquet(path, [{"content": "x"}], row_group_size=1)
    with pytest.raises(
        ConfigError, match=r"input.text_field.*'text' is not a column of .*a.parquet"
    ):
        plan_ranges([str(path)], InputConfig(format="parquet"), 1000)


def test_range_is_small_to_ship() -> None:
    import pickle

    assert len(pickle.dumps(ReadRange(7, "s3://bucket/wiki/part-00001.txt", 10, 20, 10))) < 300
