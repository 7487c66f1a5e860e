"""The Apache Beam job: documents -> tokenized documents -> instances -> WebDataset shards.

Stages (each a labelled step; every DoFn counts what it reads and drops)::

    ListRanges -> ReadTokenize (a range: read, tokenize)  spill files + refs by (split, bucket)
      -> GroupByBucket (references) -> CreateInstances (all phases, all dupes)
                                                           part files + refs by shard
      -> GroupByShard (references) -> WriteShards -> (with the statistics) WriteManifests

Only references go through the runner's groupings; documents and instances travel through
storage (the output's ``_spill`` and ``<phase>/_parts`` folders), so memory is bounded by
what one task holds (a range's spill buffer, a bucket, a shard) on every runner, whatever
the corpus size. The direct runner holds a grouping's whole input in memory.

Determinism: every random choice draws from a generator seeded by a stable hash of the run
seed and what it decides (bucket, phase, split, dupe, shard), documents are sorted by id
inside a bucket and blocks by bucket inside a shard, and nothing depends on element order,
bundle size, worker count or runner. So the same inputs, config and seed give byte-identical
shards on DirectRunner (in-process or multi-processing), DaskRunner, Flink, Spark or
Dataflow.

Balance: a bucket deals its instances, shuffled, round-robin over all shards starting at a
hashed offset (and continuing from one dupe pass to the next), so every shard gets instances
from every bucket (no document clumps) and shard sizes differ by at most the number of
buckets.
"""

from __future__ import annotations

import itertools
import json
import logging
import posixpath
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from bertpipe import fsio
from bertpipe.config import to_dict
from bertpipe.errors import BertpipeError
from bertpipe.preprocessing.config import OPERATIONAL_KEYS, PhaseConfig, PreprocessConfig
from bertpipe.preprocessing.dedup import (
    REASONS,
    DropRef,
    FindDuplicatesFn,
    RangeQuality,
    RecordRef,
    ResolveDuplicatesFn,
    Samples,
    WriteSamplesFn,
    order_key,
    sample_rank,
)
from bertpipe.preprocessing.instances import DocumentSet, TokenizedDoc, assemble, create_pairs
from bertpipe.preprocessing.masking import MaskingSpec, mask_block
from bertpipe.preprocessing.packing import SentenceTable, assemble_packed, pack_sentences
from bertpipe.preprocessing.ranges import ReadRange
from bertpipe.preprocessing.readers import Document, read_documents
from bertpipe.preprocessing.shard_format import (
    FORMAT_NAME,
    NUM_MASKED,
    RANDOM_NEXT,
    SCHEMA_VERSION,
    InstanceBlock,
    TarStats,
    token_dtype,
    write_tar,
)
from bertpipe.seeding import rng_for, stable_hash, stable_unit

log = logging.getLogger(__name__)

__all__ = [
    "PartRef",
    "Plan",
    "SpillRef",
    "TaskFailedError",
    "build_pipeline",
    "manifest_url",
    "parts_folder",
    "progress_folder",
    "resume_folder",
    "shard_name",
    "spill_folder",
]

NAMESPACE = "bertpipe.preprocess"
SPILL_BYTES = 64 << 20
"""Tokenized documents a read task buffers before writing them to its spill file."""
PART_FLUSH_BYTES = 64 << 20
"""A bucket's instances buffered (per shard) before they are written as parts."""
CHUNK_INSTANCES = 8192
"""Instances assembled and masked at a time (bounds the scratch memory of a bucket)."""
SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class Plan:
    """Everything the workers need, fixed before the pipeline starts (and picklable)."""

    cfg: PreprocessConfig
    root: str
    """The inputs' common folder (document ids are relative to it)."""
    num_files: int
    num_buckets: int
    shards: dict[str, dict[str, int]]
    """phase name -> split -> number of shards."""
    tokenizer_url: str
    """Where workers load the tokenizer from (any fsspec URL they can reach)."""
    tokenizer_sha256: str
    """Workers refuse a tokenizer with another checksum."""
    vocab_size: int
    special_ids: dict[str, int]
    continuation_ids: tuple[int, ...]
    """Ids of ``##`` pieces (for whole-word masking)."""
    continuing: bool = False
    """The job continues a stopped one in its output (tasks it finished are not run again)."""
    eval_index_url: str | None = None
    """Decontamination: where workers load the evaluation sets' n-grams from."""
    dedup_partitions: int = 1
    """Partitions of the deduplication keys (as many as buckets: memory per task stays flat)."""
    report_only: bool = False
    """``bertpipe preprocess --dry-run-quality``: documents are checked and counted, and no
    instance is made; they are spilled only for deduplication to take its removals out of
    the counts (as the job does where it makes instances)."""

    def phase(self, name: str) -> PhaseConfig:
        return next(p for p in self.cfg.phases if p.name == name)

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab_size)


class PartRef(NamedTuple):
    """Where a bucket's instances for one shard lie in the bucket's part file."""

    bucket: int
    dupe: int
    piece: int
    url: str
    offset: int
    length: int
    instances: int = 0
    tokens: int = 0
    masked: int = 0
    """Sizes of the block's arrays: a shard writer allocates the shard once and fills it."""

    def read(self) -> bytes:
        return _read_range(self.url, self.offset, self.length)


def _read_range(url: str, offset: int, length: int) -> bytes:
    """Bytes ``offset:offset + length`` of ``url``: one ranged request on an object store
    (a file opened for reading there fetches a whole block ahead, 50 MB with s3fs: every
    writer reading its slices of a part file would fetch the rest of the file each time)."""
    fs, path = fsio.to_fs(url)
    data = fs.cat_file(path, start=offset, end=offset + length)
    if len(data) != length:
        raise OSError(f"{url}: read {len(data)} of {length} bytes at offset {offset}")
    return bytes(data)


def spill_folder(output: str) -> str:
    """Scratch folder of the tokenized documents, one file per read range (removed when the
    run completes)."""
    return fsio.join(output, "_spill")


def progress_folder(output: str) -> str:
    """Scratch folder of the markers a driver counts for progress: one empty file per read
    range, training bucket and shard done (removed when the run completes)."""
    return fsio.join(output, "_progress")


def _mark_done(output: str, name: str) -> None:
    fs, path = fsio.to_fs(fsio.join(progress_folder(output), name))
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    fs.pipe_file(path, b"")


def resume_folder(output: str) -> str:
    """Scratch folder of what finished tasks made (``<task>.json``: a read range's spill
    references and counts, a bucket's part references and statistics, a shard's manifest
    record), and of the job's identity (``job.json``): the same command continues a stopped
    job from them (removed when the run completes)."""
    return fsio.join(output, "_resume")


def finished(output: str, task: str) -> Any:
    """What task ``task`` recorded when it finished (None: not finished)."""
    url = fsio.join(resume_folder(output), f"{task}.json")
    try:
        with fsio.open_url(url, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None
    except ValueError:  # cut short: a record is written atomically, so not by us
        return None


def _finish(output: str, task: str, record: Any) -> None:
    """Record task ``task`` as finished (after everything it wrote is complete)."""
    fsio.atomic_write_text(fsio.join(resume_folder(output), f"{task}.json"), json.dumps(record))


def parts_folder(output: str, phase: str) -> str:
    """Scratch folder of a phase's part files (removed when the run completes)."""
    return fsio.join(output, phase, "_parts")


def shard_name(split: str, shard: int) -> str:
    return f"{split}-{shard:05d}.tar"


def manifest_url(output: str, phase: str) -> str:
    return fsio.join(output, phase, "manifest.json")


class TaskFailedError(BertpipeError):
    """A task of the job failed for another reason than its input or storage (a bug, no
    memory left): exit status 1; the message names the task's input and the cause, the
    worker's traceback is in the job's log."""

    exit_code = 1


# --------------------------------------------------------------------------- DoFns


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


class CreateInstancesFn(beam.DoFn):
    """A bucket's documents -> instances of every phase, written to a part file per phase;
    emits ``("parts", ((phase, split, shard), PartRef))`` for every shard's slice of it and
    ``("stats", (phase, {...}))``.

    Instances travel to the shard writers through storage, not through the runner's shuffle:
    only small references go through ``GroupByShard``, so a local run's memory does not grow
    with the corpus (the direct runner holds a shuffle's whole input in memory).
    """

    def __init__(self, plan: Plan) -> None:
        self._plan = plan

    def setup(self) -> None:
        plan = self._plan
        self._drops: tuple[DropRef, np.ndarray] | None = None
        self._tokenizer: Any = None
        self._samples: list[list[Any]] = []
        mcfg = plan.cfg.masking
        continuation = np.zeros(plan.vocab_size, dtype=bool)
        continuation[list(plan.continuation_ids)] = True
        self._masking = {
            p.name: MaskingSpec(
                masked_lm_prob=mcfg.masked_lm_prob,
                max_predictions_per_seq=p.max_predictions_per_seq,
                mask_id=plan.special_ids["mask"],
                vocab_size=plan.vocab_size,
                special_ids=tuple(plan.special_ids.values()),
                mask_token_prob=mcfg.mask_token_prob,
                random_token_prob=mcfg.random_token_prob,
                whole_word=mcfg.whole_word,
                continuation=continuation,
            )
            for p in plan.cfg.phases
        }

    def process(
        self, element: tuple[tuple[str, int], Iterable[SpillRef | DropRef]]
    ) -> Iterator[Any]:
        (split, bucket), values = element
        values = list(values)
        refs = [v for v in values if isinstance(v, SpillRef)]
        # (deduplication's drops reach every bucket, also those without documents: nothing)
        drops = next((v for v in values if isinstance(v, DropRef)), None)
        cfg = self._plan.cfg
        name = f"instances-{split}-{bucket:06d}"
        done = finished(cfg.output, name) if refs else []
        if done is None:  # else a continued job: the bucket's part files are complete
            out = list(self._create(split, bucket, refs, drops))
            _finish(cfg.output, name, [[kind, _plain(value)] for kind, value in out])
        else:
            out = [(kind, _revived(kind, value)) for kind, value in done]
        yield from out
        if split == "train" and refs:
            _mark_done(cfg.output, f"bucket-{bucket:06d}")

    def _create(
        self, split: str, bucket: int, refs: Iterable[SpillRef], drops: DropRef | None
    ) -> Iterator[Any]:
        plan, cfg = self._plan, self._plan.cfg
        entries = [entry for ref in sorted(refs) for entry in ref.entries()]
        removed: Counter[str] = Counter()  # the read stage counted them in: taken out again
        if drops is not None:
            entries = list(self._dropped(split, entries, drops, removed))
            yield from (("samples", (reason, items)) for reason, items in self._samples)
        # document-id order, whatever ranges and flushes the documents came in
        docs = sorted((doc for _, doc in entries), key=lambda d: d.doc_id)
        del entries
        if not docs or plan.report_only:  # (a report counts, it makes no instance)
            for phase in cfg.phases:
                yield "stats", (phase.name, ("stats", dict(removed)))
            return
        docset = DocumentSet.from_docs(docs)
        del docs
        table = SentenceTable.from_docset(docset) if cfg.objective == "mlm" else None
        for phase in cfg.phases:
            counts: Counter[str] = Counter()
            num_shards = plan.shards[phase.name][split]
            # round-robin over the shards continues from pass to pass, from a hashed start
            dealt = stable_hash(cfg.seed, "offset", phase.name, split, bucket) % num_shards
            part_url = fsio.join(parts_folder(cfg.output, phase.name), f"{split}-{bucket:06d}.bin")
            fs, path = fsio.to_fs(part_url)
            fs.makedirs(posixpath.dirname(path), exist_ok=True)
            with fs.open(path, "wb") as out:
                parts = _ShardParts(out, part_url, bucket)
                for dupe in range(cfg.dupe_factor):
                    spread = rng_for(cfg.seed, "spread", phase.name, split, bucket, dupe)
                    if table is None:
                        blocks = self._instances(docset, phase, split, bucket, dupe, counts)
                    else:
                        blocks = self._packed(docset, table, phase, split, bucket, dupe, counts)
                    for piece, block in enumerate(blocks):
                        n = len(block)
                        order = spread.permutation(n)
                        shard_of = (dealt + np.arange(n)) % num_shards
                        dealt += n
                        for shard in range(num_shards):
                            index = order[shard_of == shard]
                            if index.size:
                                parts.add(shard, (dupe, piece), block.take(index))
                        if parts.buffered >= PART_FLUSH_BYTES:
                            parts.flush()
                parts.flush()
            refs = parts.refs
            for shard, ref in refs:
                yield "parts", ((phase.name, split, shard), ref)
            Metrics.counter(NAMESPACE, f"{phase.name}_{split}_instances").inc(counts["instances"])
            stats = {f"{split}.{k}": v for k, v in counts.items()}
            yield "stats", (phase.name, ("stats", {**stats, **removed}))

    def _dropped(
        self,
        split: str,
        entries: list[tuple[int, TokenizedDoc]],
        drops: DropRef,
        removed: Counter[str],
    ) -> Iterator[tuple[int, TokenizedDoc]]:
        """``entries`` without the documents deduplication removed; those are taken out of
        the read stage's counts (``removed``), and the review samples among them yielded as
        ``("samples", ...)`` values (decoded) through :meth:`process`'s output."""
        if self._drops is None or self._drops[0] != drops:
            self._drops = (drops, drops.load())
        table = self._drops[1]
        samples = Samples(self._plan.cfg.quality.samples)
        for order, doc in entries:
            at = int(np.searchsorted(table["order"], np.uint64(order)))
            if at == len(table) or int(table["order"][at]) != order:
                yield order, doc
                continue
            row = table[at]
            removed["documents_kept"] -= 1
            removed[f"{split}_documents"] -= 1
            removed["sentences"] -= len(doc.sentence_ends)
            removed["tokens"] -= int(doc.tokens.size)
            if row["sample"]:
                reason = REASONS[int(row["reason"])]
                record = {
                    "id": doc.doc_id,
                    "reason": reason,
                    "similarity": round(float(row["sim"]), 4),
                    "kept_order_key": int(row["kept"]),
                    "text": self._decode(doc),
                }
                samples.add(reason, sample_rank(doc.doc_id), record)
        self._samples = samples.items()

    def _decode(self, doc: TokenizedDoc) -> str:
        if self._tokenizer is None:
            from bertpipe.preprocessing.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(
                self._plan.tokenizer_url, lowercase=self._plan.cfg.lowercase
            )
        starts = np.concatenate(([0], doc.sentence_ends[:-1]))
        return "\n".join(
            self._tokenizer.decode(doc.tokens[a:b].tolist())
            for a, b in zip(starts, doc.sentence_ends, strict=True)
        )

    def _instances(
        self,
        docset: DocumentSet,
        phase: PhaseConfig,
        split: str,
        bucket: int,
        dupe: int,
        counts: Counter[str],
    ) -> Iterator[InstanceBlock]:
        """One pass of the recipe over the bucket, assembled and masked in pieces of
        ``CHUNK_INSTANCES`` so that scratch memory stays bounded however large the bucket."""
        plan, cfg = self._plan, self._plan.cfg
        spec = create_pairs(
            docset,
            max_seq_length=phase.max_seq_length,
            short_seq_prob=cfg.short_seq_prob,
            random_next_prob=cfg.random_next_prob,
            rng=rng_for(cfg.seed, "pairs", phase.name, split, bucket, dupe),
            counts=counts,
        )
        counts["short_target_instances"] += int(spec.is_short_target.sum())
        counts["truncated_instances"] += int((spec.truncated > 0).sum())
        counts["truncated_tokens"] += int(spec.truncated.sum())
        mask_rng = rng_for(cfg.seed, "mask", phase.name, split, bucket, dupe)
        for start in range(0, len(spec), CHUNK_INSTANCES):
            block = assemble(
                docset.tokens,
                spec.slice(start, start + CHUNK_INSTANCES),
                cls_id=plan.special_ids["cls"],
                sep_id=plan.special_ids["sep"],
                dtype=plan.dtype,
            )
            if cfg.masking.mode == "static":
                block = mask_block(block, self._masking[phase.name], mask_rng)
            counts["instances"] += len(block)
            counts["instance_tokens"] += int(block.tokens.size)
            counts["masked_tokens"] += int(block.info[:, NUM_MASKED].sum())
            counts["random_next"] += int(block.info[:, RANDOM_NEXT].sum())
            yield block

    def _packed(
        self,
        docset: DocumentSet,
        table: SentenceTable,
        phase: PhaseConfig,
        split: str,
        bucket: int,
        dupe: int,
        counts: Counter[str],
    ) -> Iterator[InstanceBlock]:
        """One pass of the ``mlm`` objective over the bucket: its documents in a new order
        (per phase, split, bucket and dupe), packed as ``cfg.packing`` says, assembled and
        masked in pieces of ``CHUNK_INSTANCES`` as :meth:`_instances` does."""
        plan, cfg = self._plan, self._plan.cfg
        order = rng_for(cfg.seed, "pack", phase.name, split, bucket, dupe).permutation(len(table))
        spec = pack_sentences(
            table,
            order,
            max_seq_length=phase.max_seq_length,
            cross_documents=cfg.packing == "full_sentences",
            counts=counts,
        )
        mask_rng = rng_for(cfg.seed, "mask", phase.name, split, bucket, dupe)
        for start in range(0, len(spec), CHUNK_INSTANCES):
            block = assemble_packed(
                docset.tokens,
                spec.slice(start, start + CHUNK_INSTANCES),
                cls_id=plan.special_ids["cls"],
                sep_id=plan.special_ids["sep"],
                dtype=plan.dtype,
                counts=counts,
            )
            if cfg.masking.mode == "static":
                block = mask_block(block, self._masking[phase.name], mask_rng)
            counts["instances"] += len(block)
            counts["instance_tokens"] += int(block.tokens.size)
            counts["padding_tokens"] += len(block) * phase.max_seq_length - int(block.tokens.size)
            counts["masked_tokens"] += int(block.info[:, NUM_MASKED].sum())
            yield block


class _ShardParts:
    """A bucket's instances per shard, buffered and written one shard after another.

    Every piece of the recipe (``CHUNK_INSTANCES``) is dealt over all shards; writing each
    slice as its own part would give ``buckets x dupes x pieces x shards`` references (tens
    of millions, of a few instances each, for BERT's corpus). Buffered up to
    :data:`PART_FLUSH_BYTES`, a bucket has one part per shard and flush instead. A part's
    instances stay in (dupe, piece) order, so shards are the same as with one part per slice.
    """

    def __init__(self, out: Any, url: str, bucket: int) -> None:
        self._out = out
        self._url = url
        self._bucket = bucket
        self._blocks: dict[int, list[InstanceBlock]] = {}
        self._first: tuple[int, int] = (0, 0)
        self._written = 0
        self.buffered = 0
        self.refs: list[tuple[int, PartRef]] = []

    def add(self, shard: int, key: tuple[int, int], block: InstanceBlock) -> None:
        if not self._blocks:
            self._first = key
        self._blocks.setdefault(shard, []).append(block)
        self.buffered += sum(a.nbytes for a in (block.tokens, block.info, block.mlm_pos))
        self.buffered += block.mlm_ids.nbytes

    def flush(self) -> None:
        dupe, piece = self._first
        for shard in sorted(self._blocks):
            part = InstanceBlock.concat(self._blocks[shard])
            data = part.pack()
            self._out.write(data)
            ref = PartRef(
                self._bucket,
                dupe,
                piece,
                self._url,
                self._written,
                len(data),
                len(part),
                part.tokens.size,
                part.mlm_pos.size,
            )
            self.refs.append((shard, ref))
            self._written += len(data)
        self._blocks.clear()
        self.buffered = 0


class WriteShardFn(beam.DoFn):
    """All blocks of one shard -> a shuffled, byte-reproducible WebDataset tar, atomically."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan

    def process(self, element: tuple[tuple[str, str, int], Iterable[PartRef]]) -> Iterator[Any]:
        (phase, split, shard), refs = element
        cfg = self._plan.cfg
        name = shard_name(split, shard)
        done = finished(cfg.output, f"shard-{phase}-{name}")
        if done is not None and _size(fsio.join(cfg.output, phase, name)) == done["bytes"]:
            yield phase, ("shard", done)  # a continued job: the shard is written
            return
        # (bucket, dupe, piece) order, whatever order the runner delivered the parts in
        block = _gather(sorted(refs))
        order = rng_for(cfg.seed, "shuffle", phase, split, shard).permutation(len(block))
        size = cfg.instances_per_sample
        samples = (
            (f"{shard:05d}-{i:06d}", block.take(order[start : start + size]).to_sample())
            for i, start in enumerate(range(0, len(block), size))
        )
        with fsio.atomic_writer(fsio.join(cfg.output, phase, name)) as out:
            tar = TarStats(out)
            write_tar(tar, samples)
        Metrics.counter(NAMESPACE, "shards_written").inc()
        Metrics.counter(NAMESPACE, "shard_bytes").inc(tar.size)
        record = {
            "split": split,
            "file": name,
            "instances": len(block),
            "samples": -(-len(block) // size),
            "bytes": tar.size,
            "sha256": tar.sha256.hexdigest(),
        }
        _finish(cfg.output, f"shard-{phase}-{name}", record)
        _mark_done(cfg.output, f"shard-{phase}-{name}")
        yield phase, ("shard", record)


def _size(url: str) -> int | None:
    fs, path = fsio.to_fs(url)
    try:
        return int(fs.size(path))
    except FileNotFoundError:
        return None


def _plain(value: Any) -> Any:
    """A ``CreateInstancesFn`` output value as JSON (a ``PartRef`` as a list)."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _revived(kind: str, value: Any) -> Any:
    """The value :func:`_plain` made, back: ``("parts", ((phase, split, shard), PartRef))``,
    ``("stats", (phase, ("stats", {...})))``."""
    if kind == "parts":
        (phase, split, shard), ref = value
        return ((phase, split, shard), PartRef(*ref))
    if kind == "samples":
        reason, items = value
        return (reason, items)
    phase, (tag, stats) = value
    return (phase, (tag, stats))


def _gather(refs: list[PartRef]) -> InstanceBlock:
    """The parts of a shard, concatenated into arrays allocated once: a writer holds the
    shard plus one part, not the parts and their concatenation."""
    first = InstanceBlock.unpack(refs[0].read())
    arrays = (first.tokens, first.info, first.mlm_pos, first.mlm_ids)
    sizes = (
        sum(r.tokens for r in refs),
        sum(r.instances for r in refs),
        sum(r.masked for r in refs),
        sum(r.masked for r in refs),
    )
    out = [np.empty((n, *a.shape[1:]), dtype=a.dtype) for n, a in zip(sizes, arrays, strict=True)]
    at = [0, 0, 0, 0]
    for i, ref in enumerate(refs):
        part = first if i == 0 else InstanceBlock.unpack(ref.read())
        for k, a in enumerate((part.tokens, part.info, part.mlm_pos, part.mlm_ids)):
            out[k][at[k] : at[k] + len(a)] = a
            at[k] += len(a)
    if at != list(sizes):
        raise RuntimeError(f"shard parts hold {at} elements, their references say {sizes}")
    return InstanceBlock(*out)


class WriteManifestFn(beam.DoFn):
    """A phase's ``("shard", record)`` and ``("stats", counts)`` values -> ``manifest.json``."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan

    def process(
        self, element: tuple[str, Iterable[tuple[str, dict[str, Any]]]]
    ) -> Iterator[tuple[str, str]]:
        phase_name, values = element
        values = list(values)
        shards = [v for kind, v in values if kind == "shard"]
        stats = [v for kind, v in values if kind == "stats"]
        manifest = build_manifest(self._plan, phase_name, shards, stats)
        if self._plan.cfg.quality.enabled:  # the review samples written, by reason
            manifest["quality_samples"] = sorted(
                f"quality/{v}.jsonl" for kind, v in values if kind == "samples"
            )
        text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
        fsio.atomic_write_text(manifest_url(self._plan.cfg.output, phase_name), text)
        yield phase_name, text


class SumCounts(beam.CombineFn):
    """Adds up dictionaries of counts."""

    def create_accumulator(self) -> dict[str, int]:
        return {}

    def add_input(self, acc: dict[str, int], counts: dict[str, int]) -> dict[str, int]:
        for k, v in counts.items():
            acc[k] = acc.get(k, 0) + v
        return acc

    def merge_accumulators(self, accs: Iterable[dict[str, int]]) -> dict[str, int]:
        out: dict[str, int] = {}
        for acc in accs:
            self.add_input(out, acc)
        return out

    def extract_output(self, acc: dict[str, int]) -> dict[str, int]:
        return dict(sorted(acc.items()))


class Demux(beam.PTransform):
    """Splits a PCollection of ``(tag, value)`` pairs into one PCollection per tag.

    Used instead of Beam's multi-output ParDo (``with_outputs``): the DaskRunner merges all
    outputs of such a ParDo into one collection. For the same reason no DoFn here emits from
    ``finish_bundle`` (the DaskRunner drops those outputs) and ``BatchElements`` is not used.
    """

    def __init__(self, *tags: str) -> None:
        super().__init__()
        self._tags = tags

    def expand(self, pcoll: beam.PCollection) -> dict[str, beam.PCollection]:
        return {tag: pcoll | f"Select_{tag}" >> beam.FlatMap(_select, tag) for tag in self._tags}


def _select(element: tuple[str, Any], tag: str) -> Iterator[Any]:
    if element[0] == tag:
        yield element[1]


def _count(counts: Counter[str]) -> None:
    for key, value in counts.items():
        if value:
            Metrics.counter(NAMESPACE, key).inc(value)


# --------------------------------------------------------------------------- manifest


def build_manifest(
    plan: Plan,
    phase_name: str,
    shard_records: list[dict[str, Any]],
    stats_parts: list[dict[str, int]],
) -> dict[str, Any]:
    """The manifest of one phase: schema, totals per shard and split, statistics, config."""
    cfg = plan.cfg
    phase = plan.phase(phase_name)
    raw: dict[str, int] = SumCounts().merge_accumulators(stats_parts)
    splits: dict[str, Any] = {}
    for split in SPLITS:
        records = sorted(
            (
                {k: v for k, v in r.items() if k != "split"}
                for r in shard_records
                if r["split"] == split
            ),
            key=lambda r: r["file"],
        )
        splits[split] = {
            "num_shards": len(records),
            "instances": sum(r["instances"] for r in records),
            "samples": sum(r["samples"] for r in records),
            "bytes": sum(r["bytes"] for r in records),
            "shards": records,
        }
    corpus = {k: v for k, v in raw.items() if "." not in k}
    stats: dict[str, Any] = {"corpus": corpus}
    for split in SPLITS:
        part = {k.split(".", 1)[1]: v for k, v in raw.items() if k.startswith(split + ".")}
        stats[split] = _derived(part)
    return {
        "format": FORMAT_NAME,
        "schema_version": SCHEMA_VERSION,
        "phase": phase.name,
        "objective": cfg.objective,
        "packing": cfg.packing if cfg.objective == "mlm" else None,
        "max_seq_length": phase.max_seq_length,
        "max_predictions_per_seq": phase.max_predictions_per_seq,
        "masking": cfg.masking.mode,
        "token_dtype": str(plan.dtype),
        "vocab_size": plan.vocab_size,
        "special_token_ids": plan.special_ids,
        "tokenizer_sha256": plan.tokenizer_sha256,
        "instances_per_sample": cfg.instances_per_sample,
        "seed": cfg.seed,
        "num_buckets": plan.num_buckets,
        "splits": splits,
        "stats": stats,
        # what determines the data; where it was written and how it was logged do not
        "config": _data_config(cfg),
    }


def _data_config(cfg: PreprocessConfig) -> dict[str, Any]:
    """What determines the data; where it was written and how it was logged do not (nor
    quality settings that are all off: manifests from before they existed stay the same)."""
    out = {k: v for k, v in to_dict(cfg).items() if k not in OPERATIONAL_KEYS}
    if not cfg.quality.enabled:
        out.pop("quality", None)
    return out


def _derived(part: dict[str, int]) -> dict[str, Any]:
    n = part.get("instances", 0)
    tokens = part.get("instance_tokens", 0)
    passes = part.get("document_passes", 0)
    out: dict[str, Any] = dict(sorted(part.items()))
    out["mean_tokens_per_instance"] = round(tokens / n, 3) if n else 0.0
    out["masked_fraction"] = round(part.get("masked_tokens", 0) / tokens, 5) if tokens else 0.0
    out["random_next_fraction"] = round(part.get("random_next", 0) / n, 5) if n else 0.0
    out["short_target_fraction"] = round(part.get("short_target_instances", 0) / n, 5) if n else 0.0
    out["short_target_document_fraction"] = (
        round(part.get("documents_short_target", 0) / passes, 5) if passes else 0.0
    )
    out["truncated_fraction"] = round(part.get("truncated_instances", 0) / n, 5) if n else 0.0
    if "padding_tokens" in part:  # the mlm objective's packing
        padded = tokens + part["padding_tokens"]
        out["fill_fraction"] = round(tokens / padded, 5) if padded else 0.0
        out["multi_document_fraction"] = (
            round(part.get("multi_document_instances", 0) / n, 5) if n else 0.0
        )
    return out


# --------------------------------------------------------------------------- the pipeline


def build_pipeline(p: beam.Pipeline, plan: Plan, ranges: list[ReadRange]) -> beam.PCollection:
    """Add the preprocessing steps to ``p``; returns the PCollection of (phase, manifest text)."""
    cfg = plan.cfg
    phase_names = [ph.name for ph in cfg.phases]
    read = (
        p
        | "ListRanges" >> beam.Create(ranges)
        | "SpreadRanges" >> beam.Reshuffle()
        | "ReadTokenize" >> beam.ParDo(ReadTokenizeFn(plan))
        | "SplitRead" >> Demux("spill", "counts", "dedup", "samples")
    )
    bucket_inputs = read["spill"]
    counts = [read["counts"]]
    if cfg.quality.dedup.enabled:
        drops, dedup_counts = _deduplicate(plan, read["dedup"])
        bucket_inputs = (bucket_inputs, drops) | "WithDrops" >> beam.Flatten()
        counts.append(dedup_counts)
    instances = (
        bucket_inputs
        | "GroupByBucket" >> beam.GroupByKey()
        | "CreateInstances" >> beam.ParDo(CreateInstancesFn(plan))
        | "SplitInstances" >> Demux("parts", "stats", "samples")
    )
    to_manifests = [instances["stats"]]
    if cfg.quality.enabled:
        # into the manifests' grouping: Beam's DaskRunner computes only the ancestors of the
        # pipeline's last step, so a branch that ends apart from it would never run there
        written = (
            (read["samples"], instances["samples"])
            | "AllSamples" >> beam.Flatten()
            | "GroupByReason" >> beam.GroupByKey()
            | "WriteSamples" >> beam.ParDo(WriteSamplesFn(cfg.output, cfg.quality.samples))
        )
        to_manifests.append(
            written
            | "SamplesPerPhase"
            >> beam.FlatMap(lambda r: [(name, ("samples", r)) for name in phase_names])
        )
    shards = (
        instances["parts"]
        | "GroupByShard" >> beam.GroupByKey()
        | "WriteShards" >> beam.ParDo(WriteShardFn(plan))
    )
    # statistics and shard records meet the shards' phase in one grouping: the manifest of a
    # phase is written after all of its shards
    corpus_counts = (
        counts | "CorpusCounts" >> beam.Flatten() if len(counts) > 1 else counts[0]
    ) | "PerPhase" >> beam.FlatMap(lambda c: [(name, ("stats", c)) for name in phase_names])
    return (
        (shards, corpus_counts, *to_manifests)
        | "ByPhase" >> beam.Flatten()
        | "GroupByPhase" >> beam.GroupByKey()
        | "WriteManifests" >> beam.ParDo(WriteManifestFn(plan))
    )


def _deduplicate(plan: Plan, records: beam.PCollection) -> tuple[beam.PCollection, ...]:
    """The records' references -> ``((split, bucket), DropRef)`` for every bucket, and the
    deduplication's counts (see :mod:`bertpipe.preprocessing.dedup`)."""
    cfg = plan.cfg
    found = (
        records
        | "GroupByPartition" >> beam.GroupByKey()
        | "FindDuplicates" >> beam.ParDo(FindDuplicatesFn(cfg.output, cfg.quality.dedup))
        | "SplitFound" >> Demux("edges", "counts")
    )
    resolved = (
        found["edges"]
        | "KeyEdges" >> beam.Map(lambda edges: (0, edges))
        | "GroupAllEdges" >> beam.GroupByKey()
        | "ResolveDuplicates" >> beam.ParDo(ResolveDuplicatesFn(cfg.output, cfg.quality.samples))
        | "SplitResolved" >> Demux("drops", "counts")
    )
    buckets = [(split, b) for split in SPLITS for b in range(plan.num_buckets)]
    drops = resolved["drops"] | "DropsToBuckets" >> beam.FlatMap(
        lambda ref: [(key, ref) for key in buckets]
    )
    counts = (found["counts"], resolved["counts"]) | "DedupCounts" >> beam.Flatten()
    return drops, counts
