"""Tokenizer: deterministic training, Google-format vocab.txt, special ids read not assumed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bertpipe.preprocessing.tokenizer import (
    CorpusEncoder,
    SpecialTokens,
    TokenizerMismatchError,
    build_from_vocab,
    load_tokenizer,
    read_vocab_txt,
    save_tokenizer,
    tokenizer_checksum,
    train_wordpiece,
)
from tests.conftest import synthetic_documents

TEXTS = [s for d in synthetic_documents(60, seed=3) for s in d]


def test_training_is_deterministic() -> None:
    a = train_wordpiece(TEXTS, vocab_size=300, min_frequency=1)
    b = train_wordpiece(TEXTS, vocab_size=300, min_frequency=1)
    assert tokenizer_checksum(a) == tokenizer_checksum(b)
    assert a.get_vocab() == b.get_vocab()


def test_saved_folder_round_trips_and_vocab_txt_is_in_id_order(tmp_path: Path) -> None:
    tok = train_wordpiece(TEXTS, vocab_size=300, min_frequency=1)
    save_tokenizer(tok, str(tmp_path), lowercase=True)
    vocab = read_vocab_txt(str(tmp_path / "vocab.txt"))
    assert vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert [tok.token_to_id(t) for t in vocab] == list(range(len(vocab)))
    loaded = load_tokenizer(str(tmp_path))
    assert tokenizer_checksum(loaded) == tokenizer_checksum(tok)
    # a bare vocab.txt builds an equivalent tokenizer
    from_vocab = load_tokenizer(str(tmp_path / "vocab.txt"))
    sentence = "The government development program was important."
    assert from_vocab.encode(sentence).ids == tok.encode(sentence).ids


def test_google_layout_vocab_special_ids_are_read(tmp_path: Path) -> None:
    """Google's uncased vocab puts [PAD] at 0, [UNK] [CLS] [SEP] [MASK] at 100-103."""
    vocab = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += ["the", "cat", "sat", "on", "mat", "##s", "."]
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(vocab) + "\n")
    tok = load_tokenizer(str(path))
    specials = SpecialTokens.from_tokenizer(tok)
    assert (specials.pad, specials.unk, specials.cls, specials.sep, specials.mask) == (
        0,
        100,
        101,
        102,
        103,
    )
    enc = tok.encode("The cats sat.", "On the mat.")
    assert enc.ids[0] == 101 and enc.ids.count(102) == 2
    assert enc.tokens[:4] == ["[CLS]", "the", "cat", "##s"]


def test_inconsistent_folder_and_missing_specials(tmp_path: Path) -> None:
    tok = train_wordpiece(TEXTS, vocab_size=300, min_frequency=1)
    save_tokenizer(tok, str(tmp_path), lowercase=True)
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\nother\n")
    with pytest.raises(TokenizerMismatchError, match="does not match"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(TokenizerMismatchError, match=r"\[CLS\]"):
        build_from_vocab(["[PAD]", "[UNK]", "a", "b"])


def test_literal_special_tokens_in_text_are_text() -> None:
    tok = train_wordpiece([*TEXTS, "mask cls sep tokens"], vocab_size=300, min_frequency=1)
    specials = set(SpecialTokens.from_tokenizer(tok).all()) - {
        SpecialTokens.from_tokenizer(tok).unk
    }
    ids = CorpusEncoder(tok).encode(["The [MASK] and [CLS] tokens.", "Plain text."])
    assert not specials.intersection(ids[0])
    assert ids[1] == tok.encode("Plain text.", add_special_tokens=False).ids


@pytest.mark.parametrize("accent_marks", ["diacritics", "all"])
def test_corpus_encoder_gives_the_tokenizers_ids_on_any_text(accent_marks: str) -> None:
    """The job's encoder takes a shortcut for ASCII sentences under the default normaliser
    (the diacritics steps left out: they change no ASCII text); its ids equal the
    tokenizer's own on every kind of text, in order, in batches mixing them."""
    import random
    import unicodedata

    from bertpipe.preprocessing.normalisation import Normalisation

    norm = Normalisation(accent_marks=accent_marks)  # type: ignore[arg-type]
    extra = ["Café déjà vu naïve", "파일을 사용합니다", "がぎぐ ガギグ", "Ångström Øre ß ﬁ"]
    tok = train_wordpiece([*TEXTS, *extra], vocab_size=400, min_frequency=1, normalisation=norm)
    rng = random.Random(7)
    pools = [
        "".join(map(chr, range(128))),  # every ASCII code point, controls and DEL included
        "abcdefghij ABCDEFGHIJ .,;:!?'-",
        "àáâãäåçèéêëìíîïñòóôõöùúûüýÿÀÉÎÕÜŒœŠšŽžİı",
        unicodedata.normalize("NFD", "éèêàüöçñ") + "\u0301\u0308",
        "파일을사용합니다한국어문장입니다 " + unicodedata.normalize("NFD", "한국어"),
        "がぎぐげござじずぜぞパピプ漢字の文章です。",
        "The government ",
    ]
    sentences = []
    for _ in range(400):
        chosen = rng.sample(pools, rng.randint(1, 3))
        sentences.append("".join(rng.choice(p) for p in chosen for _ in range(rng.randint(0, 30))))
    sentences += [s.lower() for s in extra] + ["", " ", "plain ascii only."]
    encoder = CorpusEncoder(tok)
    assert (encoder._ascii_batch is not None) == (accent_marks == "diacritics")
    expected = [tok.encode(s, add_special_tokens=False).ids for s in sentences]
    for size in (1, 7, 64, len(sentences)):
        got = [
            ids
            for i in range(0, len(sentences), size)
            for ids in encoder.encode(sentences[i : i + size])
        ]
        assert got == expected
    assert any(s.isascii() and s for s in sentences) and any(not s.isascii() for s in sentences)


def test_a_sample_of_a_big_corpus_is_chosen_before_splitting_and_capped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sample_fraction picks documents by id before their text is split into sentences,
    and max_mb stops reading at that much sampled text."""
    import json
    from collections import Counter

    from bertpipe.preprocessing import readers
    from bertpipe.preprocessing.config import TokenizerConfig
    from bertpipe.preprocessing.readers import InputConfig
    from bertpipe.preprocessing.vocab import _sample_sentences
    from bertpipe.seeding import stable_unit

    path = tmp_path / "c.jsonl"
    texts = [f"Document {i} is here. It has two sentences." for i in range(400)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    split_calls = []
    real_split = readers.split_sentences
    monkeypatch.setattr(
        readers, "split_sentences", lambda t: split_calls.append(t) or real_split(t)
    )

    def sample(**kw: object) -> list[str]:
        cfg = TokenizerConfig(input=InputConfig(paths=[str(path)], format="jsonl"), **kw)  # type: ignore[arg-type]
        return list(_sample_sentences(cfg, [str(path)], Counter()))

    half = sample(sample_fraction=0.5)
    chosen = [i for i in range(400) if stable_unit("sample", f"c.jsonl:{i + 1}") < 0.5]
    assert half == [s for i in chosen for s in real_split(texts[i])]
    assert len(split_calls) == len(chosen)  # the others were never split
    capped = sample(max_mb=0.002)  # 2,000 characters
    assert 2000 <= sum(len(s) + 1 for s in capped) < 2000 + 60


def _jsonl_corpus(folder: Path, files: int = 2) -> Path:
    import json

    folder.mkdir()
    docs = synthetic_documents(80, seed=5)
    for i in range(files):
        lines = [json.dumps({"text": " ".join(d)}) for d in docs[i::files]]
        (folder / f"part-{i}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_corpus_whose_files_are_all_skipped_is_one_line_exit_2_and_writes_nothing(
    tmp_path: Path,
) -> None:
    """``.jsonl`` files read as the default ``sentences`` format (the shipped config's):
    refused before anything is read, with the fix; files that are read but give no document
    (the text under another field): refused after reading. Neither touches the tokenizer
    already in ``output`` (``--overwrite`` given)."""
    from tests.cli_runner import run_cli

    corpus = _jsonl_corpus(tmp_path / "corpus")
    out = tmp_path / "tok"
    base = ["tokenizer", "train", f"input.paths=[{corpus}]", f"output={out}"]
    base += ["vocab_size=300", "tracking.enabled=false"]
    assert run_cli([*base, "input.format=jsonl"]).returncode == 0
    before = _folder_bytes(out)

    skipped = run_cli([*base, "--overwrite"])
    assert skipped.returncode == 2
    assert skipped.stderr.splitlines() == [
        "bertpipe: error: config key 'input.format': is sentences, which reads .txt, .text "
        f"files, and none of the 2 file(s) matching input.paths=['{corpus}'] is one (2 .jsonl): "
        "every file would be skipped; set input.format=jsonl (nothing was read or written)"
    ]
    assert _folder_bytes(out) == before

    nothing = run_cli([*base, "input.format=jsonl", "input.text_field=body", "--overwrite"])
    assert nothing.returncode == 2, nothing.stderr[-2000:]
    errors = [x for x in nothing.stderr.splitlines() if x.startswith("bertpipe: error:")]
    assert errors == [
        "bertpipe: error: no document to train the vocabulary on in the 2 file(s) matching "
        f"input.paths=['{corpus}']: 2 file(s) read (records_malformed=80, see the warnings "
        "above); check input.paths and input.format=jsonl and input.text_field=body; nothing "
        f"was written to {out}"
    ]
    assert nothing.stderr.splitlines()[-1] == errors[0]
    assert _folder_bytes(out) == before


def test_a_vocabulary_smaller_than_asked_says_why_in_one_warning(tmp_path: Path) -> None:
    """vocab_size beyond what half the documents hold: exit 0, the smaller vocabulary, and
    one warning naming the sample, its distinct words and characters and what to change."""
    from tests.cli_runner import run_cli

    corpus = _jsonl_corpus(tmp_path / "corpus")
    out = tmp_path / "tok"
    done = run_cli(
        [
            "tokenizer",
            "train",
            f"input.paths=[{corpus}]",
            "input.format=jsonl",
            f"output={out}",
            "vocab_size=5000",
            "sample_fraction=0.5",
            "tracking.enabled=false",
        ]
    )
    assert done.returncode == 0, done.stderr[-2000:]
    size = len((out / "vocab.txt").read_text().splitlines())
    assert size < 5000
    warnings = [x for x in done.stderr.splitlines() if " WARNING " in x]
    assert len(warnings) == 1, done.stderr
    sampled = json.loads(done.stdout.strip().splitlines()[-1])["documents_sampled"]
    assert 20 < sampled < 60
    assert (
        warnings[0]
        .split(": ", 1)[1]
        .startswith(
            f"tokenizer: the vocabulary has {size} tokens, fewer than vocab_size=5000: it learned "
            f"from sample_fraction=0.5 of the documents ({sampled} document(s)), which hold "
        )
    )
    assert warnings[0].endswith(
        "; raise sample_fraction, lower min_frequency, or ask for a smaller vocab_size"
    )
    assert re.search(r"hold \d+ distinct words \(\d+ of them seen min_frequency=2 ", warnings[0])
    assert re.search(r" and \d+ distinct characters;", warnings[0])
