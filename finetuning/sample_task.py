"""Small labelled tasks available offline, made from the Python documentation that the demo
corpus (:mod:`preprocessing.sample_corpus`) is made of, so nothing is downloaded.

Rows come from the docstrings of four standard-library packages (asyncio, email, tkinter,
xml), cut into paragraphs (at blank lines, whitespace collapsed, at least 60 characters).
The train/dev split is by a stable hash of the docstring's id, the same in every task, so the
paragraphs of one docstring never straddle it. Every choice is a stable hash: the same Python
gives the same files.

* ``package`` (:func:`write_python_docs_task`): which package a paragraph comes from (4
  classes; columns ``text``, ``label``). ``train_per_label`` keeps a fixed, class-balanced
  subset of the training rows (the ones with the smallest stable hash per label): with few
  labelled examples the task shows what pre-training is worth, where with all ~1,000 rows it
  is lexical enough for a bag of words (0.95) and a randomly initialised BERT (up to 0.94).
* ``next-paragraph`` (:func:`write_next_paragraph_task`): sentence pairs, the demo's NSP at
  paragraph level: does ``second`` follow ``first`` in the same docstring (``next``), or is
  it a later paragraph of another docstring (``other``)? Each first paragraph appears once
  with its successor and once with a drawn paragraph, so the classes are balanced; the
  ``second`` of both classes is never a docstring's opening paragraph (whose summary style
  would give the answer away without reading ``first``).

:func:`write_demo_suite` writes both into one folder with a ``suite.yaml`` naming them for
``bertpipe evaluate`` (:mod:`bertpipe.finetuning.evaluation.suite`). The files are TSV with a
header row naming the columns, the layout the generic ``table`` task reader takes.
"""

from __future__ import annotations

import csv
import io
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bertpipe import fsio
from bertpipe.seeding import rng_for, stable_unit

log = logging.getLogger(__name__)

__all__ = [
    "LABELS",
    "NEXT_LABELS",
    "SUITE_FILE",
    "SUITE_NAME",
    "write_demo_suite",
    "write_next_paragraph_task",
    "write_python_docs_task",
]

LABELS = ("asyncio", "email", "tkinter", "xml")
"""The packages, and the ``package`` task's classes."""
NEXT_LABELS = ("next", "other")
"""The ``next-paragraph`` task's classes."""
SUITE_NAME = "python-docs"
"""The suite's name in ``bertpipe evaluate``'s runs and tables."""
SUITE_FILE = "suite.yaml"
_MIN_PARAGRAPH_CHARS = 60
_SPACES = re.compile(r"\s+")


@dataclass(frozen=True)
class _Docstring:
    doc_id: str
    package: str
    split: str
    """``train`` or ``dev``."""
    paragraphs: tuple[str, ...]


def _docstrings(dev_fraction: float) -> list[_Docstring]:
    """The four packages' docstrings with their paragraphs, in the corpus's order."""
    from bertpipe.preprocessing.sample_corpus import iter_python_docs

    found = []
    for doc_id, text in iter_python_docs(min_chars=100, packages=LABELS):
        if not doc_id.startswith("stdlib/"):
            continue
        package = doc_id.split("/")[1].split(":")[0].removesuffix(".py")
        if package not in LABELS:
            continue
        split = "dev" if stable_unit("sample-task", doc_id) < dev_fraction else "train"
        paragraphs = (_SPACES.sub(" ", raw).strip() for raw in text.split("\n\n"))
        kept = tuple(p for p in paragraphs if len(p) >= _MIN_PARAGRAPH_CHARS)
        found.append(_Docstring(doc_id, package, split, kept))
    return found


def _write_tsv(
    url: str, header: Sequence[str], rows: Iterable[Sequence[str]], *, quoted: bool = False
) -> str:
    """Write a TSV file with a header row; returns ``url``. Unquoted (the table reader reads
    ``.tsv`` so; paragraphs hold no tab or newline); ``quoted``: CSV quoting of fields with a
    double quote, as the ``package`` task has always been written (the reader then keeps
    those quotes as part of the text)."""
    if quoted:
        buf = io.StringIO()
        writer = csv.writer(buf, delimiter="\t", lineterminator="\n")
        writer.writerow(header)
        writer.writerows(rows)
        text = buf.getvalue()
    else:
        text = "".join("\t".join(fields) + "\n" for fields in [header, *rows])
    fsio.atomic_write_text(url, text)
    return url


def write_python_docs_task(
    out_dir: str, dev_fraction: float = 0.2, train_per_label: int | None = None
) -> tuple[str, str]:
    """Write the ``package`` task's ``train.tsv`` and ``dev.tsv`` under ``out_dir``; returns
    their URLs.

    ``train_per_label``: keep only this many training rows per label (all dev rows are kept).
    """
    return _write_package(out_dir, _docstrings(dev_fraction), train_per_label)


def write_next_paragraph_task(
    out_dir: str, dev_fraction: float = 0.2, train_per_label: int | None = None
) -> tuple[str, str]:
    """Write the ``next-paragraph`` task's ``train.tsv`` and ``dev.tsv`` (columns ``first``,
    ``second``, ``label``) under ``out_dir``; returns their URLs.

    Every two consecutive paragraphs of a docstring give a ``next`` row, and the same first
    paragraph with a later (not opening) paragraph of another docstring of the same split,
    drawn by a stable hash, an ``other`` row. ``train_per_label``: keep only this many
    training first paragraphs (the ones with the smallest stable hash), each with its two
    rows, so this many rows per label (all dev rows are kept).
    """
    return _write_next_paragraph(out_dir, _docstrings(dev_fraction), train_per_label)


def _write_package(
    out_dir: str, docs: Sequence[_Docstring], train_per_label: int | None
) -> tuple[str, str]:
    rows: dict[str, list[tuple[str, str]]] = {"train": [], "dev": []}
    for doc in docs:
        rows[doc.split].extend((paragraph, doc.package) for paragraph in doc.paragraphs)
    if train_per_label is not None:
        keep = set()
        for label in LABELS:
            mine = [i for i, (_, lab) in enumerate(rows["train"]) if lab == label]
            mine.sort(key=lambda i: stable_unit("sample-task-subset", rows["train"][i][0]))
            keep.update(mine[:train_per_label])
        rows["train"] = [row for i, row in enumerate(rows["train"]) if i in keep]
    urls = [
        _write_tsv(fsio.join(out_dir, f"{split}.tsv"), ("text", "label"), rows[split], quoted=True)
        for split in ("train", "dev")
    ]
    log.info(
        "package task: %d train and %d dev paragraphs, labels %s",
        len(rows["train"]),
        len(rows["dev"]),
        ", ".join(LABELS),
    )
    return urls[0], urls[1]


def _write_next_paragraph(
    out_dir: str, docs: Sequence[_Docstring], train_per_label: int | None
) -> tuple[str, str]:
    rows: dict[str, list[tuple[str, str, str]]] = {}
    for split in ("train", "dev"):
        mine = [d for d in docs if d.split == split]
        pool = [(d.doc_id, p) for d in mine for p in d.paragraphs[1:]]
        pairs = [(d, i) for d in mine for i in range(len(d.paragraphs) - 1)]
        if split == "train" and train_per_label is not None:
            ranked = sorted(
                range(len(pairs)),
                key=lambda k: stable_unit("next-paragraph-subset", pairs[k][0].doc_id, pairs[k][1]),
            )
            pairs = [pairs[k] for k in sorted(ranked[:train_per_label])]
        rows[split] = []
        for doc, i in pairs:
            first, second = doc.paragraphs[i], doc.paragraphs[i + 1]
            others = [p for d, p in pool if d != doc.doc_id and p != second]
            if not others:
                raise ValueError(f"next-paragraph task: no other docstring in {split} to draw from")
            other = others[int(rng_for("next-paragraph", doc.doc_id, i).integers(len(others)))]
            rows[split] += [(first, second, NEXT_LABELS[0]), (first, other, NEXT_LABELS[1])]
    header = ("first", "second", "label")
    urls = [_write_tsv(fsio.join(out_dir, f"{s}.tsv"), header, rows[s]) for s in ("train", "dev")]
    log.info(
        "next-paragraph task: %d train and %d dev paragraph pairs",
        len(rows["train"]),
        len(rows["dev"]),
    )
    return urls[0], urls[1]


def write_demo_suite(
    out_dir: str,
    train_per_label: int | None = 32,
    pairs_per_label: int | None = 64,
    dev_fraction: float = 0.2,
) -> str:
    """Write the ``package`` and ``next-paragraph`` tasks into ``out_dir/<task>/`` and
    ``out_dir/suite.yaml`` naming them (paths relative to it, labels fixed, each scored by
    dev accuracy) for ``bertpipe evaluate suite=<it>``; returns the YAML's URL.

    ``train_per_label``: the ``package`` task's training rows per label; ``pairs_per_label``:
    the ``next-paragraph`` task's (None: all of them).
    """
    import yaml

    tasks = [
        ("package", _write_package, train_per_label, {"text_a": "text", "labels": list(LABELS)}),
        (
            "next-paragraph",
            _write_next_paragraph,
            pairs_per_label,
            {"text_a": "first", "text_b": "second", "labels": list(NEXT_LABELS)},
        ),
    ]
    docs = _docstrings(dev_fraction)
    entries = []
    for name, write, per_label, columns in tasks:
        write(fsio.join(out_dir, name), docs, per_label)
        entries.append(
            {
                "name": name,
                "family": "table",
                "train": f"{name}/train.tsv",
                "dev": f"{name}/dev.tsv",
                "score": "accuracy",
                "task": {**columns, "label": "label"},
            }
        )
    url = fsio.join(out_dir, SUITE_FILE)
    text = yaml.safe_dump({"name": SUITE_NAME, "tasks": entries}, sort_keys=False)
    fsio.atomic_write_text(url, text)
    return url
