"""The text of evaluation sets, for decontamination (:mod:`bertpipe.preprocessing.quality`).

Reads what fine-tuning and evaluation read, without depending on them (data moves forward:
preprocessing imports no later stage): every text a file holds, whatever its task.

- ``.tsv`` / ``.csv`` (GLUE): every cell of every row (a label or an index is too short to
  form an n-gram and drops out by itself);
- ``.json`` (SQuAD) and ``.jsonl``: every string value (contexts, questions, answers);
- ``.conll`` / ``.iob`` / ``.txt`` / ``eng.testa`` / ``eng.testb`` (CoNLL): the first
  column's tokens, one text per sentence (blank lines between sentences, ``-DOCSTART-`` lines
  skipped).

A folder contributes its files (recursively) except those whose name starts with ``train``:
a task's training data is not evaluation text (name such a file to include it). Each file is
one evaluation set, named by its path below the folder (or its own name), extension dropped.
"""

from __future__ import annotations

import csv
import io
import json
import posixpath
from collections.abc import Iterator
from typing import Any

from bertpipe import fsio
from bertpipe.config import ConfigError

__all__ = ["SUFFIXES", "eval_files", "eval_texts"]

SUFFIXES = (".tsv", ".csv", ".json", ".jsonl", ".conll", ".iob", ".txt", ".testa", ".testb")


def eval_files(paths: list[str]) -> list[tuple[str, str]]:
    """``(set name, url)`` of every evaluation file under ``paths``, sorted by name."""
    found: dict[str, str] = {}
    for given in paths:
        fs, path = fsio.to_fs(given)
        if not fs.exists(path):
            raise ConfigError(
                "quality.decontaminate.paths", f"{given} does not exist: give task folders or files"
            )
        if fs.isdir(path):
            base = path.rstrip("/")
            for found_path in sorted(fs.find(base)):
                name = posixpath.basename(found_path)
                if not name.endswith(SUFFIXES) or name.startswith("train"):
                    continue
                rel = found_path[len(base) :].lstrip("/")
                url = fs.unstrip_protocol(found_path) if not fsio.is_local(fs) else found_path
                found[_name(posixpath.basename(base) + "/" + rel)] = url
        else:
            found[_name(posixpath.basename(path))] = given
    if not found:
        raise ConfigError(
            "quality.decontaminate.paths",
            f"no evaluation files ({', '.join(SUFFIXES)}) under {', '.join(paths)}",
        )
    return sorted(found.items())


def _name(rel: str) -> str:
    """A set's name: its path without the extension; dots (which separate a metric's parts
    in the manifest's statistics) become underscores."""
    for suffix in SUFFIXES:
        if rel.endswith(suffix):
            rel = rel[: -len(suffix)]
            break
    return rel.replace(".", "_")


def eval_texts(paths: list[str]) -> Iterator[tuple[str, str]]:
    """``(set name, text)`` for every text of every evaluation file under ``paths``."""
    for name, url in eval_files(paths):
        with fsio.open_url(url, "rb", compression="infer") as f:
            raw = f.read().decode("utf-8", errors="replace")
        try:
            for text in _texts(url, raw):
                yield name, text
        except ValueError as exc:
            raise ConfigError(
                "quality.decontaminate.paths",
                f"{url} cannot be read as {url.rsplit('.', 1)[-1]} ({exc}): fix or remove it",
            ) from None


def _texts(url: str, raw: str) -> Iterator[str]:
    if url.endswith((".tsv", ".csv")):
        dialect = "excel-tab" if url.endswith(".tsv") else "excel"
        # GLUE's files quote nothing: a lone quote is text, not a field's start
        reader = csv.reader(io.StringIO(raw), dialect=dialect, quoting=csv.QUOTE_NONE)
        for row in reader:
            yield from (cell for cell in row if cell)
    elif url.endswith(".json"):
        yield from _strings(json.loads(raw))
    elif url.endswith(".jsonl"):
        for line in raw.splitlines():
            if line.strip():
                yield from _strings(json.loads(line))
    else:
        tokens: list[str] = []
        for line in raw.splitlines():
            fields = line.split()
            if not fields or fields[0] == "-DOCSTART-":
                if tokens:
                    yield " ".join(tokens)
                tokens = []
                continue
            tokens.append(fields[0])
        if tokens:
            yield " ".join(tokens)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
