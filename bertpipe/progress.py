"""Progress of a counted job (optimizer steps, files read) with an ETA, drawn by tqdm.

On a terminal it is a tqdm bar on stderr. Elsewhere (SLURM ``.out`` files, ``kubectl logs``,
CI) a bar is noise, so the same figures go to the log as one INFO line at most every
``interval_s`` seconds: ``phase1:  40% 400/1000 [01:00<02:00,  5.00step/s, loss 3.21]``.

``initial`` is the work done before this process started (a resumed run): the rate and the
ETA count only the work done here, so a run resumed at 90% does not promise to finish at
once. Updates are host-only (no device reads), cheap enough for every step.
"""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

__all__ = ["ProgressLine"]

log = logging.getLogger(__name__)


class ProgressLine:
    """A tqdm bar on a terminal, else a periodic log line; both with the ETA of the work left.

    ``update(done)`` takes the absolute count (not an increment). ``extra`` is shown after
    the rate (loss, documents, ...). ``force`` writes the log line now (non-terminal mode).
    """

    def __init__(
        self,
        label: str,
        total: float | None = None,
        interval: float = 0.5,
        *,
        initial: float = 0,
        interval_s: float = 60.0,
        unit: str = "it",
        logger: logging.Logger | None = None,
        tty: bool | None = None,
    ) -> None:
        self.label = label
        self.total = total or None
        self.initial = initial
        self.unit = unit
        self.interval_s = interval_s
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.enabled = self.tty  # kept for callers that draw their own log line otherwise
        self._log = logger or log
        self._start = time.monotonic()
        self._last_line = self._start
        self._done = initial
        self._extra = ""
        self._bar: tqdm | None = None
        if self.tty:
            self._bar = tqdm(
                total=self.total,
                initial=initial,
                desc=label,
                unit=unit,
                file=sys.stderr,
                mininterval=interval,
                dynamic_ncols=True,
                leave=True,
            )

    def line(self, done: float | None = None, extra: str | None = None) -> str:
        """The progress as one line of text: percentage, count, elapsed<ETA, rate, extra."""
        done = self._done if done is None else done
        extra = self._extra if extra is None else extra
        return tqdm.format_meter(
            done,
            self.total,
            time.monotonic() - self._start,
            prefix=self.label,
            initial=self.initial,
            unit=self.unit,
            ncols=0,  # figures only, no bar
            postfix=extra or None,
        )

    def update(self, done: float, extra: str = "", force: bool = False) -> None:
        self._done = done
        if extra:
            self._extra = extra
        if self._bar is not None:
            if extra:
                self._bar.set_postfix_str(extra, refresh=False)
            self._bar.update(done - self._bar.n)
            if force:
                self._bar.refresh()
            return
        now = time.monotonic()
        if force or now - self._last_line >= self.interval_s:
            self._last_line = now
            self._log.info("%s", self.line(done))

    def touch(self) -> None:
        """The caller has just logged :meth:`line` itself: the next periodic line is due
        ``interval_s`` from now."""
        self._last_line = time.monotonic()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
