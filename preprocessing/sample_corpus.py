"""A real English corpus available offline: the documentation that ships with Python.

Documents are the docstrings of the standard library (modules, classes, functions) and the
language reference topics of ``pydoc_data``. Doctest lines and indented code blocks are
dropped so what remains is prose. The corpus is the same for the same Python version, and
needs no download, which makes it the default for ``make demo`` and the benchmarks.
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import json
import logging
import re
import sysconfig
from collections.abc import Collection, Iterator
from pathlib import Path

from bertpipe import fsio

log = logging.getLogger(__name__)

__all__ = ["iter_python_docs", "write_corpus"]

_SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__"}
_CODE_LINE = re.compile(r"^\s*(>>>|\.\.\.|\$ |%|[-=~^*]{3,}\s*$)")


def _prose(text: str) -> str:
    """Keep prose paragraphs: drop doctests, rule lines and indented (code) blocks."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = [ln for ln in block.splitlines() if ln.strip()]
        if not lines:
            continue
        indent = min(len(ln) - len(ln.lstrip()) for ln in lines)
        if indent >= 4 or any(_CODE_LINE.match(ln) for ln in lines):
            continue
        paragraph = " ".join(ln.strip() for ln in lines)
        if len(paragraph) >= 40 and sum(c.isalpha() for c in paragraph) > 0.6 * len(paragraph):
            paragraphs.append(paragraph)
    return "\n\n".join(paragraphs)


def iter_python_docs(
    min_chars: int = 200, packages: Collection[str] | None = None
) -> Iterator[tuple[str, str]]:
    """Yield ``(doc_id, text)`` for each prose document of the running Python's documentation.

    ``packages``: only the docstrings of these standard-library packages (``asyncio``...), in
    the same order as unfiltered, without the pydoc topics and without parsing the rest."""
    topics: dict[str, str] = {}
    if packages is None:
        with contextlib.suppress(ImportError):  # a stripped Python has no pydoc_data
            from pydoc_data.topics import topics
    for name in sorted(topics):
        text = _prose(topics[name])
        if len(text) >= min_chars:
            yield f"pydoc/{name}", text
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts):
            continue
        if packages is not None and rel.parts[0].removesuffix(".py") not in packages:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(
                node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
            ):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            text = _prose(doc)
            if len(text) >= min_chars:
                name = getattr(node, "name", "<module>")
                yield f"stdlib/{rel.as_posix()}:{name}:{getattr(node, 'lineno', 0)}", text


def write_corpus(
    out_dir: str,
    *,
    fmt: str = "jsonl",
    files: int = 4,
    replicas: int = 1,
    max_documents: int | None = None,
) -> list[str]:
    """Write the Python documentation corpus into ``files`` files and return their URLs.

    ``fmt="jsonl"`` writes ``{"id", "text"}`` records (unsplit paragraphs);
    ``fmt="sentences"`` writes one sentence per line with a blank line between documents,
    split by :mod:`bertpipe.preprocessing.sentences`. ``replicas`` > 1 repeats the corpus under new
    document ids (for scaling benchmarks).
    """
    from bertpipe.preprocessing.sentences import split_sentences

    docs = list(itertools.islice(iter_python_docs(), max_documents))  # the first N, read no more
    buffers: list[list[str]] = [[] for _ in range(files)]
    n = 0
    for rep in range(replicas):
        for doc_id, text in docs:
            rid = doc_id if rep == 0 else f"{doc_id}#copy{rep}"
            target = buffers[n % files]
            if fmt == "jsonl":
                target.append(json.dumps({"id": rid, "text": text}, ensure_ascii=False) + "\n")
            elif fmt == "sentences":
                sentences = [s for p in text.split("\n\n") for s in split_sentences(p)]
                target.append("\n".join(sentences) + "\n\n")
            else:
                raise ValueError(f"unknown corpus format {fmt!r}: use jsonl or sentences")
            n += 1
    ext = "jsonl" if fmt == "jsonl" else "txt"
    urls = []
    for i, chunks in enumerate(buffers):
        url = fsio.join(out_dir, f"python-docs-{i:02d}.{ext}")
        fsio.atomic_write_text(url, "".join(chunks))
        urls.append(url)
    log.info("wrote %d documents (%d replicas) into %d files under %s", n, replicas, files, out_dir)
    return urls
