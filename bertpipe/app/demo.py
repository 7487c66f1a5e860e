"""``bertpipe demo``: the whole flow on an embedded default corpus, on CPU, into one folder.

The corpus is the documentation that ships with Python (no download). Every stage runs
with its real engine (HF tokenizers, Apache Beam on the direct runner, MLflow on a sqlite
store under the output folder) at a size a laptop finishes in minutes. Each stage's
resolved config is written beside its outputs, so any step can be re-run by hand, e.g.
``bertpipe tokenizer train --config <out>/tokenizer/config.yaml``, ``bertpipe preprocess
--config <out>/shards/preprocess.yaml``, ``bertpipe pretrain --config
<out>/pretrain/pretrain.yaml``, ``bertpipe evaluate --config
<out>/evaluate/pretrained/evaluate.yaml``. It ends with a small evaluation suite
(``<out>/tasks/suite.yaml``, two tasks made from the same documentation) fine-tuned from the
pre-trained and from random weights, and the ``bertpipe runs compare --suites`` table of the
two.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bertpipe import fsio
from bertpipe.tracking import runs_page_url

if TYPE_CHECKING:
    from bertpipe.finetuning.evaluation.runner import SuiteResult

log = logging.getLogger(__name__)

__all__ = [
    "add_demo_command",
    "demo_corpus",
    "demo_tasks",
    "demo_tokenizer",
    "run_demo",
    "unigram_baseline",
]

EXPERIMENT = "bertpipe-demo"
SEEDS = [1, 2, 3]
"""Every task is fine-tuned once per seed from each initialisation; the summary gives the
mean and standard deviation over them."""
LEARNING_RATES = [2e-3]
"""The demo protocol's grid: the tiny model's best rate on the paragraph task from either
initialisation (docs/training.md, "What pre-training buys"). With more than one, the rate
with the best mean dev score is chosen per task and model; each one more costs the suite's
time again."""
EPOCHS = 10
BATCH_SIZE = 16
PARALLEL = 1
"""Trials at a time. One, in the demo's process with its 2 threads: on 2 cores two at a time
with a thread each were no faster for this suite (both suites 91 and 109 s, against 95 and
96 s one at a time), with the same scores."""
TASK_TRAIN_PER_LABEL = 32
"""Labelled training paragraphs (sentences) per package in each task (128 in all): few enough
that the tasks need more than word identity learnt from scratch (see docs/training.md, "What
pre-training buys")."""
TASK_WHAT = {
    "package-paragraph": "which package is a paragraph from?",
    "package-sentence": "which package is a sentence from?",
}
"""What each task of the demo's suite asks, for the summary."""
TAG_DEMO = "bertpipe.demo"
"""Set on this demo's suite runs (and their trials), one value per demo run: its compare
table shows them and not an earlier demo's runs in the same store."""
MODELS = {"pretrained": False, "random-init": True}
"""The suite's two models (``model_name``: ``random_init``): the export, and the same
architecture from random weights."""


@dataclass(frozen=True)
class Size:
    """How much of everything the demo does."""

    documents: int | None = None
    """Corpus documents (None: all of the Python documentation's prose, ~2,700)."""
    vocab_size: int = 8000
    heldout_fraction: float = 0.02
    """Documents held out for the held-out MLM accuracy (by a stable hash of their id)."""
    phase_steps: tuple[int | None, int | None] = (None, None)
    """Pre-training steps per phase (None: ``configs/pretrain-demo.yaml``'s)."""
    every_steps: int | None = None
    """Checkpoint and held-out evaluation interval (None: the recipe's)."""
    seeds: tuple[int, ...] = tuple(SEEDS)
    epochs: int = EPOCHS
    train_per_label: int = TASK_TRAIN_PER_LABEL
    learning_rates: tuple[float, ...] = tuple(LEARNING_RATES)
    """The fine-tuning protocol's grid (the best mean dev score's rate per task and model)."""


FULL = Size()
SMOKE = Size(
    documents=120,
    vocab_size=2000,
    heldout_fraction=0.1,
    phase_steps=(12, 4),
    every_steps=6,
    seeds=(1,),
    epochs=1,
    train_per_label=8,
)
"""``--smoke``: every stage and every engine, at a size that only shows they work."""


def add_demo_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "demo",
        help="run the whole flow on a small embedded corpus (CPU, minutes)",
        description=(__doc__ or "").replace("``", "`"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="runs/demo", help="output folder (default runs/demo)")
    parser.add_argument(
        "--documents", type=int, default=None, help="use only this many documents (faster)"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the same flow at a size that checks an installation in about a minute: "
        f"{SMOKE.documents} documents, {SMOKE.phase_steps[0]} + {SMOKE.phase_steps[1]} "
        f"pre-training steps, one seed and one epoch per task (the scores mean nothing)",
    )
    parser.set_defaults(handler=_demo)


def _demo(args: argparse.Namespace, passthrough: list[str]) -> int:
    run_demo(Path(args.out), documents=args.documents, smoke=args.smoke)
    return 0


def run_demo(out: Path, documents: int | None = None, smoke: bool = False) -> dict[str, object]:
    """Run every stage into ``out`` and return what each produced (``smoke``: at
    :data:`SMOKE`'s size)."""
    size = SMOKE if smoke else FULL
    if documents is None:
        documents = size.documents
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{out / 'mlflow.db'}"
    common = [f"tracking.uri={uri}", f"tracking.experiment={EXPERIMENT}"]
    demo_id = uuid.uuid4().hex[:12]
    results: dict[str, object] = {}
    steps: list[tuple[str, Callable[[], object]]] = [
        ("corpus", lambda: demo_corpus(out, documents)),
        ("tokenizer", lambda: demo_tokenizer(out, common, size.vocab_size)),
        ("preprocess", lambda: _preprocess(out, common, size.heldout_fraction)),
        ("pretrain", lambda: _pretrain(out, common, size)),
        ("export", lambda: _export(out)),
        ("tasks", lambda: demo_tasks(out, size.train_per_label)),
        ("evaluate-pretrained", lambda: _evaluate(out, common, "pretrained", demo_id, size)),
        ("evaluate-random-init", lambda: _evaluate(out, common, "random-init", demo_id, size)),
    ]
    started = time.monotonic()
    for name, step in steps:
        t0 = time.monotonic()
        log.info("demo: %s ...", name)
        results[name] = step()
        log.info("demo: %s done in %.1f s", name, time.monotonic() - t0)
    _print_summary(out, uri, results, time.monotonic() - started, size)
    _compare(out, uri, demo_id)
    return results


def demo_corpus(out: Path, documents: int | None) -> list[str]:
    from bertpipe.preprocessing.sample_corpus import write_corpus

    folder = out / "corpus"
    if folder.exists():
        fsio.remove([str(p) for p in folder.iterdir()])
    return write_corpus(str(folder), fmt="jsonl", files=4, max_documents=documents)


def demo_tokenizer(
    out: Path,
    common: list[str],
    vocab_size: int = FULL.vocab_size,
    config: str | None = None,
    extra: Sequence[str] = (),
) -> object:
    """The tokenizer of ``out/corpus`` (``config``: a shipped recipe or YAML file under the
    demo's settings; ``extra``: overrides after them)."""
    from bertpipe.cli_args import write_resolved_config
    from bertpipe.config import load_config
    from bertpipe.preprocessing.config import TokenizerConfig
    from bertpipe.preprocessing.vocab import train_tokenizer

    cfg = load_config(
        TokenizerConfig,
        config,
        [
            f"input.paths=[{out / 'corpus'}]",
            "input.format=jsonl",
            f"output={out / 'tokenizer'}",
            f"vocab_size={vocab_size}",
            "overwrite=true",
            "tracking.run_name=demo-tokenizer",
            *common,
            *extra,
        ],
    )
    summary = train_tokenizer(cfg)
    write_resolved_config(cfg, cfg.output)
    return summary


def _preprocess(
    out: Path,
    common: list[str],
    heldout_fraction: float = FULL.heldout_fraction,
    config: str | None = None,
) -> object:
    from bertpipe.cli_args import write_resolved_config
    from bertpipe.config import load_config
    from bertpipe.preprocessing.config import PreprocessConfig
    from bertpipe.preprocessing.run import run_preprocess

    cfg = load_config(
        PreprocessConfig,
        config,
        [
            f"input.paths=[{out / 'corpus'}]",
            "input.format=jsonl",
            f"tokenizer={out / 'tokenizer'}",
            f"output={out / 'shards'}",
            "dupe_factor=5",
            "masking.mode=none",  # dynamic masking: new masks every epoch of the small corpus
            f"heldout_fraction={heldout_fraction}",
            "overwrite=true",
            "tracking.run_name=demo-preprocess",
            *common,
        ],
    )
    manifests = run_preprocess(cfg)
    write_resolved_config(cfg, cfg.output, "preprocess.yaml")
    return {
        name: {
            "instances": m["splits"]["train"]["instances"],
            "shards": m["splits"]["train"]["num_shards"],
        }
        for name, m in manifests.items()
    }


def _pretrain(out: Path, common: list[str], size: Size = FULL) -> object:
    """Both phases of a tiny BERT on CPU, from configs/pretrain-demo.yaml."""
    from bertpipe.config import load_config
    from bertpipe.training.pretrain.config import PretrainConfig
    from bertpipe.training.pretrain.trainer import run_pretraining

    cfg = load_config(
        PretrainConfig,
        "pretrain-demo",  # the shipped recipe, from a checkout or an installed wheel
        [
            f"output={out / 'pretrain'}",
            f"phases[0].data={out / 'shards' / 'seq128'}",
            f"phases[1].data={out / 'shards' / 'seq512'}",
            "checkpoint.resume=none",
            "tracking.run_name=demo-pretrain",
            *common,
            *_size_overrides(size),
        ],
    )
    if (out / "pretrain").exists():  # a fresh run each time the demo runs
        import shutil

        shutil.rmtree(out / "pretrain")
    return run_pretraining(cfg)


def _size_overrides(size: Size) -> list[str]:
    overrides = [
        f"phases[{i}].max_steps={steps}" for i, steps in enumerate(size.phase_steps) if steps
    ]
    if size.every_steps:
        overrides += [f"eval.every_steps={size.every_steps}"]
        overrides += [f"checkpoint.every_steps={size.every_steps}"]
    return overrides


def _export(out: Path) -> object:
    from bertpipe.training.export import export_checkpoint

    return export_checkpoint(str(out / "pretrain" / "checkpoints"), str(out / "bert-tiny-hf"))


def demo_tasks(out: Path, train_per_label: int = TASK_TRAIN_PER_LABEL) -> str:
    import shutil

    from bertpipe.finetuning.sample_task import write_demo_suite

    if (out / "tasks").exists():  # no task of an earlier demo's suite left beside this one's
        shutil.rmtree(out / "tasks")
    return write_demo_suite(str(out / "tasks"), train_per_label=train_per_label)


def _evaluate(
    out: Path, common: list[str], name: str, demo_id: str, size: Size = FULL
) -> SuiteResult:
    """The suite from the export (``pretrained``) or from the same architecture with random
    weights (``random-init``): the comparison shows what pre-training is worth here."""
    from bertpipe.cli_args import write_resolved_config
    from bertpipe.config import load_config
    from bertpipe.finetuning.evaluation.config import EvaluateConfig
    from bertpipe.finetuning.evaluation.runner import run_suite

    cfg = load_config(
        EvaluateConfig,
        None,
        [
            f"model={out / 'bert-tiny-hf'}",
            f"model_name={name}",
            f"suite={out / 'tasks' / 'suite.yaml'}",
            f"output={out / 'evaluate' / name}",
            "overwrite=true",  # a rerun of the demo replaces its previous suite
            f"finetune={{random_init: {str(MODELS[name]).lower()}}}",
            f"protocol.learning_rates={list(size.learning_rates)}",
            f"protocol.seeds={list(size.seeds)}",
            f"protocol.epochs={size.epochs}",
            f"protocol.batch_size={BATCH_SIZE}",
            f"parallel={PARALLEL}",
            f"tracking.run_name=demo-evaluate-{name}",
            f"tracking.tags={{{TAG_DEMO}: '{demo_id}'}}",
            *common,
        ],
    )
    result = run_suite(cfg)
    write_resolved_config(cfg, result.output, "evaluate.yaml")
    return result


def _compare(out: Path, uri: str, demo_id: str, experiment: str = EXPERIMENT) -> None:
    """The runs-compare table of this demo's two suite runs, and its bar plot."""
    from bertpipe.app.compare import CompareQuery, print_suites

    sys.stdout.write("\nThe suite runs (bertpipe runs compare --suites):\n")
    print_suites(
        CompareQuery(experiment=experiment, tracking_uri=uri, tags={TAG_DEMO: demo_id}),
        plot=str(out / "suite-scores.png"),
        width=0,
    )
    sys.stdout.flush()


def unigram_baseline(shards: Path) -> float:
    """Held-out MLM accuracy of always predicting the most frequent masked token of the
    training split: with static masking the targets in the shards; with dynamic masking
    (``masking: none``) every non-special token, which the loader masks with equal chance
    (the expected accuracy). nan without targets."""
    import collections
    import json

    import numpy as np

    from bertpipe.preprocessing.shard_format import read_shard

    manifest = json.loads((shards / "manifest.json").read_text())
    special = np.array(sorted(manifest.get("special_token_ids", {}).values()), dtype=np.int64)
    counts: dict[str, collections.Counter[int]] = {}
    for split in ("train", "heldout"):
        counts[split] = collections.Counter()
        for shard in manifest["splits"].get(split, {}).get("shards", []):
            for _, block in read_shard(str(shards / shard["file"])):
                if manifest.get("masking") == "none":
                    tokens = block.tokens.astype(np.int64)
                    counts[split].update(tokens[~np.isin(tokens, special)].tolist())
                else:
                    counts[split].update(block.mlm_ids.tolist())
    if not counts["train"] or not counts["heldout"]:
        return float("nan")
    top = counts["train"].most_common(1)[0][0]
    return counts["heldout"][top] / sum(counts["heldout"].values())


def _print_summary(
    out: Path, uri: str, results: dict[str, object], seconds: float, size: Size = FULL
) -> None:
    lines = [
        "",
        f"bertpipe demo finished in {seconds / 60:.1f} min. Outputs in {out}:",
        f"  tokenizer   {out / 'tokenizer'}  ({results['tokenizer']['vocab_size']} tokens)",  # type: ignore[index]
    ]
    for name, info in results["preprocess"].items():  # type: ignore[attr-defined]
        lines.append(
            f"  shards      {out / 'shards' / name}  ({info['instances']:,} instances, "
            f"{info['shards']} shards)"
        )
    nan = float("nan")
    for (name, info), shards in zip(
        results["pretrain"].items(),  # type: ignore[attr-defined]
        results["preprocess"],  # type: ignore[arg-type]
        strict=False,
    ):
        lines.append(
            f"  {name:11s} step {info['global_step']}: held-out loss {info.get('loss', nan):.3f}, "
            f"MLM accuracy {info.get('mlm_accuracy', nan):.3f} (unigram baseline "
            f"{unigram_baseline(out / 'shards' / shards):.3f}), "
            f"NSP accuracy {info.get('nsp_accuracy', nan):.3f}"
        )
    lines.append(
        f"  export      {out / 'bert-tiny-hf'}  (transformers BertForPreTraining + tokenizer)"
    )
    lines += _suite_lines(
        out,
        results["evaluate-pretrained"],  # type: ignore[arg-type]
        results["evaluate-random-init"],  # type: ignore[arg-type]
        size,
    )
    lines += [
        "",
        "Look at the runs in MLflow:",
        f"  {Path(sys.executable).parent / 'mlflow'} ui --backend-store-uri {uri}"
        f" --default-artifact-root {out / 'mlartifacts'}",
        f"  then open {runs_page_url('http://127.0.0.1:5000', uri, EXPERIMENT)}",
        "  (MLflow 3.17's UI opens an experiment on its GenAI pages unless the address, or the",
        "  sidebar's switch, says Model training: this link does, and the UI remembers it)",
        "",
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def _suite_lines(
    out: Path,
    pretrained: SuiteResult,
    random: SuiteResult,
    size: Size = FULL,
    what: Mapping[str, str] = TASK_WHAT,
    score: str = "dev accuracy",
) -> list[str]:
    """The suite's scores per task and on average from both initialisations, each the number
    the compare table shows for it (dev accuracy x100, mean ± std over the seeds, at the
    chosen learning rate)."""
    ours, theirs = pretrained.scores, random.scores
    grid = ", ".join(f"{lr:g}" for lr in size.learning_rates)
    several = len(size.learning_rates) > 1
    rate = f"each task's best learning rate of {grid}" if several else f"learning rate {grid}"
    labels = [pretrained.label, random.label]  # the suite runs' labels, as compare heads them
    rows = [["", *labels, *(["chosen lr"] if several else []), ""]]
    for mine, other in zip(ours.tasks, theirs.tasks, strict=True):
        chosen = [f"{mine.learning_rate:g} / {other.learning_rate:g}"] if several else []
        rows.append(
            [
                mine.task,
                _score(mine.mean, mine.std),
                _score(other.mean, other.std),
                *chosen,
                what.get(mine.task, ""),
            ]
        )
    average = [_score(ours.average, ours.average_std), _score(theirs.average, theirs.average_std)]
    rows.append(["average", *average, *([""] if several else []), ""])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = [
        f"  evaluate    suite {ours.suite} ({out / 'tasks' / 'suite.yaml'}, "
        f"{size.train_per_label} training rows per class), outputs in {out / 'evaluate'}",
        f"              {score} x100 at the last of {size.epochs} epochs "
        f"(batch {BATCH_SIZE}), mean ± std over seeds {', '.join(map(str, size.seeds))},",
        f"              at {rate}:",
    ]
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:3], widths[1:3], strict=True)]
        cells += [cell.ljust(width) for cell, width in zip(row[3:-1], widths[3:], strict=True)]
        lines.append(("              " + "  ".join([*cells, row[-1]])).rstrip())
    # the difference of the two averages as shown (x100, one decimal), so that it adds up
    gain = round(ours.average * 100, 1) - round(theirs.average * 100, 1)
    lines.append(
        f"  pre-training buys {gain:+.1f} points of {score} on the suite average "
        f"({len(ours.tasks)} tasks, {len(size.seeds)} seed{'s' * (len(size.seeds) > 1)} each)"
    )
    return lines


def _score(mean: float, std: float) -> str:
    """``mean ± std`` x100 as ``runs compare --suites`` shows it (``-`` where not finite)."""
    from bertpipe.app.compare.suites import format_score

    return format_score(*(value if math.isfinite(value) else None for value in (mean, std)))
