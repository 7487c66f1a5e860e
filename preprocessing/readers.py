"""Document readers: any fsspec URL, three layouts, compression by extension.

Layouts (``input.format``):

- ``sentences``: one sentence per line, a blank line between documents (the input format
  of Google's and NVIDIA's BERT data scripts).
- ``jsonl``: one JSON object per line; the text is in ``input.text_field`` and the id, if
  any, in ``input.id_field``. Text is split into sentences.
- ``text``: one document per file, split into sentences (blank lines are boundaries).

``.gz``, ``.bz2`` and ``.zst`` are decompressed by extension. Bad input never crashes a run:
empty, binary and non-UTF-8 files and unknown extensions are skipped, counted and logged with
the file name; documents with too few sentences and overlong sentences likewise. Inputs are
opened read-only.
"""

from __future__ import annotations

import io
import json
import logging
import posixpath
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Literal

from bertpipe import fsio
from bertpipe.config import ConfigError
from bertpipe.preprocessing.sentences import split_sentences

log = logging.getLogger(__name__)

__all__ = ["Document", "InputConfig", "read_documents", "relative_name"]

COMPRESSION = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".zstd": "zstd"}
EXTENSIONS = {
    "sentences": (".txt", ".text"),
    "text": (".txt", ".text", ".md", ".rst"),
    "jsonl": (".jsonl", ".json", ".ndjson"),
}
_SNIFF_BYTES = 1 << 16


@dataclass
class InputConfig:
    """Which documents to read and how they are laid out."""

    paths: list[str] = field(default_factory=list)
    """Files, folders or globs; any fsspec URL (``s3://bucket/wiki/*.txt.gz``)."""
    format: Literal["sentences", "jsonl", "text"] = "sentences"
    """``sentences``: a sentence per line, blank line between documents; ``jsonl``: a JSON
    record per line; ``text``: a document per file."""
    text_field: str = "text"
    """JSONL: the field holding the document text."""
    id_field: str | None = None
    """JSONL: the field holding a document id (else file name and record number)."""
    split_sentences: bool | None = None
    """Run the sentence splitter; null means no for ``sentences`` (lines are sentences),
    yes for the others. An overlong line is always split."""
    max_sentence_chars: int = 10_000
    """Longer sentences (after splitting) are skipped and counted."""

    def __post_init__(self) -> None:
        if self.max_sentence_chars < 1:
            raise ConfigError("max_sentence_chars", "must be at least 1")

    @property
    def splitting(self) -> bool:
        return self.format != "sentences" if self.split_sentences is None else self.split_sentences


@dataclass
class Document:
    """A document: a stable id and its sentences (non-empty strings)."""

    doc_id: str
    sentences: list[str]


def relative_name(url: str, root: str) -> str:
    """``url`` relative to ``root`` (the inputs' common folder), for stable document ids."""
    if root and url.startswith(root.rstrip("/") + "/"):
        return url[len(root.rstrip("/")) + 1 :]
    return posixpath.basename(url)


def common_root(urls: list[str]) -> str:
    if not urls:
        return ""
    if len(urls) == 1:
        return posixpath.dirname(urls[0])
    prefix = posixpath.commonprefix(urls)
    return prefix[: prefix.rfind("/")] if "/" in prefix else ""


def _split_extension(url: str) -> tuple[str, str | None]:
    name = posixpath.basename(url).lower()
    base, ext = posixpath.splitext(name)
    compression = COMPRESSION.get(ext)
    if compression:
        ext = posixpath.splitext(base)[1]
    return ext, compression


def read_documents(
    url: str, cfg: InputConfig, counts: Counter[str], *, root: str = ""
) -> Iterator[Document]:
    """Yield the documents of one file, updating ``counts`` with what was read and skipped."""
    ext, compression = _split_extension(url)
    name = relative_name(url, root)
    if ext not in EXTENSIONS[cfg.format]:
        counts["files_skipped_unknown_extension"] += 1
        log.warning(
            "skipping %s: extension %r is not one of %s for input.format=%s",
            url,
            ext or "(none)",
            ", ".join(EXTENSIONS[cfg.format]),
            cfg.format,
        )
        return
    try:
        with fsio.open_url(url, "rb", compression=compression) as f:
            problem = _sniff(f.read(_SNIFF_BYTES))
        if problem:
            counts[f"files_skipped_{problem}"] += 1
            log.warning("skipping %s: %s", url, problem.replace("_", " "))
            return
        counts["files_read"] += 1
        with fsio.open_url(url, "rb", compression=compression) as f:
            # zstandard's reader has no readline; a buffer over it gives fast line iteration
            lines = _lines(io.BufferedReader(f, 1 << 20) if compression == "zstd" else f)
            if cfg.format == "sentences":
                yield from _sentence_docs(lines, name, cfg, counts)
            elif cfg.format == "jsonl":
                yield from _jsonl_docs(lines, name, url, cfg, counts)
            else:
                yield from _text_doc(lines, name, cfg, counts)
    except (OSError, EOFError, ValueError) as exc:  # truncated archive, bad compression
        counts["files_failed"] += 1
        log.warning("stopped reading %s: %s: %s", url, type(exc).__name__, exc)


def _sniff(head: bytes) -> str | None:
    if not head:
        return "empty"
    if b"\x00" in head:
        return "binary"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not just a character cut at the sniff boundary
            return "not_utf8"
    return None


def _lines(stream: IO[bytes]) -> Iterator[tuple[int, str]]:
    """(line number, text) pairs, decoded as UTF-8 with undecodable bytes replaced."""
    for number, raw in enumerate(stream, start=1):
        yield number, raw.decode("utf-8", errors="replace").rstrip("\r\n")


def _clean(sentences: list[str], cfg: InputConfig, counts: Counter[str]) -> list[str]:
    out = []
    for s in sentences:
        if len(s) > cfg.max_sentence_chars:
            counts["sentences_too_long"] += 1
            continue
        if "\ufffd" in s:
            counts["sentences_invalid_utf8"] += 1
        out.append(s)
    return out


def _split(text: str, cfg: InputConfig, counts: Counter[str]) -> list[str]:
    return _clean(split_sentences(text), cfg, counts)


def _sentence_docs(
    lines: Iterator[tuple[int, str]], name: str, cfg: InputConfig, counts: Counter[str]
) -> Iterator[Document]:
    sentences: list[str] = []
    ordinal = 0
    for _, line in lines:
        line = line.strip()
        if not line:
            if sentences:
                yield Document(f"{name}:{ordinal}", sentences)
                ordinal += 1
                sentences = []
            continue
        if cfg.splitting or len(line) > cfg.max_sentence_chars:
            sentences.extend(_split(line, cfg, counts))
        else:
            sentences.extend(_clean([line], cfg, counts))
    if sentences:
        yield Document(f"{name}:{ordinal}", sentences)


def _jsonl_docs(
    lines: Iterator[tuple[int, str]],
    name: str,
    url: str,
    cfg: InputConfig,
    counts: Counter[str],
) -> Iterator[Document]:
    for number, line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            text = record[cfg.text_field]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            counts["records_malformed"] += 1
            if counts["records_malformed"] <= 10:
                log.warning(
                    "%s line %d: not a JSON object with a %r field (%s); skipped",
                    url,
                    number,
                    cfg.text_field,
                    type(exc).__name__,
                )
            continue
        if not isinstance(text, str):
            counts["records_malformed"] += 1
            continue
        doc_id = f"{name}:{number}"
        if cfg.id_field and cfg.id_field in record:
            doc_id = str(record[cfg.id_field])
        sentences = (
            _split(text, cfg, counts)
            if cfg.splitting
            else _clean([s.strip() for s in text.splitlines() if s.strip()], cfg, counts)
        )
        if sentences:
            yield Document(doc_id, sentences)
        else:
            counts["documents_empty"] += 1


def _text_doc(
    lines: Iterator[tuple[int, str]], name: str, cfg: InputConfig, counts: Counter[str]
) -> Iterator[Document]:
    text = "\n".join(line for _, line in lines)
    if cfg.splitting:
        sentences = _split(text, cfg, counts)
    else:
        sentences = _clean([s.strip() for s in text.splitlines() if s.strip()], cfg, counts)
    if sentences:
        yield Document(f"{name}:0", sentences)
    else:
        counts["documents_empty"] += 1
