"""Logging, set up once per process. Rank 0 logs at the chosen level, other ranks warnings."""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["process_rank", "setup_logging"]

_NOISY = (
    "apache_beam",
    "distributed",
    "urllib3",
    "alembic",
    "mlflow",
    "matplotlib",
    "filelock",
    "fsspec",
    "torch.distributed",
    "DeepSpeed",
    # every process start: "Found credentials in environment variables", "Found endpoint
    # for s3 via: environment_global"; their retries log at DEBUG
    "botocore",
    "aiobotocore",
    "s3fs",
)


class _DropKnownNoise(logging.Filter):
    """Drops import-time warnings of optional dependencies that do not apply to bertpipe."""

    _PREFIXES = ("apitools not found",)

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self._PREFIXES)


class _OneLineForARaisedError(logging.Filter):
    """MLflow's sqlite store logs a database error (``database is locked`` while parallel
    trials write to one store) with its traceback, then raises it to its caller, which in
    bertpipe retries the call or buffers it (``tracking.outbox``: replayed when the store
    answers, with one warning). The record keeps its first line at WARNING, without the
    traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            record.msg, record.args = "MLflow store: %s", (first,)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_RAISED_TO_THE_CALLER = ("mlflow.store.db.utils",)
"""Loggers whose logged exceptions are raised to bertpipe too (and handled there)."""


def process_rank() -> int:
    """The distributed rank from the launcher's environment (0 when not launched)."""
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if var in os.environ:
            try:
                return int(os.environ[var])
            except ValueError:
                continue
    return 0


def setup_logging(level: str = "INFO", rank: int | None = None) -> None:
    """Configure the root logger once: time, level, logger name, message on stderr."""
    rank = process_rank() if rank is None else rank
    # MLflow configures its own logger when imported; this is the setting it reads
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    root = logging.getLogger()
    chosen = getattr(logging, level.upper(), logging.INFO) if rank == 0 else logging.WARNING
    prefix = f"[rank {rank}] " if rank else ""
    formatter = logging.Formatter(
        f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    handler = next((h for h in root.handlers if getattr(h, "_bertpipe", False)), None)
    if handler is None:
        for h in list(root.handlers):
            root.removeHandler(h)
        handler = logging.StreamHandler(sys.stderr)
        handler._bertpipe = True  # type: ignore[attr-defined]
        handler.addFilter(_DropKnownNoise())
        root.addHandler(handler)
    handler.setFormatter(formatter)
    root.setLevel(chosen)
    for name in _NOISY:
        logging.getLogger(name).setLevel(max(chosen, logging.WARNING))
    for name in _RAISED_TO_THE_CALLER:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OneLineForARaisedError) for f in logger.filters):
            logger.addFilter(_OneLineForARaisedError())
