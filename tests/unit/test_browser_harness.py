"""The browser harness (:mod:`tests.browser`) reads the runs table cell by cell: a run name
or a dataset elsewhere on the page does not count, an empty cell is reported.

The same on a real ``mlflow server`` and Chromium (a hand-made store where one run has a
dataset and a model and the others lack them) costs ~25 s here, mostly the server's start:
it is ``infra/scripts/mlflow-ui-check --self-test`` (docs/tracking.md), run by hand."""

from __future__ import annotations

from tests.browser import check_runs_page, read_runs_page

# an ag-grid as MLflow 3.17 renders it: the run name pinned left, the other cells in the
# centre container, the same row-id in both; the sidebar names a run and a dataset as decoys
_DOM = """<html><body>
<nav><a href="#/experiments/1/runs/bbbb">bare</a> <span>corpus (abc)</span> model-x</nav>
<h2>Runs</h2>
<div role="grid"><div role="row">
 <div role="columnheader" col-id="attributes.`Run Name`">Run Name</div>
 <div role="columnheader" col-id="attributes.`Dataset`">Dataset</div>
 <div role="columnheader" col-id="attributes.`Models`">Models</div></div>
<div role="rowgroup" class="ag-pinned-left-cols-container">
 <div role="row" row-id="aaaa"><div role="gridcell" col-id="attributes.`Run Name`">
  <label><span>#1f272d</span><input type="color"></label>
  <a href="#/experiments/1/runs/aaaa"><span>full</span></a></div></div>
 <div role="row" row-id="bbbb"><div role="gridcell" col-id="attributes.`Run Name`">
  <a href="#/experiments/1/runs/bbbb"><span>bare</span></a></div></div></div>
<div role="rowgroup" class="ag-center-cols-container">
 <div role="row" row-id="aaaa">
  <div role="gridcell" col-id="attributes.`Dataset`"><span>
   <button data-testid="open-dataset-drawer"><span>corpus (abc)</span></button>
   <div role="status"><span>training</span></div>
   <button><span>+1</span></button></span></div>
  <div role="gridcell" col-id="attributes.`Models`"><span>
   <a href="#/experiments/1/models/m-1">model-x</a>
   <div role="status"><div>+2</div></div></span></div></div>
 <div role="row" row-id="bbbb">
  <div role="gridcell" col-id="attributes.`Dataset`"><span>-</span></div>
  <div role="gridcell" col-id="attributes.`Models`"><span>-</span></div></div></div>
</div></body></html>"""


def test_reads_the_table_cell_by_cell() -> None:
    page = read_runs_page(_DOM)
    assert page.heading == "Runs" and page.has_grid
    full, bare = page.rows["aaaa"], page.rows["bbbb"]
    assert (full.name, full.datasets, full.models) == ("full", ["corpus (abc)"], ["model-x", "+2"])
    assert (bare.name, bare.datasets, bare.models) == ("bare", [], [])
    assert check_runs_page(page, {"aaaa": "full"}) == []
    assert check_runs_page(page, {"aaaa": "full", "bbbb": "bare", "cccc": "gone"}) == [
        "run bare: no dataset in the table's Dataset column",
        "run bare: no model in the table's Models column",
        "run gone (cccc) not in the table (it lists: full, bare)",
    ]
    overview = read_runs_page(_DOM.replace("<h2>Runs</h2>", "<h2>Overview</h2>"))
    assert check_runs_page(overview, {"aaaa": "full"}) == [
        "the page opened on ['Overview'], not on the runs"
    ]
