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
