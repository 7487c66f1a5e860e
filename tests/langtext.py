"""Korean, Japanese and Chinese text written by people, for the tests of text handling.

Debian's translations of the GIMP manual (``gimp-help-ko``, ``gimp-help-ja``,
``gimp-help-zh-cn``): ``.ci/run`` unpacks their HTML pages into ``.cache/gimp-help/<lang>/``
where it runs as root with apt-get (docs/languages.md gives the two commands to do it by
hand). The ``gimp_help`` fixture gives a language's pages as text (extracted once per
session by :func:`bertpipe.app.bench.sentences.help_pages`); a test asking for a
language whose pages are absent is skipped, saying how to fetch them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from bertpipe.app.bench.sentences import GIMP_HELP_PACKAGES, help_pages

PAGES = Path(__file__).resolve().parents[1] / ".cache" / "gimp-help"
"""Where .ci/run puts the pages: one folder per language code (``ko``, ``ja``, ``zh``)."""

Pages = list[tuple[str, str]]


@pytest.fixture(scope="session")
def gimp_help() -> Callable[[str], Pages]:
    """``gimp_help("ko")``: (page name, text) of every page of the manual in that language,
    blocks separated by a blank line; skips the test when they are not there."""
    extracted: dict[str, Pages] = {}

    def pages(language: str) -> Pages:
        if language not in extracted:
            extracted[language] = help_pages(PAGES / language)
        if not extracted[language]:
            package = GIMP_HELP_PACKAGES.get(language, f"gimp-help-{language}")
            pytest.skip(
                f"no {language} text in {PAGES / language}: .ci/run fetches it as root "
                f"(`apt-get download {package}`, `dpkg -x`; see docs/languages.md)"
            )
        return extracted[language]

    return pages
