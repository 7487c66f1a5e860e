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


# --------------------------------------------------------------------------- languages

_KO = (
    "GIMP는 이미지 편집 프로그램입니다. 다음 장에서 설치 방법을\n설명합니다. "
    "준비되셨나요? 시작합니다!"
)
_KO_SENTENCES = [
    "GIMP는 이미지 편집 프로그램입니다.",
    "다음 장에서 설치 방법을 설명합니다.",  # a line break between Hangul words: a space
    "준비되셨나요?",
    "시작합니다!",
]
_JA = "GIMP は画像編集\nプログラムです。次の章で導入方法を説明します！準備はいいですか？はい"
_JA_SENTENCES = [
    "GIMP は画像編集プログラムです。",  # a line break between kana and Han: nothing
    "次の章で導入方法を説明します！",
    "準備はいいですか？",
    "はい",
]
_ZH = "GIMP 是一个图像\n编辑程序。下一章介绍安装方法！准备好了吗？好的。"
_ZH_SENTENCES = ["GIMP 是一个图像编辑程序。", "下一章介绍安装方法！", "准备好了吗？", "好的。"]


@pytest.mark.parametrize(
    ("language", "text", "expected"),
    [("ko", _KO, _KO_SENTENCES), ("ja", _JA, _JA_SENTENCES), ("zh", _ZH, _ZH_SENTENCES)],
)
def test_text_layout_splits_each_language_by_its_rules(
    tmp_path: Path, language: str, text: str, expected: list[str]
) -> None:
    """input.language picks rules that end Korean, Japanese and Chinese sentences (the
    English rules want a capital letter after the full stop and know no 。！？)."""
    path = tmp_path / f"{language}.txt"
    path.write_text(text + "\n\nGIMP 2.10\n", encoding="utf-8")
    docs, _ = _read(path, format="text", language=language)
    assert docs[0].sentences == [*expected, "GIMP 2.10"]
    english, _ = _read(path, format="text")  # the default, language=en: today's rules
    assert len(english[0].sentences) < len(expected) + 1


def test_line_breaks_inside_a_paragraph_fold_as_the_script_is_written(tmp_path: Path) -> None:
    """text and jsonl: a single line break is wrapping. It becomes a space, except between
    two characters of a script written without spaces (Han, kana), where it disappears,
    whatever the language setting; Hangul is written with spaces and keeps one."""
    path = tmp_path / "wrapped.txt"
    path.write_text(
        "日本語の文章は\n改行されても\n  一つの文です。\n\n"
        "한국어 문장은\n띄어 씁니다.\n\n"
        "Tokyo は\n日本の首都。 English\nwraps too.\n",
        encoding="utf-8",
    )
    expected = [
        "日本語の文章は改行されても一つの文です。",
        "한국어 문장은 띄어 씁니다.",
        "Tokyo は日本の首都。",
        "English wraps too.",
    ]
    docs, _ = _read(path, format="text", language="ja")
    assert docs[0].sentences == expected
    english, _ = _read(path, format="text")  # the English rules fold the same way
    assert english[0].sentences == [*expected[:2], " ".join(expected[2:])]  # 。 ends none
    lines, _ = _read(path, format="text", split_sentences=False)  # a line is a sentence
    assert lines[0].sentences[:3] == ["日本語の文章は", "改行されても", "一つの文です。"]


def test_language_field_picks_the_rules_of_each_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """jsonl: input.language_field names each record's language; a record without it is in
    input.language; a value that is no language code is counted, named and read as
    input.language."""
    path = tmp_path / "mixed.jsonl"
    records = [
        {"id": "ko-1", "lang": "ko", "text": _KO},
        {"id": "ja-1", "lang": "ja-JP", "text": _JA},
        {"id": "en-1", "text": "It works. 다음은 한국어입니다. Next one."},
        {"id": "bad-1", "lang": 7, "text": "Mr. Smith came. He left."},
    ]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    docs, counts = _read(path, format="jsonl", id_field="id", language_field="lang")
    assert [d.sentences for d in docs] == [
        _KO_SENTENCES,
        _JA_SENTENCES,
        ["It works. 다음은 한국어입니다.", "Next one."],  # English rules
        ["Mr. Smith came.", "He left."],
    ]
    assert counts["documents_language_invalid"] == 1
    assert "bad-1" in caplog.text and "lang=7" in caplog.text


def test_parquet_language_column(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "docs.parquet"
    table = pa.table({"text": [_ZH, _ZH], "lang": ["zh", None]})
    pq.write_table(table, path)
    docs, _ = _read(path, format="parquet", language_field="lang")
    assert docs[0].sentences == _ZH_SENTENCES
    assert len(docs[1].sentences) == 1  # null: input.language, English rules


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("input.language=korean!", "input.language"),
        ("input.language_field=lang", "input.language_field"),  # the sentences layout
    ],
)
def test_bad_language_settings_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str, key: str
) -> None:
    from bertpipe.app.cli import main

    corpus = tmp_path / "c.txt"
    corpus.write_text("One.\nTwo.\n")
    code = main(["preprocess", f"input.paths=[{corpus}]", override, f"output={tmp_path}/o"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("bertpipe: error:") and key in err[0]
    assert not (tmp_path / "o").exists()
