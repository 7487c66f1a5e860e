"""Faults and bad data where the pre-training loader consumes them (issue 10): transient storage
errors are retried and then exit 75, shard checksums and id ranges are checked, a resume into
regenerated data is refused, and the loader leaves the global RNG alone (exact resume with
workers). Faults are real files: renamed away, replaced by a folder, bytes changed."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from bertpipe import fsio
from bertpipe.app.cli import main
from bertpipe.errors import BertpipeError, TransientError
from bertpipe.preprocessing.shard_format import write_tar
from bertpipe.training import checkpoint as ckpt
from bertpipe.training.pretrain.data.collate import IdRangeError, check_ids
from bertpipe.training.pretrain.data.loader import PretrainingData
from bertpipe.training.pretrain.data.manifest import DataError, load_manifest
from tests.cli_runner import run_cli
from tests.conftest import sqlite_uri
from tests.training.test_data import (
    SPECIALS,
    UNEVEN,
    VOCAB,
    assert_same,
    make_instances,
    take,
    to_block,
    write_phase,
)

FAST = {"read_retries": 4, "read_retry_delay": 0.1}  # waits 0.1, 0.2, 0.4, 0.8 s


def add_checksums(folder: Path) -> dict:
    """Give the manifest the sha256 of every shard, as `bertpipe preprocess` writes it."""
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            shard["sha256"] = hashlib.sha256((folder / shard["file"]).read_bytes()).hexdigest()
    path.write_text(json.dumps(manifest))
    return manifest


def local_phase(tmp_path: Path, checksums: bool = True) -> Path:
    folder = tmp_path / f"seq40-{uuid.uuid4().hex[:8]}"
    write_phase(str(folder), UNEVEN)
    if checksums:
        add_checksums(folder)
    return folder


# ---------------------------------------------------------------- transient storage errors


def test_retried_retries_only_transient_errors_and_then_gives_up() -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise TimeoutError("read timed out")
        return "ok"

    policy = fsio.RetryPolicy(retries=4, delay=0.01)
    assert fsio.retried(flaky, "x", policy) == "ok" and len(calls) == 3
    calls.clear()
    with pytest.raises(ValueError):  # not transient: no retry
        fsio.retried(lambda: calls.append(1) or int("corrupt"), "x", policy)
    assert len(calls) == 1

    def broken() -> None:
        calls.append(1)
        raise PermissionError(13, "Permission denied")

    calls.clear()
    with pytest.raises(TransientError, match="still failing after 3 attempt") as err:
        fsio.retried(broken, "reading shard s3://b/train-0.tar", fsio.RetryPolicy(2, 0.01))
    assert len(calls) == 3 and "\n" not in str(err.value)
    assert err.value.exit_code == 75
    assert list(fsio.RetryPolicy(5, 0.5, max_delay=3).waits()) == [0.5, 1, 2, 3, 3]

    class EndpointConnectionError(Exception):  # as botocore names it
        pass

    assert fsio.is_transient(EndpointConnectionError())
    assert not fsio.is_transient(DataError("bad"))


def _away_for(path: Path, seconds: float) -> threading.Thread:
    """Rename ``path`` away now and back after ``seconds`` (a background thread)."""
    hidden = path.with_name(path.name + ".away")
    path.rename(hidden)

    def restore() -> None:
        time.sleep(seconds)
        hidden.rename(path)

    thread = threading.Thread(target=restore)
    thread.start()
    return thread


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shard_briefly_gone_is_retried_and_loading_continues(
    tmp_path: Path, num_workers: int, caplog: pytest.LogCaptureFixture
) -> None:
    folder = local_phase(tmp_path)

    def loader() -> PretrainingData:
        return PretrainingData(
            str(folder), micro_batch_size=3, seed=5, num_workers=num_workers, **FAST
        )

    reference = take(loader(), 2 * loader().batches_per_epoch)
    data = loader()  # the manifest and the shard listing are read here
    thread = _away_for(folder / "train-00002.tar", 0.5)
    try:
        with caplog.at_level(logging.WARNING):
            got = take(data, len(reference))
    finally:
        thread.join()
    assert_same(got, reference)
    if num_workers == 0:  # worker processes log elsewhere
        assert "retrying in" in caplog.text and "train-00002.tar" in caplog.text


def test_read_error_mid_shard_continues_after_the_last_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shard's stream fails after some blocks were delivered (a lost connection: the
    stream raises OSError once, after 3,000 bytes): the retry reopens the shard and continues
    after the last block yielded, no block twice, none lost."""
    from bertpipe.training.pretrain.data import shards as data_module

    folder = local_phase(tmp_path)
    url = str(folder / "train-00000.tar")
    wanted = list(range(10))
    clean = [(n, k) for n, k, _ in data_module._read_shard_blocks(url, wanted)]
    real_open = fsio.open_url
    broken: list[str] = []

    class Breaking:
        def __init__(self, f) -> None:  # type: ignore[no-untyped-def]
            self.f, self.done = f, 0

        def read(self, n: int = -1) -> bytes:
            if not broken and self.done > 3000:
                broken.append(url)
                raise ConnectionResetError(104, "Connection reset by peer")
            out = self.f.read(n)
            self.done += len(out)
            return out

        def __enter__(self):  # type: ignore[no-untyped-def]
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

    def open_url(u: str, mode: str = "rb", **kw: object):  # type: ignore[no-untyped-def]
        if u == url:
            return Breaking(open(u, mode))
        return real_open(u, mode, **kw)

    monkeypatch.setattr(fsio, "open_url", open_url)
    got = [
        (n, k)
        for n, k, _ in data_module._read_shard_blocks(url, wanted, retry=fsio.RetryPolicy(2, 0.01))
    ]
    assert broken == [url] and got == clean


def test_shard_unreadable_for_good_is_a_transient_error(tmp_path: Path) -> None:
    folder = local_phase(tmp_path)
    data = PretrainingData(str(folder), micro_batch_size=3, read_retries=2, read_retry_delay=0.05)
    shard = folder / "train-00001.tar"
    shard.unlink()
    shard.mkdir()  # unreadable as a file (IsADirectoryError), whoever runs the test
    with pytest.raises(TransientError) as err:
        take(data, data.batches_per_epoch)
    message = str(err.value)
    assert "\n" not in message and str(shard) in message and "3 attempt" in message


def test_worker_errors_keep_their_one_line_message(tmp_path: Path) -> None:
    folder = local_phase(tmp_path)
    data = PretrainingData(
        str(folder), micro_batch_size=3, num_workers=2, read_retries=1, read_retry_delay=0.05
    )
    shard = folder / "train-00001.tar"
    shard.unlink()
    shard.mkdir()
    with pytest.raises(TransientError) as err:
        take(data, data.batches_per_epoch)
    assert str(err.value).startswith(f"reading shard {shard}: IsADirectoryError")
    assert "\n" not in str(err.value)


def test_manifest_briefly_unreadable_is_retried(tmp_path: Path) -> None:
    folder = local_phase(tmp_path)
    manifest = folder / "manifest.json"
    original = manifest.read_bytes()
    manifest.unlink()
    (tmp_path / "a-folder").mkdir()
    # a read fails with an OSError (a folder), not FileNotFoundError
    manifest.symlink_to(tmp_path / "a-folder")

    def restore() -> None:  # atomically, as a writer publishes it: never missing in between
        time.sleep(0.3)
        staged = folder / "manifest.json.tmp"
        staged.write_bytes(original)
        os.replace(staged, manifest)

    thread = threading.Thread(target=restore)
    thread.start()
    try:
        loaded = load_manifest(str(folder), fsio.RetryPolicy(4, 0.1))
    finally:
        thread.join()
    assert loaded.vocab_size == VOCAB
    # a manifest that is not there is a wrong path: one line at once, exit 2, no retries
    # (a first retry would wait 5 s: the bound leaves a loaded machine room and still tells)
    started = time.monotonic()
    with pytest.raises(DataError, match="no manifest"):
        load_manifest(str(tmp_path / "nowhere"), fsio.RetryPolicy(4, 5.0))
    assert time.monotonic() - started < 4.0


def test_cli_exits_75_when_storage_stays_unreadable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`bertpipe pretrain` whose manifest cannot be read (an OSError that outlasts the
    retries): one line and exit status 75 (EX_TEMPFAIL), which the Job and sbatch retry."""
    folder = local_phase(tmp_path)
    (folder / "manifest.json").unlink()
    (folder / "manifest.json").mkdir()
    status = main(
        [
            "pretrain",
            f"output={tmp_path / 'run'}",
            f"phases=[{{name: phase1, data: {folder}, max_steps: 2, micro_batch_size: 2,"
            " global_batch_size: 2}]",
            "model.preset=tiny",
            "data.read_retries=1",
            "data.read_retry_delay=0.05",
            "tracking.enabled=false",
        ]
    )
    err = capsys.readouterr().err
    assert status == 75, err
    lines = [line for line in err.splitlines() if line.startswith("bertpipe: error:")]
    assert len(lines) == 1 and "manifest.json" in lines[0] and "2 attempt" in lines[0], err


def _pretrain_args(tmp_path: Path, folder: Path) -> list[str]:
    return [
        "pretrain",
        f"output={tmp_path / 'run'}",
        f"phases=[{{name: phase1, data: {folder}, max_steps: 2, micro_batch_size: 2,"
        " global_batch_size: 2}]",
        "model.preset=tiny",
        "model.max_position_embeddings=64",
        "precision=fp32",
        "data.num_workers=0",
        "data.read_retries=3",
        "data.read_retry_delay=0.2",
        "tracking.enabled=false",
    ]


def test_a_shard_missing_at_start_exits_75_and_one_back_in_time_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A requeued run that meets the outage which ended the last one (a listed shard the
    folder lacks) retries, then exits 75 with one line naming the shard: the scheduler
    requeues it again (exit 2 would fail the Job). The shard back before the retries end:
    the run trains."""
    folder = local_phase(tmp_path)
    shard = folder / "train-00001.tar"
    kept = shard.read_bytes()
    shard.unlink()
    status = main(_pretrain_args(tmp_path, folder))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("bertpipe: error:")]
    assert status == 75 and len(lines) == 1, err
    assert f"{shard} does not exist" in lines[0] and "after 4 attempt(s)" in lines[0]
    restore = threading.Timer(0.4, shard.write_bytes, [kept])
    restore.start()
    try:
        assert main(_pretrain_args(tmp_path, folder)) == 0, capsys.readouterr().err[-3000:]
    finally:
        restore.join()
    assert ckpt.latest_tag(str(tmp_path / "run" / "checkpoints")) == "global_step2"


# ---------------------------------------------------------------- checksums


def _tamper(path: Path) -> None:
    """Change one byte of the shard: in the padding after its first member (an info.npy of
    under 200 bytes), so the tar still parses and only the checksum can tell."""
    raw = bytearray(path.read_bytes())
    raw[512 + 300] ^= 0x01
    path.write_bytes(bytes(raw))


def test_tampered_shard_fails_with_its_name_and_manifest(tmp_path: Path) -> None:
    folder = local_phase(tmp_path)
    good = take(PretrainingData(str(folder), micro_batch_size=3), 5)  # checksums pass
    assert len(good) == 5
    shard = folder / "train-00003.tar"
    _tamper(shard)
    data = PretrainingData(str(folder), micro_batch_size=3, **FAST)
    started = time.monotonic()
    with pytest.raises(DataError) as err:
        take(data, data.batches_per_epoch)
    assert time.monotonic() - started < 5  # not retried: bad data, exit 2
    message = str(err.value)
    assert "\n" not in message
    assert str(shard) in message and str(folder / "manifest.json") in message
    assert "sha256" in message and not isinstance(err.value, TransientError)


def test_checksums_can_be_switched_off_and_are_skipped_without_them(tmp_path: Path) -> None:
    folder = local_phase(tmp_path)
    _tamper(folder / "train-00003.tar")  # a byte of tar padding: the data still read
    data = PretrainingData(str(folder), micro_batch_size=3, verify_checksums=False)
    assert len(take(data, data.batches_per_epoch)) == data.batches_per_epoch
    plain = local_phase(tmp_path, checksums=False)  # a manifest without checksums
    data = PretrainingData(str(plain), micro_batch_size=3)
    assert len(take(data, data.batches_per_epoch)) == data.batches_per_epoch


def test_changed_shard_is_verified_again(tmp_path: Path) -> None:
    """A process verifies a shard once, and again when its size or time changes."""
    folder = local_phase(tmp_path)
    data = PretrainingData(str(folder), micro_batch_size=3)
    take(data, data.batches_per_epoch)
    _tamper(folder / "train-00000.tar")
    os.utime(folder / "train-00000.tar", (time.time() + 5, time.time() + 5))
    with pytest.raises(DataError, match=r"train-00000\.tar has sha256"):
        take(data, data.batches_per_epoch)


def test_preprocessed_shards_carry_checksums_that_pass(pretrain_shards: Path) -> None:
    manifest = load_manifest(str(pretrain_shards / "seq64"))
    assert all(s.sha256 for s in manifest.splits["train"])
    data = PretrainingData(str(pretrain_shards / "seq64"), micro_batch_size=8)
    assert len(take(data, 3)) == 3


# ---------------------------------------------------------------- id ranges


def _write_with_bad_id(folder: Path, where: str, bad: int) -> Path:
    """Phase folder whose shard 1 has one token (or MLM label) id ``bad``."""
    write_phase(str(folder), UNEVEN)
    instances = make_instances(range(1000, 1000 + UNEVEN[1]), True, seed=3)
    if where == "token":
        instances[5]["tokens"][4] = bad
    else:
        instances[5]["original"][instances[5]["positions"][0]] = bad
    samples = [
        (f"00001-{i:06d}", to_block(instances[start : start + 4]).to_sample())
        for i, start in enumerate(range(0, len(instances), 4))
    ]
    shard = folder / "train-00001.tar"
    with fsio.atomic_writer(str(shard)) as f:
        write_tar(f, samples)
    return shard


@pytest.mark.parametrize(
    ("where", "bad"), [("token", VOCAB), ("label", VOCAB + 1), ("token", 65535)]
)
def test_id_outside_the_vocabulary_names_the_shard(tmp_path: Path, where: str, bad: int) -> None:
    """An id at the vocabulary size or past it: ids below the model's padded size (a multiple
    of ``pad_vocab_multiple``) used to train silently on a padding row; larger ones failed
    the lookup with an IndexError naming no shard."""
    shard = _write_with_bad_id(tmp_path / "phase", where, bad)
    data = PretrainingData(str(tmp_path / "phase"), micro_batch_size=3)
    with pytest.raises(BertpipeError) as err:
        take(data, data.batches_per_epoch)
    message = str(err.value)
    assert isinstance(err.value, IdRangeError) and "\n" not in message
    assert str(shard) in message and f"{where} id {bad}" in message
    assert f"vocabulary of {VOCAB}" in message


def test_check_ids_accepts_the_whole_vocabulary() -> None:
    instances = make_instances(range(4), True, seed=1)
    instances[0]["tokens"][4] = VOCAB - 1
    check_ids(to_block(instances), VOCAB, "here")
    with pytest.raises(IdRangeError, match="here: token id 999"):
        check_ids(to_block(instances), VOCAB - 1, "here")
    assert SPECIALS["pad"] < VOCAB


# ---------------------------------------------------------------- resume: data and RNG


def _state(sha: dict[str, str], phase_index: int = 0) -> ckpt.CheckpointState:
    return ckpt.CheckpointState(
        phase=["phase1", "phase2"][phase_index],
        phase_index=phase_index,
        phase_step=4,
        global_step=4,
        phase_complete=False,
        data={"epoch": 0, "batches": 8},
        world_size=1,
        mlflow_run_id=None,
        samples_seen=32,
        data_sha256=sha,
    )


def test_check_data_refuses_changed_data_unless_allowed(caplog: pytest.LogCaptureFixture) -> None:
    saved = {"phase1": "a" * 64, "phase2": "b" * 64}
    assert ckpt.check_data(_state(saved), dict(saved), "global_step4") == []
    # phase 2 not trained on yet: its data may change
    assert ckpt.check_data(_state(saved), {**saved, "phase2": "c" * 64}, "global_step4") == []
    with pytest.raises(ckpt.DataChangedError) as err:
        ckpt.check_data(_state(saved, 1), {**saved, "phase1": "d" * 64}, "global_step4")
    message = str(err.value)
    assert "\n" not in message and "phase1" in message and "a" * 64 in message
    assert "d" * 64 in message and "checkpoint.allow_data_change=true" in message
    with caplog.at_level(logging.WARNING):
        changed = ckpt.check_data(_state(saved), {"phase1": "d" * 64}, "t", allow=True)
    assert changed == ["phase1"] and "resuming anyway" in caplog.text
    assert ckpt.check_data(_state({}), {"phase1": "d" * 64}, "t") == []  # no checksums saved


def test_loader_workers_leave_the_global_rng_alone(tmp_path: Path) -> None:
    """Starting the loader's workers draws their seed from its own generator, derived from the
    position: the global torch RNG (dropout) is the same as if no loader had started, so a
    resumed run (RNG restored, then a new loader) continues the uninterrupted one exactly."""
    folder = local_phase(tmp_path)
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    data = PretrainingData(str(folder), micro_batch_size=3, num_workers=2)
    batches = iter(data)
    first = next(batches)
    assert torch.equal(torch.rand(4), expected)
    batches.close()
    again = next(iter(PretrainingData(str(folder), micro_batch_size=3, num_workers=2)))
    assert_same([first], [again])


# ---------------------------------------------------------------- through the trainer


def _run_cmd(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``bertpipe pretrain ARGS`` as a job would run it, in this process (one interpreter
    start-up fewer each time; the loader workers are real processes either way)."""
    return run_cli(["pretrain", *args], env)


@pytest.mark.integration
@pytest.mark.slow
def test_resume_with_loader_workers_is_exact_and_refuses_regenerated_data(
    pretrain_shards: Path, tmp_path: Path
) -> None:
    """1 process x 2 loader workers: stopped after step 4 and resumed, the losses of steps
    5-8 are those of the uninterrupted run, bit for bit (the DataLoader took its seed from the
    restored global RNG before). Then the data is regenerated (its manifest changes): the
    resume is refused with one line, exit 2, unless checkpoint.allow_data_change=true."""
    import shutil

    from tests.training.test_pretrain import _env, _history, _overrides

    env = {**_env(), "OMP_NUM_THREADS": "1"}
    data = tmp_path / "shards"
    shutil.copytree(pretrain_shards / "seq64", data / "seq64")
    shutil.copytree(pretrain_shards / "seq128", data / "seq128")
    uri = sqlite_uri(tmp_path / "mlflow.db")
    args = [
        *_overrides(data, tmp_path / "run", uri, steps=8),
        "only_phase=phase1",
        "data.num_workers=2",
        "checkpoint.keep_last=3",
        "eval.max_batches=1",
    ]
    done = _run_cmd(args, env)
    assert done.returncode == 0, done.stderr[-3000:]
    folder = tmp_path / "run" / "checkpoints"
    state, _ = ckpt.read_state(str(folder), "global_step8", 0)
    # as if the run had stopped after step 4: back to that checkpoint, the same command
    shutil.rmtree(folder / "global_step8")
    (folder / "latest").write_text("global_step4")
    done = _run_cmd(args, env)
    assert done.returncode == 0, done.stderr[-3000:]
    history = _history(uri, state.mlflow_run_id, "train/loss")
    again = [v for s, v in history if s > 4]
    assert len(again) == 8 and again[0::2] == again[1::2], history  # steps 5-8 twice, exact
    # regenerated data: another manifest (here: one more key), the resume is refused
    manifest = data / "seq64" / "manifest.json"
    raw = json.loads(manifest.read_text())
    raw["stats"]["regenerated"] = 1
    manifest.write_text(json.dumps(raw))
    shutil.rmtree(folder / "global_step8")
    (folder / "latest").write_text("global_step4")
    refused = _run_cmd(args, env)
    assert refused.returncode == 2, refused.stderr[-3000:]
    line = [x for x in refused.stderr.splitlines() if x.startswith("bertpipe: error:")]
    assert len(line) == 1 and "phase1" in line[0] and state.data_sha256["phase1"] in line[0]
    new_sha = hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert new_sha in line[0] and "allow_data_change" in line[0]
    allowed = _run_cmd([*args, "checkpoint.allow_data_change=true"], env)
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert np.isfinite([v for _, v in _history(uri, state.mlflow_run_id, "train/loss")]).all()


@pytest.mark.parametrize("damage", ["truncated", "random_bytes"])
def test_corrupt_shard_without_checksums_fails_with_its_name(tmp_path: Path, damage: str) -> None:
    """With checksums off (trusted storage), a truncated shard or one of random bytes still
    ends in one line naming it (exit 2, not retried), never in a raw tar/numpy traceback."""
    folder = local_phase(tmp_path, checksums=False)
    shard = folder / "train-00002.tar"
    data = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(data[: len(data) // 2 + 7])
    else:
        shard.write_bytes(np.random.default_rng(0).bytes(len(data)))
    loader = PretrainingData(str(folder), micro_batch_size=3, verify_checksums=False, **FAST)
    started = time.monotonic()
    with pytest.raises(BertpipeError) as err:
        take(loader, loader.batches_per_epoch)
    assert time.monotonic() - started < 5 and not isinstance(err.value, TransientError)
    assert str(shard) in str(err.value) and "\n" not in str(err.value)
