"""The Apache Beam job: documents -> tokenized documents -> instances -> WebDataset shards,
one module per stage (:mod:`~.read`, :mod:`~.instances`, :mod:`~.write`; the job's layout on
storage in :mod:`~.layout`; corpus quality in :mod:`bertpipe.preprocessing.dedup`), composed
here by :func:`build_pipeline`.

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

import logging

import apache_beam as beam

from bertpipe.preprocessing.dedup import WriteSamplesFn
from bertpipe.preprocessing.pipeline.instances import CreateInstancesFn
from bertpipe.preprocessing.pipeline.layout import (
    NAMESPACE,
    SPLITS,
    Demux,
    PartRef,
    Plan,
    SumCounts,
    TaskFailedError,
    finished,
    manifest_url,
    parts_folder,
    progress_folder,
    resume_folder,
    shard_name,
    spill_folder,
)
from bertpipe.preprocessing.pipeline.quality import deduplicate
from bertpipe.preprocessing.pipeline.read import ReadTokenizeFn, SpillRef
from bertpipe.preprocessing.pipeline.write import WriteManifestFn, WriteShardFn, build_manifest
from bertpipe.preprocessing.ranges import ReadRange

log = logging.getLogger(__name__)

__all__ = [
    "NAMESPACE",
    "SPLITS",
    "CreateInstancesFn",
    "Demux",
    "PartRef",
    "Plan",
    "ReadTokenizeFn",
    "SpillRef",
    "SumCounts",
    "TaskFailedError",
    "WriteManifestFn",
    "WriteShardFn",
    "build_manifest",
    "build_pipeline",
    "finished",
    "manifest_url",
    "parts_folder",
    "progress_folder",
    "resume_folder",
    "shard_name",
    "spill_folder",
]


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
        drops, dedup_counts = deduplicate(plan, read["dedup"])
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
