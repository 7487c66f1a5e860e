"""GLUE readers (all nine tasks, files as GLUE distributes them), a generic table reader,
sentence-pair featurization and GLUE submission files. The tasks' specs, columns and file
names are in :mod:`bertpipe.finetuning.tasks.glue_tasks`.

Every GLUE file is tab-separated and read with ``csv.QUOTE_NONE`` (MNLI, QQP, CoLA and
others hold unbalanced quote characters), one record per line. Columns are found by the
file's header, so train, dev and test layouts of a task all read with the same call; CoLA's
train and dev files have no header (``source, label, original label, sentence``).

Examples are :class:`PairExample`; ``label`` is the class id in ``spec.labels`` order
(classification), a float (regression) or ``None`` (unlabeled test files).

Features from :func:`featurize_pairs` (shared keys in :mod:`~bertpipe.finetuning.tasks.base`):

- ``input_ids`` int32 [N, S], ``token_type_ids`` int8 [N, S], ``attention_mask`` int8 [N, S],
  ``lengths`` int32 [N]: ``[CLS] A [SEP]`` or ``[CLS] A [SEP] B [SEP]``
- ``truncated`` bool [N]: the row lost tokens to ``max_seq_length``
- ``labels`` int64 [N] (classification) or float32 [N] (regression), only when every example
  is labeled. Row i is example i.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import IO, Literal

import numpy as np
from tokenizers import Tokenizer

from bertpipe.finetuning.tasks.base import (
    Features,
    ReadReport,
    TaskDataError,
    TaskKind,
    TaskSpec,
    encoded_features,
    lines_of,
    open_for_write,
    plain_tokenizer,
    read_text,
    special_ids,
    string_buffer,
)
from bertpipe.finetuning.tasks.glue_tasks import glue_task

__all__ = [
    "PairExample",
    "TableColumns",
    "encode_pairs",
    "featurize_pairs",
    "read_glue",
    "read_table",
    "table_spec",
    "truncate_pair_lengths",
    "write_glue_predictions",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PairExample:
    """One sentence (pair) with its label; ``line`` is where it sits in its file (1-based)."""

    guid: str
    text_a: str
    text_b: str | None
    label: int | float | None
    line: int


_COLA_NO_HEADER = ("source", "label", "original_label", "sentence")


def read_glue(task: str, path: str | os.PathLike[str]) -> tuple[list[PairExample], ReadReport]:
    """Read any GLUE train/dev/test file of ``task``; the layout is found from the header.

    Test files (no label column) give examples with ``label=None`` and ``guid`` from the
    index column. Raises :class:`TaskDataError` when the header does not fit the task or no
    row is usable.
    """
    glue = glue_task(task)
    name = os.fspath(path)
    lines = lines_of(read_text(name))
    report = ReadReport(name)
    if not lines:
        raise TaskDataError(f"{name}: empty file; download the GLUE {glue.spec.name} data again")
    rows = _tsv_rows(lines, report)
    first = rows[0][1] if rows else []
    if glue.spec.name == "cola" and first != ["index", "sentence"]:
        header: list[str] = list(_COLA_NO_HEADER)
        body = rows
    else:
        header, body = first, rows[1:]
    columns = _find_columns(name, header, glue.text_a, glue.text_b, glue.label, glue.index)
    stem = PurePosixPath(name).stem
    examples: list[PairExample] = []
    for line, fields in body:
        report.rows_read += 1
        if len(fields) != len(header):
            report.add(line, f"expected {len(header)} tab-separated columns, found {len(fields)}")
            continue
        a, b, lab, idx = columns
        example = _example(
            report,
            line,
            guid=fields[idx] if idx is not None else f"{stem}-{line}",
            text_a=fields[a],
            text_b=fields[b] if b is not None else None,
            raw_label=fields[lab] if lab is not None else None,
            spec=glue.spec,
            label_range=glue.label_range,
        )
        if example is not None:
            examples.append(example)
    report.rows_kept = len(examples)
    report.log()
    report.require_rows()
    return examples, report


def _tsv_rows(lines: Sequence[str], report: ReadReport) -> list[tuple[int, list[str]]]:
    """(1-based line, fields) per non-blank line, parsed with ``csv.QUOTE_NONE``.

    Blank lines hold no data and are passed over; a line :mod:`csv` rejects is a problem.
    """
    rows: list[tuple[int, list[str]]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            fields = next(csv.reader([line], delimiter="\t", quoting=csv.QUOTE_NONE))
        except csv.Error as err:
            report.rows_read += 1
            report.add(number, f"unreadable row ({err})")
            continue
        rows.append((number, fields))
    return rows


def _find_columns(
    name: str,
    header: Sequence[str],
    text_a: str,
    text_b: str | None,
    label: str | None,
    index: str | None,
) -> tuple[int, int | None, int | None, int | None]:
    """Positions of the text, label and index columns in ``header`` (None when absent)."""
    where = {column.strip(): i for i, column in enumerate(header)}
    for column in (text_a, text_b):
        if column is not None and column not in where:
            raise TaskDataError(
                f"{name}: header {list(header)} has no column {column!r}; check the file "
                "matches the task (or the column names given)"
            )
    return (
        where[text_a],
        where[text_b] if text_b is not None else None,
        where.get(label) if label is not None else None,
        where.get(index) if index is not None else None,
    )


def _example(
    report: ReadReport,
    line: int,
    *,
    guid: str,
    text_a: str,
    text_b: str | None,
    raw_label: str | None,
    spec: TaskSpec,
    label_range: tuple[float, float] | None,
) -> PairExample | None:
    """A checked example, or None after recording why the row cannot be used."""
    if not text_a.strip():
        report.add(line, "empty text (first sentence)")
        return None
    if text_b is not None and not text_b.strip():
        report.add(line, "empty text (second sentence)")
        return None
    label: int | float | None = None
    if raw_label is not None:
        raw = raw_label.strip()
        if spec.kind == "regression":
            try:
                label = float(raw)
            except ValueError:
                report.add(line, f"label {raw!r} is not a number")
                return None
            low, high = label_range if label_range is not None else (-math.inf, math.inf)
            if not math.isfinite(label) or not low <= label <= high:
                report.add(line, f"label {raw!r} is outside [{low}, {high}]")
                return None
        else:
            label = spec.label_to_id.get(raw)
            if label is None:
                report.add(line, f"unknown label {raw!r}; expected one of {list(spec.labels)}")
                return None
    return PairExample(guid, text_a, text_b, label, line)


@dataclass(frozen=True)
class TableColumns:
    """Column (or JSON key) names of a generic table: texts, label, and an optional row id."""

    text_a: str
    text_b: str | None = None
    label: str | None = None
    index: str | None = None


FileFormat = Literal["csv", "tsv", "jsonl"]
Quoting = Literal["auto", "csv", "none"]
_FORMATS = {
    ".csv": "csv",
    ".tsv": "tsv",
    ".txt": "tsv",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
}


def infer_format(path: str) -> FileFormat:
    """``csv``, ``tsv`` or ``jsonl`` from the file extension (a compression suffix is ignored)."""
    stem = path.lower()
    for suffix in (".gz", ".bz2", ".zst", ".xz"):
        stem = stem.removesuffix(suffix)
    ext = PurePosixPath(stem).suffix
    if ext not in _FORMATS:
        raise TaskDataError(
            f"{path}: cannot tell the format from {ext!r}; name it .csv, .tsv or .jsonl or "
            "pass file_format"
        )
    return _FORMATS[ext]  # type: ignore[return-value]


def _records(
    name: str, text: str, file_format: FileFormat, quoting: Quoting, report: ReadReport
) -> Iterable[tuple[int, dict[str, object]]]:
    """(1-based first line, column -> value) per data row; malformed rows become problems."""
    if file_format == "jsonl":
        for number, line in enumerate(lines_of(text), start=1):
            if not line.strip():
                continue
            report.rows_read += 1
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                report.add(number, f"invalid JSON ({err.msg})")
                continue
            if not isinstance(record, dict):
                report.add(number, f"expected a JSON object, found {type(record).__name__}")
                continue
            yield number, record
        return
    delimiter = "," if file_format == "csv" else "\t"
    quoted = quoting == "csv" or (quoting == "auto" and file_format == "csv")
    if quoted:
        reader = csv.reader(string_buffer(text), delimiter=delimiter)
        numbered: list[tuple[int, list[str]]] = []
        start = 1
        while True:
            try:
                fields = next(reader)
            except StopIteration:
                break
            except csv.Error as err:
                raise TaskDataError(
                    f"{name}: line {reader.line_num}: {err}; fix the quoting or read with "
                    "quoting='none'"
                ) from None
            if any(field.strip() for field in fields):
                numbered.append((start, fields))
            start = reader.line_num + 1
    else:
        numbered = []
        for number, line in enumerate(lines_of(text), start=1):
            if line.strip():
                numbered.append((number, line.split(delimiter)))
    if not numbered:
        raise TaskDataError(f"{name}: no header row; the file is empty")
    header = [column.strip() for column in numbered[0][1]]
    for number, fields in numbered[1:]:
        report.rows_read += 1
        if len(fields) != len(header):
            report.add(number, f"expected {len(header)} columns, found {len(fields)}")
            continue
        yield number, dict(zip(header, fields, strict=True))


def _as_text(value: object) -> str | None:
    """A JSON/CSV value as text: numbers without a spurious ``.0``; None stays None."""
    if value is None or isinstance(value, (dict, list)):
        return None
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def read_table(
    path: str | os.PathLike[str],
    columns: TableColumns,
    spec: TaskSpec,
    *,
    labeled: bool = True,
    file_format: FileFormat | None = None,
    quoting: Quoting = "auto",
    label_range: tuple[float, float] | None = None,
) -> tuple[list[PairExample], ReadReport]:
    """Read a CSV, TSV or JSON-lines file with named columns into :class:`PairExample`.

    ``quoting="auto"`` reads ``.csv`` with standard CSV quoting and ``.tsv`` with none (as
    GLUE files); ``labeled=False`` reads test files without a label column. Build ``spec``
    with :func:`table_spec` (it can infer the label list from the training file).
    """
    name = os.fspath(path)
    file_format = file_format or infer_format(name)
    report = ReadReport(name)
    stem = PurePosixPath(name).stem
    wanted = [c for c in (columns.text_a, columns.text_b) if c is not None]
    if labeled:
        if columns.label is None:
            raise ValueError("read_table(labeled=True) needs TableColumns.label")
        wanted.append(columns.label)
    examples: list[PairExample] = []
    for line, record in _records(name, read_text(name), file_format, quoting, report):
        values = {column: _as_text(record.get(column)) for column in wanted}
        missing = [column for column, value in values.items() if value is None]
        if missing:
            report.add(line, f"missing column(s) {missing}")
            continue
        guid = _as_text(record.get(columns.index)) if columns.index else None
        example = _example(
            report,
            line,
            guid=guid or f"{stem}-{line}",
            text_a=values[columns.text_a] or "",
            text_b=values[columns.text_b] if columns.text_b else None,
            raw_label=values[columns.label] if labeled and columns.label else None,
            spec=spec,
            label_range=label_range,
        )
        if example is not None:
            examples.append(example)
    report.rows_kept = len(examples)
    report.log()
    report.require_rows()
    return examples, report


def table_spec(
    name: str,
    kind: TaskKind,
    train_path: str | os.PathLike[str],
    columns: TableColumns,
    *,
    labels: Sequence[str] | None = None,
    main_metric: str | None = None,
    file_format: FileFormat | None = None,
    quoting: Quoting = "auto",
) -> TaskSpec:
    """The :class:`TaskSpec` of a generic table task.

    Classification labels are ``labels`` when given, else the sorted distinct values of the
    label column of ``train_path`` (numerically when all are integers). Metrics: accuracy and
    macro F1 (+ binary F1 of the second label for two classes), or Spearman, Pearson and MSE
    for regression.
    """
    if kind == "regression":
        metrics: tuple[str, ...] = ("spearman", "pearson", "mse")
        main = main_metric or "spearman"
        return TaskSpec(name, "regression", (), main, main != "mse", metrics)
    if kind != "classification":
        raise ValueError(f"table task {name}: kind must be classification or regression")
    if labels is None:
        labels = _infer_labels(train_path, columns, file_format, quoting)
    labels = tuple(labels)
    metrics = ("accuracy", "f1", "macro_f1") if len(labels) == 2 else ("accuracy", "macro_f1")
    positive = labels[1] if len(labels) == 2 else None
    return TaskSpec(
        name, "classification", labels, main_metric or "accuracy", True, metrics, positive
    )


def _infer_labels(
    path: str | os.PathLike[str],
    columns: TableColumns,
    file_format: FileFormat | None,
    quoting: Quoting,
) -> tuple[str, ...]:
    name = os.fspath(path)
    if columns.label is None:
        raise ValueError("inferring labels needs TableColumns.label")
    report = ReadReport(name)
    found: set[str] = set()
    for _, record in _records(
        name, read_text(name), file_format or infer_format(name), quoting, report
    ):
        value = _as_text(record.get(columns.label))
        if value is not None and value.strip():
            found.add(value.strip())
    if len(found) < 2:
        raise TaskDataError(
            f"{name}: column {columns.label!r} holds {len(found)} distinct labels; a "
            "classification task needs two or more (or pass the label list)"
        )
    if all(v.lstrip("-").isdigit() for v in found):
        return tuple(sorted(found, key=int))
    return tuple(sorted(found))


def truncate_pair_lengths(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """Lengths after BERT's ``_truncate_seq_pair``: drop the last token of the longer side
    (of B on a tie) until ``len_a + len_b <= budget``; computed without the loop."""
    if len_a + len_b <= budget:
        return len_a, len_b
    keep_a = min(len_a, max((budget + 1) // 2, budget - len_b))
    return keep_a, budget - keep_a


def encode_pairs(
    tokenizer: Tokenizer,
    texts_a: Sequence[str],
    texts_b: Sequence[str] | None,
    max_seq_length: int,
) -> Features:
    """Tokenize and build ``[CLS] A [SEP] (B [SEP])`` rows of at most ``max_seq_length``.

    Pairs are truncated longer side first, one token at a time (BERT's
    ``_truncate_seq_pair``); single texts are cut at the end. Returns ``input_ids`` int32
    [N, S], ``token_type_ids`` int8 [N, S], ``attention_mask`` int8 [N, S], ``lengths`` int32
    [N] and ``truncated`` bool [N], S = longest row.
    """
    if texts_b is not None and len(texts_b) != len(texts_a):
        raise ValueError(f"{len(texts_a)} first texts but {len(texts_b)} second texts")
    tok = plain_tokenizer(tokenizer)
    special = special_ids(tok)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no offsets needed here
    enc_a = encode(list(texts_a), add_special_tokens=False)
    enc_b = encode(list(texts_b), add_special_tokens=False) if texts_b is not None else None
    budget = max_seq_length - (3 if enc_b is not None else 2)
    if budget < 2:
        raise ValueError(f"max_seq_length {max_seq_length} leaves no room for text")
    rows: list[list[int]] = []
    types: list[list[int]] = []
    truncated = np.zeros(len(enc_a), dtype=bool)
    for i, ea in enumerate(enc_a):
        ids_a = ea.ids
        if enc_b is None:
            keep_a = min(len(ids_a), budget)
            truncated[i] = keep_a < len(ids_a)
            rows.append([special.cls, *ids_a[:keep_a], special.sep])
            types.append([0] * (keep_a + 2))
            continue
        ids_b = enc_b[i].ids
        keep_a, keep_b = truncate_pair_lengths(len(ids_a), len(ids_b), budget)
        truncated[i] = keep_a + keep_b < len(ids_a) + len(ids_b)
        rows.append([special.cls, *ids_a[:keep_a], special.sep, *ids_b[:keep_b], special.sep])
        types.append([0] * (keep_a + 2) + [1] * (keep_b + 1))
    features = encoded_features(rows, types, special.pad)
    features["truncated"] = truncated
    if truncated.any():
        logger.info(
            "%d of %d inputs truncated to %d tokens",
            int(truncated.sum()),
            len(rows),
            max_seq_length,
        )
    return features


def featurize_pairs(
    tokenizer: Tokenizer, examples: Sequence[PairExample], spec: TaskSpec, max_seq_length: int
) -> Features:
    """:func:`encode_pairs` of ``examples`` plus ``labels`` (int64 or float32 [N]) when all
    examples are labeled. Row i is ``examples[i]``."""
    if not examples:
        raise ValueError(f"task {spec.name}: no examples to featurize")
    has_b = [e.text_b is not None for e in examples]
    if any(has_b) and not all(has_b):
        raise ValueError(f"task {spec.name}: some examples have a second text and some do not")
    texts_b = [e.text_b or "" for e in examples] if all(has_b) else None
    features = encode_pairs(tokenizer, [e.text_a for e in examples], texts_b, max_seq_length)
    if all(e.label is not None for e in examples):
        dtype = np.float32 if spec.kind == "regression" else np.int64
        features["labels"] = np.array([e.label for e in examples], dtype=dtype)
    return features


def write_glue_predictions(
    target: str | os.PathLike[str] | IO[str],
    guids: Sequence[str],
    predictions: np.ndarray | Sequence[float],
    spec: TaskSpec,
) -> None:
    """Write a GLUE submission TSV: header ``index<TAB>prediction``, one row per example.

    ``predictions``: class ids [N] or logits [N, C] (classification; written as label
    names, e.g. ``entailment``, ``1``), or scores [N] / [N, 1] (regression, 3 decimals).
    """
    values = np.asarray(predictions)
    if spec.kind == "classification" and values.ndim == 2:
        values = values.argmax(axis=-1)
    values = values.reshape(len(guids), -1)[:, 0] if values.size == len(guids) else values
    if values.shape[0] != len(guids):
        raise ValueError(f"{len(guids)} ids but {values.shape[0]} predictions")
    with open_for_write(target) as out:
        out.write("index\tprediction\n")
        for guid, value in zip(guids, values, strict=True):
            text = f"{float(value):.3f}" if spec.kind == "regression" else spec.labels[int(value)]
            out.write(f"{guid}\t{text}\n")
