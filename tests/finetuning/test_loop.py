"""Fine-tuning end to end on tiny data with real DeepSpeed and MLflow: every task family,
random vs pre-trained starts, sweeps as nested runs, a real `mlflow server` over HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bertpipe.config import ConfigError, load_config
from bertpipe.finetuning.config import FinetuneConfig
from bertpipe.finetuning.run import run_finetuning
from tests.conftest import sqlite_uri

pytestmark = pytest.mark.integration

POSITIVE = ["the movie was great", "a great film", "good movie", "great great film", "good"]
NEGATIVE = ["the movie was terrible", "a bad film", "terrible movie", "bad bad film", "bad"]


def _glue_files(tmp_path: Path) -> tuple[Path, Path]:
    rows = [(s, 1) for s in POSITIVE] + [(s, 0) for s in NEGATIVE]
    train = tmp_path / "train.tsv"
    train.write_text("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in rows * 4))
    dev = tmp_path / "dev.tsv"
    dev.write_text("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in rows) + "broken\n")
    return train, dev


def _squad_files(tmp_path: Path) -> tuple[Path, Path]:
    context = "paris is the capital of france . the river seine flows through paris ."
    qas = [
        {
            "id": "q1",
            "question": "what is the capital of france ?",
            "answers": [{"text": "paris", "answer_start": 0}],
            "is_impossible": False,
        },
        {
            "id": "q2",
            "question": "what river flows through paris ?",
            "answers": [{"text": "seine", "answer_start": context.index("seine")}],
            "is_impossible": False,
        },
        {"id": "q3", "question": "who won the cup ?", "answers": [], "is_impossible": True},
    ]
    data = {
        "version": "v2.0",
        "data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}],
    }
    copies = [
        {
            "title": f"t{i}",
            "paragraphs": [
                {"context": context, "qas": [{**qa, "id": f"{qa['id']}-{i}"} for qa in qas]}
            ],
        }
        for i in range(8)
    ]
    train = tmp_path / "train.json"
    train.write_text(json.dumps({**data, "data": copies}))
    dev = tmp_path / "dev.json"
    dev.write_text(json.dumps(data))
    return train, dev


def _conll_files(tmp_path: Path) -> tuple[Path, Path]:
    sentences = [
        [("john", "B-PER"), ("lives", "O"), ("in", "O"), ("london", "B-LOC")],
        [("peter", "B-PER"), ("blackburn", "I-PER"), ("said", "O"), ("hello", "O")],
        [("new", "B-LOC"), ("york", "I-LOC"), ("mayor", "O"), ("said", "O"), ("yes", "O")],
    ]
    text = (
        "-DOCSTART- O\n\n"
        + "\n\n".join("\n".join(f"{w} {t}" for w, t in s) for s in sentences)
        + "\n"
    )
    train = tmp_path / "train.conll"
    train.write_text("\n\n".join([text] * 6))
    dev = tmp_path / "dev.conll"
    dev.write_text(text)
    return train, dev


def _table_files(tmp_path: Path) -> tuple[Path, Path]:
    """A regression table (an STS-B-like score per sentence pair) in JSON lines."""
    rows = [(a, b, 5.0 if a == b else 0.5) for a in POSITIVE for b in POSITIVE[:3]]
    text = "".join(json.dumps({"a": a, "b": b, "score": y}) + "\n" for a, b, y in rows)
    train = tmp_path / "train.jsonl"
    train.write_text(text * 3)
    dev = tmp_path / "dev.jsonl"
    dev.write_text(text)
    return train, dev


FAMILIES = {
    "glue": (_glue_files, ["task.family=glue", "task.name=sst-2"], "accuracy"),
    "squad": (
        _squad_files,
        [
            "task.family=squad",
            "task.name=squad",
            "task.max_seq_length=64",
            "task.doc_stride=32",
            "task.max_query_length=16",
        ],
        "f1",
    ),
    "conll": (_conll_files, ["task.family=conll", "task.name=ner"], "f1"),
    "table": (
        _table_files,
        [
            "task.family=table",
            "task.name=pairs",
            "task.kind=regression",
            "task.text_a=a",
            "task.text_b=b",
            "task.label=score",
        ],
        "spearman",
    ),
}


def _cfg(pretrained: Path, tmp_path: Path, uri: str, family: str, *extra: str) -> FinetuneConfig:
    make, overrides, _ = FAMILIES[family]
    tmp_path.mkdir(parents=True, exist_ok=True)
    train, dev = make(tmp_path)
    return load_config(
        FinetuneConfig,
        None,
        [
            f"output={tmp_path / 'out'}",
            f"init_from={pretrained}",
            f"task.train={train}",
            f"task.dev=[{dev}]",
            "epochs=4",
            "batch_size=8",
            "learning_rate=2e-3",
            "eval_batch_size=16",
            f"tracking.uri={uri}",
            "tracking.experiment=finetune-tests",
            *overrides,
            *extra,
        ],
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_trains_scores_and_logs(pretrained: Path, tmp_path: Path, family: str) -> None:
    import mlflow

    uri = sqlite_uri(tmp_path / "mlflow.db")
    result = run_finetuning(_cfg(pretrained, tmp_path, uri, family))
    main = FAMILIES[family][2]
    assert main in result.main_metric and result.main_metric in result.metrics
    losses = [h["train/loss"] for h in result.history]
    assert len(losses) == 4 and losses[-1] < losses[0]  # it learns
    out = tmp_path / "out"
    assert (out / "best" / "config.json").exists() and (out / "best" / "tokenizer.json").exists()
    predictions = list((out / "predictions" / f"epoch{result.best_epoch}").rglob("*.*"))
    assert predictions, "a prediction file per evaluation"
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run(result.run_id)
    assert run.data.tags["bertpipe.stage"] == "finetune"
    assert run.data.tags["bertpipe.parent_run_id"] == "pretrain-run-123"
    assert run.data.tags["bertpipe.data_manifest_sha256.phase1"] == "abc"
    assert run.data.tags["bertpipe.init"] == "pretrained"
    assert f"best/{result.main_metric}" in run.data.metrics
    # the step axis is optimizer steps; the epoch is a metric of its own
    steps = [h["step"] for h in result.history]
    assert steps == [steps[0] * e for e in (1, 2, 3, 4)] and steps[0] >= 1
    history = client.get_metric_history(result.run_id, "train/loss")
    assert sorted(m.step for m in history) == steps
    epochs = client.get_metric_history(result.run_id, "epoch")
    want = [(step, float(epoch)) for epoch, step in enumerate(steps, 1)]
    assert sorted((m.step, m.value) for m in epochs) == want
    assert run.data.metrics["best/step"] == result.best_step == steps[result.best_epoch - 1]
    assert run.data.tags["bertpipe.source_run_id"] == "pretrain-run-123"
    artifacts = {a.path for a in client.list_artifacts(result.run_id)}
    assert {"predictions", "finetune_summary.json"} <= artifacts
    assert [m.model_id for m in run.outputs.model_outputs] == [result.model_id]
    if family == "glue":  # the malformed dev row is reported, not silently dropped
        summary = json.loads(
            (Path(client.download_artifacts(result.run_id, "finetune_summary.json"))).read_text()
        )
        assert any(
            "problem" in line or "1 bad" in line or "skipped" in line
            for line in summary["read_reports"]
        )


def test_deterministic_and_random_baseline(pretrained: Path, tmp_path: Path) -> None:
    uri = sqlite_uri(tmp_path / "mlflow.db")
    a = run_finetuning(_cfg(pretrained, tmp_path / "a", uri, "glue", "save_model=false"))
    b = run_finetuning(_cfg(pretrained, tmp_path / "b", uri, "glue", "save_model=false"))
    assert [h["train/loss"] for h in a.history] == [h["train/loss"] for h in b.history]
    r = run_finetuning(
        _cfg(pretrained, tmp_path / "r", uri, "glue", "save_model=false", "random_init=true")
    )
    assert [h["train/loss"] for h in r.history] != [h["train/loss"] for h in a.history]
    import mlflow

    assert (
        mlflow.MlflowClient(tracking_uri=uri).get_run(r.run_id).data.tags["bertpipe.init"]
        == "random"
    )


def test_sweep_runs_are_nested_under_a_parent(pretrained: Path, tmp_path: Path) -> None:
    import mlflow

    from bertpipe.finetuning.sweep import run_sweep

    uri = sqlite_uri(tmp_path / "mlflow.db")
    cfg = _cfg(
        pretrained,
        tmp_path,
        uri,
        "glue",
        "save_model=false",
        "sweep.learning_rate=[2e-3, 1e-4]",
        "sweep.batch_size=[8]",
        "sweep.epochs=[1, 2]",
    )
    result = run_sweep(cfg)
    assert len(result.trials) == 4
    client = mlflow.MlflowClient(tracking_uri=uri)
    parent = client.get_run(result.run_id)
    assert parent.data.tags["bertpipe.stage"] == "sweep"
    assert parent.data.tags["bertpipe.best_run_id"] == result.best.run_id
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{result.run_id}'"
    )
    assert len(children) == 4
    assert {c.data.tags["bertpipe.parent_run_id"] for c in children} == {"pretrain-run-123"}
    best = max(children, key=lambda c: c.data.metrics["best/accuracy"])
    assert parent.data.metrics["best/accuracy"] == best.data.metrics["best/accuracy"]


def test_config_errors(pretrained: Path, tmp_path: Path) -> None:
    uri = sqlite_uri(tmp_path / "mlflow.db")
    with pytest.raises(ConfigError) as info:
        run_finetuning(_cfg(pretrained, tmp_path, uri, "glue", "task.max_seq_length=256"))
    assert info.value.key == "task.max_seq_length" and "128" in str(info.value)
    # a fine-tuned model's head has labels 0/1; a task with other labels must not reuse it
    first = run_finetuning(_cfg(pretrained, tmp_path / "first", uri, "glue", "epochs=1"))
    with pytest.raises(ConfigError) as info:
        run_finetuning(
            _cfg(Path(first.output) / "best", tmp_path / "second", uri, "conll", "epochs=1")
        )
    assert info.value.key == "task.labels"


@pytest.mark.slow
def test_logs_to_a_real_mlflow_server_over_http(
    pretrained: Path, tmp_path: Path, mlflow_server: str
) -> None:
    import mlflow

    uri = mlflow_server
    result = run_finetuning(_cfg(pretrained, tmp_path, uri, "glue", "epochs=2"))
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["best/accuracy"] == result.metrics["accuracy"]
    assert [m.model_id for m in run.outputs.model_outputs] == [result.model_id]
    assert list((tmp_path / "server-artifacts").rglob("config.json"))  # stored by the server
