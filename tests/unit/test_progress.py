"""Progress with an ETA: the rate counts only the work done in this process (a resumed run
does not promise to finish at once), and without a terminal it is a periodic log line."""

from __future__ import annotations

import logging

from bertpipe import progress as progress_mod
from bertpipe.progress import ProgressLine


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_eta_after_resume_counts_only_the_steps_done_here(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_mod.time, "monotonic", clock)
    bar = ProgressLine("phase1", 1000, initial=900, unit="step", tty=False)
    clock.now += 10.0
    # 10 steps in 10 s since the resume: 90 left at 1 step/s, not 1 s (900+10 steps in 10 s)
    line = bar.line(910)
    assert "910/1000" in line and "00:10<01:30" in line and "1.00step/s" in line


def test_non_terminal_logs_a_line_every_interval(monkeypatch, caplog):
    clock = Clock()
    monkeypatch.setattr(progress_mod.time, "monotonic", clock)
    bar = ProgressLine("phase1", 100, unit="step", interval_s=60.0, tty=False)
    with caplog.at_level(logging.INFO, logger="bertpipe.progress"):
        for step in range(1, 101):
            clock.now += 2.0
            bar.update(step)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3  # at 60, 120 and 180 s of 200
    assert lines[0].startswith("phase1:  30% 30/100 [01:00<02:20")
    bar.touch()  # the caller just logged the line itself
    clock.now += 30.0
    bar.update(100)
    assert len(caplog.records) == 3


def test_terminal_draws_a_tqdm_bar(monkeypatch, capsys):
    bar = ProgressLine("files", 4, initial=1, unit="file", tty=True)
    bar.update(3, "12 documents", force=True)
    bar.close()
    err = capsys.readouterr().err
    assert "files" in err and "3/4" in err and "12 documents" in err
