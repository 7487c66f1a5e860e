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
from bertpipe.preprocessing.instances import TokenizedDoc
from bertpipe.preprocessing.pipeline import (
    CreateInstancesFn,
    Demux,
    PartRef,
    ReadDocumentsFn,
    SumCounts,
    TokenizeFn,
    WriteShardFn,
)
from bertpipe.preprocessing.readers import InputConfig
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


def test_read_documents_fn(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_text("One.\nTwo.\n\nThree.\nFour.\n")
    (tmp_path / "y.bin").write_bytes(b"\x00")
    with _pipeline() as p:
        out = (
            p
            | beam.Create([str(tmp_path / "x.txt"), str(tmp_path / "y.bin")])
            | beam.ParDo(ReadDocumentsFn(InputConfig(), str(tmp_path), 2, batch=1))
            | Demux("docs", "counts")
        )
        assert_that(
            out["docs"],
            equal_to([[("x.txt:0", ["One.", "Two."])], [("x.txt:1", ["Three.", "Four."])]]),
            label="docs",
        )
        total = out["counts"] | beam.CombineGlobally(SumCounts())
        assert_that(
            total,
            equal_to(
                [{"documents_read": 2, "files_read": 1, "files_skipped_unknown_extension": 1}]
            ),
            label="counts",
        )


def test_tokenize_fn_keys_and_drops_short(
    tokenizer_dir: Path, corpus_dir: Path, tmp_path: Path
) -> None:
    plan = _plan(tokenizer_dir, corpus_dir, tmp_path, "heldout_fraction=0.0")
    batch = [("d1", ["The man said it.", "Then two more."]), ("d2", ["Only one sentence."])]

    def check(outputs: list) -> None:  # type: ignore[type-arg]
        docs = [v for t, v in outputs if t == "docs"]
        counts = [v for t, v in outputs if t == "counts"]
        assert len(docs) == 1
        (split, bucket), packed = docs[0]
        assert split == "train" and 0 <= bucket < plan.num_buckets
        doc = TokenizedDoc.unpack(packed)
        assert doc.doc_id == "d1" and doc.sentence_ends.size == 2
        assert counts == [{**counts[0], "documents_too_short": 1, "documents_kept": 1}]

    with _pipeline() as p:
        out = p | beam.Create([batch]) | beam.ParDo(TokenizeFn(plan))
        assert_that(out, check)


def test_create_instances_then_write_shards(
    tokenizer_dir: Path, corpus_dir: Path, tmp_path: Path
) -> None:
    plan = _plan(tokenizer_dir, corpus_dir, tmp_path)
    docs = tokenized_docs(tokenizer_dir, 30, seed=3, min_sent=3, max_sent=20)
    element = (("train", 0), [d.pack() for d in reversed(docs)])
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
