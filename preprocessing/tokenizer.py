"""The BERT WordPiece tokenizer: trained with HF ``tokenizers`` or built from a ``vocab.txt``.

A tokenizer folder holds ``tokenizer.json`` (the full HF tokenizer, the source of truth),
``vocab.txt`` (one token per line in id order, the Google/HF format) and
``tokenizer_config.json`` (what ``transformers.AutoTokenizer`` reads: every normaliser
setting, so that it gives exactly bertpipe's ids; see :func:`tokenizer_files`). Special
token ids are whatever the vocabulary says: a trained vocabulary puts them first, Google's
uncased one at 0 and 100-103, so every consumer reads them through :class:`SpecialTokens`,
never as constants.

Normalisation (:class:`Normalisation`) never damages a script: accent stripping removes the
combining diacritical marks of Latin, Greek and Cyrillic and recomposes what is left (NFC),
so Hangul syllables, kana voicing marks and the vowel signs of Indic, Thai, Arabic or
Hebrew text stay whole. Google BERT's own stripping (every nonspacing mark after NFD, no
recomposition: Hangul comes out as conjoining jamo) is ``accent_marks="all"``, kept to
reproduce Google's uncased vocabularies.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import (
    Tokenizer,
    models,
    processors,
)
from tokenizers.trainers import WordPieceTrainer

from bertpipe import fsio
from bertpipe.errors import BertpipeError
from bertpipe.preprocessing.normalisation import (
    _HANGUL,
    DIACRITICS,
    Normalisation,
    _configure,
)

log = logging.getLogger(__name__)

__all__ = [
    "DIACRITICS",
    "MAX_WORD_CHARS",
    "SPECIAL_TOKENS",
    "CorpusEncoder",
    "Normalisation",
    "SpecialTokens",
    "TokenizerMismatchError",
    "build_from_vocab",
    "load_tokenizer",
    "sample_statistics",
    "save_tokenizer",
    "tokenizer_checksum",
    "tokenizer_files",
    "train_wordpiece",
]

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")

MAX_WORD_CHARS = 100
"""WordPiece's ``max_input_chars_per_word``: a longer word is encoded as ``[UNK]``, so the
trainer is never shown one (its merges are quadratic in word length: one 300,000-letter word
took 37 s)."""
# the start of a whitespace-free run longer than any usable word (anchored at the run's start
# so the scan stays linear)
_LONG_RUN = re.compile(rf"(?<!\S)\S{{{MAX_WORD_CHARS + 1}}}")


class TokenizerMismatchError(BertpipeError, ValueError):
    """The tokenizer is not usable for BERT data (missing specials, inconsistent files)."""


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of BERT's special tokens, read from a tokenizer."""

    pad: int
    unk: int
    cls: int
    sep: int
    mask: int

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, source: str = "tokenizer") -> SpecialTokens:
        ids = {}
        for name, token in zip(("pad", "unk", "cls", "sep", "mask"), SPECIAL_TOKENS, strict=True):
            tid = tokenizer.token_to_id(token)
            if tid is None:
                raise TokenizerMismatchError(
                    f"{source} has no {token} token: BERT data needs {', '.join(SPECIAL_TOKENS)}"
                )
            ids[name] = tid
        return cls(**ids)

    def all(self) -> tuple[int, ...]:
        return (self.pad, self.unk, self.cls, self.sep, self.mask)


def _add_post_processor(tokenizer: Tokenizer) -> Tokenizer:
    cls_id = tokenizer.token_to_id("[CLS]")
    sep_id = tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return tokenizer


def train_wordpiece(
    texts: Callable[[], Iterable[str]] | Sequence[str],
    *,
    vocab_size: int = 30522,
    lowercase: bool = True,
    strip_accents: bool | None = None,
    normalisation: Normalisation | None = None,
    min_frequency: int = 2,
    limit_alphabet: int = 1000,
    special_tokens: Iterable[str] = SPECIAL_TOKENS,
    counts: Counter[str] | None = None,
) -> Tokenizer:
    """Train a BERT WordPiece vocabulary on ``texts`` (sentences or paragraphs).

    Words (after normalisation and pre-tokenisation) longer than :data:`MAX_WORD_CHARS`
    characters are left out of both passes: the tokenizer encodes them as ``[UNK]`` whatever
    the vocabulary, and the trainer's time grows with the square of a word's length. They are
    counted (``words_too_long``, added to ``counts`` when given) and logged.

    ``texts`` is a sequence or a function returning a fresh iterable: it is read twice.
    The special tokens get the first ids, then the ``##`` continuation of every alphabet
    character, then the alphabet, then the learnt pieces. ``normalisation``, when given,
    replaces ``lowercase`` and ``strip_accents``; with Google's accent stripping
    (``accent_marks="all"``) a sample holding Hangul gets one warning (its syllables are
    learnt as conjoining jamo).

    Deterministic for the same texts in the same order. ``tokenizers``' trainer on its own
    is not (huggingface/tokenizers#1794): it numbers the ``##x`` pieces in hash-map order
    and breaks ties between equally frequent merges by those numbers. Here a first pass
    counts the characters of the normalised text, and the chosen alphabet and its ``##``
    pieces are handed to the trainer up front (the pieces as special tokens, so they get
    fixed ids); the tokenizer is then rebuilt from the vocabulary with only BERT's five
    specials as added tokens.
    """
    specials = list(special_tokens)
    missing = [t for t in SPECIAL_TOKENS if t not in specials]
    if missing:
        raise TokenizerMismatchError(f"special_tokens must include {', '.join(missing)}")
    source = texts if callable(texts) else (lambda: texts)
    norm = normalisation or Normalisation(lowercase=lowercase, strip_accents=strip_accents)
    tokenizer = _configure(
        Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=MAX_WORD_CHARS)),
        norm,
    )
    # a separate tokenizer for the filter: the one being trained is locked while it reads
    probe = _configure(Tokenizer(models.WordPiece(unk_token="[UNK]")), norm)
    dropped: Counter[str] = Counter()

    def read() -> Iterator[str]:  # each pass counts afresh: the second one is reported
        dropped.clear()
        return _without_long_words(source(), probe, dropped)

    hangul = Counter[str]() if norm.decomposes_hangul else None
    alphabet = _alphabet(tokenizer, read(), limit_alphabet, hangul)
    if hangul:
        log.warning(
            "tokenizer: Google's accent stripping (accent_marks=all) decomposed %d Hangul "
            "syllable(s) of the sample into conjoining jamo: the vocabulary is learnt in jamo, "
            "not syllables; leave accent_marks at diacritics (the default) or set "
            "strip_accents=false",
            hangul["syllables"],
        )
    pieces = [f"##{c}" for c in alphabet if f"##{c}" not in specials]
    trainer = WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials + pieces,
        limit_alphabet=len(alphabet),
        initial_alphabet=alphabet,
        continuing_subword_prefix="##",
        show_progress=False,
    )
    tokenizer.train_from_iterator(read(), trainer=trainer)
    if dropped:
        log.warning(
            "%d word(s) longer than %d characters in %d text(s) were not used to train the "
            "vocabulary (the tokenizer encodes such words as [UNK])",
            dropped["words_too_long"],
            MAX_WORD_CHARS,
            dropped["texts_with_words_too_long"],
        )
        if counts is not None:
            counts.update(dropped)
    return build_from_vocab(vocab_in_order(tokenizer), normalisation=norm)


def _without_long_words(
    texts: Iterable[str], tokenizer: Tokenizer, dropped: Counter[str]
) -> Iterator[str]:
    """``texts`` with every word longer than :data:`MAX_WORD_CHARS` removed.

    A text without such a word is passed on unchanged; one with is replaced by its normalised,
    pre-tokenised words joined by spaces, which the trainer normalises and pre-tokenises into
    the same words again.
    """
    normalizer, pre_tokenizer = tokenizer.normalizer, tokenizer.pre_tokenizer
    for text in texts:
        if _LONG_RUN.search(text) is None:
            yield text
            continue
        normalized = normalizer.normalize_str(text) if normalizer else text
        words = [w for w, _ in pre_tokenizer.pre_tokenize_str(normalized)]
        kept = [w for w in words if len(w) <= MAX_WORD_CHARS]
        if len(kept) == len(words):
            yield text
            continue
        dropped["words_too_long"] += len(words) - len(kept)
        dropped["texts_with_words_too_long"] += 1
        if kept:
            yield " ".join(kept)


def _alphabet(
    tokenizer: Tokenizer, texts: Iterable[str], limit: int, hangul: Counter[str] | None = None
) -> list[str]:
    """The ``limit`` most frequent characters of the normalised texts (ties by character).
    ``hangul``: count the Hangul syllables of the texts (before normalisation) into it."""
    counts: Counter[str] = Counter()
    normalizer = tokenizer.normalizer
    for batch in batched(texts, 4096):
        joined = "\n".join(batch)
        if hangul is not None:
            hangul["syllables"] += len(_HANGUL.findall(joined))
        normalized = normalizer.normalize_str(joined) if normalizer else joined
        counts.update(normalized)
    for space in (" ", "\n", "\t", "\r"):
        counts.pop(space, None)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return sorted(c for c, _ in ranked[:limit] if not c.isspace())


def sample_statistics(
    texts: Iterable[str],
    *,
    lowercase: bool = True,
    strip_accents: bool | None = None,
    normalisation: Normalisation | None = None,
) -> tuple[Counter[str], set[str]]:
    """The words of ``texts`` as the trainer sees them (BERT's normaliser, then its
    pre-tokeniser: white space and punctuation split, a CJK ideograph is a word of its own)
    with their counts, and the distinct characters among them: what a vocabulary learned
    from ``texts`` is made of."""
    norm = normalisation or Normalisation(lowercase=lowercase, strip_accents=strip_accents)
    probe = _configure(Tokenizer(models.WordPiece(unk_token="[UNK]")), norm)
    normalizer, pre_tokenizer = probe.normalizer, probe.pre_tokenizer
    words: Counter[str] = Counter()
    for batch in batched(texts, 4096):
        text = normalizer.normalize_str("\n".join(batch)) if normalizer else "\n".join(batch)
        words.update(word for word, _ in pre_tokenizer.pre_tokenize_str(text))
    return words, {c for word in words for c in word}


def build_from_vocab(
    vocab: Iterable[str],
    *,
    lowercase: bool = True,
    strip_accents: bool | None = None,
    normalisation: Normalisation | None = None,
) -> Tokenizer:
    """A BERT tokenizer over an existing vocabulary (e.g. Google's 30,522-token ``vocab.txt``).
    ``normalisation``, when given, replaces ``lowercase`` and ``strip_accents``."""
    table: dict[str, int] = {}
    for token in vocab:
        if token in table:
            raise TokenizerMismatchError(f"vocabulary lists {token!r} twice")
        table[token] = len(table)
    missing = [t for t in SPECIAL_TOKENS if t not in table]
    if missing:
        raise TokenizerMismatchError(
            f"vocabulary has no {', '.join(missing)}: BERT needs {', '.join(SPECIAL_TOKENS)}"
        )
    tokenizer = _configure(
        Tokenizer(
            models.WordPiece(table, unk_token="[UNK]", max_input_chars_per_word=MAX_WORD_CHARS)
        ),
        normalisation or Normalisation(lowercase=lowercase, strip_accents=strip_accents),
    )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return _add_post_processor(tokenizer)


def read_vocab_txt(url: str) -> list[str]:
    """Tokens of a ``vocab.txt`` in id order (one per line, trailing newline stripped)."""
    with fsio.open_url(url, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n").rstrip("\r") for line in f if line.strip("\r\n")]


def vocab_in_order(tokenizer: Tokenizer) -> list[str]:
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    ordered = [""] * len(vocab)
    for token, idx in vocab.items():
        if idx >= len(ordered) or ordered[idx]:
            raise TokenizerMismatchError("tokenizer ids are not contiguous from 0")
        ordered[idx] = token
    return ordered


def tokenizer_files(tokenizer: Tokenizer, *, model_max_length: int = 512) -> dict[str, bytes]:
    """``vocab.txt``, ``tokenizer.json`` and ``tokenizer_config.json`` of ``tokenizer``
    (name -> bytes), written from the tokenizer itself, so the three always agree.

    ``tokenizer_config.json`` spells out every normaliser setting
    (:meth:`Normalisation.transformers_config`): transformers' ``BertTokenizer`` rebuilds
    its normaliser from these settings and ignores the one in ``tokenizer.json``, taking
    defaults for any it does not find. A normaliser it cannot rebuild (bertpipe's accent
    stripping, text not cleaned, or one bertpipe does not know) is named
    ``PreTrainedTokenizerFast``, which loads ``tokenizer.json`` as it is.
    """
    norm = Normalisation.of(tokenizer)
    normaliser = (
        norm.transformers_config()
        if norm is not None
        else {"tokenizer_class": "PreTrainedTokenizerFast"}
    )
    config = {
        **normaliser,
        "model_max_length": model_max_length,
        "model_input_names": ["input_ids", "token_type_ids", "attention_mask"],
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "mask_token": "[MASK]",
    }
    return {
        "vocab.txt": ("\n".join(vocab_in_order(tokenizer)) + "\n").encode("utf-8"),
        "tokenizer.json": tokenizer.to_str(pretty=True).encode("utf-8"),
        "tokenizer_config.json": (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode(
            "utf-8"
        ),
    }


def save_tokenizer(tokenizer: Tokenizer, folder: str, *, lowercase: bool | None = None) -> None:
    """Write ``tokenizer.json``, ``vocab.txt`` and ``tokenizer_config.json`` into ``folder``
    (:func:`tokenizer_files`). ``lowercase``, if given, must be what the tokenizer does."""
    if lowercase is not None:
        norm = Normalisation.of(tokenizer)
        if norm is not None and norm.lowercase != lowercase:
            raise TokenizerMismatchError(
                f"the tokenizer {'lower-cases' if norm.lowercase else 'keeps the case'} but "
                f"lowercase={lowercase} was asked for: rebuild it with that setting"
            )
    for name, data in tokenizer_files(tokenizer).items():
        fsio.atomic_write_text(fsio.join(folder, name), data.decode("utf-8"))


def load_tokenizer(location: str, *, lowercase: bool = True) -> Tokenizer:
    """Load a tokenizer folder (``tokenizer.json`` preferred), a tokenizer.json or a vocab.txt.

    A bare ``vocab.txt`` gets bertpipe's normalisation, uncased as ``lowercase`` says; one in
    a folder with a ``tokenizer_config.json`` (a transformers folder without
    ``tokenizer.json``) gets what transformers' ``BertTokenizer`` makes of that file. When a
    folder holds both files they must agree token for token.
    """
    if location.endswith(".json"):
        return _load_json(location)
    if location.endswith(".txt"):
        return build_from_vocab(read_vocab_txt(location), lowercase=lowercase)
    json_url = fsio.join(location, "tokenizer.json")
    vocab_url = fsio.join(location, "vocab.txt")
    has_json, has_vocab = fsio.exists(json_url), fsio.exists(vocab_url)
    if not has_json and not has_vocab:
        raise FileNotFoundError(
            f"tokenizer {location} holds neither tokenizer.json nor vocab.txt: "
            "run `bertpipe tokenizer train` or point at a vocab.txt"
        )
    if not has_json:
        config_url = fsio.join(location, "tokenizer_config.json")
        norm = Normalisation(lowercase=lowercase)
        if fsio.exists(config_url):
            with fsio.open_url(config_url, "rb") as f:
                config = fsio.parse_json(f.read(), config_url, "fix or remove it")
            if isinstance(config, dict):
                norm = Normalisation.from_transformers(config)
        return build_from_vocab(read_vocab_txt(vocab_url), normalisation=norm)
    tokenizer = _load_json(json_url)
    if has_vocab and read_vocab_txt(vocab_url) != vocab_in_order(tokenizer):
        raise TokenizerMismatchError(
            f"{vocab_url} does not match {json_url}: rewrite both with `bertpipe tokenizer train`"
        )
    return tokenizer


def _load_json(url: str) -> Tokenizer:
    with fsio.open_url(url, "rt", encoding="utf-8") as f:
        text = f.read()
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:
        raise TokenizerMismatchError(f"{url} is not a tokenizers JSON file: {exc}") from None
    SpecialTokens.from_tokenizer(tokenizer, url)
    return tokenizer


def tokenizer_checksum(tokenizer: Tokenizer) -> str:
    """sha256 of the tokenizer's canonical JSON: two tokenizers that encode alike share it."""
    canonical = json.dumps(json.loads(tokenizer.to_str()), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class CorpusEncoder:
    """Encodes corpus sentences to ids without special tokens, fast.

    Special tokens written literally in the text (``"[MASK]"`` in a document about BERT)
    are encoded as ordinary text, never as the special ids: sentences that contain one are
    re-encoded by a copy with ``encode_special_tokens`` set, which is slower, so it is only
    used where needed.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._plain = Tokenizer.from_str(tokenizer.to_str())
        self._plain.no_truncation()
        self._plain.no_padding()
        self._literal = Tokenizer.from_str(tokenizer.to_str())
        self._literal.no_truncation()
        self._literal.no_padding()
        self._literal.encode_special_tokens = True
        self._specials = [t for t in SPECIAL_TOKENS if tokenizer.token_to_id(t) is not None]
        self._batch = getattr(self._plain, "encode_batch_fast", self._plain.encode_batch)
        self._ascii_batch = self._ascii_encoder(tokenizer)

    @staticmethod
    def _ascii_encoder(tokenizer: Tokenizer) -> Callable[..., list[Any]] | None:
        """The batch encoder of a copy whose normaliser is the ``BertNormalizer`` step alone,
        for ASCII sentences, where the steps after it that strip :data:`DIACRITICS` (NFD,
        the marks' removal, NFC) change nothing: they are a third of the normaliser's work
        and 10-15% of the job's on English text. None where the tokenizer has no such
        steps (Google's normaliser, cased, or a tokenizer.json from elsewhere)."""
        norm = Normalisation.of(tokenizer)
        if norm is None or not norm.strips or norm.accent_marks != "diacritics":
            return None
        state = json.loads(tokenizer.to_str())
        steps = state["normalizer"]["normalizers"]
        if [step.get("type") for step in steps] != ["BertNormalizer", "NFD", "Replace", "NFC"]:
            return None
        state["normalizer"] = steps[0]
        fast = Tokenizer.from_str(json.dumps(state))
        fast.no_truncation()
        fast.no_padding()
        return getattr(fast, "encode_batch_fast", fast.encode_batch)

    def encode(self, sentences: list[str]) -> list[list[int]]:
        """Token ids of each sentence, [len(sentences)] lists."""
        if not sentences:
            return []
        fast = self._ascii_batch
        if fast is None:
            ids = [e.ids for e in self._batch(sentences, add_special_tokens=False)]
        elif all(s.isascii() for s in sentences):
            ids = [e.ids for e in fast(sentences, add_special_tokens=False)]
        else:
            ascii_at = [i for i, s in enumerate(sentences) if s.isascii()]
            other_at = [i for i, s in enumerate(sentences) if not s.isascii()]
            ids = [[] for _ in sentences]
            for at, encode in ((ascii_at, fast), (other_at, self._batch)):
                if at:
                    encodings = encode([sentences[i] for i in at], add_special_tokens=False)
                    for i, e in zip(at, encodings, strict=True):
                        ids[i] = e.ids
        joined = "\n".join(sentences)
        if any(t in joined for t in self._specials):
            for i, sentence in enumerate(sentences):
                if any(t in sentence for t in self._specials):
                    ids[i] = self._literal.encode(sentence, add_special_tokens=False).ids
        return ids


def batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    """Lists of up to ``size`` consecutive items."""
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
