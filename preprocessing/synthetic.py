"""A deterministic synthetic corpus of any size, for scale benchmarks and tests.

Text in the ``sentences`` layout (a sentence per line, a blank line between documents)
shaped like an encyclopedia: a Zipfian vocabulary (exponent 1.1) of pronounceable made-up
words, whose frequent words are short; sentence lengths log-normal around 22 words;
document lengths log-normal around 25 sentences with a long tail (a few hundred), and some
one-sentence stubs that the recipe drops, as a Wikipedia dump has. The same ``seed`` and
size give the same bytes on every machine (NumPy's PCG64 stream), so a benchmark figure can
be reproduced anywhere; generation runs at about 30 MB/s, off the measured path.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

__all__ = ["make_vocabulary", "synthetic_text", "write_synthetic_corpus"]

_ONSETS = [
    "b",
    "c",
    "d",
    "f",
    "g",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "w",
    "z",
    "bl",
    "br",
    "ch",
    "cl",
    "cr",
    "dr",
    "fl",
    "fr",
    "gl",
    "gr",
    "pl",
    "pr",
    "sh",
    "sk",
    "sl",
    "sp",
    "st",
    "str",
    "th",
    "tr",
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ee", "ie", "oa", "ou"]
_CODAS = [""] * 6 + ["n", "r", "s", "t", "l", "m", "nd", "st", "ng", "rt"]


def make_vocabulary(size: int = 50_000, seed: int = 0) -> list[bytes]:
    """``size`` distinct made-up words, most frequent (shortest) first."""
    rng = np.random.default_rng([seed, 1])
    words: list[bytes] = []
    seen: set[bytes] = set()
    while len(words) < size:
        rank = len(words)
        syllables = 1 + min(4, int(rng.poisson(0.3 + 2.2 * rank / size)))
        word = "".join(
            _ONSETS[rng.integers(len(_ONSETS))]
            + _VOWELS[rng.integers(len(_VOWELS))]
            + _CODAS[rng.integers(len(_CODAS))]
            for _ in range(syllables)
        ).encode()
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def synthetic_text(
    megabytes: float, seed: int = 0, vocabulary: int = 50_000, chunk_words: int = 1 << 20
) -> Iterator[bytes]:
    """Chunks of corpus text adding up to about ``megabytes`` MB, ending at a document end."""
    words = make_vocabulary(vocabulary, seed)
    inner = np.array([w + b" " for w in words], dtype=object)
    last = np.array([w + b".\n" for w in words], dtype=object)
    ranks = np.arange(1, vocabulary + 1, dtype=np.float64)
    cdf = np.cumsum(ranks**-1.1)
    cdf /= cdf[-1]
    rng = np.random.default_rng([seed, 2])
    target = int(megabytes * 1e6)
    written = 0
    while written < target:
        # documents of this chunk: sentences per document, words per sentence
        n_docs = max(1, chunk_words // 550)
        sentences = np.maximum(1, rng.lognormal(np.log(20.0), 0.9, n_docs).astype(np.int64))
        sentences[rng.random(n_docs) < 0.04] = 1  # stubs
        lengths = np.clip(rng.lognormal(np.log(20.0), 0.45, int(sentences.sum())), 3, 120)
        lengths = lengths.astype(np.int64)
        ids = np.searchsorted(cdf, rng.random(int(lengths.sum())))
        pieces = inner[ids]
        ends = np.cumsum(lengths) - 1
        pieces[ends] = last[ids[ends]]
        doc_ends = ends[np.cumsum(sentences) - 1]
        pieces[doc_ends] = [p + b"\n" for p in pieces[doc_ends]]
        # stop at the first document end past the target
        start = 0
        for end in doc_ends:
            if written >= target:
                return
            chunk = b"".join(pieces[start : end + 1].tolist())
            start = end + 1
            written += len(chunk)
            yield chunk


def write_synthetic_corpus(
    folder: str | Path, megabytes: float, files: int = 1, seed: int = 0
) -> list[Path]:
    """Write about ``megabytes`` MB of corpus to ``files`` files ``part-NNNNN.txt`` in
    ``folder`` (documents dealt round-robin, so every file has the same kind of text)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"part-{i:05d}.txt" for i in range(files)]
    handles = [p.open("wb") for p in paths]
    try:
        for i, chunk in enumerate(synthetic_text(megabytes, seed)):
            handles[i % files].write(chunk)
    finally:
        for h in handles:
            h.close()
    return paths
