"""MLflow's UI as its users see it: a headless Chromium opens an experiment's runs table on a
``mlflow server`` and this module reads what the table shows.

Chromium is driven by its command line (``--headless --dump-dom --screenshot``): one process
per page, which loads the page, lets its scripts run for ``--virtual-time-budget``
milliseconds of page time (network fetches pause that clock, so the React app's requests to
the server finish inside it), prints the rendered DOM and writes a screenshot. A page that is
not ready yet (the app still loading, or the Models column, which the UI fills from a second
request, still empty) is opened again with twice the budget, a bounded number of times. The
browser runs in its own process group, killed whatever happens, with a fresh profile, and
reaches nothing but 127.0.0.1 (every other host goes to a dead proxy and resolves to nothing)
unless the caller allows it (``infra/scripts/mlflow-ui-check`` against a remote server).

What MLflow 3.17's UI shows, found by experiment (``docs/tracking.md``):

* the route is ``#/experiments/<id>/runs``; the experiment page opens on the GenAI
  "Overview" unless the *workflow type* is ``machine_learning`` ("Model training" in the
  sidebar's switch: the ``workflowType`` query parameter, else the browser's local storage,
  default ``genai``). The ``mlflow.experimentKind`` experiment tag is not read for this in
  3.17 (its feature flag makes the kind follow the switch), so the URL carries
  ``?workflowType=machine_learning``;
* the runs table is an ag-grid: a row per run (``role=row``, ``row-id`` = the run id, split
  between the pinned-left and the centre containers), a cell per column (``role=gridcell``,
  ``col-id`` = ``attributes.`Run Name```, ``attributes.`Dataset```, ``attributes.`Models```);
  an empty cell reads ``-``;
* Dataset: the run's dataset inputs (``run.inputs.dataset_inputs``), one button
  (``data-testid=open-dataset-drawer``) "name (digest)" each, with its context tag;
* Models: the logged models of the experiment whose ``source_run_id`` is the run (a link to
  ``#/experiments/<id>/models/<model id>`` each, "+N" past the first) and the legacy
  ``mlflow.log-model.history`` tag's models; a run's *model inputs*, and a model output whose
  source is another run, are not shown there (only on the run's page, "Logged models").
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

CHROMIUM_ENV = "BERTPIPE_CHROMIUM"
CHROMIUM_NAMES = (
    "chromium-headless-shell",
    "chrome-headless-shell",
    "headless_shell",
    "chromium",
    "chromium-browser",
    "google-chrome",
    "google-chrome-stable",
)
WINDOW = (2400, 1400)
"""Wide enough for every column up to Models, and the assistant's side panel, unvirtualised."""

COL_NAME = "attributes.`Run Name`"
COL_DATASET = "attributes.`Dataset`"
COL_MODELS = "attributes.`Models`"
RUNS_HEADINGS = ("Runs", "Training runs")
"""The runs page's title: "Runs" with the Model training workflow, "Training runs" with GenAI."""


def find_chromium() -> str | None:
    """``$BERTPIPE_CHROMIUM`` if set (a path or a name on PATH), else the first of
    :data:`CHROMIUM_NAMES` on PATH; None when there is none."""
    wanted = os.environ.get(CHROMIUM_ENV)
    if wanted:
        return shutil.which(wanted)
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


def runs_url(tracking_uri: str, experiment_id: str) -> str:
    """The experiment's runs table, with the Model training workflow (not the GenAI one)."""
    return (
        f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs"
        "?workflowType=machine_learning"
    )


@dataclasses.dataclass
class Rendered:
    """One page load: the DOM after the budget, the screenshot, how long Chromium ran."""

    url: str
    dom: str
    screenshot: Path | None
    seconds: float
    budget_ms: int
    stderr_tail: str


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL to the browser's whole process group (its renderer, GPU and zygote
    processes), reaped; nothing if it is already gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def render(
    url: str,
    screenshot: Path | None,
    *,
    chromium: str | None = None,
    budget_ms: int = 15_000,
    window: tuple[int, int] = WINDOW,
    timeout: float = 90.0,
    loopback_only: bool = True,
) -> Rendered:
    """Load ``url`` in a headless Chromium for ``budget_ms`` ms of page time; its DOM and a
    screenshot at ``screenshot`` (a PNG). Raises RuntimeError when there is no Chromium, it
    fails or runs past ``timeout`` seconds; the browser is killed in every case."""
    binary = chromium or find_chromium()
    if not binary:
        raise RuntimeError(f"no Chromium: none of {', '.join(CHROMIUM_NAMES)} on PATH")
    with tempfile.TemporaryDirectory(prefix="bertpipe-chromium-") as profile:
        args = [
            binary,
            "--headless",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-sync",
            "--disable-default-apps",
            "--disable-background-networking",
            "--disable-component-update",
            "--mute-audio",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size={window[0]},{window[1]}",
            f"--virtual-time-budget={budget_ms}",
            "--dump-dom",
        ]
        if loopback_only:
            # loopback is never proxied: everything else goes to a closed port on 127.0.0.1,
            # and no host name but the loopback ones resolves
            args += [
                "--proxy-server=http://127.0.0.1:9",
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
            ]
        if os.geteuid() == 0:
            args.append("--no-sandbox")  # Chromium's sandbox refuses to run as root
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            screenshot.unlink(missing_ok=True)
            args.append(f"--screenshot={screenshot}")
        args.append(url)
        started = time.monotonic()
        proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            cwd=profile,
            start_new_session=True,  # its own process group: _end_group ends all of it
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end_group(proc)
            raise RuntimeError(f"Chromium ran past {timeout:.0f} s on {url}") from None
        finally:
            _end_group(proc)
        seconds = time.monotonic() - started
    stderr_tail = err.decode(errors="replace")[-2000:]
    dom = out.decode(errors="replace")
    if proc.returncode != 0 or not dom.strip():
        raise RuntimeError(f"Chromium exited {proc.returncode} on {url}: {stderr_tail}")
    shot = screenshot if screenshot is not None and screenshot.exists() else None
    return Rendered(url, dom, shot, seconds, budget_ms, stderr_tail)


# ---- reading the DOM -------------------------------------------------------------------

_VOID = frozenset(
    {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param"}
    | {"source", "track", "wbr"}
)


@dataclasses.dataclass
class _Node:
    tag: str
    attrs: dict[str, str]
    children: list[_Node | str] = dataclasses.field(default_factory=list)

    def text(self) -> str:
        parts: list[str] = []
        for child in self.children:
            if isinstance(child, str):
                parts.append(child)
            elif child.tag not in ("script", "style", "svg", "input"):
                parts.append(child.text())
        return " ".join(" ".join(parts).split())

    def walk(self) -> Iterable[_Node]:
        yield self
        for child in self.children:
            if isinstance(child, _Node):
                yield from child.walk()

    def find(self, pred: Callable[[_Node], bool]) -> list[_Node]:
        return [n for n in self.walk() if pred(n)]


class _TreeBuilder(HTMLParser):
    """Chromium's serialised DOM as a tree (it closes every non-void element it opens)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = _Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = _Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in _VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(_Node(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)


def _parse(dom: str) -> _Node:
    builder = _TreeBuilder()
    builder.feed(dom)
    builder.close()
    return builder.root


@dataclasses.dataclass
class RunRow:
    """One run as a table (or the client) shows it: the run id, its name, what its Dataset
    and Models cells list (empty: the cell reads ``-``)."""

    run_id: str
    name: str = ""
    datasets: list[str] = dataclasses.field(default_factory=list)
    models: list[str] = dataclasses.field(default_factory=list)
    dataset_text: str = ""
    models_text: str = ""
    model_inputs: list[str] = dataclasses.field(default_factory=list)
    """Client only: the run's model inputs (ids), which the table does not show."""

    def line(self) -> str:
        return (
            f"{self.name or '?'} ({self.run_id[:8]}): "
            f"Dataset: {', '.join(self.datasets) or '-'} | Models: {', '.join(self.models) or '-'}"
        )


@dataclasses.dataclass
class RunsPage:
    """What the experiment page showed: its title(s), the table's columns and rows."""

    rendered: Rendered | None
    headings: list[str]
    columns: list[str]
    rows: dict[str, RunRow]
    has_grid: bool

    @property
    def heading(self) -> str:
        return self.headings[0] if self.headings else ""


def _overflow(cell: _Node) -> list[str]:
    """A cell's "+N" tag (more entries than it has room for)."""
    return [
        n.text()
        for n in cell.find(lambda n: n.attrs.get("role") == "status")
        if n.text().startswith("+")
    ]


def read_runs_page(dom: str, rendered: Rendered | None = None) -> RunsPage:
    """The runs table in ``dom``: each ``role=row`` element with a ``row-id`` (the run id),
    its cells merged across the grid's containers, read by ``col-id``."""
    root = _parse(dom)
    headings = [n.text() for n in root.find(lambda n: n.tag in ("h1", "h2"))]
    grids = root.find(lambda n: n.attrs.get("role") in ("grid", "treegrid"))
    columns: list[str] = []
    rows: dict[str, RunRow] = {}
    for grid in grids:
        for header in grid.find(lambda n: n.attrs.get("role") == "columnheader"):
            col = header.attrs.get("col-id", "")
            if col and col not in columns:
                columns.append(col)
        for row in grid.find(lambda n: n.attrs.get("role") == "row" and "row-id" in n.attrs):
            run = rows.setdefault(row.attrs["row-id"], RunRow(row.attrs["row-id"]))
            for cell in row.find(lambda n: n.attrs.get("role") == "gridcell"):
                col = cell.attrs.get("col-id")
                if col == COL_NAME:
                    links = cell.find(
                        lambda n: n.tag == "a" and "/runs/" in n.attrs.get("href", "")
                    )
                    run.name = links[0].text() if links else cell.text()
                elif col == COL_DATASET:
                    run.dataset_text = cell.text()
                    buttons = cell.find(
                        lambda n: n.attrs.get("data-testid") == "open-dataset-drawer"
                    )
                    # (its "+N" button is there even for one dataset: not counted)
                    run.datasets = [b.text() for b in buttons if b.text()]
                elif col == COL_MODELS:
                    run.models_text = cell.text()
                    links = cell.find(lambda n: n.tag == "a" and n.attrs.get("href"))
                    run.models = [a.text() for a in links if a.text()] + _overflow(cell)
    return RunsPage(rendered, headings, columns, rows, bool(grids))


def _problems(
    rows: Mapping[str, RunRow], expect: Mapping[str, str], where: str, models_hint: bool
) -> list[str]:
    problems = []
    for run_id, name in expect.items():
        row = rows.get(run_id)
        if row is None:
            listed = ", ".join(r.name or r.run_id for r in rows.values()) or "none"
            problems.append(f"run {name} ({run_id[:8]}) not in the {where} (it lists: {listed})")
            continue
        if row.name != name:
            problems.append(f"run {run_id[:8]} is named {row.name!r} in the {where}, not {name!r}")
        if not row.datasets:
            problems.append(f"run {name}: no dataset in the {where}'s Dataset column")
        if not row.models:
            hint = ""
            if models_hint and row.model_inputs:
                hint = (
                    f" (it has {len(row.model_inputs)} model input(s): MLflow's runs table"
                    " shows only the logged models a run made, source_run_id, not those it read)"
                )
            problems.append(f"run {name}: no model in the {where}'s Models column{hint}")
    return problems


def check_runs_page(page: RunsPage, expect: Mapping[str, str]) -> list[str]:
    """What is wrong with ``page`` for runs ``expect`` (run id -> name): it must be the runs
    page (not the GenAI overview) with the Dataset and Models columns, each run listed under
    its name with a non-empty Dataset cell and Models cell. Empty when all is well."""
    problems = []
    if page.heading not in RUNS_HEADINGS or "Overview" in page.headings:
        problems.append(f"the page opened on {page.headings or 'no title'}, not on the runs")
    if not page.has_grid:
        return [*problems, "no runs table on the page"]
    for col in (COL_NAME, COL_DATASET, COL_MODELS):
        if col not in page.columns:
            problems.append(f"column {col} not in the table (it has {page.columns})")
    return problems + _problems(page.rows, expect, "table", models_hint=False)


def open_runs_page(
    tracking_uri: str,
    experiment_id: str,
    screenshot: Path | None,
    *,
    ready: Callable[[RunsPage], bool] | None = None,
    attempts: int = 3,
    budget_ms: int = 10_000,
    chromium: str | None = None,
    loopback_only: bool = True,
) -> RunsPage:
    """The experiment's runs page, loaded until ``ready(page)`` (default: a table with rows),
    at most ``attempts`` times, each with twice the page time of the one before; the last
    load is returned either way (its screenshot at ``screenshot``)."""
    url = runs_url(tracking_uri, experiment_id)
    ready = ready or (lambda p: p.has_grid and bool(p.rows))
    page: RunsPage | None = None
    for attempt in range(max(1, attempts)):
        rendered = render(
            url,
            screenshot,
            chromium=chromium,
            budget_ms=budget_ms * 2**attempt,
            loopback_only=loopback_only,
        )
        page = read_runs_page(rendered.dom, rendered)
        if ready(page):
            break
    assert page is not None
    return page


def check_runs_in_browser(
    tracking_uri: str,
    experiment_id: str,
    expect: Mapping[str, str],
    screenshot: Path,
    **kwargs: Any,
) -> tuple[RunsPage, list[str]]:
    """Open the runs page (again, up to the attempts, while :func:`check_runs_page` finds
    problems: the UI fills the Models column from a request after the runs'); the page and
    its problems."""
    page = open_runs_page(
        tracking_uri,
        experiment_id,
        screenshot,
        ready=lambda p: not check_runs_page(p, expect),
        **kwargs,
    )
    return page, check_runs_page(page, expect)


def read_runs_client(tracking_uri: str, experiment_id: str) -> dict[str, RunRow]:
    """The same fields through :class:`mlflow.MlflowClient`: a run's dataset inputs
    (``run.inputs.dataset_inputs``: "name (digest)"), its Models as the table fills them
    (logged models whose ``source_run_id`` is the run, and its model outputs
    ``run.outputs.model_outputs`` made by it), and its model inputs
    (``run.inputs.model_inputs``), which the table does not show."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    models: list[Any] = []
    token = None
    while True:
        page = client.search_logged_models([experiment_id], max_results=100, page_token=token)
        models.extend(page)
        token = page.token
        if not token:
            break
    by_id = {m.model_id: m for m in models}
    rows: dict[str, RunRow] = {}
    for found in client.search_runs([experiment_id], max_results=1000):
        run_id = found.info.run_id
        run = client.get_run(run_id)  # search_runs leaves out model inputs and outputs
        inputs, outputs = run.inputs, run.outputs
        dataset_inputs = inputs.dataset_inputs if inputs else []
        made = [m.name for m in models if m.source_run_id == run_id]
        for out in (outputs.model_outputs if outputs else []) or []:
            model = by_id.get(out.model_id)
            if model is not None and model.source_run_id == run_id and model.name not in made:
                made.append(model.name)
        rows[run_id] = RunRow(
            run_id,
            name=run.info.run_name or "",
            datasets=[f"{d.dataset.name} ({d.dataset.digest})" for d in dataset_inputs or []],
            models=made,
            model_inputs=[m.model_id for m in (inputs.model_inputs if inputs else []) or []],
        )
    return rows


def check_runs_client(
    tracking_uri: str, experiment_id: str, expect: Mapping[str, str]
) -> tuple[dict[str, RunRow], list[str]]:
    """:func:`check_runs_page`'s checks on the store through the client (where there is no
    Chromium): each run with a dataset input and a model it made; the rows and problems."""
    rows = read_runs_client(tracking_uri, experiment_id)
    return rows, _problems(rows, expect, "store", models_hint=True)


# ---- a hand-made store that proves the check (infra/scripts/mlflow-ui-check --self-test) --

DEMO_PROBLEMS = (
    "run reader: no model in the {where}'s Models column{hint}",
    "run bare: no dataset in the {where}'s Dataset column",
    "run bare: no model in the {where}'s Models column",
)
"""What the checks must report on :func:`make_demo_store`'s experiment (``where``: ``table``
or ``store``; ``hint``: the client's note on the reader's model input)."""
DEMO_HINT = (
    " (it has 1 model input(s): MLflow's runs table shows only the logged models a run"
    " made, source_run_id, not those it read)"
)


def demo_problems(where: str) -> list[str]:
    hint = DEMO_HINT if where == "store" else ""
    return [p.format(where=where, hint=hint if "reader" in p else "") for p in DEMO_PROBLEMS]


def make_demo_store(tracking_uri: str, name: str = "ui-check") -> tuple[str, dict[str, str]]:
    """An experiment ``name`` (tagged ``mlflow.experimentKind=custom_model_development`` as
    bertpipe tags its own) with three runs: ``full`` (a dataset input and a logged model it
    made, also logged as its output), ``reader`` (a dataset input and that model as a model
    input only) and ``bare`` (neither); its id and {run id: name}."""
    import json

    from mlflow import MlflowClient
    from mlflow.entities import (
        Dataset,
        DatasetInput,
        InputTag,
        LoggedModelInput,
        LoggedModelOutput,
    )

    client = MlflowClient(tracking_uri=tracking_uri)
    eid = client.create_experiment(name, tags={"mlflow.experimentKind": "custom_model_development"})

    def dataset(name: str) -> DatasetInput:
        source = json.dumps({"uri": f"s3://bucket/{name}"})
        return DatasetInput(
            Dataset(name, "0123abcd", "s3", source, profile=json.dumps({"files": 3})),
            tags=[InputTag("mlflow.data.context", "training")],
        )

    full = client.create_run(eid, run_name="full").info.run_id
    client.log_inputs(full, datasets=[dataset("corpus")])
    model = client.create_logged_model(eid, name="tokenizer", source_run_id=full)
    client.log_outputs(full, [LoggedModelOutput(model.model_id, step=0)])
    reader = client.create_run(eid, run_name="reader").info.run_id
    client.log_inputs(
        reader, datasets=[dataset("shards")], models=[LoggedModelInput(model.model_id)]
    )
    bare = client.create_run(eid, run_name="bare").info.run_id
    for run_id in (full, reader, bare):
        client.update_run(run_id, status="FINISHED")
    return eid, {full: "full", reader: "reader", bare: "bare"}
