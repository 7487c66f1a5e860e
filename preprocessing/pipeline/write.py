"""The write stage: a shard's parts gathered into one WebDataset tar, and each phase's
``manifest.json`` from the shards' statistics."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics

from bertpipe import fsio
from bertpipe.config import to_dict
from bertpipe.preprocessing.config import OPERATIONAL_KEYS, PreprocessConfig
from bertpipe.preprocessing.pipeline.layout import (
    NAMESPACE,
    SPLITS,
    PartRef,
    Plan,
    SumCounts,
    _finish,
    _mark_done,
    _size,
    finished,
    manifest_url,
    shard_name,
)
from bertpipe.preprocessing.shard_format import (
    FORMAT_NAME,
    SCHEMA_VERSION,
    InstanceBlock,
    TarStats,
    write_tar,
)
from bertpipe.seeding import rng_for

log = logging.getLogger(__name__)


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
