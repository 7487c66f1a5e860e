"""``bertpipe preprocess --dry-run-quality``: what the quality steps would remove, counted,
without making instances or writing shards.

The read stage and the deduplication of the real job run (same code, same counts and review
samples as the job would give; the duplicates are taken out of the counts by the job's own
instance step, which makes no instance here) into a scratch folder under ``output``; the
counts are written to ``<output>/quality-report/report.json`` with the review samples beside
them, and printed.
Shards and manifests already in ``output`` are not touched.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import apache_beam as beam

from bertpipe import fsio, lease
from bertpipe.config import ConfigError
from bertpipe.errors import BertpipeError
from bertpipe.preprocessing.config import PreprocessConfig
from bertpipe.preprocessing.dedup import WriteSamplesFn
from bertpipe.preprocessing.pipeline import (
    CreateInstancesFn,
    Demux,
    Plan,
    ReadTokenizeFn,
    SumCounts,
)
from bertpipe.preprocessing.pipeline.quality import deduplicate
from bertpipe.preprocessing.ranges import ReadRange

log = logging.getLogger(__name__)

__all__ = ["report_folder", "run_quality_report"]


def report_folder(output: str) -> str:
    return fsio.join(output, "quality-report")


def run_quality_report(cfg: PreprocessConfig, beam_args: Sequence[str] = ()) -> dict[str, Any]:
    """Run the quality steps alone; returns (and writes) the counts."""
    from bertpipe.preprocessing.job_output import (
        beam_logs_to,
        remove_scratch,
        worker_failure,
        worker_log_path,
        workers_stopped,
    )
    from bertpipe.preprocessing.run import (
        LEASE_TIMEOUT_S,
        make_pipeline,
        prepare,
        write_eval_index,
    )

    if not cfg.quality.enabled:
        raise ConfigError(
            "quality", "is all off: turn on filters, decontaminate.paths or dedup to report"
        )
    final = report_folder(cfg.output)
    scratch = dataclasses.replace(
        cfg, output=fsio.join(cfg.output, "_quality-report"), overwrite=True
    )
    with lease.held(cfg.output, "preprocess", LEASE_TIMEOUT_S):
        plan, ranges = prepare(scratch)
        plan = dataclasses.replace(plan, report_only=True)
        remove_scratch(scratch)
        write_eval_index(plan)
        started = time.monotonic()
        pipeline = make_pipeline(beam_args, len(ranges), sum(r.text_bytes for r in ranges))
        _build(pipeline, plan, ranges)
        worker_log = worker_log_path(cfg.output, "quality-report")
        with beam_logs_to(pipeline, worker_log), workers_stopped():
            try:
                pipeline.run().wait_until_finish()
            except BertpipeError:
                raise
            except Exception as exc:  # a worker's error, as the runner carried it back
                raise worker_failure(exc, worker_log) from exc
        seconds = time.monotonic() - started
        with fsio.open_url(fsio.join(scratch.output, "report.json"), "rb") as f:
            report = json.loads(f.read())
        fs, path = fsio.to_fs(final)
        fsio.remove([final], recursive=True)
        fs.makedirs(path, exist_ok=True)
        for name in report["samples"]:
            fs.copy(fsio.to_fs(fsio.join(scratch.output, name))[1], f"{path}/{name.split('/')[-1]}")
        report["samples"] = [f"{final}/{name.split('/')[-1]}" for name in report["samples"]]
        report["seconds"] = round(seconds, 1)
        fsio.atomic_write_text(
            fsio.join(final, "report.json"), json.dumps(report, indent=2, sort_keys=True) + "\n"
        )
        remove_scratch(scratch)
        fsio.remove([scratch.output], recursive=True)
    log.info("preprocess --dry-run-quality: %s", json.dumps(report["removed"]))
    return report


def _build(p: beam.Pipeline, plan: Plan, ranges: list[ReadRange]) -> None:
    cfg = plan.cfg
    read = (
        p
        | "ListRanges" >> beam.Create(ranges)
        | "SpreadRanges" >> beam.Reshuffle()
        | "ReadTokenize" >> beam.ParDo(ReadTokenizeFn(plan))
        | "SplitRead" >> Demux("spill", "counts", "dedup", "samples")
    )
    counts = [read["counts"]]
    samples = [read["samples"]]
    if cfg.quality.dedup.enabled:
        drops, dedup_counts = deduplicate(plan, read["dedup"])
        counts.append(dedup_counts)
        # the job takes the duplicates out of the read stage's counts (documents, sentences,
        # tokens, per split) and decodes their samples where it makes instances: the same
        # step, which makes no instance in a report (``Plan.report_only``)
        first = cfg.phases[0].name
        checked = (
            (read["spill"], drops)
            | "WithDrops" >> beam.Flatten()
            | "GroupByBucket" >> beam.GroupByKey()
            | "TakeOutDuplicates" >> beam.ParDo(CreateInstancesFn(plan))
            | "SplitTakenOut" >> Demux("stats", "samples")
        )
        counts.append(
            checked["stats"]
            | "OnePhase" >> beam.FlatMap(lambda v: [v[1][1]] if v[0] == first else [])
        )
        samples.append(checked["samples"])
    written = (
        samples
        | "AllSamples" >> beam.Flatten()
        | "GroupByReason" >> beam.GroupByKey()
        | "WriteSamples" >> beam.ParDo(WriteSamplesFn(cfg.output, cfg.quality.samples))
    )
    total = (
        counts
        | "AllCounts" >> beam.Flatten()
        | "Sum" >> beam.CombineGlobally(SumCounts())
        | "Tag" >> beam.Map(lambda c: ("counts", c))
    )
    # the report is the last step, after the samples (Beam's DaskRunner runs only what the
    # last step depends on)
    _ = (
        (total, written | "TagSamples" >> beam.Map(lambda r: ("samples", r)))
        | "Both" >> beam.Flatten()
        | "One" >> beam.Map(lambda v: (0, v))
        | "GroupAll" >> beam.GroupByKey()
        | "WriteReport" >> beam.ParDo(_WriteReport(cfg.output))
    )


class _WriteReport(beam.DoFn):
    def __init__(self, output: str) -> None:
        self._output = output

    def process(self, element: tuple[int, Any]) -> Iterator[str]:
        _, values = element
        values = list(values)
        counts = next((v for kind, v in values if kind == "counts"), {})
        samples = sorted(f"quality/{v}.jsonl" for kind, v in values if kind == "samples")
        report = {
            "documents_read": counts.get("documents_read", 0),
            "removed": {
                k[len("removed_") :]: v for k, v in counts.items() if k.startswith("removed_")
            },
            "contaminated_by": {
                k.split("/", 1)[1]: v for k, v in counts.items() if k.startswith("contaminated_by/")
            },
            "counts": counts,
            "samples": samples,
        }
        fsio.atomic_write_text(fsio.join(self._output, "report.json"), json.dumps(report))
        yield "report.json"
