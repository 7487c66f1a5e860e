"""Small labelled tasks available offline, made from the Python documentation that the demo
corpus (:mod:`preprocessing.sample_corpus`) is made of, so nothing is downloaded.

Rows come from the docstrings of four standard-library packages (asyncio, email, tkinter,
xml), cut into paragraphs (at blank lines, whitespace collapsed, at least 60 characters).
The train/dev split is by a stable hash of the docstring's id, the same in every task, so no
docstring straddles it. Every choice is a stable hash: the same Python gives the same files.
Both tasks ask which package the text comes from (4 classes; columns ``text`` and
``label``):

* ``package-paragraph`` (:func:`write_python_docs_task`): a paragraph. ``train_per_label``
  keeps a fixed, class-balanced subset of the training rows (the ones with the smallest
  stable hash per label): with few labelled examples the task shows what pre-training is
  worth, where with all ~1,000 rows it is lexical enough for a bag of words (0.95) and a
  randomly initialised BERT (up to 0.94).
* ``package-sentence`` (:func:`write_sentence_task`): one sentence of such a paragraph (as
  :func:`~preprocessing.sentences.split_sentences` cuts it, at least 40 characters), so
  fewer words to go by; each sentence once per split, and none in dev that is also in
  training. ``train_per_label`` as above.

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
from bertpipe.seeding import stable_unit

log = logging.getLogger(__name__)

__all__ = [
    "LABELS",
    "SUITE_FILE",
    "SUITE_NAME",
    "write_demo_suite",
    "write_python_docs_task",
    "write_sentence_task",
]

LABELS = ("asyncio", "email", "tkinter", "xml")
"""The packages: the tasks' classes."""
SUITE_NAME = "python-docs"
"""The suite's name in ``bertpipe evaluate``'s runs and tables."""
SUITE_FILE = "suite.yaml"
_MIN_PARAGRAPH_CHARS = 60
_MIN_SENTENCE_CHARS = 40
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
    ``.tsv`` so; the texts hold no tab or newline); ``quoted``: CSV quoting of fields with a
    double quote, as the ``package-paragraph`` task has always been written (the reader
    then keeps those quotes as part of the text)."""
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
    """Write the ``package-paragraph`` task's ``train.tsv`` and ``dev.tsv`` under ``out_dir``;
    returns their URLs.

    ``train_per_label``: keep only this many training rows per label (all dev rows are kept).
    """
    return _write_package(out_dir, _docstrings(dev_fraction), train_per_label)


def write_sentence_task(
    out_dir: str, dev_fraction: float = 0.2, train_per_label: int | None = None
) -> tuple[str, str]:
    """Write the ``package-sentence`` task's ``train.tsv`` and ``dev.tsv`` under ``out_dir``;
    returns their URLs.

    ``train_per_label``: keep only this many training rows per label (all dev rows are kept).
    """
    return _write_sentences(out_dir, _docstrings(dev_fraction), train_per_label)


def _write_package(
    out_dir: str, docs: Sequence[_Docstring], train_per_label: int | None
) -> tuple[str, str]:
    rows: dict[str, list[tuple[str, str]]] = {"train": [], "dev": []}
    for doc in docs:
        rows[doc.split].extend((paragraph, doc.package) for paragraph in doc.paragraphs)
    if train_per_label is not None:
        rows["train"] = _balanced(rows["train"], train_per_label, "sample-task-subset")
    urls = [
        _write_tsv(fsio.join(out_dir, f"{split}.tsv"), ("text", "label"), rows[split], quoted=True)
        for split in ("train", "dev")
    ]
    log.info(
        "package-paragraph task: %d train and %d dev paragraphs, labels %s",
        len(rows["train"]),
        len(rows["dev"]),
        ", ".join(LABELS),
    )
    return urls[0], urls[1]


def _write_sentences(
    out_dir: str, docs: Sequence[_Docstring], train_per_label: int | None
) -> tuple[str, str]:
    from bertpipe.preprocessing.sentences import split_sentences

    rows: dict[str, dict[str, str]] = {"train": {}, "dev": {}}  # sentence -> package
    for doc in docs:
        for paragraph in doc.paragraphs:
            for sentence in split_sentences(paragraph):
                if len(sentence) >= _MIN_SENTENCE_CHARS:
                    rows[doc.split].setdefault(sentence, doc.package)
    train = list(rows["train"].items())
    dev = [(text, label) for text, label in rows["dev"].items() if text not in rows["train"]]
    if train_per_label is not None:
        train = _balanced(train, train_per_label, "sentence-task-subset")
    header = ("text", "label")
    urls = [
        _write_tsv(fsio.join(out_dir, f"{split}.tsv"), header, found)
        for split, found in (("train", train), ("dev", dev))
    ]
    log.info("package-sentence task: %d train and %d dev sentences", len(train), len(dev))
    return urls[0], urls[1]


def _balanced(rows: list[tuple[str, str]], per_label: int, key: str) -> list[tuple[str, str]]:
    """``per_label`` rows of each label (those whose text has the smallest stable hash under
    ``key``), in their order in ``rows``."""
    keep = set()
    for label in LABELS:
        mine = [i for i, (_, lab) in enumerate(rows) if lab == label]
        mine.sort(key=lambda i: stable_unit(key, rows[i][0]))
        keep.update(mine[:per_label])
    return [row for i, row in enumerate(rows) if i in keep]


def write_demo_suite(
    out_dir: str, train_per_label: int | None = 32, dev_fraction: float = 0.2
) -> str:
    """Write the ``package-paragraph`` and ``package-sentence`` tasks into
    ``out_dir/<task>/`` and ``out_dir/suite.yaml`` naming them (paths relative to it, labels
    fixed, each scored by dev accuracy) for ``bertpipe evaluate suite=<it>``; returns the
    YAML's URL.

    ``train_per_label``: training rows per label of each task (None: all of them).
    """
    import yaml

    docs = _docstrings(dev_fraction)
    entries = []
    # a sentence fits 64 tokens (the longest are cut, counted): half the paragraphs' cost
    for name, write, length in (
        ("package-paragraph", _write_package, 128),
        ("package-sentence", _write_sentences, 64),
    ):
        write(fsio.join(out_dir, name), docs, train_per_label)
        options = {"text_a": "text", "label": "label", "labels": list(LABELS)}
        entries.append(
            {
                "name": name,
                "family": "table",
                "train": f"{name}/train.tsv",
                "dev": f"{name}/dev.tsv",
                "score": "accuracy",
                "task": {**options, "max_seq_length": length},
            }
        )
    url = fsio.join(out_dir, SUITE_FILE)
    text = yaml.safe_dump({"name": SUITE_NAME, "tasks": entries}, sort_keys=False)
    fsio.atomic_write_text(url, text)
    return url
