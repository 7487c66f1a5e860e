"""The Beam side of corpus quality (:mod:`bertpipe.preprocessing.quality`): the read stage's
per-range state, the grouping of duplicates across the corpus, and the review samples.

Flow, with only references and small arrays going through the runner's groupings (as
everywhere in the job: memory stays flat whatever the corpus size)::

    ReadTokenize: filters, decontamination (removed at once); for each kept document its
        exact key and LSH band keys -> a records file per range, partitioned by key, and
        its MinHash signature -> a signatures file per range
      -> GroupByPartition (references) -> FindDuplicates: records of one partition sorted
        by key; equal exact keys are duplicate pairs, equal band keys candidate pairs,
        verified on the signatures' estimate of the Jaccard similarity  -> edges
      -> GroupAll -> ResolveDuplicates: clusters (connected components of the edges), the
        first document of each in corpus order kept -> the drops file (scratch)
      -> to every bucket (joined with its spill references in GroupByBucket):
        CreateInstances skips the dropped documents

A document's place in corpus order is its *order key*, ``read range << 32 | ordinal`` (the
ranges are planned in file order, a range's documents are read in order), so "the first"
is the same on every runner and for every worker count.
"""

from __future__ import annotations

import heapq
import json
import posixpath
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import apache_beam as beam
import numpy as np

from bertpipe import fsio
from bertpipe.preprocessing.quality import DocQuality, EvalIndex, Verdict, band_keys
from bertpipe.preprocessing.quality_config import DedupConfig, QualityConfig
from bertpipe.seeding import stable_hash

__all__ = [
    "DROP",
    "DropRef",
    "FindDuplicatesFn",
    "RangeQuality",
    "RecordRef",
    "ResolveDuplicatesFn",
    "WriteSamplesFn",
    "order_key",
    "quality_folder",
    "samples_folder",
]

RECORD = np.dtype([("key", "<u8"), ("order", "<u8")])
"""A key (exact: lowest bit 1; a band's: 0) and the document holding it."""
EDGE = np.dtype([("a", "<u8"), ("b", "<u8"), ("sim", "<f4"), ("exact", "u1")])
"""Two documents found to be duplicates (``a`` first in corpus order)."""
DROP = np.dtype(
    [("order", "<u8"), ("kept", "<u8"), ("sim", "<f4"), ("reason", "u1"), ("sample", "u1")]
)
"""A removed document, the document its cluster keeps, its greatest estimated similarity to
another member, why (:data:`REASONS`) and whether it is one of the review samples."""
REASONS = ("exact_duplicate", "near_duplicate")
SMALL_GROUP = 16
"""Band groups up to this size verify every pair; larger ones each member against the
group's first and its neighbour in corpus order."""


def quality_folder(output: str) -> str:
    """Scratch folder of the records, signatures and drops (removed when the run completes)."""
    return fsio.join(output, "_quality")


def samples_folder(output: str) -> str:
    """The removed documents kept for review, ``<reason>.jsonl`` (part of the output)."""
    return fsio.join(output, "quality")


def order_key(range_index: int, ordinal: int) -> int:
    return (range_index << 32) | ordinal


def _sig_url(output: str, range_index: int) -> str:
    return fsio.join(quality_folder(output), f"sig-{range_index:06d}.bin")


class RecordRef(NamedTuple):
    """One partition's records in a range's records file."""

    url: str
    offset: int
    count: int

    def records(self) -> np.ndarray:
        fs, path = fsio.to_fs(self.url)
        size = self.count * RECORD.itemsize
        data = fs.cat_file(path, start=self.offset, end=self.offset + size)
        return np.frombuffer(data, dtype=RECORD, count=self.count)


class DropRef(NamedTuple):
    """The drops file (:data:`DROP` rows sorted by order key)."""

    url: str
    count: int

    def load(self) -> np.ndarray:
        if not self.count:
            return np.zeros(0, dtype=DROP)
        with fsio.open_url(self.url, "rb") as f:
            return np.frombuffer(f.read(), dtype=DROP, count=self.count)


def sample_rank(doc_id: str) -> int:
    """Review samples are the removed documents of lowest rank (a stable hash of the id)."""
    return stable_hash("quality-sample", doc_id)


class Samples:
    """The ``k`` lowest-ranked items per reason (mergeable: the result does not depend on the
    order items arrive in)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.kept: dict[str, list[tuple[int, str]]] = {}

    def add(self, reason: str, rank: int, record: dict[str, Any]) -> None:
        if not self.k:
            return
        heap = self.kept.setdefault(reason, [])
        item = (-rank, json.dumps(record, sort_keys=True, ensure_ascii=False))
        if len(heap) < self.k:
            heapq.heappush(heap, item)
        elif item > heap[0]:
            heapq.heapreplace(heap, item)

    def items(self) -> list[list[Any]]:
        """``[reason, [[rank, json], ...]]`` (JSON-able, for a resume record)."""
        return [[r, sorted([-n, t] for n, t in heap)] for r, heap in sorted(self.kept.items())]


# --------------------------------------------------------------------------- read stage


class RangeQuality:
    """The quality state of one read range: its documents' verdicts, records and signatures,
    counts and samples."""

    def __init__(
        self,
        cfg: QualityConfig,
        index: EvalIndex | None,
        output: str,
        range_index: int,
        partitions: int,
    ) -> None:
        self.cfg = cfg
        self.checker = DocQuality(cfg, index)
        self.output = output
        self.range_index = range_index
        self.partitions = partitions
        self.samples = Samples(cfg.samples)
        self._keys: list[np.ndarray] = []
        self._orders: list[np.ndarray] = []
        self._sigs: dict[int, np.ndarray] = {}

    def check(self, doc_id: str, sentences: list[str], counts: Counter[str]) -> Verdict:
        """The document's verdict; a removed one is counted and maybe sampled here."""
        verdict = self.checker.check(sentences)
        if verdict.eval_sets:
            for name in verdict.eval_sets:
                counts[f"contaminated_by/{name}"] += 1
        if verdict.reason is not None:
            counts[f"removed_{verdict.reason}"] += 1
            record = {"id": doc_id, "reason": verdict.reason, "text": "\n".join(sentences)}
            if verdict.eval_sets:
                record["eval_sets"] = verdict.eval_sets
            self.samples.add(verdict.reason, sample_rank(doc_id), record)
        elif verdict.sentences is not None:
            counts["contaminated_sentences_removed"] += len(sentences) - len(verdict.sentences)
            counts["documents_partly_decontaminated"] += 1
        return verdict

    def keep(self, ordinal: int, verdict: Verdict) -> None:
        """A document that made it into the spill takes part in deduplication."""
        dedup = self.cfg.dedup
        order = order_key(self.range_index, ordinal)
        keys = []
        if verdict.exact:
            keys.append(np.array([verdict.exact], dtype=np.uint64))
        if verdict.signature is not None:
            keys.append(band_keys(verdict.signature, dedup.bands, dedup.rows))
            self._sigs[ordinal] = verdict.signature
        if keys:
            k = np.concatenate(keys)
            self._keys.append(k)
            self._orders.append(np.full(len(k), order, dtype=np.uint64))

    def finish(self) -> list[tuple[int, RecordRef]]:
        """Write the range's records (by partition) and signatures; their references."""
        if not self._keys:
            return []
        records = np.empty(sum(len(k) for k in self._keys), dtype=RECORD)
        records["key"] = np.concatenate(self._keys)
        records["order"] = np.concatenate(self._orders)
        part = ((records["key"] >> np.uint64(1)) % np.uint64(self.partitions)).astype(np.int64)
        order = np.argsort(part, kind="stable")
        records, part = records[order], part[order]
        url = fsio.join(quality_folder(self.output), f"records-{self.range_index:06d}.bin")
        fsio.atomic_write_bytes(url, records.tobytes())
        if self._sigs:
            width = self.cfg.dedup.num_perm
            table = np.zeros((max(self._sigs) + 1, width), dtype="<u2")
            for ordinal, sig in self._sigs.items():
                table[ordinal] = sig
            fsio.atomic_write_bytes(_sig_url(self.output, self.range_index), table.tobytes())
        bounds = np.searchsorted(part, np.arange(self.partitions + 1))
        refs = []
        for p in range(self.partitions):
            lo, hi = int(bounds[p]), int(bounds[p + 1])
            if hi > lo:
                refs.append((p, RecordRef(url, lo * RECORD.itemsize, hi - lo)))
        return refs


# --------------------------------------------------------------------------- grouping


class FindDuplicatesFn(beam.DoFn):
    """A partition's records -> ``("edges", bytes)`` (:data:`EDGE` rows) and ``("counts",
    {...})``: equal exact keys are duplicates; equal band keys are candidates, kept when the
    signatures' estimate of their Jaccard similarity reaches the threshold."""

    def __init__(self, output: str, cfg: DedupConfig) -> None:
        self._output = output
        self._cfg = cfg

    def process(self, element: tuple[int, Iterable[RecordRef]]) -> Iterator[Any]:
        _, refs = element
        records = np.concatenate([ref.records() for ref in sorted(refs)])
        records = records[np.lexsort((records["order"], records["key"]))]
        key, order = records["key"], records["order"]
        start = np.concatenate(([True], key[1:] != key[:-1]))
        group = np.cumsum(start) - 1
        first = np.flatnonzero(start)
        size = np.diff(np.append(first, len(key)))
        member = ~start & (size[group] >= 2)
        exact = (key & np.uint64(1)) == 1
        edges = [_edges(order[first[group[member & exact]]], order[member & exact], 1.0, 1)]
        counts: Counter[str] = Counter()
        a, b = _candidates(order, group, first, size, member & ~exact)
        if a.size:
            counts["near_duplicate_checks"] += int(a.size)
            sim = self._similarity(a, b)
            ok = sim >= self._cfg.threshold
            counts["near_duplicate_checks_passed"] += int(ok.sum())
            edges.append(_edges(a[ok], b[ok], sim[ok], 0))
        yield "edges", np.concatenate(edges).tobytes()
        yield "counts", dict(counts)

    def _similarity(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """The signatures' estimate for each pair (the fraction of equal bins)."""
        docs = np.unique(np.concatenate((a, b)))
        width = self._cfg.num_perm * 2
        ranges = (docs >> np.uint64(32)).astype(np.int64)
        ordinals = (docs & np.uint64(0xFFFFFFFF)).astype(np.int64)
        urls = [_sig_url(self._output, int(r)) for r in ranges]
        fs, _ = fsio.to_fs(urls[0])
        paths = [fsio.to_fs(u)[1] for u in urls]
        starts = (ordinals * width).tolist()
        ends = [s + width for s in starts]
        blobs = fs.cat_ranges(paths, starts, ends, on_error="raise")
        sigs = np.frombuffer(b"".join(blobs), dtype="<u2").reshape(len(docs), -1)
        ia, ib = np.searchsorted(docs, a), np.searchsorted(docs, b)
        return (sigs[ia] == sigs[ib]).mean(axis=1).astype(np.float32)


def _edges(a: np.ndarray, b: np.ndarray, sim: Any, exact: int) -> np.ndarray:
    out = np.empty(len(a), dtype=EDGE)
    out["a"], out["b"], out["sim"], out["exact"] = a, b, sim, exact
    return out


def _candidates(
    order: np.ndarray, group: np.ndarray, first: np.ndarray, size: np.ndarray, member: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Pairs to verify in the band groups (``member``: a band record after its group's
    first): every pair of a small group; in a larger one each member with the group's first
    and with its predecessor. Unique, ``a`` before ``b`` in corpus order."""
    at = np.flatnonzero(member)
    pairs = [
        np.stack((order[first[group[at]]], order[at]), axis=1),
        np.stack((order[at - 1], order[at]), axis=1),
    ]
    for g in np.flatnonzero((size > 2) & (size <= SMALL_GROUP)):
        if not member[first[g] + 1]:
            continue  # an exact key's group
        docs = order[first[g] : first[g] + size[g]]
        i, j = np.triu_indices(len(docs), k=2)
        pairs.append(np.stack((docs[i], docs[j]), axis=1))
    both = np.concatenate(pairs)
    both = both[both[:, 0] != both[:, 1]]
    if not both.size:
        return both[:, 0], both[:, 1]
    both = np.unique(np.sort(both, axis=1), axis=0)
    return both[:, 0], both[:, 1]


class ResolveDuplicatesFn(beam.DoFn):
    """All edges -> the drops file; emits ``("drops", DropRef)`` and ``("counts", {...})``.

    Clusters are the connected components of the edges (so near-duplicates chain); each keeps
    its first document in corpus order. A removed document is an exact duplicate when its
    text equals an earlier document's, else a near-duplicate."""

    def __init__(self, output: str, samples: int) -> None:
        self._output = output
        self._samples = samples

    def process(self, element: tuple[int, Iterable[bytes]]) -> Iterator[Any]:
        _, blobs = element
        edges = np.concatenate([np.frombuffer(b, dtype=EDGE) for b in blobs])
        nodes = np.unique(np.concatenate((edges["a"], edges["b"])))
        ia, ib = np.searchsorted(nodes, edges["a"]), np.searchsorted(nodes, edges["b"])
        root = _components(len(nodes), ia, ib)
        removed = np.flatnonzero(root != np.arange(len(nodes)))
        exact = np.zeros(len(nodes), dtype=bool)
        exact[ib[edges["exact"] == 1]] = True
        sim = np.zeros(len(nodes), dtype=np.float32)
        np.maximum.at(sim, ia, edges["sim"])
        np.maximum.at(sim, ib, edges["sim"])
        drops = np.empty(len(removed), dtype=DROP)
        drops["order"] = nodes[removed]
        drops["kept"] = nodes[root[removed]]
        drops["sim"] = sim[removed]
        drops["reason"] = np.where(exact[removed], 0, 1)
        drops["sample"] = 0
        for code in range(len(REASONS)):
            which = np.flatnonzero(drops["reason"] == code)
            rank = _rank(drops["order"][which])
            drops["sample"][which[np.argsort(rank, kind="stable")[: self._samples]]] = 1
        url = fsio.join(quality_folder(self._output), "drops.bin")
        fsio.atomic_write_bytes(url, drops.tobytes())
        counts = {f"removed_{r}": int((drops["reason"] == i).sum()) for i, r in enumerate(REASONS)}
        counts["duplicate_clusters"] = len(np.unique(root[removed]))
        yield "drops", DropRef(url, len(drops))
        yield "counts", counts


def _rank(orders: np.ndarray) -> np.ndarray:
    x = orders ^ np.uint64(0x243F6A8885A308D3)
    x = (x ^ (x >> np.uint64(31))) * np.uint64(0x7FB5D329728EA185)
    return x ^ (x >> np.uint64(27))


def _components(n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Each node's component, named by its lowest node (label propagation with pointer
    jumping; nodes sorted by corpus order, so the lowest is the first)."""
    label = np.arange(n)
    while True:
        low = np.minimum(label[a], label[b])
        new = label.copy()
        np.minimum.at(new, a, low)
        np.minimum.at(new, b, low)
        new = new[new]  # jump: a node takes its label's label
        if np.array_equal(new, label):
            return label
        label = new


# --------------------------------------------------------------------------- samples


class WriteSamplesFn(beam.DoFn):
    """A reason's candidate samples (``[[rank, json], ...]`` lists) -> the ``k`` of lowest rank
    in ``quality/<reason>.jsonl``."""

    def __init__(self, output: str, k: int) -> None:
        self._output = output
        self._k = k

    def process(self, element: tuple[str, Iterable[list[list[Any]]]]) -> Iterator[str]:
        reason, lists = element
        best = heapq.nsmallest(self._k, (tuple(item) for items in lists for item in items))
        text = "".join(record + "\n" for _, record in best)
        url = fsio.join(samples_folder(self._output), f"{reason}.jsonl")
        fs, path = fsio.to_fs(url)
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        fsio.atomic_write_text(url, text)
        yield reason
