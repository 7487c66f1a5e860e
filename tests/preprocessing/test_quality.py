"""Corpus quality in the Beam job: planted duplicates, near-duplicates and evaluation text
are removed (and nothing much else), counted by reason in the manifest and MLflow, the same
bytes on every runner."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bertpipe.config import ConfigError, load_config
from bertpipe.preprocessing import quality as q
from bertpipe.preprocessing.config import PreprocessConfig
from bertpipe.preprocessing.evalsets import eval_files, eval_texts
from bertpipe.preprocessing.run import run_preprocess
from bertpipe.preprocessing.synthetic import eval_sentences, write_planted_corpus
from tests.cli_runner import run_cli
from tests.conftest import sqlite_uri
from tests.preprocessing.helpers import output_digests

# ----------------------------------------------------------------------------- the pieces


def test_words_ignore_case_punctuation_and_unicode_separators() -> None:
    a = q.word_hashes("Hello, World\u2014\u201cquoted\u201d caf\u00e9\u2026 x")
    b = q.word_hashes("hello world quoted caf\u00e9 x")
    assert a.tolist() == b.tolist()
    assert len(set(q.word_hashes("one two one").tolist())) == 2


def _jaccard(a: list[str], b: list[str], n: int = 5) -> float:
    sa = {tuple(a[i : i + n]) for i in range(len(a) - n + 1)}
    sb = {tuple(b[i : i + n]) for i in range(len(b) - n + 1)}
    return len(sa & sb) / len(sa | sb)


@pytest.mark.parametrize("length", [40, 400, 4000])
def test_minhash_estimates_jaccard_within_its_standard_deviation(length: int) -> None:
    rng = np.random.default_rng(length)
    vocab = [f"w{i}" for i in range(3000)]
    errors = []
    for _ in range(40):
        a = [vocab[i] for i in rng.integers(len(vocab), size=length)]
        b = list(a)
        for i in rng.choice(length, size=max(1, int(rng.uniform(0.005, 0.05) * length))):
            b[i] = vocab[int(rng.integers(len(vocab)))]
        truth = _jaccard(a, b)
        sa, sb = (q.minhash(q.ngram_hashes(q.word_hashes(" ".join(d)), 5), 256) for d in (a, b))
        assert sa is not None and sb is not None
        errors.append(float((sa == sb).mean()) - truth)
    # sqrt(J (1 - J) / 256) <= 0.031: the mean error is near 0, the spread near that
    assert abs(np.mean(errors)) < 0.02
    assert np.std(errors) < 0.04


def test_filters_follow_gophers_rules() -> None:
    cfg = q.FilterConfig(gopher=True)
    good = ["The cat sat on the mat and looked at the birds outside."] * 1 + [
        f"Sentence number {i} tells a different story about the old house." for i in range(8)
    ]
    assert q.filter_failures(good, cfg) is None
    assert q.filter_failures(["Too short."], cfg) == "filter_min_words"
    repeated = good[:2] * 6
    assert q.filter_failures(repeated, cfg) == "filter_max_duplicate_lines"
    hashes = [line + " #tag #more #again #so" for line in good]
    assert q.filter_failures(hashes, cfg) == "filter_max_symbol_ratio"
    off = q.FilterConfig()
    assert not off.enabled and q.filter_failures(["Too short."], off) is None


def test_eval_index_finds_ngrams_and_short_texts(tmp_path: Path) -> None:
    task = tmp_path / "sst2"
    task.mkdir()
    (task / "train.tsv").write_text("sentence\tlabel\nnot evaluation text at all here\t1\n")
    long = "the quick brown fox jumps over the lazy dog near the quiet river bank today"
    short = "a rather short sentence of nine words right here"
    (task / "dev.tsv").write_text(f"sentence\tlabel\n{long}\t1\n{short}\t0\n")
    squad = tmp_path / "squad.json"
    squad.write_text(json.dumps({"data": [{"paragraphs": [{"context": long.upper()}]}]}))
    assert [name for name, _ in eval_files([str(task), str(squad)])] == ["squad", "sst2/dev"]
    index = q.build_eval_index(eval_texts([str(task), str(squad)]), q.DecontaminationConfig())
    doc = q.word_hashes(f"Something else. {long.capitalize()}! And more words follow.")
    covered, owners = index.matches(doc)
    assert index.set_names(owners) == ["squad", "sst2/dev"]
    assert covered.sum() == 15
    _, owners = index.matches(q.word_hashes(f"words before {short} and after"))
    assert index.set_names(owners) == ["sst2/dev"]
    _, owners = index.matches(q.word_hashes("the quick brown fox jumps over the lazy dog"))
    assert owners == 0
    again = q.EvalIndex.from_bytes(index.to_bytes())
    assert again.names == index.names and again.matches(doc)[1] == owners | 3


def test_invalid_quality_settings_fail_with_the_key() -> None:
    with pytest.raises(ConfigError, match="num_perm"):
        load_config(PreprocessConfig, None, ["quality.dedup.num_perm=100"])
    with pytest.raises(ConfigError, match="bands"):
        load_config(PreprocessConfig, None, ["quality.dedup.bands=50", "quality.dedup.rows=8"])
    with pytest.raises(ConfigError, match="threshold"):
        load_config(PreprocessConfig, None, ["quality.dedup.threshold=1.5"])


# ----------------------------------------------------------------------------- the job

EVAL_SENTENCES = eval_sentences()


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 4 MB corpus with planted copies, an evaluation task, a tokenizer trained on it."""
    from bertpipe.preprocessing.tokenizer import save_tokenizer, train_wordpiece

    root = tmp_path_factory.mktemp("planted")
    truth = write_planted_corpus(
        root / "corpus",
        2.5,
        files=4,
        seed=3,
        exact=0.13,
        near=0.13,
        below=0.13,
        eval_sentences=EVAL_SENTENCES,
        contaminated=0.02,
    )
    task = root / "tasks" / "made-up"
    task.mkdir(parents=True)
    rows = "".join(f"{s}\t{i % 2}\n" for i, s in enumerate(EVAL_SENTENCES))
    (task / "dev.tsv").write_text("sentence\tlabel\n" + rows)
    lines = [
        line
        for p in sorted((root / "corpus").glob("*.txt"))
        for line in p.read_text().splitlines()[:4000]
        if line
    ]
    tokenizer = root / "tokenizer"
    save_tokenizer(
        train_wordpiece(lines, vocab_size=2000, min_frequency=2), str(tokenizer), lowercase=True
    )
    return {"root": root, "truth": truth, "task": task, "tokenizer": tokenizer}


QUALITY = (
    "quality.dedup.exact=true",
    "quality.dedup.near=true",
    # every removal kept for review: the removed ids are read from the samples (the shards do
    # not store document ids); the dry run below checks the limit
    "quality.samples=100000",
)


def _run(planted: dict[str, Any], out: Path, beam_args: list[str], *extra: str) -> Any:
    cfg = load_config(
        PreprocessConfig,
        None,
        [
            f"input.paths=[{planted['root'] / 'corpus'}]",
            f"tokenizer={planted['tokenizer']}",
            f"output={out}",
            "phases=[{name: seq128, max_seq_length: 128, max_predictions_per_seq: 20, "
            "num_shards: 4}]",
            "dupe_factor=1",
            "bucket_mb=0.5",  # several buckets and dedup partitions
            "split_mb=0.6",  # files read in byte ranges by several tasks
            "tokenize_batch_documents=64",
            *extra,
        ],
    )
    return run_preprocess(cfg, beam_args)["seq128"]


@pytest.mark.integration
@pytest.mark.slow
def test_planted_removals_counts_samples_and_the_same_bytes_on_every_runner(
    planted: dict[str, Any], dask_cluster: Any, tmp_path: Path
) -> None:
    import distributed
    import mlflow

    uri = sqlite_uri(tmp_path / "mlflow.db")
    extra = (*QUALITY, f"quality.decontaminate.paths=[{planted['task']}]")
    manifest = _run(
        planted,
        tmp_path / "a",
        [],
        *extra,
        f"tracking.uri={uri}",
        "tracking.experiment=quality",
    )
    truth = planted["truth"]
    corpus = manifest["stats"]["corpus"]
    removed = {}
    for reason_file in sorted((tmp_path / "a" / "quality").glob("*.jsonl")):
        for line in reason_file.read_text().splitlines():
            record = json.loads(line)
            assert record["text"]  # duplicates' decoded from their tokens
            removed[record["id"]] = record["reason"]
    assert manifest["quality_samples"] == [
        "quality/contaminated.jsonl",
        "quality/exact_duplicate.jsonl",
        "quality/near_duplicate.jsonl",
    ]

    # a file read in byte ranges names its documents by offset, one read whole by ordinal:
    # the truth has both names; removals are keyed by the offset name from here on
    aliases = {
        p[k]: p[f"{k}_at"]
        for kind in ("exact", "near", "below")
        for p in truth[kind]
        for k in ("source", "copy")
    }
    aliases.update({c["id"]: c["id_at"] for c in truth["contaminated"]})
    removed = {aliases.get(k, k): v for k, v in removed.items()}
    exact, near, below = truth["exact"], truth["near"], truth["below"]
    assert len(exact) > 40 and len(near) > 40 and len(below) > 30

    def handled(pairs: list[dict[str, Any]]) -> float:  # one of the two (or both) removed
        return sum(p["source_at"] in removed or p["copy_at"] in removed for p in pairs) / len(pairs)

    assert handled(exact) >= 0.99
    assert handled(near) >= 0.95
    # a copy below the threshold is a document of its own: removing it is a false positive
    assert sum(p["copy_at"] in removed for p in below) <= 0.01 * len(below)
    # every cluster of planted exact copies keeps exactly one document, and no cluster with
    # near-duplicates loses all of its (a near pair whose estimate falls just under the
    # threshold may keep both: the 95% above allows for it)
    clusters: dict[str, set[str]] = {}
    for kind in ("exact", "near"):
        for p in truth[kind]:
            merged = clusters.get(p["source_at"], {p["source_at"]}) | clusters.get(
                p["copy_at"], {p["copy_at"]}
            )
            for doc in merged:
                clusters[doc] = merged
    exact_only = {id(c) for c in clusters.values()}
    for p in near:
        exact_only.discard(id(clusters[p["source_at"]]))
    for members in {id(c): c for c in clusters.values()}.values():
        kept = sum(doc not in removed for doc in members)
        assert kept == 1 if id(members) in exact_only else kept >= 1, members
    contaminated = {c["id_at"] for c in truth["contaminated"]}
    assert all(removed.get(i) == "contaminated" for i in contaminated)
    # nothing else went: every removal is a planted copy or a contaminated document
    assert set(removed) <= set(clusters) | contaminated
    assert corpus["removed_contaminated"] == len(contaminated)
    assert corpus["contaminated_by/made-up/dev"] == len(contaminated)
    assert corpus["removed_exact_duplicate"] + corpus["removed_near_duplicate"] == sum(
        r != "contaminated" for r in removed.values()
    )
    assert corpus["removed_exact_duplicate"] >= len(exact)
    kept = corpus["documents_read"] - len(removed) - corpus.get("documents_too_short", 0)
    assert corpus["documents_kept"] == kept
    # MLflow has the counts by reason
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.get_experiment_by_name("quality")
    run = mlflow.MlflowClient(uri).search_runs([experiment.experiment_id])[0]
    for key in ("removed_exact_duplicate", "removed_near_duplicate", "removed_contaminated"):
        assert run.data.metrics[f"corpus.{key}"] == corpus[key]

    # the same bytes on the direct runner's modes and Dask
    reference = output_digests(tmp_path / "a")

    # --dry-run-quality on the same output: the job's counts, printed; its shards untouched
    done = run_cli(
        [
            "preprocess",
            "--dry-run-quality",
            f"input.paths=[{planted['root'] / 'corpus'}]",
            f"tokenizer={planted['tokenizer']}",
            f"output={tmp_path / 'a'}",
            "bucket_mb=0.5",
            "split_mb=0.6",
            "tracking.enabled=false",
            *extra,
            "quality.samples=5",
        ]
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["counts"] == corpus  # kept documents, sentences, tokens, splits: all
    assert report["removed"] == {k[8:]: v for k, v in corpus.items() if k.startswith("removed_")}
    assert report["contaminated_by"] == {"made-up/dev": len(contaminated)}
    sampled = (tmp_path / "a" / "quality-report" / "contaminated.jsonl").read_text()
    assert len(sampled.splitlines()) == 5  # the lowest-ranked five
    assert {aliases.get(r, r) for r in (json.loads(x)["id"] for x in sampled.splitlines())} <= (
        contaminated
    )
    assert output_digests(tmp_path / "a") == {
        **reference,
        **{
            k: v
            for k, v in output_digests(tmp_path / "a").items()
            if k.startswith("quality-report/")
        },
    }
    assert not (tmp_path / "a" / "_quality-report").exists()
    assert any(k.startswith("quality/") for k in reference)
    multi = tmp_path / "b"
    _run(
        planted,
        multi,
        ["--direct_running_mode=multi_processing", "--direct_num_workers=2"],
        *extra,
        "tracking.enabled=false",
    )
    assert output_digests(multi) == reference
    try:
        _run(
            planted,
            tmp_path / "c",
            ["--runner=DaskRunner", f"--dask_client_address={dask_cluster.scheduler_address}"],
            *extra,
            "tracking.enabled=false",
        )
    finally:  # Beam's DaskRunner opens a client and leaves it open
        with contextlib.suppress(ValueError):
            distributed.default_client().close()
    assert output_digests(tmp_path / "c") == reference


@pytest.mark.integration
def test_dry_run_counts_equal_the_jobs_manifest_with_planted_duplicates(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """A small corpus with planted exact and near copies, and two exact copies of a
    one-sentence document: ``--dry-run-quality`` reports every count of the job's manifest
    (documents kept, per split, sentences, tokens, removals by reason). The one-sentence
    copies are too short before they are duplicates (docs/corpus-quality.md, "Order"): both
    counted as ``documents_too_short``, neither as a duplicate."""
    corpus = tmp_path / "corpus"
    truth = write_planted_corpus(corpus, 0.3, files=2, seed=5, exact=0.3, near=0.3, below=0.0)
    assert len(truth["exact"]) >= 4 and len(truth["near"]) >= 4
    lone = "A document of one sentence that appears twice in the corpus."
    (corpus / "part-00002.txt").write_text(f"{lone}\n\n{lone}\n\nAnother lone sentence.\n")
    common = [
        f"input.paths=[{corpus}]",
        f"tokenizer={tokenizer_dir}",
        "phases=[{name: seq64, max_seq_length: 64, max_predictions_per_seq: 10, num_shards: 2}]",
        "heldout_fraction=0.2",
        "quality.dedup.exact=true",
        "quality.dedup.near=true",
        "quality.samples=1000",
        "tracking.enabled=false",
    ]
    job = run_cli(["preprocess", f"output={tmp_path / 'job'}", *common])
    assert job.returncode == 0, job.stderr[-3000:]
    manifest = json.loads((tmp_path / "job" / "seq64" / "manifest.json").read_text())
    corpus_counts = manifest["stats"]["corpus"]
    report_run = run_cli(
        ["preprocess", "--dry-run-quality", f"output={tmp_path / 'report'}", *common]
    )
    assert report_run.returncode == 0, report_run.stderr[-3000:]
    report = json.loads(report_run.stdout.strip().splitlines()[-1])
    assert report["counts"] == corpus_counts
    assert corpus_counts["documents_too_short"] == 3  # the three one-sentence documents
    assert corpus_counts["removed_exact_duplicate"] >= len(truth["exact"])
    assert corpus_counts["removed_near_duplicate"] > 0
    assert corpus_counts["heldout_documents"] > 0
    kept = corpus_counts["train_documents"] + corpus_counts["heldout_documents"]
    assert corpus_counts["documents_kept"] == kept
    removed = sum(v for k, v in corpus_counts.items() if k.startswith("removed_"))
    assert kept == corpus_counts["documents_read"] - corpus_counts["documents_too_short"] - removed
    # the report's review samples are the job's, duplicates included (decoded the same way)
    for reason in ("exact_duplicate", "near_duplicate"):
        job_samples = (tmp_path / "job" / "quality" / f"{reason}.jsonl").read_text()
        assert (tmp_path / "report" / "quality-report" / f"{reason}.jsonl").read_text() == (
            job_samples
        )
    assert not any(lone in line for line in job_samples.splitlines())
