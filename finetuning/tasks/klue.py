"""KLUE (Korean Language Understanding Evaluation, Park et al. 2021): five of its tasks read
as its GitHub release lays out the files, scored with KLUE's own metrics.

The layout (``klue_benchmark/`` of https://github.com/KLUE-benchmark/KLUE, v1.1) and the
fields and metrics are those of KLUE's baseline code (``KLUE-benchmark/KLUE-baseline``:
``klue_baseline/data/*.py`` and ``klue_baseline/metrics/{functional,utils}.py``):

========  ===================================  ==========================================
task      files (``<folder>/<folder>_train``)  metrics (KLUE's names)
========  ===================================  ==========================================
``ynat``  ``ynat-v1.1/*.json``                 ``macro_f1`` (scikit-learn, macro)
``sts``   ``klue-sts-v1.1/*.json``             ``pearson`` of ``labels.real-label``; ``f1`` of
                                               both sides binarised at 3.0
``nli``   ``klue-nli-v1.1/*.json``             ``accuracy``
``ner``   ``klue-ner-v1.1/*.tsv``              ``entity_macro_f1`` (seqeval, strict IOB2,
                                               macro), ``character_macro_f1`` (scikit-learn)
``mrc``   ``klue-mrc-v1.1/*.json``             ``exact_match``, ``rouge_w`` (KLUE's: see
                                               :func:`rouge_w`)
========  ===================================  ==========================================

* YNAT, STS, NLI: a JSON list of objects. YNAT ``guid``, ``title``, ``label`` (one of 7
  topics); STS ``guid``, ``sentence1``, ``sentence2``, ``labels`` (``label``, ``real-label``
  in [0, 5], ``binary-label``); NLI ``guid``, ``premise``, ``hypothesis``, ``gold_label``.
  They become :class:`~bertpipe.finetuning.tasks.glue.PairExample` and GLUE's featurizer.
* NER: one character per line, ``char<TAB>tag`` (a space is a character too, ``" \\tO"``);
  sentences end at a blank line; comment lines start with ``##``, the last before a
  sentence being ``## <guid><TAB><sentence with <entity:TYPE> marks>``. Tags are BIO over 6
  types (PS person, LC location, OG organisation, DT date, TI time, QT quantity).
* MRC: SQuAD 2.0's layout (``data[].paragraphs[].qas[]``, ``is_impossible``) with the
  question's id under ``guid`` and a ``question_type`` (1 paraphrase, 2 multi-sentence,
  3 unanswerable); read by :func:`~bertpipe.finetuning.tasks.squad.read_squad`.

NER features (:func:`featurize_klue_ner`) come from the tokenizer's offsets into the
sentence as written, so they hold for any vocabulary: each token is labelled with the tag
of its first character (as KLUE's baseline labels each word piece), and a token's
prediction goes back to its characters, the first getting it and the others its ``I-``
form (:func:`align_klue_ner`). Keys besides the shared ones:

- ``labels`` int64 [N, S]: the tag id of the token's first character; -100 on
  ``[CLS]``/``[SEP]``/padding
- ``char_start``, ``char_end`` int32 [N, S]: the token's [start, end) characters in the
  sentence, -1 on specials and padding
- ``truncated`` bool [N]: the sentence lost tokens to ``max_seq_length``; their characters
  are predicted ``O``

Characters are scored without the spaces, as KLUE's baseline does (it drops them when it
reads the file).
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import string
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

import numpy as np
from seqeval.metrics import f1_score as seqeval_f1
from seqeval.scheme import IOB2
from sklearn import metrics as skm
from tokenizers import Tokenizer

from bertpipe.finetuning.tasks.base import (
    IGNORE_INDEX,
    Features,
    ReadReport,
    TaskDataError,
    TaskSpec,
    encoded_features,
    lines_of,
    open_for_write,
    pad_rows,
    plain_tokenizer,
    read_text,
    special_ids,
)
from bertpipe.finetuning.tasks.glue import PairExample
from bertpipe.finetuning.tasks.squad import LineFinder, SquadExample, read_squad

__all__ = [
    "KLUE_TASKS",
    "KlueSentence",
    "KlueTask",
    "align_klue_ner",
    "featurize_klue_ner",
    "klue_mrc_metrics",
    "klue_ner_metrics",
    "klue_task",
    "normalize_klue_answer",
    "read_klue_mrc",
    "read_klue_ner",
    "read_klue_pairs",
    "rouge_w",
    "write_klue_ner_predictions",
]

logger = logging.getLogger(__name__)

YNAT_LABELS = ("정치", "경제", "사회", "생활문화", "세계", "IT과학", "스포츠")
"""YNAT's topics in the baseline's id order: politics, economy, society, culture, world,
IT/science, sport."""
NLI_LABELS = ("entailment", "contradiction", "neutral")
NER_LABELS = (
    *(f"{prefix}-{kind}" for kind in ("PS", "LC", "OG", "DT", "TI", "QT") for prefix in "BI"),
    "O",
)
"""KLUE-NER's 13 tags in the baseline's id order (``O`` last)."""


@dataclass(frozen=True)
class KlueTask:
    """A KLUE task: its spec, release folder name and file extension, and the fields."""

    spec: TaskSpec
    folder: str
    """The release's folder and file stem before ``-v1.1`` (``klue-sts``)."""
    extension: str
    text_a: str = ""
    text_b: str | None = None
    label: str = ""

    def files(self, version: str) -> tuple[str, str, str]:
        """The folder, training and dev file names of release ``version`` (``v1.1``)."""
        stem = f"{self.folder}-{version}"
        return stem, f"{stem}_train.{self.extension}", f"{stem}_dev.{self.extension}"


KLUE_TASKS: dict[str, KlueTask] = {
    "ynat": KlueTask(
        TaskSpec("ynat", "classification", YNAT_LABELS, "macro_f1", True, ("macro_f1",)),
        "ynat",
        "json",
        text_a="title",
        label="label",
    ),
    "sts": KlueTask(
        TaskSpec("sts", "regression", (), "pearson", True, ("pearson", "f1"), threshold=3.0),
        "klue-sts",
        "json",
        text_a="sentence1",
        text_b="sentence2",
        label="real-label",
    ),
    "nli": KlueTask(
        TaskSpec("nli", "classification", NLI_LABELS, "accuracy", True, ("accuracy",)),
        "klue-nli",
        "json",
        text_a="premise",
        text_b="hypothesis",
        label="gold_label",
    ),
    "ner": KlueTask(
        TaskSpec(
            "ner",
            "token_labels",
            NER_LABELS,
            "entity_macro_f1",
            True,
            ("entity_macro_f1", "character_macro_f1"),
        ),
        "klue-ner",
        "tsv",
    ),
    "mrc": KlueTask(
        TaskSpec("mrc", "span_qa", (), "exact_match", True, ("exact_match", "rouge_w")),
        "klue-mrc",
        "json",
    ),
}
"""The KLUE tasks bertpipe reads, in KLUE's order (RE, DP and DST are not read)."""


def klue_task(name: str) -> KlueTask:
    """The KLUE task called ``name`` (``ynat``, ``sts``, ``nli``, ``ner``, ``mrc``; a
    ``klue-`` or ``klue_`` prefix and case are ignored)."""
    key = name.lower().replace("_", "-").removeprefix("klue-")
    if key not in KLUE_TASKS:
        raise ValueError(f"unknown KLUE task {name!r}; choose one of {list(KLUE_TASKS)}")
    return KLUE_TASKS[key]


# --------------------------------------------------------------------------- YNAT, STS, NLI


def _json(name: str) -> tuple[str, Any]:
    text = read_text(name)
    try:
        return text, json.loads(text)
    except json.JSONDecodeError as err:
        raise TaskDataError(
            f"{name}: invalid JSON at line {err.lineno} column {err.colno} ({err.msg}); "
            "download the KLUE file again"
        ) from None


def read_klue_pairs(
    task: str, path: str | os.PathLike[str]
) -> tuple[list[PairExample], ReadReport]:
    """Read a YNAT, STS or NLI file (a JSON list of objects) into :class:`PairExample`.

    Problems (the row dropped, its line found by its ``guid``): not an object, no
    ``guid``, a text missing or empty, a label missing, outside the task's labels (YNAT,
    NLI) or not a number in [0, 5] (STS ``labels.real-label``). Raises
    :class:`TaskDataError` when the file is not a JSON list or no row is usable.
    """
    klue = klue_task(task)
    spec = klue.spec
    name = os.fspath(path)
    text, rows = _json(name)
    if not isinstance(rows, list):
        raise TaskDataError(
            f"{name}: expected a JSON list of {spec.name} rows (KLUE's layout), found "
            f"{type(rows).__name__}; is this the KLUE {spec.name} file?"
        )
    report = ReadReport(name)
    lines = LineFinder(text, "guid")
    examples: list[PairExample] = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        report.rows_read += 1
        guid = row.get("guid") if isinstance(row, dict) else None
        line = lines.line(guid)
        problem, example = _pair(klue, row, i, line, seen)
        if example is None:
            report.add(line, problem)
            continue
        seen.add(example.guid)
        examples.append(example)
    report.rows_kept = len(examples)
    report.log()
    report.require_rows()
    return examples, report


def _pair(
    klue: KlueTask, row: object, i: int, line: int, seen: set[str]
) -> tuple[str, PairExample | None]:
    """The row as an example, or why it cannot be used."""
    where = f"row {i}"
    if not isinstance(row, dict):
        return f"{where} is not an object", None
    guid = row.get("guid")
    if not isinstance(guid, str) or not guid:
        return f"{where} has no 'guid'", None
    if guid in seen:
        return f"{guid}: duplicate guid", None
    texts = []
    for field in (klue.text_a, klue.text_b):
        if field is None:
            continue
        value = row.get(field)
        if not isinstance(value, str) or not value.strip():
            return f"{guid}: {field!r} missing or empty", None
        texts.append(value)
    spec = klue.spec
    if spec.kind == "regression":
        labels = row.get("labels")
        raw = labels.get(klue.label) if isinstance(labels, dict) else None
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            return f"{guid}: labels.{klue.label} is {raw!r}, not a number", None
        if not 0.0 <= raw <= 5.0:
            return f"{guid}: labels.{klue.label} {raw!r} is outside [0, 5]", None
        label: int | float = float(raw)
    else:
        raw = row.get(klue.label)
        if raw not in spec.label_to_id:
            return f"{guid}: unknown label {raw!r}; expected one of {list(spec.labels)}", None
        label = spec.label_to_id[raw]
    text_b = texts[1] if len(texts) > 1 else None
    return "", PairExample(guid, texts[0], text_b, label, line)


# --------------------------------------------------------------------------- NER


@dataclass(frozen=True)
class KlueSentence:
    """A KLUE-NER sentence: its characters (spaces included) and their tags; ``line`` is
    its first character's line (1-based)."""

    guid: str
    chars: tuple[str, ...]
    labels: tuple[str, ...]
    line: int

    @property
    def text(self) -> str:
        return "".join(self.chars)


_NER_TAG = re.compile(r"^(O|[BI]-[A-Z]+)$")


def read_klue_ner(
    path: str | os.PathLike[str], labels: Sequence[str] = NER_LABELS
) -> tuple[list[KlueSentence], ReadReport]:
    """Read a KLUE-NER file (module docstring); a bad line drops its whole sentence.

    Problems that drop the sentence: a line that is not one character, a tab and a tag; a
    tag that is not ``O``/``B-X``/``I-X`` or not one of ``labels`` (KLUE's 13). A sentence
    is its lines up to a blank line (or one holding only a tab, as the baseline splits).
    """
    name = os.fspath(path)
    report = ReadReport(name)
    allowed = set(labels)
    sentences: list[KlueSentence] = []
    guid = ""
    chars: list[str] = []
    tags: list[str] = []
    first = 0
    bad = False

    def finish() -> None:
        nonlocal bad, guid
        if chars:
            report.rows_read += 1
            if not bad:
                key = guid or f"{os.path.basename(name)}-{first}"
                sentences.append(KlueSentence(key, tuple(chars), tuple(tags), first))
            guid = ""
        chars.clear()
        tags.clear()
        bad = False

    for number, line in enumerate(lines_of(read_text(name)), start=1):
        if line in ("", "\t"):
            finish()
            continue
        if line.startswith("##"):
            if chars:  # a comment inside a sentence: the sentence before it ends
                finish()
            guid = line[2:].split("\t", 1)[0].strip()
            continue
        if not chars:
            first = number
        fields = line.split("\t")
        if bad:
            continue
        if len(fields) != 2 or len(fields[0]) != 1:
            report.add(
                number,
                f"expected one character, a tab and a tag, found {line!r}; sentence dropped",
            )
            bad = True
        elif not _NER_TAG.match(fields[1]) or fields[1] not in allowed:
            report.add(
                number,
                f"tag {fields[1]!r} is not one of KLUE-NER's {list(labels)}; sentence dropped",
            )
            bad = True
        chars.append(fields[0] if fields else "")
        tags.append(fields[-1])
    finish()
    report.rows_kept = len(sentences)
    report.log()
    report.require_rows()
    return sentences, report


def featurize_klue_ner(
    tokenizer: Tokenizer, sentences: Sequence[KlueSentence], spec: TaskSpec, max_seq_length: int
) -> Features:
    """``[CLS] tokens [SEP]`` per sentence, each token labelled with its first character's
    tag (layout in the module docstring). The tokenizer's offsets are into the sentence as
    written (its normaliser keeps them there), so the characters of every token are
    known whatever the vocabulary splits."""
    tok = plain_tokenizer(tokenizer)
    special = special_ids(tok)
    label_ids = spec.label_to_id
    budget = max_seq_length - 2
    encodings = tok.encode_batch([s.text for s in sentences], add_special_tokens=False)
    rows: list[list[int]] = []
    label_rows: list[list[int]] = []
    starts: list[list[int]] = []
    ends: list[list[int]] = []
    truncated = np.zeros(len(sentences), dtype=bool)
    for i, (sentence, encoding) in enumerate(zip(sentences, encodings, strict=True)):
        kept = [
            (token_id, start, end)
            for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True)
            if end > start
        ]
        truncated[i] = len(kept) > budget
        kept = kept[:budget]
        rows.append([special.cls, *(k[0] for k in kept), special.sep])
        tags = [label_ids.get(sentence.labels[k[1]], label_ids["O"]) for k in kept]
        label_rows.append([IGNORE_INDEX, *tags, IGNORE_INDEX])
        starts.append([-1, *(k[1] for k in kept), -1])
        ends.append([-1, *(k[2] for k in kept), -1])
    features = encoded_features(rows, [[0] * len(r) for r in rows], special.pad)
    features["labels"] = pad_rows(label_rows, IGNORE_INDEX, np.int64)
    features["char_start"] = pad_rows(starts, -1, np.int32)
    features["char_end"] = pad_rows(ends, -1, np.int32)
    features["truncated"] = truncated
    if truncated.any():
        logger.warning(
            "%d of %d sentences are longer than max_seq_length=%d tokens; their characters "
            "past the cut are predicted O",
            int(truncated.sum()),
            len(sentences),
            max_seq_length,
        )
    return features


def align_klue_ner(
    features: Features,
    predictions: np.ndarray | Sequence[np.ndarray],
    sentences: Sequence[KlueSentence],
    spec: TaskSpec,
) -> list[list[str]]:
    """Character-level tags (one per character, spaces included) from token predictions.

    ``predictions``: tag ids [N, S'] or logits [N, S', C], or N per-row arrays. A token's
    first character takes its tag; its other characters the ``I-`` form of it (``O``
    stays ``O``), as KLUE's baseline spreads a word piece over its syllables. A combining
    mark or format character that the normaliser removed (so no token covers it: a
    decomposed accent, a zero-width joiner) goes with the character before it; other
    characters no token covers (spaces, those cut off by truncation) are ``O``.
    """
    out: list[list[str]] = []
    for i, sentence in enumerate(sentences):
        length = int(features["lengths"][i])
        row = np.asarray(predictions[i])
        if row.ndim == 2:
            row = row.argmax(axis=-1)
        if row.shape[0] < length:
            raise ValueError(f"predictions row {i} has {row.shape[0]} positions, needs {length}")
        tags: list[str | None] = [None] * len(sentence.chars)
        for position in range(1, length - 1):
            start = int(features["char_start"][i, position])
            end = int(features["char_end"][i, position])
            tag = spec.labels[int(row[position])]
            tags[start] = tag
            for c in range(start + 1, end):
                tags[c] = _inside(tag)
        for c, ch in enumerate(sentence.chars):  # characters no token covers
            if tags[c] is None:
                previous = tags[c - 1] if c else None
                mark = unicodedata.category(ch)[0] == "M" or unicodedata.category(ch) == "Cf"
                tags[c] = _inside(previous) if mark and previous is not None else "O"
        out.append([t or "O" for t in tags])
    return out


def _inside(tag: str) -> str:
    """The tag a character inside ``tag``'s entity takes: ``I-X`` for ``B-X``/``I-X``."""
    return tag if tag == "O" else f"I-{tag[2:]}"


def _without_spaces(
    sentences: Sequence[KlueSentence], tags: Sequence[Sequence[str]]
) -> list[list[str]]:
    return [
        [t for ch, t in zip(s.chars, row, strict=True) if ch != " "]
        for s, row in zip(sentences, tags, strict=True)
    ]


def klue_ner_metrics(
    sentences: Sequence[KlueSentence],
    predicted: Sequence[Sequence[str]],
    labels: Sequence[str] = NER_LABELS,
) -> dict[str, float]:
    """KLUE-NER's two scores over the characters without spaces, as fractions.

    ``entity_macro_f1``: seqeval's F1 in ``mode="strict"`` with ``scheme=IOB2``, the mean
    over entity types (an entity must open with ``B-``; an ``I-`` after ``O`` is no
    entity). ``character_macro_f1``: scikit-learn's F1 per tag over every character, the
    mean over all 13 tags, ``O`` included, a tag on neither side counting 1.0
    (``zero_division=1``): KLUE's definitions, computed per sentence (KLUE's code scores
    one sequence of the whole set with the model's guesses at ``[CLS]`` and ``[SEP]`` in
    it; bertpipe leaves those positions out).
    """
    if len(sentences) != len(predicted):
        raise ValueError(f"{len(sentences)} sentences but {len(predicted)} predicted")
    gold = _without_spaces(sentences, [s.labels for s in sentences])
    pred = _without_spaces(sentences, predicted)
    entity = seqeval_f1(gold, pred, average="macro", mode="strict", scheme=IOB2, zero_division=0)
    flat_gold = [t for row in gold for t in row]
    flat_pred = [t for row in pred for t in row]
    character = skm.f1_score(
        flat_gold, flat_pred, labels=list(labels), average="macro", zero_division=1
    )
    return {"entity_macro_f1": float(entity), "character_macro_f1": float(character)}


def write_klue_ner_predictions(
    target: str | os.PathLike[str] | IO[str],
    sentences: Sequence[KlueSentence],
    predicted: Sequence[Sequence[str]],
) -> None:
    """Write ``## guid`` then ``char<TAB>gold<TAB>predicted`` per character, a blank line
    after each sentence (KLUE's layout with the prediction added)."""
    if len(sentences) != len(predicted):
        raise ValueError(f"{len(sentences)} sentences but {len(predicted)} predictions")
    with open_for_write(target) as out:
        for sentence, tags in zip(sentences, predicted, strict=True):
            out.write(f"## {sentence.guid}\n")
            for ch, gold, pred in zip(sentence.chars, sentence.labels, tags, strict=True):
                out.write(f"{ch}\t{gold}\t{pred}\n")
            out.write("\n")


# --------------------------------------------------------------------------- MRC


def read_klue_mrc(
    path: str | os.PathLike[str],
) -> tuple[list[SquadExample], ReadReport]:
    """Read a KLUE-MRC file: SQuAD 2.0's layout, ids under ``guid`` (module docstring)."""
    return read_squad(path, version_2=True, id_key="guid")


_QUOTE_RUN = re.compile("[\"'《》<>〈〉]\\(\\)‘’")
"""What KLUE's ``NORMALIZE_CHAR_PATTERN`` matches as written: one of ``'"《》<>〈〉``
followed by the four characters ``()‘’`` (a bracket expression closed early), a sequence
that answers do not hold; kept so that the normalisation is KLUE's exactly."""
_ASCII_PUNCTUATION = frozenset(string.punctuation)


def normalize_klue_answer(text: str) -> str:
    """KLUE-MRC's answer normalisation (``normalize_answer_for_klue_mrc``): lower case,
    :data:`_QUOTE_RUN` to a space, ASCII punctuation removed, runs of white space to one
    space. No articles removed and no Unicode punctuation (``「」`` stays)."""
    text = _QUOTE_RUN.sub(" ", text.lower())
    text = "".join(ch for ch in text if ch not in _ASCII_PUNCTUATION)
    return " ".join(text.split())


def rouge_w(prediction: str, gold: str) -> float:
    """KLUE-MRC's "ROUGE-W" of two normalised answers, as KLUE's code defines it
    (``rouge_w_score_for_klue_mrc``): the F1 of character precision and recall of their
    longest common *contiguous* substring (``difflib.SequenceMatcher.find_longest_match``
    with its defaults), not the weighted LCS of Lin's ROUGE-W. An empty gold scores 1.0
    only for an empty prediction."""
    if gold == "":
        return float(prediction == gold)
    matcher = difflib.SequenceMatcher(None, prediction, gold)
    common = matcher.find_longest_match(0, len(prediction), 0, len(gold)).size
    precision = common / len(prediction) if prediction else 0.0
    recall = common / len(gold)
    if precision + recall == 0.0:
        return 0.0
    return 2 * precision * recall / (precision + recall)


def klue_mrc_metrics(
    predictions: Mapping[str, str], gold: Mapping[str, Sequence[str]]
) -> dict[str, float]:
    """KLUE-MRC's exact match and ROUGE-W (:func:`rouge_w`), the best over each question's
    gold answers, averaged over the questions, as fractions. An unanswerable question's
    only answer is the empty string; a question without a prediction scores 0."""
    em: list[float] = []
    rouge: list[float] = []
    missing = 0
    for qid, answers in gold.items():
        if qid not in predictions:
            missing += 1
            em.append(0.0)
            rouge.append(0.0)
            continue
        pred = normalize_klue_answer(predictions[qid])
        truths = [normalize_klue_answer(a) for a in answers] or [""]
        em.append(max([0.0, *(float(pred == t) for t in truths)]))
        rouge.append(max([0.0, *(rouge_w(pred, t) for t in truths)]))
    if missing:
        logger.warning("%d of %d questions have no prediction; scored 0", missing, len(gold))
    if not em:
        raise ValueError("no questions to score")
    return {"exact_match": float(np.mean(em)), "rouge_w": float(np.mean(rouge))}
