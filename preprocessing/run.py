"""Entry points of the tokenizer and preprocessing stages: checks first, then the work.

Everything that can be wrong with a run (no matching input, a tokenizer without BERT's
special tokens or with the wrong checksum, an output folder that already holds shards) is
checked before any document is read, so a bad invocation fails in a second with one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from bertpipe import fsio, lease, tracking
from bertpipe.config import ConfigError
from bertpipe.errors import BertpipeError
from bertpipe.fsio import common_root
from bertpipe.preprocessing.config import PreprocessConfig
from bertpipe.preprocessing.dask_watch import wait_until_finish
from bertpipe.preprocessing.dedup import quality_folder
from bertpipe.preprocessing.evalsets import eval_files, eval_texts
from bertpipe.preprocessing.job_output import (
    LoggedFnApiRunner,
    beam_logs_to,
    check_output,
    check_writable,
    job_identity,
    remove_scratch,
    start_output,
    worker_failure,
    worker_log_path,
    workers_stopped,
)
from bertpipe.preprocessing.pipeline import (
    Plan,
    build_pipeline,
    manifest_url,
    progress_folder,
)
from bertpipe.preprocessing.quality import build_eval_index
from bertpipe.preprocessing.ranges import ReadRange, plan_ranges
from bertpipe.preprocessing.readers import NoTrainingDataError, check_input_format
from bertpipe.preprocessing.tokenizer import (
    SpecialTokens,
    TokenizerMismatchError,
    load_tokenizer,
    tokenizer_checksum,
)
from bertpipe.progress import ProgressLine

log = logging.getLogger(__name__)

__all__ = ["make_pipeline", "prepare", "run_preprocess"]

_SHARD_FILE = re.compile(r"^(train|heldout)-\d{5}\.tar$")


# --------------------------------------------------------------------------- preprocess


def prepare(cfg: PreprocessConfig) -> tuple[Plan, list[ReadRange]]:
    """All checks, then the plan and the read ranges; raises a one-line error before any
    work is done."""
    cfg.check_runnable()
    files = fsio.expand_urls(cfg.input.paths)
    check_input_format(files, cfg.input)
    ranges = plan_ranges(files, cfg.input, int(cfg.split_mb * 1e6))
    try:
        tokenizer = load_tokenizer(cfg.tokenizer, lowercase=cfg.lowercase)
    except FileNotFoundError as exc:
        raise ConfigError("tokenizer", str(exc)) from None
    specials = SpecialTokens.from_tokenizer(tokenizer, cfg.tokenizer)
    checksum = tokenizer_checksum(tokenizer)
    if cfg.tokenizer_sha256 and cfg.tokenizer_sha256 != checksum:
        raise TokenizerMismatchError(
            f"tokenizer {cfg.tokenizer} has sha256 {checksum[:12]}..., the config expects "
            f"{cfg.tokenizer_sha256[:12]}...: point `tokenizer` at the right one or update "
            "`tokenizer_sha256`"
        )
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    text_bytes = sum(r.text_bytes for r in ranges)
    shards = {
        p.name: {
            "train": cfg.num_shards(p, text_bytes),
            "heldout": max(1, cfg.heldout_shards(p, text_bytes)),
        }
        for p in cfg.phases
    }
    plan = Plan(
        cfg=cfg,
        root=common_root(files),
        num_files=len(files),
        num_buckets=cfg.num_buckets(text_bytes),
        shards=shards,
        tokenizer_url=cfg.tokenizer,
        tokenizer_sha256=checksum,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        special_ids={
            "pad": specials.pad,
            "unk": specials.unk,
            "cls": specials.cls,
            "sep": specials.sep,
            "mask": specials.mask,
        },
        continuation_ids=tuple(sorted(i for t, i in vocab.items() if t.startswith("##"))),
    )
    if cfg.quality.decontaminate.enabled:
        eval_files(cfg.quality.decontaminate.paths)  # they exist and are evaluation files
        plan = dataclasses.replace(
            plan, eval_index_url=fsio.join(quality_folder(cfg.output), "eval-index.npz")
        )
    if cfg.quality.dedup.enabled:
        plan = dataclasses.replace(plan, dedup_partitions=plan.num_buckets)
    check_writable(cfg)  # every folder it writes, before anything is read or deleted
    continuing = check_output(cfg, job_identity(plan, ranges), _SHARD_FILE)
    return dataclasses.replace(plan, continuing=continuing), ranges


def write_eval_index(plan: Plan) -> None:
    """The evaluation sets' n-grams, where the workers load them from (decontamination)."""
    if plan.eval_index_url is None:
        return
    cfg = plan.cfg.quality.decontaminate
    started = time.monotonic()
    index = build_eval_index(eval_texts(cfg.paths), cfg)
    fsio.atomic_write_bytes(plan.eval_index_url, index.to_bytes())
    log.info(
        "preprocess: decontamination against %d evaluation set(s) (%s): %d n-grams of %s "
        "words, in %.1f s",
        len(index.names),
        ", ".join(index.names),
        sum(len(h) for h in index.hashes),
        "/".join(map(str, index.lengths)) or "-",
        time.monotonic() - started,
    )


def make_pipeline(beam_args: Sequence[str], tasks: int = 1, text_bytes: int = 0):  # type: ignore[no-untyped-def]
    """A Beam pipeline for ``beam_args``; the direct runner is pinned to the FnApiRunner.

    Beam's ``DirectRunner`` first tries to fetch and start Prism, which cannot work offline,
    so the local default is the FnApiRunner it would fall back to. Without running-mode
    flags it runs one worker process per core, up to ``tasks`` (the read ranges) and one per
    :data:`MB_PER_WORKER` of text (starting a worker costs seconds), in ``multi_processing``
    mode; ``--direct_num_workers=1`` keeps everything in this process. The worker processes'
    output can be sent to a log file (:func:`~.job_output.beam_logs_to`).
    ``--runner=DaskRunner`` is accepted as a short name for Beam's Dask runner, whose
    ``Create`` defaults to one element per partition here (Beam's default of 128 puts a
    whole small job in one partition, i.e. on one worker).
    """
    import apache_beam as beam
    from apache_beam.options.pipeline_options import (
        DirectOptions,
        PipelineOptions,
        StandardOptions,
    )

    args = list(beam_args)
    if not any(a.startswith("--default_sdk_harness_log_level") for a in args):
        args.append("--default_sdk_harness_log_level=WARNING")  # workers' INFO is noise
    options = PipelineOptions(args)
    standard = options.view_as(StandardOptions)
    if standard.runner in (None, "DirectRunner", "direct", "FnApiRunner"):
        direct = options.view_as(DirectOptions)
        given = any(a.startswith(("--direct_num_workers", "--direct_running_mode")) for a in args)
        if not given:
            by_size = -(-text_bytes // int(MB_PER_WORKER * 1e6))
            direct.direct_num_workers = max(1, min(local_cores(), tasks, by_size))
            direct.direct_running_mode = (
                "multi_processing" if direct.direct_num_workers > 1 else "in_memory"
            )
        log.info(
            "preprocess: direct runner, %s mode, %d worker(s)",
            direct.direct_running_mode,
            direct.direct_num_workers or local_cores(),
        )
        return beam.Pipeline(runner=LoggedFnApiRunner(), options=options)
    if standard.runner == "DaskRunner":
        standard.runner = "apache_beam.runners.dask.dask_runner.DaskRunner"
        if not any(a.startswith(("--dask_npartitions", "--dask_partition_size")) for a in args):
            options = PipelineOptions([*args, "--dask_partition_size=1"])
            options.view_as(StandardOptions).runner = standard.runner
    return beam.Pipeline(options=options)


MB_PER_WORKER = 16.0
"""Text per default direct-runner worker: smaller jobs run in fewer processes."""


@contextlib.contextmanager
def _worker_threads(pipeline: Any) -> Iterator[None]:
    """The direct runner's worker processes get ``cores // workers`` tokenizer threads each
    (``RAYON_NUM_THREADS`` while they start, unless set): the workers are the parallelism."""
    from apache_beam.options.pipeline_options import DirectOptions

    direct = pipeline._options.view_as(DirectOptions)
    if direct.direct_running_mode != "multi_processing" or "RAYON_NUM_THREADS" in os.environ:
        yield
        return
    workers = direct.direct_num_workers or local_cores()
    os.environ["RAYON_NUM_THREADS"] = str(max(1, local_cores() // workers))
    try:
        yield
    finally:
        del os.environ["RAYON_NUM_THREADS"]


def local_cores() -> int:
    """CPUs this process may run on (the affinity mask, not the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def run_preprocess(
    cfg: PreprocessConfig, beam_args: Sequence[str] = ()
) -> dict[str, dict[str, Any]]:
    """Run the Beam job and return each phase's manifest (also logged to MLflow). A SIGTERM
    stops it (the runner's worker processes too) and raises
    :class:`~bertpipe.errors.Terminated` (exit 143); the same command continues it."""
    with tracking.terminated_raises(), lease.held(cfg.output, "preprocess", LEASE_TIMEOUT_S):
        return _run_preprocess(cfg, beam_args)


LEASE_TIMEOUT_S = 60.0
"""The job's lease on its output (:mod:`bertpipe.lease`): a second job on the same output is
refused while this one lives; a lease not renewed for this long is taken over."""


def _run_preprocess(cfg: PreprocessConfig, beam_args: Sequence[str]) -> dict[str, dict[str, Any]]:
    plan, ranges = prepare(cfg)
    text_bytes = sum(r.text_bytes for r in ranges)
    log.info(
        "preprocess: %d file(s), ~%.1f MB of text in %d read range(s), %d bucket(s), phases %s, "
        "shards %s",
        plan.num_files,
        text_bytes / 1e6,
        len(ranges),
        plan.num_buckets,
        ", ".join(p.name for p in cfg.phases),
        json.dumps(plan.shards),
    )
    files = sorted({r.url for r in ranges})
    tags = {tracking.TAG_TOKENIZER: plan.tokenizer_sha256}
    with tracking.start_run(
        cfg.tracking,
        "preprocess",
        config=cfg,
        run_name=cfg.tracking.run_name or "preprocess",
        tags=tags,
    ) as run:
        if run is not None:  # what it reads: the corpus, and the tokenizer's logged model
            tokenizer = tracking.find_model(
                run.info.run_id, tracking.TAG_TOKENIZER, plan.tokenizer_sha256
            )
            tracking.log_inputs([tracking.files_dataset("corpus", files)], [tokenizer or ""])
        manifests, seconds = _run_pipeline(cfg, beam_args, plan, ranges, text_bytes)
        if run is not None:
            _log_to_mlflow(manifests, seconds)
            # the shards' tokenizer travels with them as this run's model: the manifests pin
            # its checksum, and it is here even when it was imported or trained untracked
            model_tags = {tracking.TAG_TOKENIZER: plan.tokenizer_sha256}
            if tokenizer:
                model_tags["bertpipe.source_model_id"] = tokenizer
            tracking.log_folder_model(
                cfg.tokenizer,
                run.info.run_id,
                name="tokenizer",
                model_type="tokenizer",
                tags=model_tags,
            )
    return manifests


def _run_pipeline(
    cfg: PreprocessConfig,
    beam_args: Sequence[str],
    plan: Plan,
    ranges: list[ReadRange],
    text_bytes: int,
) -> tuple[dict[str, dict[str, Any]], float]:
    """The Beam job, then its manifests read back (each with its ``_sha256``) and checked."""
    start_output(cfg, job_identity(plan, ranges), plan.continuing)
    write_eval_index(plan)
    started = time.monotonic()
    pipeline = make_pipeline(beam_args, len(ranges), text_bytes)
    build_pipeline(pipeline, plan, ranges)
    worker_log = worker_log_path(cfg.output)
    with (
        PreprocessProgress(plan, ranges),
        _worker_threads(pipeline),
        beam_logs_to(pipeline, worker_log) as worker_warnings,
        workers_stopped(),
    ):
        try:
            wait_until_finish(pipeline.run(), cfg.stall_timeout_s)
        except BertpipeError:  # the driver's own (a stalled cluster)
            raise
        except Exception as exc:  # a worker's error, as the runner carried it back
            raise worker_failure(exc, worker_log) from exc
    if worker_warnings:  # they went to the workers' log, not the console
        log.warning(
            "preprocess: %d warning(s) in the worker processes, the first: %s; all in %s",
            len(worker_warnings),
            worker_warnings[0],
            worker_log,
        )
    seconds = time.monotonic() - started
    _forget_listings(cfg.output)  # the workers wrote there: other processes, other clients
    manifests = {}
    empty = []
    for phase in cfg.phases:
        url = manifest_url(cfg.output, phase.name)
        if not fsio.exists(url):
            raise RuntimeError(f"the pipeline finished but wrote no {url}: see the runner's log")
        with fsio.open_url(url, "rb") as f:
            raw = f.read()
        manifest = json.loads(raw)
        manifest["_sha256"] = hashlib.sha256(raw).hexdigest()
        manifests[phase.name] = manifest
        if manifest["splits"]["train"]["instances"] == 0:
            empty.append(phase.name)  # nothing of an earlier run is removed for it
        else:
            _remove_stale(cfg, phase.name, manifest)
    remove_scratch(cfg)
    log.info(
        "preprocess: %.1f MB of text in %.1f s (%.2f MB/s)",
        text_bytes / 1e6,
        seconds,
        text_bytes / 1e6 / max(seconds, 1e-9),
    )
    for manifest in manifests.values():
        _log_summary(manifest)
    if empty:
        files = sorted({r.url for r in ranges})
        raise NoTrainingDataError(_no_training_data(cfg, files, manifests, empty))
    return manifests, seconds


def _forget_listings(url: str) -> None:
    """Drop the folder listings this process's filesystem client cached under ``url``.

    Object-store clients (s3fs, gcsfs) cache every listing for good and forget it only for
    their own writes; files that worker processes or other machines wrote would stay unseen.
    """
    fs, path = fsio.to_fs(url)
    fs.invalidate_cache(path)
    for cached in [p for p in getattr(fs, "dircache", {}) if str(p).startswith(path.rstrip("/"))]:
        fs.invalidate_cache(cached)


class PreprocessProgress:
    """MB of the corpus done, MB/s and the ETA of a running job, from the markers its tasks
    leave in the output's ``_progress`` folder (any runner, any filesystem the workers
    share), polled by a thread of the driver.

    The three stages are weighed by their measured share of the work (reading and
    tokenizing, instance creation, shard writing), so the rate and ETA are in corpus MB.
    """

    WEIGHTS = (0.45, 0.45, 0.10)

    def __init__(
        self, plan: Plan, ranges: Sequence[ReadRange], poll_s: float | None = None
    ) -> None:
        self._folder = progress_folder(plan.cfg.output)
        self._sizes = {f"read-{r.index:06d}": r.text_bytes for r in ranges}
        self._total = sum(self._sizes.values()) / 1e6
        self._buckets = plan.num_buckets
        self._shards = sum(n for split in plan.shards.values() for n in split.values())
        # the line counts tenths of MB: 1.4/1.4 MB, not 1.441739/1.441739
        self._line = ProgressLine("preprocess", max(round(self._total, 1), 0.1), unit="MB")
        self._poll_s = poll_s if poll_s is not None else (1.0 if self._line.tty else 10.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="preprocess-progress", daemon=True)

    def __enter__(self) -> PreprocessProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if exc[0] is None:
            self.poll(force=True)
        self._line.close()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.poll()
            except Exception as error:  # a listing that failed once must not end the job
                log.debug("progress poll failed: %s", error)

    def poll(self, force: bool = False) -> float:
        """Update the line from the markers (``force``: log it now); returns the MB done."""
        _forget_listings(self._folder)  # the markers come from other processes
        names = [u.rsplit("/", 1)[-1] for u in fsio.list_files(self._folder)]
        read = sum(self._sizes.get(n, 0) for n in names) / 1e6
        buckets = sum(n.startswith("bucket-") for n in names)
        shards = sum(n.startswith("shard-") for n in names)
        w_read, w_bucket, w_shard = self.WEIGHTS
        done = self._total * (
            w_read * read / max(self._total, 1e-9)
            + w_bucket * min(1.0, buckets / self._buckets)
            + w_shard * min(1.0, shards / max(self._shards, 1))
        )
        self._line.update(
            round(done, 1),
            f"read {read:,.1f}/{self._total:,.1f} MB, buckets {buckets}/{self._buckets}, "
            f"shards {shards}/{self._shards}",
            force=force,
        )
        return done


def _no_training_data(
    cfg: PreprocessConfig, files: Sequence[str], manifests: dict[str, Any], empty: list[str]
) -> str:
    """One line: which phases got nothing, from which inputs, what was skipped, what to do."""
    corpus = manifests[empty[0]]["stats"]["corpus"]
    skipped = ", ".join(
        f"{k}={v}"
        for k, v in sorted(corpus.items())
        if v and ("skipped" in k or "too" in k or "failed" in k or "malformed" in k or "empty" in k)
    )
    return (
        f"no training instance for phase(s) {', '.join(empty)} from {len(files)} input file(s) "
        f"matching input.paths={list(cfg.input.paths)}: {corpus.get('files_read', 0)} file(s) "
        f"read, {corpus.get('documents_kept', 0)} of {corpus.get('documents_read', 0)} "
        f"document(s) kept ({skipped or 'nothing skipped'}); check input.paths and "
        f"input.format={cfg.input.format} (see the warnings above), or lower min_sentences "
        f"(={cfg.min_sentences}) for short documents; the counts are in "
        f"{manifest_url(cfg.output, empty[0])}, and a rerun needs --overwrite"
    )


def _remove_stale(cfg: PreprocessConfig, phase: str, manifest: dict[str, Any]) -> None:
    keep = {r["file"] for s in manifest["splits"].values() for r in s["shards"]}
    folder = fsio.join(cfg.output, phase)
    stale = [
        u
        for u in fsio.list_files(folder)
        if _SHARD_FILE.match(u.rsplit("/", 1)[-1]) and u.rsplit("/", 1)[-1] not in keep
    ]
    if stale:
        log.info("removing %d shard(s) of an earlier run from %s", len(stale), folder)
        fsio.remove(stale)


def _log_summary(manifest: dict[str, Any]) -> None:
    train = manifest["stats"]["train"]
    corpus = manifest["stats"]["corpus"]
    split = manifest["splits"]
    head = (
        manifest["phase"],
        corpus.get("documents_kept", 0),
        corpus.get("documents_read", 0),
        corpus.get("sentences", 0),
        corpus.get("tokens", 0),
        split["train"]["instances"],
        split["train"]["num_shards"],
    )
    if manifest.get("objective") == "mlm":
        log.info(
            "%s: %d documents kept of %d read, %d sentences, %d tokens -> train %d instances in "
            "%d shard(s) (mlm, %s: %.1f tokens/instance, filled %.4f, %.4f across documents, "
            "%d sentence(s) cut, masked %.4f), held-out %d instances",
            *head,
            manifest.get("packing"),
            train["mean_tokens_per_instance"],
            train.get("fill_fraction", 0.0),
            train.get("multi_document_fraction", 0.0),
            train.get("sentences_cut", 0),
            train["masked_fraction"],
            split["heldout"]["instances"],
        )
    else:
        log.info(
            "%s: %d documents kept of %d read, %d sentences, %d tokens -> train %d instances in "
            "%d shard(s) (%.1f tokens/instance, masked %.4f, random next %.4f, short target "
            "%.4f, truncated %.4f), held-out %d instances",
            *head,
            train["mean_tokens_per_instance"],
            train["masked_fraction"],
            train["random_next_fraction"],
            train["short_target_fraction"],
            train["truncated_fraction"],
            split["heldout"]["instances"],
        )
    skipped = {
        k: v
        for k, v in corpus.items()
        if "skipped" in k or "too" in k or "failed" in k or "malformed" in k
    }
    if skipped:
        log.warning("%s: skipped input: %s", manifest["phase"], json.dumps(skipped))
    if corpus.get("files_partly_read"):
        log.warning(
            "%s: partly read: %d file(s) broke in the middle; their documents up to there are "
            "in (see the warnings above for which)",
            manifest["phase"],
            corpus["files_partly_read"],
        )


def _log_to_mlflow(manifests: dict[str, dict[str, Any]], seconds: float) -> None:
    """The open preprocess run: each phase's manifest checksum (tag), statistics (metrics)
    and manifest (artifact)."""
    tracking.set_tags(
        {f"{tracking.TAG_DATA_CHECKSUM}.{name}": m["_sha256"] for name, m in manifests.items()}
    )
    metrics: dict[str, float] = {"seconds": seconds}
    for name, m in manifests.items():
        for key, value in m["stats"]["corpus"].items():
            metrics[f"corpus.{key}"] = value
        for split in ("train", "heldout"):
            for key, value in m["stats"][split].items():
                metrics[f"{name}.{split}.{key}"] = value
            metrics[f"{name}.{split}.bytes"] = m["splits"][split]["bytes"]
            metrics[f"{name}.{split}.num_shards"] = m["splits"][split]["num_shards"]
        train = m["splits"]["train"]
        if train["instances"]:
            metrics[f"{name}.bytes_per_instance"] = train["bytes"] / train["instances"]
        body = {k: v for k, v in m.items() if k != "_sha256"}
        tracking.log_text(json.dumps(body, indent=2, sort_keys=True), f"manifests/{name}.json")
    tracking.log_metrics(metrics)
