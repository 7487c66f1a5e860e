"""Shared vocabulary of the task readers: read reports, task specs, feature arrays, writers.

Every reader returns ``(examples, ReadReport)``. A row that cannot be used (wrong column
count, unknown label, empty text, an answer that does not match its context, ...) becomes a
:class:`ReadProblem` naming the file and line; nothing is dropped without being counted. A
file that cannot be read at all raises :class:`TaskDataError`, a one-line message naming the
file and what to do.

Features
--------
Featurizers return :data:`Features`, a ``dict[str, numpy.ndarray]`` with one row per model
input. Token arrays are padded to the longest row of the *whole set* (never longer than
``max_seq_length``); ``lengths`` holds the real length of each row, so a collator can cut a
batch down to its own longest row with :func:`take`. Keys every featurizer writes:

- ``input_ids``       int32 [N, S]  token ids, padded with the tokenizer's ``[PAD]`` id
- ``token_type_ids``  int8  [N, S]  0 for ``[CLS]`` + segment A + first ``[SEP]``, 1 after
- ``attention_mask``  int8  [N, S]  1 on real tokens, 0 on padding
- ``lengths``         int32 [N]     real tokens per row

Convention: every array with two or more dimensions is per token (axis 1 is the sequence
axis, length S); one-dimensional arrays are per row. Task modules add their own keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

import numpy as np
from tokenizers import Tokenizer

from bertpipe.config import ConfigError
from bertpipe.fsio import open_url

__all__ = [
    "IGNORE_INDEX",
    "Features",
    "ReadProblem",
    "ReadReport",
    "SpecialIds",
    "TaskDataError",
    "TaskKind",
    "TaskSpec",
    "check_dev_labels",
    "check_max_seq_length",
    "open_for_write",
    "pad_rows",
    "plain_tokenizer",
    "read_text",
    "special_ids",
    "take",
]

from bertpipe.errors import BertpipeError

logger = logging.getLogger(__name__)

Features = dict[str, np.ndarray]
"""Model inputs and bookkeeping, one row per model input (see the module docstring)."""

TaskKind = Literal["classification", "regression", "span_qa", "token_labels"]
TASK_KINDS: tuple[str, ...] = ("classification", "regression", "span_qa", "token_labels")

IGNORE_INDEX = -100
"""Label value that the loss ignores (specials, padding, non-first sub-tokens)."""


class TaskDataError(BertpipeError, ValueError):
    """A task data file cannot be used at all; the message names the file and what to do."""


@dataclass(frozen=True)
class ReadProblem:
    """One row of a task file that could not be used as it is.

    ``line`` is 1-based. For JSON files it is the line where the question id appears (official
    SQuAD files are a single line, so ``reason`` also names the JSON path).
    """

    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


@dataclass
class ReadReport:
    """What a reader did with one file: rows seen, rows kept, and every problem found.

    A problem is not always a dropped row: a SQuAD answer that does not match its context is
    reported, but its question is kept for evaluation (``reason`` says which).
    """

    file: str
    rows_read: int = 0
    rows_kept: int = 0
    problems: list[ReadProblem] = field(default_factory=list)

    def add(self, line: int, reason: str) -> None:
        """Record a problem at ``line`` (1-based) of this report's file."""
        self.problems.append(ReadProblem(self.file, line, reason))

    def summary(self) -> str:
        """One line: file, rows read and kept, problem count and the first problem."""
        text = f"{self.file}: read {self.rows_read} rows, kept {self.rows_kept}"
        if self.problems:
            text += f", {len(self.problems)} problems (first: line {self.problems[0].line}: "
            text += f"{self.problems[0].reason})"
        return text

    def log(self, max_shown: int = 5) -> None:
        """Log the summary, and the first ``max_shown`` problems as warnings."""
        if not self.problems:
            logger.info("%s", self.summary())
            return
        logger.warning("%s", self.summary())
        for problem in self.problems[:max_shown]:
            logger.warning("  %s", problem)
        if len(self.problems) > max_shown:
            logger.warning("  ... and %d more", len(self.problems) - max_shown)

    def require_rows(self) -> None:
        """Raise :class:`TaskDataError` when no row of the file was usable."""
        if self.rows_kept == 0:
            first = f"; first problem: {self.problems[0]}" if self.problems else ""
            raise TaskDataError(
                f"{self.file}: no usable rows ({self.rows_read} read, "
                f"{len(self.problems)} problems){first}: check the file's layout and task name"
            )


@dataclass(frozen=True)
class TaskSpec:
    """What a task is: its kind, label list and how it is scored.

    ``labels`` are the class names in id order (classification, token_labels); empty for
    regression and span_qa. ``metrics`` are the names :func:`bertpipe.finetuning.metrics.
    compute_task_metrics` reports; ``main_metric`` picks the model and must be one of them.
    ``positive_label`` is the class binary F1 counts as positive. ``threshold`` (regression
    only): the score at or above which a pair counts as positive, on both sides, for the
    metric ``f1`` (KLUE-STS: 3.0).
    """

    name: str
    kind: TaskKind
    labels: tuple[str, ...] = ()
    main_metric: str = "accuracy"
    greater_is_better: bool = True
    metrics: tuple[str, ...] = ("accuracy",)
    positive_label: str | None = None
    threshold: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in TASK_KINDS:
            raise ValueError(f"task {self.name}: kind {self.kind!r} is not one of {TASK_KINDS}")
        if self.kind in ("classification", "token_labels") and len(self.labels) < 2:
            raise ValueError(f"task {self.name}: a {self.kind} task needs at least two labels")
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"task {self.name}: duplicate labels in {self.labels}")
        if self.main_metric not in self.metrics:
            raise ValueError(
                f"task {self.name}: main metric {self.main_metric!r} not in {self.metrics}"
            )
        if self.threshold is not None and self.kind != "regression":
            raise ValueError(f"task {self.name}: a threshold is for regression tasks only")
        if self.positive_label is not None and self.positive_label not in self.labels:
            raise ValueError(
                f"task {self.name}: positive label {self.positive_label!r} not in {self.labels}"
            )

    @property
    def num_labels(self) -> int:
        """Outputs of the task head: 1 for regression, 2 (start, end) for span_qa."""
        if self.kind == "regression":
            return 1
        if self.kind == "span_qa":
            return 2
        return len(self.labels)

    @property
    def label_to_id(self) -> dict[str, int]:
        return {label: i for i, label in enumerate(self.labels)}

    def replace(self, **changes: object) -> TaskSpec:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SpecialIds:
    """Ids of BERT's special tokens, read from the tokenizer (never Google's 100-103)."""

    cls: int
    sep: int
    pad: int
    unk: int


def special_ids(tokenizer: Tokenizer) -> SpecialIds:
    """Look up ``[CLS]``, ``[SEP]``, ``[PAD]`` and ``[UNK]`` in ``tokenizer``'s vocabulary."""
    found: dict[str, int] = {}
    for name, token in (("cls", "[CLS]"), ("sep", "[SEP]"), ("pad", "[PAD]"), ("unk", "[UNK]")):
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"tokenizer has no {token} token: use a BERT tokenizer.json (WordPiece with "
                "[PAD], [UNK], [CLS], [SEP], [MASK])"
            )
        found[name] = token_id
    return SpecialIds(**found)


def plain_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """``tokenizer`` itself, or a copy with truncation and padding off when either is set.

    Featurizers truncate and pad themselves; the caller's tokenizer is never modified.
    """
    if tokenizer.truncation is None and tokenizer.padding is None:
        return tokenizer
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.no_truncation()
    copy.no_padding()
    return copy


def check_max_seq_length(max_seq_length: int, max_positions: int) -> None:
    """Raise :class:`ConfigError` (key ``task.max_seq_length``) unless it fits the model.

    ``max_positions`` is the model's ``max_position_embeddings``.
    """
    if max_seq_length > max_positions:
        raise ConfigError(
            "task.max_seq_length",
            f"{max_seq_length} is longer than the model's max_position_embeddings "
            f"({max_positions}); set task.max_seq_length to {max_positions} or less",
        )
    if max_seq_length < 8:
        raise ConfigError(
            "task.max_seq_length",
            f"{max_seq_length} leaves no room for text next to [CLS] and [SEP]; use 8 or more "
            "(BERT uses 128 for GLUE, 384 for SQuAD)",
        )


def pad_rows(rows: Sequence[Sequence[int]], pad_value: int, dtype: type | str) -> np.ndarray:
    """Stack ``rows`` into a [N, S] array, S = longest row, shorter rows right-padded."""
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), pad_value, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def encoded_features(
    ids: Sequence[Sequence[int]], type_ids: Sequence[Sequence[int]], pad_id: int
) -> Features:
    """The four shared keys (module docstring) from per-row token ids and segment ids."""
    input_ids = pad_rows(ids, pad_id, np.int32)
    lengths = np.array([len(r) for r in ids], dtype=np.int32)
    mask = (np.arange(input_ids.shape[1])[None, :] < lengths[:, None]).astype(np.int8)
    return {
        "input_ids": input_ids,
        "token_type_ids": pad_rows(type_ids, 0, np.int8),
        "attention_mask": mask,
        "lengths": lengths,
    }


def take(features: Features, indices: Sequence[int] | np.ndarray, trim: bool = True) -> Features:
    """Rows ``indices`` of every array; with ``trim``, token arrays cut to their longest row.

    Returns arrays of shape [B, S_batch, ...] for token keys and [B, ...] for row keys, where
    S_batch = ``lengths[indices].max()``.
    """
    idx = np.asarray(indices, dtype=np.int64)
    width = int(features["lengths"][idx].max()) if trim and len(idx) else None
    out: Features = {}
    for key, array in features.items():
        rows = array[idx]
        if width is not None and rows.ndim >= 2:
            rows = rows[:, :width]
        out[key] = rows
    return out


def check_dev_labels(
    train_file: str,
    train_labels: Iterable[str],
    dev_file: str,
    dev_labels: Iterable[tuple[int, str]],
    what: str = "label",
) -> None:
    """Raise :class:`TaskDataError` when a dev row holds a label the training file never has.

    ``dev_labels``: (1-based line, label) per dev row (per entity for token tasks, with
    ``what="entity type"``). A model trained without a class never predicts it, so every
    such row is scored wrong and the score says less than it seems (a GLUE RTE training
    file cut to one class gives a model that answers that class). The message names the
    first such row, how many there are and the training file's labels.
    """
    seen = set(train_labels)
    unseen = [(line, label) for line, label in dev_labels if label not in seen]
    if not unseen:
        return
    line, label = unseen[0]
    more = f" (and {len(unseen) - 1} more rows)" if len(unseen) > 1 else ""
    has = ", ".join(sorted(seen)) or "none"
    raise TaskDataError(
        f"{dev_file}:{line}: {what} {label!r} is not in the training file {train_file} "
        f"(it has: {has}){more}: a model trained on it never predicts {label!r}; give a "
        "training file with every class, or leave the task out"
    )


def read_text(path: str | os.PathLike[str]) -> str:
    """The whole of a UTF-8 text file (local or any fsspec URL; .gz/.bz2/.zst inferred).

    A leading byte-order mark is dropped. Raises :class:`TaskDataError` when the file is
    missing or not UTF-8.
    """
    name = os.fspath(path)
    try:
        with open_url(name, "rb", compression="infer") as f:
            data = f.read()
    except FileNotFoundError:
        raise TaskDataError(f"{name}: file not found; check the task's data paths") from None
    except OSError as err:
        raise TaskDataError(f"{name}: cannot be read ({err}); check the path") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise TaskDataError(
            f"{name}: not UTF-8 text (bad byte at offset {err.start}); re-encode it as UTF-8"
        ) from None


@contextlib.contextmanager
def open_for_write(target: str | os.PathLike[str] | IO[str]) -> Iterator[IO[str]]:
    """A text stream to write to: ``target`` itself if it has ``write()``, else the file.

    Local paths are opened with ``open`` (parent folders created); URLs with ``://`` go
    through fsspec. A stream passed in is left open.
    """
    if hasattr(target, "write"):
        yield target  # type: ignore[misc]
        return
    name = os.fspath(target)  # type: ignore[arg-type]
    if "://" in name:
        with open_url(name, "wt", encoding="utf-8", newline="") as f:
            yield f
        return
    Path(name).parent.mkdir(parents=True, exist_ok=True)
    with open(name, "w", encoding="utf-8", newline="") as f:
        yield f


def lines_of(text: str) -> list[str]:
    """``text`` split at ``\\n`` only (``str.splitlines`` also splits at form feeds etc.)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def string_buffer(text: str) -> io.StringIO:
    """A stream over ``text`` for :mod:`csv` (newlines kept as they are)."""
    return io.StringIO(text, newline="")
