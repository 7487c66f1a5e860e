"""Corpus quality: what the Beam job removes before it makes instances, and why.

Four kinds of removal, each off by default (the paper recipe's output is unchanged) and each
counted by reason in the manifest and the preprocess MLflow run (``removed_<reason>``):

- **filters** (:class:`FilterConfig`): heuristic document filters of Gopher (Rae et al.
  2021, "Scaling Language Models", appendix A.1.1), decided per document in the read stage;
- **decontamination** (:class:`DecontaminationConfig`): documents (or only their sentences)
  sharing a 13-word n-gram with the evaluation sets' text (GPT-3's check, Brown et al. 2020,
  appendix C), decided per document in the read stage against an index of the evaluation
  n-grams that the driver builds once (:func:`build_eval_index`);
- **exact duplicates** (:class:`DedupConfig` ``exact``): documents whose normalised text is
  the same, the first in corpus order kept;
- **near-duplicates** (``near``): MinHash over word shingles with locality-sensitive
  banding, candidates verified on the signatures' estimate of the Jaccard similarity,
  clusters formed transitively, one document (the first in corpus order) kept per cluster.

This module holds the per-document computations, pure and vectorised with numpy; the Beam
stages that group documents across the corpus are in :mod:`bertpipe.preprocessing.dedup`.

**Words** (shared by all of it): the maximal runs of ASCII letters, digits and ``_`` and of
characters beyond ASCII other than general punctuation (U+2000-U+206F: dashes, quotes, the
ellipsis, spaces), the no-break space and guillemets; ASCII letters are lower-cased, other
characters compared as they are. Punctuation and white space separate words and are
otherwise ignored. A document's words are found and hashed (64 bits, a polynomial over the
UTF-8 bytes, then a mixer) for the whole document at once in numpy, and an n-gram's hash is
made from its words' hashes: the same words give the same hashes in every process and on
every machine. A document's *normalised text* is its sequence of words.

**MinHash**: one-permutation hashing (Li, Owen and Zhang 2012) with optimal densification
(Shrivastava 2017): each shingle is hashed once; the top bits of its hash choose one of
``num_perm`` bins and the rest rank it there; a bin keeps a 16-bit fingerprint of its
lowest-ranked shingle, and an empty bin borrows the value of a bin chosen by a probe
sequence that is the same for every document. Two signatures agree in a bin with
probability equal to the documents' Jaccard similarity, as ``num_perm`` independent
permutations would, at the cost of one hash per shingle instead of ``num_perm``
(``datasketch``'s ``MinHash.update_batch`` hashes every shingle ``num_perm`` times with
SHA-1 then numpy: about 6x the time of this whole path, measured; BENCHMARKS.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from bertpipe.config import ConfigError
from bertpipe.preprocessing.quality_config import (
    DecontaminationConfig,
    DedupConfig,
    FilterConfig,
    QualityConfig,
)

__all__ = [
    "DecontaminationConfig",
    "DedupConfig",
    "DocQuality",
    "EvalIndex",
    "FilterConfig",
    "QualityConfig",
    "Verdict",
    "filter_failures",
    "minhash",
    "ngram_hashes",
    "word_hashes",
    "word_spans",
]


# --------------------------------------------------------------------------- hashing

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_P = np.uint64(0x100000001B3)  # the FNV prime: odd, so invertible modulo 2**64
_P_INV = np.uint64(pow(int(_P), -1, 1 << 64))
_GRAM = np.array(
    [(0x9E3779B97F4A7C15 * (2 * k + 1)) & 0xFFFFFFFFFFFFFFFF | 1 for k in range(64)],
    dtype=np.uint64,
)
"""Odd multipliers of an n-gram's words by position (n at most 64)."""


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise (uint64 arithmetic wraps)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


class _Powers:
    """``P**i`` and ``P**-i`` modulo 2**64, grown on demand (shared by all documents)."""

    def __init__(self) -> None:
        self.up = np.ones(1, dtype=np.uint64)
        self.down = np.ones(1, dtype=np.uint64)

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.up) < n:
            size = max(n, 2 * len(self.up))
            with np.errstate(over="ignore"):
                self.up = _cumpow(_P, size)
                self.down = _cumpow(_P_INV, size)
        return self.up[:n], self.down[:n]


def _cumpow(base: np.uint64, n: int) -> np.ndarray:
    """``base**0 ... base**(n-1)`` modulo 2**64."""
    out = np.full(n, base, dtype=np.uint64)
    out[0] = 1
    return np.cumprod(out, dtype=np.uint64)


_POWERS = _Powers()


_WORD_BYTE = np.zeros(256, dtype=bool)
for _c in b"0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ":
    _WORD_BYTE[_c] = True
_WORD_BYTE[0x80:] = True


def word_spans(text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The words of ``text`` (see the module's documentation): their hashes ([n] uint64) and
    the byte offsets where each starts and ends in ``text``'s UTF-8 encoding."""
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    if not data.size:
        empty = np.zeros(0, dtype=np.int64)
        return np.zeros(0, dtype=np.uint64), empty, empty
    word = _WORD_BYTE[data]
    # separators beyond ASCII: general punctuation (U+2000-U+206F: dashes, quotes, the
    # ellipsis, spaces), the no-break space and the guillemets
    lead = np.flatnonzero((data[:-2] == 0xE2) & ((data[1:-1] & 0xFE) == 0x80))
    for k in range(3):
        word[lead + k] = False
    pair = np.flatnonzero(
        (data[:-1] == 0xC2) & ((data[1:] == 0xA0) | (data[1:] == 0xAB) | (data[1:] == 0xBB))
    )
    word[pair] = word[pair + 1] = False
    edge = np.diff(word.astype(np.int8), prepend=np.int8(0), append=np.int8(0))
    starts = np.flatnonzero(edge == 1)
    ends = np.flatnonzero(edge == -1)
    if not starts.size:
        return np.zeros(0, dtype=np.uint64), starts, ends
    up, down = _POWERS.get(len(data))
    # a word's hash: the sum of its (lower-cased) bytes times P**position, shifted back to 0;
    # separators count 0, so each sum from one word's start to the next's is that word's
    lower = data | (((data - np.uint8(65)) < 26).view(np.uint8) << np.uint8(5))
    lower *= word.view(np.uint8)
    h = np.add.reduceat(lower.astype(np.uint64) * up, starts) * down[starts]
    return _mix(h + (ends - starts).astype(np.uint64)), starts, ends


def word_hashes(text: str) -> np.ndarray:
    """[n] uint64: the hash of each word of ``text``."""
    return word_spans(text)[0]


def gram_prefix(hashes: np.ndarray) -> np.ndarray:
    """Prefix sums of word hash x P**position: :func:`ngram_hashes` of any length from them."""
    prefix = np.zeros(len(hashes) + 1, dtype=np.uint64)
    if len(hashes):
        np.cumsum(hashes * _POWERS.get(len(hashes))[0], out=prefix[1:])
    return prefix


def ngram_hashes(
    hashes: np.ndarray, n: int, prefix: np.ndarray | None = None, mix: bool = True
) -> np.ndarray:
    """[len - n + 1] uint64: the hash of every n consecutive words (empty if fewer): a
    polynomial in their hashes, in O(len) for any ``n`` (give ``prefix``, from
    :func:`gram_prefix`, when taking several lengths of the same words). ``mix=False`` skips
    the final mixer: enough to look n-grams up (decontamination), not to rank them (MinHash
    takes bins from the top bits)."""
    count = len(hashes) - n + 1
    if count <= 0:
        return np.zeros(0, dtype=np.uint64)
    if prefix is None:
        prefix = gram_prefix(hashes)
    down = _POWERS.get(count)[1]
    grams = (prefix[n:] - prefix[:count]) * down + np.uint64(n)
    return _mix(grams) if mix else grams


_PROBES: dict[int, np.ndarray] = {}
_PROBE_TRIES = 64


def _probes(num_perm: int) -> np.ndarray:
    """[num_perm, tries] the bins an empty bin tries, in order (the same for every document)."""
    table = _PROBES.get(num_perm)
    if table is None:
        seq = np.arange(num_perm * _PROBE_TRIES, dtype=np.uint64) + np.uint64(0x5EED)
        table = (_mix(seq) % np.uint64(num_perm)).astype(np.int64).reshape(num_perm, -1)
        _PROBES[num_perm] = table
    return table


def minhash(shingles: np.ndarray, num_perm: int) -> np.ndarray | None:
    """[num_perm] uint16 signature of a set of shingle hashes (None for an empty set): one
    permutation hashing with optimal densification (see the module's documentation)."""
    if shingles.size == 0:
        return None
    bits = num_perm.bit_length() - 1
    ordered = np.sort(shingles)  # by bin (top bits), then rank: a bin's first is its minimum
    bins = (ordered >> np.uint64(64 - bits)).astype(np.int64)
    first = np.flatnonzero(np.concatenate(([True], bins[1:] != bins[:-1])))
    sig = np.zeros(num_perm, dtype=np.uint16)
    filled = np.zeros(num_perm, dtype=bool)
    sig[bins[first]] = (ordered[first] & np.uint64(0xFFFF)).astype(np.uint16)
    filled[bins[first]] = True
    empty = np.flatnonzero(~filled)
    if empty.size:
        own = sig.copy()
        table = _probes(num_perm)
        for t in range(_PROBE_TRIES):
            cand = table[empty, t]
            ok = filled[cand]
            sig[empty[ok]] = own[cand[ok]]
            empty = empty[~ok]
            if not empty.size:
                break
        if empty.size:  # rare (a few filled bins): the next filled bin, circularly
            full = np.flatnonzero(filled)
            nxt = full[np.searchsorted(full, empty) % len(full)]
            sig[empty] = own[nxt]
    return sig


def band_keys(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """[bands] uint64 keys of the signature's bands (lowest bit 0; a band's index mixed in)."""
    block = sig[: bands * rows].astype(np.uint64).reshape(bands, rows)
    acc = (block * _GRAM[:rows]).sum(axis=1, dtype=np.uint64)
    acc += np.arange(bands, dtype=np.uint64) * np.uint64(0xD6E8FEB86659FD93)
    return _mix(acc) & ~np.uint64(1)


def exact_key(hashes: np.ndarray) -> int:
    """The 64-bit key of a document's words (lowest bit 1; 0 for a document without words)."""
    if not hashes.size:
        return 0
    digest = hashlib.blake2b(hashes.astype("<u8").tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") | 1


# --------------------------------------------------------------------------- filters

_SPACE = np.zeros(256, dtype=bool)
_SPACE[[9, 10, 11, 12, 13, 32]] = True
_LETTER = np.zeros(256, dtype=bool)
_LETTER[65:91] = _LETTER[97:123] = True
_LETTER[0xC0:] = True  # the first byte of a character beyond ASCII: counted as a letter


def _token_stats(text: str) -> tuple[int, int, int]:
    """White-space separated tokens of ``text``: how many, their characters, and how many
    hold a letter (ASCII letters, or any character beyond ASCII)."""
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    inside = ~_SPACE[data]
    edge = np.diff(inside.view(np.int8), prepend=np.int8(0), append=np.int8(0))
    starts = np.flatnonzero(edge == 1)
    if not starts.size:
        return 0, 0, 0
    chars = int(np.count_nonzero(inside & ((data & 0xC0) != 0x80)))
    # from one token's start to the next's: that token's letters (white space has none)
    letters = np.add.reduceat(_LETTER[data].view(np.uint8), starts, dtype=np.int32)
    with_letter = int(np.count_nonzero(letters))
    return len(starts), chars, with_letter


def filter_failures(sentences: Sequence[str], cfg: FilterConfig) -> str | None:
    """The first filter ``sentences`` (a document's lines) fails, as ``filter_<key>``; None
    when it passes them all."""
    text = "\n".join(sentences)
    n, chars, with_letter = _token_stats(text)
    checks: list[tuple[str, float | None, float, bool]] = [
        ("min_words", cfg.min_words, n, True),
        ("max_words", cfg.max_words, n, False),
    ]
    if n:
        mean = chars / n
        checks += [
            ("min_mean_word_length", cfg.min_mean_word_length, mean, True),
            ("max_mean_word_length", cfg.max_mean_word_length, mean, False),
            ("min_alpha_words", cfg.min_alpha_words, with_letter / n, True),
        ]
        if cfg.max_symbol_ratio is not None:
            ellipses = text.count("...") + text.count("\u2026")
            ratio = max(text.count("#"), ellipses) / n
            checks.append(("max_symbol_ratio", cfg.max_symbol_ratio, ratio, False))
    lines = [s.strip() for s in sentences]
    if lines:
        if cfg.max_ellipsis_lines is not None:
            share = sum(s.endswith(("...", "\u2026")) for s in lines) / len(lines)
            checks.append(("max_ellipsis_lines", cfg.max_ellipsis_lines, share, False))
        if cfg.max_duplicate_lines is not None:
            share = (len(lines) - len(set(lines))) / len(lines)
            checks.append(("max_duplicate_lines", cfg.max_duplicate_lines, share, False))
    for key, limit, value, is_min in checks:
        if limit is not None and (value < limit if is_min else value > limit):
            return f"filter_{key}"
    return None


# --------------------------------------------------------------------------- evaluation sets


@dataclass
class EvalIndex:
    """The evaluation sets' n-grams: for each length, sorted hashes and the sets holding
    each (a bit per set, at most 64 sets)."""

    names: list[str]
    lengths: list[int]
    hashes: list[np.ndarray]
    owners: list[np.ndarray]

    def to_bytes(self) -> bytes:
        """A portable file (numpy's ``.npz``, nothing pickled) for the workers."""
        import io
        import json

        out = io.BytesIO()
        arrays = {"names": np.frombuffer(json.dumps(self.names).encode(), dtype=np.uint8)}
        for length, h, o in zip(self.lengths, self.hashes, self.owners, strict=True):
            arrays[f"h{length}"] = h
            arrays[f"o{length}"] = o
        np.savez(out, **arrays)
        return out.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> EvalIndex:
        import io
        import json

        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            names = json.loads(bytes(z["names"]).decode())
            lengths = sorted(int(k[1:]) for k in z.files if k.startswith("h"))
            return cls(
                names,
                lengths,
                [z[f"h{n}"] for n in lengths],
                [z[f"o{n}"] for n in lengths],
            )

    def matches(
        self, hashes: np.ndarray, prefix: np.ndarray | None = None
    ) -> tuple[np.ndarray, int]:
        """Which words of a document (its word hashes) an evaluation n-gram covers ([n]
        bool), and the sets those n-grams come from (a bit per set)."""
        covered = np.zeros(len(hashes), dtype=bool)
        owners = 0
        if prefix is None:
            prefix = gram_prefix(hashes)
        for n, table, owner in zip(self.lengths, self.hashes, self.owners, strict=True):
            grams = ngram_hashes(hashes, n, prefix, mix=False)
            if not grams.size or not table.size:
                continue
            at = np.minimum(np.searchsorted(table, grams), len(table) - 1)
            hit = np.flatnonzero(table[at] == grams)
            if hit.size:
                owners |= int(np.bitwise_or.reduce(owner[at[hit]]))
                # the words of every matching n-gram: starts hit .. hit + n - 1
                delta = np.zeros(len(hashes) + 1, dtype=np.int64)
                np.add.at(delta, hit, 1)
                np.add.at(delta, hit + n, -1)
                covered |= np.cumsum(delta[:-1]) > 0
        return covered, owners

    def set_names(self, owners: int) -> list[str]:
        return [name for i, name in enumerate(self.names) if owners >> i & 1]


def build_eval_index(texts: Iterable[tuple[str, str]], cfg: DecontaminationConfig) -> EvalIndex:
    """The index of ``(set name, text)`` pairs: each text's ``cfg.ngram``-grams, or the whole
    text when it has ``cfg.min_ngram`` to ``cfg.ngram - 1`` words."""
    names: list[str] = []
    grams: dict[int, list[tuple[np.ndarray, int]]] = {}
    for name, text in texts:
        if name not in names:
            if len(names) == 64:
                raise ConfigError(
                    "quality.decontaminate.paths", "at most 64 evaluation sets (files)"
                )
            names.append(name)
        bit = 1 << names.index(name)
        h = word_hashes(text)
        n = cfg.ngram if len(h) >= cfg.ngram else len(h)
        if n < cfg.min_ngram:
            continue
        grams.setdefault(n, []).append((ngram_hashes(h, n, mix=False), bit))
    lengths = sorted(grams)
    hashes, owners = [], []
    for n in lengths:
        h = np.concatenate([g for g, _ in grams[n]])
        o = np.concatenate([np.full(len(g), bit, dtype=np.uint64) for g, bit in grams[n]])
        order = np.argsort(h, kind="stable")
        h, o = h[order], o[order]
        # one entry per n-gram, with the bits of every set holding it
        first = np.concatenate(([True], h[1:] != h[:-1]))
        group = np.cumsum(first) - 1
        merged = np.zeros(int(first.sum()), dtype=np.uint64)
        np.bitwise_or.at(merged, group, o)
        hashes.append(h[first])
        owners.append(merged)
    return EvalIndex(names, lengths, hashes, owners)


# --------------------------------------------------------------------------- a document


@dataclass
class Verdict:
    """What quality decided about one document in the read stage."""

    reason: str | None = None
    """Why it is removed (``filter_<key>``, ``contaminated``), or None."""
    sentences: list[str] | None = None
    """Its sentences after decontamination at sentence scope (None: unchanged)."""
    eval_sets: list[str] | None = None
    """The evaluation sets it overlapped."""
    exact: int = 0
    """The exact-duplicate key (0: not taking part)."""
    signature: np.ndarray | None = None
    """Its MinHash signature (None: not taking part in near-duplicate removal)."""


class DocQuality:
    """The read stage's per-document checks, with what they need loaded once per worker."""

    def __init__(self, cfg: QualityConfig, index: EvalIndex | None) -> None:
        self.cfg = cfg
        self.index = index

    def check(self, sentences: list[str]) -> Verdict:
        cfg = self.cfg
        if cfg.filters.enabled:
            failed = filter_failures(sentences, cfg.filters)
            if failed:
                return Verdict(reason=failed)
        verdict = Verdict()
        if not (self.index is not None or cfg.dedup.enabled):
            return verdict
        text = "\n".join(sentences)
        hashes, starts, _ = word_spans(text)
        prefix = gram_prefix(hashes)
        if self.index is not None:
            covered, owners = self.index.matches(hashes, prefix)
            if owners:
                verdict.eval_sets = self.index.set_names(owners)
                if cfg.decontaminate.scope == "document":
                    verdict.reason = "contaminated"
                    return verdict
                # the sentence of each word: by the byte offsets of the newlines between them
                data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
                breaks = np.flatnonzero(data == 10)
                touched = set(np.searchsorted(breaks, starts[covered]).tolist())
                verdict.sentences = [s for i, s in enumerate(sentences) if i not in touched]
                if not verdict.sentences:
                    verdict.reason = "contaminated"
                    return verdict
                hashes = word_hashes("\n".join(verdict.sentences))
                prefix = gram_prefix(hashes)
        dedup = cfg.dedup
        if dedup.exact:
            verdict.exact = exact_key(hashes)
        if dedup.near:
            shingles = ngram_hashes(hashes, dedup.shingle_words, prefix)
            verdict.signature = minhash(shingles, dedup.num_perm)
        return verdict
