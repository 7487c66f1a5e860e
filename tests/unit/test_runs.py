"""``bertpipe runs compare``: table, order, filters, lineage, best marker, CSV/JSON, plot, errors.

One real MLflow sqlite store per module (schema creation takes seconds), filled with runs
logged here through MLflow's client with fixed start and end times: a pre-training run with
a ``train/loss`` history, fine-tuning runs tagged with it as parent (one of them FAILED), and
a sweep whose three trials are nested runs (lineage tag: the pre-training run, MLflow parent:
the sweep, as ``bertpipe.tracking.start_run(parent_run_id=..., nested_in=...)`` logs them), and
a fine-tuning run that starts from another fine-tuned model. A second experiment holds a sweep
trial with only MLflow's parent tag, whose lineage crosses into the first experiment.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import re
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bertpipe.app.compare import (
    MLFLOW_PARENT_TAG,
    BadTagError,
    CompareQuery,
    Comparison,
    NoMatchingRunsError,
    TrackingUnreachableError,
    UnknownExperimentError,
    UnknownMetricError,
    UnknownRunError,
    compare_runs,
    lower_is_better,
    parse_tags,
    plot_comparison,
)
from bertpipe.formatting import format_duration, format_number
from bertpipe.tracking import TAG_DATA_CHECKSUM, TAG_PARENT, TAG_STAGE

EXPERIMENT = "bertpipe-test"
T0 = 1_700_000_000_000  # ms
MINUTE = 60_000
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclasses.dataclass
class Store:
    """The test store and the ids of the runs in it, by run name."""

    uri: str
    ids: dict[str, str]

    def query(self, **kwargs: Any) -> CompareQuery:
        return CompareQuery(experiment=EXPERIMENT, tracking_uri=self.uri, **kwargs)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Store:
    return build_store(tmp_path_factory.mktemp("mlflow"))


def build_store(folder: Path) -> Store:
    """Log the test runs into a new sqlite store in ``folder``."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    uri = f"sqlite:///{folder / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment_id = client.create_experiment(
        EXPERIMENT, artifact_location=(folder / "artifacts").as_uri()
    )
    other_id = client.create_experiment(
        "other-project", artifact_location=(folder / "other").as_uri()
    )
    ids: dict[str, str] = {}

    def log_run(
        name: str,
        stage: str,
        start_min: int,
        minutes: float,
        metrics: dict[str, list[tuple[int, float]]],
        params: dict[str, str] | None = None,
        tags: dict[str, str] | None = None,
        parent: str | None = None,
        nested_in: str | None = None,
        status: str = "FINISHED",
        experiment: str = experiment_id,
    ) -> None:
        all_tags = {TAG_STAGE: stage, **(tags or {})}
        if parent:
            all_tags[TAG_PARENT] = ids[parent]
        if nested_in:
            all_tags[MLFLOW_PARENT_TAG] = ids[nested_in]
        start = T0 + start_min * MINUTE
        run = client.create_run(experiment, start_time=start, tags=all_tags, run_name=name)
        entries = [
            Metric(key, value, start + 1000 * (i + 1), step)
            for key, points in metrics.items()
            for i, (step, value) in enumerate(points)
        ]
        client.log_batch(
            run.info.run_id,
            metrics=entries,
            params=[Param(k, v) for k, v in (params or {}).items()],
        )
        client.set_terminated(run.info.run_id, status, end_time=start + int(minutes * MINUTE))
        ids[name] = run.info.run_id

    log_run(
        "pretrain-base",
        "pretrain",
        0,
        90,
        {
            "train/loss": [(step, 10.0 - 0.7 * step) for step in range(10)],
            "eval/loss": [(4, 6.0), (9, 4.25)],
            "eval/mlm_accuracy": [(9, 0.31)],
        },
        params={"lr": "0.0001"},
        tags={f"{TAG_DATA_CHECKSUM}.phase1": "abc123"},
    )
    ft_loss = [(0, 0.7), (25, 0.5), (50, 0.4)]
    log_run(
        "ft-sst2",
        "finetune",
        100,
        3,
        {"eval/accuracy": [(50, 0.85)], "train/loss": ft_loss},
        params={"task": "sst2", "learning_rate": "2e-05"},
        tags={"task": "sst2"},
        parent="pretrain-base",
    )
    log_run(
        "ft-mrpc",
        "finetune",
        110,
        2.5,
        {"eval/accuracy": [(40, 0.74)], "eval/f1": [(40, 0.82)], "train/loss": ft_loss},
        params={"task": "mrpc"},
        tags={"task": "mrpc"},
        parent="pretrain-base",
    )
    log_run("ft-broken", "finetune", 115, 0.1, {}, parent="pretrain-base", status="FAILED")
    sweep_metrics = {
        "trial/accuracy": [(0, 0.70), (1, 0.88), (2, 0.79)],
        "best/accuracy": [(0, 0.88)],
    }
    log_run("sweep-lr", "sweep", 120, 10, sweep_metrics, parent="pretrain-base")
    for i, (accuracy, lr) in enumerate([(0.70, "1e-05"), (0.88, "3e-05"), (0.79, "5e-05")]):
        log_run(
            f"trial-{i}",
            "finetune",
            121 + 3 * i,
            2,
            {"eval/accuracy": [(10, accuracy - 0.1), (20, accuracy)]},
            params={"learning_rate": lr},
            parent="pretrain-base",
            nested_in="sweep-lr",
        )
    # intermediate-task transfer: fine-tuned from the SST-2 model
    log_run(
        "ft-rte",
        "finetune",
        130,
        1.5,
        {"eval/accuracy": [(30, 0.66)]},
        params={"task": "rte"},
        parent="ft-sst2",
    )
    log_run("sweep-old", "sweep", 140, 5, {}, parent="pretrain-base", experiment=other_id)
    log_run(
        "old-trial",
        "finetune",
        141,
        1,
        {"eval/accuracy": [(5, 0.5)]},
        nested_in="sweep-old",
        experiment=other_id,
    )
    return Store(uri=uri, ids=ids)


def names(comparison: Comparison) -> list[str]:
    return [row.name for row in comparison.rows]


# --------------------------------------------------------------------------- table


@pytest.mark.integration
def test_finetune_runs_sorted_with_best_marker_and_lineage(store: Store) -> None:
    comparison = compare_runs(store.query(stage="finetune", sort="eval/accuracy"))
    assert names(comparison) == ["trial-1", "ft-sst2", "trial-2", "ft-mrpc", "trial-0", "ft-rte"]
    assert [row.best for row in comparison.rows] == [True] + [False] * 5
    assert not comparison.ascending
    # every eval/* metric present, by default
    assert comparison.metrics == ["eval/accuracy", "eval/f1"]
    by_name = {row.name: row for row in comparison.rows}
    assert by_name["ft-sst2"].parent_name == "pretrain-base"
    assert by_name["ft-sst2"].parent_run_id == store.ids["pretrain-base"]
    assert by_name["trial-0"].parent_name == "pretrain-base"
    assert by_name["trial-0"].nested_in_name == "sweep-lr"
    assert by_name["ft-rte"].parent_name == "ft-sst2"
    assert by_name["ft-rte"].pretrain_run_id == store.ids["pretrain-base"]
    assert by_name["ft-rte"].data_checksums == {"phase1": "abc123"}  # inherited, two up
    assert by_name["ft-sst2"].duration_s == pytest.approx(180.0)

    lines = comparison.render().splitlines()
    header = lines[0].split()
    assert header == [
        "run",
        "id",
        "stage",
        "status",
        "started",
        "duration",
        "eval/accuracy",
        "eval/f1",
        "parent",
        "sweep",
        "pretrain",
    ]
    rows = [line.split() for line in lines[2:]]
    assert rows[0][:3] == ["best", "trial-1", store.ids["trial-1"][:8]]
    assert rows[0][-5:] == ["0.88", "-", "pretrain-base", "sweep-lr", "pretrain-base"]
    assert rows[1][0] == "ft-sst2"  # no marker
    assert rows[1][-6:] == ["3m00s", "0.85", "-", "pretrain-base", "-", "pretrain-base"]
    assert rows[3][-5:] == ["0.74", "0.82", "pretrain-base", "-", "pretrain-base"]
    assert rows[5][-5:] == ["0.66", "-", "ft-sst2", "-", "pretrain-base"]
    assert "best" not in "".join(lines[3:])


@pytest.mark.integration
def test_sort_direction_and_max_runs(store: Store) -> None:
    ascending = compare_runs(store.query(stage="finetune", sort="eval/accuracy", ascending=True))
    assert names(ascending) == ["ft-rte", "trial-0", "ft-mrpc", "trial-2", "ft-sst2", "trial-1"]
    assert ascending.best is not None and ascending.best.name == "ft-rte"
    top2 = compare_runs(store.query(stage="finetune", sort="eval/accuracy", max_runs=2))
    assert names(top2) == ["trial-1", "ft-sst2"]
    # a loss sorts smallest first unless told otherwise
    losses = compare_runs(store.query(tags={"task": "mrpc"}, sort="train/loss"))
    assert losses.ascending
    newest = compare_runs(store.query(stage="finetune"))
    assert names(newest) == ["ft-rte", "trial-2", "trial-1", "trial-0", "ft-mrpc", "ft-sst2"]
    assert newest.best is None
    assert newest.render().startswith("run ")  # no marker column


@pytest.mark.integration
def test_filters_by_tag_and_state(store: Store) -> None:
    parent = {TAG_PARENT: store.ids["pretrain-base"]}
    finished = compare_runs(store.query(stage="finetune", tags=parent))
    assert names(finished) == ["trial-2", "trial-1", "trial-0", "ft-mrpc", "ft-sst2"]
    everything = compare_runs(store.query(stage="finetune", tags=parent, all_states=True))
    assert names(everything) == ["trial-2", "trial-1", "trial-0", "ft-broken", "ft-mrpc", "ft-sst2"]
    broken = everything.rows[3]
    assert broken.status == "FAILED" and broken.metrics == {}
    row = everything.render().splitlines()[5].split()
    assert row[:4] == ["ft-broken", broken.short_id, "finetune", "FAILED"]
    assert row[-4:] == ["-", "-", "pretrain-base", "-"]  # no metrics, no sweep
    assert names(compare_runs(store.query(tags={"task": "sst2"}))) == ["ft-sst2"]
    from_sst2 = compare_runs(store.query(tags={TAG_PARENT: store.ids["ft-sst2"]}))
    assert names(from_sst2) == ["ft-rte"]


@pytest.mark.integration
def test_children_of_a_sweep(store: Store) -> None:
    by_name = compare_runs(store.query(children_of="sweep-lr", sort="eval/accuracy"))
    by_id = compare_runs(store.query(children_of=store.ids["sweep-lr"], sort="eval/accuracy"))
    assert names(by_name) == names(by_id) == ["trial-1", "trial-2", "trial-0"]
    assert [r.best for r in by_id.rows] == [True, False, False]
    assert by_id.rows[0].metrics["eval/accuracy"] == pytest.approx(0.88)  # the final value
    best_line = by_id.render().splitlines()[2].split()
    assert best_line[:2] == ["best", "trial-1"]
    assert best_line[-2:] == ["pretrain-base", "sweep-lr"]
    sweep = {MLFLOW_PARENT_TAG: store.ids["sweep-lr"]}
    same = compare_runs(store.query(stage="finetune", tags=sweep, params=["learn*"]))
    assert names(same) == ["trial-2", "trial-1", "trial-0"]
    assert same.params == ["learning_rate"]
    assert [r.params["learning_rate"] for r in same.rows] == ["5e-05", "3e-05", "1e-05"]


@pytest.mark.integration
def test_parent_from_mlflow_nesting_across_experiments(store: Store) -> None:
    comparison = compare_runs(
        CompareQuery(experiment="other-project", tracking_uri=store.uri, stage="finetune")
    )
    (row,) = comparison.rows
    assert (row.parent_name, row.nested_in_name) == ("sweep-old", "sweep-old")
    assert row.pretrain_name == "pretrain-base"  # looked up in the other experiment
    header = comparison.render().splitlines()[0].split()
    assert header[-2:] == ["parent", "pretrain"]  # no sweep column: same as the parent


@pytest.mark.integration
def test_pretrain_defaults_and_missing_values(store: Store) -> None:
    comparison = compare_runs(store.query(stage="pretrain", params=["lr", "no_such_param"]))
    assert comparison.metrics == [
        "train/loss",
        "eval/loss",
        "eval/mlm_accuracy",
        "eval/nsp_accuracy",
    ]
    row = comparison.render().splitlines()[2].split()
    # lr, no_such_param, train/loss (last value), eval/loss, mlm, nsp, parent
    assert row[-7:] == ["0.0001", "-", "3.7", "4.25", "0.31", "-", "-"]
    sweep = compare_runs(store.query(stage="sweep"))
    assert sweep.metrics == ["best/accuracy"]
    mixed = compare_runs(store.query())
    assert mixed.metrics[:2] == ["eval/accuracy", "eval/f1"]  # the newest run's stage first
    assert set(mixed.metrics) == {
        "best/accuracy",
        "eval/accuracy",
        "eval/f1",
        "train/loss",
        "eval/loss",
        "eval/mlm_accuracy",
        "eval/nsp_accuracy",
    }


@pytest.mark.integration
def test_table_fits_the_width(store: Store) -> None:
    comparison = compare_runs(store.query(stage="finetune", sort="eval/accuracy"))
    full = comparison.render().splitlines()
    assert max(len(line) for line in full) > 110
    assert full[0].split()[:3] == ["run", "id", "stage"]

    def fitted(width: int) -> list[str]:
        lines = comparison.render(width=width).splitlines()
        assert max(len(line) for line in lines) <= width
        assert lines[-6].split()[2] == store.ids["trial-1"][:8]  # run ids are never cut
        return lines

    # constant columns (stage, status) go first, then the year of the start time
    wide = fitted(110)
    assert wide[0].split() == [
        "run",
        "id",
        "started",
        "duration",
        "eval/accuracy",
        "eval/f1",
        "parent",
        "sweep",
        "pretrain",
    ]
    assert "…" not in "".join(wide)
    assert re.fullmatch(r"\d\d-\d\d \d\d:\d\d", " ".join(wide[2].split()[3:5]))
    # then metric names take two header lines and names are cut
    medium = fitted(100)
    assert medium[0].split() == ["eval/", "eval/"]
    assert medium[1].split()[4:6] == ["accuracy", "f1"]
    assert medium[3].split()[-5:] == ["0.88", "-", "pretrain-b…", "sweep-lr", "pretrain-ba…"]
    # then the start time goes, then any column is cut, the widest first
    narrow = fitted(70)
    assert "started" not in narrow[1] and "…" in narrow[1]
    assert [line.split()[-5] for line in narrow[3:]] == [
        "0.88",
        "0.85",
        "0.79",
        "0.74",
        "0.7",
        "0.66",
    ]


# --------------------------------------------------------------------------- CSV, JSON, CLI


@pytest.mark.integration
def test_cli_json_and_csv(store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bertpipe.app.cli import main

    out_csv = tmp_path / "out" / "runs.csv"
    argv = ["runs", "compare", "--tracking-uri", store.uri, "--experiment", EXPERIMENT]
    argv += ["--children-of", "sweep-lr", "--sort", "eval/accuracy", "--param", "learning_rate"]
    assert main([*argv, "--csv", str(out_csv), "--json"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    data = json.loads(last)
    assert [r["run_name"] for r in data["runs"]] == ["trial-1", "trial-2", "trial-0"]
    assert data["best_run_id"] == store.ids["trial-1"]
    assert data["runs"][0]["best"] is True
    assert data["runs"][0]["parent_run_name"] == "pretrain-base"
    assert data["runs"][0]["nested_in_run_name"] == "sweep-lr"
    assert data["runs"][0]["pretrain_run_id"] == store.ids["pretrain-base"]
    assert data["runs"][0]["data_manifest_sha256"] == {"phase1": "abc123"}
    assert data["runs"][0]["metrics"] == {"eval/accuracy": pytest.approx(0.88)}
    assert data["runs"][0]["params"] == {"learning_rate": "3e-05"}
    assert data["csv"] == str(out_csv)

    rows = list(csv.DictReader(io.StringIO(out_csv.read_text())))
    assert [r["run_name"] for r in rows] == ["trial-1", "trial-2", "trial-0"]
    assert [r["best"] for r in rows] == ["best", "", ""]
    assert rows[0]["run_id"] == store.ids["trial-1"]
    assert float(rows[0]["metrics.eval/accuracy"]) == pytest.approx(0.88)
    assert rows[0]["params.learning_rate"] == "3e-05"
    assert rows[0]["parent_run_name"] == "pretrain-base"
    assert rows[0]["nested_in_run_id"] == store.ids["sweep-lr"]
    assert rows[0]["duration_s"] == "120.000"

    # missing values are empty CSV cells
    assert main([*argv[:6], "--stage", "finetune", "--csv", str(out_csv)]) == 0
    printed = capsys.readouterr().out
    assert f"csv: {out_csv}" in printed
    assert "6 runs of experiment 'bertpipe-test'" in printed
    by_name = {r["run_name"]: r for r in csv.DictReader(io.StringIO(out_csv.read_text()))}
    assert by_name["ft-sst2"]["metrics.eval/f1"] == ""
    assert by_name["ft-mrpc"]["metrics.eval/f1"] == "0.82"


# --------------------------------------------------------------------------- plot


@pytest.mark.integration
def test_plot_one_line_per_run(
    store: Store,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    comparison = compare_runs(store.query(stage="finetune", sort="eval/accuracy"))
    out = tmp_path / "plots" / "cmp.png"
    fig = plot_comparison(comparison, str(out), ["train/loss", "eval/accuracy"])
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    assert [f.name for f in out.parent.iterdir()] == ["cmp.png"]  # no temporary left behind
    loss_ax, acc_ax = fig.axes
    assert loss_ax.get_title() == "train/loss"
    loss_lines = loss_ax.get_lines()
    assert len(loss_lines) == 2  # only the two runs that logged train/loss
    assert {line.get_label() for line in loss_lines} == {"ft-sst2", "ft-mrpc"}
    assert np.asarray(loss_lines[0].get_xdata()).tolist() == [0, 25, 50]  # full history, by step
    legend = loss_ax.get_legend()
    assert legend is not None
    assert [t.get_text() for t in legend.get_texts()] == ["ft-sst2", "ft-mrpc"]
    # a run keeps its colour across subplots
    assert loss_lines[0].get_color() == acc_ax.get_lines()[1].get_color()
    acc_lines = acc_ax.get_lines()
    assert len(acc_lines) == 6
    assert acc_lines[0].get_label() == "trial-1 (best)"
    assert np.asarray(acc_lines[0].get_ydata()).tolist() == pytest.approx([0.78, 0.88])

    # default plot metric: the first shown metric; the demo's call (not on a terminal: no
    # width limit, unless $COLUMNS says one, as pytest-xdist's workers have it)
    from bertpipe.app.compare import print_comparison

    monkeypatch.delenv("COLUMNS", raising=False)

    stream = io.StringIO()
    demo_png = tmp_path / "demo.png"
    pre = print_comparison(store.query(stage="pretrain"), plot=str(demo_png), stream=stream)
    (ax,) = plot_comparison(pre).axes
    assert ax.get_title() == "train/loss"
    assert np.asarray(ax.get_lines()[0].get_xdata()).tolist() == list(range(10))
    printed = stream.getvalue().splitlines()
    assert printed[0].startswith("1 run of experiment 'bertpipe-test'")
    assert printed[1].split()[0] == "run" and printed[3].split()[0] == "pretrain-base"
    assert printed[-1] == f"plot: {demo_png} (train/loss; 1 run)"
    assert demo_png.read_bytes().startswith(PNG_MAGIC)

    from bertpipe.app.cli import main

    cli_out = tmp_path / "cli.png"
    argv = ["runs", "compare", "--tracking-uri", store.uri, "--experiment", EXPERIMENT]
    assert main([*argv, "--children-of", "sweep-lr", "--plot", str(cli_out)]) == 0
    assert f"plot: {cli_out} (eval/accuracy; 3 runs)" in capsys.readouterr().out
    assert cli_out.read_bytes().startswith(PNG_MAGIC)


# --------------------------------------------------------------------------- errors


@pytest.mark.integration
def test_errors(store: Store, tmp_path: Path) -> None:
    with pytest.raises(UnknownExperimentError) as unknown:
        compare_runs(CompareQuery(experiment="nope", tracking_uri=store.uri))
    message = str(unknown.value)
    assert "no experiment 'nope'" in message
    assert f"{EXPERIMENT}, " in message and "other-project" in message

    with pytest.raises(NoMatchingRunsError, match="match stage tokenizer, status FINISHED"):
        compare_runs(store.query(stage="tokenizer"))
    with pytest.raises(NoMatchingRunsError, match=r"tag task=qnli.*--all-states"):
        compare_runs(store.query(tags={"task": "qnli"}))
    with pytest.raises(UnknownRunError, match="no run with id or name 'sweep-x'"):
        compare_runs(store.query(children_of="sweep-x"))
    with pytest.raises(UnknownRunError, match="no run with id"):
        compare_runs(store.query(children_of="0" * 32))
    with pytest.raises(UnknownMetricError, match=r"cannot sort by eval/bleu.*eval/accuracy"):
        compare_runs(store.query(sort="eval/bleu"))
    comparison = compare_runs(store.query(stage="pretrain"))
    with pytest.raises(UnknownMetricError, match="cannot plot eval/f1"):
        plot_comparison(comparison, str(tmp_path / "x.png"), ["eval/f1"])
    assert not (tmp_path / "x.png").exists()

    missing = f"sqlite:///{tmp_path / 'absent.db'}"
    with pytest.raises(TrackingUnreachableError, match="no MLflow store at"):
        compare_runs(CompareQuery(tracking_uri=missing))
    assert not (tmp_path / "absent.db").exists()  # never created by looking
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(TrackingUnreachableError, match="cannot reach the MLflow tracking server"):
        compare_runs(CompareQuery(tracking_uri=f"http://127.0.0.1:{port}"))


@pytest.mark.integration
def test_cli_errors_are_one_line(store: Store, capsys: pytest.CaptureFixture[str]) -> None:
    from bertpipe.app.cli import main

    base = ["runs", "compare", "--tracking-uri", store.uri]
    assert main([*base, "--experiment", EXPERIMENT, "--tag", "novalue"]) == 2
    err = capsys.readouterr().err
    assert err == "bertpipe: error: bad --tag 'novalue': it must look like KEY=VALUE\n"
    assert main([*base, "--experiment", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bertpipe: error: no experiment 'nope'") and err.count("\n") == 1


# --------------------------------------------------------------------------- pure helpers


def test_parse_tags() -> None:
    assert parse_tags(["a=b", "bertpipe.parent_run_id=x=y", "empty="]) == {
        "a": "b",
        "bertpipe.parent_run_id": "x=y",
        "empty": "",
    }
    for bad in ["novalue", "=v", "a`b=c"]:
        with pytest.raises(BadTagError, match="bad --tag"):
            parse_tags([bad])


def test_filter_string_quotes() -> None:
    query = CompareQuery(stage="finetune", tags={"note": "it's"}, all_states=True)
    assert query.filter_string() == (
        "tags.`bertpipe.stage` = 'finetune' AND tags.`note` = \"it's\""
    )
    assert CompareQuery().filter_string("r1") == (
        "tags.`mlflow.parentRunId` = 'r1' AND attributes.status = 'FINISHED'"
    )


def test_formatting() -> None:
    assert format_duration(None) == "-"
    assert format_duration(0.42) == "0.4s"
    assert format_duration(42) == "42s"
    assert format_duration(185) == "3m05s"
    assert format_duration(7620) == "2h07m"
    assert format_duration(97200) == "1d03h"
    assert format_number(0.8567) == "0.8567"
    assert format_number(7.12345) == "7.123"
    assert format_number(3.0) == "3"
    assert format_number(12345.67) == "12345.7"
    assert format_number(2e-05) == "2.000e-05"
    assert format_number(float("nan")) == "nan"
    assert lower_is_better("eval/loss") and lower_is_better("train/mlm_loss")
    assert lower_is_better("eval/perplexity")
    assert not lower_is_better("eval/accuracy") and not lower_is_better("eval/f1")
