"""Where the suite's CPU goes, per test: an opt-in pytest plugin and its report.

``--durations`` gives wall time, which hides what a multi-process test costs the machine
(two ranks and two launchers on two cores) and counts a test that only waits. The suite is
CPU-bound, so this counts CPU: for each test (setup, call and teardown), the CPU time of the
pytest process and of the child processes it reaped in that time (``getrusage``; a child
reaps its own children, so ranks under a launcher are counted when the launcher ends). Each
worker writes its rows to ``BERTPIPE_CPU_REPORT`` (a folder) at the end::

    BERTPIPE_CPU_REPORT=/tmp/cpu pytest -p tests.cpu_report -n 2 --dist worksteal
    python -m tests.cpu_report /tmp/cpu        # the costliest tests and the totals

Servers a session fixture starts are counted in the test whose teardown stops them.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

_ENV = "BERTPIPE_CPU_REPORT"
_rows: list[dict[str, object]] = []
_started: dict[str, tuple[float, float, float]] = {}


def _now() -> tuple[float, float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (
        own.ru_utime + own.ru_stime,
        children.ru_utime + children.ru_stime,
        time.monotonic(),
    )


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    _started[nodeid] = _now()


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    start = _started.pop(nodeid, None)
    if start is None:
        return
    end = _now()
    _rows.append(
        {
            "test": nodeid,
            "self_s": round(end[0] - start[0], 2),
            "children_s": round(end[1] - start[1], 2),
            "wall_s": round(end[2] - start[2], 2),
        }
    )


def pytest_sessionfinish(session: object) -> None:
    folder = os.environ.get(_ENV)
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (Path(folder) / f"cpu-{worker}.json").write_text(json.dumps(_rows))


def report(folder: Path, top: int = 30) -> str:
    """The ``top`` costliest tests by CPU, then the totals, from every worker's file."""
    rows = [r for f in sorted(folder.glob("cpu-*.json")) for r in json.loads(f.read_text())]
    if not rows:
        raise SystemExit(f"{folder}: no cpu-*.json (run pytest with {_ENV}={folder})")
    rows.sort(key=lambda r: -(r["self_s"] + r["children_s"]))
    lines = [f"{'cpu s':>7} {'own':>6} {'child':>6} {'wall':>6}  test"]
    for r in rows[:top]:
        cpu = r["self_s"] + r["children_s"]
        lines.append(
            f"{cpu:7.1f} {r['self_s']:6.1f} {r['children_s']:6.1f} {r['wall_s']:6.1f}  {r['test']}"
        )
    own = sum(r["self_s"] for r in rows)
    children = sum(r["children_s"] for r in rows)
    lines.append(
        f"{len(rows)} tests: {own + children:.0f} s of CPU ({own:.0f} s in pytest's processes,"
        f" {children:.0f} s in their children)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: python -m tests.cpu_report FOLDER [TOP]")
    print(report(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) == 3 else 30))
