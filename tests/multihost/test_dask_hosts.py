"""Preprocessing across machines (issue 30): the Beam job on a Dask cluster whose scheduler and
workers sit on separate test hosts that share no scratch, with the corpus, the tokenizer and
the output on object storage.

Three test hosts (:mod:`tests.netns`): host 1 (192.0.2.1) runs the Dask scheduler, a worker
and the job's driver (`bertpipe preprocess ... -- --runner=DaskRunner`); host 2 (192.0.2.2)
a worker; host 3 (192.0.2.3) the S3 server (:mod:`tests.s3`), which this process cannot
reach. The job's config names only ``s3://`` URLs, and each host's processes get their own
``TMPDIR``, ``HOME`` and Dask ``--local-directory``, so nothing a worker reads or writes can
come from a local folder another host sees. The reference is the same job on the direct
runner in this process, on local copies of the same corpus and tokenizer: shards and
manifest must be byte-identical (the manifest's config differs only in where the inputs lie).

The second test loses host 2 twice in one job: its worker holds a read task (a stall
fault, :mod:`tests.faultenv`, makes that certain) when every process on it is killed; a new
worker started on host 2 then holds work of the shard stage (a shard task, or bucket results
that shards need) when its cable is pulled (host 1 writes no shard until then, so the job
cannot end without it), and the scheduler drops it after
``worker-ttl``. Dask reschedules the lost tasks on host 1's worker and the job completes
with the same bytes; or (a Dask worker can wait for good on a peer that vanished mid-fetch)
the driver's watch (:mod:`bertpipe.preprocessing.dask_watch`) ends the job within its bound
with exit 75 and one line naming host 2's worker, and the same command then completes it
with the same bytes. The test accepts either and prints which. The two tests share the
scheduler and host 1's worker; a job that does not end puts what the scheduler and each
worker still hold in the failure message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bertpipe.config import load_config, to_yaml
from bertpipe.errors import TEMPFAIL_EXIT_CODE
from bertpipe.preprocessing.config import PreprocessConfig, TokenizerConfig
from bertpipe.preprocessing.run import run_preprocess
from bertpipe.preprocessing.vocab import train_tokenizer
from tests.conftest import end_process_group, synthetic_documents, write_sentence_files
from tests.faultenv import FAULT_PREPROCESS_HOLD, FAULT_PREPROCESS_STALL, child_pythonpath
from tests.netns import NetnsUnavailableError, TestHosts
from tests.s3 import S3Server

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.multihost]

REPO = Path(__file__).resolve().parent.parent.parent
BIN = Path(sys.executable).parent
SCHEDULER = "tcp://192.0.2.1:8786"
HOLD = "hold-shards"
TIMEOUT_S = 300  # a job; a hung cluster fails the test, not the suite
WORKER_TTL_S = 6  # the scheduler drops a worker it has not heard from for this long
TCP_TIMEOUT_S = 12  # distributed needs at least 11 (10 keepalive probes)


@dataclass
class Cluster:
    hosts: TestHosts
    s3: S3Server
    bucket: str
    root: Path
    reference: dict[str, bytes]
    """Relative path -> bytes of the direct runner's output on local disk."""


def _overrides(corpus: str, tokenizer: str, output: str) -> list[str]:
    return [
        f"input.paths=[{corpus}]",
        f"tokenizer={tokenizer}",
        f"output={output}",
        "phases=[{name: seq64, max_seq_length: 64, max_predictions_per_seq: 10, num_shards: 6}]",
        "heldout_fraction=0.05",
        "dupe_factor=2",
        "bucket_mb=0.1",  # 4 buckets and 8 read ranges: work for both hosts in every stage
        "split_mb=0.05",
        "tokenize_batch_documents=16",
        "instances_per_sample=32",
        # deduplication's records, signatures (ranged reads) and drops on the storage too
        "quality.dedup.exact=true",
        "quality.dedup.near=true",
        "quality.samples=3",
        "tracking.enabled=false",
    ]


def _files(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _host_env(cluster_root: Path, host: int, s3: S3Server, **extra: str) -> dict[str, str]:
    """A host's environment: the storage's endpoint and keys, and folders of its own."""
    private = cluster_root / f"host{host + 1}"
    for name in ("tmp", "home", "dask"):
        (private / name).mkdir(parents=True, exist_ok=True)
    keep = ("PATH", "LANG", "LC_ALL", "DS_ACCELERATOR", "TORCH_EXTENSIONS_DIR")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    return {
        **env,
        **s3.env(),
        "TMPDIR": str(private / "tmp"),
        "HOME": str(private / "home"),
        "PYTHONPATH": child_pythonpath(REPO),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # a silent worker (its link cut) is dropped after WORKER_TTL_S, and its connections
        # fail after TCP_TIMEOUT_S (TCP_USER_TIMEOUT), not the defaults (5 min, 30 s)
        "DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL": f"{WORKER_TTL_S}s",
        "DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": f"{TCP_TIMEOUT_S}s",
        **extra,
    }


def _on_host(cluster: Cluster, host: int, code: str, *args: str, timeout: float = 120) -> str:
    """``python -c code args`` on a test host (its environment, the storage reachable)."""
    done = cluster.hosts.run(
        host,
        [sys.executable, "-c", code, *args],
        env=_host_env(cluster.root, host, cluster.s3),
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


_PUT = "import sys, fsspec; fsspec.filesystem('s3').put(sys.argv[1], sys.argv[2], recursive=True)"
_GET = "import sys, fsspec; fsspec.filesystem('s3').get(sys.argv[1], sys.argv[2], recursive=True)"
_WORKERS = """
import json, sys, time
from distributed import Client
want = sorted(sys.argv[2:])
with Client(sys.argv[1], timeout=60) as client:
    deadline = time.monotonic() + 120
    while True:
        names = sorted(w["name"] for w in client.scheduler_info()["workers"].values())
        if names == want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    print(json.dumps(names))
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Three test hosts, the S3 server on host 3 with the corpus and the tokenizer in a
    bucket, and the direct runner's output on local copies of both."""
    root = tmp_path_factory.mktemp("dask-hosts")
    try:
        hosts = TestHosts(3)
        hosts.open()
    except NetnsUnavailableError as err:
        pytest.skip(str(err))
    s3 = S3Server(root, host="192.0.2.3", netns=hosts.names[2])
    try:
        s3.start()
        bucket = s3.make_bucket()
        docs = synthetic_documents(260, seed=11)
        # exact copies, and near ones (a word changed in a long document)
        near = [[*d[:-1], d[-1].replace(" ", " zq ", 1)] for d in docs[20:40] if len(d) > 6]
        write_sentence_files(root / "corpus", docs + docs[:10] + near, files=4)
        tok = load_config(
            TokenizerConfig,
            None,
            [
                f"input.paths=[{root / 'corpus'}]",
                f"output={root / 'tokenizer'}",
                "vocab_size=400",
                "min_frequency=1",
                "tracking.enabled=false",
            ],
        )
        train_tokenizer(tok)
        out = root / "reference"
        cfg = load_config(
            PreprocessConfig,
            None,
            _overrides(str(root / "corpus"), str(root / "tokenizer"), str(out)),
        )
        run_preprocess(cfg, ["--direct_num_workers=1"])
        made = Cluster(hosts, s3, bucket, root, _files(out))
        for name in ("corpus", "tokenizer"):
            _on_host(made, 0, _PUT, str(root / name), f"{bucket}/{name}")
        yield made
    finally:
        s3.stop()
        hosts.close()


class Dask:
    """A scheduler on host 1; :meth:`worker` adds a worker on a host."""

    def __init__(self, cluster: Cluster, tag: str) -> None:
        self.cluster = cluster
        self.tag = tag
        self.procs: list[subprocess.Popen[bytes]] = []
        hosts = cluster.hosts
        self.procs.append(
            hosts.popen(
                0,
                [str(BIN / "dask"), "scheduler", "--host", "192.0.2.1", "--port", "8786",
                 "--no-dashboard"],
                env=_host_env(cluster.root, 0, cluster.s3),
                log=cluster.root / f"{tag}-scheduler.log",
            )
        )  # fmt: skip

    def worker(self, host: int, name: str, **extra: str) -> subprocess.Popen[bytes]:
        env = _host_env(self.cluster.root, host, self.cluster.s3, **extra)
        self.procs.append(
            self.cluster.hosts.popen(
                host,
                [str(BIN / "dask"), "worker", SCHEDULER, "--name", name, "--nworkers", "1",
                 "--nthreads", "1", "--host", f"192.0.2.{host + 1}", "--no-dashboard",
                 "--local-directory", str(Path(env["TMPDIR"]).parent / "dask")],
                env=env,
                log=self.cluster.root / f"{self.tag}-{name}.log",
            )
        )  # fmt: skip
        return self.procs[-1]

    def wait_for(self, *names: str) -> list[str]:
        """The workers' names once the scheduler has exactly ``names`` (or after 120 s)."""
        return json.loads(_on_host(self.cluster, 0, _WORKERS, SCHEDULER, *names))

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                end_process_group(proc, 10)


@pytest.fixture(scope="module")
def dask(cluster: Cluster) -> Iterator[Dask]:
    """The scheduler and host 1's worker, shared by the tests (host 2's come and go)."""
    made = Dask(cluster, "dask")
    try:
        # host 1 writes no shard while HOLD exists: the loss test's way to make sure host 2
        # gets shard tasks before the job can end without it
        made.worker(0, "host1", **{FAULT_PREPROCESS_HOLD: f"WriteShards:{cluster.root / HOLD}"})
        yield made
    finally:
        made.close()


def _submit(cluster: Cluster, output: str, tag: str, *extra: str) -> subprocess.Popen[bytes]:
    """The job's driver on host 1: ``bertpipe preprocess`` onto the cluster (the same
    command again for the same ``output``: the config is written once)."""
    b = cluster.bucket
    path = cluster.root / f"{output}.yaml"
    if not path.exists():
        overrides = [*_overrides(f"{b}/corpus", f"{b}/tokenizer", f"{b}/{output}"), *extra]
        path.write_text(to_yaml(load_config(PreprocessConfig, None, overrides)))
    return cluster.hosts.popen(
        0,
        [str(BIN / "bertpipe"), "preprocess", "--config", str(path), "--",
         "--runner=DaskRunner", f"--dask_client_address={SCHEDULER}"],
        env=_host_env(cluster.root, 0, cluster.s3),
        log=cluster.root / f"{tag}-driver.log",
    )  # fmt: skip


def _assert_same_as_reference(cluster: Cluster, output: str, tag: str) -> None:
    local = cluster.root / f"{tag}-output"
    _on_host(cluster, 0, _GET, f"{cluster.bucket}/{output}/", str(local))
    got, want = _files(local), cluster.reference
    assert "seq64" in got.pop("preprocess.yaml").decode()  # the CLI's resolved config
    assert sorted(got) == sorted(want)  # no scratch left behind, nothing missing
    shards = [p for p in want if p.endswith(".tar")]
    assert len(shards) >= 6
    for path in shards:
        assert got[path] == want[path], path
    manifest = json.loads(got["seq64/manifest.json"]), json.loads(want["seq64/manifest.json"])
    assert manifest[0]["splits"] == manifest[1]["splits"]  # every shard's sha256 and counts
    assert manifest[0]["stats"] == manifest[1]["stats"]
    corpus = manifest[1]["stats"]["corpus"]
    assert corpus["removed_exact_duplicate"] > 0 and corpus["removed_near_duplicate"] > 0
    where = ("input", "tokenizer")
    assert {k: v for k, v in manifest[0]["config"].items() if k not in where} == {
        k: v for k, v in manifest[1]["config"].items() if k not in where
    }


_STUCK = r"""
import sys
from distributed import Client

def worker_side(dask_worker):
    st = dask_worker.state
    left = {k: ts for k, ts in st.tasks.items() if ts.state != "memory"}
    lines = [f"{len(left)} task(s) not in memory"]
    for key, ts in list(left.items())[:20]:
        lines.append(f"{key} {ts.state} who_has={sorted(ts.who_has)}")
        lines += [f"    {event}" for event in st.story(key)[-8:]]
    return "\n".join(lines)

def scheduler_side(dask_scheduler):
    busy = [t for t in dask_scheduler.tasks.values() if t.state in ("processing", "no-worker")]
    return "\n".join(
        f"{t.key} {t.state} on {t.processing_on and t.processing_on.address}" for t in busy[:20]
    )

with Client(sys.argv[1], timeout=30) as client:
    print("scheduler:", client.run_on_scheduler(scheduler_side))
    for address, text in client.run(worker_side).items():
        print(address, text)
"""


def _wait(
    cluster: Cluster, proc: subprocess.Popen[bytes], log: Path, codes: tuple[int, ...] = (0,)
) -> int:
    try:
        code = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # a hung job: what the scheduler and each worker hold, in the failure message
        try:
            stuck = _on_host(cluster, 0, _STUCK, SCHEDULER, timeout=60)
        except (AssertionError, subprocess.TimeoutExpired) as err:
            stuck = f"(no cluster state: {err})"
        end_process_group(proc, 10)
        raise AssertionError(
            f"no end in {TIMEOUT_S} s: {log.read_text()[-2000:]}\n{stuck}"
        ) from None
    assert code in codes, log.read_text()[-4000:]
    return code


def test_two_hosts_s3_to_s3_same_bytes_as_the_direct_runner(cluster: Cluster, dask: Dask) -> None:
    host2 = dask.worker(1, "host2")
    try:
        assert dask.wait_for("host1", "host2") == ["host1", "host2"]
        driver = _submit(cluster, "plain", "plain")
        _wait(cluster, driver, cluster.root / "plain-driver.log")
    finally:
        end_process_group(host2, 10)
    # both hosts did work: each worker's private folder holds its Dask scratch
    for host in (1, 2):
        assert any((cluster.root / f"host{host}" / "dask").iterdir()), host
    _assert_same_as_reference(cluster, "plain", "plain")


def _wait_for_file(
    paths: tuple[Path, ...], driver: subprocess.Popen[bytes], log: Path, what: str
) -> Path:
    """The first of ``paths`` to appear (the job must not end before)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        for path in paths:
            if path.exists():
                return path
        assert driver.poll() is None, f"the job ended before {what}: " + log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {what} in {TIMEOUT_S} s"
        time.sleep(0.1)


STALL_TIMEOUT_S = 20
"""The job's ``stall_timeout_s`` in the loss test."""


def test_host2_lost_in_the_read_stage_and_again_in_the_shard_stage(
    cluster: Cluster, dask: Dask
) -> None:
    hosts, root = cluster.hosts, cluster.root
    read_marker, shard_marker = root / "stalled-read", root / "stalled-shard"
    hold = root / HOLD
    log = root / "lost-driver.log"
    rerun = None
    try:
        dask.worker(1, "host2-a", **{FAULT_PREPROCESS_STALL: f"ReadTokenize:{read_marker}"})
        assert dask.wait_for("host1", "host2-a") == ["host1", "host2-a"]
        hold.touch()
        driver = _submit(cluster, "lost", "lost", f"stall_timeout_s={STALL_TIMEOUT_S}")
        # 1. host 2's worker holds a read range: every process on host 2 is killed
        _wait_for_file((read_marker,), driver, log, "read task on host 2")
        hosts.kill_host(1)
        lost_read = time.monotonic()
        # 2. a new worker on host 2 (its machine back), lost in the shard stage (it holds a
        # shard task, or host 1 began one: host 1 writes none while HOLD exists) by pulling
        # its cable: the scheduler hears nothing from it and drops it after worker-ttl
        dask.worker(1, "host2-b", **{FAULT_PREPROCESS_STALL: f"WriteShards:{shard_marker}"})
        # joined before its link is cut: on a loaded machine its start-up (seconds) could
        # outlast host 1's read stage, and the job end without it (no loss to see)
        assert dask.wait_for("host1", "host2-b") == ["host1", "host2-b"]
        held = root / f"{HOLD}.held"
        _wait_for_file((shard_marker, held), driver, log, "shard stage")
        # host 1 holding its shard task leaves the other five to host 2: give its task the
        # moment to reach the stall (cut earlier, it held a task with nothing to lose yet)
        settle = time.monotonic() + 30
        while not shard_marker.exists() and time.monotonic() < settle and driver.poll() is None:
            time.sleep(0.1)
        hosts.link_down(1)
        cut = time.monotonic()
        hold.unlink()
        code = _wait(cluster, driver, log, codes=(0, TEMPFAIL_EXIT_CODE))
        finished = time.monotonic()
        if code == TEMPFAIL_EXIT_CODE:
            # Dask did not reschedule: the watch ended the job with one line naming host 2's
            # worker, within the bound; the same command continues it
            last = log.read_text().strip().splitlines()[-1]
            assert last.startswith("bertpipe: error: preprocess: the Dask cluster ran no task")
            assert "host2-b (192.0.2.2" in last.replace("tcp://", ""), last
            bound = WORKER_TTL_S + TCP_TIMEOUT_S + STALL_TIMEOUT_S + 30
            assert finished - cut < bound, (finished - cut, bound)
            rerun = root / "lost-again-driver.log"
            again = time.monotonic()
            _wait(cluster, _submit(cluster, "lost", "lost-again"), rerun)
            rerun_s = time.monotonic() - again
    finally:
        hold.unlink(missing_ok=True)
        hosts.kill_host(1)
        hosts.link_up(1)
    scheduler = (root / "dask-scheduler.log").read_text()
    removed = [line for line in scheduler.splitlines() if "Remove worker" in line]
    assert any("host2-a" in line for line in removed), scheduler[-3000:]
    assert any("host2-b" in line for line in removed), scheduler[-3000:]
    # host 2 had work of the shard stage: a shard task, or results of the buckets' stage
    lost_work = any(
        "caused the cluster to lose" in line and "192.0.2.2" in line
        for line in scheduler.splitlines()
    )
    assert shard_marker.exists() or lost_work, scheduler[-3000:]
    how = "rescheduled by Dask" if rerun is None else f"stopped by the watch, rerun {rerun_s:.1f} s"
    print(
        f"read loss to end {finished - lost_read:.1f} s, link cut to end {finished - cut:.1f} s"
        f" ({how}; host 2 held a shard task: {shard_marker.exists()})"
    )
    _assert_same_as_reference(cluster, "lost", "lost")
