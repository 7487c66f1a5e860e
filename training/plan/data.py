"""What a planned phase's data gives each rank: shards, loader readers, batches and epochs.

Part of ``bertpipe plan`` (:mod:`bertpipe.training.plan.plan`): the manifest is read and the
blocks are partitioned by the loader's own functions
(:mod:`bertpipe.training.pretrain.data.loader`), so the figures are the ones ``pretrain`` will see.
The loader module imports webdataset: it is imported only when a manifest is read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from bertpipe import fsio

if TYPE_CHECKING:
    from bertpipe.training.pretrain.data.manifest import Manifest

__all__ = ["DataPlan", "data_plan", "read_manifest"]


def read_manifest(data_url: str) -> Manifest | None:
    """The phase folder's manifest, read and checked by the loader's own
    :func:`bertpipe.training.pretrain.data.loader.load_manifest` (so a broken folder fails here as
    it would in ``pretrain``), or None when the folder has no ``manifest.json``."""
    if not fsio.exists(fsio.join(data_url, "manifest.json")):
        return None
    from bertpipe.training.pretrain.data.manifest import load_manifest

    return load_manifest(data_url)


@dataclass(frozen=True)
class DataPlan:
    """What a phase's training split gives each rank (None fields: data not found)."""

    url: str
    found: bool
    num_shards: int | None = None
    instances: int | None = None
    """Training instances (sequences) in the phase's shards."""
    shards_per_rank: float | None = None
    """num_shards / N (the loader places whole shards and cuts the rest into block runs)."""
    readers_per_rank: int | None = None
    """Loader readers per rank: max(1, data.num_workers)."""
    min_instances_per_reader: int | None = None
    """Instances of the reader with the fewest: every reader yields as many batches as it."""
    batches_per_rank_per_epoch: int | None = None
    """floor(min_instances_per_reader / micro batch) x readers_per_rank."""
    steps_per_epoch: int | None = None
    """floor(batches_per_rank_per_epoch / accumulation) optimizer steps."""
    instances_used_per_epoch: int | None = None
    """batches_per_rank_per_epoch x micro batch x N; the rest of the split is dropped."""
    epochs: float | None = None
    """Samples the phase consumes / instances in the split."""


def data_plan(
    url: str,
    manifest: Manifest | None,
    world_size: int,
    num_workers: int,
    micro_batch: int,
    accumulation: int,
    samples: int,
) -> DataPlan:
    """Shards and batches per rank as the loader (:mod:`bertpipe.training.pretrain.data.loader`)
    will cut them.

    The loader splits the training split's blocks into N x W reader groups of about equal
    instance counts (:func:`bertpipe.training.pretrain.data.loader.partition_blocks`, W = max(1,
    num_workers)) and every reader yields ``floor(min over readers of instances / b)`` batches per
    epoch, so a rank gets W times that and no rank waits for another at the end of an epoch."""
    if manifest is None:
        return DataPlan(url=url, found=False)
    from bertpipe.training.pretrain.data.loader import partition_blocks
    from bertpipe.training.pretrain.data.manifest import DataError

    if "train" not in manifest.splits:
        raise DataError(f"{manifest.url} has no 'train' split")
    readers = max(1, num_workers)
    sizes = manifest.block_sizes("train")
    groups = partition_blocks(sizes, world_size * readers)
    per_reader = [sum(int(sizes[r.shard][r.start : r.stop].sum()) for r in g) for g in groups]
    smallest = min(per_reader)
    batches = smallest // micro_batch * readers
    instances = sum(int(s.sum()) for s in sizes)
    return DataPlan(
        url=url,
        found=True,
        num_shards=len(sizes),
        instances=instances,
        shards_per_rank=len(sizes) / world_size,
        readers_per_rank=readers,
        min_instances_per_reader=smallest,
        batches_per_rank_per_epoch=batches,
        steps_per_epoch=batches // accumulation,
        instances_used_per_epoch=batches * micro_batch * world_size,
        epochs=samples / instances if instances else None,
    )
