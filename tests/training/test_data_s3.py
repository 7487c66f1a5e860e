"""The pre-training loader on object storage (issue 16): shards in an S3 bucket (a real HTTP S3
server, :mod:`tests.s3`) give the same batches as the same shards on local disk, before and
after a resume; each shard is read whole in one request, and the next one is fetched in the
background while the current one is consumed (at most one ahead)."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

import pytest

from bertpipe import fsio
from bertpipe.training.pretrain.data import shards as data_module
from bertpipe.training.pretrain.data.loader import PretrainingData
from tests.training.test_data import assert_same, ids_of, take, write_phase
from tests.training.test_data_integrity import add_checksums

pytestmark = pytest.mark.integration

SHARDS = (60, 52, 60, 44)  # 15, 13, 15 and 11 blocks of 4 instances


def _phases(s3: Any, tmp_path: Path) -> tuple[str, str]:
    """The same phase folder on local disk and in the bucket (with shard checksums)."""
    local = tmp_path / "seq40"
    write_phase(str(local), SHARDS)
    add_checksums(local)
    remote = f"{s3.bucket}/shards/seq40"
    fs, path = fsio.to_fs(remote)
    fs.put(str(local), path, recursive=True)
    return str(local), remote


@pytest.mark.parametrize("num_workers", [0, 2])
def test_s3_batches_equal_local_ones_also_after_a_resume(
    s3: Any, tmp_path: Path, num_workers: int
) -> None:
    local, remote = _phases(s3, tmp_path)

    def loader(url: str, workers: int = 0) -> PretrainingData:
        return PretrainingData(url, micro_batch_size=3, seed=11, num_workers=workers)

    reference = loader(local, num_workers)  # the same layout: ranks x workers
    epoch = reference.batches_per_epoch
    want = take(reference, 2 * epoch)
    assert_same(take(loader(remote, num_workers), 2 * epoch), want)
    # a resume from a saved position, mid-way through the second epoch
    stopped = loader(remote, num_workers)
    first = take(stopped, epoch + 5)
    state = stopped.state_dict()
    assert state == {"epoch": 1, "batches": 5}
    resumed = loader(remote, num_workers)
    resumed.load_state_dict(state)
    assert_same(first + take(resumed, epoch - 5), want)


def test_next_shard_is_prefetched_while_the_current_one_is_consumed(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards are fetched by :func:`_fetch_shard` (one ``cat_file``: a single GET each);
    the second shard's fetch runs in the background and completes while the first shard's
    blocks are still being consumed, and nothing is fetched further ahead."""
    _, remote = _phases(s3, tmp_path)
    fs, _ = fsio.to_fs(remote)
    real_fetch, real_cat = data_module._fetch_shard, fs.cat_file
    fetched: list[tuple[str, str]] = []  # (shard file, thread name)
    done: dict[str, threading.Event] = {}
    cats: list[str] = []

    def fetch(url: str, **kwargs: Any) -> bytes:
        fetched.append((url.rsplit("/", 1)[-1], threading.current_thread().name))
        try:
            return real_fetch(url, **kwargs)
        finally:
            done.setdefault(url.rsplit("/", 1)[-1], threading.Event()).set()

    def cat_file(path: str, *args: Any, **kwargs: Any) -> bytes:
        cats.append(path.rsplit("/", 1)[-1])
        return real_cat(path, *args, **kwargs)

    def no_open(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a shard was opened for streaming instead of read whole")

    data = PretrainingData(remote, micro_batch_size=3, seed=3, shuffle_blocks=2)
    monkeypatch.setattr(data_module, "_fetch_shard", fetch)
    monkeypatch.setattr(fs, "cat_file", cat_file)
    monkeypatch.setattr(fs, "open", no_open)
    order = [data.manifest.splits["train"][r.shard].file for r in data._plan.slot_runs(0, 0)]
    batches = iter(data)
    first = next(batches)  # from the first shard's first window (8 of its instances)
    assert fetched[0] == (order[0], threading.main_thread().name)
    # nothing more is consumed: only a background fetch can complete the second shard
    second = done.setdefault(order[1], threading.Event())
    assert second.wait(timeout=20), fetched
    assert fetched == [(order[0], "MainThread"), (order[1], "bertpipe-shard-prefetch")]
    rest = list(itertools.islice(batches, data.batches_per_epoch - 1))
    assert [f for f, _ in fetched] == order  # every shard read once, in reading order
    assert sorted(cats) == sorted(order)  # in one request each
    got = [i for b in [first, *rest] for i in ids_of(b)]
    assert len(got) == len(set(got)) == data.batches_per_epoch * 3


def test_large_shards_are_streamed_and_give_the_same_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shards over WHOLE_READ_MAX are streamed through the tar reader, not held whole."""
    folder = tmp_path / "seq40"
    write_phase(str(folder), SHARDS)
    add_checksums(folder)
    whole = take(PretrainingData(str(folder), micro_batch_size=3, seed=2), 30)
    monkeypatch.setattr(data_module, "WHOLE_READ_MAX", 100)
    monkeypatch.setattr(data_module, "_fetch_shard", None)  # never called
    assert_same(take(PretrainingData(str(folder), micro_batch_size=3, seed=2), 30), whole)


def test_bench_loader_on_s3_reports_the_local_figures_beside(
    s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from bertpipe.app.cli import main

    _, remote = _phases(s3, tmp_path)
    assert main(["bench", "loader", "--data", remote, "--warmup", "1", "--step-ms", "1"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["data"] == remote and figures["batches"] == 5  # 216 // 32 - 1 of warm-up
    assert figures["local"]["batches"] == 5 and figures["instances"] == sum(SHARDS)
    for result in (figures, figures["local"]):
        assert result["instances_per_s"] > 0 and 0 <= result["wait_fraction"] <= 1
    assert figures["remote_vs_local"] > 0


def test_a_prefetch_that_gave_up_is_read_again_when_its_shard_is_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A background read still failing after its retries is not the loader's error yet: the
    shard is read again (with the retries again) when the loader reaches it."""
    from bertpipe.errors import TransientError

    folder = tmp_path / "seq40"
    write_phase(str(folder), SHARDS)
    add_checksums(folder)
    want = take(PretrainingData(str(folder), micro_batch_size=3, seed=4), 40)
    real_fetch = data_module._fetch_shard
    failed: list[str] = []

    def fetch(url: str, **kwargs: Any) -> bytes:
        if threading.current_thread() is not threading.main_thread():
            failed.append(url)
            raise TransientError(f"reading shard {url}: gave up")
        return real_fetch(url, **kwargs)

    monkeypatch.setattr(data_module, "_fetch_shard", fetch)
    assert_same(take(PretrainingData(str(folder), micro_batch_size=3, seed=4), 40), want)
    assert len(failed) == len(SHARDS) - 1


def test_a_shard_missing_from_the_bucket_at_start_is_retried_then_transient(
    s3: Any, tmp_path: Path
) -> None:
    """The manifest's shard list checked against the bucket: a missing object is an outage
    (retried, then exit 75 naming it), and one back before the retries end is found (the
    listing is not served from s3fs's cache)."""
    from bertpipe.errors import TransientError
    from bertpipe.training.pretrain.config import PhaseSpec
    from bertpipe.training.pretrain.data.manifest import read_phase_data

    _, remote = _phases(s3, tmp_path)
    shard = fsio.join(remote, "train-00002.tar")
    with fsio.open_url(shard, "rb") as f:
        kept = f.read()
    fsio.remove([shard])
    with pytest.raises(TransientError, match=r"train-00002\.tar does not exist.*3 attempt"):
        read_phase_data(PhaseSpec(data=remote), "phases[0]", fsio.RetryPolicy(2, 0.05))
    restore = threading.Timer(0.3, fsio.atomic_write_bytes, [shard, kept])
    restore.start()
    try:
        data = read_phase_data(PhaseSpec(data=remote), "phases[0]", fsio.RetryPolicy(4, 0.2))
    finally:
        restore.join()
    assert len(data.parsed.splits["train"]) == len(SHARDS)
