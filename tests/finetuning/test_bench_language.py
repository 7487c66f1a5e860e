"""``bertpipe bench language``: the Korean recipe from the GIMP manual's pages to a pre-trained
tiny BERT, and the labelled tasks made from the same pages
(:mod:`bertpipe.app.bench.manual_task`), fine-tuned from the export and from random weights.

The pages are Debian's ``gimp-help-ko`` (``.cache/gimp-help/ko``, fetched by ``.ci/run``);
without them the tests that read them skip and say how to fetch them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bertpipe.app.bench.sentences import GIMP_HELP_PACKAGES
from tests.cli_runner import run_cli
from tests.langtext import PAGES

HANGUL = re.compile("[\uac00-\ud7a3]")


def _korean_pages() -> Path:
    folder = PAGES / "ko"
    if not any(folder.glob("*.html")):
        pytest.skip(
            f"no ko pages in {folder}: .ci/run fetches them as root (`apt-get download "
            f"{GIMP_HELP_PACKAGES['ko']}`, `dpkg -x`; see docs/languages.md)"
        )
    return folder


def _read(path: Path) -> list[tuple[str, str]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "text\tlabel"
    return [(text, label) for text, label in (line.split("\t") for line in lines[1:])]


def test_manual_tasks_are_korean_balanced_and_split_by_page(tmp_path: Path) -> None:
    """Every row is mostly Hangul; training holds the same number of rows per class; no page
    gives rows to both splits (a page's text is found in one split only); the suite loads."""
    from bertpipe.app.bench.manual_task import (
        _blocks,
        dev_pages,
        manual_pages,
        script_share,
        write_manual_suite,
    )
    from bertpipe.finetuning.evaluation.suite import check_suite, load_suite

    pages = manual_pages(_korean_pages(), "ko", max_pages=60)
    summary = write_manual_suite(pages, str(tmp_path), "ko", train_per_label=8)
    held = dev_pages(pages, "ko", 0.3)
    assert 0 < len(held) < len(pages)
    blocks = {split: set() for split in ("train", "dev")}
    for page in pages:
        blocks["dev" if page.name in held else "train"].update(_blocks(page.text))
    paragraphs = {split: _read(tmp_path / "part-paragraph" / f"{split}.tsv") for split in blocks}
    # a dev paragraph is on a dev page and on no training page; a training one on a training page
    assert all(t in blocks["dev"] and t not in blocks["train"] for t, _ in paragraphs["dev"])
    assert all(t in blocks["train"] for t, _ in paragraphs["train"])
    for task in ("part-paragraph", "part-sentence"):
        train = _read(tmp_path / task / "train.tsv")
        dev = _read(tmp_path / task / "dev.tsv")
        classes = summary[task]["classes"]
        assert len(classes) >= 2
        assert sorted({label for _, label in train}) == classes
        assert {label for _, label in dev} <= set(classes)
        assert [sum(1 for _, lab in train if lab == c) for c in classes] == [8] * len(classes)
        assert not {t for t, _ in train} & {t for t, _ in dev}
        for text, _ in train + dev:
            assert script_share(text, "ko") >= 0.5 and HANGUL.search(text), text
        assert (summary[task]["train"], summary[task]["dev"]) == (len(train), len(dev))
    suite = check_suite(load_suite(str(tmp_path / "suite.yaml"), str(tmp_path)), "fail")
    assert [t.name for t in suite.tasks] == ["part-paragraph", "part-sentence"]


@pytest.mark.integration
def test_bench_language_pretrains_and_fine_tunes_both_models(tmp_path: Path) -> None:
    """The whole bench at a tiny size (12 pages, 20 + 4 steps, one seed, one epoch): the last
    line is one JSON object whose budget adds up, and both models were scored on both
    tasks, from the export and from random weights."""
    pages = _korean_pages().parent
    out = tmp_path / "bench"
    done = run_cli(
        [
            *("bench", "language", "--pages", str(pages), "--language", "ko"),
            *("--out", str(out), "--max-pages", "12", "--steps", "20", "4", "--seeds", "1"),
            *("--epochs", "1", "--train-per-label", "8", "--vocab-size", "2000"),
        ]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    budget = result["budget"]
    # pre-training reads the Hangul blocks of the training pages only (no dev page's text)
    assert 0 < budget["corpus"]["pages"] < 12
    assert (budget["corpus"]["pretrain_on"], budget["corpus"]["text"]) == (
        "training-pages",
        "script",
    )
    assert budget["corpus"]["script_share"] > 0.9
    assert budget["recipes"] == ["tokenizer-ko-cased", "preprocess-ko", "pretrain-demo"]
    assert [p["steps"] for p in budget["phases"].values()] == [20, 4]
    assert budget["sequences"] == 20 * 32 + 4 * 16
    assert budget["tokens"] > 0.5 * 20 * 32 * 128
    for model in ("pretrained", "random-init"):
        scores = result["scores"][model]
        assert set(scores) == {"average", "part-paragraph", "part-sentence", "per_seed"}
        assert 0.0 <= scores["average"][0] <= 1.0
        resolved = (out / "evaluate" / model / "evaluate.yaml").read_text()
        assert f"random_init: {str(model == 'random-init').lower()}" in resolved
    assert "| part-paragraph | " in done.stdout
    tokenizer = json.loads((out / "tokenizer" / "tokenizer_config.json").read_text())
    assert tokenizer["do_lower_case"] is False  # the Korean (cased) recipe


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--language", "xx"], "--language xx: no shipped recipe for it (one of ko)"),
        (["--steps", "0", "4"], "--steps: each phase at least 1 step"),
        (["--language", "ko"], "no HTML pages in {pages}/ko: fetch them with `apt-get download"),
    ],
)
def test_bench_language_refuses_bad_options_in_one_line(
    tmp_path: Path, options: list[str], message: str
) -> None:
    done = run_cli(
        ["bench", "language", "--pages", str(tmp_path), "--out", str(tmp_path), *options]
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bertpipe: error: bench language: ")
    assert message.format(pages=tmp_path) in lines[0]
    assert lines[0].endswith("(nothing was run)")
    assert not any(tmp_path.iterdir())
