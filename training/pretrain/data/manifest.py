"""A phase folder's ``manifest.json``: read once per run, validated, and kept in two forms.

A phase folder (``manifest.json`` + WebDataset tar shards, see docs/data-format.md) is
described by its manifest alone: the loader plans every epoch from it
(:mod:`bertpipe.training.pretrain.data.loader`) and the trainer identifies the data by the checksum
of its bytes. :func:`read_phase_data` reads those bytes once, on every rank before the process group
does any work, and keeps the raw dict (tokenizer checksum, stats, config: what tracking and the
model config read), the bytes' sha256, and the validated :class:`Manifest` the loader needs, parsed
from the same bytes: a loader built from it (``PretrainingData(manifest)``,
``build_pretraining_data(..., manifest=...)``) reads nothing again. :func:`load_manifest` reads and
validates a folder's manifest for callers that have no phase (benches, the plan).

Validation checks the format and schema version, that every shard's sample count fits its
instance count, the masking mode, the objective (absent in older manifests: ``mlm+nsp``), and
that every listed shard exists (one listing of the folder). A manifest that fails is a
:class:`DataError` naming its URL (exit status 2). Transient read errors (``OSError``,
timeouts) are retried with ``data.read_retries`` / ``data.read_retry_delay``; a missing
manifest is not transient (a wrong path).
"""

from __future__ import annotations

import hashlib
import posixpath
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bertpipe import fsio
from bertpipe.config import ConfigError
from bertpipe.errors import BertpipeError
from bertpipe.fsio import RetryPolicy
from bertpipe.preprocessing.shard_format import FORMAT_NAME, SCHEMA_VERSION
from bertpipe.training.pretrain.config import PhaseSpec

__all__ = [
    "DataError",
    "DataMismatchError",
    "Manifest",
    "PhaseData",
    "ShardInfo",
    "load_manifest",
    "read_bytes",
    "read_phase_data",
    "validate_manifest",
]

MANIFEST_NAME = "manifest.json"
OBJECTIVES = ("mlm+nsp", "mlm")
"""The pre-training objectives a phase's data may be cut for (the manifest's ``objective``)."""


class DataError(BertpipeError):
    """A manifest or shard that cannot be used; the message names the URL."""


class DataMismatchError(BertpipeError):
    """The phases' data do not fit together or the model."""


@dataclass(frozen=True)
class ShardInfo:
    """One tar shard of a split, as the manifest describes it."""

    file: str
    url: str
    instances: int
    samples: int
    sha256: str | None = None
    """The shard's checksum as the manifest lists it (None in manifests without one)."""
    bytes: int | None = None
    """The shard's size as the manifest lists it (None in manifests without one)."""


@dataclass(frozen=True)
class Manifest:
    """The parts of ``manifest.json`` the loader needs (validated by :func:`load_manifest`)."""

    url: str
    max_seq_length: int
    max_predictions_per_seq: int
    masking: str
    """``static`` (masks in the shards) or ``none`` (the loader masks: dynamic masking)."""
    vocab_size: int
    special_token_ids: dict[str, int]
    instances_per_sample: int
    splits: dict[str, tuple[ShardInfo, ...]]
    masking_config: dict[str, Any] = field(default_factory=dict)
    """The ``config.masking`` section the shards were written with (may be empty)."""
    objective: str = "mlm+nsp"
    """``mlm+nsp`` (sentence pairs with the NSP label, the BERT paper's) or ``mlm`` (packed
    single-segment instances, no NSP label: ``is_random_next`` is 0 throughout and means
    nothing). Manifests written before the ``mlm`` objective have no ``objective``: mlm+nsp."""

    def block_sizes(self, split: str) -> list[np.ndarray]:
        """Instances of every block (sample) of every shard of ``split``: [samples] each."""
        ips = self.instances_per_sample
        out = []
        for shard in self.splits[split]:
            sizes = np.full(shard.samples, ips, dtype=np.int64)
            if shard.samples:
                sizes[-1] = shard.instances - ips * (shard.samples - 1)
            out.append(sizes)
        return out


@dataclass
class PhaseData:
    """A phase's manifest, read once (:func:`read_phase_data`)."""

    url: str
    """The phase's data folder (``phase.data``)."""
    manifest: dict[str, Any]
    """``manifest.json`` as written: tokenizer checksum, stats, the preprocessing config."""
    sha256: str
    """The checksum of the manifest's bytes, which identifies the data (tags, resume)."""
    parsed: Manifest
    """The same bytes validated for the loader: pass it on as
    ``build_pretraining_data(..., manifest=d.parsed)`` and the loader reads nothing again."""

    @property
    def max_seq_length(self) -> int:
        return self.parsed.max_seq_length


def _read_bytes(url: str) -> bytes:
    with fsio.open_url(url, "rb") as f:
        return bytes(f.read())


def read_bytes(url: str, retry: RetryPolicy | None = None) -> bytes:
    """The bytes of ``url`` (a manifest), transient errors retried with ``retry``'s backoff; a
    missing file raises ``FileNotFoundError`` at once (a wrong path is not transient)."""
    what = f"reading {url}"
    return fsio.retried(lambda: _read_bytes(url), what, retry, _transient_unless_missing)


def _transient_unless_missing(exc: BaseException) -> bool:
    """Transient, except a file that is not there (a wrong path, not a storage hiccup)."""
    return not isinstance(exc, FileNotFoundError) and fsio.is_transient(exc)


def read_phase_data(phase: PhaseSpec, key: str, retry: RetryPolicy | None = None) -> PhaseData:
    """The manifest of ``phase``, read once and validated (``key``: where the phase is in the
    config, for errors). A missing manifest is a :class:`~bertpipe.config.ConfigError` of
    ``<key>.data``, one of another format a :class:`DataMismatchError`, an invalid one a
    :class:`DataError`; transient read errors are retried (``data.read_retries``)."""
    url = fsio.join(phase.data, MANIFEST_NAME)
    try:
        raw = read_bytes(url, retry)
    except FileNotFoundError:
        raise ConfigError(
            f"{key}.data", f"{url} does not exist: run `bertpipe preprocess` for this phase first"
        ) from None
    manifest = _decode(url, raw)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise DataMismatchError(f"{url} is not a bertpipe shard manifest")
    parsed = validate_manifest(phase.data, manifest, retry)
    return PhaseData(phase.data, manifest, hashlib.sha256(raw).hexdigest(), parsed)


def load_manifest(folder: str, retry: RetryPolicy | None = None) -> Manifest:
    """Read and validate ``<folder>/manifest.json``; checks that every listed shard exists.

    Transient read errors are retried with ``retry``'s backoff (a missing manifest is not)."""
    url = fsio.join(folder, MANIFEST_NAME)
    try:
        raw = _decode(url, read_bytes(url, retry))
    except FileNotFoundError:
        raise DataError(
            f"no manifest at {url}: point the phase's data at a folder written by "
            "`bertpipe preprocess` (it writes manifest.json last)"
        ) from None
    return validate_manifest(folder, raw, retry)


def _decode(url: str, raw: bytes) -> Any:
    try:
        return fsio.parse_json(raw, url, "rerun `bertpipe preprocess` for this phase")
    except fsio.BadFileError as exc:
        raise DataError(str(exc)) from None


def validate_manifest(folder: str, raw: Any, retry: RetryPolicy | None = None) -> Manifest:
    """The loader's :class:`Manifest` of ``raw`` (``<folder>/manifest.json`` as decoded),
    validated; checks that every listed shard exists (listing ``folder``, transient errors
    retried with ``retry``'s backoff). Anything wrong is a :class:`DataError`."""
    url = fsio.join(folder, MANIFEST_NAME)

    def fail(what: str) -> DataError:
        return DataError(f"{url}: {what}; rerun `bertpipe preprocess` with this bertpipe version")

    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise fail(f"format is {got!r}, expected {FORMAT_NAME!r}")
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise fail(
            f"schema_version {raw.get('schema_version')!r}, this loader reads {SCHEMA_VERSION}"
        )
    try:
        ips = int(raw["instances_per_sample"])
        splits: dict[str, tuple[ShardInfo, ...]] = {}
        for name, split in raw["splits"].items():
            shards = tuple(
                ShardInfo(
                    s["file"],
                    fsio.join(folder, s["file"]),
                    int(s["instances"]),
                    int(s["samples"]),
                    str(s["sha256"]) if s.get("sha256") else None,
                    int(s["bytes"]) if s.get("bytes") is not None else None,
                )
                for s in split["shards"]
            )
            for s in shards:
                if s.samples != -(-s.instances // ips):
                    raise fail(
                        f"shard {s.file} lists {s.instances} instances in {s.samples} samples"
                    )
            splits[name] = shards
        manifest = Manifest(
            url=url,
            max_seq_length=int(raw["max_seq_length"]),
            max_predictions_per_seq=int(raw["max_predictions_per_seq"]),
            masking=str(raw["masking"]),
            vocab_size=int(raw["vocab_size"]),
            special_token_ids={k: int(v) for k, v in raw["special_token_ids"].items()},
            instances_per_sample=ips,
            splits=splits,
            masking_config=dict(raw.get("config", {}).get("masking", {})),
            objective=str(raw.get("objective", "mlm+nsp")),
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise fail(f"missing or malformed entry {exc}") from None
    if manifest.masking not in ("static", "none"):
        raise fail(f"masking {manifest.masking!r} is neither 'static' nor 'none'")
    if manifest.objective not in OBJECTIVES:
        raise fail(f"objective {manifest.objective!r} is not one of {', '.join(OBJECTIVES)}")
    _check_shards_exist(folder, manifest, retry)
    return manifest


class ShardsMissingError(OSError):
    """Shards the manifest lists that the phase folder's listing lacks: storage that lost
    them (an outage, a mount that went away) or a folder being copied, retried like any
    read (exit 75 if they stay away), not bad data."""


def _check_shards_exist(folder: str, manifest: Manifest, retry: RetryPolicy | None) -> None:
    """A listing of ``folder`` (again after a transient error or while shards the manifest
    lists are absent, with ``retry``'s backoff): still absent after the retries is a
    :class:`~bertpipe.errors.TransientError` naming the first one (exit 75)."""
    fs, path = fsio.to_fs(folder)
    names = [s for shards in manifest.splits.values() for s in shards]

    def check() -> None:
        fs.invalidate_cache(path)  # a listing cached before the last attempt
        listing = fs.ls(path, detail=False)
        present = {posixpath.basename(p.rstrip("/")) for p in listing}
        missing = [s.url for s in names if s.file not in present]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ShardsMissingError(f"{missing[0]}{more} does not exist")

    fsio.retried(
        check,
        f"{manifest.url} lists shards the folder lacks",
        retry,
        lambda exc: isinstance(exc, ShardsMissingError) or _transient_unless_missing(exc),
    )
