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

__all__ = [
    "eval_sentences",
    "make_vocabulary",
    "shingle_jaccard",
    "synthetic_text",
    "write_planted_corpus",
    "write_synthetic_corpus",
]

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


def _words_of(doc: bytes) -> list[bytes]:
    return doc.replace(b".", b" ").split()


def shingle_jaccard(a: bytes, b: bytes, n: int = 5) -> float:
    """Jaccard similarity of two documents' ``n``-word shingle sets (words as the quality
    steps see them: these made-up words are ASCII letters, sentences end in '.')."""
    wa, wb = _words_of(a.lower()), _words_of(b.lower())
    sa = {tuple(wa[i : i + n]) for i in range(len(wa) - n + 1)}
    sb = {tuple(wb[i : i + n]) for i in range(len(wb) - n + 1)}
    return len(sa & sb) / max(1, len(sa | sb))


def _mutate(doc: bytes, target: float, words: list[bytes], rng: np.random.Generator) -> bytes:
    """``doc`` with words replaced at positions at least 5 apart, as many as make its 5-word
    shingle sets' Jaccard similarity about ``target`` (each replacement changes 5 shingles)."""
    lines = [line.split(b" ") for line in doc.rstrip(b"\n").split(b"\n")]
    flat = [(i, j) for i, line in enumerate(lines) for j in range(len(line))]
    shingles = len(flat) - 4
    m = max(1, round(shingles * (1 - target) / (5 * (1 + target))))
    slots = rng.choice(len(flat) // 5, size=min(m, len(flat) // 5), replace=False)
    for slot in slots:
        i, j = flat[slot * 5 + 2]
        old = lines[i][j]
        tail = b"." if old.endswith(b".") else b""
        lines[i][j] = words[int(rng.integers(len(words)))] + b"zq" + tail  # a word not in it
    return b"\n".join(b" ".join(line) for line in lines) + b"\n\n"


def eval_sentences(count: int = 20, seed: int = 7) -> list[str]:
    """Made-up evaluation sentences of 9 to 17 words (from their own vocabulary), to plant in
    a corpus and decontaminate it of."""
    words = [w.decode() for w in make_vocabulary(count * 18, seed=seed)]
    return [" ".join(words[i * 18 : i * 18 + 9 + i % 9]) for i in range(count)]


def write_planted_corpus(
    folder: str | Path,
    megabytes: float,
    files: int = 4,
    seed: int = 0,
    exact: float = 0.02,
    near: float = 0.02,
    near_jaccard: tuple[float, float] = (0.85, 0.95),
    below: float = 0.02,
    below_jaccard: tuple[float, float] = (0.4, 0.7),
    eval_sentences: list[str] | None = None,
    contaminated: float = 0.005,
) -> dict[str, list[dict[str, object]]]:
    """:func:`write_synthetic_corpus` with planted copies, for the quality steps' tests and
    benchmark: after a document, with these probabilities, an exact copy of an earlier
    document, a near-duplicate at a Jaccard similarity drawn from ``near_jaccard``, a copy
    below the threshold (``below_jaccard``), or a document with one of ``eval_sentences``
    inserted. Returns the truth: ``{"exact"|"near"|"below": [{"source", "copy", "jaccard"}],
    "contaminated": [{"id", "sentence"}]}`` with document ids as the job names them in files
    read whole (``part-NNNNN.txt:<ordinal>``); the same keys ending in ``_at`` hold the ids of
    files read in byte ranges (``part-NNNNN.txt@<offset>``)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"part-{i:05d}.txt" for i in range(files)]
    handles = [p.open("wb") for p in paths]
    rng = np.random.default_rng([seed, 3])
    vocab = make_vocabulary(2000, seed + 1)
    truth: dict[str, list[dict[str, object]]] = {
        "exact": [],
        "near": [],
        "below": [],
        "contaminated": [],
    }
    pool: list[tuple[tuple[str, str], bytes]] = []  # earlier documents that can be copied
    written = [0]
    count = [0]
    offsets = [0] * files

    def emit(doc: bytes) -> tuple[str, str]:
        n = count[0]
        f = n % files
        at = offsets[f]
        handles[f].write(doc)
        offsets[f] += len(doc)
        count[0] += 1
        written[0] += len(doc)
        return f"part-{f:05d}.txt:{n // files}", f"part-{f:05d}.txt@{at}"

    target = int(megabytes * 1e6)
    try:
        for doc in synthetic_text(megabytes, seed):
            if written[0] >= target:
                break
            if eval_sentences and rng.random() < contaminated and doc.count(b"\n") > 3:
                sentence = eval_sentences[int(rng.integers(len(eval_sentences)))]
                lines = doc.rstrip(b"\n").split(b"\n")
                lines.insert(int(rng.integers(1, len(lines))), sentence.encode())
                doc_id, doc_at = emit(b"\n".join(lines) + b"\n\n")
                truth["contaminated"].append({"id": doc_id, "id_at": doc_at, "sentence": sentence})
                continue
            ids = emit(doc)
            if doc.count(b"\n") > 3 and len(_words_of(doc)) >= 60:
                pool.append((ids, doc))
                if len(pool) > 500:
                    pool.pop(int(rng.integers(len(pool))))
            u = rng.random()
            if not pool or u >= exact + near + below:
                continue
            (source_id, source_at), source = pool[int(rng.integers(len(pool)))]
            if u < exact:
                kind, copy = "exact", source
            else:
                kind = "near" if u < exact + near else "below"
                low, high = near_jaccard if kind == "near" else below_jaccard
                copy = _mutate(source, float(rng.uniform(low, high)), vocab, rng)
            copy_id, copy_at = emit(copy)
            truth[kind].append(
                {
                    "source": source_id,
                    "copy": copy_id,
                    "source_at": source_at,
                    "copy_at": copy_at,
                    "jaccard": round(shingle_jaccard(source, copy), 4),
                }
            )
    finally:
        for h in handles:
            h.close()
    return truth
