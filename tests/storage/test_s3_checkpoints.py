"""Checkpoints on a real S3 server (``checkpoint.dir=s3://…``), shards streamed from it too:
a 2-rank run killed in the middle of an upload resumes from the previous complete checkpoint
bit for bit; so does the finished run after its newest checkpoint's model states were
truncated on the store; a checkpoint missing one rank's file is skipped with a log line, and
with rank 0's marker of the one before truncated too none is left (one line); a file whose
content changed on the store (same size) is refused on download by its CRC-32; a rank that
never uploads keeps the checkpoint unpublished. SIGTERM in the middle of an upload, through
injected storage faults: ``tests/training/test_pretrain.py::test_resume_after_sigterm_is_exact``."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from bertpipe.config import to_yaml
from bertpipe.training import checkpoint as ckpt
from tests.conftest import sqlite_uri
from tests.faultenv import FAULT_IN_SAVE
from tests.training.test_pretrain import _env, _history

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BIN = Path(sys.executable).parent


def _upload_shards(s3, shards: Path) -> str:
    import s3fs

    fs = s3fs.S3FileSystem()
    url = f"{s3.bucket}/shards"
    fs.put(str(shards / "seq64"), f"{url}/seq64".removeprefix("s3://"), recursive=True)
    return url


def _config(tmp: Path, shards: str, checkpoints: str, steps: int, **extra: object) -> Path:
    from bertpipe.config import load_config
    from bertpipe.training.pretrain.config import PretrainConfig

    uri = sqlite_uri(tmp / "mlflow.db")
    items = [
        f"output={tmp / 'run'}",
        "model.preset=tiny",
        "model.max_position_embeddings=128",
        f"phases=[{{name: phase1, data: {shards}/seq64, max_steps: {steps}, micro_batch_size: 8,"
        " global_batch_size: 16, learning_rate: 2.0e-3, warmup: 0.25}]",
        "precision=fp32",
        "zero.stage=1",
        "data.num_workers=0",
        "log_every_steps=1",
        "eval.max_batches=1",
        f"checkpoint.dir={checkpoints}",
        f"checkpoint.local_dir={tmp / 'staging'}",
        "checkpoint.every_steps=4",
        "checkpoint.keep_last=2",
        f"tracking.uri={uri}",
        "tracking.experiment=s3-tests",
    ]
    items += [f"{k.replace('__', '.')}={v}" for k, v in extra.items()]
    path = tmp / "cfg.yaml"
    path.write_text(to_yaml(load_config(PretrainConfig, None, items)))
    return path


def _run(cmd: list[str], s3, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**_env(), **s3.env}
    if fault:
        env[FAULT_IN_SAVE] = fault
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _losses(uri: str, run_id: str) -> dict[int, list[float]]:
    by_step: dict[int, list[float]] = {}
    for step, value in _history(uri, run_id, "train/loss"):
        by_step.setdefault(step, []).append(value)
    return by_step


def test_two_ranks_killed_mid_upload_resume_exactly(
    s3, pretrain_shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shards = _upload_shards(s3, pretrain_shards)
    folder = f"{s3.bucket}/run/checkpoints"
    cfg = _config(tmp_path, shards, folder, steps=12)
    # torchrun: two interpreter start-ups fewer than the deepspeed launcher (tested elsewhere)
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", "29661",
           str(BIN / "bertpipe"), "pretrain", "--config", str(cfg)]  # fmt: skip
    killed = _run(cmd, s3, fault="kill-upload:global_step8")
    assert killed.returncode != 0, killed.stdout[-3000:]
    assert ckpt.latest_tag(folder) == "global_step4"
    assert "global_step8" in ckpt.tags(folder)  # part of it reached the store
    assert ckpt.latest_complete_tag(folder) == "global_step4"

    again = _run(cmd, s3)
    assert again.returncode == 0, again.stdout[-3000:]
    assert ckpt.latest_tag(folder) == "global_step12"
    state, _ = ckpt.read_state(folder, "global_step12", 0)
    assert state.world_size == 2
    uri = sqlite_uri(tmp_path / "mlflow.db")
    by_step = _losses(uri, str(state.mlflow_run_id))
    assert sorted(by_step) == list(range(1, 13))
    repeated = {s: v for s, v in by_step.items() if len(v) > 1}
    assert set(repeated) >= {5, 6, 7}, repeated  # re-run from global_step4
    assert all(len(set(v)) == 1 for v in repeated.values()), repeated  # bit for bit
    index = [e["tag"] for e in json.loads(ckpt._Folder(folder).read_text(ckpt.INDEX_FILE))]
    assert index == ["global_step8", "global_step12"]  # keep_last=2, pruned on the store
    assert ckpt.tags(folder) == ["global_step12", "global_step8"]

    # the newest checkpoint's model states truncated on the store: the same command resumes
    # from global_step8 with one line (rank 0's only) and repeats 9-12 exactly
    import s3fs

    fs = s3fs.S3FileSystem()

    def truncate(path: str) -> None:
        fs.pipe_file(path, fs.cat_file(path)[: fs.size(path) // 2])
        fs.invalidate_cache()

    truncate(f"{folder}/global_step12/mp_rank_00_model_states.pt")
    rerun = _run(cmd, s3)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    lines = [x for x in rerun.stderr.splitlines() if "incomplete or damaged" in x]
    assert len(lines) == 1, rerun.stderr[-3000:]
    assert "checkpoint global_step12 in" in lines[0], lines[0]
    assert "mp_rank_00_model_states.pt has" in lines[0], lines[0]
    assert "resuming from global_step8, the newest whole checkpoint" in lines[0], lines[0]
    by_step = _losses(uri, str(state.mlflow_run_id))
    assert all(len(by_step[s]) > 1 for s in (9, 10, 11, 12)), by_step
    assert all(len(set(v)) == 1 for v in by_step.values()), by_step
    assert ckpt.latest_tag(folder) == "global_step12"

    # one rank's file gone from the newest checkpoint: resume=auto skips it, saying why
    victim = next(
        p for p in fs.find(f"{folder}/global_step12") if "zero_pp_rank_1_" in p.rsplit("/", 1)[1]
    )
    fs.rm(victim)
    with caplog.at_level(logging.WARNING):
        assert ckpt.resume_tag(folder, "auto") == "global_step8"
    assert "checkpoint global_step12" in caplog.text and "incomplete or damaged" in caplog.text
    assert "zero_pp_rank_1_" in caplog.text
    # and rank 0's completion marker of the one before truncated: no whole checkpoint left
    truncate(f"{folder}/global_step8/bertpipe_rank00000.json")
    with pytest.raises(ckpt.CheckpointDamagedError) as refused:
        ckpt.resume_tag(folder, "auto")
    assert f"{folder} has no whole checkpoint to resume from" in str(refused.value)
    assert "global_step8 (rank 0's file bertpipe_rank00000.json has" in str(refused.value)


def test_a_rank_that_never_uploads_is_not_published(s3) -> None:
    """Rank 0's publish waits for every rank's marker of this save; one that never comes is
    an error after ``publish_timeout_s`` naming it (exit 75), and ``latest`` does not move.
    A marker of an earlier, killed attempt of the same tag does not count."""
    import s3fs

    from bertpipe.training.checkpoint.store import (
        CheckpointUploadError,
        RemoteCheckpoints,
        marker_name,
    )

    fs = s3fs.S3FileSystem()
    store = RemoteCheckpoints(f"{s3.bucket}/ck", publish_timeout_s=0.5)
    files = {"mp_rank_00_model_states.pt": 3}
    fs.pipe(f"{s3.bucket}/ck/global_step5/mp_rank_00_model_states.pt", b"abc")
    for rank, attempt in ((0, "now"), (1, "killed-before")):
        marker = {"rank": rank, "world_size": 2, "attempt": attempt, "files": files}
        store.write_text(f"global_step5/{marker_name(rank)}", json.dumps(marker))
    assert "rank 1's upload marker is from another save" in store.missing("global_step5", 2, "now")
    with pytest.raises(CheckpointUploadError, match=r"not published.*rank 1") as raised:
        store.wait_complete("global_step5", 2, "now")
    assert raised.value.exit_code == 75
    assert store.read_text("latest") is None
    fs.pipe(f"{s3.bucket}/ck/global_step5/mp_rank_00_model_states.pt", b"ab")  # truncated
    assert "has 2 bytes, not 3" in store.missing("global_step5")


def test_a_file_changed_on_the_store_is_refused_on_download(s3, tmp_path: Path) -> None:
    """Sizes are checked from a listing; the CRC-32 that the uploading rank recorded is
    checked as a rank downloads the file (downloaded twice, then one error naming it, exit
    2). A marker that does not parse makes the checkpoint incomplete, not a traceback."""
    import zlib

    import s3fs

    from bertpipe.training.checkpoint.store import (
        CheckpointDamagedError,
        RemoteCheckpoints,
        marker_name,
    )

    fs = s3fs.S3FileSystem()
    store = RemoteCheckpoints(f"{s3.bucket}/crc", local_dir=str(tmp_path / "staging"))
    name = "mp_rank_00_model_states.pt"
    fs.pipe(f"{s3.bucket}/crc/global_step5/{name}", b"xyz")  # saved as "abc", same size
    marker = {"rank": 0, "world_size": 1, "attempt": "a", "files": {name: 3},
              "crc32": {name: f"{zlib.crc32(b'abc'):08x}"}}  # fmt: skip
    store.write_text(f"global_step5/{marker_name(0)}", json.dumps(marker))
    assert store.missing("global_step5") == ""  # sizes agree
    with (
        pytest.raises(CheckpointDamagedError, match=name) as raised,
        store.fetched("global_step5", 0, 1),
    ):
        pass
    assert getattr(raised.value, "exit_code", 2) == 2  # not retried: the store's copy is bad
    fs.pipe(f"{s3.bucket}/crc/global_step5/{name}", b"abc")
    with store.fetched("global_step5", 0, 1) as local:
        assert (Path(local) / "global_step5" / name).read_bytes() == b"abc"
    store.write_text(f"global_step5/{marker_name(0)}", json.dumps(marker)[:20])  # truncated
    assert store.missing("global_step5") == f"{marker_name(0)} does not parse (truncated?)"


def test_credentials_revoked_mid_run_give_one_line_naming_the_url(
    s3, pretrain_shards: Path, tmp_path: Path
) -> None:
    """The run's access key is deleted once its first checkpoint is published: the next
    upload is refused (403). The line is that refusal's, naming the checkpoint URL (the
    save after the error meets the same 403 and must not replace it); no secret printed."""
    import threading
    import time

    import boto3
    import s3fs

    from tests.cli_runner import run_cli

    user = s3.server.user_env(f"revoked-{tmp_path.name[-12:]}", ["s3:*"])
    checkpoints = f"{s3.bucket}/revoked/checkpoints"
    cfg = _config(tmp_path, str(pretrain_shards), checkpoints, steps=8)
    admin = boto3.client(
        "s3",
        endpoint_url=s3.env["AWS_ENDPOINT_URL"],
        aws_access_key_id=s3.env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=s3.env["AWS_SECRET_ACCESS_KEY"],
        region_name=s3.env["AWS_DEFAULT_REGION"],
    )
    iam = boto3.client(
        "iam",
        endpoint_url=s3.env["AWS_ENDPOINT_URL"],
        aws_access_key_id=s3.env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=s3.env["AWS_SECRET_ACCESS_KEY"],
        region_name=s3.env["AWS_DEFAULT_REGION"],
    )
    bucket, _, prefix = checkpoints.removeprefix("s3://").partition("/")
    revoked = threading.Event()

    def revoke() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            listed = admin.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/latest")
            if listed.get("KeyCount"):
                name = f"revoked-{tmp_path.name[-12:]}"
                iam.delete_access_key(UserName=name, AccessKeyId=user["AWS_ACCESS_KEY_ID"])
                revoked.set()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=revoke, daemon=True)
    watcher.start()
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        done = run_cli(["pretrain", "--config", str(cfg)], {**_env(), **user})
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        watcher.join(timeout=5)
    assert revoked.is_set()
    lines = [line for line in done.stderr.splitlines() if line.startswith("bertpipe: error:")]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert checkpoints in lines[0] and "check AWS_ACCESS_KEY_ID" in lines[0], lines[0]
    assert user["AWS_SECRET_ACCESS_KEY"] not in done.stderr + done.stdout
