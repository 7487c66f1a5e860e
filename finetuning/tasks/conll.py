"""CoNLL-2003 style named-entity data: reader, IOB1 -> IOB2, first-sub-token features,
word-level alignment of predictions, entity-level scores (seqeval, conlleval's rules) and the
three-column prediction file.

Input: one token per line, ``word POS chunk NER`` (CoNLL-2003) or ``word label``; the label
is the last column. Blank lines separate sentences; ``-DOCSTART-`` lines are skipped.

Features from :func:`featurize_conll` (shared keys in :mod:`bertpipe.finetuning.tasks.base`), row i
is sentence i:

- ``input_ids`` int32 [N, S], ``token_type_ids`` int8 [N, S] (all 0), ``attention_mask``
  int8 [N, S], ``lengths`` int32 [N]: ``[CLS] sub-tokens [SEP]``
- ``labels`` int64 [N, S]: the word's label id on its FIRST sub-token, -100 on the other
  sub-tokens, on ``[CLS]``/``[SEP]`` and on padding
- ``word_ids`` int32 [N, S]: index of the word whose first sub-token sits there, else -1
- ``truncated`` bool [N]: the sentence lost sub-tokens to ``max_seq_length``; words cut off
  get no prediction and are scored as ``O``
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

import numpy as np
from seqeval.metrics import accuracy_score as seqeval_accuracy
from seqeval.metrics.sequence_labeling import get_entities
from seqeval.metrics.sequence_labeling import precision_recall_fscore_support as seqeval_prf
from tokenizers import Tokenizer

from bertpipe.finetuning.tasks.base import (
    IGNORE_INDEX,
    Features,
    ReadReport,
    TaskSpec,
    encoded_features,
    lines_of,
    open_for_write,
    pad_rows,
    plain_tokenizer,
    read_text,
    special_ids,
)

__all__ = [
    "Sentence",
    "align_predictions",
    "conll_labels",
    "conll_spec",
    "entities",
    "entity_scores",
    "featurize_conll",
    "iob1_to_iob2",
    "read_conll",
    "write_conll_predictions",
]

logger = logging.getLogger(__name__)

_LABEL = re.compile(r"^(O|[BIES]-\S+)$")
_PREFIX_ORDER = ("B", "I", "E", "S")


@dataclass(frozen=True)
class Sentence:
    """Words and their labels (IOB2 after reading); ``line`` is the first word's line."""

    words: tuple[str, ...]
    labels: tuple[str, ...]
    line: int


def iob1_to_iob2(labels: Sequence[str]) -> list[str]:
    """IOB1 -> IOB2: an ``I-X`` that does not continue an ``X`` entity becomes ``B-X``.

    IOB2 input comes back unchanged, so the conversion is safe on either scheme.
    """
    out: list[str] = []
    previous = "O"
    for label in labels:
        if label.startswith("I-") and (previous == "O" or previous[2:] != label[2:]):
            label = "B-" + label[2:]
        out.append(label)
        previous = label
    return out


def read_conll(
    path: str | os.PathLike[str],
    labels: Sequence[str] | None = None,
    convert_iob1: bool = True,
) -> tuple[list[Sentence], ReadReport]:
    """Read a CoNLL file into sentences; a bad line drops its whole sentence (reported).

    Problems that drop the sentence: a line whose column count differs from the file's first
    token line or has fewer than two columns, a label that is not ``O``/``B-X``/``I-X``/
    ``E-X``/``S-X``. A well-formed label outside ``labels`` (when given: the model's labels,
    e.g. an entity type the training file never has) is reported but its sentence is kept,
    so that an evaluation scores the whole file: :func:`featurize_conll` trains such words
    as ``O`` and :func:`entity_scores` counts their gold entities, which the model cannot
    predict, as missed. Labels are converted from IOB1 to IOB2 unless ``convert_iob1`` is
    False.
    """
    name = os.fspath(path)
    report = ReadReport(name)
    allowed = set(labels) if labels is not None else None
    sentences: list[Sentence] = []
    columns = 0
    words: list[str] = []
    tags: list[str] = []
    numbers: list[int] = []
    bad = False

    def finish() -> None:
        nonlocal bad
        if words:
            report.rows_read += 1
            if not bad:
                fixed = iob1_to_iob2(tags) if convert_iob1 else list(tags)
                pairs = zip(numbers, fixed, strict=True)
                unknown = [(n, t) for n, t in pairs if allowed is not None and t not in allowed]
                if unknown:  # kept: an evaluation must score every sentence
                    report.add(
                        unknown[0][0],
                        f"unknown label {unknown[0][1]!r} (not one of the task's labels); "
                        "sentence kept: such words are O for the loss, and their entities "
                        "count as missed when scored",
                    )
                sentences.append(Sentence(tuple(words), tuple(fixed), numbers[0]))
        words.clear()
        tags.clear()
        numbers.clear()
        bad = False

    for number, line in enumerate(lines_of(read_text(name)), start=1):
        fields = line.split()
        if not fields or fields[0] == "-DOCSTART-":
            finish()
            continue
        columns = columns or len(fields)
        if bad:
            continue
        if len(fields) < 2 or len(fields) != columns:
            report.add(
                number, f"expected {max(columns, 2)} columns, found {len(fields)}; sentence dropped"
            )
            bad = True
        elif not _LABEL.match(fields[-1]):
            report.add(
                number, f"label {fields[-1]!r} is not O or B-/I-/E-/S-TYPE; sentence dropped"
            )
            bad = True
        words.append(fields[0])
        tags.append(fields[-1])
        numbers.append(number)
    finish()
    report.rows_kept = len(sentences)
    report.log()
    report.require_rows()
    return sentences, report


def conll_labels(sentences: Sequence[Sentence]) -> tuple[str, ...]:
    """``O`` then, per entity type in sorted order, every prefix seen in the data (B, I, ...)."""
    types: set[str] = set()
    prefixes: set[str] = {"B", "I"}
    for sentence in sentences:
        for label in sentence.labels:
            if label != "O":
                prefixes.add(label[0])
                types.add(label[2:])
    order = [p for p in _PREFIX_ORDER if p in prefixes]
    return ("O", *(f"{p}-{t}" for t in sorted(types) for p in order))


def conll_spec(
    name: str, sentences: Sequence[Sentence] | None = None, labels: Sequence[str] | None = None
) -> TaskSpec:
    """Token-label spec: ``labels`` as given, else :func:`conll_labels` of ``sentences``;
    scored by entity-level micro F1."""
    if labels is None:
        if sentences is None:
            raise ValueError(f"task {name}: give the label list or the training sentences")
        labels = conll_labels(sentences)
    metrics = ("f1", "precision", "recall", "token_accuracy")
    return TaskSpec(name, "token_labels", tuple(labels), "f1", True, metrics)


def featurize_conll(
    tokenizer: Tokenizer, sentences: Sequence[Sentence], spec: TaskSpec, max_seq_length: int
) -> Features:
    """First-sub-token features of ``sentences`` (layout in the module docstring).

    A word the tokenizer turns into no token at all (e.g. a lone control character) becomes
    ``[UNK]`` so that every word keeps a position. Truncated sentences are counted in a
    warning. A label outside ``spec.labels`` (reported by :func:`read_conll`) gets the id of
    ``O`` (of the loss's ignore index when there is no ``O``); the sentence's own labels,
    which evaluation scores, are not changed.
    """
    tok = plain_tokenizer(tokenizer)
    special = special_ids(tok)
    label_ids = spec.label_to_id
    fallback = label_ids.get("O", IGNORE_INDEX)
    budget = max_seq_length - 2
    encodings = tok.encode_batch(
        [list(s.words) for s in sentences], is_pretokenized=True, add_special_tokens=False
    )
    rows: list[list[int]] = []
    label_rows: list[list[int]] = []
    word_rows: list[list[int]] = []
    truncated = np.zeros(len(sentences), dtype=bool)
    words_lost = 0
    for i, (sentence, encoding) in enumerate(zip(sentences, encodings, strict=True)):
        pieces: list[list[int]] = [[] for _ in sentence.words]
        for token_id, word in zip(encoding.ids, encoding.word_ids, strict=True):
            if word is not None:
                pieces[word].append(token_id)
        ids, labels, word_ids = [special.cls], [IGNORE_INDEX], [-1]
        for w, word_pieces in enumerate(pieces):
            for j, token_id in enumerate(word_pieces or [special.unk]):
                if len(ids) - 1 >= budget:
                    truncated[i] = True
                    break
                ids.append(token_id)
                labels.append(
                    label_ids.get(sentence.labels[w], fallback) if j == 0 else IGNORE_INDEX
                )
                word_ids.append(w if j == 0 else -1)
            if truncated[i]:
                words_lost += len(pieces) - sum(1 for x in word_ids if x >= 0)
                break
        rows.append([*ids, special.sep])
        label_rows.append([*labels, IGNORE_INDEX])
        word_rows.append([*word_ids, -1])
    features = encoded_features(rows, [[0] * len(r) for r in rows], special.pad)
    features["labels"] = pad_rows(label_rows, IGNORE_INDEX, np.int64)
    features["word_ids"] = pad_rows(word_rows, -1, np.int32)
    features["truncated"] = truncated
    if truncated.any():
        logger.warning(
            "%d of %d sentences are longer than max_seq_length=%d and were truncated; %d words "
            "get no prediction and are scored as O",
            int(truncated.sum()),
            len(sentences),
            max_seq_length,
            words_lost,
        )
    return features


def align_predictions(
    features: Features,
    predictions: np.ndarray | Sequence[np.ndarray],
    sentences: Sequence[Sentence],
    spec: TaskSpec,
) -> list[list[str]]:
    """Word-level labels from token-level predictions, read at each word's first sub-token.

    ``predictions``: label ids [N, S'] or logits [N, S', C] (S' >= each row's length), or N
    per-row arrays. Words cut off by truncation get ``O``. Returns one list per sentence.
    """
    out: list[list[str]] = []
    for i, sentence in enumerate(sentences):
        length = int(features["lengths"][i])
        row = np.asarray(predictions[i])
        if row.ndim == 2:
            row = row.argmax(axis=-1)
        if row.shape[0] < length:
            raise ValueError(f"predictions row {i} has {row.shape[0]} positions, needs {length}")
        labels = ["O"] * len(sentence.words)
        word_ids = features["word_ids"][i, :length]
        for position in np.flatnonzero(word_ids >= 0):
            labels[int(word_ids[position])] = spec.labels[int(row[position])]
        out.append(labels)
    return out


def entities(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """Entity spans ``(type, first, last)`` (inclusive word indices) by seqeval's default
    mode, which follows conlleval: an ``I-X`` after ``O`` or after another type starts a new
    entity."""
    return [(kind, first, last) for kind, first, last in get_entities(list(tags))]


def entity_scores(
    gold: Sequence[Sequence[str]], predicted: Sequence[Sequence[str]]
) -> dict[str, float]:
    """Entity-level precision, recall and F1 (exact span and type), micro-averaged over all
    sentences, plus ``token_accuracy`` and ``<TYPE>_precision/_recall/_f1/_support`` per
    type (every type in either side). Fractions in [0, 1]; 0.0 where a ratio has nothing to
    count.

    Computed by seqeval in its default mode, the conlleval rules (the CoNLL-2003 shared
    task's scorer): an ``I-X`` that does not continue an ``X`` entity starts one, so a
    prediction that opens an entity with ``I-`` is still scored. seqeval's ``mode="strict"``
    with ``scheme=IOB2`` drops such entities instead (KLUE-NER's scorer uses it; see
    :mod:`bertpipe.finetuning.tasks.klue`)."""
    if len(gold) != len(predicted):
        raise ValueError(f"{len(gold)} gold sentences but {len(predicted)} predicted")
    for i, (g, p) in enumerate(zip(gold, predicted, strict=True)):
        if len(g) != len(p):
            raise ValueError(f"sentence {i}: {len(g)} gold labels but {len(p)} predicted")
    y_true = [list(g) for g in gold]
    y_pred = [list(p) for p in predicted]
    tokens = sum(len(g) for g in y_true)
    precision, recall, f1, _ = seqeval_prf(y_true, y_pred, average="micro", zero_division=0)
    out = {
        "precision": float(precision),
        "recall": float(recall),
        "f1": float(f1),
        "token_accuracy": float(seqeval_accuracy(y_true, y_pred)) if tokens else 0.0,
    }
    kinds = sorted({e[0] for e in get_entities(y_true)} | {e[0] for e in get_entities(y_pred)})
    if kinds:  # seqeval's per-type arrays are in this (sorted) order
        per_type = seqeval_prf(y_true, y_pred, average=None, zero_division=0)
        for k, kind in enumerate(kinds):
            type_p, type_r, type_f, support = (float(a[k]) for a in per_type)
            out.update({f"{kind}_precision": type_p, f"{kind}_recall": type_r})
            out.update({f"{kind}_f1": type_f, f"{kind}_support": support})
    return out


def write_conll_predictions(
    target: str | os.PathLike[str] | IO[str],
    sentences: Sequence[Sentence],
    predicted: Sequence[Sequence[str]],
) -> None:
    """Write ``word gold predicted`` per line, a blank line after each sentence (the input
    format of conlleval)."""
    if len(sentences) != len(predicted):
        raise ValueError(f"{len(sentences)} sentences but {len(predicted)} predictions")
    with open_for_write(target) as out:
        for sentence, labels in zip(sentences, predicted, strict=True):
            for word, gold, pred in zip(sentence.words, sentence.labels, labels, strict=True):
                out.write(f"{word} {gold} {pred}\n")
            out.write("\n")
