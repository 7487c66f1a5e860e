"""The normaliser of bertpipe's tokenizers: lower-casing, accent stripping that only ever removes
the combining marks of scripts that have them (Hangul, kana, Indic and Thai marks stay whole),
Chinese characters as words, and what ``tokenizer_config.json`` says of it so that
transformers rebuilds the same normaliser."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Literal

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    normalizers,
    pre_tokenizers,
)

log = logging.getLogger(__name__)


DIACRITICS = "[\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f]"
"""The marks that ``strip_accents`` removes (by default): Unicode's combining diacritical
mark blocks (Combining Diacritical Marks, its Extended and Supplement blocks, those for
symbols, half marks), the accents of Latin, Greek and Cyrillic letters after canonical
decomposition. A script's own marks (kana voicing, Indic/Thai vowel signs and viramas,
Arabic and Hebrew points) are outside them."""


_HANGUL = re.compile("[\uac00-\ud7a3]")


@dataclass(frozen=True)
class Normalisation:
    """What a BERT tokenizer does to text before splitting it into words.

    Built into ``tokenizer.json`` (:meth:`normalizer`), read back from one (:meth:`of`) and
    written into ``tokenizer_config.json`` (:meth:`transformers_config`), so that every
    reader of a tokenizer folder normalises alike.
    """

    lowercase: bool = True
    """Lower-case the text (an uncased model)."""
    strip_accents: bool | None = None
    """Remove accents; null follows ``lowercase``, as BERT does."""
    accent_marks: Literal["diacritics", "all"] = "diacritics"
    """Which marks accent stripping removes: ``diacritics`` (:data:`DIACRITICS` after NFD,
    then NFC: ``é`` -> ``e``, Hangul syllables and every script's own marks kept) or
    ``all`` (Google BERT's and ``tokenizers``' ``BertNormalizer``: every nonspacing mark
    after NFD, nothing recomposed: Hangul becomes conjoining jamo, ``が`` becomes ``か``,
    Devanagari and Thai lose their vowel signs)."""
    tokenize_chinese_chars: bool = True
    """Put spaces around every CJK ideograph (Chinese, and the kanji and hanja of Japanese
    and Korean text), so each is a word of its own."""
    clean_text: bool = True
    """Drop control characters and turn every white space into a plain space."""

    @property
    def strips(self) -> bool:
        """Whether accents are stripped (``strip_accents`` resolved)."""
        return self.lowercase if self.strip_accents is None else self.strip_accents

    def resolved(self) -> Normalisation:
        """The same normalisation with ``strip_accents`` spelled out (and ``accent_marks`` at
        its default when nothing is stripped): what :meth:`of` reads back."""
        return dataclasses.replace(
            self,
            strip_accents=self.strips,
            accent_marks=self.accent_marks if self.strips else "diacritics",
        )

    @property
    def decomposes_hangul(self) -> bool:
        """Whether Hangul syllables come out as conjoining jamo (Google's stripping)."""
        return self.strips and self.accent_marks == "all"

    def normalizer(self) -> normalizers.Normalizer:
        """The ``tokenizers`` normaliser: a ``BertNormalizer``, followed, when ``diacritics``
        are stripped, by NFD, the removal of :data:`DIACRITICS` and NFC."""
        google = self.accent_marks == "all"
        bert = normalizers.BertNormalizer(
            clean_text=self.clean_text,
            handle_chinese_chars=self.tokenize_chinese_chars,
            strip_accents=self.strips and google,
            lowercase=self.lowercase,
        )
        if not self.strips or google:
            return bert
        return normalizers.Sequence(
            [
                bert,
                normalizers.NFD(),
                normalizers.Replace(Regex(DIACRITICS), ""),
                normalizers.NFC(),
            ]
        )

    @property
    def is_bert_normalizer(self) -> bool:
        """Whether transformers' ``BertTokenizer`` rebuilds this normaliser from
        ``tokenizer_config.json`` (it always cleans text, and strips Google's way)."""
        return self.clean_text and (not self.strips or self.accent_marks == "all")

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> Normalisation | None:
        """The normalisation of ``tokenizer`` (None for a normaliser bertpipe does not build:
        a tokenizer.json from elsewhere)."""
        state = json.loads(tokenizer.to_str()).get("normalizer")
        return cls.from_json(state) if isinstance(state, dict) else None

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> Normalisation | None:
        """The normalisation of a ``tokenizer.json`` ``normalizer`` entry, or None."""
        steps = state.get("normalizers") if state.get("type") == "Sequence" else [state]
        if not isinstance(steps, list) or not steps or steps[0].get("type") != "BertNormalizer":
            return None
        bert = steps[0]
        lowercase = bool(bert.get("lowercase", True))
        google_strip = bert.get("strip_accents")
        google_strip = lowercase if google_strip is None else bool(google_strip)
        common = {
            "lowercase": lowercase,
            "tokenize_chinese_chars": bool(bert.get("handle_chinese_chars", True)),
            "clean_text": bool(bert.get("clean_text", True)),
        }
        if len(steps) == 1:
            marks = "all" if google_strip else "diacritics"
            return cls(strip_accents=google_strip, accent_marks=marks, **common)
        tail = [step.get("type") for step in steps[1:]]
        pattern = (steps[2].get("pattern") or {}).get("Regex") if len(steps) > 2 else None
        if (
            google_strip
            or tail != ["NFD", "Replace", "NFC"]
            or pattern != DIACRITICS
            or steps[2].get("content") != ""
        ):
            return None
        return cls(strip_accents=True, accent_marks="diacritics", **common)

    @classmethod
    def from_transformers(cls, config: dict[str, Any]) -> Normalisation:
        """What transformers' ``BertTokenizer`` makes of a ``tokenizer_config.json``: its
        normaliser is Google's (``BertNormalizer``, text always cleaned)."""
        strip = config.get("strip_accents")
        return cls(
            lowercase=bool(config.get("do_lower_case", True)),
            strip_accents=None if strip is None else bool(strip),
            accent_marks="all",
            tokenize_chinese_chars=bool(config.get("tokenize_chinese_chars", True)),
            clean_text=True,
        ).resolved()

    def transformers_config(self) -> dict[str, Any]:
        """The normaliser's entries of ``tokenizer_config.json``: every setting, explicit.
        A normaliser that ``BertTokenizer`` rebuilds from them exactly is named
        ``BertTokenizer``; any other is ``PreTrainedTokenizerFast``, which transformers
        loads from ``tokenizer.json`` as it is (``BertTokenizer`` would rebuild Google's
        normaliser from these settings and strip Hangul into jamo, or keep control
        characters it should not)."""
        return {
            "tokenizer_class": (
                "BertTokenizer" if self.is_bert_normalizer else "PreTrainedTokenizerFast"
            ),
            "do_lower_case": self.lowercase,
            "strip_accents": self.strips,
            "accent_marks": self.accent_marks,
            "tokenize_chinese_chars": self.tokenize_chinese_chars,
            "clean_text": self.clean_text,
        }


def _configure(tokenizer: Tokenizer, normalisation: Normalisation) -> Tokenizer:
    """Give a WordPiece model BERT's normaliser, pre-tokeniser, decoder and post-processor."""
    tokenizer.normalizer = normalisation.normalizer()
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return tokenizer
