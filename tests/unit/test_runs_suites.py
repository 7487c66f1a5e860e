"""``bertpipe runs compare --suites``: suite runs side by side, CSV/JSON, plot, errors.

One real MLflow sqlite store per module, filled through MLflow's client with the suite runs
``bertpipe evaluate`` records (stage ``evaluate``, the ``bertpipe.suite*`` and model tags,
``T/score``, ``T/score_std``, ... metrics; see :mod:`bertpipe.finetuning.evaluation`): two
models on GLUE (the smaller one without MRPC) with their nested trials, a FAILED suite run, a
pre-training run; a second experiment with one model on GLUE twice and on SQuAD; a third with
no suite run at all.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

from bertpipe.app.compare import (
    MLFLOW_PARENT_TAG,
    CompareQuery,
    NoMatchingRunsError,
    RunsError,
    SuiteTable,
    compare_suites,
    plot_suites,
    print_suites,
)
from bertpipe.app.compare.suites import (
    TAG_MODEL,
    TAG_MODEL_NAME,
    TAG_PRETRAIN_STEP,
    TAG_SUITE,
    TAG_SUITE_TASKS,
    format_score,
)
from bertpipe.tracking import TAG_PARENT, TAG_STAGE

EXPERIMENT = "suites-test"
MIXED = "suites-mixed"
EMPTY = "no-suites"
T0 = 1_700_000_000_000  # ms
MINUTE = 60_000
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# task -> (score, score_std); fractions as `bertpipe evaluate` logs them
BASE_SCORES = {
    "cola": (0.523, 0.012),
    "sst2": (0.912, 0.004),
    "mrpc": (0.85, 0.01),
    "rte": (0.65, 0.02),
    "average": (0.734, 0.008),
}
SMALL_SCORES = {
    "cola": (0.45, 0.015),
    "sst2": (0.881, 0.006),
    "rte": (0.602, 0.025),
    "average": (0.644, 0.011),
}


@dataclasses.dataclass
class Store:
    """The test store and the ids of the runs in it, by run name."""

    uri: str
    ids: dict[str, str]

    def query(self, experiment: str = EXPERIMENT, **kwargs: Any) -> CompareQuery:
        return CompareQuery(experiment=experiment, tracking_uri=self.uri, **kwargs)

    def argv(self, experiment: str = EXPERIMENT) -> list[str]:
        return [
            "runs",
            "compare",
            "--suites",
            "--tracking-uri",
            self.uri,
            "--experiment",
            experiment,
        ]


def score_metrics(scores: dict[str, tuple[float, float]]) -> dict[str, float]:
    """The metrics of a suite run with these (score, std) per task (and the average)."""
    metrics: dict[str, float] = {}
    for task, (mean, std) in scores.items():
        if task == "average":
            metrics.update({"average": mean, "average_std": std})
        else:
            metrics.update({f"{task}/score": mean, f"{task}/score_std": std})
            metrics[f"{task}/learning_rate"] = 3e-5
    return metrics


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    folder = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiments = {
        name: client.create_experiment(name, artifact_location=(folder / name).as_uri())
        for name in (EXPERIMENT, MIXED, EMPTY)
    }
    ids: dict[str, str] = {}

    def log_run(
        name: str,
        stage: str,
        start_min: int,
        metrics: dict[str, float],
        tags: dict[str, str] | None = None,
        status: str = "FINISHED",
        experiment: str = EXPERIMENT,
    ) -> None:
        start = T0 + start_min * MINUTE
        run = client.create_run(
            experiments[experiment],
            start_time=start,
            tags={TAG_STAGE: stage, **(tags or {})},
            run_name=name,
        )
        entries = [Metric(key, value, start + 1000, 0) for key, value in metrics.items()]
        client.log_batch(run.info.run_id, metrics=entries)
        client.set_terminated(run.info.run_id, status, end_time=start + MINUTE)
        ids[name] = run.info.run_id

    def suite_tags(model_name: str, suite: str, tasks: str) -> dict[str, str]:
        return {
            TAG_SUITE: suite,
            TAG_MODEL: f"runs/export/{model_name}",
            TAG_MODEL_NAME: model_name,
            TAG_SUITE_TASKS: tasks,
        }

    log_run("pretrain-base", "pretrain", 0, {"train/loss": 2.5})
    base = score_metrics(BASE_SCORES)
    base.update({"mrpc/f1": 0.88, "mrpc/f1_std": 0.008, "mrpc/accuracy": 0.82})
    base_tags = suite_tags("bert-base", "glue", "cola,sst2,mrpc,rte")
    base_tags.update({TAG_PARENT: "0" * 32, TAG_PRETRAIN_STEP: "20000"})
    log_run("glue-base", "evaluate", 10, base, base_tags)
    for seed in range(2):  # trials: nested finetune runs, tagged with the suite too
        log_run(
            f"trial-cola-{seed}",
            "finetune",
            11 + seed,
            {"eval/matthews_correlation": 0.5 + seed / 100},
            {MLFLOW_PARENT_TAG: ids["glue-base"], TAG_SUITE: "glue", "bertpipe.trial": "cola"},
        )
    log_run(
        "glue-small",
        "evaluate",
        20,
        score_metrics(SMALL_SCORES),
        suite_tags("bert-small", "glue", "cola,sst2,rte"),
    )
    log_run(
        "glue-tiny",
        "evaluate",
        30,
        {},
        suite_tags("bert-tiny", "glue", "cola,sst2,mrpc,rte"),
        status="FAILED",
    )
    # one model, twice on GLUE (different task lists) and once on SQuAD
    for minute, suite, scores in (
        (0, "glue", {"cola": (0.5, 0.01), "sst2": (0.5, 0.01), "average": (0.5, 0.01)}),
        (5, "squad", {"squad": (0.5, 0.01), "average": (0.5, 0.01)}),
        (9, "glue", {"sst2": (0.9, 0.01), "qnli": (0.8, 0.02), "average": (0.85, 0.01)}),
    ):
        tasks = ",".join(task for task in scores if task != "average")
        log_run(
            f"mixed-{minute}",
            "evaluate",
            minute,
            score_metrics(scores),
            suite_tags("bert", suite, tasks),
            experiment=MIXED,
        )
    log_run("ft-only", "finetune", 0, {"eval/accuracy": 0.8}, experiment=EMPTY)
    return Store(uri=uri, ids=ids)


def cells(line: str) -> list[str]:
    """A table line's cells (columns are two or more spaces apart, a cell holds one)."""
    return re.split(r"\s{2,}", line.strip())


# --------------------------------------------------------------------------- table


@pytest.mark.integration
def test_table_one_row_per_task_one_column_per_run(store: Store) -> None:
    table = compare_suites(store.query())
    assert isinstance(table, SuiteTable)
    # newest first; the FAILED run, the trials and the pre-training run are not suite runs
    assert [run.run_name for run in table.runs] == ["glue-small", "glue-base"]
    assert table.headings == ["bert-small", "bert-base"]
    assert table.suites == ["glue"]
    assert table.tasks == ["cola", "sst2", "mrpc", "rte"]  # suite order, though small lacks mrpc
    assert table.rows == ["cola", "sst2", "mrpc", "rte", "average"]
    assert table.filter == "tags.`bertpipe.stage` = 'evaluate' AND attributes.status = 'FINISHED'"
    assert table.summary().startswith(
        f"2 suite runs (glue) of experiment '{EXPERIMENT}' at {store.uri} (stage evaluate, "
        "status FINISHED), newest first"
    )

    lines = table.render().splitlines()
    assert cells(lines[0]) == ["task", "bert-small", "bert-base"]
    assert set(lines[1]) == {"-", " "}
    assert [cells(line) for line in lines[2:6]] == [
        ["cola", "45.0 ± 1.5", "52.3 ± 1.2"],
        ["sst2", "88.1 ± 0.6", "91.2 ± 0.4"],
        ["mrpc", "-", "85.0 ± 1.0"],
        ["rte", "60.2 ± 2.5", "65.0 ± 2.0"],
    ]
    assert lines[6] == lines[1]  # a rule above the average
    assert cells(lines[7]) == ["average", "64.4 ± 1.1", "73.4 ± 0.8"]
    assert len(lines) == 8
    # numbers right-aligned: the missing cell ends where the others do
    assert lines[4].index("-") + 1 == len(lines[2].split("  52.3")[0])

    # fitted to a width: the spaces around ± go first
    narrow = table.render(width=30).splitlines()
    assert max(len(line) for line in narrow) <= 30
    assert cells(narrow[2]) == ["cola", "45.0±1.5", "52.3±1.2"]

    base = table.runs[1]
    assert base.parent_run_id == "0" * 32 and base.pretrain_step == 20000
    assert base.task_metrics("mrpc") == {"accuracy": (0.82, None), "f1": (0.88, 0.008)}


@pytest.mark.integration
def test_filters_all_states_and_tags(store: Store) -> None:
    everything = compare_suites(store.query(all_states=True))
    assert everything.headings == ["bert-tiny", "bert-small", "bert-base"]
    average = everything.render().splitlines()[-1]
    assert cells(average) == ["average", "-", "64.4 ± 1.1", "73.4 ± 0.8"]
    assert everything.runs[0].status == "FAILED"
    small = compare_suites(store.query(tags={TAG_MODEL_NAME: "bert-small"}))
    assert small.headings == ["bert-small"] and small.tasks == ["cola", "sst2", "rte"]
    # the trials carry the suite tag too, but are not suite runs
    glue = compare_suites(store.query(tags={TAG_SUITE: "glue"}, max_runs=1))
    assert [run.run_name for run in glue.runs] == ["glue-small"]
    # a stage other than evaluate, or a choice of columns, does not apply
    with pytest.raises(RunsError, match="not stage finetune"):
        compare_suites(store.query(stage="finetune"))
    with pytest.raises(RunsError, match="--sort, --ascending/--descending do not apply"):
        compare_suites(store.query(sort="average", ascending=True))


@pytest.mark.integration
def test_same_model_twice_headings_and_suites_union(store: Store) -> None:
    table = compare_suites(store.query(MIXED))
    ids = [store.ids[name][:8] for name in ("mixed-9", "mixed-5", "mixed-0")]
    assert [run.run_id[:8] for run in table.runs] == ids
    assert table.headings == [
        f"bert (glue, {ids[0]})",
        "bert (squad)",
        f"bert (glue, {ids[2]})",
    ]
    assert table.suites == ["glue", "squad"]
    # the newest run's order; cola before sst2 as its run has it; squad after the GLUE tasks
    assert table.rows == ["cola", "sst2", "qnli", "squad", "average"]
    lines = table.render().splitlines()
    assert cells(lines[2]) == ["cola", "-", "-", "50.0 ± 1.0"]
    assert cells(lines[5]) == ["squad", "-", "50.0 ± 1.0", "-"]
    assert cells(lines[-1]) == ["average", "85.0 ± 1.0", "50.0 ± 1.0", "50.0 ± 1.0"]


def test_format_score() -> None:
    assert format_score(0.843, 0.004) == "84.3 ± 0.4"
    assert format_score(-0.0512, 0.0) == "-5.1 ± 0.0"  # MCC can be negative
    assert format_score(0.9, None) == "90.0"
    assert format_score(None, 0.1) == "-"


# --------------------------------------------------------------------------- CLI: JSON, CSV


@pytest.mark.integration
def test_cli_json_and_csv(store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bertpipe.app.cli import main

    out_csv = tmp_path / "out" / "suites.csv"
    assert main([*store.argv(), "--csv", str(out_csv), "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert data["experiment"] == EXPERIMENT and data["csv"] == str(out_csv)
    assert data["plot"] is None
    assert data["suites"] == ["glue"]
    assert data["tasks"] == ["cola", "sst2", "mrpc", "rte"]
    small, base = data["runs"]
    assert small["heading"] == "bert-small" and small["run_id"] == store.ids["glue-small"]
    assert list(small["tasks"]) == ["cola", "sst2", "rte"]
    assert small["average"] == {"mean": 0.644, "std": 0.011}
    assert base["model"] == "runs/export/bert-base" and base["suite"] == "glue"
    assert base["pretrain_step"] == 20000 and base["parent_run_id"] == "0" * 32
    assert base["status"] == "FINISHED" and base["start_time"].startswith("2023-11-14T")
    assert base["tasks"]["mrpc"] == {
        "mean": 0.85,
        "std": 0.01,
        "learning_rate": 3e-5,
        "metrics": {
            "accuracy": {"mean": 0.82, "std": None},
            "f1": {"mean": 0.88, "std": 0.008},
        },
    }

    rows = list(csv.reader(io.StringIO(out_csv.read_text())))
    assert rows[0] == [
        "task",
        "bert-small mean",
        "bert-small std",
        "bert-base mean",
        "bert-base std",
    ]
    assert [row[0] for row in rows[1:]] == ["cola", "sst2", "mrpc", "rte", "average"]
    assert rows[3] == ["mrpc", "", "", "0.85", "0.01"]  # as logged, not x100
    assert [float(v) for v in rows[5][1:]] == [0.644, 0.011, 0.734, 0.008]

    # the text form names the CSV written
    assert main([*store.argv(), "--csv", str(out_csv), "--width", "0"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("2 suite runs (glue) of experiment")
    assert cells(printed[1]) == ["task", "bert-small", "bert-base"]
    assert printed[-1] == f"csv: {out_csv}"


# --------------------------------------------------------------------------- plot


@pytest.mark.integration
def test_plot_grouped_bars(
    store: Store,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from matplotlib.container import BarContainer

    monkeypatch.delenv("COLUMNS", raising=False)  # not a terminal: no width limit
    out = tmp_path / "plots" / "suites.png"
    stream = io.StringIO()
    table = print_suites(store.query(), plot=str(out), stream=stream)
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert [f.name for f in out.parent.iterdir()] == ["suites.png"]  # no temporary left
    printed = stream.getvalue().splitlines()
    assert printed[-1] == f"plot: {out} (4 tasks and the average; 2 suite runs)"
    assert cells(printed[-2]) == ["average", "64.4 ± 1.1", "73.4 ± 0.8"]

    (ax,) = plot_suites(table).axes
    assert [t.get_text() for t in ax.get_xticklabels()] == [*table.tasks, "average"]
    small, base = (c for c in ax.containers if isinstance(c, BarContainer))
    assert (small.get_label(), base.get_label()) == ("bert-small", "bert-base")
    assert [bar.get_height() for bar in small] == pytest.approx([45.0, 88.1, 60.2, 64.4])
    assert [bar.get_height() for bar in base] == pytest.approx([52.3, 91.2, 85.0, 65.0, 73.4])
    # no bar where a run lacks the task (small at mrpc); runs side by side within a task
    centres = [bar.get_x() + bar.get_width() / 2 for bar in small]
    assert centres == pytest.approx([-0.2, 0.8, 2.8, 3.8])
    assert base[0].get_x() + base[0].get_width() / 2 == pytest.approx(0.2)
    # std as error bars, x100
    assert small.errorbar is not None
    segments = small.errorbar.lines[2][0].get_segments()
    assert [s[1][1] - s[0][1] for s in segments] == pytest.approx([3.0, 1.2, 5.0, 2.2])
    legend = ax.get_legend()
    assert legend is not None
    assert [t.get_text() for t in legend.get_texts()] == ["bert-small", "bert-base"]

    from bertpipe.app.cli import main

    cli_out = tmp_path / "cli.png"
    assert main([*store.argv(MIXED), "--plot", str(cli_out)]) == 0
    assert f"plot: {cli_out} (4 tasks and the average; 3 suite runs)" in capsys.readouterr().out
    assert cli_out.read_bytes().startswith(PNG_MAGIC)


# --------------------------------------------------------------------------- errors


@pytest.mark.integration
def test_no_suite_runs_is_one_line_error(store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    from bertpipe.app.cli import main

    with pytest.raises(NoMatchingRunsError, match="match stage evaluate, status FINISHED"):
        compare_suites(store.query(EMPTY))
    assert main(store.argv(EMPTY)) == 2
    err = capsys.readouterr().err
    assert err == (
        f"bertpipe: error: no runs of experiment '{EMPTY}' match stage evaluate, status "
        "FINISHED (MLflow filter: tags.`bertpipe.stage` = 'evaluate' AND attributes.status = "
        "'FINISHED'); `bertpipe evaluate` records suite runs; --all-states includes "
        "unfinished and failed runs\n"
    )
    assert main([*store.argv(), "--tag", f"{TAG_MODEL_NAME}=bert-huge"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bertpipe: error: no runs of experiment") and err.count("\n") == 1
    assert f"tag {TAG_MODEL_NAME}=bert-huge" in err
    for extra, message in (
        (["--sort", "average"], "--sort does not apply"),
        (["--plot-metric", "average"], "--plot-metric does not apply"),
        (["--stage", "pretrain"], "not stage pretrain"),
    ):
        assert main([*store.argv(), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("bertpipe: error: --suites") and err.count("\n") == 1
        assert message in err
