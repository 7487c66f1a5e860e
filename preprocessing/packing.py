"""Masked-LM instances without NSP: whole sentences packed up to the sequence length.

RoBERTa's input formats (Liu et al. 2019, section 4.2): **FULL-SENTENCES** packs full
sentences contiguously from one or more documents, and when it crosses a document boundary
puts an extra separator between the documents; **DOC-SENTENCES** packs the same way but never
crosses a document boundary. An instance is ``[CLS] sentences [SEP]``, or across documents
``[CLS] docA-sentences [SEP] docB-sentences [SEP]``: one segment (token type 0 throughout),
no random next, no short targets.

Packing is greedy in a stream of the bucket's documents, taken in a permuted order (the
caller's generator, a new order for every dupe pass): sentences are added whole while the
instance stays within ``max_seq_length`` (``[CLS]``, the final ``[SEP]`` and each separator
between documents included). A sentence longer than a whole instance's room cannot be added
whole: it is cut, its first piece filling what is left of the current instance, then pieces
of a whole instance, its last piece starting the next instance (to which whole sentences are
added again). Nothing is dropped: the instances' non-special tokens, in order, are the
documents' tokens in the permuted order.

The stream is kept *virtual*: each document is a separator followed by its tokens, and an
instance is a range ``[start, end)`` of it (a separator at the range's start is the one
``[CLS]`` replaces). The greedy walk is a loop over instances with one ``bisect`` into the
sentence ends each (a few microseconds per instance); everything per token or per sentence
is done with numpy, and instances are assembled from their ranges in chunks.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass

import numpy as np

from bertpipe.preprocessing.instances import DocumentSet
from bertpipe.preprocessing.shard_format import InstanceBlock, gather_segments, segment_index

__all__ = ["PackedSpec", "SentenceTable", "assemble_packed", "pack_sentences"]


@dataclass
class SentenceTable:
    """A bucket's documents as flat arrays (built once per bucket, used by every pass)."""

    doc_start: np.ndarray
    """[D] int64, each document's first token in ``DocumentSet.tokens``."""
    doc_tokens: np.ndarray
    """[D] int64, tokens per document."""
    doc_first_sentence: np.ndarray
    """[D] int64, index of each document's first sentence in ``sentence_len``."""
    doc_sentences: np.ndarray
    """[D] int64, sentences per document."""
    sentence_len: np.ndarray
    """[S] int64, tokens per sentence, documents in order."""

    @classmethod
    def from_docset(cls, docs: DocumentSet) -> SentenceTable:
        n_sent = np.fromiter(map(len, docs.ends), dtype=np.int64, count=len(docs))
        total = int(n_sent.sum())
        if total == 0:
            empty = np.zeros(0, dtype=np.int64)
            return cls(empty, empty, empty, n_sent, empty)
        starts = np.fromiter((s for d in docs.starts for s in d), dtype=np.int64, count=total)
        ends = np.fromiter((e for d in docs.ends for e in d), dtype=np.int64, count=total)
        first = np.cumsum(n_sent) - n_sent
        last = first + n_sent - 1
        return cls(
            doc_start=starts[first],
            doc_tokens=ends[last] - starts[first],
            doc_first_sentence=first,
            doc_sentences=n_sent,
            sentence_len=ends - starts,
        )

    def __len__(self) -> int:
        return int(self.doc_start.shape[0])


@dataclass
class PackedSpec:
    """One pass's instances as ranges of the virtual stream (see the module docstring)."""

    start: np.ndarray
    """[n] int64, virtual start of each instance."""
    end: np.ndarray
    """[n] int64, virtual end (exclusive)."""
    virtual_doc_start: np.ndarray
    """[D + 1] int64, where each document (in packing order) starts in the virtual stream
    (its separator), then the stream's end."""
    real_doc_start: np.ndarray
    """[D] int64, each document's (in packing order) first token in ``DocumentSet.tokens``."""

    def __len__(self) -> int:
        return int(self.start.shape[0])

    def slice(self, lo: int, hi: int) -> PackedSpec:
        """Instances ``lo`` to ``hi`` (for assembling a large bucket in chunks)."""
        return PackedSpec(
            self.start[lo:hi], self.end[lo:hi], self.virtual_doc_start, self.real_doc_start
        )


def pack_sentences(
    table: SentenceTable,
    order: np.ndarray,
    *,
    max_seq_length: int,
    cross_documents: bool,
    counts: Counter[str] | None = None,
) -> PackedSpec:
    """Pack the documents of ``table``, taken in ``order`` (a permutation of their indices),
    into instances of at most ``max_seq_length`` tokens. ``cross_documents``: FULL-SENTENCES
    (True) or DOC-SENTENCES (False)."""
    room = max_seq_length - 2
    if room < 1:
        raise ValueError("max_seq_length must be at least 3")
    order = np.asarray(order, dtype=np.int64)
    n_docs = order.size
    sizes = table.doc_tokens[order] + 1  # each document behind its separator
    vdoc = np.zeros(n_docs + 1, dtype=np.int64)
    np.cumsum(sizes, out=vdoc[1:])
    real = table.doc_start[order]
    n_sent = table.doc_sentences[order]
    sent = gather_segments(
        np.arange(table.sentence_len.size, dtype=np.int64), table.doc_first_sentence[order], n_sent
    )
    first = np.zeros(sent.size, dtype=bool)  # the sentence opens its document
    first[np.cumsum(n_sent) - n_sent] = True
    length = table.sentence_len[sent]
    # virtual sentence ends: a document's first sentence carries the separator before it
    ends_v = np.cumsum(length + first)
    longer = length > room

    if counts is not None:
        counts["document_passes"] += n_docs
        counts["sentences_cut"] += int(longer.sum())
    if sent.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return PackedSpec(empty, empty.copy(), vdoc, real)

    breaks: list[int] = ends_v.tolist()
    opens: list[bool] = first.tolist()
    too_long: list[bool] = longer.tolist()
    doc_end: list[int] = vdoc[1:].tolist()
    total = len(breaks)
    starts: list[int] = []
    stops: list[int] = []
    p = 0  # where the next instance starts in the virtual stream
    s = 0  # the sentence holding position p (the first whose end is past p)
    d = 0  # the document holding position p (DOC-SENTENCES only)
    p_opens = True  # p is a document's separator (replaced by [CLS])
    bisect_right = bisect.bisect_right
    while s < total:
        limit = p + room + p_opens
        if not cross_documents:
            while doc_end[d] <= p:
                d += 1
            limit = min(limit, doc_end[d])
        i = bisect_right(breaks, limit, s) - 1  # the last sentence that fits whole
        if i >= s:
            q = breaks[i]
            t = i + 1  # the next sentence: cut it if no instance can hold it whole
            if t < total and too_long[t] and limit > q + opens[t]:
                q = limit
                s = t
                p_opens = False
            else:
                s = t
                p_opens = t < total and opens[t]
        else:  # sentence s, from p on, is longer than a whole instance: a piece of it
            q = limit
            p_opens = False
        starts.append(p)
        stops.append(q)
        p = q
    return PackedSpec(
        np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64), vdoc, real
    )


def assemble_packed(
    all_tokens: np.ndarray,
    spec: PackedSpec,
    *,
    cls_id: int,
    sep_id: int,
    dtype: np.dtype,
    counts: Counter[str] | None = None,
) -> InstanceBlock:
    """Build ``[CLS] ... [SEP]`` for every instance of ``spec`` (no masks yet): ``a_end`` is
    the length (one segment), ``is_random_next`` 0."""
    n = len(spec)
    vdoc = spec.virtual_doc_start
    first_doc = np.searchsorted(vdoc, spec.start, side="right") - 1
    last_doc = np.searchsorted(vdoc, spec.end - 1, side="right") - 1
    opens = spec.start == vdoc[first_doc]
    lengths = spec.end - spec.start - opens + 2
    offsets = np.cumsum(lengths) - lengths
    # one segment per document an instance holds, in the virtual stream
    n_seg = last_doc - first_doc + 1
    inst = np.repeat(np.arange(n), n_seg)
    seg_first = np.cumsum(n_seg) - n_seg
    doc = first_doc[inst] + (np.arange(int(n_seg.sum())) - seg_first[inst])
    v_lo = np.maximum(spec.start[inst], vdoc[doc] + 1)
    v_hi = np.minimum(spec.end[inst], vdoc[doc + 1])
    seg_len = v_hi - v_lo
    source = spec.real_doc_start[doc] + (v_lo - vdoc[doc] - 1)
    # the virtual stream's layout is the instance's: content where it is, [SEP] elsewhere
    target = offsets[inst] + 1 + (v_lo - spec.start[inst] - opens[inst])
    tokens = np.full(int(lengths.sum()), sep_id, dtype=dtype)
    tokens[offsets] = cls_id
    tokens[segment_index(target, seg_len)] = gather_segments(all_tokens, source, seg_len)
    info = np.zeros((n, 4), dtype=np.uint16)
    info[:, 0] = lengths
    info[:, 1] = lengths
    if counts is not None:
        counts["document_boundaries"] += int((n_seg - 1).sum())
        counts["multi_document_instances"] += int((n_seg > 1).sum())
    empty_ids = np.zeros(0, dtype=dtype)
    return InstanceBlock(tokens, info, np.zeros(0, dtype=np.uint16), empty_ids)
