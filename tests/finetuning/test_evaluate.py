"""``bertpipe evaluate``: the paper's protocol on GLUE's layouts, resumed after SIGKILL and
after SIGTERM while running in parallel, and refused on bad input before any trial.

The suites fine-tune the tiny BERT of ``conftest.pretrained`` on GLUE-layout folders written
by :mod:`tests.finetuning.glue_layout` (all nine tasks; WNLI must be left out). Every trial
computes on one thread, so that a trial run again anywhere (a worker process, a resumed
suite, ``bertpipe finetune`` by hand) gives the same bits.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bertpipe.finetuning.evaluation.sample_glue import write_glue
from tests.cli_runner import run_cli
from tests.conftest import sqlite_uri

TASKS = ["cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte"]
GLUE_SCORE = {  # the GLUE benchmark's rule, written out again here
    "cola": ["mcc"],
    "sst2": ["accuracy"],
    "mrpc": ["f1", "accuracy"],
    "stsb": ["pearson", "spearman"],
    "qqp": ["f1", "accuracy"],
    "mnli": ["accuracy", "dev_mismatched/accuracy"],
    "qnli": ["accuracy"],
    "rte": ["accuracy"],
}
LRS, SEEDS = [3e-3, 1e-3], [1, 2]
PROTOCOL = [
    f"protocol.learning_rates=[{','.join(map(str, LRS))}]",
    f"protocol.seeds=[{','.join(map(str, SEEDS))}]",
    "protocol.epochs=2",
    "protocol.max_seq_length=32",
    "threads_per_trial=1",
    "tracking.experiment=evaluate",
]


JOB = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env() -> dict[str, str]:
    """A child's environment: one thread, and not this process's one-process job."""
    return {**{k: v for k, v in os.environ.items() if k not in JOB}, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def glue(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_glue(tmp_path_factory.mktemp("glue"))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return sqlite_uri(tmp_path_factory.mktemp("store") / "mlflow.db")


@pytest.fixture(scope="module")
def suite(pretrained: Path, glue: Path, store: str, tmp_path_factory) -> dict[str, Any]:
    """The whole GLUE suite (8 tasks x 2 learning rates x 2 seeds), run once."""
    out = tmp_path_factory.mktemp("suite") / "glue"
    args = ["evaluate", f"model={pretrained}", "suite=glue", f"data={glue}", f"output={out}"]
    done = run_cli([*args, *PROTOCOL, f"tracking.uri={store}", "parallel=1"], _env())
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return {"out": out, "summary": summary, "stdout": done.stdout, "args": args}


def _trial(out: Path, task: str, lr: float, seed: int) -> dict[str, Any]:
    return json.loads((out / "trials" / task / f"lr{lr:g}-seed{seed}" / "result.json").read_text())


def test_glue_suite_follows_the_protocol_and_logs_it(suite: dict[str, Any], store: str) -> None:
    out, summary = suite["out"], suite["summary"]
    assert list(summary["tasks"]) == TASKS  # the paper's order; WNLI left out
    assert summary["trials"] == summary["trials_run"] == len(TASKS) * len(LRS) * len(SEEDS)
    seed_averages = []
    for task in TASKS:
        per_lr = {}
        for lr in LRS:
            scores = []
            for seed in SEEDS:
                trial = _trial(out, task, lr, seed)
                assert trial["metrics"] == trial["last"]  # the last epoch, as the paper
                scores.append(statistics.fmean(trial["metrics"][m] for m in GLUE_SCORE[task]))
            per_lr[lr] = scores
        chosen = max(LRS, key=lambda lr: (statistics.fmean(per_lr[lr]), -LRS.index(lr)))
        got = summary["tasks"][task]
        assert got["learning_rate"] == chosen
        assert got["score"] == pytest.approx(statistics.fmean(per_lr[chosen]), abs=1e-12)
        assert got["std"] == pytest.approx(statistics.stdev(per_lr[chosen]), abs=1e-12)
        seed_averages.append(per_lr[chosen])
    average = statistics.fmean(summary["tasks"][t]["score"] for t in TASKS)
    assert summary["average"] == pytest.approx(average, abs=1e-12)
    per_seed = [statistics.fmean(s[i] for s in seed_averages) for i in range(len(SEEDS))]
    assert summary["average_std"] == pytest.approx(statistics.stdev(per_seed), abs=1e-12)
    assert "| **average** |" in (out / "table.md").read_text()

    import mlflow

    client = mlflow.MlflowClient(store)
    run = client.get_run(summary["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["bertpipe.stage"] == "evaluate"
    assert run.data.tags["bertpipe.suite_tasks"] == ",".join(TASKS)
    assert run.data.tags["bertpipe.parent_run_id"] == "pretrain-run-123"  # the export's lineage
    assert run.data.metrics["average"] == summary["average"]
    for task in TASKS:
        assert run.data.metrics[f"{task}/score"] == summary["tasks"][task]["score"]
        assert run.data.metrics[f"{task}/learning_rate"] == summary["tasks"][task]["learning_rate"]
    assert (
        run.data.metrics["mrpc/f1_std"] >= 0 and "mnli/dev_mismatched/accuracy" in run.data.metrics
    )
    children = client.search_runs(
        [run.info.experiment_id], f"tags.mlflow.parentRunId = '{summary['run_id']}'"
    )
    assert len(children) == summary["trials"]
    assert {c.info.status for c in children} == {"FINISHED"}
    assert {c.data.tags["bertpipe.trial"] for c in children} >= {"rte/lr0.003-seed1"}
    names = {a.path for a in client.list_artifacts(summary["run_id"])}
    assert {"suite_results.json", "suite_table.md"} <= names


def test_each_task_equals_finetune_run_by_hand(
    suite: dict[str, Any], tmp_path: Path, store: str
) -> None:
    """The chosen setting of every task, run again as `bertpipe finetune --config` of the
    trial's own finetune.yaml: the same metrics, bit for bit (best epoch on stdout, last
    epoch's in its MLflow run)."""
    import mlflow

    out, summary = suite["out"], suite["summary"]
    client = mlflow.MlflowClient(store)
    for task in TASKS:
        lr, seed = summary["tasks"][task]["learning_rate"], SEEDS[0]
        trial = _trial(out, task, lr, seed)
        config = out / "trials" / task / f"lr{lr:g}-seed{seed}" / "finetune.yaml"
        again = run_cli(
            [
                "finetune",
                "--config",
                str(config),
                f"output={tmp_path / task}",
                "tracking.experiment=by-hand",
                "tracking.run_name=by-hand",
            ],
            _env(),
        )
        assert again.returncode == 0, again.stderr[-3000:]
        by_hand = json.loads(again.stdout.strip().splitlines()[-1])
        best = {k: v for k, v in trial["best"].items() if k != "best_epoch"}
        assert by_hand["metrics"] == best, task
        last = client.get_run(by_hand["run_id"]).data.metrics
        assert {k: last[f"eval/{k}"] for k in trial["last"]} == trial["last"], task


TRAINING = "bertpipe.finetuning.run: fine-tuning "
"""The line a trial logs as its training starts (its SIGTERM handler is in place)."""
FIRST_EPOCH = "bertpipe.finetuning.run: epoch 1/"
"""The line a trial logs at the end of its first epoch (of two)."""


def _stopped(
    args: list[str], out: Path, sig: signal.Signals, in_first_epoch: bool = False
) -> tuple[int, str, dict[Path, int]]:
    """``bertpipe evaluate args`` in a session of its own, sent ``sig`` (to the process group,
    as a scheduler sends it) once its third trial has finished; with ``in_first_epoch``, at a
    moment when another trial is in its first epoch, so that it will stop at one of its steps
    (the group is frozen with SIGSTOP to look, then sent ``sig`` and SIGCONT, as SLURM
    preempts a suspended job); its exit status, stderr and the finished trials'
    ``result.json`` with their mtimes."""
    with tempfile.TemporaryFile() as log:  # not a pipe: a full pipe would stall the suite
        proc = subprocess.Popen(
            [sys.executable, "-m", "bertpipe.app.cli", *args],
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )

        def stderr() -> str:
            log.seek(0)
            return log.read().decode(errors="replace")

        def due() -> bool:
            if len(list(out.glob("trials/*/*/result.json"))) < 3:
                return False
            text = stderr()
            return not in_first_epoch or text.count(TRAINING) > text.count(FIRST_EPOCH)

        deadline = time.monotonic() + 300
        try:
            while True:
                assert proc.poll() is None, stderr()[-3000:]
                assert time.monotonic() < deadline, "no third trial in 300 s"
                if due():
                    if not in_first_epoch:
                        break
                    os.killpg(proc.pid, signal.SIGSTOP)
                    if due():  # still so, now that nothing moves
                        break
                    os.killpg(proc.pid, signal.SIGCONT)
                time.sleep(0.01)
            os.killpg(proc.pid, sig)
            os.killpg(proc.pid, signal.SIGCONT)
            proc.wait(timeout=120)
        finally:  # a failed wait leaves no suite behind
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        text = stderr()
    finished = {p: p.stat().st_mtime_ns for p in out.glob("trials/*/*/result.json")}
    assert 3 <= len(finished) < 8 and not (out / "results.json").exists(), text[-3000:]
    return proc.returncode, text, finished


def _resumed(args: list[str], finished: dict[Path, int]) -> dict[str, Any]:
    """The same command again: it reuses the finished trials (not run again) and ends."""
    resumed = run_cli(args, _env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{len(finished)} of 8 trials finished before" in resumed.stderr
    assert {p: p.stat().st_mtime_ns for p in finished} == finished  # not run again
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["trials_run"] == 8 - len(finished) and summary["trials"] == 8
    return summary


def _trial_runs(store: str, suite_run: str) -> list[tuple[str, str]]:
    """The suite run's children: (trial, status) of each."""
    import mlflow

    client = mlflow.MlflowClient(store)
    children = client.search_runs(
        [client.get_experiment_by_name("evaluate").experiment_id],
        f"tags.mlflow.parentRunId = '{suite_run}'",
    )
    return [(c.data.tags["bertpipe.trial"], c.info.status) for c in children]


@pytest.fixture(scope="module")
def two_tasks(pretrained: Path, glue: Path, store: str) -> list[str]:
    """A suite of two tasks, rte and stsb (8 trials)."""
    base = ["evaluate", f"model={pretrained}", "suite=glue", f"data={glue}", "tasks=[rte,stsb]"]
    return [*base, *PROTOCOL, f"tracking.uri={store}"]


@pytest.fixture(scope="module")
def sigkilled(two_tasks: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The two tasks one trial at a time, SIGKILLed after the third trial, then resumed."""
    out = tmp_path_factory.mktemp("sigkilled")
    args = [*two_tasks, f"output={out}", "parallel=1"]
    status, _, finished = _stopped(args, out, signal.SIGKILL)
    assert status == -signal.SIGKILL
    summary = _resumed(args, finished)
    return {"out": out, "summary": summary}


def test_a_sigkilled_suite_resumes_without_rerunning(
    sigkilled: dict[str, Any], store: str, suite: dict[str, Any]
) -> None:
    """Two tasks (8 trials) SIGKILLed (the process group, as a scheduler does) after its
    third trial: the same command reuses the finished trials (checked in the fixture) and
    ends with the scores of the same tasks in the whole suite's run, which had no stop."""
    results = json.loads((sigkilled["out"] / "results.json").read_text())
    for task in results["scores"]["tasks"]:
        assert task["mean"] == suite["summary"]["tasks"][task["task"]]["score"]
    statuses = [status for _, status in _trial_runs(store, sigkilled["summary"]["run_id"])]
    assert "RUNNING" not in statuses and statuses.count("FINISHED") == 8


def test_a_sigtermed_parallel_suite_resumes_like_sigkill_with_the_same_table(
    sigkilled: dict[str, Any], two_tasks: list[str], store: str, tmp_path: Path
) -> None:
    """The same two tasks 2 trials at a time in worker processes, SIGTERMed (the process
    group: the suite and its workers) after the third trial, while another one is in its
    first epoch: exit 143 with one line, the suite's run KILLED, that trial stopped at its next
    step with its checkpoint (a worker between trials has none); the same command reuses the
    finished trials, continues the stopped ones from their checkpoints and starts the others
    again, and ends with the table of the one-at-a-time suite that was SIGKILLed and resumed
    (so parallel, SIGTERM and SIGKILL all give the same)."""
    import mlflow

    from bertpipe.training.checkpoint import has_checkpoints

    # a SIGTERM acted on at the next step (not within 10, as by default: a trial has 10)
    args = [*two_tasks, f"output={tmp_path}", "parallel=2"]
    args.append("finetune.checkpoint.preemption_check_steps=1")
    status, stderr, finished = _stopped(args, tmp_path, signal.SIGTERM, in_first_epoch=True)
    assert status == 143 and "2 at a time" in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "bertpipe: terminated (SIGTERM)", stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    suite_run = json.loads((tmp_path / "suite.json").read_text())["run_id"]
    assert mlflow.MlflowClient(store).get_run(suite_run).info.status == "KILLED"
    stopped = [
        trial
        for trial in tmp_path.glob("trials/*/*")
        if not (trial / "result.json").exists() and has_checkpoints(str(trial / "checkpoints"))
    ]
    assert stopped, stderr[-3000:]
    summary = _resumed(args, finished)
    assert summary["run_id"] == suite_run  # the same suite run, continued
    assert (tmp_path / "table.md").read_text() == (sigkilled["out"] / "table.md").read_text()
    results = [json.loads((o / "results.json").read_text()) for o in (sigkilled["out"], tmp_path)]
    assert results[0]["scores"] == results[1]["scores"]
    trials = _trial_runs(store, summary["run_id"])
    statuses = [status for _, status in trials]
    assert "RUNNING" not in statuses and statuses.count("FINISHED") == 8
    for trial in stopped:  # continued in the MLflow run it began in, not started again
        key = f"{trial.parent.name}/{trial.name}"
        assert [status for name, status in trials if name == key] == ["FINISHED"], trials


def _refused(args: list[str], fragment: str) -> str:
    done = run_cli(args, _env())
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("bertpipe: error: ") and fragment in line, line
    return line


def test_bad_input_is_one_line_before_any_trial(
    pretrained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    glue = write_glue(tmp_path / "glue", train=40, dev=16)
    uri = sqlite_uri(tmp_path / "mlflow.db")
    common = [f"model={pretrained}", f"tracking.uri={uri}", *PROTOCOL]

    def evaluate(*extra: str) -> list[str]:
        return ["evaluate", *common, f"output={tmp_path / 'out'}", *extra]

    (glue / "MRPC" / "dev.tsv").unlink()
    _refused(evaluate("suite=glue", f"data={glue}"), f"{glue / 'MRPC' / 'dev.tsv'} is missing")
    shutil.rmtree(glue / "MRPC")
    sst2 = glue / "SST-2" / "train.tsv"
    lines = sst2.read_text().splitlines()
    lines[7] = lines[7] + "\textra"  # line 8: a column too many
    sst2.write_text("\n".join(lines) + "\n")
    line = _refused(evaluate("suite=glue", f"data={glue}"), f"{sst2}:8: ")
    assert "bad_rows=skip" in line
    _refused(evaluate("suite=glue", f"data={glue}", "tasks=[wnli]"), "'wnli' is not a GLUE task")

    table = tmp_path / "table"
    table.mkdir()
    (table / "train.csv").write_text("text,label\n" + "the cat sat.,a\nthe dog sat.,b\n" * 4)
    (table / "dev.csv").write_text("text,label\nthe cat sat.,a\nthe dog sat.,b\n")
    (table / "dev_c.csv").write_text("text,label\nthe cat sat.,a\nthe man sat.,c\n")
    suite_yaml = tmp_path / "suite.yaml"

    def suite_file(text: str) -> list[str]:
        suite_yaml.write_text(text)
        return evaluate(f"suite={suite_yaml}", f"data={table}")

    _refused(
        suite_file("name: mine\ntasks:\n  - {name: t, family: tabel, train: a, dev: [b]}\n"),
        "tasks[0].family: unknown family 'tabel'",
    )
    _refused(
        suite_file("name: mine\ntasks:\n  - {name: t, train: train.csv, dev: dev.csv, score: auc}"),
        "task t has no metric 'auc'",
    )
    _refused(
        suite_file("name: mine\ntasks:\n  - {name: t, train: train.csv, dev: [dev_c.csv]}\n"),
        f"{table / 'dev_c.csv'}:3: ",  # label c: not in the training file
    )
    _refused(evaluate("suite=glue", "data=", "tasks=[rte]"), "config key 'data'")
    _refused(
        evaluate("suite=glue", f"data={glue}", "finetune.learning_rate=1"),
        "config key 'finetune.learning_rate'",
    )

    import mlflow

    runs = mlflow.MlflowClient(uri).search_runs(
        [e.experiment_id for e in mlflow.MlflowClient(uri).search_experiments()]
    )
    assert runs == []  # nothing published, not even a failed suite run


def _squad(folder: Path, n: int, seed: int) -> None:
    """SQuAD v1.1 files (``train-v1.1.json``, ``dev-v1.1.json``): who sat on what."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", n), ("dev", n // 2)):
        paragraphs = []
        for i in range(count):
            who, what = rng.choice(["the cat", "the dog", "john", "peter"], 2, replace=False)
            context = f"{who} sat on the mat . {what} sat on the river ."
            qas = [
                {
                    "id": f"{split}-{i}",
                    "question": "who sat on the mat ?",
                    "answers": [{"text": str(who), "answer_start": 0}],
                }
            ]
            paragraphs.append({"context": context, "qas": qas})
        data = {"version": "1.1", "data": [{"title": "t", "paragraphs": paragraphs}]}
        (folder / f"{split}-v1.1.json").write_text(json.dumps(data))


def _conll(folder: Path, n: int, seed: int) -> None:
    """CoNLL-2003's layout (``eng.train``, ``eng.testa``), IOB1 tags."""
    rng = np.random.default_rng(seed)
    for name, count in (("eng.train", n), ("eng.testa", n // 2)):
        lines = ["-DOCSTART- -X- -X- O", ""]
        for _ in range(count):
            person = str(rng.choice(["john", "peter"]))
            place = str(rng.choice(["london", "paris", "japan"]))
            words = [(person, "I-PER"), ("lives", "O"), ("in", "O"), (place, "I-LOC")]
            lines += [f"{w} NN I-NP {tag}" for w, tag in words] + [""]
        (folder / name).write_text("\n".join(lines) + "\n")


def test_suite_scores_are_fractions_squad_included() -> None:
    """SQuAD's fine-tuning runs log exact match and F1 in percent (the official script's
    scale), the other families fractions: a suite divides SQuAD's by 100 before any mean,
    choice or average, so its table shows every task x100 alike."""
    from bertpipe.finetuning.evaluation.scores import TrialResult, summarise
    from bertpipe.finetuning.evaluation.suite import Suite, SuiteTask
    from bertpipe.finetuning.tasks.squad_scores import squad_metrics

    logged = squad_metrics({"q1": "the cat", "q2": "a dog sat on"}, {"q1": ["cat"], "q2": ["dog"]})
    assert (logged["exact"], logged["f1"]) == (50.0, 75.0)  # percent, as the trials log it
    qa = SuiteTask("qa", {"family": "squad"}, ("f1", "exact"), ("f1", "exact"))
    rte = SuiteTask("rte", {"family": "glue"}, ("accuracy",), ("accuracy",))
    trials = {
        "qa/lr0.001-seed1": TrialResult("qa", 1e-3, 1, {"f1": 3.5, "exact": 2.5, "total": 40}),
        "qa/lr0.001-seed2": TrialResult("qa", 1e-3, 2, {"f1": 4.5, "exact": 1.5, "total": 40}),
        "rte/lr0.001-seed1": TrialResult("rte", 1e-3, 1, {"accuracy": 0.5}),
        "rte/lr0.001-seed2": TrialResult("rte", 1e-3, 2, {"accuracy": 0.7}),
    }
    scores = summarise(Suite("mine", [qa, rte]), [1e-3], [1, 2], trials)
    squad = scores.tasks[0]
    assert squad.scores == pytest.approx([0.03, 0.03]) and squad.mean == pytest.approx(0.03)
    assert squad.metrics["f1"][0] == pytest.approx(0.04)
    assert squad.metrics["exact"][0] == pytest.approx(0.02)
    assert scores.average == pytest.approx((0.03 + 0.6) / 2)
    table = scores.table("mine")
    assert "| qa | 3.0 ± 0.0 | f1 4.0 ± 0.7, exact 2.0 ± 0.7 | 0.001 |" in table
    assert "| rte | 60.0 ± 14.1 | accuracy 60.0 ± 14.1 | 0.001 |" in table


def test_squad_conll_and_yaml_suites(pretrained: Path, glue: Path, tmp_path: Path) -> None:
    """The three suite kinds end to end; SQuAD's F1 and exact match on the x100 scale of the
    others in `evaluate suite=squad`'s table and in `runs compare --suites`; a model_name
    given is the label on the console and in the compare table."""
    from bertpipe.finetuning.evaluation.suite import check_suite, load_suite

    (tmp_path / "squad").mkdir()
    (tmp_path / "conll").mkdir()
    _squad(tmp_path / "squad", 48, 0)
    _conll(tmp_path / "conll", 48, 0)
    squad = check_suite(load_suite("squad", str(tmp_path / "squad")))
    assert [(t.name, t.score, t.metrics) for t in squad.tasks] == [
        ("squad", ("f1",), ("f1", "exact"))
    ]
    conll = check_suite(load_suite("conll", str(tmp_path / "conll")))
    assert conll.tasks[0].task["train"].endswith("eng.train") and conll.tasks[0].score == ("f1",)

    uri = sqlite_uri(tmp_path / "mlflow.db")
    one = ["protocol.learning_rates=[3e-3]", "protocol.seeds=[1]", "protocol.epochs=1"]
    one += ["threads_per_trial=1", f"tracking.uri={uri}", "tracking.experiment=kinds"]
    done = run_cli(
        [
            "evaluate",
            f"model={pretrained}",
            "suite=conll",
            f"data={tmp_path / 'conll'}",
            f"output_root={tmp_path / 'evaluate'}",
            "protocol.max_seq_length=32",
            *one,
        ],
        _env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["output"] == str(tmp_path / "evaluate" / f"conll-{pretrained.name}")
    assert summary["average"] == summary["tasks"]["conll"]["score"]

    # suite=squad (max length 96: SQuAD's 64 question tokens leave 29 for the context; 2
    # epochs at 1e-2: F1 and exact match well above 0, where a 100x would show)
    done = run_cli(
        [
            "evaluate",
            f"model={pretrained}",
            "suite=squad",
            f"data={tmp_path / 'squad'}",
            f"output={tmp_path / 'squad-suite'}",
            *one,
            "protocol.max_seq_length=96",
            "protocol.epochs=2",
            "protocol.learning_rates=[1e-2]",
        ],
        _env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    logged = _trial(tmp_path / "squad-suite", "squad", 1e-2, 1)["metrics"]  # percent
    f1, em = f"{logged['f1']:.1f}", f"{logged['exact']:.1f}"
    assert 1 < logged["exact"] < logged["f1"] <= 100, logged
    row = f"| squad | {f1} ± 0.0 | f1 {f1} ± 0.0, exact {em} ± 0.0 | 0.01 |"
    assert row in done.stdout and row in (tmp_path / "squad-suite" / "table.md").read_text()
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["tasks"]["squad"]["score"] == pytest.approx(logged["f1"] / 100, abs=1e-12)

    suite_yaml = tmp_path / "mine.yaml"
    suite_yaml.write_text(
        f"""name: mine
tasks:
  - {{name: qa, family: squad, folder: {tmp_path / "squad"}, train: train-v1.1.json,
     dev: [dev-v1.1.json], task: {{doc_stride: 16, max_query_length: 8}}, score: [f1, exact]}}
  - {{name: rte, family: glue, folder: {glue / "RTE"}}}
"""
    )
    done = run_cli(
        [
            "evaluate",
            f"model={pretrained}",
            f"suite={suite_yaml}",
            f"output={tmp_path / 'mine'}",
            "protocol.max_seq_length=32",
            "model_name=tiny qa",
            *one,
        ],
        _env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(summary["tasks"]) == ["qa", "rte"] and summary["model_name"] == "tiny qa"
    assert "### mine: tiny qa" in done.stdout  # the label given, on the console too
    trial = _trial(tmp_path / "mine", "qa", 3e-3, 1)
    assert summary["tasks"]["qa"]["score"] == pytest.approx(
        (trial["metrics"]["f1"] + trial["metrics"]["exact"]) / 200, abs=1e-12
    )
    assert summary["average"] == pytest.approx(
        (summary["tasks"]["qa"]["score"] + summary["tasks"]["rte"]["score"]) / 2, abs=1e-12
    )
    assert "Dev scores x100 of the last epoch (of 1), mean ± std over 1 seed" in done.stdout

    compare = ["runs", "compare", "--suites", f"--tracking-uri={uri}", "--experiment=kinds"]
    shown = run_cli([*compare, "--width=0"], _env())
    assert shown.returncode == 0, shown.stderr[-2000:]
    rows = {cells[0]: cells[1:] for cells in map(_cells, shown.stdout.splitlines()) if cells[0]}
    qa = f"{(trial['metrics']['f1'] + trial['metrics']['exact']) / 2:.1f} ± 0.0"
    assert rows["squad"] == ["-", f"{f1} ± 0.0", "-"]  # newest first: mine, squad, conll
    assert rows["qa"] == [qa, "-", "-"]
    payload = json.loads(run_cli([*compare, "--json"], _env()).stdout)
    names = [run["model_name"] for run in payload["runs"]]
    assert names == ["tiny qa", pretrained.name, pretrained.name]
    metrics = payload["runs"][1]["tasks"]["squad"]["metrics"]
    assert metrics["f1"]["mean"] == pytest.approx(logged["f1"] / 100, abs=1e-12)
    assert metrics["exact"]["mean"] == pytest.approx(logged["exact"] / 100, abs=1e-12)


def _cells(line: str) -> list[str]:
    """A text table line's cells (two or more spaces apart)."""
    return re.split(r"\s{2,}", line.strip())


def test_runs_compare_shows_two_models_suites_side_by_side(
    suite: dict[str, Any], pretrained: Path, glue: Path, store: str, tmp_path: Path
) -> None:
    """The whole suite's run (the pre-trained model) and the same architecture from random
    weights on two tasks, as `bertpipe runs compare --suites` shows them: the random-init
    suite labelled as such without a model_name, on the console and in the compare table,
    and in a folder of its own."""
    args = ["evaluate", f"model={pretrained}", "suite=glue", f"data={glue}", "tasks=[sst2,rte]"]
    args += [*PROTOCOL, f"tracking.uri={store}", f"output_root={tmp_path}"]
    done = run_cli([*args, "finetune.random_init=true"], _env())
    assert done.returncode == 0, done.stderr[-3000:]
    random_init = json.loads(done.stdout.strip().splitlines()[-1])
    label = f"{pretrained.name} (random init)"
    assert random_init["model_name"] == label and f"### glue: {label}\n" in done.stdout
    assert random_init["output"] == str(tmp_path / f"glue-{pretrained.name}-random-init")
    assert f"### glue: {pretrained.name}\n" in suite["stdout"]  # the pre-trained, unchanged

    compare = ["runs", "compare", "--suites", f"--tracking-uri={store}", "--experiment=evaluate"]
    shown = run_cli([*compare, "--width=0", f"--plot={tmp_path / 'suites.png'}"], _env())
    assert shown.returncode == 0, shown.stderr[-2000:]
    lines = shown.stdout.splitlines()
    assert _cells(next(line for line in lines if label in line))[1] == label  # newest first
    rows = {line.split()[0]: line for line in lines if line.split() and line.split()[0] in TASKS}
    assert list(rows) == TASKS
    sst2 = random_init["tasks"]["sst2"]
    assert f"{100 * sst2['score']:.1f} ± {100 * sst2['std']:.1f}" in rows["sst2"]
    assert rows["cola"].split()[1] == "-"  # the newest column (random-init) has no CoLA
    assert (tmp_path / "suites.png").stat().st_size > 0
    as_json = run_cli([*compare, "--json"], _env())
    payload = json.loads(as_json.stdout)
    names = [run["model_name"] for run in payload["runs"]]
    assert as_json.returncode == 0 and names[0] == label and pretrained.name in names[1:]


def test_bench_evaluate_reports_seconds_per_task(tmp_path: Path) -> None:
    sqlite_uri(tmp_path / "mlflow.db")  # the bench's store, made from the empty template
    args = ["bench", "evaluate", "--rows", "32", "--learning-rates", "1e-3", "--seeds", "1,2"]
    args += ["--epochs", "1", "--tasks", "rte,cola", "--max-seq-length", "32"]
    done = run_cli([*args, "--threads-per-trial", "1", "--out", str(tmp_path)], _env())
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["trials"] == 4 and figures["threads_per_trial"] == 1
    assert set(figures["tasks"]) == {"rte", "cola"}
    assert all(t["trials"] == 2 and t["seconds_per_trial"] > 0 for t in figures["tasks"].values())
