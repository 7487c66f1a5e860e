"""A small labelled task available offline: which standard-library package a paragraph of
documentation comes from (asyncio, email, tkinter or xml).

Built from the same Python documentation as the demo corpus (:mod:`preprocessing.
sample_corpus`), so nothing is downloaded. Rows are paragraphs of those packages'
docstrings; the train/dev split is by a stable hash of the docstring's id, so paragraphs of
one docstring never straddle it. ``train_per_label`` keeps a fixed, class-balanced subset
of the training rows (the ones with the smallest stable hash per label): with few labelled
examples the task shows what pre-training is worth, where with all ~1,000 rows it is
lexical enough for a bag of words (0.95) and a randomly initialised BERT (up to 0.94). Written as
TSV files with ``text`` and ``label`` columns, the layout the generic ``table`` task reader
takes.
"""

from __future__ import annotations

import csv
import io
import logging
import re

from bertpipe import fsio
from bertpipe.seeding import stable_unit

log = logging.getLogger(__name__)

__all__ = ["LABELS", "write_python_docs_task"]

LABELS = ("asyncio", "email", "tkinter", "xml")
_SPACES = re.compile(r"\s+")


def write_python_docs_task(
    out_dir: str, dev_fraction: float = 0.2, train_per_label: int | None = None
) -> tuple[str, str]:
    """Write ``train.tsv`` and ``dev.tsv`` under ``out_dir``; returns their URLs.

    ``train_per_label``: keep only this many training rows per label (all dev rows are kept).
    """
    from bertpipe.preprocessing.sample_corpus import iter_python_docs

    rows: dict[str, list[tuple[str, str]]] = {"train": [], "dev": []}
    for doc_id, text in iter_python_docs(min_chars=100, packages=LABELS):
        if not doc_id.startswith("stdlib/"):
            continue
        package = doc_id.split("/")[1].split(":")[0].removesuffix(".py")
        if package not in LABELS:
            continue
        split = "dev" if stable_unit("sample-task", doc_id) < dev_fraction else "train"
        for paragraph in text.split("\n\n"):
            paragraph = _SPACES.sub(" ", paragraph).strip()
            if len(paragraph) >= 60:
                rows[split].append((paragraph, package))
    if train_per_label is not None:
        keep = set()
        for label in LABELS:
            mine = [i for i, (_, lab) in enumerate(rows["train"]) if lab == label]
            mine.sort(key=lambda i: stable_unit("sample-task-subset", rows["train"][i][0]))
            keep.update(mine[:train_per_label])
        rows["train"] = [row for i, row in enumerate(rows["train"]) if i in keep]
    urls = []
    for split in ("train", "dev"):
        buf = io.StringIO()
        writer = csv.writer(buf, delimiter="\t", lineterminator="\n")
        writer.writerow(["text", "label"])
        writer.writerows(rows[split])
        url = fsio.join(out_dir, f"{split}.tsv")
        fsio.atomic_write_text(url, buf.getvalue())
        urls.append(url)
    log.info(
        "python-docs task: %d train and %d dev paragraphs, labels %s",
        len(rows["train"]),
        len(rows["dev"]),
        ", ".join(LABELS),
    )
    return urls[0], urls[1]
