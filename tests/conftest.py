"""Shared fixtures: small corpora and a tokenizer written by the tests themselves.

The environment is set here once for every test: DeepSpeed on CPU with its compiled ops
cached in the project, tokenizers without fork warnings, MLflow never at a default URI.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Under pytest-xdist (`make test`: one worker per core) every worker and its children compute
# on one thread: two workers with torch's default of a thread per core would oversubscribe
# the cores (a compute-bound test ran 5x slower). Set before numpy and torch are imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest

from tests.faultenv import install_from_environ

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("MLFLOW_TRACKING_URI", None)
# the fault-injection entry point of in-process runs: a test asks for a fault by setting a
# BERTPIPE_FAULT_* variable (tests/faultenv.py); bertpipe itself reads none of them
install_from_environ()
# this Python's bin folder first, as `make` does, for this process and every child: DeepSpeed
# builds its CPU op with the `ninja` on PATH, and two ninja versions (the environment's and a
# system one) disagree on the build log, so each would rebuild the op (~25 s) after the other
_BIN = str(Path(sys.executable).parent)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")

_WORDS_TEXT = (
    "the of and to in a is that for it as was with be by on not he i this are or his from at "
    "which but have an they you were her she there been one all we their has would when if so "
    "no will more can said who about out up them some could what into only other time new also "
    "than two may then do first any my now such like our over man me even most made after "
    "world through back years where much before should how people just state after between "
    "under never system water country during without against government early small number "
    "interest general however public information program development present problem national "
    "possible political economic important international community example university "
    "population understanding organization particularly administration approximately "
    "responsibility characteristics implementation configuration "
)
WORDS = tuple(_WORDS_TEXT.split())


def synthetic_documents(
    n_docs: int, seed: int = 0, min_sent: int = 2, max_sent: int = 40
) -> list[list[str]]:
    """Documents of English-like sentences (common words, capitalised, full stops)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        sentences = []
        for _ in range(int(rng.integers(min_sent, max_sent + 1))):
            words = [WORDS[i] for i in rng.integers(0, len(WORDS), int(rng.integers(4, 22)))]
            words[0] = words[0].capitalize()
            sentences.append(" ".join(words) + ".")
        docs.append(sentences)
    return docs


def write_sentence_files(folder: Path, docs: list[list[str]], files: int = 3) -> list[Path]:
    """Write ``docs`` in the one-sentence-per-line layout, spread over ``files`` files."""
    folder.mkdir(parents=True, exist_ok=True)
    chunks: list[list[str]] = [[] for _ in range(files)]
    for i, doc in enumerate(docs):
        chunks[i % files].append("\n".join(doc) + "\n\n")
    paths = []
    for i, chunk in enumerate(chunks):
        path = folder / f"part-{i}.txt"
        path.write_text("".join(chunk), encoding="utf-8")
        paths.append(path)
    return paths


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 documents in three sentence-per-line files."""
    folder = tmp_path_factory.mktemp("corpus")
    write_sentence_files(folder, synthetic_documents(200, seed=1))
    return folder


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> Path:
    """A WordPiece tokenizer trained on ``corpus_dir`` (vocabulary of 400)."""
    from bertpipe.preprocessing.tokenizer import save_tokenizer, train_wordpiece

    folder = tmp_path_factory.mktemp("tokenizer")
    texts = [
        line
        for p in sorted(corpus_dir.glob("*.txt"))
        for line in p.read_text().splitlines()
        if line
    ]
    tokenizer = train_wordpiece(texts, vocab_size=400, min_frequency=1)
    save_tokenizer(tokenizer, str(folder), lowercase=True)
    return folder


@pytest.fixture(scope="session")
def pretrain_shards(
    tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path, tokenizer_dir: Path
) -> Path:
    """Shards of the synthetic corpus: ``seq64`` and ``seq128`` phases, with held-out splits."""
    from bertpipe.config import load_config
    from bertpipe.preprocessing.config import PreprocessConfig
    from bertpipe.preprocessing.run import run_preprocess

    out = tmp_path_factory.mktemp("shards")
    cfg = load_config(
        PreprocessConfig,
        None,
        [
            f"input.paths=[{corpus_dir}]",
            f"tokenizer={tokenizer_dir}",
            f"output={out}",
            "phases=[{name: seq64, max_seq_length: 64, max_predictions_per_seq: 10, num_shards: 4},"
            " {name: seq128, max_seq_length: 128, max_predictions_per_seq: 20, num_shards: 4}]",
            "dupe_factor=2",
            "heldout_fraction=0.1",
            "instances_per_sample=32",
            "tracking.enabled=false",
        ],
    )
    run_preprocess(cfg)
    return out


@pytest.fixture(scope="session")
def mlm_shards(
    tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path, tokenizer_dir: Path
) -> Path:
    """Shards of the ``mlm`` objective (packed full sentences, 30% dynamic masking): ``seq64``."""
    from bertpipe.config import load_config
    from bertpipe.preprocessing.config import PreprocessConfig
    from bertpipe.preprocessing.run import run_preprocess

    out = tmp_path_factory.mktemp("mlm-shards")
    cfg = load_config(
        PreprocessConfig,
        None,
        [
            f"input.paths=[{corpus_dir}]",
            f"tokenizer={tokenizer_dir}",
            f"output={out}",
            "objective=mlm",
            "masking.masked_lm_prob=0.3",
            "phases=[{name: seq64, max_seq_length: 64, max_predictions_per_seq: 20,"
            " num_shards: 4}]",
            "dupe_factor=2",
            "heldout_fraction=0.1",
            "instances_per_sample=32",
            "tracking.enabled=false",
        ],
    )
    run_preprocess(cfg)
    return out


_EMPTY_STORE: Path | None = None


def sqlite_uri(path: Path | str) -> str:
    """``sqlite:///<path>``, a sqlite MLflow store private to the test. Unless ``path`` exists it
    starts as a copy of an empty store made once per test process: MLflow builds a new
    database's tables by running its ~100 schema migrations, 1-2 s for each of the suite's
    many stores and servers (every process that opens a new one pays it). A new database
    built by MLflow itself stays covered by ``test_runs`` (and the demo)."""
    global _EMPTY_STORE
    import shutil
    import tempfile

    target = Path(path)
    if not target.exists():
        if _EMPTY_STORE is None or not _EMPTY_STORE.exists():
            import mlflow

            template = Path(tempfile.mkdtemp(prefix="bertpipe-mlflow-")) / "empty.db"
            mlflow.MlflowClient(tracking_uri=f"sqlite:///{template}").search_experiments()
            _EMPTY_STORE = template
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_EMPTY_STORE, target)
    return f"sqlite:///{target}"


@pytest.fixture
def mlflow_uri(tmp_path: Path) -> str:
    """A sqlite MLflow store private to the test (see :func:`sqlite_uri`)."""
    return sqlite_uri(tmp_path / "mlflow.db")


def free_port() -> int:
    """A TCP port nothing listens on now (for a server the test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def end_process_group(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM to the process group ``proc`` leads (a server and its workers), SIGKILL after
    ``timeout`` seconds; reaped either way."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


@pytest.fixture
def keep_logging() -> Iterator[None]:
    """For tests that call the CLI's ``main`` (which sets up logging): the root logger is
    put back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def parity_task(folder: Path) -> tuple[Path, Path]:
    """A two-class table task in the synthetic corpus's words (its tokenizer knows them):
    ``train.jsonl`` and ``dev.jsonl`` in ``folder``."""
    import json

    rows = []
    for i in range(48):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(6)]
        rows.append({"text": " ".join(words), "label": "even" if i % 2 == 0 else "odd"})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:16]))
    return folder / "train.jsonl", folder / "dev.jsonl"


class MlflowServer:
    """A real ``mlflow server`` (sqlite backend with model registry, artifacts served from
    ``<folder>/server-artifacts``) on a fixed free port, which a test can stop and start
    again on the same port and store."""

    def __init__(
        self, folder: Path, artifacts: str | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.folder = folder
        self.artifacts = artifacts or str(folder / "server-artifacts")
        self.env = env
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--backend-store-uri",
                sqlite_uri(self.folder / "server.db"),  # a new one starts 2 s faster as a copy
                "--artifacts-destination",
                self.artifacts,
                "--workers",
                "1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # no GenAI job runner: a second process bertpipe never uses
            env={**(self.env or os.environ), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
            start_new_session=True,  # its own process group: stop() ends its workers too
        )
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.5)

    @property
    def up(self) -> bool:
        return self.proc is not None

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        end_process_group(proc, 30)
        deadline = time.monotonic() + 30  # until the port refuses connections
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=1).close()
            except OSError:
                return
            time.sleep(0.2)


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    """A running :class:`MlflowServer` for the test; yields its http:// URI."""
    server = MlflowServer(tmp_path)
    server.start()
    try:
        yield server.uri
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real S3 server (moto's server mode, :mod:`tests.s3`) on 127.0.0.1 for the session."""
    from tests.s3 import running_server

    yield from running_server(tmp_path_factory.mktemp("s3server"))


class S3Env:
    """What an S3 test holds: the server, a fresh bucket (``s3://…``) and the environment
    (already set in this process) that its child processes need."""

    def __init__(self, server: Any, bucket: str, env: dict[str, str]) -> None:
        self.server = server
        self.bucket = bucket
        self.env = env

    def child_env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, **self.env, **extra}


@pytest.fixture
def s3(s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Env]:
    """The session's S3 server with a new bucket, its endpoint and keys in the environment
    (as a MinIO/Ceph user would set them) and s3fs's cached clients dropped before and after."""
    import s3fs

    env = s3_server.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield S3Env(s3_server, s3_server.make_bucket(), env)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist's worksteal (``make test``), each half of the run starts with slow
    tests and ends with quick ones.

    worksteal gives each of the two workers one contiguous half of the collection, and a worker
    that runs dry takes the second half of the other's queue. With the slow tests (``slow``:
    minute-long, multi-process) at the head of both halves, what is stolen and run last is
    quick, so neither core sits idle while the other finishes a minute-long test. A slow
    module's slow tests stay together (module fixtures are built once per worker). Every
    worker computes the same order, as xdist requires."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    groups: dict[str, list[pytest.Item]] = {}
    light: list[pytest.Item] = []
    for item in items:
        if item.get_closest_marker("slow"):
            groups.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
        else:
            light.append(item)
    heavy: tuple[list[pytest.Item], list[pytest.Item]] = ([], [])
    for group in sorted(groups.values(), key=len, reverse=True):  # the larger groups first
        min(heavy, key=len).extend(group)
    half = len(items) // 2
    cut = max(0, min(len(light), half - len(heavy[0])))
    items[:] = [*heavy[0], *light[:cut], *heavy[1], *light[cut:]]
