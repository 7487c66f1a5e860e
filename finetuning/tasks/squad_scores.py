"""SQuAD's scores: exact match and F1 as the official evaluation script computes them (its
answer normalisation: lower case, no ASCII punctuation, no English articles), and for other
languages MLQA's normalisation (every Unicode punctuation mark removed, each CJK character a
token; ``task.language``). Scores are percentages, as the official script reports them."""

from __future__ import annotations

import collections
import logging
import re
import string
import unicodedata
from collections.abc import Mapping, Sequence

import numpy as np

from bertpipe.finetuning.tasks.squad import SquadExample

logger = logging.getLogger(__name__)

__all__ = ["exact_match", "f1_score", "gold_answers", "normalize_answer", "squad_metrics"]


_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)
_MLQA_ARTICLES = {
    "es": re.compile(r"\b(un|una|unos|unas|el|la|los|las)\b"),
    "vi": re.compile(r"\b(của|là|cái|chiếc|những)\b"),
    "de": re.compile(r"\b(ein|eine|einen|einem|eines|einer|der|die|das|den|dem|des)\b"),
    "ar": re.compile(r"\sال^|ال"),
}
"""The articles MLQA's script removes per language (none for the others)."""
_UNSPACED = re.compile(r"([\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff])")
"""Characters of scripts written without spaces between words (kana and CJK ideographs):
each is a token of its own, as MLQA's ``mixed_segmentation`` makes each Chinese one."""


def _is_punctuation(ch: str) -> bool:
    return ch in _PUNCTUATION or unicodedata.category(ch).startswith("P")


def normalize_answer(text: str, language: str = "en") -> str:
    """The official normalisation: lower case, no punctuation, no a/an/the, single spaces.

    ``language`` other than ``en``: MLQA's multilingual rules (``mlqa_evaluation_v1.py``,
    the evaluation script of Lewis et al. 2020): every Unicode punctuation character goes
    (the official script only strips ASCII's, so ``。`` or ``「`` stayed), English articles
    stay, the language's own are removed (Spanish, German, Vietnamese, Arabic), and each
    kana or CJK ideograph is a token of its own (MLQA does this for Chinese; Japanese is
    written without spaces too), so F1 credits a partly right answer in those scripts.
    Korean is written with spaces between words and is split there, as MLQA splits Hindi.
    """
    if language == "en":
        text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
        return " ".join(_ARTICLES.sub(" ", text).split())
    text = "".join(ch for ch in text.lower() if not _is_punctuation(ch))
    articles = _MLQA_ARTICLES.get(language)
    if articles is not None:
        text = articles.sub(" ", text)
    return " ".join(_UNSPACED.sub(r" \1 ", text).split())


def exact_match(prediction: str, gold: str, language: str = "en") -> float:
    """1.0 when the normalised texts are equal, else 0.0."""
    return float(normalize_answer(prediction, language) == normalize_answer(gold, language))


def f1_score(prediction: str, gold: str, language: str = "en") -> float:
    """Token-overlap F1 of the normalised texts (1.0 when both are empty)."""
    pred_tokens = normalize_answer(prediction, language).split()
    gold_tokens = normalize_answer(gold, language).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def gold_answers(examples: Sequence[SquadExample]) -> dict[str, list[str]]:
    """qid -> gold answer texts (all of them, mismatching ones too); [] when impossible."""
    return {e.qid: [] if e.is_impossible else [a.text for a in e.answers] for e in examples}


def squad_metrics(
    predictions: Mapping[str, str], gold: Mapping[str, Sequence[str]], language: str = "en"
) -> dict[str, float]:
    """EM and F1 in percent, max over gold answers, as ``evaluate-v2.0.py``.

    A question without gold answers scores 1 only for an empty prediction. A question with
    no prediction scores 0. Returns ``exact``, ``f1``, ``total`` and, where present, the
    ``HasAns_*`` and ``NoAns_*`` breakdowns. ``language``: the answers' language
    (:func:`normalize_answer`; ``en``, the default, is the official script exactly).
    """
    groups: dict[str, list[tuple[float, float]]] = {"": [], "HasAns_": [], "NoAns_": []}
    missing = 0
    for qid, answers in gold.items():
        texts = [a for a in answers if normalize_answer(a, language)] or [""]
        if qid in predictions:
            pred = predictions[qid]
            scores = (
                max(exact_match(pred, t, language) for t in texts),
                max(f1_score(pred, t, language) for t in texts),
            )
        else:
            missing += 1
            scores = (0.0, 0.0)
        groups[""].append(scores)
        groups["HasAns_" if answers else "NoAns_"].append(scores)
    if missing:
        logger.warning("%d of %d questions have no prediction; scored 0", missing, len(gold))
    out: dict[str, float] = {}
    for prefix, group in groups.items():
        if not group and prefix:
            continue
        out[f"{prefix}exact"] = 100.0 * float(np.mean([s[0] for s in group])) if group else 0.0
        out[f"{prefix}f1"] = 100.0 * float(np.mean([s[1] for s in group])) if group else 0.0
        out[f"{prefix}total"] = float(len(group))
    return out
