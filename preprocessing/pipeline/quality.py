"""The quality stage: exact and near-duplicate documents found across the whole corpus
(:mod:`bertpipe.preprocessing.dedup`'s DoFns over references only), one of each kept, the
drops sent to the buckets they would have gone to, and the review samples written. The
per-document filters and decontamination run in the read stage, on each range."""

from __future__ import annotations

import apache_beam as beam

from bertpipe.preprocessing.dedup import (
    FindDuplicatesFn,
    ResolveDuplicatesFn,
)
from bertpipe.preprocessing.pipeline.layout import SPLITS, Demux, Plan

__all__ = ["deduplicate"]


def deduplicate(plan: Plan, records: beam.PCollection) -> tuple[beam.PCollection, ...]:
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
