"""The shard format: round trips, reproducible tars, no pickle, WebDataset compatibility."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import webdataset as wds

from bertpipe.preprocessing.shard_format import (
    MEMBERS,
    InstanceBlock,
    gather_segments,
    read_shard,
    tar_bytes,
    token_dtype,
)


def _block(n: int = 5, seed: int = 0) -> InstanceBlock:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 20, n)
    a_end = lengths // 2
    counts = np.minimum(3, lengths - 3)
    tokens = rng.integers(5, 1000, int(lengths.sum())).astype(np.uint16)
    pos = np.concatenate(
        [
            np.sort(rng.choice(np.arange(1, n - 1), c, replace=False))
            for n, c in zip(lengths, counts, strict=False)
        ]
    )
    info = np.stack([lengths, a_end, counts, rng.integers(0, 2, n)], axis=1).astype(np.uint16)
    return InstanceBlock(
        tokens,
        info,
        pos.astype(np.uint8),
        rng.integers(5, 1000, int(counts.sum())).astype(np.uint16),
    )


def _same(a: InstanceBlock, b: InstanceBlock) -> bool:
    return all(
        np.array_equal(getattr(a, f), getattr(b, f))
        for f in ("tokens", "info", "mlm_pos", "mlm_ids")
    )


def test_pack_sample_take_concat_round_trips() -> None:
    block = _block(7)
    assert _same(InstanceBlock.unpack(block.pack()), block)
    assert _same(InstanceBlock.from_sample(block.to_sample()), block)
    order = np.array([6, 0, 3])
    taken = block.take(order)
    for j, i in enumerate(order):
        x, y = taken.instance(j), block.instance(int(i))
        assert np.array_equal(x.input_ids, y.input_ids) and np.array_equal(
            x.mlm_labels, y.mlm_labels
        )
    parts = block.split(3)
    assert [len(p) for p in parts] == [3, 3, 1]
    assert _same(InstanceBlock.concat(parts), block)


def test_tar_is_reproducible_and_pickle_free(tmp_path: Path) -> None:
    samples = [(f"00000-{i:06d}", _block(4, seed=i).to_sample()) for i in range(3)]
    data = tar_bytes(samples)
    assert data == tar_bytes(list(reversed(samples)))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = tar.getmembers()
    assert {m.mtime for m in members} == {0} and {m.uname for m in members} == {""}
    assert all(m.name.split(".", 1)[1] in MEMBERS for m in members)
    path = tmp_path / "train-00000.tar"
    path.write_bytes(data)
    read = list(read_shard(str(path)))
    assert [k for k, _ in read] == [k for k, _ in samples]
    pairs = zip(read, samples, strict=True)
    assert all(_same(b, InstanceBlock.from_sample(s)) for (_, b), (_, s) in pairs)


def test_webdataset_reads_our_shards(tmp_path: Path) -> None:
    samples = [(f"00000-{i:06d}", _block(4, seed=i).to_sample()) for i in range(3)]
    path = tmp_path / "s.tar"
    path.write_bytes(tar_bytes(samples))
    got = list(wds.WebDataset(str(path), shardshuffle=False))
    assert [s["__key__"] for s in got] == [k for k, _ in samples]
    assert _same(InstanceBlock.from_sample(got[1]), InstanceBlock.from_sample(samples[1][1]))


def test_helpers() -> None:
    data = np.arange(100)
    assert gather_segments(data, np.array([5, 50, 0]), np.array([2, 0, 3])).tolist() == [
        5,
        6,
        0,
        1,
        2,
    ]
    assert token_dtype(30522) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.int32
