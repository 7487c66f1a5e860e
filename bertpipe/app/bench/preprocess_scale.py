"""``bertpipe bench preprocess --scale-mb N``: the real CLI at corpus scale, memory and speed.

Writes a deterministic corpus of ``N`` MB (:mod:`bertpipe.preprocessing.synthetic`, or the
files given with ``--corpus`` repeated up to that size) to ``--files`` files, trains a
16,000-token vocabulary on a 20 MB sample once, then runs ``bertpipe preprocess`` (one phase
of 128 tokens, ``dupe_factor`` 5, no MLflow) as a child process:

- ``--runner direct --workers 1``: the FnApiRunner in-process (``--direct_num_workers=1``);
- ``--runner direct --workers K``: ``--direct_running_mode=multi_processing``, K workers;
- ``--runner dask --workers K``: a local Dask cluster started with the ``dask scheduler``
  and ``dask worker --nworkers K --nthreads 1`` commands, the job sent to it with
  ``--runner=DaskRunner --dask_scheduler_file=...``;
- ``--runner dask --dask-address tcp://HOST:8786 --workers K``: a running cluster of K
  workers, which may sit on other machines; with ``--storage URL`` (``s3://bucket/prefix``)
  the corpus and the tokenizer are copied there once and the shards are written there, so
  that workers which share no disk with this machine can run the job
  (``infra/scripts/bench-dask-hosts`` starts such a cluster on test hosts and runs this).

The run (and the Dask workers) is pinned to ``--workers`` CPUs, one core per worker, so
that MB/s per worker is per core. The peak memory is the largest sum, over all processes
started for the run (the CLI, Beam's worker processes, the Dask scheduler and workers), of
their resident set size, sampled every 0.2 s; ``peak_rss_max_process_mb`` is the largest
single process. Wall time is the CLI's whole run, start-up included. The corpus and
tokenizer are kept in ``--workdir`` and reused by later runs with the same size, file count
and source.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["add_scale_arguments", "run_scale"]


def add_scale_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scale run (with --scale-mb)")
    group.add_argument("--scale-mb", type=float, help="corpus size in MB: runs the scale bench")
    group.add_argument("--workers", type=int, default=1, help="Beam workers (default 1)")
    group.add_argument("--runner", choices=("direct", "dask"), default="direct")
    group.add_argument(
        "--dask-address",
        help="with --runner dask: a running scheduler (tcp://HOST:PORT) instead of a local "
        "cluster; --workers is then how many workers it has (for MB/s per worker)",
    )
    group.add_argument(
        "--storage",
        help="an fsspec URL (s3://bucket/prefix) that holds the corpus, the tokenizer and the "
        "shards, for workers that share no disk with this machine",
    )
    group.add_argument("--files", type=int, default=16, help="corpus files (1: one big file)")
    group.add_argument("--corpus", help="repeat these files (sentences layout) instead")
    group.add_argument("--seed", type=int, default=0, help="synthetic corpus seed")
    group.add_argument(
        "--preempt",
        action="store_true",
        help="then the same job again into a new output, SIGTERMed once its first shard is "
        "written, and continued with the same command: its wall times against the full run's",
    )
    group.add_argument(
        "--planted",
        action="store_true",
        help="a synthetic corpus with planted copies: 2%% exact, 2%% near (Jaccard 0.85-0.95), "
        "2%% below the threshold (0.4-0.7), 0.2%% with an evaluation sentence",
    )
    group.add_argument(
        "--quality",
        action="store_true",
        help="with every quality step on: Gopher's filters, decontamination against the "
        "planted evaluation set, exact and near-duplicate removal (implies --planted)",
    )
    group.add_argument(
        "--format",
        choices=("sentences", "parquet"),
        default="sentences",
        help="corpus files: sentence per line, or parquet (a document per row, as hub datasets)",
    )


_QUALITY = [
    "quality.filters.gopher=true",
    "quality.dedup.exact=true",
    "quality.dedup.near=true",
]


def _corpus(args: argparse.Namespace, work: Path) -> Path:
    from bertpipe.preprocessing.synthetic import (
        eval_sentences,
        write_planted_corpus,
        write_synthetic_corpus,
    )

    source = Path(args.corpus).resolve() if args.corpus else None
    tag = f"{args.scale_mb:g}mb-{args.files}f-" + (
        f"copies-{abs(hash(str(source))) % 10**8}" if source else f"synthetic-{args.seed}"
    )
    if args.format == "parquet":
        tag += "-parquet"
    if args.planted or args.quality:
        tag += "-planted"
    folder = work / f"corpus-{tag}"
    done = folder / ".complete"
    if done.exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    started = time.monotonic()
    if source is None and (args.planted or args.quality):
        truth = write_planted_corpus(
            folder,
            args.scale_mb,
            files=args.files,
            seed=args.seed,
            eval_sentences=eval_sentences(),
            contaminated=0.002,
        )
        (work / f"truth-{tag}.json").write_text(json.dumps(truth))
        tasks = work / "eval-tasks" / "planted"
        tasks.mkdir(parents=True, exist_ok=True)
        rows = "".join(f"{s}\t{i % 2}\n" for i, s in enumerate(eval_sentences()))
        (tasks / "dev.tsv").write_text("sentence\tlabel\n" + rows)
    elif source is None:
        write_synthetic_corpus(folder, args.scale_mb, files=args.files, seed=args.seed)
    else:
        _repeat(source, folder, args.scale_mb, args.files)
    if args.format == "parquet":
        _to_parquet(folder)
    done.write_text("")
    log.info("corpus %s written in %.0f s", folder, time.monotonic() - started)
    return folder


def _repeat(source: Path, folder: Path, megabytes: float, files: int) -> None:
    inputs = sorted(p for p in (source.rglob("*") if source.is_dir() else [source]) if p.is_file())
    blobs = [p.read_bytes().rstrip(b"\n") + b"\n\n" for p in inputs]
    folder.mkdir(parents=True)
    outs = [(folder / f"part-{i:05d}.txt").open("wb") for i in range(files)]
    written, k = 0, 0
    try:
        while written < megabytes * 1e6:
            blob = blobs[k % len(blobs)]
            outs[k % files].write(blob)
            written += len(blob)
            k += 1
    finally:
        for out in outs:
            out.close()


def _to_parquet(folder: Path, rows_per_group: int = 2000) -> None:
    """Each sentence-per-line file -> a parquet file of one document per row (``text``, the
    sentences joined by newlines, and ``id``), in row groups of ``rows_per_group``. The run
    reads it with ``input.split_sentences=false`` (a line is a sentence)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for path in sorted(folder.glob("*.txt")):
        docs = [d for d in path.read_text(encoding="utf-8").split("\n\n") if d.strip()]
        table = pa.table({"id": [f"{path.stem}-{i}" for i in range(len(docs))], "text": docs})
        pq.write_table(table, path.with_suffix(".parquet"), row_group_size=rows_per_group)
        path.unlink()


def _corpus_mb(corpus: Path, fmt: str) -> float:
    """Text megabytes of the corpus (for parquet: the text column, uncompressed)."""
    if fmt != "parquet":
        return sum(p.stat().st_size for p in corpus.glob("*.txt")) / 1e6
    import pyarrow.parquet as pq

    return (
        sum(
            sum(len(t.encode()) for t in pq.read_table(p, columns=["text"]).column(0).to_pylist())
            for p in corpus.glob("*.parquet")
        )
        / 1e6
    )


def _tokenizer(corpus: Path, work: Path, fmt: str = "sentences") -> Path:
    folder = work / f"tokenizer-{corpus.name}"
    if (folder / "tokenizer.json").exists():
        return folder
    _cli(
        [
            "tokenizer",
            "train",
            f"input.paths=[{corpus}]",
            f"input.format={fmt}",
            "input.split_sentences=false",
            f"output={folder}",
            "vocab_size=16000",
            "max_mb=20",
            "overwrite=true",
            "tracking.enabled=false",
        ]
    )
    return folder


def _cli(
    argv: list[str], env: dict[str, str] | None = None, cpus: set[int] | None = None
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "bertpipe.app.cli", *argv]
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )
    if env is None:  # a set-up step: wait for it
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:2])} failed:\n{out.decode()[-3000:]}")
    return proc


class _TreeMemory:
    """Peak of the summed RSS of this process's descendants, sampled by a thread."""

    def __init__(self, interval: float = 0.2) -> None:
        import psutil

        self._me = psutil.Process()
        self._interval = interval
        self.peak_sum = 0
        self.peak_one = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(self._interval):
            total = 0
            for child in self._me.children(recursive=True):
                try:
                    rss = child.memory_info().rss
                except psutil.Error:
                    continue
                total += rss
                self.peak_one = max(self.peak_one, rss)
            self.peak_sum = max(self.peak_sum, total)


def _to_storage(folder: Path, storage: str) -> str:
    """``folder`` copied to ``storage/<its name>`` once (a ``.complete`` marker after it)."""
    from bertpipe import fsio

    url = fsio.join(storage, folder.name)
    fs, root = fsio.to_fs(url)
    if not fs.exists(f"{root}/.complete"):
        started = time.monotonic()
        if fs.exists(root):
            fs.rm(root, recursive=True)
        fs.put(f"{folder}/", root, recursive=True)
        fs.pipe_file(f"{root}/.complete", b"")
        log.info("%s copied to %s in %.0f s", folder, url, time.monotonic() - started)
    return url


def _manifest(out: str) -> dict[str, Any]:
    from bertpipe import fsio

    fs, root = fsio.to_fs(fsio.join(out, "seq128", "manifest.json"))
    return dict(json.loads(fs.cat_file(root)))


def run_scale(args: argparse.Namespace) -> dict[str, Any]:
    if args.dask_address and args.runner != "dask":
        raise SystemExit("bertpipe: error: --dask-address needs --runner dask")
    if args.storage and args.preempt:
        raise SystemExit("bertpipe: error: --preempt reads the shards locally: drop --storage")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        corpus = _corpus(args, work)
        tokenizer = _tokenizer(corpus, work, args.format)
        text_mb = _corpus_mb(corpus, args.format)
        out: Any = work / "shards"
        corpus_url, tokenizer_url = str(corpus), str(tokenizer)
        if args.storage:
            corpus_url = _to_storage(corpus, args.storage)
            tokenizer_url = _to_storage(tokenizer, args.storage)
            out = f"{args.storage.rstrip('/')}/shards"
        env = dict(os.environ)
        # a remote cluster's workers are pinned where they run, not here
        cpus = None if args.dask_address else _cpus(args.workers)
        extra: list[subprocess.Popen[bytes]] = []
        if args.dask_address:
            beam = ["--runner=DaskRunner", f"--dask_client_address={args.dask_address}"]
        elif args.runner == "direct":
            beam = (
                ["--direct_num_workers=1"]
                if args.workers == 1
                else [
                    "--direct_running_mode=multi_processing",
                    f"--direct_num_workers={args.workers}",
                ]
            )
        else:
            scheduler_file = work / "dask-scheduler.json"
            scheduler_file.unlink(missing_ok=True)
            dask_env = dict(env, RAYON_NUM_THREADS="1")
            dask = shutil.which("dask", path=str(Path(sys.executable).parent)) or "dask"
            extra.append(
                subprocess.Popen(
                    [
                        dask,
                        "scheduler",
                        "--scheduler-file",
                        str(scheduler_file),
                        "--host",
                        "127.0.0.1",
                        "--no-dashboard",
                    ],
                    env=dask_env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            while not scheduler_file.exists():
                time.sleep(0.2)
            extra.append(
                subprocess.Popen(
                    [
                        dask,
                        "worker",
                        "--scheduler-file",
                        str(scheduler_file),
                        "--nworkers",
                        str(args.workers),
                        "--nthreads",
                        "1",
                        "--memory-limit",
                        "0",
                        "--no-dashboard",
                        "--host",
                        "127.0.0.1",
                    ],
                    env=dask_env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
                )
            )
            _wait_workers(scheduler_file, args.workers)
            beam = ["--runner=DaskRunner", f"--dask_scheduler_file={scheduler_file}"]
        argv = [
            "preprocess",
            f"input.paths=[{corpus_url}]",
            f"input.format={args.format}",
            "input.id_field=id" if args.format == "parquet" else "input.id_field=null",
            # the synthetic text is lower-case, which a sentence splitter cannot cut: a
            # document's lines are its sentences, as in the sentence-per-line files
            "input.split_sentences=false",
            f"tokenizer={tokenizer_url}",
            f"output={out}",
            "overwrite=true",
            f"dupe_factor={args.dupe_factor}",
            "phases=[{name: seq128, max_seq_length: 128, max_predictions_per_seq: 20}]",
            "tracking.enabled=false",
            *(
                [*_QUALITY, f"quality.decontaminate.paths=[{work / 'eval-tasks'}]"]
                if args.quality
                else []
            ),
            "--",
            *beam,
        ]
        try:
            with _TreeMemory() as memory:
                started = time.monotonic()
                proc = _cli(argv, env, cpus)
                output, _ = proc.communicate()
                wall = time.monotonic() - started
        finally:
            for p in reversed(extra):
                p.terminate()
                p.wait(timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"bertpipe preprocess failed:\n{output.decode()[-4000:]}")
        manifest = _manifest(str(out))
        splits = manifest["splits"]
        preempted = _preempted(argv, out, work, env, cpus) if args.preempt else {}
        corpus_stats = manifest["stats"]["corpus"]
        removed = {k: v for k, v in corpus_stats.items() if k.startswith("removed_")}
        truth_file = work / f"truth-{corpus.name.removeprefix('corpus-')}.json"
        if args.quality and truth_file.exists():  # what was planted, to read the counts by
            truth = json.loads(truth_file.read_text())
            removed.update({f"planted_{k}": len(v) for k, v in truth.items()})
        return {
            **preempted,
            **(
                {"quality": True, "documents_read": corpus_stats["documents_read"], **removed}
                if args.quality
                else {}
            ),
            "planted": bool(args.planted or args.quality),
            "mb": round(text_mb, 1),
            "files": args.files,
            "format": args.format,
            "runner": args.runner,
            "cluster": args.dask_address or None,
            "storage": args.storage or None,
            "workers": args.workers,
            "wall_s": round(wall, 1),
            "mb_per_s": round(text_mb / wall, 3),
            "mb_per_s_per_worker": round(text_mb / wall / args.workers, 3),
            "peak_rss_mb": round(memory.peak_sum / 2**20, 1),
            "peak_rss_max_process_mb": round(memory.peak_one / 2**20, 1),
            # a running cluster's processes are not this process's children
            "peak_rss_of": "the driver" if args.dask_address else "the whole run",
            "instances": splits["train"]["instances"] + splits["heldout"]["instances"],
            "train_shards": splits["train"]["num_shards"],
            "num_buckets": manifest["num_buckets"],
            "dupe_factor": args.dupe_factor,
            "cpus": len(cpus) if cpus else None,
        }


def _preempted(
    argv: list[str], out: Path, work: Path, env: dict[str, str], cpus: set[int] | None
) -> dict[str, Any]:
    """The job of ``argv`` into a new output, SIGTERMed (the driver only, as a container's
    PID 1 gets it) once its first shard is written, then the same command again: it
    continues. Its output must equal the full run's in ``out``, byte for byte."""
    import signal

    again = work / "preempted"
    shutil.rmtree(again, ignore_errors=True)
    command = [a for a in argv if a != "overwrite=true"]
    command = [f"output={again}" if a.startswith("output=") else a for a in command]
    started = time.monotonic()
    proc = _cli(command, env, cpus)
    while proc.poll() is None and not list((again / "seq128").glob("train-*.tar")):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stopped_out, _ = proc.communicate()
    stopped = time.monotonic() - started
    if proc.returncode != 143:
        raise RuntimeError(
            f"the SIGTERMed run exited {proc.returncode}:\n{stopped_out.decode()[-3000:]}"
        )
    shards_before = len(list((again / "seq128").glob("train-*.tar")))
    started = time.monotonic()
    proc = _cli(command, env, cpus)
    output, _ = proc.communicate()
    continued = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"the continued run failed:\n{output.decode()[-3000:]}")
    same = (again / "seq128" / "manifest.json").read_bytes() == (
        out / "seq128" / "manifest.json"
    ).read_bytes()
    shards = sorted(p.name for p in (out / "seq128").glob("*.tar"))
    same = same and all(
        (again / "seq128" / n).read_bytes() == (out / "seq128" / n).read_bytes() for n in shards
    )
    partial = [p.name for p in again.rglob("*") if ".tmp-" in p.name]
    return {
        "preempted_after_s": round(stopped, 1),
        "shards_when_preempted": shards_before,
        "continued_wall_s": round(continued, 1),
        "continued_byte_identical": same,
        "partial_files_left": len(partial),
    }


def _cpus(workers: int) -> set[int] | None:
    """The first ``workers`` CPUs this process may use: the run gets one core per worker
    (tokenizer threads included), so that MB/s per worker is per core."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    mine = sorted(os.sched_getaffinity(0))
    if workers > len(mine):
        log.warning("%d workers on %d CPUs: not pinned", workers, len(mine))
        return None
    return set(mine[:workers])


def _wait_workers(scheduler_file: Path, n: int, timeout: float = 120.0) -> None:
    from distributed import Client

    with Client(scheduler_file=str(scheduler_file), timeout=timeout) as client:
        client.wait_for_workers(n, timeout=timeout)
