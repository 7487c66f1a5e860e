"""Document readers: any fsspec URL, three layouts, compression by extension.

Layouts (``input.format``):

- ``sentences``: one sentence per line, a blank line between documents (the input format
  of Google's and NVIDIA's BERT data scripts).
- ``jsonl``: one JSON object per line; the text is in ``input.text_field`` and the id, if
  any, in ``input.id_field``. Text is split into sentences.
- ``text``: one document per file, split into sentences (blank lines are boundaries).
- ``parquet``: one document per row (``input.text_field``, ``input.id_field``), read one
  row group at a time with pyarrow.

Text is split into sentences by the rules of ``input.language`` (or of each record's
``input.language_field``): see :mod:`bertpipe.preprocessing.sentences` and
docs/languages.md.

Uncompressed ``sentences`` and ``jsonl`` files can be read in byte ranges (``start``,
``end``): a range yields the documents whose first line starts in it, so a 20 GB file is
read by many workers at once (its documents are then named by their byte offset, the same
whatever the cut); parquet files split by row groups.

``.gz``, ``.bz2`` and ``.zst`` are decompressed by extension. Bad input never crashes a run:
empty, binary and non-UTF-8 files and unknown extensions are skipped, counted and logged with
the file name; documents with too few sentences and overlong sentences likewise. Inputs are
opened read-only.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import lzma
import posixpath
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Literal

import fsspec.spec

from bertpipe import fsio
from bertpipe.config import ConfigError
from bertpipe.errors import BertpipeError, TransientError
from bertpipe.preprocessing.sentences import (
    check_language,
    is_english,
    segment_sentences,
    split_sentences,
)

log = logging.getLogger(__name__)

__all__ = ["Document", "InputConfig", "read_documents", "relative_name"]

COMPRESSION = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".zstd": "zstd"}
EXTENSIONS = {
    "sentences": (".txt", ".text"),
    "text": (".txt", ".text", ".md", ".rst"),
    "jsonl": (".jsonl", ".json", ".ndjson"),
    "parquet": (".parquet", ".pq"),
}
_SNIFF_BYTES = 1 << 16


@dataclass
class InputConfig:
    """Which documents to read and how they are laid out."""

    paths: list[str] = field(default_factory=list)
    """Files, folders or globs; any fsspec URL (``s3://bucket/wiki/*.txt.gz``)."""
    format: Literal["sentences", "jsonl", "text", "parquet"] = "sentences"
    """``sentences``: a sentence per line, blank line between documents; ``jsonl``: a JSON
    record per line; ``text``: a document per file; ``parquet``: a record per row (the
    files of hub datasets), read a row group at a time."""
    text_field: str = "text"
    """JSONL and parquet: the field (column) holding the document text."""
    id_field: str | None = None
    """JSONL and parquet: the field holding a document id (else file name and byte offset
    or row number)."""
    split_sentences: bool | None = None
    """Run the sentence splitter; null means no for ``sentences`` (lines are sentences),
    yes for the others. An overlong line is always split."""
    language: str = "en"
    """The corpus's language (``ko``, ``ja``, ``zh``, ``de``...; any language code), which
    picks the sentence splitter's rules: ``en`` keeps the English rules of the paper recipe;
    any other goes to sentencex, which knows the terminators of every script (``。``, ``！``,
    ``।``...) and Korean endings (``…합니다. 다음``). See docs/languages.md."""
    language_field: str | None = None
    """JSONL and parquet: the field (column) holding each document's language code; a
    record without it (or with null) is in ``language``; one that is not a language code is
    counted (``documents_language_invalid``) and read as ``language``."""
    max_sentence_chars: int = 10_000
    """Longer sentences (after splitting) are skipped and counted."""
    allow_partial: bool = False
    """Go on without an input file that was listed when the job was planned but is gone or
    unreadable when its turn comes (counted as ``files_failed``). Default: such a file fails
    the job with one line naming it, exit 75 (the storage may come back; the same command
    continues the job). A file that breaks in the middle (a truncated archive) is kept to
    where it broke either way, counted as ``files_partly_read``."""

    def __post_init__(self) -> None:
        if self.max_sentence_chars < 1:
            raise ConfigError("max_sentence_chars", "must be at least 1")
        try:
            check_language(self.language)
        except ValueError as exc:
            raise ConfigError(
                "language", f"{exc} (it picks the sentence splitter's rules)"
            ) from None
        if self.language_field is not None and self.format not in ("jsonl", "parquet"):
            raise ConfigError(
                "language_field",
                f"is for jsonl and parquet records; input.format={self.format} has no "
                "fields: set input.language for the whole corpus instead",
            )

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


def split_extension(url: str) -> tuple[str, str | None]:
    """The layout extension of ``url`` and its compression (``a.txt.gz`` -> ``.txt``, ``gzip``)."""
    name = posixpath.basename(url).lower()
    base, ext = posixpath.splitext(name)
    compression = COMPRESSION.get(ext)
    if compression:
        ext = posixpath.splitext(base)[1]
    return ext, compression


def read_documents(
    url: str,
    cfg: InputConfig,
    counts: Counter[str],
    *,
    root: str = "",
    start: int = 0,
    end: int | None = None,
    offset_ids: bool = False,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[Document]:
    """Yield the documents of one file (or of its byte range ``[start, end)``), updating
    ``counts`` with what was read and skipped (see :func:`_documents`).

    A file that is gone or unreadable (``FileNotFoundError``, no permission, an I/O error of
    the storage) raises :class:`InputGoneError` (exit 75) unless ``cfg.allow_partial``; one
    that breaks in the middle (a truncated or corrupt archive, bad parquet) is kept to where
    it broke: ``files_partly_read`` if it gave documents, else ``files_failed``."""
    if (start or end is not None) and not offset_ids and cfg.format != "parquet":
        raise ValueError("a byte range of a file is read with offset_ids=True")
    if start and cfg.format != "parquet" and (split_extension(url)[1] or cfg.format == "text"):
        raise ValueError(f"{url} cannot be read from byte {start}: it is not splittable")
    yielded = 0
    try:
        for doc in _documents(
            url, cfg, counts, root=root, start=start, end=end, offset_ids=offset_ids, keep=keep
        ):
            yielded += 1
            yield doc
    except (OSError, EOFError, ValueError) as exc:
        _stopped(url, exc, counts, yielded, cfg.allow_partial)


class InputGoneError(TransientError):
    """An input file listed when the job was planned is gone or unreadable now."""


def _stopped(url: str, exc: BaseException, counts: Counter[str], yielded: int, allow: bool) -> None:
    what = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    broken = EOFError | ValueError | gzip.BadGzipFile | zlib.error | lzma.LZMAError
    corrupt = isinstance(exc, broken)  # a truncated archive: kept to where it broke
    if not corrupt and not allow:
        raise InputGoneError(
            f"{fsio.redact(url)} was listed when the job was planned and cannot be read now "
            f"({fsio.redact(what)}): the storage may be unavailable; rerun the same command "
            "(it continues the job), or set input.allow_partial=true to go on without it"
        ) from exc
    if yielded:
        counts["files_partly_read"] += 1
        log.warning("read %s only partly: %d document(s), then %s", url, yielded, what)
    else:
        counts["files_failed"] += 1
        log.warning("stopped reading %s: %s", url, what)


def _documents(
    url: str,
    cfg: InputConfig,
    counts: Counter[str],
    *,
    root: str = "",
    start: int = 0,
    end: int | None = None,
    offset_ids: bool = False,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[Document]:
    """Yield the documents of one file (or of its byte range ``[start, end)``), updating
    ``counts`` with what was read and skipped. ``keep(doc_id)`` false skips a document
    before its text is split into sentences (a sample of a big corpus reads fast).

    A range yields the documents whose first line starts inside it, read to their end even
    past ``end``, so the ranges of a file together yield each document exactly once.
    Document ids name the file and the document's ordinal (``sentences``), line number
    (``jsonl``) or row (``parquet``); a range that does not start at 0 cannot know those,
    so a file read in ranges is read with ``offset_ids``: ids name the byte offset where
    the document starts (``name@offset``), the same whatever the cut. File-level counts
    (files read or skipped) come from the range that starts at 0. For ``parquet``,
    ``start``/``end`` are row-group numbers.
    """
    ext, compression = split_extension(url)
    name = relative_name(url, root)
    first = start == 0
    if ext not in EXTENSIONS[cfg.format]:
        if first:
            counts["files_skipped_unknown_extension"] += 1
            log.warning(
                "skipping %s: extension %r is not one of %s for input.format=%s",
                url,
                ext or "(none)",
                ", ".join(EXTENSIONS[cfg.format]),
                cfg.format,
            )
        return
    if cfg.format == "parquet":
        yield from _parquet_docs(url, name, cfg, counts, start, end, keep)
        return
    with fsio.open_url(url, "rb", compression=compression) as f:
        problem = _sniff(f.read(_SNIFF_BYTES))
    if problem:
        if first:
            counts[f"files_skipped_{problem}"] += 1
            log.warning("skipping %s: %s", url, problem.replace("_", " "))
        return
    if first:
        counts["files_read"] += 1
    with fsio.open_url(url, "rb", compression=compression) as f:
        stream = _line_reader(f, compression)
        if cfg.format == "text":
            if keep is None or keep(f"{name}:0"):
                yield from _text_doc(_lines(stream, 0), name, cfg, counts)
            return
        begin, prev_blank = _seek_line(stream, start)
        lines = _lines(stream, begin)
        if cfg.format == "sentences":
            yield from _sentence_docs(lines, name, cfg, counts, end, prev_blank, offset_ids)
        else:
            yield from _jsonl_docs(lines, name, url, cfg, counts, end, offset_ids, keep)


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


def _line_reader(f: Any, compression: str | None) -> IO[bytes]:
    """``f`` as a stream whose lines are cheap. zstandard's reader has no ``readline``, and
    fsspec's remote files (s3fs, gcsfs: ``AbstractBufferedFile``) implement it as
    ``readuntil``, which reads a whole block (``block_size``, megabytes) through the cache and
    copies it for every line, then seeks back: a 100 MB job reading from S3 spent most of
    its time there (BENCHMARKS.md, "Preprocessing on Dask across hosts"). A 1 MB
    ``io.BufferedReader`` over them reads the file in 1 MB calls and splits lines in C; it
    seeks as the file does, which ranges need."""
    if compression == "zstd" or isinstance(f, fsspec.spec.AbstractBufferedFile):
        return io.BufferedReader(f, 1 << 20)
    return f  # type: ignore[no-any-return]


def _lines(stream: IO[bytes], offset: int) -> Iterator[tuple[int, str]]:
    """(byte offset of the line, text) pairs, decoded as UTF-8 with undecodable bytes replaced."""
    for raw in stream:
        yield offset, raw.decode("utf-8", errors="replace").rstrip("\r\n")
        offset += len(raw)


# what str.strip() removes, among ASCII bytes
_ASCII_SPACE = frozenset(b" \t\r\x0b\x0c\x1c\x1d\x1e\x1f")
_BACK_CHUNK = 1 << 12


def _seek_line(stream: IO[bytes], start: int) -> tuple[int, bool]:
    """Move ``stream`` to the first line that starts at or after ``start``; returns that
    offset and whether the line before it is blank (a document starts after a blank line)."""
    if start == 0:
        return 0, True
    stream.seek(start - 1)
    begin = start - 1 + len(stream.readline())  # the rest of the line holding byte start-1
    # the line before `begin` ends with the newline at begin-1: is it blank?
    end = begin - 1
    tail = b""
    pos = end
    while pos > 0:
        back = max(0, pos - _BACK_CHUNK)
        stream.seek(back)
        chunk = stream.read(pos - back)
        cut = chunk.rfind(b"\n")
        tail = chunk[cut + 1 :] + tail
        if cut >= 0 or any(b not in _ASCII_SPACE and b < 0x80 for b in chunk[cut + 1 :]):
            break
        pos = back
    stream.seek(begin)
    if any(b not in _ASCII_SPACE and b < 0x80 for b in tail):
        return begin, False
    if all(b in _ASCII_SPACE for b in tail):
        return begin, True
    return begin, not tail.decode("utf-8", errors="replace").strip()  # non-ASCII spaces


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


def _split(text: str, cfg: InputConfig, counts: Counter[str], language: str) -> list[str]:
    if is_english(language):
        return _clean(split_sentences(text), cfg, counts)
    return _clean(segment_sentences(text, language), cfg, counts)


def _language(value: object, cfg: InputConfig, counts: Counter[str], where: str) -> str:
    """A record's language: its ``language_field`` value, else ``input.language``."""
    if value is None or value == "":
        return cfg.language
    if isinstance(value, str):
        try:
            return check_language(value)
        except ValueError:
            pass
    counts["documents_language_invalid"] += 1
    if counts["documents_language_invalid"] <= 10:
        log.warning(
            "%s: %s=%r is not a language code such as ko, ja or zh-CN; read as input.language=%s",
            where,
            cfg.language_field,
            value,
            cfg.language,
        )
    return cfg.language


def _sentence_docs(
    lines: Iterator[tuple[int, str]],
    name: str,
    cfg: InputConfig,
    counts: Counter[str],
    end: int | None = None,
    prev_blank: bool = True,
    offset_ids: bool = False,
) -> Iterator[Document]:
    """Documents (runs of non-blank lines) whose first line starts before ``end``; lines
    before the first document start belong to the previous range's last document."""
    sentences: list[str] = []
    doc_start = -1
    ordinal = 0

    def doc_id() -> str:
        return f"{name}@{doc_start}" if offset_ids else f"{name}:{ordinal}"

    for offset, line in lines:
        line = line.strip()
        if not line:
            if doc_start >= 0 and sentences:
                yield Document(doc_id(), sentences)
                ordinal += 1
            if doc_start >= 0:
                sentences = []
                doc_start = -1
            prev_blank = True
            continue
        if doc_start < 0:
            if not prev_blank:
                continue  # the tail of a document that started before this range
            if end is not None and offset >= end:
                return
            doc_start = offset
        prev_blank = False
        if cfg.splitting or len(line) > cfg.max_sentence_chars:
            sentences.extend(_split(line, cfg, counts, cfg.language))
        else:
            sentences.extend(_clean([line], cfg, counts))
    if doc_start >= 0 and sentences:
        yield Document(doc_id(), sentences)


def _jsonl_docs(
    lines: Iterator[tuple[int, str]],
    name: str,
    url: str,
    cfg: InputConfig,
    counts: Counter[str],
    end: int | None = None,
    offset_ids: bool = False,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[Document]:
    for number, (offset, line) in enumerate(lines, start=1):
        if end is not None and offset >= end:
            return
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            text = record[cfg.text_field]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            counts["records_malformed"] += 1
            if counts["records_malformed"] <= 10:
                log.warning(
                    "%s %s: not a JSON object with a %r field (%s); skipped",
                    url,
                    f"at byte {offset}" if offset_ids else f"line {number}",
                    cfg.text_field,
                    type(exc).__name__,
                )
            continue
        doc_id = f"{name}@{offset}" if offset_ids else f"{name}:{number}"
        if cfg.id_field and cfg.id_field in record:
            doc_id = str(record[cfg.id_field])
        if keep is None or keep(doc_id):
            language = cfg.language
            if cfg.language_field:
                language = _language(record.get(cfg.language_field), cfg, counts, doc_id)
            yield from _record_doc(text, doc_id, cfg, counts, language)


def _record_doc(
    text: object, doc_id: str, cfg: InputConfig, counts: Counter[str], language: str
) -> Iterator[Document]:
    """The document of one JSONL or parquet record's text."""
    if not isinstance(text, str):
        counts["records_malformed"] += 1
        return
    sentences = (
        _split(text, cfg, counts, language)
        if cfg.splitting
        else _clean([s.strip() for s in text.splitlines() if s.strip()], cfg, counts)
    )
    if sentences:
        yield Document(doc_id, sentences)
    else:
        counts["documents_empty"] += 1


def _parquet_docs(
    url: str,
    name: str,
    cfg: InputConfig,
    counts: Counter[str],
    start: int,
    end: int | None,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[Document]:
    """Rows of row groups ``[start, end)``, one row group in memory at a time."""
    import pyarrow.parquet as pq

    with fsio.open_url(url, "rb") as f:
        pf = pq.ParquetFile(f)
        meta = pf.metadata
        if start == 0:
            counts["files_read"] += 1
        columns = [cfg.text_field] + [f for f in (cfg.id_field, cfg.language_field) if f]
        columns = [c for c in columns if c in pf.schema_arrow.names]
        row = sum(meta.row_group(g).num_rows for g in range(start))
        for group in range(start, meta.num_row_groups if end is None else end):
            table = pf.read_row_group(group, columns=columns)
            texts = table.column(cfg.text_field).to_pylist()
            ids, languages = (
                table.column(f).to_pylist() if f in table.column_names else [None] * len(texts)
                for f in (cfg.id_field, cfg.language_field)
            )
            del table
            for text, doc_id, language in zip(texts, ids, languages, strict=True):
                key = f"{name}#{row}" if doc_id is None else str(doc_id)
                row += 1
                if keep is None or keep(key):
                    lang = _language(language, cfg, counts, key) if cfg.language_field else None
                    yield from _record_doc(text, key, cfg, counts, lang or cfg.language)


def _text_doc(
    lines: Iterator[tuple[int, str]], name: str, cfg: InputConfig, counts: Counter[str]
) -> Iterator[Document]:
    text = "\n".join(line for _, line in lines)
    if cfg.splitting:
        sentences = _split(text, cfg, counts, cfg.language)
    else:
        sentences = _clean([s.strip() for s in text.splitlines() if s.strip()], cfg, counts)
    if sentences:
        yield Document(f"{name}:0", sentences)
    else:
        counts["documents_empty"] += 1


class NoTrainingDataError(BertpipeError):
    """The inputs gave a phase no training instance (every file or document was skipped)."""


def check_input_format(files: Sequence[str], cfg: InputConfig) -> None:
    """One line (exit 2) before anything is read when no input file has an extension that
    ``input.format`` reads: every file would be skipped, and the run would learn or make
    nothing."""
    if not files:
        return
    found = Counter(split_extension(url)[0] for url in files)
    readable = EXTENSIONS[cfg.format]
    if any(ext in readable for ext in found):
        return
    fits = sorted({fmt for fmt, known in EXTENSIONS.items() for ext in found if ext in known})
    fix = (
        "set " + " or ".join(f"input.format={fmt}" for fmt in fits)
        if fits
        else f"give files ending in {', '.join(readable)} (compressed or not)"
    )
    kinds = ", ".join(f"{n} {ext or '(no extension)'}" for ext, n in sorted(found.items()))
    raise ConfigError(
        "input.format",
        f"is {cfg.format}, which reads {', '.join(readable)} files, and none of the "
        f"{len(files)} file(s) matching input.paths={list(cfg.paths)} is one ({kinds}): every "
        f"file would be skipped; {fix} (nothing was read or written)",
    )
