"""Preprocessing from and to object storage (issue 16): a corpus in an S3 bucket, the tokenizer
trained from it into the bucket, and the Beam job writing its shards there (on the direct
runner's worker processes: ``tests/storage/test_s3_flow.py``; on a Dask cluster across test
hosts, S3 to S3 with deduplication, compared byte for byte with the direct runner:
``tests/multihost/test_dask_hosts.py``). The server is
real HTTP S3 with authentication (:mod:`tests.s3`), reached as MinIO or Ceph users reach
theirs: through ``AWS_ENDPOINT_URL`` and keys in the environment, which every worker process
must inherit.

The shards and the manifest's statistics must be byte-identical to the same job on local disk,
and no scratch (``_spill``, ``_parts``, ``_progress``) may be left in the bucket.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from bertpipe import fsio
from bertpipe.config import load_config
from bertpipe.preprocessing.config import PreprocessConfig, TokenizerConfig
from bertpipe.preprocessing.run import run_preprocess
from bertpipe.preprocessing.vocab import train_tokenizer
from tests.conftest import synthetic_documents, write_sentence_files

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@dataclass
class Job:
    """The module's corpus and tokenizer (local and in the bucket) and the local job's files."""

    bucket: str
    env: dict[str, str]
    corpus: str
    tokenizer: str
    local: dict[str, bytes]
    """Relative path -> bytes of every file the local run wrote."""


def _cfg(corpus: str, tokenizer: str, output: str) -> PreprocessConfig:
    return load_config(
        PreprocessConfig,
        None,
        [
            f"input.paths=[{corpus}]",
            f"tokenizer={tokenizer}",
            f"output={output}",
            "phases=[{name: seq64, max_seq_length: 64, max_predictions_per_seq: 10,"
            " num_shards: 3}]",
            "heldout_fraction=0.05",
            "bucket_mb=0.02",  # several buckets and read ranges: work really is spread
            "split_mb=0.03",
            "tokenize_batch_documents=16",
            "instances_per_sample=32",
            # deduplication's records, signatures (ranged reads) and drops in the bucket too
            "quality.dedup.exact=true",
            "quality.dedup.near=true",
            "quality.samples=3",
            "tracking.enabled=false",
        ],
    )


def _files(folder: str) -> dict[str, bytes]:
    """Relative path -> bytes of every file under ``folder`` (local or ``s3://``)."""
    fs, root = fsio.to_fs(folder)
    return {p[len(root) :].lstrip("/"): fs.cat_file(p) for p in sorted(fs.find(root))}


@pytest.fixture(scope="module")
def job(s3_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    """A corpus uploaded to a fresh bucket, a tokenizer trained from it into the bucket, and
    the reference: the job on local disk (in process) with that tokenizer."""
    import s3fs

    env = s3_server.env()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        s3fs.S3FileSystem.clear_instance_cache()
        local = tmp_path_factory.mktemp("s3job")
        docs = synthetic_documents(160, seed=7)
        # exact copies, and near ones (a word changed in a long document)
        near = [[*d[:-1], d[-1].replace(" ", " zq ", 1)] for d in docs[20:40] if len(d) > 6]
        write_sentence_files(local / "corpus", docs + docs[:8] + near, files=3)
        bucket = s3_server.make_bucket()
        fs, _ = fsio.to_fs(bucket)
        fs.put(str(local / "corpus"), f"{bucket}/corpus", recursive=True)
        tok_cfg = load_config(
            TokenizerConfig,
            None,
            [
                f"input.paths=[{bucket}/corpus]",
                f"output={bucket}/tokenizer",
                "vocab_size=400",
                "min_frequency=1",
                "tracking.enabled=false",
            ],
        )
        train_tokenizer(tok_cfg)
        fs.get(f"{bucket}/tokenizer", str(local / "tokenizer"), recursive=True)
        out = local / "out"
        run_preprocess(
            _cfg(str(local / "corpus"), str(local / "tokenizer"), str(out)),
            ["--direct_num_workers=1"],
        )
        yield Job(bucket, env, f"{bucket}/corpus", f"{bucket}/tokenizer", _files(str(out)))
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3_env(job: Job, monkeypatch: pytest.MonkeyPatch) -> Job:
    for name, value in job.env.items():
        monkeypatch.setenv(name, value)
    return job


def test_local_reference_is_what_the_manifest_lists(job: Job) -> None:
    manifest = json.loads(job.local["seq64/manifest.json"])
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            data = job.local[f"seq64/{shard['file']}"]
            assert hashlib.sha256(data).hexdigest() == shard["sha256"]


def test_progress_sees_markers_that_other_processes_write(s3_env: Job) -> None:
    """s3fs caches a listing for good and forgets it only for its own writes: the driver's
    progress line must still count the markers the workers (other clients) leave."""
    import s3fs

    from bertpipe.preprocessing.pipeline import progress_folder
    from bertpipe.preprocessing.run import PreprocessProgress, prepare

    cfg = _cfg(s3_env.corpus, s3_env.tokenizer, f"{s3_env.bucket}/progress")
    plan, ranges = prepare(cfg)
    progress = PreprocessProgress(plan, ranges, poll_s=3600)
    worker = s3fs.S3FileSystem(skip_instance_cache=True)  # as a worker process's client
    worker.pipe_file(f"{progress_folder(cfg.output)}/read-{ranges[0].index:06d}", b"")
    assert progress.poll() == pytest.approx(0.45 * ranges[0].text_bytes / 1e6)
    for r in ranges[1:]:
        worker.pipe_file(f"{progress_folder(cfg.output)}/read-{r.index:06d}", b"")
    assert progress.poll() == pytest.approx(0.45 * sum(r.text_bytes for r in ranges) / 1e6)
