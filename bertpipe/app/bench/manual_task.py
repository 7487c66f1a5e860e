"""Labelled tasks in another language, made from a translated manual's HTML pages: which part
of the manual a paragraph (or a sentence) comes from.

Made for ``bertpipe bench language`` from Debian's translations of the GIMP manual
(``.cache/gimp-help/<lang>/``, docs/languages.md), in the spirit of the demo's python-docs
tasks (:mod:`bertpipe.finetuning.sample_task`): nothing is downloaded and every choice is a
stable hash, so the same pages give the same files. The pages are DocBook's: each names the
page above it (``<link rel="up">``), so every page knows the part of the manual it sits in
(Part I "Getting started", Part II "How to become a GIMP wizard", Part III "Function
reference", Appendix A "GIMP history", ...). The file names are the same in every
translation, and so are the labels (the part's file name without ``gimp-`` and ``.html``:
``getting-started``, ``become-a-gimp-wizard``, ``function-reference``,
``introduction-history``).

Rows are the pages' blocks (paragraphs, list items, table cells, as
:func:`~bertpipe.app.bench.sentences.html_text` cuts them), spaces collapsed, that
are mostly in the language's script (:data:`SCRIPTS`; half the letters or more): the
translations are partial (the Korean pages are 7% Hangul), and an English paragraph left
untranslated would make the task an English one.

* ``part-paragraph``: a block of at least 40 characters -> its part.
* ``part-sentence``: a sentence of such a block (any length of block; cut by the language's
  rules, :func:`~bertpipe.preprocessing.sentences.segment_sentences`), at least 20
  characters and mostly in the script -> its part. Fewer words to go by.

A text is a row once per split (the first page it is on gives its label), and a dev text
also in training is dropped. The split is by page, the same in both tasks, so no page
straddles it: per part, the pages in the order of a stable hash of their name go to dev while
dev holds less than ``dev_fraction`` of the part's paragraphs, each only if it keeps dev
within 1.5 times that share (one long page does not take a part's dev set over); the rest is
training. Training keeps ``train_per_label`` rows per part (the smallest stable hash of
their text), so few labelled rows leave the task to what the model brings; dev keeps all.
A part is a class only where it has a dev page and ``train_per_label`` training rows in both
tasks (the parts left out are logged).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bertpipe import fsio
from bertpipe.errors import BertpipeError
from bertpipe.seeding import stable_unit

log = logging.getLogger(__name__)

__all__ = [
    "SCRIPTS",
    "ManualPage",
    "dev_pages",
    "manual_pages",
    "script_share",
    "script_text",
    "write_manual_suite",
]

SCRIPTS = {
    "ko": re.compile("[\uac00-\ud7a3\u1100-\u11ff\u3130-\u318f]"),
    "ja": re.compile("[\u3040-\u30ff\u4e00-\u9fff\u3400-\u4dbf]"),
    "zh": re.compile("[\u4e00-\u9fff\u3400-\u4dbf]"),
}
"""The letters of each language's own script: Hangul (syllables and jamo); kana and Han; Han."""
MIN_SHARE = 0.5
"""A row's letters in the language's script, at least (the rest: Latin, digits aside)."""
MIN_PARAGRAPH_CHARS = 40
MIN_SENTENCE_CHARS = 20
SUITE_FILE = "suite.yaml"
TASKS = {
    "part-paragraph": "which part of the manual is a paragraph from?",
    "part-sentence": "which part of the manual is a sentence from?",
    "word-order": "is a sentence as written, or are two of its words swapped?",
}
"""The suite's tasks and what each asks."""
DEFAULT_TASKS = ("part-paragraph", "part-sentence")
"""The tasks a suite holds unless told: ``word-order`` is at chance for both the pre-trained
and the randomly initialised tiny model at the bench's budget (BENCHMARKS.md), so it is asked
for by name."""
_MAX_SEQ_LENGTH = {"part-paragraph": 128, "part-sentence": 64, "word-order": 64}
_UP = re.compile(r"""<link\s+rel=["']up["']\s+href=["']([^"'#]*)""")
_SPACES = re.compile(r"\s+")


@dataclass(frozen=True)
class ManualPage:
    """A page of the manual: its file name, its text and the part it belongs to."""

    name: str
    text: str
    divisions: tuple[str, ...]
    """The divisions holding the page, the top one first, down to the page: each its file
    name with ``gimp-`` and ``.html`` cut off."""

    @property
    def part(self) -> str:
        """The top division (a part or an appendix of the manual)."""
        return self.divisions[0]

    @property
    def chapter(self) -> str:
        """The division below the top one (a chapter; the top one for a page directly in it)."""
        return self.divisions[min(1, len(self.divisions) - 1)]


def _up_links(folder: Path) -> dict[str, str]:
    """Page file name -> the file name of the page above it (from the page's head)."""
    links = {}
    for path in sorted(folder.glob("*.html")):
        with path.open(encoding="utf-8", errors="replace") as f:
            head = f.read(4096)
        found = _UP.search(head)
        if found and found.group(1):
            links[path.name] = found.group(1)
    return links


def _divisions(name: str, up: dict[str, str]) -> tuple[str, ...]:
    """The labels of the divisions holding page ``name``, the top one first (the last page
    before the manual's ``index.html`` on the way up; a page whose parent is missing is its
    own top), down to the page itself."""
    chain = [name]
    while up.get(chain[-1], "index.html") != "index.html" and up[chain[-1]] not in chain:
        chain.append(up[chain[-1]])
    return tuple(page.removesuffix(".html").removeprefix("gimp-") for page in reversed(chain))


def script_share(text: str, language: str) -> float:
    """The share of ``text``'s letters that are in the language's script (0 without letters)."""
    letters = sum(1 for c in text if c.isalpha())
    return len(SCRIPTS[language].findall(text)) / letters if letters else 0.0


def manual_pages(folder: Path, language: str, max_pages: int | None = None) -> list[ManualPage]:
    """The pages under ``folder`` with any text, by name; ``max_pages``: only that many, those
    with the most paragraphs in ``language``'s script (ties by name): a small sample that
    still spans parts."""
    from bertpipe.app.bench.sentences import html_text

    up = _up_links(folder)
    pages = []
    for path in sorted(folder.glob("*.html")):
        text = html_text(path.read_text(encoding="utf-8", errors="replace"))
        if text:
            pages.append(ManualPage(path.name, text, _divisions(path.name, up)))
    if max_pages is not None:
        rows = {p.name: len(_paragraphs(p.text, language)) for p in pages}
        keep = set(sorted(rows, key=lambda n: (-rows[n], n))[:max_pages])
        pages = [p for p in pages if p.name in keep]
    return pages


def _blocks(text: str) -> list[str]:
    return [_SPACES.sub(" ", block).strip() for block in text.split("\n\n") if block.strip()]


def script_text(text: str, language: str) -> str:
    """The blocks of ``text`` that are mostly in the language's script, a blank line between."""
    return "\n\n".join(b for b in _blocks(text) if script_share(b, language) >= MIN_SHARE)


def _paragraphs(text: str, language: str) -> list[str]:
    return [
        b
        for b in _blocks(text)
        if len(b) >= MIN_PARAGRAPH_CHARS and script_share(b, language) >= MIN_SHARE
    ]


def _sentences(text: str, language: str) -> list[str]:
    from bertpipe.preprocessing.sentences import segment_sentences

    out = []
    for block in _blocks(text):
        if script_share(block, language) < MIN_SHARE:
            continue
        out += [
            s
            for s in segment_sentences(block, language)
            if len(s) >= MIN_SENTENCE_CHARS and script_share(s, language) >= MIN_SHARE
        ]
    return out


def dev_pages(pages: Sequence[ManualPage], language: str, dev_fraction: float) -> set[str]:
    """The pages whose rows are dev rows (see the module's docstring)."""
    dev: set[str] = set()
    for part in sorted({p.part for p in pages}):
        mine = [p for p in pages if p.part == part]
        rows = {p.name: len(_paragraphs(p.text, language)) for p in mine}
        target = dev_fraction * sum(rows.values())
        held = 0
        for page in sorted(mine, key=lambda p: stable_unit("manual-task-split", p.name)):
            if rows[page.name] and held < target and held + rows[page.name] <= 1.5 * target:
                dev.add(page.name)
                held += rows[page.name]
    return dev


Labelled = Callable[[ManualPage, str], list[tuple[str, str]]]
"""A task's (text, label) rows of a page in a language."""


def _part_paragraphs(page: ManualPage, language: str) -> list[tuple[str, str]]:
    return [(text, page.part) for text in _paragraphs(page.text, language)]


def _part_sentences(page: ManualPage, language: str) -> list[tuple[str, str]]:
    return [(text, page.part) for text in _sentences(page.text, language)]


def _word_order(page: ManualPage, language: str) -> list[tuple[str, str]]:
    """Sentences of 4 words or more, each ``original`` or ``swapped`` (by a stable hash of
    the sentence: two neighbouring words, neither the last, exchanged; SentEval's bigram
    shift)."""
    rows = []
    for sentence in _sentences(page.text, language):
        words = sentence.split(" ")
        if len(words) < 4:
            continue
        if stable_unit("manual-word-order", sentence) < 0.5:
            rows.append((sentence, "original"))
            continue
        at = int(stable_unit("manual-word-order-at", sentence) * (len(words) - 2))
        if words[at] == words[at + 1]:
            continue
        words[at], words[at + 1] = words[at + 1], words[at]
        rows.append((" ".join(words), "swapped"))
    return rows


def _rows(
    pages: Sequence[ManualPage], dev: set[str], labelled: Labelled, language: str
) -> dict[str, list[tuple[str, str]]]:
    """(text, label) rows per split, each text once per split, no dev text that is in train."""
    found: dict[str, dict[str, str]] = {"train": {}, "dev": {}}
    for page in pages:
        split = "dev" if page.name in dev else "train"
        for text, label in labelled(page, language):
            found[split].setdefault(text, label)
    train = list(found["train"].items())
    return {"train": train, "dev": [r for r in found["dev"].items() if r[0] not in found["train"]]}


def _balanced(rows: list[tuple[str, str]], per_label: int, key: str) -> list[tuple[str, str]]:
    """``per_label`` rows of each label (the smallest stable hash of their text under
    ``key``), in their order in ``rows``."""
    keep: set[int] = set()
    for label in {label for _, label in rows}:
        mine = [i for i, (_, lab) in enumerate(rows) if lab == label]
        mine.sort(key=lambda i: stable_unit(key, rows[i][0]))
        keep.update(mine[:per_label])
    return [row for i, row in enumerate(rows) if i in keep]


def _write_tsv(url: str, rows: Sequence[tuple[str, str]]) -> None:
    """``text`` and ``label`` columns, unquoted (the texts' white space is collapsed, so no
    tab or line break is in them)."""
    fsio.atomic_write_text(url, "".join(f"{t}\t{lab}\n" for t, lab in [("text", "label"), *rows]))


_LABELLED: dict[str, Labelled] = {
    "part-paragraph": _part_paragraphs,
    "part-sentence": _part_sentences,
    "word-order": _word_order,
}


def write_manual_suite(
    pages: Sequence[ManualPage],
    out_dir: str,
    language: str,
    train_per_label: int = 32,
    dev_fraction: float = 0.3,
    suite_name: str | None = None,
    tasks: Sequence[str] = DEFAULT_TASKS,
) -> dict[str, dict[str, object]]:
    """Write ``tasks`` (:data:`DEFAULT_TASKS`: ``part-paragraph`` and ``part-sentence``)
    into ``out_dir/<task>/`` (``train.tsv``, ``dev.tsv``) and ``out_dir/suite.yaml`` naming
    them for ``bertpipe evaluate`` (``table`` family; dev macro-F1 for the parts, accuracy for
    word order). Returns per task its
    classes and row counts. One line (BertpipeError) when fewer than two parts have rows enough."""
    import yaml

    if language not in SCRIPTS:
        raise BertpipeError(
            f"manual task: no script known for language {language!r}: one of "
            f"{', '.join(sorted(SCRIPTS))}"
        )
    dev = dev_pages(pages, language, dev_fraction)
    rows = {name: _rows(pages, dev, _LABELLED[name], language) for name in tasks}
    by_part = {k: v for k, v in rows.items() if k.startswith("part-")}
    parts = _classes(by_part, train_per_label or 16) if by_part else []
    entries, summary = [], {}
    for name, split in rows.items():
        labels = parts if name.startswith("part-") else ["original", "swapped"]
        train = [r for r in split["train"] if r[1] in labels]
        if train_per_label:
            train = _balanced(train, train_per_label, f"manual-{name}-subset")
        held = [r for r in split["dev"] if r[1] in labels]
        for part, rows_of in (("train", train), ("dev", held)):
            _write_tsv(fsio.join(out_dir, name, f"{part}.tsv"), rows_of)
        counts = Counter(label for _, label in held)
        summary[name] = {
            "classes": labels,
            "train": len(train),
            "dev": len(held),
            "dev_majority": max(counts.values()) / len(held),
        }
        options = {"text_a": "text", "label": "label", "labels": list(labels)}
        entries.append(
            {
                "name": name,
                "family": "table",
                "train": f"{name}/train.tsv",
                "dev": f"{name}/dev.tsv",
                # training is balanced, dev is not (a part's share of the dev pages): macro-F1
                # does not reward a model that leans to the largest part, accuracy does
                "score": "macro_f1" if name.startswith("part-") else "accuracy",
                "task": {**options, "max_seq_length": _MAX_SEQ_LENGTH[name]},
            }
        )
        log.info(
            "%s: %d train and %d dev rows, classes %s (dev pages: %d of %d)",
            name,
            len(train),
            len(held),
            ", ".join(labels),
            len(dev),
            len(pages),
        )
    suite = {"name": suite_name or f"manual-{language}", "tasks": entries}
    fsio.atomic_write_text(
        fsio.join(out_dir, SUITE_FILE), yaml.safe_dump(suite, sort_keys=False, allow_unicode=True)
    )
    return summary


def _classes(rows: dict[str, dict[str, list[tuple[str, str]]]], per_label: int) -> list[str]:
    """The parts with a dev row and ``per_label`` training rows in every task, sorted."""
    parts = set.intersection(
        *(
            {
                part
                for part, n in Counter(lab for _, lab in split["train"]).items()
                if n >= per_label and any(lab == part for _, lab in split["dev"])
            }
            for split in rows.values()
        )
    )
    every = {lab for split in rows.values() for part in split.values() for _, lab in part}
    if every - parts:
        log.info(
            "parts left out (too few rows or no dev page): %s", ", ".join(sorted(every - parts))
        )
    if len(parts) < 2:
        raise BertpipeError(
            f"manual task: {len(parts)} part(s) of the manual have a dev page and {per_label} "
            "training rows in the language's script, fewer than the 2 classes a task needs: "
            "give more pages or a smaller train_per_label"
        )
    return sorted(parts)
