"""The read stage: a byte range of an input file read, split into documents and sentences,
tokenized once, and spilled (tokenized documents go to storage, references go on), with
the quality filters of the range applied on the way."""

from __future__ import annotations

import itertools
import logging
import posixpath
from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from bertpipe import fsio
from bertpipe.errors import BertpipeError
from bertpipe.preprocessing.dedup import (
    RangeQuality,
    RecordRef,
    order_key,
)
from bertpipe.preprocessing.instances import TokenizedDoc
from bertpipe.preprocessing.pipeline.layout import (
    NAMESPACE,
    Plan,
    TaskFailedError,
    _count,
    _finish,
    _mark_done,
    _read_range,
    finished,
    spill_folder,
)
from bertpipe.preprocessing.ranges import ReadRange
from bertpipe.preprocessing.readers import Document, read_documents
from bertpipe.seeding import stable_hash, stable_unit

log = logging.getLogger(__name__)


SPILL_BYTES = 64 << 20
"""Tokenized documents a read task buffers before writing them to its spill file."""


class ReadTokenizeFn(beam.DoFn):
    """A :class:`ReadRange` -> its documents, tokenized, spilled to the range's spill file
    grouped by ``(split, bucket)``; emits ``("spill", ((split, bucket), SpillRef))`` per
    group and flush, then ``("counts", {...})``.

    The tokenized corpus goes to storage, not through the runner: only the references are
    grouped by bucket, so no runner ever holds the corpus. A worker holds at most
    :data:`SPILL_BYTES` of tokenized documents before writing them out.
    """

    def __init__(self, plan: Plan) -> None:
        self._plan = plan

    def setup(self) -> None:
        from bertpipe.preprocessing.tokenizer import (
            CorpusEncoder,
            TokenizerMismatchError,
            load_tokenizer,
            tokenizer_checksum,
        )

        plan = self._plan
        tokenizer = load_tokenizer(plan.tokenizer_url, lowercase=plan.cfg.lowercase)
        if tokenizer_checksum(tokenizer) != plan.tokenizer_sha256:
            raise TokenizerMismatchError(
                f"tokenizer {plan.tokenizer_url} changed while the job was running"
            )
        self._encoder = CorpusEncoder(tokenizer)
        self._dtype = plan.dtype
        self._index = None
        if plan.eval_index_url:
            from bertpipe.preprocessing.quality import EvalIndex

            with fsio.open_url(plan.eval_index_url, "rb") as f:
                self._index = EvalIndex.from_bytes(f.read())

    def process(self, task: ReadRange) -> Iterator[Any]:
        try:
            yield from self._read(task)
        except BertpipeError:  # an input gone, a tokenizer changed: they name what
            raise
        except Exception as exc:
            what = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            unit = "row groups" if self._plan.cfg.input.format == "parquet" else "bytes"
            where = "" if task.end is None else f" ({unit} {task.start}-{task.end})"
            raise TaskFailedError(
                f"reading {fsio.redact(task.url)}{where} failed: {type(exc).__name__}: "
                f"{fsio.redact(what)}"
            ) from exc

    def _read(self, task: ReadRange) -> Iterator[Any]:
        cfg = self._plan.cfg
        name = f"read-{task.index:06d}"
        done = finished(cfg.output, name)
        if done is not None:  # a continued job: the range's spill file is complete
            for split, bucket, url, offset, length in done["refs"]:
                yield "spill", ((split, bucket), SpillRef(url, offset, length))
            for partition, url, offset, count in done.get("dedup", []):
                yield "dedup", (partition, RecordRef(url, offset, count))
            for reason, items in done.get("samples", []):
                yield "samples", (reason, items)
            _count(Counter(done["counts"]))
            yield "counts", done["counts"]
            return
        counts: Counter[str] = Counter()
        spill = _Spill(fsio.join(spill_folder(cfg.output), f"{task.index:06d}.bin"))
        refs: list[list[Any]] = []
        quality = None
        if cfg.quality.enabled:
            quality = RangeQuality(
                cfg.quality, self._index, cfg.output, task.index, self._plan.dedup_partitions
            )
        docs = read_documents(
            task.url,
            cfg.input,
            counts,
            root=self._plan.root,
            start=task.start,
            end=task.end,
            offset_ids=task.split,
        )
        batch: list[tuple[Document, int, Any]] = []
        try:
            for ordinal, doc in enumerate(docs):
                counts["documents_read"] += 1
                verdict = None
                if quality is not None:
                    verdict = quality.check(doc.doc_id, doc.sentences, counts)
                    if verdict.reason is not None:
                        continue
                    if verdict.sentences is not None:
                        doc = Document(doc.doc_id, verdict.sentences)
                batch.append((doc, order_key(task.index, ordinal), verdict))
                if len(batch) == cfg.tokenize_batch_documents:
                    self._tokenize(batch, spill, counts, quality)
                    batch = []
                    if spill.buffered >= SPILL_BYTES:
                        for ref in spill.flush():
                            refs.append([*ref[0], *ref[1]])
                            yield "spill", ref
            self._tokenize(batch, spill, counts, quality)
            for ref in spill.flush():
                refs.append([*ref[0], *ref[1]])
                yield "spill", ref
        finally:
            spill.close()
        record: dict[str, Any] = {"refs": refs}
        if quality is not None:
            dedup = quality.finish()
            record["dedup"] = [[p, *ref] for p, ref in dedup]
            record["samples"] = quality.samples.items()
            yield from (("dedup", item) for item in dedup)
            yield from (("samples", (reason, items)) for reason, items in record["samples"])
        _count(counts)
        Metrics.counter(NAMESPACE, "text_bytes_read").inc(task.text_bytes)
        _finish(cfg.output, name, {**record, "counts": dict(counts)})
        _mark_done(cfg.output, name)
        yield "counts", dict(counts)

    def _tokenize(
        self,
        batch: list[tuple[Document, int, Any]],
        spill: _Spill,
        counts: Counter[str],
        quality: RangeQuality | None,
    ) -> None:
        if not batch:
            return
        cfg = self._plan.cfg
        ids = self._encoder.encode([s for doc, _, _ in batch for s in doc.sentences])
        pos = 0
        for doc, order, verdict in batch:
            doc_ids = [x for x in ids[pos : pos + len(doc.sentences)] if x]
            pos += len(doc.sentences)
            counts["sentences_empty_after_tokenization"] += len(doc.sentences) - len(doc_ids)
            if len(doc_ids) < (cfg.min_sentences or 1):  # resolved by the config
                counts["documents_too_short"] += 1
                continue
            lengths = np.fromiter(map(len, doc_ids), dtype=np.int32, count=len(doc_ids))
            total = int(lengths.sum())
            tokens = np.fromiter(itertools.chain.from_iterable(doc_ids), self._dtype, total)
            split = (
                "heldout" if stable_unit("heldout", doc.doc_id) < cfg.heldout_fraction else "train"
            )
            bucket = stable_hash(cfg.seed, "bucket", doc.doc_id) % self._plan.num_buckets
            counts["documents_kept"] += 1
            counts[f"{split}_documents"] += 1
            counts["sentences"] += len(doc_ids)
            counts["tokens"] += total
            tokenized = TokenizedDoc(doc.doc_id, tokens, np.cumsum(lengths, dtype=np.int32))
            if not self._plan.report_only or cfg.quality.dedup.enabled:
                spill.add((split, bucket), order, tokenized.pack())
            if quality is not None:
                quality.keep(order & 0xFFFFFFFF, verdict)


class SpillRef(NamedTuple):
    """Where some of a bucket's tokenized documents lie in a spill file."""

    url: str
    offset: int
    length: int

    def documents(self) -> Iterator[TokenizedDoc]:
        return (doc for _, doc in self.entries())

    def entries(self) -> Iterator[tuple[int, TokenizedDoc]]:
        """``(order key, document)`` of each document (see :mod:`.dedup`)."""
        data = _read_range(self.url, self.offset, self.length)
        pos = 0
        while pos < len(data):
            size = int.from_bytes(data[pos : pos + 4], "little")
            order = int.from_bytes(data[pos + 4 : pos + 12], "little")
            yield order, TokenizedDoc.unpack(data[pos + 12 : pos + 12 + size])
            pos += 12 + size


class _Spill:
    """Packed documents buffered per key, written out in key order to one file."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.buffered = 0
        self._buffers: dict[tuple[str, int], list[bytes]] = {}
        self._out: Any = None
        self._written = 0

    def add(self, key: tuple[str, int], order: int, packed: bytes) -> None:
        head = len(packed).to_bytes(4, "little") + order.to_bytes(8, "little")
        self._buffers.setdefault(key, []).append(head + packed)
        self.buffered += len(packed) + 12

    def flush(self) -> list[tuple[tuple[str, int], SpillRef]]:
        if not self._buffers:
            return []
        if self._out is None:
            fs, path = fsio.to_fs(self.url)
            fs.makedirs(posixpath.dirname(path), exist_ok=True)
            self._out = fs.open(path, "wb")
        refs = []
        for key in sorted(self._buffers):
            data = b"".join(self._buffers[key])
            self._out.write(data)
            refs.append((key, SpillRef(self.url, self._written, len(data))))
            self._written += len(data)
        self._buffers.clear()
        self.buffered = 0
        self._out.flush()
        return refs

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
