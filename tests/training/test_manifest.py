"""A phase's manifest is read once: :func:`read_phase_data` keeps the raw dict, the bytes'
checksum and the loader's validated :class:`Manifest` of the same bytes, and loaders built
from that manifest read nothing more of it. Errors name the manifest."""

from __future__ import annotations

import hashlib
import json
import threading
import uuid

import pytest

from bertpipe import fsio
from bertpipe.config import ConfigError
from bertpipe.errors import TransientError
from bertpipe.fsio import RetryPolicy
from bertpipe.training.pretrain.config import DataConfig, EvalConfig, PhaseSpec
from bertpipe.training.pretrain.data.loader import PretrainingData, build_pretraining_data
from bertpipe.training.pretrain.data.manifest import (
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


def test_a_listed_shard_missing_at_start_is_an_outage_retried_then_exit_75(folder: str) -> None:
    """A shard the manifest lists and the folder lacks is storage gone (the run was requeued
    after an outage), not bad data: the listing is retried, then it is a TransientError
    (exit 75) naming the file and the attempts."""
    fsio.remove([fsio.join(folder, "train-00002.tar")])
    retry = RetryPolicy(retries=2, delay=0.01)
    with pytest.raises(TransientError) as error:
        read_phase_data(PhaseSpec(data=folder), "phases[0]", retry)
    message = str(error.value)
    assert "train-00002.tar does not exist" in message and "after 3 attempt(s)" in message
    assert "\n" not in message and error.value.exit_code == 75


def test_a_shard_back_before_the_retries_end_is_read_normally(folder: str) -> None:
    shard = fsio.join(folder, "train-00002.tar")
    with fsio.open_url(shard, "rb") as f:
        data = f.read()
    fsio.remove([shard])
    timer = threading.Timer(0.3, lambda: fsio.atomic_write_bytes(shard, data))
    timer.start()
    try:
        d = read_phase_data(PhaseSpec(data=folder), "phases[0]", RetryPolicy(retries=4, delay=0.2))
    finally:
        timer.join()
    assert any(s.file == "train-00002.tar" for s in d.parsed.splits["train"])


def test_a_truncated_manifest_is_one_line_with_the_position(folder: str) -> None:
    """Cut inside a string and between two entries: the whole line, position included
    (the decoder's "Unterminated string starting at" once lost its position)."""
    url = fsio.join(folder, "manifest.json")
    with fsio.open_url(url, "rb") as f:
        raw = f.read()
    advice = "rerun `bertpipe preprocess` for this phase"
    start = raw.index(b'"format"')  # the string the cut falls in begins here
    line, column = raw[:start].count(b"\n") + 1, start - raw.rfind(b"\n", 0, start)
    cut = raw.index(b",", start) + 1  # the file ends after a comma
    cut_line, cut_column = raw[:cut].count(b"\n") + 1, cut - raw.rfind(b"\n", 0, cut)
    for size, expected in (
        (
            start + 4,
            f"{url} is not valid JSON: unterminated string starting at line {line}, column "
            f"{column} (character {start} of {start + 4}): {advice}",
        ),
        (
            cut,
            f"{url} is not valid JSON: expecting property name enclosed in double quotes at "
            f"line {cut_line}, column {cut_column} (character {cut} of {cut}): {advice}",
        ),
    ):
        fsio.atomic_write_bytes(url, raw[:size])
        with pytest.raises(DataError) as error:
            read_phase_data(PhaseSpec(data=folder), "phases[0]")
        assert str(error.value) == expected
