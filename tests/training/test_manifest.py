"""A phase's manifest is read once: :func:`read_phase_data` keeps the raw dict, the bytes'
checksum and the loader's validated :class:`Manifest` of the same bytes, and loaders built
from that manifest read nothing more of it. Errors name the manifest."""

from __future__ import annotations

import hashlib
import json
import uuid

import pytest

from bertpipe import fsio
from bertpipe.config import ConfigError
from bertpipe.training.config import DataConfig, EvalConfig, PhaseSpec
from bertpipe.training.data import PretrainingData, build_pretraining_data
from bertpipe.training.manifest import (
    DataError,
    DataMismatchError,
    Manifest,
    load_manifest,
    read_phase_data,
)
from tests.training.test_data import MAX_SEQ, UNEVEN, assert_same, take, write_phase


@pytest.fixture
def folder() -> str:
    url = f"memory://manifest-{uuid.uuid4().hex}/seq40"
    write_phase(url, UNEVEN)
    return url


def test_phase_data_holds_the_raw_manifest_its_checksum_and_the_validated_one(
    folder: str,
) -> None:
    with fsio.open_url(fsio.join(folder, "manifest.json"), "rb") as f:
        raw = f.read()
    d = read_phase_data(PhaseSpec(data=folder), "phases[0]")
    assert d.url == folder and d.manifest == json.loads(raw)
    assert d.sha256 == hashlib.sha256(raw).hexdigest()
    assert d.parsed == load_manifest(folder) and d.max_seq_length == MAX_SEQ


def test_loaders_built_from_the_read_manifest_do_not_read_it_again(folder: str) -> None:
    """The training and held-out loaders of a phase built from ``PhaseData.parsed`` give the
    batches of loaders that read the folder's manifest, with the manifest gone."""
    phase = PhaseSpec(data=folder, micro_batch_size=3)
    d = read_phase_data(phase, "phases[0]")

    def loaders(manifest: Manifest | None = None) -> tuple[PretrainingData, PretrainingData]:
        def build(evaluation: EvalConfig | None) -> PretrainingData:
            data = DataConfig()
            return build_pretraining_data(
                phase, data, rank=0, world_size=1, seed=2, evaluation=evaluation, manifest=manifest
            )

        return build(None), build(EvalConfig(max_batches=2))

    train, held = loaders()
    want = take(train, 8), list(held)
    fsio.remove([fsio.join(folder, "manifest.json")])
    train, held = loaders(d.parsed)
    assert_same(take(train, 8), want[0])
    assert_same(list(held), want[1])
    with pytest.raises(DataError, match="no manifest at"):
        loaders()


def test_phase_manifest_errors_name_the_manifest(folder: str) -> None:
    url = fsio.join(folder, "manifest.json")
    fsio.atomic_write_text(url, json.dumps({"format": "something.else"}))
    with pytest.raises(DataMismatchError, match="is not a bertpipe shard manifest"):
        read_phase_data(PhaseSpec(data=folder), "phases[0]")
    fsio.atomic_write_text(url, "{not json")
    with pytest.raises(DataError, match="is not valid JSON"):
        read_phase_data(PhaseSpec(data=folder), "phases[0]")
    fsio.remove([url])
    with pytest.raises(ConfigError, match=r"phases\[1\]\.data"):
        read_phase_data(PhaseSpec(data=folder), "phases[1]")


def test_phase_manifest_listing_a_missing_shard_fails_before_any_loader(folder: str) -> None:
    fsio.remove([fsio.join(folder, "train-00002.tar")])
    with pytest.raises(DataError, match=r"lists .*train-00002\.tar, which does not exist"):
        read_phase_data(PhaseSpec(data=folder), "phases[0]")
