"""The pre-training loader: equal batches per rank, disjoint reads, determinism, exact resume,
collation, dynamic masking, manifest validation. Shards are tiny and written here."""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bertpipe import fsio
from bertpipe.errors import TransientError
from bertpipe.preprocessing.shard_format import InstanceBlock, write_tar
from bertpipe.training.pretrain.config import DataConfig, EvalConfig, PhaseSpec
from bertpipe.training.pretrain.data.collate import (
    BATCH_KEYS,
    collate_block,
    pack_batch,
    unpack_batch,
)
from bertpipe.training.pretrain.data.loader import (
    PretrainingData,
    build_pretraining_data,
    partition_blocks,
)
from bertpipe.training.pretrain.data.manifest import DataError

SPECIALS = {"pad": 5, "unk": 1, "cls": 2, "sep": 3, "mask": 4}
VOCAB = 1000
MAX_SEQ = 40


def make_instances(ids: Sequence[int], masked: bool, seed: int) -> list[dict[str, Any]]:
    """Instances whose tokens 1 and 2 spell their id; random lengths 8..MAX_SEQ."""
    rng = np.random.default_rng(seed)
    out = []
    for ident in ids:
        length = int(rng.integers(8, MAX_SEQ + 1))
        a_end = int(rng.integers(5, length - 2))
        tokens = rng.integers(10, VOCAB, length).astype(np.int64)
        tokens[0], tokens[a_end - 1], tokens[-1] = SPECIALS["cls"], SPECIALS["sep"], SPECIALS["sep"]
        tokens[1], tokens[2] = 10 + ident // 900, 10 + ident % 900
        original = tokens.copy()
        positions = np.zeros(0, dtype=np.int64)
        if masked:
            choices = [i for i in range(3, length - 1) if i != a_end - 1]
            positions = np.sort(rng.choice(choices, size=3, replace=False))
            tokens[positions] = SPECIALS["mask"]
        out.append(
            {
                "id": ident,
                "tokens": tokens,
                "original": original,
                "a_end": a_end,
                "positions": positions,
                "random_next": int(rng.integers(0, 2)),
            }
        )
    return out


def to_block(instances: Sequence[dict[str, Any]]) -> InstanceBlock:
    info = np.array(
        [[len(x["tokens"]), x["a_end"], len(x["positions"]), x["random_next"]] for x in instances],
        dtype=np.uint16,
    )
    return InstanceBlock(
        tokens=np.concatenate([x["tokens"] for x in instances]).astype(np.uint16),
        info=info,
        mlm_pos=np.concatenate([x["positions"] for x in instances]).astype(np.uint8),
        mlm_ids=np.concatenate([x["original"][x["positions"]] for x in instances]).astype(
            np.uint16
        ),
    )


def write_phase(
    folder: str,
    train: Sequence[int],
    heldout: Sequence[int] = (6,),
    ips: int = 4,
    masked: bool = True,
    **manifest_overrides: Any,
) -> dict[int, dict[str, Any]]:
    """Shards with the given instance counts and their manifest; returns id -> instance."""
    everything: dict[int, dict[str, Any]] = {}
    splits: dict[str, Any] = {}
    next_id = 0
    for split, counts in (("train", train), ("heldout", heldout)):
        records = []
        for shard, count in enumerate(counts):
            instances = make_instances(range(next_id, next_id + count), masked, seed=next_id)
            everything.update({x["id"]: x for x in instances})
            next_id += count
            samples = [
                (f"{shard:05d}-{i:06d}", to_block(instances[start : start + ips]).to_sample())
                for i, start in enumerate(range(0, count, ips))
            ]
            name = f"{split}-{shard:05d}.tar"
            with fsio.atomic_writer(fsio.join(folder, name)) as f:
                size = write_tar(f, samples)
            records.append(
                {"file": name, "instances": count, "samples": len(samples), "bytes": size}
            )
        splits[split] = {
            "num_shards": len(records),
            "instances": sum(counts),
            "samples": sum(r["samples"] for r in records),
            "shards": records,
        }
    manifest = {
        "format": "bertpipe.instances",
        "schema_version": 1,
        "phase": "seq40",
        "max_seq_length": MAX_SEQ,
        "max_predictions_per_seq": 20,
        "masking": "static" if masked else "none",
        "token_dtype": "uint16",
        "vocab_size": VOCAB,
        "special_token_ids": SPECIALS,
        "instances_per_sample": ips,
        "seed": 0,
        "num_buckets": 4,
        "splits": splits,
        "stats": {},
        "config": {"masking": {"mode": "static" if masked else "none", "masked_lm_prob": 0.15}},
        **manifest_overrides,
    }
    fsio.atomic_write_text(fsio.join(folder, "manifest.json"), json.dumps(manifest))
    return everything


@pytest.fixture
def phase_url() -> str:
    return f"memory://loader-{uuid.uuid4().hex}/seq40"


UNEVEN = (37, 23, 41, 19, 30, 11)


def ids_of(batch: dict[str, torch.Tensor]) -> list[int]:
    ids = batch["input_ids"]
    return ((ids[:, 1] - 10) * 900 + ids[:, 2] - 10).tolist()


def take(data: PretrainingData, n: int) -> list[dict[str, torch.Tensor]]:
    return list(itertools.islice(iter(data), n))


def assert_same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys() == set(BATCH_KEYS)
        for key in BATCH_KEYS:
            torch.testing.assert_close(x[key], y[key], rtol=0, atol=0)


# ---------------------------------------------------------------- partition and epochs


def test_partition_covers_every_block_once_and_balances() -> None:
    sizes = [np.array([4] * (n // 4) + ([n % 4] if n % 4 else [])) for n in UNEVEN]
    for slots in (1, 2, 3, 4, 5, 8, 16):
        groups = partition_blocks(sizes, slots)
        seen = sorted((r.shard, b) for g in groups for r in g for b in range(r.start, r.stop))
        assert seen == [(s, b) for s in range(len(sizes)) for b in range(len(sizes[s]))]
        loads = [sum(int(sizes[r.shard][r.start : r.stop].sum()) for r in g) for g in groups]
        assert max(loads) - min(loads) <= 2 * 4, (slots, loads)
    # enough equal shards: every slot reads whole shards only
    equal = [np.array([256] * 10)] * 8
    for g in partition_blocks(equal, 4):
        assert len(g) == 2 and all(r.start == 0 and r.stop == 10 for r in g)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_equal_batches_disjoint_ranks_and_coverage(phase_url: str, world_size: int) -> None:
    write_phase(phase_url, UNEVEN)
    ranks = [
        PretrainingData(phase_url, micro_batch_size=3, rank=r, world_size=world_size, seed=7)
        for r in range(world_size)
    ]
    n = ranks[0].batches_per_epoch
    assert all(d.batches_per_epoch == n for d in ranks)
    seen: list[int] = []
    for data in ranks:
        batches = take(data, n)
        assert len(batches) == n and all(b["input_ids"].shape[0] == 3 for b in batches)
        assert data.state_dict() == {"epoch": 1, "batches": 0}
        seen += [i for b in batches for i in ids_of(b)]
    assert len(seen) == len(set(seen)) == ranks[0].instances_per_epoch == n * 3 * world_size
    total = sum(UNEVEN)
    assert ranks[0].instances_in_split == total
    assert set(seen) <= set(range(total))
    assert total - len(seen) <= world_size * (4 + 3)  # about a block plus a batch per rank
    summary = ranks[0].summary()
    assert summary["dropped_per_epoch"] == total - len(seen)


def test_workers_read_disjoint_data_through_dataloader(phase_url: str) -> None:
    write_phase(phase_url, UNEVEN)
    ranks = [
        PretrainingData(phase_url, micro_batch_size=3, rank=r, world_size=2, num_workers=2)
        for r in range(2)
    ]
    n = ranks[0].batches_per_epoch
    assert n == ranks[1].batches_per_epoch and n % 2 == 0
    seen = [i for data in ranks for b in take(data, n) for i in ids_of(b)]
    assert len(seen) == len(set(seen)) == ranks[0].instances_per_epoch
    assert sum(UNEVEN) - len(seen) <= 4 * (4 + 3)


def test_deterministic_and_reshuffled_each_epoch(phase_url: str) -> None:
    write_phase(phase_url, UNEVEN)
    first = PretrainingData(phase_url, micro_batch_size=4, seed=3)
    n = first.batches_per_epoch
    epoch0 = take(first, n)
    epoch1 = take(first, n)  # the same iterator rolls over into epoch 1
    assert_same(take(PretrainingData(phase_url, micro_batch_size=4, seed=3), n), epoch0)
    order0 = [i for b in epoch0 for i in ids_of(b)]
    order1 = [i for b in epoch1 for i in ids_of(b)]
    assert order0 != order1
    other_seed = [
        i
        for b in take(PretrainingData(phase_url, micro_batch_size=4, seed=4), n)
        for i in ids_of(b)
    ]
    assert other_seed != order0


# ---------------------------------------------------------------- resume


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_is_exact(phase_url: str, num_workers: int) -> None:
    write_phase(phase_url, UNEVEN)

    def loader() -> PretrainingData:
        return PretrainingData(
            phase_url, micro_batch_size=3, seed=11, num_workers=num_workers, shuffle_blocks=2
        )

    n = loader().batches_per_epoch
    reference = take(loader(), 2 * n + 3)
    for consumed, more in ((5, 6), (n - 1, 4), (n + 2, 3)):  # mid-epoch, across the boundary
        interrupted = loader()
        take(interrupted, consumed)
        state = interrupted.state_dict()
        assert state == {"epoch": consumed // n, "batches": consumed % n}
        resumed = loader()
        resumed.load_state_dict(state)
        assert_same(take(resumed, more), reference[consumed : consumed + more])
        assert resumed.state_dict() == {
            "epoch": (consumed + more) // n,
            "batches": (consumed + more) % n,
        }


def test_eval_pass_is_fixed_and_capped(phase_url: str) -> None:
    write_phase(phase_url, UNEVEN, heldout=(9, 14))
    phase = PhaseSpec(data=phase_url, micro_batch_size=2)
    data = build_pretraining_data(
        phase,
        DataConfig(num_workers=2),
        rank=0,
        world_size=2,
        seed=1,
        evaluation=EvalConfig(max_batches=3),
    )
    assert data.eval_batches == 3
    first, second = list(data), list(data)
    assert len(first) == 3
    assert_same(first, second)
    full = build_pretraining_data(
        phase, DataConfig(), rank=1, world_size=2, seed=1, evaluation=EvalConfig(max_batches=0)
    )
    assert len(list(full)) == full.eval_batches == full.batches_per_epoch
    train = build_pretraining_data(phase, DataConfig(num_workers=0), rank=0, world_size=1, seed=1)
    assert train.split == "train" and train.micro_batch_size == 2


# ---------------------------------------------------------------- collation


def test_collate_block_matches_instances() -> None:
    instances = make_instances(range(7), masked=True, seed=5)
    block = to_block(instances)
    batch = collate_block(block, pad_id=SPECIALS["pad"], max_seq_length=MAX_SEQ)
    B, S = batch["input_ids"].shape
    longest = max(len(x["tokens"]) for x in instances)
    assert B == 7 and S % 8 == 0 and longest <= S < longest + 8
    assert all(batch[k].dtype == torch.int64 for k in BATCH_KEYS)
    flat_ids = batch["input_ids"].reshape(-1)
    positions: list[int] = []
    for row in range(B):
        inst = block.instance(row)
        length = len(inst.input_ids)
        assert batch["input_ids"][row, :length].tolist() == inst.input_ids.tolist()
        assert (batch["input_ids"][row, length:] == SPECIALS["pad"]).all()
        assert batch["attention_mask"][row].tolist() == [1] * length + [0] * (S - length)
        assert batch["token_type_ids"][row, :length].tolist() == inst.token_type_ids.tolist()
        assert (batch["token_type_ids"][row, length:] == 0).all()
        assert int(batch["nsp_labels"][row]) == int(inst.is_random_next)
        positions += (row * S + inst.mlm_positions).tolist()
    assert batch["mlm_positions"].tolist() == positions
    assert (flat_ids[batch["mlm_positions"]] == SPECIALS["mask"]).all()
    labels = [int(v) for i in range(B) for v in block.instance(i).mlm_labels]
    assert batch["mlm_labels"].tolist() == labels
    assert_same([unpack_batch(pack_batch(batch))], [batch])  # how loader workers send it


def test_loader_batches_match_the_written_instances(phase_url: str) -> None:
    written = write_phase(phase_url, UNEVEN)
    data = PretrainingData(phase_url, micro_batch_size=5, seed=2)
    for batch in take(data, data.batches_per_epoch):
        S = batch["input_ids"].shape[1]
        assert S % 8 == 0 and S <= MAX_SEQ
        flat = batch["input_ids"].reshape(-1)
        expected_positions, expected_labels = [], []
        for row, ident in enumerate(ids_of(batch)):
            inst = written[ident]
            length = len(inst["tokens"])
            assert batch["input_ids"][row, :length].tolist() == inst["tokens"].tolist()
            assert (batch["input_ids"][row, length:] == SPECIALS["pad"]).all()
            assert int(batch["attention_mask"][row].sum()) == length
            types = batch["token_type_ids"][row]
            assert types[: inst["a_end"]].sum() == 0 and types[inst["a_end"] : length].all()
            assert int(batch["nsp_labels"][row]) == inst["random_next"]
            expected_positions += (row * S + inst["positions"]).tolist()
            expected_labels += inst["original"][inst["positions"]].tolist()
        assert batch["mlm_positions"].tolist() == expected_positions
        assert batch["mlm_labels"].tolist() == expected_labels
        assert (flat[batch["mlm_positions"]] == SPECIALS["mask"]).all()


# ---------------------------------------------------------------- dynamic masking


def test_dynamic_masking(tmp_path: Path) -> None:
    url = str(tmp_path / "seq40")
    written = write_phase(url, (40, 40), masked=False)
    data = PretrainingData(url, micro_batch_size=8, seed=5)
    n = data.batches_per_epoch
    epoch0, epoch1 = take(data, n), take(data, n)
    assert_same(take(PretrainingData(url, micro_batch_size=8, seed=5), n), epoch0)
    specials = set(SPECIALS.values())

    def masks(batches: list[dict[str, torch.Tensor]]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        masked = real = 0
        for batch in batches:
            S = batch["input_ids"].shape[1]
            pos = batch["mlm_positions"]
            rows, cols = (pos // S).tolist(), (pos % S).tolist()
            restored = batch["input_ids"].clone()  # the masked tokens put back
            restored.view(-1)[pos] = batch["mlm_labels"]
            ids = ids_of({"input_ids": restored})
            for row, col, label in zip(rows, cols, batch["mlm_labels"].tolist(), strict=True):
                original = written[ids[row]]["original"]
                assert label == int(original[col]) and label not in specials
                out.setdefault(ids[row], []).append(col)
            masked += pos.numel()
            real += int(batch["attention_mask"].sum())
            # tokens that were not chosen are the original ones
            keep = torch.ones_like(batch["input_ids"], dtype=torch.bool).reshape(-1)
            keep[pos] = False
            keep = keep.reshape(batch["input_ids"].shape) & batch["attention_mask"].bool()
            for row, ident in enumerate(ids):
                original = torch.as_tensor(written[ident]["original"].astype(np.int64))
                row_keep = keep[row, : original.numel()]
                assert torch.equal(
                    batch["input_ids"][row, : original.numel()][row_keep], original[row_keep]
                )
        assert 0.12 <= masked / real <= 0.18
        return out

    m0, m1 = masks(epoch0), masks(epoch1)
    common = set(m0) & set(m1)
    assert common and sum(m0[i] != m1[i] for i in common) > len(common) // 2


# ---------------------------------------------------------------- validation


def test_wrong_schema_and_format_are_one_line_errors(phase_url: str) -> None:
    write_phase(phase_url, UNEVEN, schema_version=2)
    with pytest.raises(DataError) as err:
        PretrainingData(phase_url, micro_batch_size=2)
    message = str(err.value)
    assert "\n" not in message and f"{phase_url}/manifest.json" in message
    assert "schema_version" in message and "bertpipe preprocess" in message
    write_phase(phase_url, UNEVEN, format="something-else")
    with pytest.raises(DataError, match="format"):
        PretrainingData(phase_url, micro_batch_size=2)
    with pytest.raises(DataError, match="no manifest"):
        PretrainingData(phase_url + "-missing", micro_batch_size=2)


def test_missing_shard_names_its_url(phase_url: str) -> None:
    """Storage that lost a listed shard: retried, then transient (exit 75), naming it."""
    write_phase(phase_url, UNEVEN)
    fsio.remove([f"{phase_url}/train-00002.tar"])
    with pytest.raises(TransientError) as err:
        PretrainingData(phase_url, micro_batch_size=2, read_retries=1, read_retry_delay=0.01)
    assert "\n" not in str(err.value) and f"{phase_url}/train-00002.tar" in str(err.value)


def test_shard_that_disagrees_with_manifest(phase_url: str) -> None:
    write_phase(phase_url, UNEVEN)
    with fsio.open_url(f"{phase_url}/train-00001.tar") as f:
        other = f.read()
    fsio.atomic_write_bytes(f"{phase_url}/train-00000.tar", other)  # 23 instances, not 37
    data = PretrainingData(phase_url, micro_batch_size=2, world_size=1)
    with pytest.raises(DataError, match=r"train-00000\.tar"):
        take(data, data.batches_per_epoch)


def test_too_few_instances_fail_early(phase_url: str) -> None:
    write_phase(phase_url, (3, 2))
    with pytest.raises(DataError, match="too few") as err:
        PretrainingData(phase_url, micro_batch_size=2, rank=0, world_size=3)
    assert "\n" not in str(err.value)
    with pytest.raises(DataError, match="no split"):
        PretrainingData(phase_url, split="validation", micro_batch_size=2)
