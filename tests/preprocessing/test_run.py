"""The whole preprocessing stage end to end: real Beam, real files, real MLflow."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from bertpipe.app.cli import main
from bertpipe.config import load_config
from bertpipe.preprocessing.config import PreprocessConfig
from bertpipe.preprocessing.run import prepare, run_preprocess
from bertpipe.preprocessing.shard_format import read_shard
from tests.cli_runner import run_cli

pytestmark = pytest.mark.integration

PHASES = (
    "phases=[{name: seq64, max_seq_length: 64, max_predictions_per_seq: 10, num_shards: 4},"
    " {name: seq128, max_seq_length: 128, max_predictions_per_seq: 20, num_shards: 3}]"
)


def _cfg(corpus: Path, tokenizer: Path, out: Path, *extra: str) -> PreprocessConfig:
    return load_config(
        PreprocessConfig,
        None,
        [
            f"input.paths=[{corpus}]",
            f"tokenizer={tokenizer}",
            f"output={out}",
            PHASES,
            "dupe_factor=2",
            "heldout_fraction=0.05",
            "bucket_mb=0.02",
            *extra,
        ],
    )


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_both_phases_with_manifest_stats_and_mlflow(
    corpus_dir: Path, tokenizer_dir: Path, tmp_path: Path, mlflow_uri: str
) -> None:
    out = tmp_path / "shards"
    manifests = run_preprocess(_cfg(corpus_dir, tokenizer_dir, out, f"tracking.uri={mlflow_uri}"))
    assert set(manifests) == {"seq64", "seq128"}
    for name, max_len in (("seq64", 64), ("seq128", 128)):
        m = manifests[name]
        assert m["schema_version"] == 1 and m["max_seq_length"] == max_len
        assert m["stats"]["corpus"]["documents_read"] == 200
        assert (out / name / "manifest.json").exists()
        assert not (out / name / "_parts").exists()
        total = 0
        for split in ("train", "heldout"):
            for shard in m["splits"][split]["shards"]:
                path = out / name / shard["file"]
                assert hashlib.sha256(path.read_bytes()).hexdigest() == shard["sha256"]
                blocks = [b for _, b in read_shard(str(path))]
                n = sum(len(b) for b in blocks)
                assert n == shard["instances"] and len(blocks) == shard["samples"]
                assert max(int(b.lengths.max()) for b in blocks) <= max_len
                total += n
        train = m["splits"]["train"]
        counts = [s["instances"] for s in train["shards"]]
        assert len(counts) == train["num_shards"]
        assert max(counts) - min(counts) <= m["num_buckets"]  # balanced
        assert total == m["stats"]["train"]["instances"] + m["stats"]["heldout"]["instances"]
        assert m["stats"]["train"]["masked_fraction"] == pytest.approx(0.15, abs=0.01)
        assert 0 < m["splits"]["heldout"]["instances"] < 0.2 * train["instances"]
    import mlflow

    mlflow.set_tracking_uri(mlflow_uri)
    (run,) = mlflow.search_runs(experiment_names=["bertpipe"], output_format="list")
    assert run.data.tags["bertpipe.stage"] == "preprocess"
    assert run.data.tags["bertpipe.data_manifest_sha256.seq64"] == manifests["seq64"]["_sha256"]
    assert (
        run.data.metrics["seq128.train.instances"]
        == manifests["seq128"]["stats"]["train"]["instances"]
    )
    assert run.data.params["dupe_factor"] == "2"
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "manifests")}
    assert artifacts == {"manifests/seq64.json", "manifests/seq128.json"}
    # the run spans the Beam job, and its corpus is its dataset input (MLflow's own field)
    assert run.info.end_time - run.info.start_time >= 1000 * run.data.metrics["seconds"]
    (corpus,) = run.inputs.dataset_inputs
    assert corpus.dataset.name == "corpus" and corpus.dataset.source_type == "local"
    assert json.loads(corpus.dataset.source)["uri"] == f"file://{corpus_dir}"
    profile = json.loads(corpus.dataset.profile)
    assert profile["files"] == len(list(corpus_dir.iterdir())) and profile["bytes"] > 0
    assert corpus.dataset.digest == profile["sha256"][:32]
    assert {t.key: t.value for t in corpus.tags}["mlflow.data.context"] == "training"
    experiment = mlflow.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"


def test_bad_input_is_counted_and_inputs_untouched(
    tokenizer_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two worker processes read the messy corpus: every skip is counted; the warnings they
    logged went to the workers' log, and one line after the job says so."""
    corpus = tmp_path / "messy"
    corpus.mkdir()
    from tests.conftest import synthetic_documents, write_sentence_files

    write_sentence_files(corpus, synthetic_documents(40, seed=8), files=2)
    (corpus / "empty.txt").write_bytes(b"")
    (corpus / "blob.txt").write_bytes(bytes(range(256)) * 10)
    (corpus / "latin.txt").write_bytes("d\xe9j\xe0 vu.\nencore.\n".encode("latin-1") * 20)
    (corpus / "short.txt").write_text("Just one sentence here.\n\nAnd another lonely one.\n")
    (corpus / "table.csv").write_text("a,b\n1,2\n")
    with (corpus / "huge.txt").open("w") as f:
        f.write("y" * 50_000_000 + "\n")
    before = _digest(corpus)
    manifests = run_preprocess(
        _cfg(corpus, tokenizer_dir, tmp_path / "out", "tracking.enabled=false"),
        ["--direct_running_mode=multi_processing", "--direct_num_workers=2"],
    )
    worker_log = tmp_path / "logs" / "out-preprocess.log"
    (summary,) = [r.getMessage() for r in caplog.records if "in the worker processes" in r.msg]
    assert summary.startswith("preprocess: 4 warning(s) in the worker processes, the first: ")
    assert summary.endswith(f"; all in {worker_log}")
    assert worker_log.read_text().count(":skipping ") == 4  # empty, binary, latin-1, .csv
    corpus_stats = manifests["seq64"]["stats"]["corpus"]
    assert corpus_stats["files_skipped_empty"] == 1
    assert corpus_stats["files_skipped_binary"] == 1
    assert corpus_stats["files_skipped_not_utf8"] == 1
    assert corpus_stats["files_skipped_unknown_extension"] == 1
    assert corpus_stats["documents_too_short"] == 2
    assert corpus_stats["sentences_too_long"] == 1
    assert manifests["seq64"]["splits"]["train"]["instances"] > 0
    assert _digest(corpus) == before


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``bertpipe ARGS``: its exit status and output as a child's, run in this process (no
    signal or launcher is involved: a child would only add its imports)."""
    return run_cli(list(args))


def test_clear_errors_before_any_work(
    corpus_dir: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    base = [f"tokenizer={tokenizer_dir}", "tracking.enabled=false", PHASES, "dupe_factor=1"]
    # a glob that matches nothing
    proc = _cli(
        "preprocess", f"input.paths=[{tmp_path}/missing-*.txt]", f"output={tmp_path}/o", *base
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("bertpipe: error: input ")
    assert "missing-*.txt matches no file" in proc.stderr
    # a config key that does not exist
    proc = _cli("preprocess", f"input.paths=[{corpus_dir}]", "dupe_factr=3", *base)
    assert proc.returncode == 2 and "config key 'dupe_factr': unknown key" in proc.stderr
    # a tokenizer with another checksum
    proc = _cli(
        "preprocess",
        f"input.paths=[{corpus_dir}]",
        f"output={tmp_path}/o",
        "tokenizer_sha256=abc",
        *base,
    )
    assert proc.returncode == 2 and "sha256" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_existing_output_needs_overwrite_and_is_kept(
    corpus_dir: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "o"
    args = [
        "preprocess",
        f"input.paths=[{corpus_dir}]",
        f"tokenizer={tokenizer_dir}",
        f"output={out}",
        "tracking.enabled=false",
        "dupe_factor=1",
        "phases=[{name: s, max_seq_length: 32, max_predictions_per_seq: 5, num_shards: 2}]",
    ]
    assert main(args) == 0
    before = _digest(out)
    proc = _cli(*args)
    assert proc.returncode == 2 and "already holds 3 shard(s) and a manifest" in proc.stderr
    assert "--overwrite" in proc.stderr
    assert _digest(out) == before
    # with --overwrite the same config reproduces the same bytes
    assert main([*args, "--overwrite"]) == 0
    after = _digest(out)
    assert {k: v for k, v in after.items() if k != "preprocess.yaml"} == {
        k: v for k, v in before.items() if k != "preprocess.yaml"
    }


def test_tokenizer_cli_trains_and_imports(
    corpus_dir: Path, tmp_path: Path, mlflow_uri: str
) -> None:
    out = tmp_path / "tok"
    args = [
        "tokenizer",
        "train",
        f"input.paths=[{corpus_dir}]",
        f"output={out}",
        "vocab_size=300",
        "tracking.enabled=false",
    ]
    assert main([*args[:-1], f"tracking.uri={mlflow_uri}", "tracking.run_name=tok-300"]) == 0
    vocab = (out / "vocab.txt").read_text().splitlines()
    assert len(vocab) == 300 and vocab[2] == "[CLS]"
    # its MLflow run spans the training, reads the corpus and outputs the tokenizer as a model
    import mlflow

    mlflow.set_tracking_uri(mlflow_uri)
    client = mlflow.MlflowClient()
    (run,) = mlflow.search_runs(experiment_names=["bertpipe"], output_format="list")
    assert run.info.status == "FINISHED" and run.info.run_name == "tok-300"
    assert run.info.end_time - run.info.start_time >= 1000 * run.data.metrics["seconds"]
    (corpus,) = run.inputs.dataset_inputs
    assert corpus.dataset.name == "corpus"
    assert json.loads(corpus.dataset.profile)["files"] == len(list(corpus_dir.iterdir()))
    (output,) = run.outputs.model_outputs
    model = mlflow.get_logged_model(output.model_id)
    assert model.name == "tokenizer" and model.source_run_id == run.info.run_id
    assert model.tags["bertpipe.tokenizer_sha256"] == run.data.tags["bertpipe.tokenizer_sha256"]
    files = {a.path for a in client.list_logged_model_artifacts(model.model_id)}
    assert {"vocab.txt", "tokenizer.json", "tokenizer_config.json"} <= files
    assert _cli(*args).returncode == 2  # exists
    imported = tmp_path / "imported"
    assert (
        main(
            [
                "tokenizer",
                "train",
                f"vocab_file={out / 'vocab.txt'}",
                f"output={imported}",
                "tracking.enabled=false",
            ]
        )
        == 0
    )
    assert (imported / "vocab.txt").read_text().splitlines() == vocab
    first = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    second = json.loads((imported / "tokenizer.json").read_text())["model"]["vocab"]
    assert first == second
    # the same inputs train the same vocabulary again
    again = tmp_path / "again"
    assert main([*args[:3], f"output={again}", "vocab_size=300", "tracking.enabled=false"]) == 0
    assert (again / "vocab.txt").read_bytes() == (out / "vocab.txt").read_bytes()
    assert np.all(np.array(vocab[:5]) == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])


def test_progress_in_corpus_mb_from_task_markers(
    corpus_dir: Path, tokenizer_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The driver counts the markers the tasks leave (ranges read, training buckets made,
    shards written) as corpus MB done, and logs the last line when the job ends."""
    from bertpipe.preprocessing.pipeline.layout import _mark_done
    from bertpipe.preprocessing.run import PreprocessProgress

    cfg = _cfg(corpus_dir, tokenizer_dir, tmp_path / "o", "tracking.enabled=false")
    plan, ranges = prepare(cfg)
    total = sum(r.text_bytes for r in ranges) / 1e6
    progress = PreprocessProgress(plan, ranges, poll_s=3600)
    assert progress.poll() == 0.0
    _mark_done(cfg.output, f"read-{ranges[0].index:06d}")
    first = ranges[0].text_bytes / 1e6
    assert progress.poll() == pytest.approx(0.45 * first)
    for r in ranges:
        _mark_done(cfg.output, f"read-{r.index:06d}")
    for b in range(plan.num_buckets):
        _mark_done(cfg.output, f"bucket-{b:06d}")
    assert progress.poll() == pytest.approx(0.9 * total)

    with caplog.at_level("INFO", logger="bertpipe.progress"):
        run_preprocess(_cfg(corpus_dir, tokenizer_dir, tmp_path / "run", "tracking.enabled=false"))
    last = [r.getMessage() for r in caplog.records if " buckets " in r.getMessage()]
    assert last and "100%" in last[-1], last
    assert f"buckets {plan.num_buckets}/{plan.num_buckets}" in last[-1]
    assert "shards 9/9" in last[-1]  # 4 + 3 training shards, a held-out shard per phase
    assert not (tmp_path / "run" / "_progress").exists()
    assert not (tmp_path / "run" / "_spill").exists()


def test_a_big_file_split_in_ranges_gives_the_same_shards_as_fewer_ranges(
    corpus_dir: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """One file over split_mb is read in byte ranges (documents named by offset): any range
    size gives byte-identical shards and statistics, on one worker or two processes."""
    single = tmp_path / "in" / "all.txt"
    single.parent.mkdir()
    single.write_bytes(b"\n\n".join(p.read_bytes() for p in sorted(corpus_dir.glob("*.txt"))))
    size_mb = single.stat().st_size / 1e6

    def run(out: str, split_mb: float, beam: list[str]) -> tuple[int, dict[str, str], dict]:  # type: ignore[type-arg]
        cfg = _cfg(
            single.parent,
            tokenizer_dir,
            tmp_path / out,
            "tracking.enabled=false",
            f"split_mb={split_mb}",
        )
        ranges = prepare(cfg)[1]
        assert all(r.split for r in ranges)
        manifest = run_preprocess(cfg, beam)["seq64"]
        shards = {k: v for k, v in _digest(tmp_path / out).items() if k.endswith(".tar")}
        return len(ranges), shards, {k: manifest[k] for k in ("splits", "stats")}

    n_few, few, few_manifest = run("few", size_mb / 3, ["--direct_num_workers=1"])
    n_many, many, many_manifest = run(
        "many", size_mb / 17, ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]
    )
    assert 3 <= n_few < 6 < n_many
    assert few == many and len(few) == 9
    assert few_manifest == many_manifest


def test_parquet_corpus_end_to_end(corpus_dir: Path, tokenizer_dir: Path, tmp_path: Path) -> None:
    """A hub-style parquet corpus (a document per row, several row groups, read in runs of
    row groups by several tasks) gives the documents, instances and shards of the text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = []
    for p in sorted(corpus_dir.glob("*.txt")):
        docs += [d for d in p.read_text().split("\n\n") if d.strip()]
    folder = tmp_path / "parquet"
    folder.mkdir()
    table = pa.Table.from_pylist([{"id": i, "text": d} for i, d in enumerate(docs)])
    pq.write_table(table, folder / "train-00000-of-00001.parquet", row_group_size=16)
    cfg = _cfg(
        folder,
        tokenizer_dir,
        tmp_path / "out",
        "tracking.enabled=false",
        "input.format=parquet",
        "input.id_field=id",
        "split_mb=0.02",
    )
    assert len(prepare(cfg)[1]) > 3
    manifest = run_preprocess(cfg)["seq64"]
    corpus = manifest["stats"]["corpus"]
    assert corpus["documents_read"] == len(docs) and corpus["files_read"] == 1
    assert corpus["documents_kept"] > 0.9 * len(docs)
    assert manifest["splits"]["train"]["instances"] > 1000
