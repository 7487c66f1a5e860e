"""Bad input never hangs a stage or yields an empty result silently.

- The sentence splitter is linear in its input: 1 MB of one pathological kind or another
  takes milliseconds (it was quadratic on runs of ``.``/``!``: 20,000 dots took 2.6 s, the
  300,000-dot line of the report about 9 minutes).
- The WordPiece trainer never sees a word longer than the tokenizer can encode (its time is
  quadratic in word length: a 300,000-letter word took 37 s); such words are counted.
- ``bertpipe preprocess`` on inputs that give no training instance fails with one line and
  exit status 2, keeping what it wrote (the manifest with the counts) and the inputs.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from pathlib import Path

import pytest

from bertpipe.app.cli import main
from bertpipe.preprocessing.readers import InputConfig, read_documents
from bertpipe.preprocessing.sentences import split_sentences
from bertpipe.preprocessing.tokenizer import MAX_WORD_CHARS, train_wordpiece, vocab_in_order
from tests.conftest import synthetic_documents, write_sentence_files

MB = 1_000_000
# generous: each case takes 10-40 ms on 2 shared cores; the quadratic splitter needed hours
SECONDS = 1.0


def _timed(text: str) -> tuple[list[str], float]:
    started = time.perf_counter()
    sentences = split_sentences(text)
    return sentences, time.perf_counter() - started


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("dots", "." * MB),
        ("bangs", "!" * MB),
        ("questions", "?" * MB),
        ("mixed", ("Word " + "?" * 700 + " ... Next " + "!" * 300 + " x ..." * 20) * 850),
        ("dots-then-lowercase", ("." * 1000 + " a") * 998),
        ("closing-quotes", ('."' * 500 + " Then") * 990),
        ("no-punctuation", "y" * MB),
    ],
)
def test_splitter_is_linear_on_1mb_of_pathological_text(name: str, text: str) -> None:
    """Each 1 MB case must finish in under a second (measured with time.perf_counter)."""
    assert len(text) >= 0.95 * MB
    sentences, seconds = _timed(text)
    assert seconds < SECONDS, f"{name}: {seconds:.2f} s"
    assert "".join(sentences).replace(" ", "") == text.replace(" ", "")  # nothing lost


def test_splitter_output_on_runs_is_unchanged() -> None:
    """What the earlier (quadratic) splitter returned for these."""
    assert split_sentences("." * 50) == ["." * 50]
    assert split_sentences("Wait... What?! Yes.") == ["Wait...", "What?!", "Yes."]
    assert split_sentences('He said "yes." Then left. (See it.) Done') == [
        'He said "yes."',
        "Then left.",
        "(See it.)",
        "Done",
    ]
    assert split_sentences('It ends") Here. Mr. Smith came.') == [
        'It ends") Here.',
        "Mr. Smith came.",
    ]
    assert split_sentences("Dots ..... and on..... Then more") == [
        "Dots ..... and on.....",
        "Then more",
    ]


def test_reader_with_a_1mb_line_of_dots_is_fast(tmp_path: Path) -> None:
    path = tmp_path / "dots.txt"
    text = "A first sentence. A second one.\n\n" + "." * MB + "\n\nThe end. Really.\n"
    path.write_text(text)
    counts: Counter[str] = Counter()
    started = time.perf_counter()
    docs = list(read_documents(str(path), InputConfig(format="text"), counts))
    assert time.perf_counter() - started < SECONDS
    assert counts["sentences_too_long"] == 1  # the dots, counted, not kept
    assert docs[0].sentences == ["A first sentence.", "A second one.", "The end.", "Really."]


def test_wordpiece_trainer_skips_words_it_could_never_encode() -> None:
    texts = [" ".join(s) for s in synthetic_documents(30, seed=3)]
    reference = vocab_in_order(train_wordpiece([*texts, "x fox"], vocab_size=300))
    counts: Counter[str] = Counter()
    started = time.perf_counter()
    long_words = ["a" * 300_000, "x " + "ab" * 200_000 + " fox"]
    tokenizer = train_wordpiece([*texts, *long_words], vocab_size=300, counts=counts)
    assert time.perf_counter() - started < 10  # 37 s (the 300,000 letters alone) before
    assert counts == {"words_too_long": 2, "texts_with_words_too_long": 2}
    assert vocab_in_order(tokenizer) == reference
    # a word of exactly the limit is kept
    counts.clear()
    train_wordpiece([*texts, "q" * MAX_WORD_CHARS], vocab_size=300, counts=counts)
    assert not counts


@pytest.mark.integration
def test_tokenizer_cli_on_a_300k_line_of_dots_finishes_in_seconds(
    corpus_dir: Path, tmp_path: Path
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for p in corpus_dir.glob("*.txt"):
        (corpus / p.name).write_bytes(p.read_bytes())
    (corpus / "dots.txt").write_text("One line first.\n" + "." * 300_000 + "\nAnd after.\n")
    out = tmp_path / "tok"
    started = time.perf_counter()
    args = ["tokenizer", "train", f"input.paths=[{corpus}]", f"output={out}", "vocab_size=300"]
    assert main([*args, "tracking.enabled=false"]) == 0
    assert time.perf_counter() - started < 60  # "had not finished after 9 minutes"
    assert len((out / "vocab.txt").read_text().splitlines()) == 300


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _bad_corpus(folder: Path) -> Path:
    folder.mkdir()
    (folder / "empty.txt").write_bytes(b"")
    (folder / "blob.txt").write_bytes(bytes(range(256)) * 10)
    (folder / "latin.txt").write_bytes("d\xe9j\xe0 vu.\nencore.\n".encode("latin-1") * 20)
    (folder / "short.txt").write_text("Just one sentence here.\n\nAnd another lonely one.\n")
    (folder / "table.csv").write_text("a,b\n1,2\n")
    return folder


@pytest.mark.integration
def test_preprocess_without_any_usable_input_fails_and_keeps_what_it_wrote(
    corpus_dir: Path, tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    phase = "phases=[{name: s, max_seq_length: 32, max_predictions_per_seq: 5, num_shards: 2}]"
    base = [f"tokenizer={tokenizer_dir}", f"output={out}", "tracking.enabled=false", phase]
    bad = _bad_corpus(tmp_path / "bad")
    inputs_before = _digest(bad)

    assert main(["preprocess", f"input.paths=[{bad}]", *base]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("bertpipe: error: no training instance for phase(s) s from 5 ")
    for expected in (str(bad), "files_skipped_empty=1", "documents_too_short=2", "--overwrite"):
        assert expected in err[-1]
    assert _digest(bad) == inputs_before  # inputs untouched
    assert (out / "s" / "manifest.json").exists()  # the counts stay for inspection

    # a good run, then a bad rerun over it: the error leaves the earlier shards in place
    good = tmp_path / "good"
    write_sentence_files(good, synthetic_documents(30, seed=4), files=2)
    assert main(["preprocess", f"input.paths=[{good}]", *base, "--overwrite"]) == 0
    shards = {k: v for k, v in _digest(out).items() if k.endswith(".tar")}
    assert shards
    assert main(["preprocess", f"input.paths=[{bad}]", *base, "--overwrite"]) == 2
    assert "no training instance" in capsys.readouterr().err
    after = _digest(out)
    assert {k: after.get(k) for k in shards} == shards
