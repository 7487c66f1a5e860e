"""Readers: layouts, compression, ids, and bad input counted instead of crashing."""

from __future__ import annotations

import bz2
import gzip
import json
from collections import Counter
from pathlib import Path

import pytest
import zstandard

from bertpipe import fsio
from bertpipe.fsio import common_root
from bertpipe.preprocessing.readers import InputConfig, read_documents
from bertpipe.preprocessing.sentences import split_sentences


def _read(path: Path, **cfg: object) -> tuple[list, Counter]:
    counts: Counter[str] = Counter()
    docs = list(read_documents(str(path), InputConfig(**cfg), counts, root=str(path.parent)))
    return docs, counts


def test_sentence_layout_documents_and_ids(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_text("One.\nTwo.\n\n\nThree.\nFour.\nFive.\n")
    docs, counts = _read(path)
    assert [d.sentences for d in docs] == [["One.", "Two."], ["Three.", "Four.", "Five."]]
    assert [d.doc_id for d in docs] == ["a.txt:0", "a.txt:1"]
    assert counts["files_read"] == 1


@pytest.mark.parametrize("ext", [".gz", ".bz2", ".zst"])
def test_compressed_inputs_by_extension(tmp_path: Path, ext: str) -> None:
    raw = b"First sentence.\nSecond one.\n\nOther doc.\nMore.\n"
    data = {".gz": gzip.compress, ".bz2": bz2.compress, ".zst": zstandard.compress}[ext](raw)
    path = tmp_path / f"c.txt{ext}"
    path.write_bytes(data)
    docs, _ = _read(path)
    assert [len(d.sentences) for d in docs] == [2, 2]


def test_jsonl_with_fields_and_malformed_lines(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    lines = [
        json.dumps({"id": "x1", "body": "Alpha is first. Beta follows it."}),
        "{not json",
        json.dumps({"other": "no body"}),
        json.dumps({"id": "x2", "body": "Gamma. Delta here."}),
    ]
    path.write_text("\n".join(lines) + "\n")
    docs, counts = _read(path, format="jsonl", text_field="body", id_field="id")
    assert [d.doc_id for d in docs] == ["x1", "x2"]
    assert docs[0].sentences == ["Alpha is first.", "Beta follows it."]
    assert counts["records_malformed"] == 2


def test_text_layout_splits_sentences(tmp_path: Path) -> None:
    path = tmp_path / "e.txt"
    path.write_text("Dr. Who arrived. He left\nat noon.\n\nA new paragraph starts here")
    docs, _ = _read(path, format="text")
    assert docs[0].sentences == [
        "Dr. Who arrived.",
        "He left at noon.",
        "A new paragraph starts here",
    ]


def test_bad_files_are_counted_not_fatal(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "binary.txt").write_bytes(b"\x00\x01\x02" * 100)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait.\n".encode("latin-1") * 50)
    (tmp_path / "notes.docx").write_bytes(b"whatever")
    counts: Counter[str] = Counter()
    cfg = InputConfig()
    for name in ("empty.txt", "binary.txt", "latin1.txt", "notes.docx"):
        assert list(read_documents(str(tmp_path / name), cfg, counts)) == []
    assert counts["files_skipped_empty"] == 1
    assert counts["files_skipped_binary"] == 1
    assert counts["files_skipped_not_utf8"] == 1
    assert counts["files_skipped_unknown_extension"] == 1
    for name in ("empty.txt", "binary.txt", "latin1.txt", "notes.docx"):
        assert name in caplog.text


def test_a_50mb_line_is_skipped_with_bounded_work(tmp_path: Path) -> None:
    path = tmp_path / "huge.txt"
    with path.open("w") as f:
        f.write("Before it.\nAnd then.\n\n")
        f.write("x" * 50_000_000 + "\n\n")
        f.write("After it.\nThe end.\n")
    docs, counts = _read(path)
    assert [d.sentences for d in docs] == [["Before it.", "And then."], ["After it.", "The end."]]
    assert counts["sentences_too_long"] == 1


def test_truncated_gzip_is_reported(tmp_path: Path) -> None:
    data = gzip.compress(b"A sentence.\nAnother.\n\n" * 2000)
    path = tmp_path / "cut.txt.gz"
    path.write_bytes(data[: len(data) // 2])
    _docs, counts = _read(path)
    assert counts["files_failed"] == 1


def test_glob_folder_and_no_match(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    for name in ("a.txt", "b.txt", "sub/c.txt"):
        (tmp_path / name).write_text("x.\n")
    assert len(fsio.expand_urls(str(tmp_path))) == 3
    assert len(fsio.expand_urls(str(tmp_path / "*.txt"))) == 2
    with pytest.raises(fsio.NoMatchError, match="nothing-here"):
        fsio.expand_urls(str(tmp_path / "nothing-here*.txt"))
    assert common_root([str(tmp_path / "a.txt"), str(tmp_path / "sub/c.txt")]) == str(tmp_path)


def test_memory_filesystem_urls() -> None:
    fsio.atomic_write_text("memory://corpus/m.txt", "Hello there.\nGeneral Kenobi.\n")
    counts: Counter[str] = Counter()
    docs = list(read_documents("memory://corpus/m.txt", InputConfig(), counts))
    assert docs[0].sentences == ["Hello there.", "General Kenobi."]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Mr. Smith went home. He slept.", ["Mr. Smith went home.", "He slept."]),
        ("It costs 3.50 dollars. Cheap!", ["It costs 3.50 dollars.", "Cheap!"]),
        ('He said "Stop." Then left.', ['He said "Stop."', "Then left."]),
        ("See e.g. the docs. Fine.", ["See e.g. the docs.", "Fine."]),
        ("J. R. R. Tolkien wrote. Yes?  No.", ["J. R. R. Tolkien wrote.", "Yes?", "No."]),
        ("lower case after. stays together", ["lower case after. stays together"]),
        ("One.\n\ntwo", ["One.", "two"]),
    ],
)
def test_sentence_splitter(text: str, expected: list[str]) -> None:
    assert split_sentences(text) == expected
