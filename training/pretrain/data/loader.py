"""The pre-training data loader: equal batches per rank, deterministic, exactly resumable.

A phase folder (``manifest.json`` + WebDataset tar shards, see docs/data-format.md) is read
by R ranks x W loader workers = P *slots* (W = 1 when ``num_workers`` is 0). Everything is
planned from the manifest alone (:mod:`bertpipe.training.pretrain.data.manifest`), with no
communication:

- **Partition** (the same every epoch): shards are placed whole, largest first, on the least
  loaded slot while they fit its share; the shards left over are cut into contiguous runs of
  blocks (WebDataset samples) so that every slot ends up with about the same number of
  instances. No block belongs to two slots. Each slot yields ``batches_per_slot`` =
  min over slots of ``instances // micro_batch_size`` batches per epoch, so every rank gets
  exactly ``W * batches_per_slot`` and DDP/ZeRO never waits at the end of an epoch; the rest
  (usually well under 1%) is dropped, a different part every epoch.
- **Order** (per epoch, from :func:`bertpipe.seeding.rng_for`): the groups of runs are dealt
  to slots by a permutation, each slot reads its runs in a shuffled order, blocks are mixed
  in windows of ``shuffle_blocks`` blocks (one permutation of their instances per window) and
  consecutive micro-batches are cut from that instance stream. A slot's batch j is therefore
  instances ``[j*B, (j+1)*B)`` of its stream, which lets a resumed loader jump straight to the
  window holding the next batch without decoding what came before.
- **Workers**: a ``torch.utils.data.DataLoader`` over an ``IterableDataset`` asks its W
  workers for batches round-robin; every worker yields the same count per epoch, so a rank's
  batch k is batch k // W of worker k % W. After resuming at k consumed batches, new worker w
  plays worker (w + k) % W, so the DataLoader's round robin continues where it stopped.
  The workers are started, stopped and killed by :mod:`bertpipe.training.pretrain.data.workers`.

A slot's shards are read by :func:`bertpipe.training.pretrain.data.shards.read_shards` (whole,
checksum verified, the next one prefetched; transient errors retried). The loader checks what their
blocks hold: instance counts against the manifest's and token or label ids inside the vocabulary
(:class:`~bertpipe.training.pretrain.data.manifest.DataError`, exit status 2, naming the shard), and
with dynamic masking (shards written with ``masking: none``) masks every block."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from bertpipe.fsio import RetryPolicy
from bertpipe.preprocessing.masking import MaskingSpec, mask_block
from bertpipe.preprocessing.shard_format import InstanceBlock
from bertpipe.seeding import rng_for
from bertpipe.training.pretrain.config import DataConfig, EvalConfig, PhaseSpec
from bertpipe.training.pretrain.data.collate import (
    DynamicMasking,
    check_ids,
    cut_batches,
    pack_batch,
    unpack_batch,
)
from bertpipe.training.pretrain.data.manifest import DataError, Manifest, load_manifest
from bertpipe.training.pretrain.data.shards import ShardBlocks, read_shards
from bertpipe.training.pretrain.data.workers import worker_batches, worker_init_fn

__all__ = [
    "DynamicMasking",
    "PretrainingData",
    "Run",
    "build_pretraining_data",
    "partition_blocks",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Run:
    """Blocks ``start:stop`` of shard number ``shard`` (its index in the split's list)."""

    shard: int
    start: int
    stop: int


def partition_blocks(block_sizes: Sequence[np.ndarray], num_slots: int) -> list[list[Run]]:
    """Split the blocks of all shards into ``num_slots`` groups of about equal instance counts.

    Whole shards first (largest first, onto the least loaded group while it stays within its
    share, plus 1% or one block of slack); the leftover shards' blocks, in shard order, are
    cut into contiguous runs for the groups still short of their share. Depends only on the
    block sizes, never on the epoch.
    """
    sizes = np.array([int(b.sum()) for b in block_sizes], dtype=np.int64)
    target = float(sizes.sum()) / num_slots
    biggest_block = max((int(b.max()) for b in block_sizes if b.size), default=0)
    slack = min(float(biggest_block), target / 100)
    loads = np.zeros(num_slots, dtype=np.int64)
    groups: list[list[Run]] = [[] for _ in range(num_slots)]
    pool: list[int] = []
    for shard in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        slot = int(np.argmin(loads))
        if loads[slot] + sizes[shard] <= target + slack:
            groups[slot].append(Run(shard, 0, len(block_sizes[shard])))
            loads[slot] += sizes[shard]
        else:
            pool.append(shard)
    if not pool:
        return groups
    pool.sort()
    refs = [(s, b) for s in pool for b in range(len(block_sizes[s]))]
    bounds = np.concatenate(([0], np.cumsum(np.concatenate([block_sizes[s] for s in pool]))))
    need = np.maximum(target - loads, 0.0)
    needy = np.flatnonzero(need > 0)
    cuts = np.cumsum(need[needy]) * (bounds[-1] / need[needy].sum())
    right = np.clip(np.searchsorted(bounds, cuts), 1, len(bounds) - 1)
    nearest = np.where(cuts - bounds[right - 1] < bounds[right] - cuts, right - 1, right)
    nearest[-1] = len(refs)
    start = 0
    for slot, stop in zip(needy.tolist(), nearest.tolist(), strict=True):
        for shard, blocks in itertools.groupby(refs[start:stop], key=lambda r: r[0]):
            numbers = [b for _, b in blocks]
            groups[slot].append(Run(shard, numbers[0], numbers[-1] + 1))
        start = max(start, stop)
    return groups


@dataclass(frozen=True)
class _Plan:
    """Everything a slot needs to produce its batches (picklable, for loader workers)."""

    manifest: Manifest
    split: str
    micro_batch_size: int
    seed: int
    num_slots: int
    shuffle_blocks: int
    groups: tuple[tuple[Run, ...], ...]
    batches_per_slot: int
    block_sizes: tuple[np.ndarray, ...]
    masking: MaskingSpec | None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    verify_checksums: bool = True

    def slot_runs(self, epoch: int, slot: int) -> list[Run]:
        """The runs slot ``slot`` reads in ``epoch``, in reading order."""
        deal = rng_for(self.seed, "loader-groups", self.split, epoch, self.num_slots)
        group = int(deal.permutation(self.num_slots)[slot])
        runs = self.groups[group]
        key = (self.seed, "loader-runs", self.split, epoch, self.num_slots, group)
        order = rng_for(*key).permutation(len(runs))
        return [runs[i] for i in order]

    def slot_batches(
        self, epoch: int, slot: int, skip: int = 0, limit: int | None = None
    ) -> Iterator[dict[str, Tensor]]:
        """Batches ``skip, skip + 1, ..., batches_per_slot - 1`` of ``slot`` in ``epoch``
        (only the first ``limit`` of them, if given)."""
        refs = [(r.shard, b) for r in self.slot_runs(epoch, slot) for b in range(r.start, r.stop)]
        window = self.shuffle_blocks
        per_window = [
            sum(int(self.block_sizes[s][b]) for s, b in refs[i : i + window])
            for i in range(0, len(refs), window)
        ]
        ends = np.cumsum(per_window)
        B = self.micro_batch_size
        count = self.batches_per_slot - skip
        if limit is not None:
            count = min(count, limit)
        first = int(np.searchsorted(ends, skip * B, side="right"))  # first window still needed
        offset = skip * B - (int(ends[first - 1]) if first else 0)
        # the window holding the last instance needed: no shard after it is read (prefetched)
        last = int(np.searchsorted(ends, (skip + count) * B - 1, side="right"))
        blocks = self._read_blocks(epoch, refs[first * window : (last + 1) * window])

        def windows() -> Iterator[InstanceBlock]:
            for w in range(first, len(per_window)):
                mixed = InstanceBlock.concat(list(itertools.islice(blocks, window)))
                key = (self.seed, "loader-window", self.split, epoch, self.num_slots, slot, w)
                order = rng_for(*key).permutation(len(mixed))
                yield mixed.take(order[offset:] if w == first else order)

        pad, longest = self.manifest.special_token_ids["pad"], self.manifest.max_seq_length
        try:
            yield from cut_batches(windows(), B, count, pad, longest)
        finally:
            blocks.close()

    def _read_blocks(
        self, epoch: int, refs: list[tuple[int, int]]
    ) -> Generator[InstanceBlock, None, None]:
        """Decode (and mask, for dynamic masking) the blocks ``refs``, in that order: each
        shard read whole, the next one prefetched meanwhile (:func:`read_shards`)."""
        shards = self.manifest.splits[self.split]
        runs = [(shard, [b for _, b in g]) for shard, g in itertools.groupby(refs, lambda r: r[0])]
        reads = read_shards(
            [(shards[shard], wanted) for shard, wanted in runs],
            retry=self.retry,
            verify_checksums=self.verify_checksums,
            manifest_url=self.manifest.url,
        )
        with contextlib.closing(reads):  # cancels a prefetch in progress
            for (shard, _), blocks in zip(runs, reads, strict=True):
                yield from self._checked(epoch, shard, blocks)

    def _checked(self, epoch: int, shard: int, blocks: ShardBlocks) -> Iterator[InstanceBlock]:
        """The blocks of shard number ``shard``, checked against the manifest and the
        vocabulary (and masked, for dynamic masking)."""
        info = self.manifest.splits[self.split][shard]
        for number, key, block in blocks:
            expected = int(self.block_sizes[shard][number])
            if len(block) != expected:
                raise DataError(
                    f"{info.url}: sample {key} holds {len(block)} instances, the manifest "
                    f"{self.manifest.url} says {expected}: rerun `bertpipe preprocess`"
                )
            check_ids(block, self.manifest.vocab_size, f"shard {info.url} sample {key}")
            if self.masking is not None:
                rng = rng_for(self.seed, "dynamic-mask", epoch, info.file, key)
                block = mask_block(block, self.masking, rng)
            yield block


class _SlotDataset(IterableDataset):
    """One rank's batches, read by ``workers`` DataLoader workers (see the module doc) or,
    with ``workers`` 1, in the training process.

    Starts at (``epoch``, ``consumed`` batches of this rank) and runs through the epochs
    forever, or stops after ``limit`` batches of this rank.
    """

    def __init__(
        self, plan: _Plan, rank: int, workers: int, epoch: int, consumed: int, limit: int | None
    ) -> None:
        super().__init__()
        self._plan, self._rank, self._workers = plan, rank, workers
        self._epoch, self._consumed, self._limit = epoch, consumed, limit

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        info = get_worker_info()  # None: iterated in the training process (W = 1)
        new_id = info.id if info is not None else 0
        W, c = self._workers, self._consumed
        worker = (new_id + c) % W  # the logical worker this one plays
        skip = c // W + (1 if worker < c % W else 0)  # its batches the trainer already had
        slot = self._rank * W + worker
        mine = None if self._limit is None else max(0, -(-(self._limit - new_id) // W))
        stream: Iterator[dict[str, Tensor]] = (
            batch
            for e in itertools.count(self._epoch)
            for batch in self._plan.slot_batches(
                e, slot, skip if e == self._epoch else 0, mine if e == self._epoch else None
            )
        )
        if mine is not None:
            stream = itertools.islice(stream, mine)
        for batch in stream:
            yield batch if info is None else pack_batch(batch)


class PretrainingData:
    """One rank's micro-batches of a phase folder's split (a torchtitan-style ``Stateful``).

    Training (``train=True``): ``iter(data)`` yields batches forever, epoch after epoch,
    starting at the current state; every rank gets ``batches_per_epoch`` batches per epoch.
    ``state_dict()`` is ``{"epoch": e, "batches": c}``, c the batches of epoch e already
    handed out, and a fresh loader given it by ``load_state_dict`` yields exactly the batches
    that would have come next. Evaluation (``train=False``): each ``iter(data)`` yields the
    same ``eval_batches`` batches (epoch 0, at most ``max_batches``), and the state is unused.

    ``source`` is the phase folder's URL (its manifest is read and validated here) or its
    manifest already read (:func:`~bertpipe.training.pretrain.data.manifest.load_manifest`,
    :attr:`PhaseData.parsed <bertpipe.training.pretrain.data.manifest.PhaseData.parsed>`): then
    nothing is read before the first batch.

    Batches are dicts of int64 tensors, see :mod:`bertpipe.training.pretrain.data.collate`.
    """

    def __init__(
        self,
        source: str | Manifest,
        split: str = "train",
        micro_batch_size: int = 32,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        num_workers: int = 0,
        shuffle_blocks: int = 4,
        masking: DynamicMasking | None = None,
        train: bool = True,
        max_batches: int | None = None,
        pin_memory: bool = False,
        read_retries: int = 4,
        read_retry_delay: float = 0.5,
        verify_checksums: bool = True,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if micro_batch_size < 1 or shuffle_blocks < 1 or num_workers < 0:
            raise ValueError("micro_batch_size and shuffle_blocks must be >= 1, num_workers >= 0")
        if max_batches is not None and max_batches < 1:
            raise ValueError("max_batches must be at least 1 (None: the whole split)")
        retry = RetryPolicy(retries=read_retries, delay=read_retry_delay)
        if isinstance(source, Manifest):
            self.manifest = m = source
        else:
            self.manifest = m = load_manifest(source, retry)
        if split not in self.manifest.splits:
            raise DataError(
                f"{self.manifest.url} has no split {split!r} (it has "
                f"{sorted(self.manifest.splits)}): check the data config"
            )
        self.rank, self.world_size, self.num_workers = rank, world_size, num_workers
        self.train, self.max_batches, self.pin_memory = train, max_batches, pin_memory
        workers = max(1, num_workers)
        slots = world_size * workers
        sizes = self.manifest.block_sizes(split)
        groups = partition_blocks(sizes, slots)
        per_group = [sum(int(sizes[r.shard][r.start : r.stop].sum()) for r in g) for g in groups]
        batches = min(per_group) // micro_batch_size
        self.instances_in_split = int(sum(int(s.sum()) for s in sizes))
        if batches == 0:
            raise DataError(
                f"split {split!r} of {self.manifest.url} has {self.instances_in_split} instances "
                f"in {sum(len(s) for s in sizes)} blocks: too few for one batch of "
                f"{micro_batch_size} per reader ({world_size} ranks x {workers} worker(s)); use "
                "fewer loader workers, a smaller micro batch or more data"
            )
        spec = None
        if m.masking == "none":
            masking = masking or DynamicMasking.from_config(m.masking_config)
            spec = masking.spec(m.vocab_size, m.max_predictions_per_seq, m.special_token_ids)
        self._plan = _Plan(
            manifest=self.manifest,
            split=split,
            micro_batch_size=micro_batch_size,
            seed=seed,
            num_slots=slots,
            shuffle_blocks=shuffle_blocks,
            groups=tuple(tuple(g) for g in groups),
            batches_per_slot=batches,
            block_sizes=tuple(sizes),
            masking=spec,
            retry=retry,
            verify_checksums=verify_checksums,
        )
        self.split = split
        self.micro_batch_size = micro_batch_size
        self.batches_per_epoch = batches * workers
        """Batches every rank gets per epoch."""
        self.instances_per_epoch = self.batches_per_epoch * micro_batch_size * world_size
        """Instances all ranks together use per epoch (the rest of the split is dropped)."""
        self._epoch = 0
        self._batches = 0
        self._readers = workers
        log.info("%s: %s", self.manifest.url, self.summary())

    @property
    def eval_batches(self) -> int:
        """Batches one evaluation pass (``train=False``) yields on every rank."""
        cap = self.max_batches or self.batches_per_epoch
        return min(cap, self.batches_per_epoch)

    def summary(self) -> dict[str, Any]:
        """Figures for logs and MLflow: the epoch's size against the split's."""
        return {
            "split": self.split,
            "shards": len(self._plan.block_sizes),
            "readers": f"{self.world_size} rank(s) x {self._readers}",
            "masking": "dynamic" if self._plan.masking else "static",
            "batches_per_epoch": self.batches_per_epoch,
            "instances_per_epoch": self.instances_per_epoch,
            "instances_in_split": self.instances_in_split,
            "dropped_per_epoch": self.instances_in_split - self.instances_per_epoch,
        }

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": e, "batches": c}``: c batches of epoch e were handed out on this rank."""
        return {"epoch": self._epoch, "batches": self._batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after ``state`` (call before ``iter()``)."""
        epoch, batches = int(state["epoch"]), int(state["batches"])
        if epoch < 0 or batches < 0:
            raise ValueError(f"invalid loader state {state}")
        if batches >= self.batches_per_epoch:
            log.warning(
                "loader state %s is past this layout's %d batches per epoch (world size, "
                "workers or batch size changed?): continuing with epoch %d",
                state,
                self.batches_per_epoch,
                epoch + 1,
            )
            epoch, batches = epoch + 1, 0
        self._epoch, self._batches = epoch, batches

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        # closed explicitly: closing this generator stops the loader's workers at once
        if not self.train:
            with contextlib.closing(self._batches_from(0, 0, self.eval_batches)) as batches:
                yield from batches
            return
        with contextlib.closing(self._batches_from(self._epoch, self._batches, None)) as batches:
            for batch in batches:
                self._batches += 1
                if self._batches == self.batches_per_epoch:
                    self._epoch, self._batches = self._epoch + 1, 0
                yield batch

    def _batches_from(
        self, epoch: int, consumed: int, limit: int | None
    ) -> Generator[dict[str, Tensor], None, None]:
        pin = self.pin_memory and torch.cuda.is_available()
        workers = max(1, self.num_workers)
        dataset = _SlotDataset(self._plan, self.rank, workers, epoch, consumed, limit)
        if self.num_workers == 0:
            for batch in dataset:
                yield {k: v.pin_memory() for k, v in batch.items()} if pin else batch
            return
        # The DataLoader draws its workers' base seed from `generator`; without one it draws
        # from the global torch RNG, which then differs after a resume (restored RNG + one
        # draw) from the uninterrupted run (dropout masks shift). Seeded from the position.
        generator = torch.Generator()
        generator.manual_seed(
            int(
                rng_for(
                    self._plan.seed, "loader-torch", self.split, self.rank, epoch, consumed
                ).integers(0, 2**63 - 1)
            )
        )
        loader = DataLoader(
            dataset,
            batch_size=None,
            num_workers=self.num_workers,
            pin_memory=pin,
            in_order=True,
            worker_init_fn=worker_init_fn(),
            generator=generator,
        )
        # closed explicitly: closing it stops the workers at once
        with contextlib.closing(worker_batches(loader)) as packed:
            for batch in packed:
                yield unpack_batch(batch)


def build_pretraining_data(
    phase: PhaseSpec,
    data: DataConfig,
    *,
    rank: int,
    world_size: int,
    seed: int,
    evaluation: EvalConfig | None = None,
    masking: DynamicMasking | None = None,
    manifest: Manifest | None = None,
) -> PretrainingData:
    """The endless training loader of ``phase`` for this rank; with ``evaluation``, its
    held-out loader instead: one pass of at most ``evaluation.max_batches``, read in the
    training process (no workers forked at every evaluation; 50 batches take milliseconds).

    The one place where the loaders of pre-training, its evaluation and ``bertpipe bench
    train`` are configured. Evaluation reads its blocks unmixed (``shuffle_blocks`` 1): the
    batches it takes are a fixed subset whatever the training's shuffle. Batches are not
    pinned here: :class:`~bertpipe.training.pretrain.batches.BatchPrep` pins what it sends to a GPU
    (after unpadding, which makes new tensors).

    ``manifest``: ``phase.data``'s manifest if already read (the trainer's
    :attr:`PhaseData.parsed <bertpipe.training.pretrain.data.manifest.PhaseData.parsed>`): it is not
    read again."""
    train = evaluation is None
    return PretrainingData(
        phase.data if manifest is None else manifest,
        "train" if train else data.heldout_split,
        phase.micro_batch_size,
        rank=rank,
        world_size=world_size,
        seed=seed,
        num_workers=data.num_workers if train else 0,
        shuffle_blocks=data.shuffle_blocks if train else 1,
        masking=masking,
        train=train,
        max_batches=None if evaluation is None else evaluation.max_batches or None,
        pin_memory=False,
        read_retries=data.read_retries,
        read_retry_delay=data.read_retry_delay,
        verify_checksums=data.verify_checksums,
    )
