"""Stable hashing and explicit random generators.

Python's ``hash()`` is salted per process, so nothing that must be reproducible across
runs, workers or runners may use it. Everything random in bertpipe draws from a
``numpy.random.Generator`` seeded by :func:`stable_hash` of the run seed and the
identity of the work item (document id, bucket, phase, ...).
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["rng_for", "stable_hash", "stable_unit"]


def stable_hash(*parts: object) -> int:
    """A 64-bit hash of ``parts`` that is the same in every process, machine and run."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(str(part).encode("utf-8"))
        h.update(b"\x1f")
    return int.from_bytes(h.digest(), "little")


def stable_unit(*parts: object) -> float:
    """A number in [0, 1) derived from ``parts`` by :func:`stable_hash`."""
    return stable_hash(*parts) / 2.0**64


def rng_for(*parts: object) -> np.random.Generator:
    """A generator whose stream depends only on ``parts`` (e.g. ``seed, "bucket", 7``)."""
    return np.random.Generator(np.random.PCG64(stable_hash(*parts)))
