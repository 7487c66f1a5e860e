"""Each Beam transform on its own, with TestPipeline and assert_that (FnApiRunner)."""

from __future__ import annotations

from pathlib import Path

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing.test_pipeline import TestPipeline
from apache_beam.testing.util import assert_that, equal_to

from bertpipe.config import load_config
from bertpipe.preprocessing.config import PreprocessConfig
from bertpipe.preprocessing.pipeline import (
    CreateInstancesFn,
    Demux,
    PartRef,
    ReadTokenizeFn,
    SpillRef,
    SumCounts,
    WriteShardFn,
)
from bertpipe.preprocessing.ranges import ReadRange
from bertpipe.preprocessing.run import prepare
from bertpipe.preprocessing.shard_format import read_shard
from tests.preprocessing.helpers import tokenized_docs


def _pipeline() -> TestPipeline:
    return TestPipeline(runner=FnApiRunner())


def _plan(tokenizer_dir: Path, corpus_dir: Path, tmp_path: Path, *extra: str):  # type: ignore[no-untyped-def]
    cfg = load_config(
        PreprocessConfig,
        None,
        [
            f"input.paths=[{corpus_dir}]",
            f"tokenizer={tokenizer_dir}",
            f"output={tmp_path / 'out'}",
            "phases=[{name: p64, max_seq_length: 64, max_predictions_per_seq: 10, num_shards: 3}]",
            "dupe_factor=2",
            "tracking.enabled=false",
            *extra,
        ],
    )
    return prepare(cfg)[0]


def test_demux_routes_by_tag() -> None:
    with _pipeline() as p:
        parts = p | beam.Create([("a", 1), ("b", 2), ("a", 3)]) | Demux("a", "b")
        assert_that(parts["a"], equal_to([1, 3]), label="a")
        assert_that(parts["b"], equal_to([2]), label="b")


def test_read_tokenize_fn_spills_by_bucket(
    tokenizer_dir: Path, corpus_dir: Path, tmp_path: Path
) -> None:
    """A range's documents are tokenized into its spill file, keyed by (split, bucket); only
    references leave the task; unknown files and short documents are counted."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "x.txt").write_text(
        "The man said it.\nThen two more.\n\nOnly one sentence.\n\nA third one.\nAnd four.\n"
    )
    (inputs / "y.bin").write_bytes(b"\x00")
    plan = _plan(tokenizer_dir, inputs, tmp_path, "heldout_fraction=0.0", "bucket_mb=0.00001")
    ranges = [
        ReadRange(0, str(inputs / "x.txt"), 0, 30, split=True),
        ReadRange(1, str(inputs / "x.txt"), 30, None, split=True),
        ReadRange(2, str(inputs / "y.bin")),
    ]

    def check(outputs: list) -> None:  # type: ignore[type-arg]
        refs = [v for t, v in outputs if t == "spill"]
        counts = SumCounts().merge_accumulators([v for t, v in outputs if t == "counts"])
        assert all(isinstance(ref, SpillRef) for _, ref in refs)
        docs = {
            doc.doc_id: (split, bucket, doc.sentence_ends.size)
            for (split, bucket), ref in refs
            for doc in ref.documents()
        }
        assert sorted(docs) == ["x.txt@0", "x.txt@53"]  # a split file: named by byte offset
        assert all(split == "train" and 0 <= b < plan.num_buckets for split, b, _ in docs.values())
        assert [n for _, _, n in docs.values()] == [2, 2]
        assert counts["documents_read"] == 3 and counts["documents_too_short"] == 1
        assert counts["files_read"] == 1 and counts["files_skipped_unknown_extension"] == 1

    with _pipeline() as p:
        out = p | beam.Create(ranges) | beam.ParDo(ReadTokenizeFn(plan))
        assert_that(out, check)
    assert sorted(f.name for f in (tmp_path / "out" / "_spill").iterdir()) == [
        "000000.bin",
        "000001.bin",
    ]


def test_create_instances_then_write_shards(
    tokenizer_dir: Path, corpus_dir: Path, tmp_path: Path
) -> None:
    plan = _plan(tokenizer_dir, corpus_dir, tmp_path)
    docs = tokenized_docs(tokenizer_dir, 30, seed=3, min_sent=3, max_sent=20)
    spill = tmp_path / "spill.bin"
    # a spill record: size, the document's order key (see dedup.py), the packed document
    records = [
        len(d.pack()).to_bytes(4, "little") + i.to_bytes(8, "little") + d.pack()
        for i, d in enumerate(reversed(docs))
    ]
    spill.write_bytes(b"".join(records))
    half = sum(map(len, records[:11]))
    # two pieces of the bucket, in either order: documents are sorted by id
    element = (
        ("train", 0),
        [
            SpillRef(str(spill), half, spill.stat().st_size - half),
            SpillRef(str(spill), 0, half),
        ],
    )
    with _pipeline() as p:
        out = (
            p
            | beam.Create([element])
            | beam.ParDo(CreateInstancesFn(plan))
            | Demux("parts", "stats")
        )
        shards = out["parts"] | beam.GroupByKey() | beam.ParDo(WriteShardFn(plan))

        def check_refs(refs: list) -> None:  # type: ignore[type-arg]
            shards_seen = {key for key, _ in refs}
            assert shards_seen == {("p64", "train", s) for s in range(3)}
            assert all(isinstance(r, PartRef) for _, r in refs)

        def check_shards(records: list) -> None:  # type: ignore[type-arg]
            assert {(phase, kind) for phase, (kind, _) in records} == {("p64", "shard")}
            counts = sorted(r["instances"] for _, (_, r) in records)
            assert counts[-1] - counts[0] <= 1  # one bucket deals evenly
            assert all(r["file"].startswith("train-") for _, (_, r) in records)

        def check_stats(stats: list) -> None:  # type: ignore[type-arg]
            ((phase, (kind, counts)),) = stats
            assert phase == "p64" and kind == "stats" and counts["train.instances"] > 30
            assert counts["train.document_passes"] == 60

        assert_that(out["stats"], check_stats, label="stats")
        assert_that(out["parts"], check_refs, label="refs")
        assert_that(shards, check_shards, label="shards")
    written = sorted((tmp_path / "out" / "p64").glob("train-*.tar"))
    assert len(written) == 3
    blocks = [b for path in written for _, b in read_shard(str(path))]
    lengths = np.concatenate([b.lengths for b in blocks])
    assert lengths.max() <= 64 and lengths.size > 30


@pytest.mark.parametrize("bad", ["nothing-matches-*.txt"])
def test_prepare_rejects_inputs_before_work(tokenizer_dir: Path, tmp_path: Path, bad: str) -> None:
    from bertpipe.fsio import NoMatchError

    with pytest.raises(NoMatchError, match="nothing-matches"):
        _plan(tokenizer_dir, tmp_path / bad, tmp_path)


@pytest.mark.parametrize(
    ("beam_args", "cores", "tasks", "mb", "mode", "workers"),
    [
        ([], 8, 40, 1000, "multi_processing", 8),  # a big corpus: a worker per core
        ([], 8, 3, 1000, "multi_processing", 3),  # no more workers than read tasks
        ([], 8, 40, 20, "multi_processing", 2),  # one per 16 MB of text
        ([], 8, 40, 10, "in_memory", 1),  # a small corpus stays in this process
        ([], 1, 40, 1000, "in_memory", 1),
        (["--direct_num_workers=1"], 8, 40, 1000, "in_memory", 1),  # the user's choice
        (
            ["--direct_running_mode=multi_processing", "--direct_num_workers=3"],
            8,
            40,
            10,
            "multi_processing",
            3,
        ),
    ],
)
def test_direct_runner_defaults_to_a_worker_per_core(
    monkeypatch: pytest.MonkeyPatch,
    beam_args: list[str],
    cores: int,
    tasks: int,
    mb: int,
    mode: str,
    workers: int,
) -> None:
    from apache_beam.options.pipeline_options import DirectOptions

    from bertpipe.preprocessing import run

    monkeypatch.setattr(run, "local_cores", lambda: cores)
    options = run.make_pipeline(beam_args, tasks, mb * 10**6)._options.view_as(DirectOptions)
    assert options.direct_running_mode == mode
    assert options.direct_num_workers == workers


def test_dask_runner_gets_a_partition_per_read_task() -> None:
    from apache_beam.options.pipeline_options import StandardOptions

    from bertpipe.preprocessing.run import make_pipeline

    options = make_pipeline(["--runner=DaskRunner"], 4)._options
    assert options.view_as(StandardOptions).runner.endswith("dask_runner.DaskRunner")
    assert options.get_all_options()["partition_size"] == 1
    given = make_pipeline(["--runner=DaskRunner", "--dask_npartitions=7"], 4)._options
    assert given.get_all_options()["npartitions"] == 7
    assert given.get_all_options()["partition_size"] is None
