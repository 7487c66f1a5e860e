"""The pre-training sample format: blocks of instances in WebDataset tar shards.

This module is the contract between ``bertpipe preprocess`` and the trainer (which imports
it). It is documented for people in ``docs/data-format.md``; bump :data:`SCHEMA_VERSION`
whenever the layout changes.

A WebDataset sample holds a *block* of up to ``instances_per_sample`` instances in columnar
form, so one tar member header (512 bytes) is paid per block, not per instance:

- ``tokens.npy``  [T] uint16 (int32 if the vocabulary exceeds 65,536): every instance's input
  ids back to back, ``[CLS] A [SEP] B [SEP]`` (objective ``mlm+nsp``) or ``[CLS] ... [SEP]``
  with a ``[SEP]`` between packed documents (``mlm``), masked positions already replaced.
- ``info.npy``    [n, 4] uint16: per instance ``length``, ``a_end`` (first index of segment B,
  i.e. one past the first ``[SEP]``; token type ids are 0 before it and 1 from it; ``mlm``:
  the length, one segment), ``num_masked`` and ``is_random_next`` (1 when B comes from
  another document; ``mlm``: 0).
- ``mlm_pos.npy`` [M] uint16: positions of the masked tokens inside their instance,
  ascending per instance, instance after instance (``num_masked`` of each).
- ``mlm_ids.npy`` [M] uint16/int32: the original token ids at those positions (the labels).

Shards written without masks (``masking: none``) have ``num_masked`` 0 and empty ``mlm_*``
arrays; the loader masks them itself. Only ``.npy`` (read with ``allow_pickle=False``) and
``.json`` appear in a shard: nothing is pickled. Tars are byte-reproducible: members sorted
by name, mtime 0, uid/gid 0, no user names.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

import numpy as np

from bertpipe import fsio

__all__ = [
    "FORMAT_NAME",
    "MEMBERS",
    "SCHEMA_VERSION",
    "Instance",
    "InstanceBlock",
    "TarStats",
    "gather_segments",
    "read_shard",
    "segment_index",
    "tar_bytes",
    "token_dtype",
    "write_tar",
]

FORMAT_NAME = "bertpipe.instances"
SCHEMA_VERSION = 1
MEMBERS = ("tokens.npy", "info.npy", "mlm_pos.npy", "mlm_ids.npy")
LENGTH, A_END, NUM_MASKED, RANDOM_NEXT = range(4)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits, else int32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def segment_index(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])``, vectorised."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    keep = lengths > 0
    if not keep.all():
        starts, lengths = starts[keep], lengths[keep]
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    big = int(starts.max()) + int(lengths.max()) >= 1 << 31
    step = np.ones(total, dtype=np.int64 if big else np.int32)
    first = np.cumsum(lengths[:-1])  # where each segment after the first begins
    step[0] = starts[0]
    step[first] = starts[1:] - (starts[:-1] + lengths[:-1]) + 1
    return np.cumsum(step, dtype=step.dtype)


def gather_segments(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ``data[starts[i] : starts[i] + lengths[i]]`` for all i, without a Python loop."""
    return data[segment_index(starts, lengths)]


@dataclass
class Instance:
    """One pre-training example, decoded (for inspection and tests, not the training hot path)."""

    input_ids: np.ndarray
    token_type_ids: np.ndarray
    mlm_positions: np.ndarray
    mlm_labels: np.ndarray
    is_random_next: bool


@dataclass
class InstanceBlock:
    """A block of instances in columnar form; see the module docstring for the arrays."""

    tokens: np.ndarray
    info: np.ndarray
    mlm_pos: np.ndarray
    mlm_ids: np.ndarray

    def __len__(self) -> int:
        return int(self.info.shape[0])

    @property
    def lengths(self) -> np.ndarray:
        return self.info[:, LENGTH]

    @property
    def token_offsets(self) -> np.ndarray:
        """Start of each instance in ``tokens``, [n]."""
        lengths = self.info[:, LENGTH].astype(np.int64)
        return np.cumsum(lengths) - lengths

    @property
    def mlm_offsets(self) -> np.ndarray:
        counts = self.info[:, NUM_MASKED].astype(np.int64)
        return np.cumsum(counts) - counts

    def instance(self, i: int) -> Instance:
        length, a_end, num_masked, random_next = (int(v) for v in self.info[i])
        start = int(self.token_offsets[i])
        m0 = int(self.mlm_offsets[i])
        ids = self.tokens[start : start + length].astype(np.int64)
        types = np.zeros(length, dtype=np.int64)
        types[a_end:] = 1
        return Instance(
            input_ids=ids,
            token_type_ids=types,
            mlm_positions=self.mlm_pos[m0 : m0 + num_masked].astype(np.int64),
            mlm_labels=self.mlm_ids[m0 : m0 + num_masked].astype(np.int64),
            is_random_next=bool(random_next),
        )

    def __iter__(self) -> Iterator[Instance]:
        for i in range(len(self)):
            yield self.instance(i)

    def take(self, index: np.ndarray) -> InstanceBlock:
        """The instances at ``index``, in that order."""
        index = np.asarray(index, dtype=np.int64)
        info = self.info[index]
        tokens = gather_segments(self.tokens, self.token_offsets[index], info[:, LENGTH])
        mlm_start = self.mlm_offsets[index]
        mlm_count = info[:, NUM_MASKED]
        return InstanceBlock(
            tokens=tokens,
            info=info,
            mlm_pos=gather_segments(self.mlm_pos, mlm_start, mlm_count),
            mlm_ids=gather_segments(self.mlm_ids, mlm_start, mlm_count),
        )

    @staticmethod
    def concat(blocks: Sequence[InstanceBlock]) -> InstanceBlock:
        if not blocks:
            raise ValueError("concat needs at least one block")
        return InstanceBlock(
            tokens=np.concatenate([b.tokens for b in blocks]),
            info=np.concatenate([b.info for b in blocks]),
            mlm_pos=np.concatenate([b.mlm_pos for b in blocks]),
            mlm_ids=np.concatenate([b.mlm_ids for b in blocks]),
        )

    def split(self, size: int) -> list[InstanceBlock]:
        """Consecutive blocks of ``size`` instances (the last may be shorter)."""
        return [
            self.take(np.arange(i, min(i + size, len(self)))) for i in range(0, len(self), size)
        ]

    # ---- sample encoding (.npy members) ----

    def to_sample(self) -> dict[str, bytes]:
        """The WebDataset members of this block, ``{"tokens.npy": b"...", ...}``."""
        arrays = (self.tokens, self.info, self.mlm_pos, self.mlm_ids)
        return {name: _npy_bytes(a) for name, a in zip(MEMBERS, arrays, strict=True)}

    @classmethod
    def from_sample(cls, sample: Mapping[str, object]) -> InstanceBlock:
        """Decode a sample dict as WebDataset yields it (keys with or without a leading dot)."""
        arrays = []
        for name in MEMBERS:
            value = sample.get(name, sample.get("." + name))
            if value is None:
                key = sample.get("__key__", "?")
                raise ValueError(f"sample {key} has no {name}: not a {FORMAT_NAME} shard")
            arrays.append(value if isinstance(value, np.ndarray) else _npy_load(value))
        return cls(*arrays)

    # ---- compact transport between pipeline stages ----

    def pack(self) -> bytes:
        """A compact byte string (npy members back to back) for moving blocks between workers."""
        parts = [_npy_bytes(a) for a in (self.tokens, self.info, self.mlm_pos, self.mlm_ids)]
        header = np.array([len(p) for p in parts], dtype="<u8").tobytes()
        return header + b"".join(parts)

    @classmethod
    def unpack(cls, data: bytes) -> InstanceBlock:
        sizes = np.frombuffer(data[:32], dtype="<u8")
        arrays, pos = [], 32
        for size in sizes:
            arrays.append(_npy_load(data[pos : pos + int(size)]))
            pos += int(size)
        return cls(*arrays)


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def _npy_load(data: object) -> np.ndarray:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"expected .npy bytes, got {type(data).__name__}")
    return np.lib.format.read_array(io.BytesIO(bytes(data)), allow_pickle=False)


def write_tar(fileobj: IO[bytes], samples: Iterable[tuple[str, Mapping[str, bytes]]]) -> int:
    """Stream ``(key, {member: bytes})`` samples into a byte-reproducible tar; returns its size.

    Keys must come in ascending order; members of a sample are written sorted by name.
    """
    counter = fileobj if isinstance(fileobj, TarStats) else TarStats(fileobj)
    with tarfile.open(fileobj=counter, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, members in samples:
            for member in sorted(members):
                data = members[member]
                info = tarfile.TarInfo(f"{key}.{member}")
                info.size = len(data)
                info.mtime = 0
                info.mode = 0o644
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                tar.addfile(info, io.BytesIO(data))
    return counter.size


def tar_bytes(samples: Sequence[tuple[str, Mapping[str, bytes]]]) -> bytes:
    """The tar of ``samples`` (see :func:`write_tar`) as bytes, samples sorted by key."""
    buf = io.BytesIO()
    write_tar(buf, sorted(samples, key=lambda s: s[0]))
    return buf.getvalue()


class TarStats(io.RawIOBase):
    """Passes writes through, counting bytes and hashing them (sha256)."""

    def __init__(self, target: IO[bytes]) -> None:
        self._target = target
        self.size = 0
        self.sha256 = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.size

    def write(self, data) -> int:  # type: ignore[no-untyped-def,override]
        self._target.write(data)
        self.sha256.update(data)
        self.size += len(data)
        return len(data)


def read_shard(url: str) -> Iterator[tuple[str, InstanceBlock]]:
    """Yield ``(key, block)`` for each sample of a shard (any fsspec URL), in file order."""
    with fsio.open_url(url, "rb") as f, tarfile.open(fileobj=f, mode="r|") as tar:
        current: str | None = None
        members: dict[str, bytes] = {}
        for info in tar:
            if not info.isfile():
                continue
            key, _, member = info.name.partition(".")
            if current is not None and key != current:
                yield current, InstanceBlock.from_sample({**members, "__key__": current})
                members = {}
            current = key
            handle = tar.extractfile(info)
            members[member] = handle.read() if handle else b""
        if current is not None:
            yield current, InstanceBlock.from_sample({**members, "__key__": current})
