"""Sentence splitting for the world's scripts; no model download.

Two splitters, chosen by the corpus's language (``input.language``, or per document from
``input.language_field``; see docs/languages.md):

- English (``en``, the default, also ``en-US`` and the like): the rule-based splitter of the
  BERT paper recipe's output, unchanged. A boundary is terminal punctuation (``.``, ``!``,
  ``?``, optionally followed by closing quotes or brackets), then whitespace, then something
  that can start a sentence (a capital letter, a digit or an opening quote/bracket). A period
  after a known abbreviation or a single-letter initial is not a boundary. This is the same
  family of heuristics as the Punkt defaults, tuned for encyclopedic and technical prose, and
  it is fast: one regular-expression scan per paragraph, linear in its length whatever the
  text (long runs of dots or of anything else included).
- Every other language: `sentencex <https://github.com/wikimedia/sentencex>`_ (Wikimedia,
  MIT licence, rule based, about 300 languages through fallback chains, compiled, no
  dependencies, nothing downloaded), which knows the terminators of every script (``。``,
  ``！``, ``？``, ``।``, ``؟`` ...) and ends Korean ``…합니다. 다음…`` sentences that an English
  capital-letter rule never ends. sentencex is quadratic on some inputs (a paragraph of
  unmatched opening quotes, or of ``。``/``!`` with no space between them: its look-back for
  the word before every terminator runs to the last space), so a paragraph is given to it in
  pieces that hold at most :data:`RISKY_PER_PIECE` such characters, cut where a sentence
  ends; overlong runs of them (9 or more in a row) never reach it. That keeps it linear:
  1 MB of any of them takes about a second, not hours. Section numbers that it cuts off as
  sentences of their own (``2.4.``, ``그림 14.151.``) are joined to the sentence they number.

Either way, blank lines always end a sentence, and a single line break inside a paragraph
is folded: into a space, except between two characters of scripts written without spaces
(Han, kana, CJK punctuation and fullwidth forms: not Hangul), where it disappears, as a
browser renders such text (CSS Text 3, segment breaks).
"""

from __future__ import annotations

import re

import sentencex

__all__ = [
    "check_language",
    "is_english",
    "segment_sentences",
    "split_paragraphs",
    "split_sentences",
]

_ABBREVIATIONS = frozenset(
    [
        "mr",
        "mrs",
        "ms",
        "dr",
        "prof",
        "sr",
        "jr",
        "st",
        "mt",
        "ft",
        "vs",
        "etc",
        "e.g",
        "eg",
        "i.e",
        "ie",
        "cf",
        "al",
        "fig",
        "figs",
        "no",
        "nos",
        "vol",
        "vols",
        "inc",
        "ltd",
        "co",
        "corp",
        "approx",
        "dept",
        "est",
        "ed",
        "eds",
        "rev",
        "gen",
        "col",
        "lt",
        "sgt",
        "capt",
        "cmdr",
        "gov",
        "pres",
        "sen",
        "rep",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
        "u.s",
        "u.k",
        "u.n",
        "e.u",
        "a.m",
        "p.m",
        "ca",
        "op",
        "pp",
        "ch",
        "sec",
        "art",
        "para",
        "resp",
        "viz",
        "ibid",
    ]
)

# A boundary candidate: a whole run of terminal punctuation and closing quotes/brackets (it
# must not continue a run: the lookbehind), whitespace, then a plausible sentence start. The
# boundary itself begins at the run's first ``.``, ``!`` or ``?``; a run without one is none.
# Matching whole runs keeps the scan linear: a pattern that may start at every character of a
# long run of dots rescans the rest of the run from each of them (quadratic; 20,000 dots took
# 2.6 s, a 1 MB line hours).
_RUN_CHARS = r"[.!?\"'”’)\]]"
_BOUNDARY = re.compile(rf"(?<!{_RUN_CHARS}){_RUN_CHARS}++(\s+)(?=[\"'“‘(\[]?[A-Z0-9])")
_TERMINAL = re.compile(r"[.!?]")
_WORD_BEFORE = re.compile(r"([\w.]+)$")
_PARAGRAPH = re.compile(r"\n\s*\n")
_SPACES = re.compile(r"[^\S ]\s*| \s+")  # whitespace that is not already one space
# scripts written without spaces between words: a line break between two of their
# characters is no word break (Hangul is written with spaces and is not here)
_NO_SPACE = (
    "\u2e80-\u2fdf"  # CJK radicals, Kangxi radicals
    "\u3000-\u303f"  # CJK symbols and punctuation (。、「」)
    "\u3040-\u30ff"  # hiragana, katakana
    "\u31f0-\u31ff"  # katakana phonetic extensions
    "\u3400-\u4dbf"  # CJK extension A
    "\u4e00-\u9fff"  # CJK unified ideographs
    "\uf900-\ufaff"  # CJK compatibility ideographs
    "\uff00-\uffef"  # halfwidth and fullwidth forms (！？（）, halfwidth katakana)
    "\U00020000-\U0003134f"  # CJK extensions B-G
)
_CJK_LINE_BREAK = re.compile(rf"(?<=[{_NO_SPACE}])[^\S\n]*\n\s*(?=[{_NO_SPACE}])")


def split_paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, each with its line breaks folded: into a space, or
    into nothing between two characters of a script written without spaces (``…説明\nし
    ます`` is ``…説明します``)."""
    out = []
    for block in _PARAGRAPH.split(text):
        if "\n" in block and not block.isascii():
            block = _CJK_LINE_BREAK.sub("", block)
        block = _SPACES.sub(" ", block).strip()
        if block:
            out.append(block)
    return out


def split_sentences(text: str) -> list[str]:
    """Split ``text`` into sentences; blank lines are hard boundaries."""
    sentences: list[str] = []
    for paragraph in split_paragraphs(text):
        start = 0
        for match in _BOUNDARY.finditer(paragraph):
            terminal = _TERMINAL.search(paragraph, match.start(), match.start(1))
            if terminal is None:  # only closing quotes/brackets before the space
                continue
            if terminal.group() == "." and _is_abbreviation(paragraph, terminal.start()):
                continue
            end = match.start(1)
            sentence = paragraph[start:end].strip()
            if sentence:
                sentences.append(sentence)
            start = match.end()
        tail = paragraph[start:].strip()
        if tail:
            sentences.append(tail)
    return sentences


def _is_abbreviation(text: str, period_at: int) -> bool:
    word_match = _WORD_BEFORE.search(text, max(0, period_at - 20), period_at)
    if word_match is None:
        return False
    word = word_match.group(1).lower().rstrip(".")
    if len(word) == 1 and word.isalpha():  # an initial: "J. Smith", "U. S."
        return True
    return word in _ABBREVIATIONS


# ---------------------------------------------------------------- languages other than English

_LANGUAGE = re.compile(r"[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{1,8})*")


def check_language(code: str) -> str:
    """``code`` if it is a language tag (``ko``, ``ja``, ``zh-CN``, ``pt_BR``); else ValueError."""
    if not isinstance(code, str) or not _LANGUAGE.fullmatch(code):
        raise ValueError(f"{code!r} is not a language code such as en, ko, ja or zh-CN")
    return code


def is_english(language: str) -> bool:
    """Whether ``language`` gets the English rules (``en``, ``en-GB``, ``EN_us``)."""
    return language[:2].lower() == "en" and language[2:3] in ("", "-", "_")


# sentencex's sentence terminators (Unicode's STerm and ATerm, and 。｡), all but the full
# stop: each one makes sentencex look back to the last space or full stop
_TERMINATORS = (
    "!?։؝؞؟۔܀܁܂߹࠷࠹࠽࠾।॥၊။።፧፨᙮᜵᜶᠃᠉᥄᥅᪨᪩᪪᪫᭚᭛᭞᭟᭽᭾᰻᰼᱾᱿․‼‽⁇⁈⁉⸮⸼⹓⹔"
    "꓿꘎꘏꛳꛷꡶꡷꣎꣏꤯꧈꧉꩝꩞꩟꫰꫱꯫﹒﹖﹗！．？｡。"
    "𐩖𐩗𐽕𐽖𐽗𐽘𐽙𐾆𐾇𐾈𐾉𑁇𑁈𑂾𑂿𑃀𑃁𑅁𑅂𑅃𑇅𑇆𑇍𑇞𑇟𑈸𑈹𑈻𑈼𑊩𑑋𑑌"
    "𑗂𑗃𑗉𑗊𑗋𑗌𑗍𑗎𑗏𑗐𑗑𑗒𑗓𑗔𑗕𑗖𑗗𑙁𑙂𑜼𑜽𑜾𑥄𑥆𑩂𑩃𑪛𑪜𑱁𑱂𑻷𑻸𑽃𑽄𖩮𖩯𖫵𖬷𖬸𖭄𖺘𛲟𝪈"
)
# the quotes and brackets sentencex pairs (an opener without a closer makes it search the
# rest of the paragraph for one)
_QUOTES = "`'\"«»‘’‚“”‛„‟‹›《》「」『』【】〈〉（）()[]{}<>"
_CLOSERS = re.escape("\"'”’»›)]}）」』】》〉")
_CJK_TERMINATORS = "。！？｡．"
_RISKY_PER_RUN = 8
RISKY_PER_PIECE = 32
"""At most this many terminators and quotes in a piece of a paragraph given to sentencex:
its time on a piece is at most about this many times the piece's length."""


# Python's re tests a character against a class holding characters beyond U+FFFF ten times
# slower: a paragraph with such terminators is scanned in a copy where each one is U+E000
# (a private-use character, one code point as they are: offsets stay the same)
_STAND_IN = "\ue000"
_ASTRAL_TERMINATORS = {ord(c): _STAND_IN for c in _TERMINATORS if c > "\uffff"}
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")
_TERM = re.escape("".join(c for c in _TERMINATORS if c <= "\uffff") + _STAND_IN)
_RISKY = re.escape("".join(c for c in _TERMINATORS if c <= "\uffff") + _STAND_IN + _QUOTES)
_OVERLONG_RUN = re.compile(rf"[{_RISKY}]{{{_RISKY_PER_RUN + 1},}}")
# up to and including the (RISKY_PER_PIECE / 2)-th terminator or quote
_HALF = re.compile(rf"(?:[^{_RISKY}]*+[{_RISKY}]){{{RISKY_PER_PIECE // 2}}}")
# the last sentence-like end in a span: terminators (a whole run), closers and a space, or
# a CJK full stop, exclamation or question mark and closers; else the last space
_LAST_END = re.compile(
    rf"(?s:.*)(?:(?<![.{_TERM}])[.{_TERM}]++[{_CLOSERS}]*+ "
    rf"|(?<![{_CJK_TERMINATORS}])[{_CJK_TERMINATORS}]++[{_CLOSERS}]*+)"
)
_LAST_SPACE = re.compile(r"(?s:.*) ")
_NUMBERING = re.compile(r"(?:\S{1,12} )?\d+(?:\.\d+)*\.")


def segment_sentences(text: str, language: str) -> list[str]:
    """Split ``text`` into sentences with sentencex's rules for ``language`` (any code;
    one it has no rules for falls back to its defaults, which know every script's
    terminators). Blank lines end a sentence; line breaks fold as :func:`split_paragraphs`
    says."""
    sentences: list[str] = []
    for paragraph in split_paragraphs(text):
        scanned = (
            paragraph.translate(_ASTRAL_TERMINATORS) if _ASTRAL.search(paragraph) else paragraph
        )
        raw: list[str] = []
        start = 0
        for run in _OVERLONG_RUN.finditer(scanned):
            _segment_span(paragraph, scanned, start, run.start(), language, raw)
            # a run of quotes or terminators (garbage, or a decoration) stays with the text
            # before it; the library never sees it
            if raw:
                raw[-1] += paragraph[run.start() : run.end()]
            else:
                raw.append(paragraph[run.start() : run.end()])
            start = run.end()
        _segment_span(paragraph, scanned, start, len(paragraph), language, raw)
        sentences.extend(_join_numbering(raw))
    return sentences


def _segment_span(
    text: str, scanned: str, start: int, end: int, language: str, out: list[str]
) -> None:
    """Append sentencex's sentences of ``text[start:end]``, given to it in pieces of at most
    :data:`RISKY_PER_PIECE` terminators and quotes, each cut after the last sentence end
    (else space) among its last half of them: linear in the span's length. ``scanned`` is
    ``text`` as the patterns read it (terminators beyond U+FFFF replaced)."""
    while start < end:
        cut = end
        half = _HALF.match(scanned, start, end)
        full = _HALF.match(scanned, half.end(), end) if half is not None else None
        if half is not None and full is not None and full.end() < end:
            cut = full.end()
            found = _LAST_END.match(scanned, half.end(), cut) or _LAST_SPACE.match(
                scanned, half.end(), cut
            )
            if found is not None:
                cut = found.end()
        out.extend(sentencex.segment(language, text[start:cut]))
        start = cut


def _join_numbering(raw: list[str]) -> list[str]:
    """Strip sentencex's sentences and join a section number it cut off (``2.4.``,
    ``Figure 3.``) to the sentence it numbers."""
    out: list[str] = []
    pending = ""
    for piece in raw:
        sentence = piece.strip()
        if not sentence:
            continue
        if sentence[-2:-1].isdigit() and sentence[-1] == "." and _NUMBERING.fullmatch(sentence):
            pending += piece
            continue
        if pending:
            sentence = (pending + piece).strip()
            pending = ""
        out.append(sentence)
    if pending:
        out.append(pending.strip())
    return out
