"""Next-sentence-prediction pairs, as google-research/bert's ``create_pretraining_data.py``.

For each document (and each of ``dupe_factor`` passes) the target length is
``max_seq_length - 3``, or with probability ``short_seq_prob`` a random length in
``[2, max_seq_length - 3]`` (drawn once per document, as the reference does). Sentences are
accumulated into a chunk until it reaches the target; the chunk is split at a random
sentence into A and B. With probability ``random_next_prob`` (or when the chunk holds a
single sentence) B is instead taken from a random other document, starting at a random
sentence, and the chunk's unused sentences are put back. The pair is then truncated to
``max_seq_length - 3`` tokens by removing tokens from the longer side, from its front or
back at random.

The reference pops tokens one at a time; here the number of tokens removed from each side
is computed in closed form and the front/back split drawn as a binomial, which gives the same
distribution. Instances are kept as token ranges into the bucket's token array and
assembled into ``[CLS] A [SEP] B [SEP]`` blocks with numpy in one pass.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bertpipe.preprocessing.shard_format import InstanceBlock, gather_segments, segment_index

__all__ = ["DocumentSet", "PairSpec", "TokenizedDoc", "assemble", "create_pairs"]

_TWO_52 = float(1 << 52)


@dataclass
class TokenizedDoc:
    """A document after tokenization: ids back to back and where each sentence ends."""

    doc_id: str
    tokens: np.ndarray
    """[T] token ids (uint16 or int32)."""
    sentence_ends: np.ndarray
    """[n_sentences] int32, exclusive end offset of each sentence in ``tokens``."""

    def pack(self) -> bytes:
        """Compact bytes for moving the document between workers (raw arrays, nothing pickled)."""
        doc_id = self.doc_id.encode("utf-8")
        code = b"H" if self.tokens.dtype == np.uint16 else b"i"
        header = np.array(
            [len(doc_id), self.tokens.size, self.sentence_ends.size], dtype="<u4"
        ).tobytes()
        return (
            code
            + header
            + doc_id
            + self.tokens.astype(self.tokens.dtype.newbyteorder("<"), copy=False).tobytes()
            + self.sentence_ends.astype("<i4", copy=False).tobytes()
        )

    @classmethod
    def unpack(cls, data: bytes) -> TokenizedDoc:
        dtype = np.dtype("<u2") if data[:1] == b"H" else np.dtype("<i4")
        n_id, n_tok, n_sent = (int(v) for v in np.frombuffer(data, dtype="<u4", count=3, offset=1))
        pos = 13
        doc_id = data[pos : pos + n_id].decode("utf-8")
        pos += n_id
        tokens = np.frombuffer(data, dtype=dtype, count=n_tok, offset=pos)
        pos += n_tok * dtype.itemsize
        ends = np.frombuffer(data, dtype="<i4", count=n_sent, offset=pos)
        return cls(doc_id, tokens, ends)


@dataclass
class PairSpec:
    """Instances as token ranges into a bucket's concatenated token array, [n] each."""

    a_start: np.ndarray
    a_len: np.ndarray
    b_start: np.ndarray
    b_len: np.ndarray
    is_random_next: np.ndarray
    is_short_target: np.ndarray
    truncated: np.ndarray
    """Tokens removed by truncation."""

    def __len__(self) -> int:
        return int(self.a_start.shape[0])

    def slice(self, start: int, stop: int) -> PairSpec:
        """Instances ``start`` to ``stop`` (for working through a large bucket in chunks)."""
        return PairSpec(*(getattr(self, f)[start:stop] for f in _PAIR_FIELDS))


_PAIR_FIELDS = (
    "a_start",
    "a_len",
    "b_start",
    "b_len",
    "is_random_next",
    "is_short_target",
    "truncated",
)


class _Uniforms:
    """Uniform draws taken from a generator in bulk: scalar calls into numpy are slow."""

    def __init__(self, rng: np.random.Generator, chunk: int = 1 << 16) -> None:
        self._rng = rng
        self._chunk = chunk
        self._values: list[float] = []
        self._pos = 0

    def next(self) -> float:
        """The next uniform draw in [0, 1)."""
        if self._pos >= len(self._values):
            self._values = self._rng.random(self._chunk).tolist()
            self._pos = 0
        value = self._values[self._pos]
        self._pos += 1
        return value

    def integer(self, low: int, high: int) -> int:
        """Uniform integer in ``[low, high]`` (inclusive, like ``random.randint``)."""
        return low + min(int(self.next() * (high - low + 1)), high - low)


@dataclass
class DocumentSet:
    """The documents of one bucket, concatenated once and reused by every pass and phase."""

    tokens: np.ndarray
    """[T] all documents' tokens back to back."""
    starts: list[list[int]]
    """Per document, each sentence's start offset in ``tokens``."""
    ends: list[list[int]]
    """Per document, each sentence's end offset in ``tokens``."""

    @classmethod
    def from_docs(cls, docs: list[TokenizedDoc]) -> DocumentSet:
        if not docs:
            return cls(np.zeros(0, dtype=np.uint16), [], [])
        sizes = [d.tokens.size for d in docs]
        base = np.cumsum([0, *sizes[:-1]]).tolist()
        starts, ends = [], []
        for d, b in zip(docs, base, strict=True):
            doc_ends = (d.sentence_ends.astype(np.int64) + b).tolist()
            starts.append([b, *doc_ends[:-1]])
            ends.append(doc_ends)
        return cls(np.concatenate([d.tokens for d in docs]), starts, ends)

    def __len__(self) -> int:
        return len(self.ends)


def create_pairs(
    docs: DocumentSet,
    *,
    max_seq_length: int,
    short_seq_prob: float,
    random_next_prob: float,
    rng: np.random.Generator,
    counts: Counter[str] | None = None,
) -> PairSpec:
    """One pass of the recipe over ``docs`` (the caller repeats it ``dupe_factor`` times).

    Returns the instances as token ranges into ``docs.tokens``. Documents with fewer than
    two sentences should be filtered out by the caller; random next segments come from the
    other documents of ``docs``.
    """
    max_num_tokens = max_seq_length - 3
    if max_num_tokens < 2:
        raise ValueError("max_seq_length must be at least 5")
    uniform = _Uniforms(rng)
    n_docs = len(docs)
    starts_l, ends_l = docs.starts, docs.ends

    a_start: list[int] = []
    a_len: list[int] = []
    b_start: list[int] = []
    b_len: list[int] = []
    random_next: list[bool] = []
    short: list[bool] = []
    truncated: list[int] = []
    short_docs = 0
    no_other_doc = 0
    forced = 0

    draw = uniform.next
    randint = uniform.integer
    for di in range(n_docs):
        starts, ends = starts_l[di], ends_l[di]
        n_sent = len(ends)
        target = max_num_tokens
        is_short = draw() < short_seq_prob
        if is_short:
            target = randint(2, max_num_tokens)
            short_docs += 1
        first = 0
        while first < n_sent:
            # the chunk grows sentence by sentence until it reaches the target: its last
            # sentence is the first whose end is `target` tokens past the chunk's start
            i = min(bisect.bisect_left(ends, starts[first] + target, first), n_sent - 1)
            k = i - first + 1
            a_end = 1 if k < 2 else randint(1, k - 1)
            sa = starts[first]
            la = ends[first + a_end - 1] - sa
            if k == 1 or draw() < random_next_prob:
                is_random = True
                forced += k == 1
                other = di
                for _ in range(10):
                    other = randint(0, n_docs - 1)
                    if other != di:
                        break
                if other == di:
                    no_other_doc += 1
                o_starts, o_ends = starts_l[other], ends_l[other]
                rs = randint(0, len(o_ends) - 1)
                sb = o_starts[rs]
                # sentences from `rs` until B reaches its target length (at least one)
                j = min(bisect.bisect_left(o_ends, sb + target - la, rs), len(o_ends) - 1)
                lb = o_ends[j] - sb
                i -= k - a_end  # the chunk's unused sentences go back
            else:
                is_random = False
                sb = starts[first + a_end]
                lb = ends[i] - sb
            excess = la + lb - max_num_tokens
            if excess > 0:
                ra, rb = _removals(la, lb, excess)
                if ra:
                    sa += _binomial_half(draw, ra)
                    la -= ra
                if rb:
                    sb += _binomial_half(draw, rb)
                    lb -= rb
                truncated.append(excess)
            else:
                truncated.append(0)
            a_start.append(sa)
            a_len.append(la)
            b_start.append(sb)
            b_len.append(lb)
            random_next.append(is_random)
            short.append(is_short)
            first = i + 1

    if counts is not None:
        counts["document_passes"] += n_docs
        counts["documents_short_target"] += short_docs
        counts["random_next_same_document"] += no_other_doc
        counts["random_next_forced"] += forced
    return PairSpec(
        a_start=np.asarray(a_start, dtype=np.int64),
        a_len=np.asarray(a_len, dtype=np.int64),
        b_start=np.asarray(b_start, dtype=np.int64),
        b_len=np.asarray(b_len, dtype=np.int64),
        is_random_next=np.asarray(random_next, dtype=bool),
        is_short_target=np.asarray(short, dtype=bool),
        truncated=np.asarray(truncated, dtype=np.int64),
    )


def _removals(la: int, lb: int, excess: int) -> tuple[int, int]:
    """Tokens removed from A and from B when the longer side loses one token at a time
    (B on ties, as the reference's ``len(a) > len(b)`` test does)."""
    diff = la - lb
    if diff >= 0:
        if excess <= diff:
            return excess, 0
        rest = excess - diff
        return diff + rest // 2, rest - rest // 2
    if excess <= -diff:
        return 0, excess
    rest = excess + diff
    return rest // 2, -diff + rest - rest // 2


def _binomial_half(draw: Callable[[], float], n: int) -> int:
    """Binomial(n, 1/2), the number of ``n`` one-token removals taken from the front: the
    popcount of ``n`` random bits, 52 bits per uniform draw."""
    count = 0
    while n > 0:
        take = min(n, 52)
        count += (int(draw() * _TWO_52) & ((1 << take) - 1)).bit_count()
        n -= take
    return count


def assemble(
    all_tokens: np.ndarray, spec: PairSpec, *, cls_id: int, sep_id: int, dtype: np.dtype
) -> InstanceBlock:
    """Build ``[CLS] A [SEP] B [SEP]`` for every instance of ``spec`` (no masks yet)."""
    n = len(spec)
    lengths = spec.a_len + spec.b_len + 3
    offsets = np.cumsum(lengths) - lengths
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    tokens[offsets] = cls_id
    tokens[offsets + 1 + spec.a_len] = sep_id
    tokens[offsets + lengths - 1] = sep_id
    tokens[segment_index(offsets + 1, spec.a_len)] = gather_segments(
        all_tokens, spec.a_start, spec.a_len
    )
    tokens[segment_index(offsets + 2 + spec.a_len, spec.b_len)] = gather_segments(
        all_tokens, spec.b_start, spec.b_len
    )
    info = np.zeros((n, 4), dtype=np.uint16)
    info[:, 0] = lengths
    info[:, 1] = spec.a_len + 2
    info[:, 3] = spec.is_random_next
    empty_ids = np.zeros(0, dtype=dtype)
    return InstanceBlock(tokens, info, np.zeros(0, dtype=np.uint16), empty_ids)
