"""SQuAD v1.1 / v2.0: JSON reader, windowed features, span decoding, EM/F1, prediction files.

Contexts and questions are tokenized separately (no special tokens), so every token's
``offsets`` are character offsets into the original context; windows are assembled as
``[CLS] question [SEP] context-window [SEP]`` with ids read from the tokenizer.

Features from :func:`featurize_squad` (shared keys in :mod:`bertpipe.finetuning.tasks.base`):

- ``input_ids`` int32 [N, S], ``token_type_ids`` int8 [N, S] (1 on the window and last
  ``[SEP]``), ``attention_mask`` int8 [N, S], ``lengths`` int32 [N]
- ``example_index`` int32 [N]: index into the example list the features were built from
- ``offset_mapping`` int32 [N, S, 2]: [start, end) character offsets into the context for
  context tokens, -1 elsewhere (question, specials, padding)
- ``token_is_max_context`` bool [N, S]: this window gives the token its most context (the
  BERT reference's ``_check_is_max_context``); only such tokens may start an answer
- ``start_positions``, ``end_positions`` int64 [N] (``training=True`` only): answer token
  positions inside the row, 0 (``[CLS]``) when the answer is outside the window or the
  question is impossible

Scores follow the official ``evaluate-v2.0.py`` (which also scores v1.1 files the same way):
percentages in [0, 100], unlike the GLUE metrics, which are fractions.
"""

from __future__ import annotations

import bisect
import collections
import json
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
from tokenizers import Tokenizer

from bertpipe.config import ConfigError
from bertpipe.finetuning.tasks.base import (
    Features,
    ReadReport,
    TaskDataError,
    TaskSpec,
    encoded_features,
    open_for_write,
    plain_tokenizer,
    read_text,
    special_ids,
)
from bertpipe.fsio import join

__all__ = [
    "SquadAnswer",
    "SquadExample",
    "check_squad_lengths",
    "decode",
    "featurize_squad",
    "read_squad",
    "squad_spec",
    "write_json",
    "write_squad_predictions",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SquadAnswer:
    """An answer as the file gives it: text and character offset into the context."""

    text: str
    start: int


@dataclass(frozen=True)
class SquadExample:
    """One question. ``answers`` are all gold answers of the file (each still scores EM/F1);
    ``train_answer`` is the first one that matches the context at its offset, or None."""

    qid: str
    question: str
    context: str
    answers: tuple[SquadAnswer, ...]
    is_impossible: bool
    train_answer: SquadAnswer | None
    plausible_answers: tuple[SquadAnswer, ...] = ()
    title: str = ""


def squad_spec(version_2: bool) -> TaskSpec:
    """The spec of SQuAD v1.1 or v2.0: span QA scored by F1 (and exact match)."""
    name = "squad_v2" if version_2 else "squad"
    return TaskSpec(name, "span_qa", (), "f1", True, ("f1", "exact"))


def check_squad_lengths(max_seq_length: int, max_query_length: int, doc_stride: int) -> None:
    """Raise :class:`ConfigError` when the window lengths leave no room for the context."""
    if max_query_length < 1:
        raise ConfigError("task.max_query_length", "must be 1 or more (BERT uses 64)")
    if doc_stride < 1:
        raise ConfigError("task.doc_stride", "must be 1 or more (BERT uses 128)")
    if max_seq_length - max_query_length - 3 < 1:
        raise ConfigError(
            "task.max_query_length",
            f"{max_query_length} leaves no context tokens in task.max_seq_length="
            f"{max_seq_length}; make it smaller than max_seq_length - 3",
        )


class LineFinder:
    """Line numbers of record ids (the string values of ``key``) in the raw JSON, built on
    the first look-up; 1 for an id not found."""

    def __init__(self, text: str, key: str = "id") -> None:
        self._text = text
        self._id = re.compile(rf'"{re.escape(key)}"\s*:\s*"((?:[^"\\]|\\.)*)"')
        self._lines: dict[str, int] | None = None

    def line(self, qid: object) -> int:
        if self._lines is None:
            newlines = [m.start() for m in re.finditer("\n", self._text)]
            self._lines = {}
            for match in self._id.finditer(self._text):
                try:
                    key = json.loads(f'"{match.group(1)}"')
                except json.JSONDecodeError:
                    continue
                self._lines.setdefault(key, bisect.bisect_left(newlines, match.start()) + 1)
        return self._lines.get(str(qid), 1)


def _answers(raw: object) -> list[SquadAnswer] | None:
    """Answers from a JSON list, or None when any entry is malformed."""
    if not isinstance(raw, list):
        return None
    out = []
    for item in raw:
        if not isinstance(item, dict):
            return None
        text, start = item.get("text"), item.get("answer_start")
        if not isinstance(text, str) or not isinstance(start, int) or isinstance(start, bool):
            return None
        out.append(SquadAnswer(text, start))
    return out


def read_squad(
    path: str | os.PathLike[str], version_2: bool | None = None, id_key: str = "id"
) -> tuple[list[SquadExample], ReadReport]:
    """Read a SQuAD JSON file (``data[].paragraphs[].context/qas[]``).

    ``version_2=None`` detects v2.0 from ``version`` or any ``is_impossible`` key.
    ``id_key``: the question's id field (KLUE-MRC's files name it ``guid``). Problems:
    malformed entries, empty questions, duplicate ids, answerable questions without answers
    (dropped); answers whose ``answer_start`` lies outside the context (negative, or past
    its end), whose text is empty, or whose text does not match the context at
    ``answer_start`` (question kept for evaluation, answer skipped for training).
    """
    name = os.fspath(path)
    text = read_text(name)
    try:
        root = json.loads(text)
    except json.JSONDecodeError as err:
        raise TaskDataError(
            f"{name}: invalid JSON at line {err.lineno} column {err.colno} ({err.msg}); "
            "download the SQuAD file again"
        ) from None
    if not isinstance(root, dict) or not isinstance(root.get("data"), list):
        raise TaskDataError(f"{name}: no top-level 'data' list; is this a SQuAD JSON file?")
    if version_2 is None:
        version_2 = str(root.get("version", "")).lstrip("v").startswith("2") or (
            '"is_impossible"' in text
        )
    report = ReadReport(name)
    lines = LineFinder(text, id_key)
    examples: list[SquadExample] = []
    seen: set[str] = set()
    for a, article in enumerate(root["data"]):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            report.add(1, f"data[{a}] has no 'paragraphs' list; skipped")
            continue
        title = str(article.get("title", ""))
        for p, paragraph in enumerate(paragraphs):
            where = f"data[{a}].paragraphs[{p}]"
            context = paragraph.get("context") if isinstance(paragraph, dict) else None
            qas = paragraph.get("qas") if isinstance(paragraph, dict) else None
            if not isinstance(context, str) or not context.strip() or not isinstance(qas, list):
                report.add(1, f"{where} lacks a non-empty 'context' or a 'qas' list; skipped")
                continue
            for q, qa in enumerate(qas):
                report.rows_read += 1
                where_q = f"{where}.qas[{q}]"
                result = _example(qa, context, title, where_q, version_2, seen, id_key)
                if isinstance(result, str):
                    qid = qa.get(id_key) if isinstance(qa, dict) else None
                    report.add(lines.line(qid), result)
                    continue
                example, mismatched = result
                for answer, reason in mismatched:
                    report.add(
                        lines.line(example.qid),
                        f"question {example.qid} ({where}.qas[{q}]): answer {answer.text!r} "
                        f"{reason}; skipped for training, kept for evaluation",
                    )
                seen.add(example.qid)
                examples.append(example)
    report.rows_kept = len(examples)
    report.log()
    report.require_rows()
    return examples, report


def _answer_problem(answer: SquadAnswer, context: str) -> str | None:
    """Why ``answer`` cannot be trained on (its span is not in ``context``), or None.

    Python slicing would accept a negative offset (counted from the end) and an empty text
    anywhere, so both are checked before the text is compared.
    """
    end = answer.start + len(answer.text)
    if not 0 <= answer.start < len(context):
        return f"has answer_start {answer.start}, outside the context ({len(context)} characters)"
    if end > len(context):
        return (
            f"at answer_start {answer.start} runs {end - len(context)} character(s) past the "
            f"end of the context ({len(context)} characters)"
        )
    if not answer.text:
        return f"is empty (answer_start {answer.start})"
    found = context[answer.start : end]
    if found != answer.text:
        return f"does not match the context at {answer.start} ({found!r})"
    return None


def _example(
    qa: object,
    context: str,
    title: str,
    where: str,
    version_2: bool,
    seen: set[str],
    id_key: str = "id",
) -> str | tuple[SquadExample, list[tuple[SquadAnswer, str]]]:
    """The example and its unusable answers with the reasons, or why the question is
    dropped."""
    if not isinstance(qa, dict):
        return f"{where} is not an object; dropped"
    qid, question = qa.get(id_key), qa.get("question")
    if not isinstance(qid, str) or not qid:
        return f"{where} has no {id_key!r}; dropped"
    if qid in seen:
        return f"question {qid} ({where}): duplicate id; dropped"
    if not isinstance(question, str) or not question.strip():
        return f"question {qid} ({where}): empty question; dropped"
    answers = _answers(qa.get("answers", []))
    plausible = _answers(qa.get("plausible_answers", [])) or []
    if answers is None:
        return f"question {qid} ({where}): malformed 'answers' (need text and answer_start)"
    impossible = bool(qa.get("is_impossible", False)) and version_2
    if not impossible and not answers:
        return f"question {qid} ({where}): no answers and not marked impossible; dropped"
    problems = [(x, _answer_problem(x, context)) for x in answers]
    mismatched = [(x, reason) for x, reason in problems if reason is not None]
    matching = [x for x, reason in problems if reason is None]
    train = None if impossible or not matching else matching[0]
    example = SquadExample(
        qid, question, context, tuple(answers), impossible, train, tuple(plausible), title
    )
    return example, mismatched


def _doc_spans(num_tokens: int, window: int, doc_stride: int) -> list[tuple[int, int]]:
    """(start, length) windows over ``num_tokens`` context tokens, as the BERT reference."""
    spans: list[tuple[int, int]] = []
    start = 0
    while True:
        length = min(num_tokens - start, window)
        spans.append((start, length))
        if start + length >= num_tokens:
            return spans
        start += min(length, doc_stride)


def _max_context(spans: Sequence[tuple[int, int]], num_tokens: int) -> np.ndarray:
    """Index of the span where each context token has the most context: [num_tokens].

    Score of token t in span (s, n): min(t - s, s + n - 1 - t) + 0.01 * n; the first span
    with the highest score wins (BERT's ``_check_is_max_context``).
    """
    best = np.full(num_tokens, -np.inf)
    owner = np.zeros(num_tokens, dtype=np.int64)
    for k, (start, length) in enumerate(spans):
        t = np.arange(start, start + length)
        score = np.minimum(t - start, start + length - 1 - t) + 0.01 * length
        better = score > best[t]
        best[t[better]] = score[better]
        owner[t[better]] = k
    return owner


def featurize_squad(
    tokenizer: Tokenizer,
    examples: Sequence[SquadExample],
    *,
    max_seq_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int = 64,
    training: bool,
) -> Features:
    """Windowed features for ``examples`` (layout in the module docstring).

    With ``training=True`` answerable examples without a matching answer are skipped
    (counted in the log) and ``start_positions``/``end_positions`` are added.
    """
    check_squad_lengths(max_seq_length, max_query_length, doc_stride)
    tok = plain_tokenizer(tokenizer)
    special = special_ids(tok)
    questions = tok.encode_batch([e.question for e in examples], add_special_tokens=False)
    unique = list(dict.fromkeys(e.context for e in examples))
    encoded = dict(zip(unique, tok.encode_batch(unique, add_special_tokens=False), strict=True))
    rows: list[list[int]] = []
    types: list[list[int]] = []
    offsets: list[list[tuple[int, int]]] = []
    is_max: list[list[bool]] = []
    example_index: list[int] = []
    positions: list[tuple[int, int]] = []
    skipped = 0
    for i, example in enumerate(examples):
        if training and not example.is_impossible and example.train_answer is None:
            skipped += 1
            continue
        query = questions[i].ids[:max_query_length]
        ctx = encoded[example.context]
        ctx_offsets = ctx.offsets
        answer = _answer_tokens(ctx_offsets, example.train_answer) if training else None
        if training and not example.is_impossible and answer is None:
            skipped += 1
            continue
        spans = _doc_spans(len(ctx.ids), max_seq_length - len(query) - 3, doc_stride)
        owner = _max_context(spans, len(ctx.ids))
        head = len(query) + 2
        for k, (start, length) in enumerate(spans):
            end = start + length
            rows.append([special.cls, *query, special.sep, *ctx.ids[start:end], special.sep])
            types.append([0] * head + [1] * (length + 1))
            offsets.append([(-1, -1)] * head + list(ctx_offsets[start:end]) + [(-1, -1)])
            is_max.append([False] * head + list(owner[start:end] == k) + [False])
            example_index.append(i)
            if answer is not None and start <= answer[0] and answer[1] < end:
                positions.append((answer[0] - start + head, answer[1] - start + head))
            else:
                positions.append((0, 0))
    if skipped:
        logger.warning(
            "%d of %d questions have no answer that matches their context; not used for training",
            skipped,
            len(examples),
        )
    if not rows:
        raise ValueError("no SQuAD features: every question was skipped")
    features = encoded_features(rows, types, special.pad)
    width = features["input_ids"].shape[1]
    offset_mapping = np.full((len(rows), width, 2), -1, dtype=np.int32)
    max_context = np.zeros((len(rows), width), dtype=bool)
    for r, (row_offsets, row_max) in enumerate(zip(offsets, is_max, strict=True)):
        offset_mapping[r, : len(row_offsets)] = row_offsets
        max_context[r, : len(row_max)] = row_max
    features["example_index"] = np.array(example_index, dtype=np.int32)
    features["offset_mapping"] = offset_mapping
    features["token_is_max_context"] = max_context
    if training:
        features["start_positions"] = np.array([p[0] for p in positions], dtype=np.int64)
        features["end_positions"] = np.array([p[1] for p in positions], dtype=np.int64)
    return features


def _answer_tokens(
    offsets: Sequence[tuple[int, int]], answer: SquadAnswer | None
) -> tuple[int, int] | None:
    """First and last context token overlapping the answer's characters, or None."""
    if answer is None:
        return None
    start_char, end_char = answer.start, answer.start + len(answer.text)
    ends = [o[1] for o in offsets]
    starts = [o[0] for o in offsets]
    first = bisect.bisect_right(ends, start_char)
    last = bisect.bisect_left(starts, end_char) - 1
    if first >= len(offsets) or last < first:
        return None
    return first, last


def _row(logits: np.ndarray | Sequence[np.ndarray], i: int, length: int) -> np.ndarray:
    row = np.asarray(logits[i], dtype=np.float64)
    if row.shape[0] < length:
        raise ValueError(f"logits row {i} has {row.shape[0]} positions, the feature {length}")
    return row[:length]


def decode(
    examples: Sequence[SquadExample],
    features: Features,
    start_logits: np.ndarray | Sequence[np.ndarray],
    end_logits: np.ndarray | Sequence[np.ndarray],
    n_best_size: int = 20,
    max_answer_length: int = 30,
    version_2: bool = False,
    null_score_diff_threshold: float = 0.0,
) -> tuple[dict[str, str], dict[str, list[dict[str, Any]]], dict[str, float]]:
    """Turn span logits into answers: the exact substring of each original context.

    ``start_logits``/``end_logits``: [N, S'] with S' >= each row's length, or N 1-D arrays
    (one per feature row, e.g. batches of different widths). Returns ``predictions``
    (qid -> text; "" means no answer), ``nbest`` (qid -> entries with text, probability,
    start_logit, end_logit, start_char) and ``null_odds`` (qid -> null score minus best span
    score; +inf when no span is valid). With ``version_2`` the answer is "" when the null
    odds exceed ``null_score_diff_threshold``.
    """
    by_example: dict[int, list[int]] = collections.defaultdict(list)
    for row, index in enumerate(features["example_index"]):
        by_example[int(index)].append(row)
    predictions: dict[str, str] = {}
    nbest_out: dict[str, list[dict[str, Any]]] = {}
    null_odds: dict[str, float] = {}
    for i, example in enumerate(examples):
        candidates: list[tuple[float, float, float, int, int]] = []
        null_start = null_end = 0.0
        null_score = math.inf
        for row in by_example.get(i, []):
            length = int(features["lengths"][row])
            starts = _row(start_logits, row, length)
            ends = _row(end_logits, row, length)
            char_start = features["offset_mapping"][row, :length, 0].tolist()
            char_end = features["offset_mapping"][row, :length, 1].tolist()
            is_max = features["token_is_max_context"][row, :length].tolist()
            if starts[0] + ends[0] < null_score:
                null_score, null_start, null_end = starts[0] + ends[0], starts[0], ends[0]
            top_starts = np.argsort(-starts, kind="stable")[:n_best_size].tolist()
            top_ends = np.argsort(-ends, kind="stable")[:n_best_size].tolist()
            for s in top_starts:
                if char_start[s] < 0 or not is_max[s]:
                    continue
                for e in top_ends:
                    if char_start[e] < 0 or e < s or e - s + 1 > max_answer_length:
                        continue
                    score = float(starts[s] + ends[e])
                    candidates.append((score, starts[s], ends[e], char_start[s], char_end[e]))
        candidates.sort(key=lambda c: -c[0])
        entries: list[dict[str, Any]] = []
        texts: set[str] = set()
        if version_2 and by_example.get(i):
            candidates.append((null_score, null_start, null_end, -1, -1))
            candidates.sort(key=lambda c: -c[0])
        for _score, s_logit, e_logit, first, last in candidates:
            text = example.context[first:last] if first >= 0 else ""
            if text in texts:
                continue
            texts.add(text)
            entries.append(_entry(text, s_logit, e_logit, first))
            if len(entries) >= n_best_size:
                break
        if version_2 and by_example.get(i) and "" not in texts:
            entries.append(_entry("", null_start, null_end, -1))
        if not entries:
            entries.append(_entry("", 0.0, 0.0, -1))
        scores = np.array([x["start_logit"] + x["end_logit"] for x in entries])
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        for entry, prob in zip(entries, probs, strict=True):
            entry["probability"] = float(prob)
        best = next((x for x in entries if x["text"]), None)
        if best is None:
            null_odds[example.qid] = math.inf
            predictions[example.qid] = ""
        else:
            null_odds[example.qid] = float(null_score - best["start_logit"] - best["end_logit"])
            no_answer = version_2 and null_odds[example.qid] > null_score_diff_threshold
            predictions[example.qid] = "" if no_answer else best["text"]
        nbest_out[example.qid] = entries
    missing = sum(1 for i in range(len(examples)) if i not in by_example)
    if missing:
        logger.warning("%d questions have no feature rows; predicted as empty", missing)
    return predictions, nbest_out, null_odds


def _entry(text: str, start_logit: float, end_logit: float, start_char: int) -> dict[str, Any]:
    return {
        "text": text,
        "probability": 0.0,
        "start_logit": float(start_logit),
        "end_logit": float(end_logit),
        "start_char": int(start_char),
    }


def write_json(target: str | os.PathLike[str] | IO[str], obj: object) -> None:
    """Write ``obj`` as indented JSON (non-finite floats as ``Infinity``, as Python reads)."""
    with open_for_write(target) as out:
        json.dump(obj, out, indent=2, ensure_ascii=False)
        out.write("\n")


def write_squad_predictions(
    out_dir: str,
    predictions: Mapping[str, str],
    nbest: Mapping[str, list[dict[str, Any]]] | None = None,
    null_odds: Mapping[str, float] | None = None,
) -> list[str]:
    """Write ``predictions.json`` (+ ``nbest_predictions.json``, ``null_odds.json``) into
    ``out_dir`` (local folder or URL); returns the paths written."""
    written = []
    for name, obj in (
        ("predictions.json", predictions),
        ("nbest_predictions.json", nbest),
        ("null_odds.json", null_odds),
    ):
        if obj is not None:
            path = join(out_dir, name)
            write_json(path, dict(obj))
            written.append(path)
    return written
