"""``bertpipe bench sentences``: sentence splitting per language, on text people wrote.

The text: Debian's translations of the GIMP manual (``gimp-help-ko``, ``gimp-help-ja``,
``gimp-help-zh-cn``, ``gimp-help-en``), HTML pages that ``.ci/run`` unpacks into
``.cache/gimp-help/<lang>/`` (``apt-get download gimp-help-ko && dpkg -x ...``: see
docs/languages.md). :func:`html_text` gives a page's text as a person would copy it out of a
browser: a blank line between blocks (paragraphs, headings, list items, table cells), the
line breaks of the HTML source inside them. The translations are partial: the Korean pages
are 7% Hangul (the rest is English the translators have not reached), the Japanese 42%
kana and Han, the Chinese 2% Han; :func:`script_of_ending` tells their endings apart.

For each language (one JSON object at the end, as every benchmark):

- ``mb_per_s``: megabytes of page text per second through the splitter that
  ``input.language=<lang>`` picks (median of ``--repeats``, and the range), one core;
- ``endings`` and ``endings_found``: the sentence endings in the text (counted by
  :func:`sentence_endings`) and the share of them at which a sentence ends; also per script
  (``hangul``, ``cjk``, ``other``) and, for comparison, what the English rules find;
- with ``--preprocess``: the job itself on the pages (a cased WordPiece vocabulary learnt
  from them, a JSONL record per page, ``input.language=<lang>``) against the same pages split
  at every counted ending beforehand and read as ``sentences`` (the "split by hand"
  reference): documents too short, and the random-next fraction of both.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from bertpipe.preprocessing.sentences import (
    is_english,
    segment_sentences,
    split_paragraphs,
    split_sentences,
)

log = logging.getLogger(__name__)

__all__ = [
    "GIMP_HELP_PACKAGES",
    "add_arguments",
    "endings_found",
    "help_pages",
    "html_text",
    "reference_sentences",
    "run_bench",
    "sentence_endings",
    "splitter",
]

GIMP_HELP_PACKAGES = {
    "ko": "gimp-help-ko",
    "ja": "gimp-help-ja",
    "zh": "gimp-help-zh-cn",
    "en": "gimp-help-en",
}
"""Language code -> the Debian package of the GIMP manual in it (``.cache/gimp-help/<code>``)."""

# ---------------------------------------------------------------------- HTML to text

_BLOCKS = frozenset(
    [
        *("p", "li", "h1", "h2", "h3", "h4", "h5", "h6", "td", "th", "dt", "dd", "pre"),
        *("div", "title", "tr", "table", "ul", "ol", "dl", "hr", "blockquote", "caption"),
        *("figure", "figcaption"),
    ]
)
_SKIPPED = frozenset(["script", "style", "head"])
_NAVIGATION = frozenset(["navheader", "navfooter"])  # DocBook's previous/next links


class _TextParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skipping = 0
        self.divs: list[bool] = []  # per open <div>: is it navigation (skipped)?

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "div":
            nav = any(k == "class" and v and _NAVIGATION & set(v.split()) for k, v in attrs)
            self.divs.append(nav)
            self.skipping += nav
        elif tag in _SKIPPED:
            self.skipping += 1
        if tag == "br":
            self.parts.append("\n")
        elif tag in _BLOCKS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag: str) -> None:
        if tag == "div":
            if self.divs and self.divs.pop():
                self.skipping -= 1
        elif tag in _SKIPPED:
            self.skipping = max(0, self.skipping - 1)
        if tag in _BLOCKS:
            self.parts.append("\n\n")

    def handle_data(self, data: str) -> None:
        if not self.skipping:
            self.parts.append(data)


_BLOCK_BREAK = re.compile(r"\n[^\S\n]*\n\s*")
_BLANKS = re.compile(r"[^\S\n]+")


def html_text(html: str) -> str:
    """The text of an HTML page: blocks separated by a blank line, each block's lines as
    in the source (spaces collapsed, lines stripped), navigation and scripts left out."""
    parser = _TextParser()
    parser.feed(html)
    parser.close()
    blocks = []
    for block in _BLOCK_BREAK.split("".join(parser.parts)):
        lines = [_BLANKS.sub(" ", line).strip() for line in block.split("\n")]
        if any(lines):
            blocks.append("\n".join(line for line in lines if line))
    return "\n\n".join(blocks)


def help_pages(folder: Path) -> list[tuple[str, str]]:
    """(relative path, text) of every ``*.html`` page under ``folder`` with any text, sorted."""
    pages = []
    for path in sorted(folder.rglob("*.html")):
        text = html_text(path.read_text(encoding="utf-8", errors="replace"))
        if text:
            pages.append((path.relative_to(folder).as_posix(), text))
    return pages


# ---------------------------------------------------------------------- sentence endings

_CJK_TERMINATORS = "。！？｡．"
_TERMINATORS = ".!?" + _CJK_TERMINATORS
_CLOSERS = "\"'”’»)]}」』）】〕〉》"
_ENDING = re.compile(rf"[{re.escape(_TERMINATORS)}…]++[{re.escape(_CLOSERS)}]*+")
_NEXT_CHAR = re.compile(r"\s*(\S)")
_NUMBER = re.compile(r"[\d.]+")
_NEVER_FINAL = frozenset(["e.g", "i.e", "cf", "vs"])
_OPENERS = "\"'(“‘[「『（"


def sentence_endings(paragraph: str) -> list[int]:
    """Offsets just after each sentence ending in ``paragraph`` (one paragraph, line breaks
    folded), counted on the raw text independently of any splitter:

    - a run of ``。！？｡．`` (and the closing quotes or brackets after it) is an ending,
      unless a closing quote is followed at once by a letter (``「はい。」と言った``: a
      quotation inside a sentence);
    - a run of ``.!?`` (and closers) is an ending when whitespace or the paragraph's end
      follows, except: an ellipsis (``...``, ``…``: menu items ``Resize...``); before a
      lower-case Latin letter (``e.g. this``); after a single Latin letter (an initial:
      ``J. Smith``); after ``e.g``/``i.e``/``cf``/``vs``; after a number with a dot inside
      (``2.4. File Open``, ``그림 14.151. ...``: section and figure numbers); and after a
      whole number among the paragraph's first two words (``4. Next``: a list item's
      number). So ``다.``, ``요.``, ``합니다.`` before a space or a line break are endings,
      and so is ``255.`` later in a sentence.
    """
    out = []
    first = paragraph.find(" ")
    second_word_ends = paragraph.find(" ", first + 1) if first >= 0 else -1
    for match in _ENDING.finditer(paragraph):
        start, end = match.span()
        run = match.group()
        core = run.rstrip(_CLOSERS)
        after = paragraph[end : end + 1]
        if not any(c in _TERMINATORS for c in core) or core == "." * len(core) > ".":
            continue  # an ellipsis: "Open…", "Resize...", "Wait... what"
        if any(c in _CJK_TERMINATORS for c in core):
            if len(core) < len(run) and after.isalnum():
                continue
            out.append(end)
            continue
        if after and not after.isspace():
            continue  # file.txt, 2.10, a.b
        following = _NEXT_CHAR.match(paragraph, end)
        if following and following.group(1).isascii() and following.group(1).islower():
            continue
        word = paragraph[_word_start(paragraph, start) : start].lstrip(_OPENERS)
        if not word:
            continue
        if len(word) == 1 and word.isascii() and word.isalpha():
            continue
        if word.lower().rstrip(".") in _NEVER_FINAL:
            continue
        if _NUMBER.fullmatch(word) and (
            "." in word.strip(".") or second_word_ends < 0 or start < second_word_ends
        ):
            continue
        out.append(end)
    return out


def _word_start(text: str, end: int) -> int:
    """Where the word that ends at ``end`` starts (after the last whitespace before it)."""
    return max(text.rfind(c, 0, end) for c in " \n\t") + 1


def reference_sentences(text: str) -> list[str]:
    """``text`` split at every ending :func:`sentence_endings` counts and at blank lines:
    the "split by hand" reference."""
    sentences = []
    for paragraph in split_paragraphs(text):
        cuts = [0, *sentence_endings(paragraph), len(paragraph)]
        for start, end in itertools.pairwise(cuts):
            sentence = paragraph[start:end].strip()
            if sentence:
                sentences.append(sentence)
    return sentences


_SPACE = re.compile(r"\s+")


def _visible(text: str) -> int:
    return len(text) - sum(len(m) for m in _SPACE.findall(text))


def script_of_ending(paragraph: str, end: int) -> str:
    """``hangul``, ``cjk`` (Han or kana) or ``other``: the script of the letter before the
    ending that finishes at ``end``."""
    i = end - 1
    while i > 0 and paragraph[i] in _TERMINATORS + _CLOSERS + "…":
        i -= 1
    c = paragraph[i]
    if "\uac00" <= c <= "\ud7a3":
        return "hangul"
    if "\u3040" <= c <= "\u30ff" or "\u4e00" <= c <= "\u9fff":
        return "cjk"
    return "other"


def endings_found(text: str, sentences: list[str]) -> dict[str, tuple[int, int]]:
    """Per script and ``all``: (sentence endings in ``text``, how many of them end one of
    ``sentences``, the splitter's output for ``text``). Positions are compared in visible
    (non-space) characters, so the splitter's whitespace does not matter; it must keep
    every other character, in order (ValueError if not)."""
    ends = set()
    at = 0
    for sentence in sentences:
        at += _visible(sentence)
        ends.add(at)
    out: dict[str, list[int]] = {"all": [0, 0]}
    base = 0
    for paragraph in split_paragraphs(text):
        previous, visible = 0, base
        for end in sentence_endings(paragraph):
            visible += _visible(paragraph[previous:end])
            previous = end
            hit = visible in ends
            for key in ("all", script_of_ending(paragraph, end)):
                counts = out.setdefault(key, [0, 0])
                counts[0] += 1
                counts[1] += hit
        base += _visible(paragraph)
    if base != at:
        raise ValueError(f"the sentences hold {at} visible characters, the text {base}")
    return {k: (v[0], v[1]) for k, v in out.items()}


def splitter(language: str) -> Callable[[str], list[str]]:
    """The sentence splitter ``input.language=language`` picks (see readers)."""
    if is_english(language):
        return split_sentences
    return lambda text: segment_sentences(text, language)


# ---------------------------------------------------------------------- the benchmark


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pages",
        default=".cache/gimp-help",
        help="folder with one subfolder of HTML pages per language (what .ci/run fetches)",
    )
    parser.add_argument(
        "--languages",
        nargs="+",
        default=sorted(GIMP_HELP_PACKAGES),
        help="language codes (subfolders of --pages); a missing one is skipped with a note",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per language")
    parser.add_argument(
        "--preprocess",
        action="store_true",
        help="also run the job on the pages: documents too short, random-next fraction vs "
        "the pages split by hand",
    )
    parser.add_argument("--dupe-factor", type=int, default=5, help="with --preprocess")
    parser.add_argument("--workdir", help="with --preprocess: keep corpora and shards here")


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.pages)
    result: dict[str, Any] = {"pages": str(root), "languages": {}, "missing": []}
    for language in args.languages:
        folder = root / language
        if not folder.is_dir() or not any(folder.rglob("*.html")):
            package = GIMP_HELP_PACKAGES.get(language, f"gimp-help-{language}")
            log.warning(
                "no pages in %s: fetch them with `apt-get download %s` and `dpkg -x` "
                "(docs/languages.md); skipped",
                folder,
                package,
            )
            result["missing"].append(language)
            continue
        texts = [text for _, text in help_pages(folder)]
        figures = measure_splitting(texts, language, args.repeats)
        if args.preprocess:
            work = Path(args.workdir) / language if args.workdir else None
            figures["preprocess"] = preprocess_pages(texts, language, args.dupe_factor, work)
        log.info("%s: %s", language, figures)
        result["languages"][language] = figures
    return result


def measure_splitting(texts: list[str], language: str, repeats: int) -> dict[str, Any]:
    """MB/s of the splitter for ``language`` over ``texts`` and the sentence endings found."""
    split = splitter(language)
    megabytes = sum(len(t.encode()) for t in texts) / 1e6
    seconds = []
    for _ in range(max(1, repeats)):
        started = time.perf_counter()
        outputs = [split(t) for t in texts]
        seconds.append(time.perf_counter() - started)
    rates = [megabytes / s for s in seconds]
    found = _found(texts, outputs)
    english = _found(texts, [split_sentences(t) for t in texts]) if language != "en" else None
    return {
        "pages": len(texts),
        "mb": round(megabytes, 3),
        "mb_per_s": round(statistics.median(rates), 2),
        "mb_per_s_range": [round(min(rates), 2), round(max(rates), 2)],
        "sentences": sum(len(o) for o in outputs),
        "endings": found["all"][0],
        "endings_found": _share(found["all"]),
        "endings_found_by_script": {k: _share(v) for k, v in found.items() if k != "all"},
        "endings_by_script": {k: v[0] for k, v in found.items() if k != "all"},
        **({"english_rules_endings_found": _share(english["all"])} if english else {}),
    }


def _found(texts: Iterable[str], outputs: Iterable[list[str]]) -> dict[str, tuple[int, int]]:
    total: dict[str, tuple[int, int]] = {}
    for text, sentences in zip(texts, outputs, strict=True):
        for key, (n, hit) in endings_found(text, sentences).items():
            was = total.get(key, (0, 0))
            total[key] = (was[0] + n, was[1] + hit)
    return total


def _share(pair: tuple[int, int]) -> float:
    return round(pair[1] / pair[0], 4) if pair[0] else 1.0


def preprocess_pages(
    texts: list[str], language: str, dupe_factor: int = 5, work: Path | None = None
) -> dict[str, Any]:
    """The preprocessing job on ``texts`` (a JSONL record per page, ``input.language``)
    against the same pages split by hand (:func:`reference_sentences`, ``sentences``
    layout), with one cased WordPiece vocabulary learnt from the pages: documents read and
    too short, sentences, instances and the random-next fraction of each, one phase of 128."""
    if work is None:
        with tempfile.TemporaryDirectory(prefix="bench-sentences-") as tmp:
            return preprocess_pages(texts, language, dupe_factor, Path(tmp))
    from bertpipe.app.cli import main

    pages, by_hand = work / "pages", work / "by-hand"
    pages.mkdir(parents=True, exist_ok=True)
    by_hand.mkdir(parents=True, exist_ok=True)
    (pages / "pages.jsonl").write_text(
        "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts),
        encoding="utf-8",
    )
    (by_hand / "pages.txt").write_text(
        "".join("\n".join(reference_sentences(t)) + "\n\n" for t in texts), encoding="utf-8"
    )
    tokenizer = work / "tokenizer"
    overrides = ["overwrite=true", "tracking.enabled=false"]
    code = main(
        [
            "tokenizer",
            "train",
            f"input.paths=[{by_hand}]",
            f"output={tokenizer}",
            "vocab_size=8000",
            "lowercase=false",
            *overrides,
        ]
    )
    if code:
        raise RuntimeError(f"tokenizer training failed with exit status {code}")
    out: dict[str, Any] = {}
    for name, inputs in (
        ("split_by_language", [f"input.paths=[{pages}]", "input.format=jsonl"]),
        ("split_by_hand", [f"input.paths=[{by_hand}]", "input.format=sentences"]),
    ):
        shards = work / f"shards-{name}"
        code = main(
            [
                "preprocess",
                *inputs,
                f"input.language={language}",
                f"tokenizer={tokenizer}",
                f"output={shards}",
                f"dupe_factor={dupe_factor}",
                "phases=[{name: seq128, max_seq_length: 128, max_predictions_per_seq: 20}]",
                *overrides,
            ]
        )
        if code:
            raise RuntimeError(f"preprocess ({name}) failed with exit status {code}")
        out[name] = _manifest_figures(shards / "seq128" / "manifest.json")
    out["random_next_difference"] = round(
        out["split_by_language"]["random_next_fraction"]
        - out["split_by_hand"]["random_next_fraction"],
        4,
    )
    return out


def _manifest_figures(path: Path) -> dict[str, Any]:
    manifest = json.loads(path.read_text())
    corpus = manifest["stats"]["corpus"]
    train = manifest["stats"]["train"]
    read = corpus.get("documents_read", 0)
    short = corpus.get("documents_too_short", 0)
    return {
        "documents_read": read,
        "documents_too_short": short,
        "too_short_fraction": round(short / read, 4) if read else 0.0,
        "sentences": corpus.get("sentences", 0),
        "instances": train["instances"],
        "random_next_fraction": round(train["random_next_fraction"], 4),
    }
