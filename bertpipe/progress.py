"""A one-line progress display for interactive runs (only when stderr is a terminal)."""

from __future__ import annotations

import sys
import time

__all__ = ["ProgressLine", "format_duration"]


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ProgressLine:
    """Rewrites one status line on stderr, at most every ``interval`` seconds.

    Does nothing when stderr is not a TTY (CI logs, files, worker processes), so it is safe to
    call from library code on every step.
    """

    def __init__(self, label: str, total: float | None = None, interval: float = 0.5) -> None:
        self.label = label
        self.total = total
        self.interval = interval
        self.enabled = sys.stderr.isatty()
        self._start = time.monotonic()
        self._last = 0.0
        self._shown = False

    def update(self, done: float, extra: str = "", force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        elapsed = now - self._start
        text = f"{self.label}: {done:,.0f}"
        if self.total:
            text += f"/{self.total:,.0f} ({100.0 * done / self.total:.0f}%)"
            if done > 0:
                text += f" eta {format_duration(elapsed * (self.total - done) / done)}"
        text += f" elapsed {format_duration(elapsed)}"
        if extra:
            text += f" {extra}"
        sys.stderr.write("\r" + text[:200].ljust(80))
        sys.stderr.flush()
        self._shown = True

    def close(self) -> None:
        if self.enabled and self._shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._shown = False
