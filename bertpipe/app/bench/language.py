"""``bertpipe bench language``: what pre-training buys in another language, Korean first.

The whole recipe on a translated manual's pages (Debian's GIMP manual, ``.cache/gimp-help/
<lang>/``: docs/languages.md), then the same tiny BERT fine-tuned from its pre-trained export
and from random weights:

1. the corpus: the blocks of text mostly in the language's script (``--corpus``) of the pages
   no dev row comes from (``--pretrain-on``: the pre-trained model never reads a dev text), a
   JSONL record per page; the translation is partial, so the whole pages are mostly the
   English not yet translated;
2. the language's shipped recipe (:data:`RECIPES`): ``tokenizer-ko-cased`` (a vocabulary of
   ``--vocab-size``, learnt from every page) and ``preprocess-ko`` (``input.language=ko``),
   with the demo's data settings (dynamic masking, dupe factor 5, 2% of the pages held out);
3. the demo's pre-training (``pretrain-demo``: 2 layers, hidden 128; 1,600 steps of 32
   sequences of 128 tokens, then 40 of 16 at 512; ``--steps`` changes phase 1's) and export;
4. labelled tasks from the same pages (:mod:`bertpipe.app.bench.manual_task`: which part of
   the manual a paragraph, or a sentence, in the language's script comes from; split by
   page; ``--train-per-label`` rows per class), a suite YAML for ``bertpipe evaluate``;
5. ``bertpipe evaluate`` of the suite from the export and with ``finetune.random_init=true``
   under the paper's protocol (``--learning-rates``, batch 16, ``--epochs``, dev macro-F1 at the
   last epoch), ``--seeds`` each.

It prints the budget (steps, sequences, tokens, wall time), held-out MLM accuracy beside the
unigram baseline, the suite's scores from both initialisations (mean ± std over the seeds)
and the ``bertpipe runs compare --suites`` table; the last line is one JSON object. Each
step's resolved config is written beside its outputs under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bertpipe.errors import BertpipeError

log = logging.getLogger(__name__)

__all__ = ["RECIPES", "add_arguments", "run_bench"]

RECIPES = {"ko": ("tokenizer-ko-cased", "preprocess-ko")}
"""Language -> its shipped tokenizer and preprocessing recipes."""
EXPERIMENT = "bench-language"
HELDOUT_FRACTION = 0.02
"""Pages held out for the held-out MLM accuracy (by a stable hash of their record)."""
LEARNING_RATES = "0.0005,0.002"
"""The fine-tuning grid: 2e-3 is the demo's rate; 5e-4 was the best of 1e-4, 5e-4 and 2e-3 for
both initialisations on the Korean tasks (BENCHMARKS.md)."""
BUDGET_FILE = "pretrain-budget.json"
"""What pre-training cost, kept beside the export (``--reuse`` reads it back)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pages",
        default=".cache/gimp-help",
        help="folder with one subfolder of HTML pages per language (what .ci/run fetches)",
    )
    parser.add_argument("--language", default="ko", help=f"one of {', '.join(RECIPES)}")
    parser.add_argument("--out", default=None, help="work folder (runs/bench-language-<lang>)")
    parser.add_argument(
        "--max-pages",
        type=int,
        default=None,
        help="only this many pages (those with the most paragraphs in the language): faster",
    )
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument(
        "--steps",
        type=int,
        nargs=2,
        default=None,
        metavar=("PHASE1", "PHASE2"),
        help="pre-training steps per phase (pretrain-demo's 1600 40)",
    )
    parser.add_argument("--seeds", default="1,2,3", help="fine-tuning seeds per model")
    parser.add_argument("--epochs", type=int, default=10, help="fine-tuning epochs")
    parser.add_argument(
        "--learning-rates",
        default=LEARNING_RATES,
        help="fine-tuning learning rates, separated by commas: each model and task at the one "
        "with its best mean dev score (the paper's protocol)",
    )
    parser.add_argument("--train-per-label", type=int, default=32, help="training rows per class")
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=None,
        help="the suite's tasks, of part-paragraph, part-sentence, word-order (default: the "
        "first two; word-order is at chance for both models at this budget)",
    )
    parser.add_argument("--dev-fraction", type=float, default=0.3, help="pages' share for dev")
    parser.add_argument(
        "--pretrain-on",
        choices=("all", "training-pages"),
        default="training-pages",
        help="pre-train on every page, or only on the pages no dev row comes from "
        "(the default: the pre-trained model never reads a dev text)",
    )
    parser.add_argument(
        "--corpus",
        choices=("pages", "script"),
        default="script",
        help="pre-train only on the pages' blocks mostly in the language's script (the "
        "default), or on their whole text (the language and the English not yet translated)",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="reuse the pre-trained export already in --out (an earlier run's): only the "
        "tasks and the fine-tuning run again",
    )


def check_args(args: argparse.Namespace) -> Path:
    """The language's pages folder; one line (exit 2) before any work for what cannot run."""
    from bertpipe.app.bench.sentences import GIMP_HELP_PACKAGES

    problems = []
    if args.language not in RECIPES:
        problems.append(
            f"--language {args.language}: no shipped recipe for it (one of {', '.join(RECIPES)})"
        )
    if args.steps is not None and min(args.steps) < 1:
        problems.append("--steps: each phase at least 1 step")
    for name in ("epochs", "train_per_label", "vocab_size"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_pages is not None and args.max_pages < 2:
        problems.append("--max-pages must be at least 2 (a training and a dev page)")
    if not 0.0 < args.dev_fraction < 1.0:
        problems.append("--dev-fraction must be in (0, 1)")
    try:
        [int(s) for s in str(args.seeds).split(",")]
    except ValueError:
        problems.append("--seeds must be integers separated by commas")
    try:
        if min(float(s) for s in str(args.learning_rates).split(",")) <= 0:
            problems.append("--learning-rates must be above 0")
    except ValueError:
        problems.append("--learning-rates must be numbers separated by commas")
    folder = Path(args.pages) / args.language
    if not problems and not any(folder.glob("*.html")):
        package = GIMP_HELP_PACKAGES.get(args.language, f"gimp-help-{args.language}")
        problems.append(
            f"no HTML pages in {folder}: fetch them with `apt-get download {package}` and "
            "`dpkg -x` (docs/languages.md, .ci/run)"
        )
    if problems:
        raise BertpipeError("bench language: " + "; ".join(problems) + " (nothing was run)")
    return folder


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from bertpipe.app import demo
    from bertpipe.app.bench.manual_task import (
        DEFAULT_TASKS,
        TASKS,
        ManualPage,
        dev_pages,
        manual_pages,
        script_text,
        write_manual_suite,
    )

    folder = check_args(args)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    language = args.language
    out = Path(args.out or f"runs/bench-language-{language}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{out / 'mlflow.db'}"
    common = [f"tracking.uri={uri}", f"tracking.experiment={EXPERIMENT}"]
    seeds = tuple(int(s) for s in str(args.seeds).split(","))
    size = demo.Size(
        vocab_size=args.vocab_size,
        heldout_fraction=HELDOUT_FRACTION,
        phase_steps=tuple(args.steps) if args.steps else (None, None),  # type: ignore[arg-type]
        seeds=seeds,
        epochs=args.epochs,
        train_per_label=args.train_per_label,
        learning_rates=tuple(float(s) for s in str(args.learning_rates).split(",")),
    )
    started, load = time.monotonic(), [os.getloadavg()[0]]
    pages = manual_pages(folder, language, args.max_pages)
    corpus = pages
    if args.pretrain_on == "training-pages":
        held = dev_pages(pages, language, args.dev_fraction)
        corpus = [p for p in pages if p.name not in held]
    if args.corpus == "script":
        corpus = [
            ManualPage(p.name, text, p.divisions)
            for p in corpus
            if (text := script_text(p.text, language))
        ]
    if args.reuse and (out / BUDGET_FILE).exists():
        budget = json.loads((out / BUDGET_FILE).read_text())
        was = budget["corpus"]
        now = {"pages": len(corpus), "pretrain_on": args.pretrain_on, "text": args.corpus}
        if any(was.get(key) != value for key, value in now.items()):
            raise BertpipeError(
                f"bench language: --reuse: the export in {out} was pre-trained on "
                f"{ {key: was.get(key) for key in now} }, these options give {now}: run "
                "without --reuse (or with the earlier run's options)"
            )
        log.info("bench language: reusing the export in %s", out)
    else:
        budget = _pretrained(out, common, corpus, language, size)
        budget["corpus"]["pretrain_on"] = args.pretrain_on
        budget["corpus"]["text"] = args.corpus
        (out / BUDGET_FILE).write_text(json.dumps(budget, indent=2) + "\n")
    if (out / "tasks").exists():  # no task of an earlier run's suite left beside this one's
        import shutil

        shutil.rmtree(out / "tasks")
    tasks = write_manual_suite(
        pages,
        str(out / "tasks"),
        language,
        args.train_per_label,
        args.dev_fraction,
        tasks=args.tasks or DEFAULT_TASKS,
    )
    for name, info in tasks.items():
        info["bag_of_words"] = bag_of_words(out / "tasks" / name)
    run_id = uuid.uuid4().hex[:12]
    results = {name: demo._evaluate(out, common, name, run_id, size) for name in demo.MODELS}
    load.append(os.getloadavg()[0])
    lines = _budget_lines(out, budget)
    lines += demo._suite_lines(
        out, results["pretrained"], results["random-init"], size, TASKS, "dev macro-F1"
    )
    sys.stdout.write("\n".join(lines) + "\n\nBENCHMARKS.md rows:\n")
    sys.stdout.write(_markdown(tasks, results, budget) + "\n")
    sys.stdout.flush()
    demo._compare(out, uri, run_id, EXPERIMENT)
    scores = {
        name: {
            "average": [r.scores.average, r.scores.average_std],
            **{t.task: [t.mean, t.std] for t in r.scores.tasks},
            "per_seed": {t.task: t.scores for t in r.scores.tasks},
        }
        for name, r in results.items()
    }
    return {
        "name": f"language-{language}",
        "language": language,
        "out": str(out),
        "budget": budget,
        "tasks": tasks,
        "protocol": {
            "learning_rates": list(size.learning_rates),
            "batch_size": demo.BATCH_SIZE,
            "epochs": args.epochs,
            "seeds": list(seeds),
            "epoch": "last",
        },
        "scores": scores,
        "gain_points": round(100 * results["pretrained"].scores.average, 1)
        - round(100 * results["random-init"].scores.average, 1),
        "load_average": load,
        "seconds": round(time.monotonic() - started, 1),
    }


def _pretrained(
    out: Path, common: list[str], pages: list[Any], language: str, size: Any
) -> dict[str, Any]:
    """Corpus, tokenizer, shards, pre-training and export (the demo's steps with the
    language's recipes) into ``out``; returns the budget, also written to
    ``out/pretrain-budget.json``."""
    from bertpipe.app import demo
    from bertpipe.app.bench.manual_task import script_share
    from bertpipe.app.bench.recipes import _mean_tokens
    from bertpipe.config import load_config
    from bertpipe.training.pretrain.config import PretrainConfig

    tokenizer_recipe, preprocess_recipe = RECIPES[language]
    corpus = _write_corpus(out / "corpus", pages)
    text = "\n\n".join(p.text for p in pages)
    tokenizer = demo.demo_tokenizer(
        out,
        common,
        size.vocab_size,
        config=tokenizer_recipe,
        extra=["sample_fraction=1.0", f"tracking.run_name={language}-tokenizer"],
    )
    shards = demo._preprocess(out, common, size.heldout_fraction, config=preprocess_recipe)
    cfg = load_config(PretrainConfig, "pretrain-demo", demo._size_overrides(size))
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    pretrain = demo._pretrain(out, common, size)
    wall = time.monotonic() - t0
    demo._export(out)
    phases = {}
    for spec, (name, info) in zip(cfg.phases, pretrain.items(), strict=True):  # type: ignore[attr-defined]
        data = out / "shards" / Path(spec.data).name
        sequences = info["steps"] * spec.global_batch_size
        phases[name] = {
            "steps": info["steps"],
            "batch": spec.global_batch_size,
            "max_seq_length": int(data.name.removeprefix("seq")),
            "sequences": sequences,
            "tokens": round(sequences * _mean_tokens(data)),
            "heldout_loss": _finite(info.get("loss")),
            "heldout_mlm_accuracy": _finite(info.get("mlm_accuracy")),
            "heldout_nsp_accuracy": _finite(info.get("nsp_accuracy")),
            "unigram_baseline": _finite(demo.unigram_baseline(data)),
        }
    budget = {
        "corpus": {
            "pages": len(pages),
            "mb": round(len(text.encode()) / 1e6, 3),
            "script_share": round(script_share(text, language), 4),
            "file": corpus,
        },
        "recipes": [tokenizer_recipe, preprocess_recipe, "pretrain-demo"],
        "vocab_size": tokenizer["vocab_size"],  # type: ignore[index]
        "shards": shards,
        "phases": phases,
        "sequences": sum(p["sequences"] for p in phases.values()),
        "tokens": sum(p["tokens"] for p in phases.values()),
        "pretrain_wall_s": round(wall, 1),
        "load_average": [load0, os.getloadavg()[0]],
        "threads": _threads(),
    }
    (out / BUDGET_FILE).write_text(json.dumps(budget, indent=2) + "\n")
    return budget


def _finite(value: float | None) -> float | None:
    """``value``, or None where it is missing or not finite (no held-out split: the JSON line
    stays JSON)."""
    return value if value is not None and math.isfinite(value) else None


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _write_corpus(folder: Path, pages: list[Any]) -> str:
    """A JSONL record per page (``id``: its file name) in ``folder``, emptied first."""
    import shutil

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    path = folder / "pages.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": p.name, "text": p.text}, ensure_ascii=False) + "\n" for p in pages
        ),
        encoding="utf-8",
    )
    return str(path)


def _budget_lines(out: Path, budget: dict[str, Any]) -> list[str]:
    corpus = budget["corpus"]
    lines = [
        "",
        f"bench language: outputs in {out}",
        f"  corpus      {corpus['pages']} pages, {corpus['mb']} MB of text, "
        f"{100 * corpus['script_share']:.1f}% of the letters in the language's script",
        f"  recipes     {', '.join(budget['recipes'])}; vocabulary {budget['vocab_size']} tokens",
    ]
    for name, p in budget["phases"].items():
        lines.append(
            f"  {name:11s} {p['steps']} steps x {p['batch']} sequences of {p['max_seq_length']} "
            f"= {p['sequences']:,} sequences, {p['tokens']:,} tokens; held-out MLM accuracy "
            f"{_fmt(p['heldout_mlm_accuracy'])} (unigram baseline {_fmt(p['unigram_baseline'])}), "
            f"NSP {_fmt(p['heldout_nsp_accuracy'])}"
        )
    lines.append(
        f"  pre-training {budget['sequences']:,} sequences, {budget['tokens']:,} tokens in "
        f"{budget['pretrain_wall_s'] / 60:.1f} min ({budget['threads']} torch threads, load "
        f"average {budget['load_average'][0]:.1f} -> {budget['load_average'][1]:.1f})"
    )
    return lines


def bag_of_words(task_dir: Path) -> dict[str, float]:
    """The task's dev score (macro-F1 for the parts, accuracy for word order: the suite's
    score metric) of tf-idf features and a logistic regression trained on the task's
    training rows (scikit-learn; the features' vocabulary from both files' texts, no labels):
    what the words alone give (``words``: scikit-learn's word tokens; ``chars``: character
    2-4-grams within words, which see a Korean word's stem apart from its particles)."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score, f1_score

    def read(name: str) -> tuple[list[str], list[str]]:
        rows = [line.split("\t") for line in (task_dir / name).read_text().splitlines()[1:]]
        return [r[0] for r in rows], [r[1] for r in rows]

    (train, y_train), (dev, y_dev) = read("train.tsv"), read("dev.tsv")
    out = {}
    for name, vectorizer in (
        ("words", TfidfVectorizer()),
        ("chars", TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 4))),
    ):
        vectorizer.fit(train + dev)
        model = LogisticRegression(max_iter=2000).fit(vectorizer.transform(train), y_train)
        predicted = model.predict(vectorizer.transform(dev))
        if task_dir.name.startswith("part-"):
            out[name] = float(f1_score(y_dev, predicted, average="macro"))
        else:
            out[name] = float(accuracy_score(y_dev, predicted))
    return out


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _markdown(
    tasks: dict[str, dict[str, Any]], results: dict[str, Any], budget: dict[str, Any]
) -> str:
    """The result as BENCHMARKS.md's table: task, classes, rows, both models' scores."""
    from bertpipe.app.demo import _score

    pre, rnd = results["pretrained"].scores, results["random-init"].scores
    lines = [
        "| task | classes | train / dev rows | largest class of dev % | tf-idf words / chars | "
        "pre-trained | random init | learning rate (pre-trained / random) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mine, other in zip(pre.tasks, rnd.tasks, strict=True):
        info = tasks[mine.task]
        bow = info["bag_of_words"]
        lines.append(
            f"| {mine.task} | {len(info['classes'])} | {info['train']} / {info['dev']} | "
            f"{100 * info['dev_majority']:.1f} | {100 * bow['words']:.1f} / "
            f"{100 * bow['chars']:.1f} | {_score(mine.mean, mine.std)} | "
            f"{_score(other.mean, other.std)} | {mine.learning_rate:g} / "
            f"{other.learning_rate:g} |"
        )
    lines.append(
        f"| average | | | | | {_score(pre.average, pre.average_std)} | "
        f"{_score(rnd.average, rnd.average_std)} | |"
    )
    return "\n".join(lines)
