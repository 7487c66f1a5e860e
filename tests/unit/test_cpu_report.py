"""The opt-in per-test CPU counter (tests/cpu_report.py) on a tiny suite of its own: a test
whose child process burns CPU is counted in the child column, one that burns it itself in
the pytest process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.cpu_report import report

REPO = Path(__file__).resolve().parents[2]

_SUITE = """
import subprocess, sys, time

def _burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

def test_child_burns():
    code = "import time\\nend = time.process_time() + 0.5\\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", code], check=True)

def test_itself_burns():
    _burn(0.5)
"""


def test_cpu_is_counted_per_test_in_the_process_that_spent_it(tmp_path: Path) -> None:
    (tmp_path / "test_tiny.py").write_text(_SUITE)
    out = tmp_path / "cpu"
    env = {**os.environ, "BERTPIPE_CPU_REPORT": str(out), "PYTHONPATH": str(REPO)}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.cpu_report", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), str(tmp_path / "test_tiny.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {r["test"].split("::")[1]: r for r in json.loads((out / "cpu-main.json").read_text())}
    assert rows["test_child_burns"]["children_s"] >= 0.4, rows
    assert rows["test_child_burns"]["self_s"] < 0.4, rows
    assert rows["test_itself_burns"]["self_s"] >= 0.4, rows
    assert rows["test_itself_burns"]["children_s"] < 0.1, rows
    lines = report(out).splitlines()
    assert {line.rsplit("::", 1)[1] for line in lines[1:3]} == set(rows), lines
    assert lines[-1].startswith("2 tests: "), lines
