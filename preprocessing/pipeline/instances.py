"""The instances stage: a bucket of tokenized documents becomes every phase's instances
(NSP pairs or packed sentences, every dupe pass, masked), dealt round-robin over the shards
and written as parts."""

from __future__ import annotations

import logging
import posixpath
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from bertpipe import fsio
from bertpipe.preprocessing.config import PhaseConfig
from bertpipe.preprocessing.dedup import (
    REASONS,
    DropRef,
    Samples,
    sample_rank,
)
from bertpipe.preprocessing.instances import DocumentSet, TokenizedDoc, assemble, create_pairs
from bertpipe.preprocessing.masking import MaskingSpec, mask_block
from bertpipe.preprocessing.packing import SentenceTable, assemble_packed, pack_sentences
from bertpipe.preprocessing.pipeline.layout import (
    NAMESPACE,
    PartRef,
    Plan,
    _finish,
    _mark_done,
    _plain,
    _revived,
    finished,
    parts_folder,
)
from bertpipe.preprocessing.pipeline.read import SpillRef
from bertpipe.preprocessing.shard_format import (
    NUM_MASKED,
    RANDOM_NEXT,
    InstanceBlock,
)
from bertpipe.seeding import rng_for, stable_hash

log = logging.getLogger(__name__)


PART_FLUSH_BYTES = 64 << 20
"""A bucket's instances buffered (per shard) before they are written as parts."""


CHUNK_INSTANCES = 8192
"""Instances assembled and masked at a time (bounds the scratch memory of a bucket)."""


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
