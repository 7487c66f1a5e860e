"""A dev label that the training file lacks: one line naming the dev file's row and the
training file, exit 2, before anything is trained or published, in every family with
labels. (RTE's training file cut to one class used to run and publish a whole suite.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bertpipe.finetuning.evaluation.sample_glue import write_glue
from tests.cli_runner import run_cli
from tests.conftest import sqlite_uri

PROTOCOL = [
    "protocol.learning_rates=[1e-3]",
    "protocol.seeds=[1]",
    "protocol.epochs=1",
    "protocol.max_seq_length=32",
    "threads_per_trial=1",
    "parallel=1",
]


def _env() -> dict[str, str]:
    job = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in job}, "OMP_NUM_THREADS": "1"}


def _refused(args: list[str], *fragments: str) -> str:
    done = run_cli(args, _env())
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("bertpipe: error: "), line
    for fragment in fragments:
        assert fragment in line, (fragment, line)
    return line


def _nothing_in(uri: str) -> None:
    import mlflow

    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert runs == []  # no suite run, no trial run, no fine-tuning run


def _one_class(rte: Path) -> int:
    """Keep only the ``entailment`` rows of RTE's training file; returns the line of the
    first ``not_entailment`` row of its dev file."""
    lines = (rte / "train.tsv").read_text().splitlines()
    kept = [lines[0], *(line for line in lines[1:] if line.endswith("\tentailment"))]
    (rte / "train.tsv").write_text("\n".join(kept) + "\n")
    dev = (rte / "dev.tsv").read_text().splitlines()
    return next(i for i, line in enumerate(dev, start=1) if line.endswith("not_entailment"))


def test_a_glue_task_whose_training_lacks_a_dev_label_is_refused(
    pretrained: Path, tmp_path: Path
) -> None:
    glue = write_glue(tmp_path / "glue", train=24, dev=12)
    rte = glue / "RTE"
    line = _one_class(rte)
    uri = sqlite_uri(tmp_path / "mlflow.db")
    out = tmp_path / "suite"
    where = f"{rte / 'dev.tsv'}:{line}: label 'not_entailment' is not in the training file"
    for bad_rows in ("fail", "skip"):  # not a row to drop: refused either way
        _refused(
            [
                "evaluate",
                f"model={pretrained}",
                "suite=glue",
                f"data={glue}",
                f"output={out}",
                f"tracking.uri={uri}",
                f"bad_rows={bad_rows}",
                *PROTOCOL,
            ],
            where,
            f"{rte / 'train.tsv'} (it has: entailment)",
        )
    assert not (out / "trials").exists()
    _refused(  # bertpipe finetune on the same files
        [
            "finetune",
            f"init_from={pretrained}",
            "task.family=glue",
            "task.name=rte",
            f"task.train={rte / 'train.tsv'}",
            f"task.dev=[{rte / 'dev.tsv'}]",
            f"output={tmp_path / 'finetune'}",
            f"tracking.uri={uri}",
        ],
        where,
    )
    _nothing_in(uri)


@pytest.mark.parametrize("family", ["table", "conll"])
def test_other_families_refuse_a_dev_label_training_lacks(
    pretrained: Path, tmp_path: Path, family: str
) -> None:
    """A table task with its labels given (so the dev row reads), and a CoNLL task whose
    dev file has an entity type the training file lacks (kept by ``bertpipe finetune``,
    scored as missed; refused by a suite, with bad_rows=skip too)."""
    folder = tmp_path / family
    folder.mkdir()
    if family == "table":
        (folder / "train.csv").write_text("text,label\n" + "the cat sat.,a\nthe dog sat.,b\n" * 4)
        (folder / "dev.csv").write_text("text,label\nthe cat sat.,a\nthe man sat.,c\n")
        task = "{name: t, family: table, train: train.csv, dev: dev.csv, task: {labels: [a, b, c]}}"
        fragments = [f"{folder / 'dev.csv'}:3: label 'c' is not in the training file"]
    else:
        sentence = "john NNP B-PER\nlives VBZ O\nin IN O\nlondon NNP B-LOC\n\n"
        (folder / "train.txt").write_text("john NNP B-PER\nlives VBZ O\n\n" * 4)
        (folder / "dev.txt").write_text(sentence)
        task = "{name: t, family: conll, train: train.txt, dev: dev.txt}"
        fragments = [f"{folder / 'dev.txt'}:4: entity type 'LOC' is not in the training file"]
    suite = folder / "suite.yaml"
    suite.write_text(f"name: mine\ntasks:\n  - {task}\n")
    uri = sqlite_uri(tmp_path / "mlflow.db")
    args = ["evaluate", f"model={pretrained}", f"suite={suite}", f"output={tmp_path / 'out'}"]
    _refused([*args, f"tracking.uri={uri}", "bad_rows=skip", *PROTOCOL], *fragments)
    _nothing_in(uri)
