"""The ``quality.*`` section of the preprocessing config: Gopher's document filters,
decontamination against the evaluation sets, exact and near-duplicate removal (what each does:
docs/corpus-quality.md)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal

from bertpipe.config import ConfigError

log = logging.getLogger(__name__)


GOPHER = {
    "min_words": 50,
    "max_words": 100_000,
    "min_mean_word_length": 3.0,
    "max_mean_word_length": 10.0,
    "min_alpha_words": 0.8,
    "max_symbol_ratio": 0.1,
    "max_ellipsis_lines": 0.3,
    "max_duplicate_lines": 0.3,
}
"""Gopher's thresholds (Rae et al. 2021, appendix A.1.1), the values ``filters.gopher``
sets."""


@dataclass
class FilterConfig:
    """Heuristic document filters (each off while null). Words here are the text's white-space
    separated tokens and lines the document's sentences as read (a line each in the
    ``sentences`` format), as Gopher counts them."""

    gopher: bool = False
    """Set every filter left null to Gopher's threshold: 50-100,000 words, mean word length
    3-10, 80% of words with a letter, '#' and ellipses at most 0.1 per word, at most 30% of
    lines ending in an ellipsis, at most 30% of lines repeating an earlier line."""
    min_words: int | None = None
    """Fewer words: removed (``filter_min_words``)."""
    max_words: int | None = None
    """More words: removed (``filter_max_words``)."""
    min_mean_word_length: float | None = None
    """Mean characters per word below this: removed."""
    max_mean_word_length: float | None = None
    """Mean characters per word above this: removed."""
    min_alpha_words: float | None = None
    """Share of words holding at least one letter below this: removed."""
    max_symbol_ratio: float | None = None
    """'#' per word, or ellipses ('...', '…') per word, above this: removed."""
    max_ellipsis_lines: float | None = None
    """Share of lines ending in an ellipsis above this: removed."""
    max_duplicate_lines: float | None = None
    """Share of lines that repeat an earlier line of the document above this: removed."""

    def __post_init__(self) -> None:
        if self.gopher:
            for key, value in GOPHER.items():
                if getattr(self, key) is None:
                    setattr(self, key, value)
        for key in GOPHER:
            value = getattr(self, key)
            if value is not None and value < 0:
                raise ConfigError(key, "must not be negative (or null: off)")

    @property
    def enabled(self) -> bool:
        return any(getattr(self, key) is not None for key in GOPHER)


@dataclass
class DecontaminationConfig:
    """Removal of the evaluation sets' text from the corpus."""

    paths: list[str] = field(default_factory=list)
    """Evaluation files or task folders (what fine-tuning and evaluation read): GLUE-style
    ``.tsv`` (every text cell), SQuAD ``.json`` (contexts, questions, answers), CoNLL files
    (``.conll``, ``.txt``, ``.iob``: the first column's tokens, a sentence per block). Empty:
    off. Each file is an evaluation set, named by its path below the folder given."""
    ngram: int = 13
    """Words per n-gram: a document sharing one n-gram with an evaluation text is
    contaminated (13, as GPT-3's check)."""
    min_ngram: int = 8
    """Evaluation texts shorter than ``ngram`` words count whole down to this many words
    (GPT-3 lowered n to 8 for short examples); shorter ones are not checked."""
    scope: Literal["document", "sentences"] = "document"
    """``document``: a contaminated document is removed; ``sentences``: only its sentences
    an overlapping n-gram touches are (the rest of the document stays)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.ngram:
            raise ConfigError("min_ngram", "must be between 1 and ngram")

    @property
    def enabled(self) -> bool:
        return bool(self.paths)


@dataclass
class DedupConfig:
    """Exact and near-duplicate removal across the whole corpus (both splits)."""

    exact: bool = False
    """Remove documents whose normalised text (their words, see above) equals an earlier
    document's."""
    near: bool = False
    """Remove near-duplicates: documents whose word shingles' Jaccard similarity with
    another's is at least ``threshold``, transitively; one per cluster is kept."""
    threshold: float = 0.8
    """Jaccard similarity of shingle sets (0.8: Lee et al. 2022, "Deduplicating Training Data
    Makes Language Models Better", and NeMo Curator's default)."""
    shingle_words: int = 5
    """Words per shingle (5: Lee et al. 2022, datatrove). Documents with fewer words take
    part in exact deduplication only."""
    num_perm: int = 256
    """MinHash bins (a power of two). Candidates are verified on the signatures' estimate,
    whose standard deviation is ``sqrt(J (1 - J) / num_perm)``: 0.025 at 0.8 with 256."""
    bands: int = 20
    """LSH bands of ``rows`` bins each: a pair is a candidate when one band agrees, with
    probability ``1 - (1 - J**rows)**bands`` (20 x 6: 0.998 at J 0.8, 0.27 at 0.5)."""
    rows: int = 6

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigError("threshold", "must be in (0, 1]")
        if self.shingle_words < 1:
            raise ConfigError("shingle_words", "must be at least 1")
        if self.num_perm < 16 or self.num_perm & (self.num_perm - 1):
            raise ConfigError("num_perm", "must be a power of two, at least 16")
        if self.bands < 1 or self.rows < 1 or self.bands * self.rows > self.num_perm:
            raise ConfigError("bands", "bands x rows must be at most num_perm")

    @property
    def enabled(self) -> bool:
        return self.exact or self.near


@dataclass
class QualityConfig:
    """What the job removes from the corpus before making instances (all off by default)."""

    filters: FilterConfig = field(default_factory=FilterConfig)
    decontaminate: DecontaminationConfig = field(default_factory=DecontaminationConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    samples: int = 20
    """Removed documents kept for review per reason (``<output>/quality/<reason>.jsonl``),
    chosen by a stable hash of their ids."""

    def __post_init__(self) -> None:
        if self.samples < 0:
            raise ConfigError("samples", "must not be negative")

    @property
    def enabled(self) -> bool:
        return self.filters.enabled or self.decontaminate.enabled or self.dedup.enabled
