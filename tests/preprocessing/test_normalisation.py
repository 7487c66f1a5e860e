"""Normalisation that damages no script, and a tokenizer folder transformers reads alike.

Accent stripping removes the diacritics of Latin, Greek and Cyrillic letters and nothing of
Hangul, kana, Indic, Thai, Arabic or Hebrew text; Google's own stripping stays available,
bit for bit. Every normaliser setting reaches ``tokenizer_config.json``, so that
``transformers.AutoTokenizer`` in a clean interpreter gives bertpipe's ids on every line of
Korean, Japanese, Chinese and English text. The text is the GIMP manual's Debian
translations (``tests/langtext.py``: English from the Korean manual's untranslated pages)
and lines written here.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import subprocess
import sys
import unicodedata
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import normalizers

from bertpipe.config import load_config
from bertpipe.preprocessing.config import TokenizerConfig
from bertpipe.preprocessing.normalisation import Normalisation
from bertpipe.preprocessing.tokenizer import (
    TokenizerMismatchError,
    build_from_vocab,
    load_tokenizer,
    save_tokenizer,
    tokenizer_files,
    train_wordpiece,
    vocab_in_order,
)
from tests.langtext import Pages

JAMO = re.compile("[\u1100-\u11ff]")  # conjoining jamo: what NFD makes of a syllable
COMPAT_JAMO = re.compile("[\u3130-\u318f]")
SYLLABLE = re.compile("[\uac00-\ud7a3]")
CJK = re.compile("[\u1100-\u11ff\u3040-\u30ff\u3130-\u318f\u4e00-\u9fff\uac00-\ud7a3]")
SCRIPTS = {
    "ja": re.compile("[\u3040-\u30ff\u4e00-\u9fff]"),  # kana and ideographs
    "zh": re.compile("[\u4e00-\u9fff]"),
}

# lines no manual page holds: every script's marks, decomposed input, controls, long words
WRITTEN = [
    "한국어 문장입니다. 파일을 사용합니다. 다음 대화상자에서 레이어를 선택하세요.",
    unicodedata.normalize("NFD", "분해된 한글도 음절로 돌아옵니다."),
    "호환 자모 ㄱㄴㄷ ㅏㅑ 와 한자 漢字 樂 \uf914 섞인 줄",
    "がぎぐげご パピプペポ ヴ 日本語のテキストです。ｶﾞｷﾞｸﾞ",
    "中文句子。繁體字與简体字，全角标点！",
    "Café naïve Ünïcödé İstanbul Ångström ﬁnance Tiếng Việt",
    "Ελληνικά άέή, Йод и ёж, हिन्दी भाषा, ภาษาไทยนั้น, שָׁלוֹם, العَرَبِيَّة",
    "tab\there\x00nul\u200bzero width\r\nline\u00a0nbsp",
    "x" * 120 + " 가" * 3 + " " + "字" * 3,
    "中" * 120,
]


def paragraphs(pages: Pages, script: re.Pattern[str] | None, limit: int) -> list[str]:
    """Up to ``limit`` paragraphs of ``pages`` (one line each, 20 characters or more) at
    least 30% in ``script``; ``None``: English, paragraphs with no Hangul, kana or ideograph
    (the translations are partial: most of a page is still the English original)."""
    out = []
    for _, text in pages:
        for block in text.split("\n\n"):
            line = " ".join(block.split())
            if len(line) < 20:
                continue
            share = len((script or CJK).findall(line)) / len(line)
            if (share >= 0.3) if script is not None else (share == 0 and line.isascii()):
                out.append(line)
                if len(out) == limit:
                    return out
    return out


def korean_pages(pages: Pages) -> list[list[str]]:
    """The pages of the Korean manual that are mostly Korean (30% Hangul or more), each as
    its paragraphs (one line each)."""
    return [
        [" ".join(block.split()) for block in text.split("\n\n") if block.strip()]
        for _, text in pages
        if len(SYLLABLE.findall(text)) >= 0.3 * len(text)
    ]


def four_languages(gimp_help: Callable[[str], Pages], limit: int) -> dict[str, list[str]]:
    """``limit`` paragraphs each of Korean, Japanese, Chinese and English (the English of the
    Korean manual's untranslated pages)."""
    korean = gimp_help("ko")
    return {
        "ko": paragraphs(korean, SYLLABLE, limit),
        "ja": paragraphs(gimp_help("ja"), SCRIPTS["ja"], limit),
        "zh": paragraphs(gimp_help("zh"), SCRIPTS["zh"], limit),
        "en": paragraphs(korean, None, limit),
    }


# --------------------------------------------------------------------------- the normaliser


def test_accent_stripping_keeps_every_script_whole() -> None:
    """The default (uncased) normaliser lower-cases and strips Latin/Greek/Cyrillic accents,
    and gives every other script back as it came (in NFC); Google's stripping is tokenizers'
    ``BertNormalizer`` to the character, Hangul decomposed."""
    uncased = Normalisation().normalizer()
    korean, nfd_korean, compat, japanese, chinese, latin, others = WRITTEN[:7]
    assert uncased.normalize_str(korean) == korean.lower()
    assert uncased.normalize_str(nfd_korean) == unicodedata.normalize("NFC", nfd_korean)
    assert COMPAT_JAMO.findall(uncased.normalize_str(compat)) == COMPAT_JAMO.findall(compat)
    assert all(kana in uncased.normalize_str(japanese) for kana in "がぎぐげごパピプペポヴ")
    assert uncased.normalize_str(chinese).split() == list("中文句子。繁體字與简体字，全角标点！")
    assert uncased.normalize_str(latin) == "cafe naive unicode istanbul angstrom ﬁnance tieng viet"
    assert uncased.normalize_str(others) == (
        "ελληνικα αεη, иод и еж, हिन्दी भाषा, ภาษาไทยนั้น, שָׁלוֹם, العَرَبِيَّة"
    )
    cased = Normalisation(lowercase=False, strip_accents=True).normalizer()
    assert cased.normalize_str(latin) == "Cafe naive Unicode Istanbul Angstrom ﬁnance Tieng Viet"
    assert Normalisation(lowercase=False).normalizer().normalize_str(latin) == latin

    google = Normalisation(accent_marks="all").normalizer()
    reference = normalizers.BertNormalizer(strip_accents=True, lowercase=True)
    for line in WRITTEN:
        assert google.normalize_str(line) == reference.normalize_str(line)
    assert not SYLLABLE.search(google.normalize_str(korean))
    assert len(JAMO.findall(google.normalize_str(korean))) > 2 * len(SYLLABLE.findall(korean))

    # offsets point into the text as given (span answers and word labels depend on them),
    # through decomposition and recomposition alike
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "cafe", "파일", "##을", "が", "##ぎ"]
    line = "Café 파일을 がぎ"
    encoding = build_from_vocab(vocab).encode(line, add_special_tokens=False)
    assert [line[a:b] for a, b in encoding.offsets] == ["Café", "파일", "을", "が", "ぎ"]

    # written into tokenizer.json and read back as it was
    for norm in _settings():
        tok = build_from_vocab(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], normalisation=norm)
        assert Normalisation.of(tok) == norm.resolved()


def test_korean_vocabulary_is_syllables_with_the_korean_and_the_default_recipe(
    gimp_help: Callable[[str], Pages], caplog: pytest.LogCaptureFixture
) -> None:
    """Korean paragraphs of the manual (~230 KB): the Korean recipe's and the default
    recipe's settings learn Hangul syllables and no conjoining jamo, and decode gives each
    Korean word back; Google's stripping learns jamo and says so in one warning."""
    lines = paragraphs(gimp_help("ko"), SYLLABLE, 3000)
    text = "\n".join(lines)
    assert len(text.encode()) > 200_000
    korean = load_config(TokenizerConfig, "tokenizer-ko-cased").normalisation()
    words = [w for line in lines[:300] for w in line.split() if SYLLABLE.fullmatch(w)]
    for norm in (korean, TokenizerConfig().normalisation()):
        tok = train_wordpiece(lines, vocab_size=3000, normalisation=norm)
        vocab = vocab_in_order(tok)
        syllables = [t for t in vocab if SYLLABLE.search(t)]
        assert len(syllables) > 1500 and {"사용", "파일"} <= set(vocab)
        assert not [t for t in vocab if JAMO.search(t)]
        assert {c for t in vocab for c in COMPAT_JAMO.findall(t)} <= set(COMPAT_JAMO.findall(text))
        encodings = tok.encode_batch(words, add_special_tokens=False)
        unknown = tok.token_to_id("[UNK]")
        known = [(w, e) for w, e in zip(words, encodings, strict=True) if unknown not in e.ids]
        assert len(known) > 0.98 * len(words)
        assert all(tok.decode(e.ids) == w for w, e in known)

    with caplog.at_level(logging.WARNING):
        google = train_wordpiece(
            lines, vocab_size=3000, normalisation=Normalisation(accent_marks="all")
        )
    vocab = vocab_in_order(google)
    assert not [t for t in vocab if SYLLABLE.search(t)]
    assert len([t for t in vocab if JAMO.search(t)]) > 1000
    warnings = [r.getMessage() for r in caplog.records if "jamo" in r.getMessage()]
    assert len(warnings) == 1 and "accent_marks=all" in warnings[0]


# --------------------------------------------------------------------------- transformers


def _settings() -> list[Normalisation]:
    """Every combination: lowercase x strip_accents (true, false, null) x
    tokenize_chinese_chars x clean_text, and both kinds of stripping where it strips."""
    out = []
    for lowercase, strip, chinese, clean, marks in itertools.product(
        (True, False), (True, False, None), (True, False), (True, False), ("diacritics", "all")
    ):
        norm = Normalisation(lowercase, strip, marks, chinese, clean)  # type: ignore[arg-type]
        if norm.strips or marks == "diacritics":
            out.append(norm)
    return out


_TRANSFORMERS = """
import json, sys
from transformers import AutoTokenizer
job = json.load(open(sys.argv[1]))
out = {}
for folder in job["folders"]:
    tok = AutoTokenizer.from_pretrained(folder)
    out[folder] = {"class": type(tok).__name__, "single": tok(job["lines"])["input_ids"]}
    if job["pairs"]:
        pairs = tok([a for a, _ in job["pairs"]], [b for _, b in job["pairs"]])
        out[folder]["pairs"] = [pairs["input_ids"], pairs["token_type_ids"]]
json.dump(out, open(sys.argv[2], "w"))
"""


def transformers_ids(
    folders: list[Path], lines: list[str], pairs: list[tuple[str, str]], work: Path
) -> dict[str, dict]:  # type: ignore[type-arg]
    """What ``AutoTokenizer.from_pretrained`` makes of each folder, in a fresh interpreter
    (nothing of bertpipe imported): ids of every line and of every pair with its segments."""
    job, result = work / "job.json", work / "ids.json"
    job.write_text(
        json.dumps({"folders": [str(f) for f in folders], "lines": lines, "pairs": pairs})
    )
    done = subprocess.run(
        [sys.executable, "-c", _TRANSFORMERS, str(job), str(result)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(result.read_text())


def _model_config(folder: Path, family: str, vocab_size: int) -> Path:
    """The config.json ``bertpipe export`` writes for a tiny model of ``family``: its model
    type picks the tokenizer class transformers builds (weights play no part in tokenizing)."""
    from bertpipe.training.models.families import preset_config
    from bertpipe.training.models.hf import hf_config_dict

    architecture = "ModernBertForMaskedLM" if family == "modernbert" else "BertForPreTraining"
    config = hf_config_dict(preset_config(family, "tiny", vocab_size), architecture)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder / "config.json"


def _hf_folder(folder: Path, config: Path, files: dict[str, bytes]) -> Path:
    """An exported model's folder as far as ``AutoTokenizer`` reads it: ``config`` and the
    tokenizer files."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_bytes(config.read_bytes())
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def test_transformers_gives_bertpipe_ids_for_every_normaliser_setting(
    gimp_help: Callable[[str], Pages], tmp_path: Path
) -> None:
    """36 settings, each a folder as ``bertpipe export`` writes it (with a BERT's and with a
    ModernBERT's config.json), loaded by ``AutoTokenizer`` in a clean interpreter: the same
    ids on every line of Korean, Japanese, Chinese and English text and the lines written
    here, pairs with their segment ids too. The folder of the old writer (``do_lower_case``
    without ``strip_accents``) gives other ids on Korean lines: the comparison sees the bug
    this fixed."""
    texts = four_languages(gimp_help, 40)
    lines = [line for group in texts.values() for line in group] + WRITTEN
    pairs = [(texts["ko"][i], texts["ja"][i]) for i in range(10)]
    # one vocabulary for all: the union of those learnt with cased, uncased and Google's
    # normalisation, so every setting finds its pieces (and [UNK] stays rare)
    vocab: list[str] = []
    for norm in (
        Normalisation(lowercase=False),
        Normalisation(),
        Normalisation(accent_marks="all"),
    ):
        tok = train_wordpiece(lines, vocab_size=1500, normalisation=norm, limit_alphabet=5000)
        vocab += vocab_in_order(tok)
    vocab = list(dict.fromkeys(vocab))
    config = _model_config(tmp_path / "bert", "bert", len(vocab))
    modern = _model_config(tmp_path / "modernbert", "modernbert", len(vocab))

    settings = _settings()
    assert len(settings) == 36
    tokenizers, folders, modern_folders = [], [], []
    for i, norm in enumerate(settings):
        tok = build_from_vocab(vocab, normalisation=norm)
        tokenizers.append(tok)
        folders.append(_hf_folder(tmp_path / f"s{i}", config, tokenizer_files(tok)))
        modern_folders.append(_hf_folder(tmp_path / f"m{i}", modern, tokenizer_files(tok)))
    # the old writer's folder: lower-cased, accents kept, strip_accents left out
    kept = settings.index(Normalisation(lowercase=True, strip_accents=False))
    old = _hf_folder(tmp_path / "old", config, tokenizer_files(tokenizers[kept]))
    old_config = json.loads((old / "tokenizer_config.json").read_text())
    for key in ("strip_accents", "accent_marks", "tokenize_chinese_chars", "clean_text"):
        old_config.pop(key)
    (old / "tokenizer_config.json").write_text(json.dumps(old_config))

    theirs = transformers_ids([*folders, *modern_folders, old], lines, pairs, tmp_path)
    unknown = tokenizers[0].token_to_id("[UNK]")
    for norm, tok, folder, modern_folder in zip(
        settings, tokenizers, folders, modern_folders, strict=True
    ):
        mine = [e.ids for e in tok.encode_batch(lines)]
        both = tok.encode_batch(pairs)
        for where in (folder, modern_folder):
            got = theirs[str(where)]
            differ = [x for x, a, b in zip(lines, mine, got["single"], strict=True) if a != b]
            assert not differ, (norm, where.name, got["class"], differ[:3])
            assert got["pairs"] == [[e.ids for e in both], [e.type_ids for e in both]], norm
        expected = "BertTokenizer" if norm.is_bert_normalizer else "TokenizersBackend"
        assert theirs[str(folder)]["class"] == expected, norm
        if not norm.decomposes_hangul and norm.clean_text and norm.tokenize_chinese_chars:
            korean = [i for e in mine[: len(texts["ko"])] for i in e]
            assert korean.count(unknown) < 0.01 * len(korean), norm

    broken = theirs[str(old)]["single"]
    mine = [e.ids for e in tokenizers[kept].encode_batch(texts["ko"])]
    assert sum(a != b for a, b in zip(mine, broken, strict=False)) > 0.9 * len(mine)


def test_a_folder_of_vocab_txt_and_tokenizer_config_is_read_as_transformers_reads_it(
    gimp_help: Callable[[str], Pages], tmp_path: Path
) -> None:
    """A transformers folder without tokenizer.json (vocab.txt and tokenizer_config.json, as
    fine-tuning may be given one): bertpipe builds the normaliser transformers would, from
    the config's settings, not its own default."""
    lines = paragraphs(gimp_help("ko"), SYLLABLE, 200) + WRITTEN
    cased = train_wordpiece(lines, vocab_size=1500, normalisation=Normalisation(lowercase=False))
    save_tokenizer(cased, str(tmp_path / "full"))
    folder = tmp_path / "hf"
    folder.mkdir()
    for name in ("vocab.txt", "tokenizer_config.json"):
        (folder / name).write_bytes((tmp_path / "full" / name).read_bytes())
    loaded = load_tokenizer(str(folder))
    assert Normalisation.of(loaded) == Normalisation(lowercase=False, strip_accents=False)
    assert [e.ids for e in loaded.encode_batch(lines)] == [e.ids for e in cased.encode_batch(lines)]
    # a transformers folder that leaves strip_accents out: Google's stripping, as there
    (folder / "tokenizer_config.json").write_text('{"do_lower_case": true}')
    google = Normalisation.of(load_tokenizer(str(folder)))
    assert google == Normalisation(lowercase=True, strip_accents=True, accent_marks="all")
    with pytest.raises(TokenizerMismatchError, match="lower-cases"):
        save_tokenizer(
            build_from_vocab(vocab_in_order(cased)), str(tmp_path / "x"), lowercase=False
        )
