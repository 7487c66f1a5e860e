"""``bertpipe demo``: the whole flow on an embedded default corpus, on CPU, into one folder.

The corpus is the documentation that ships with Python (no download). Every stage runs
with its real engine (HF tokenizers, Apache Beam on the direct runner, MLflow on a sqlite
store under the output folder) at a size a laptop finishes in minutes. Each stage's
resolved config is written beside its outputs, so any step can be re-run by hand, e.g.
``bertpipe tokenizer train --config <out>/tokenizer/config.yaml``, ``bertpipe preprocess
--config <out>/shards/preprocess.yaml``, ``bertpipe pretrain --config
<out>/pretrain/pretrain.yaml``, ``bertpipe finetune --config
<out>/finetune/pretrained/finetune.yaml``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bertpipe import fsio
from bertpipe.tracking import runs_page_url

log = logging.getLogger(__name__)

__all__ = ["add_demo_command", "run_demo", "unigram_baseline"]

FINETUNE_SEEDS = (1, 2, 3)
"""Each initialisation is fine-tuned once per seed; the summary gives the mean and range."""
TASK_TRAIN_PER_LABEL = 32
EXPERIMENT = "bertpipe-demo"
"""Labelled training paragraphs per package (128 in all): few enough that the task needs more
than word identity learnt from scratch (see docs/training.md, "What pre-training buys")."""


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
    parser.set_defaults(handler=_demo)


def _demo(args: argparse.Namespace, passthrough: list[str]) -> int:
    run_demo(Path(args.out), documents=args.documents)
    return 0


def run_demo(out: Path, documents: int | None = None) -> dict[str, object]:
    """Run every stage into ``out`` and return what each produced."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{out / 'mlflow.db'}"
    common = [f"tracking.uri={uri}", f"tracking.experiment={EXPERIMENT}"]
    results: dict[str, object] = {}
    steps: list[tuple[str, Callable[[], object]]] = [
        ("corpus", lambda: _corpus(out, documents)),
        ("tokenizer", lambda: _tokenizer(out, common)),
        ("preprocess", lambda: _preprocess(out, common)),
        ("pretrain", lambda: _pretrain(out, common)),
        ("export", lambda: _export(out)),
        ("task", lambda: _task(out)),
        ("finetune-pretrained", lambda: _finetune_seeds(out, common, random_init=False)),
        ("finetune-random", lambda: _finetune_seeds(out, common, random_init=True)),
    ]
    started = time.monotonic()
    for name, step in steps:
        t0 = time.monotonic()
        log.info("demo: %s ...", name)
        results[name] = step()
        log.info("demo: %s done in %.1f s", name, time.monotonic() - t0)
    _print_summary(out, uri, results, time.monotonic() - started)
    return results


def _corpus(out: Path, documents: int | None) -> list[str]:
    from bertpipe.preprocessing.sample_corpus import write_corpus

    folder = out / "corpus"
    if folder.exists():
        fsio.remove([str(p) for p in folder.iterdir()])
    return write_corpus(str(folder), fmt="jsonl", files=4, max_documents=documents)


def _tokenizer(out: Path, common: list[str]) -> object:
    from bertpipe.cli_args import write_resolved_config
    from bertpipe.config import load_config
    from bertpipe.preprocessing.config import TokenizerConfig
    from bertpipe.preprocessing.run import train_tokenizer

    cfg = load_config(
        TokenizerConfig,
        None,
        [
            f"input.paths=[{out / 'corpus'}]",
            "input.format=jsonl",
            f"output={out / 'tokenizer'}",
            "vocab_size=8000",
            "overwrite=true",
            "tracking.run_name=demo-tokenizer",
            *common,
        ],
    )
    summary = train_tokenizer(cfg)
    write_resolved_config(cfg, cfg.output)
    return summary


def _preprocess(out: Path, common: list[str]) -> object:
    from bertpipe.cli_args import write_resolved_config
    from bertpipe.config import load_config
    from bertpipe.preprocessing.config import PreprocessConfig
    from bertpipe.preprocessing.run import run_preprocess

    cfg = load_config(
        PreprocessConfig,
        None,
        [
            f"input.paths=[{out / 'corpus'}]",
            "input.format=jsonl",
            f"tokenizer={out / 'tokenizer'}",
            f"output={out / 'shards'}",
            "dupe_factor=5",
            "masking.mode=none",  # dynamic masking: new masks every epoch of the small corpus
            "heldout_fraction=0.02",
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


def _pretrain(out: Path, common: list[str]) -> object:
    """Both phases of a tiny BERT on CPU, from configs/pretrain-demo.yaml."""
    from bertpipe.config import load_config
    from bertpipe.training.config import PretrainConfig
    from bertpipe.training.trainer import run_pretraining

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
        ],
    )
    if (out / "pretrain").exists():  # a fresh run each time the demo runs
        import shutil

        shutil.rmtree(out / "pretrain")
    return run_pretraining(cfg)


def _export(out: Path) -> object:
    from bertpipe.training.export import export_checkpoint

    return export_checkpoint(str(out / "pretrain" / "checkpoints"), str(out / "bert-tiny-hf"))


def _task(out: Path) -> tuple[str, str]:
    from bertpipe.finetuning.sample_task import write_python_docs_task

    return write_python_docs_task(str(out / "task"), train_per_label=TASK_TRAIN_PER_LABEL)


def _finetune_seeds(out: Path, common: list[str], *, random_init: bool) -> list[object]:
    return [_finetune(out, common, random_init=random_init, seed=seed) for seed in FINETUNE_SEEDS]


def _finetune(out: Path, common: list[str], *, random_init: bool, seed: int = 1) -> object:
    """The Python-docs paragraph classification task, from the export or from random weights
    (the same architecture): the comparison shows what pre-training is worth here."""
    from bertpipe.config import load_config
    from bertpipe.finetuning.config import FinetuneConfig
    from bertpipe.finetuning.run import run_finetuning

    name = f"{'random' if random_init else 'pretrained'}-seed{seed}"
    cfg = load_config(
        FinetuneConfig,
        None,
        [
            f"output={out / 'finetune' / name}",
            "overwrite=true",  # a rerun of the demo replaces its previous fine-tuning runs
            f"init_from={out / 'bert-tiny-hf'}",
            f"random_init={str(random_init).lower()}",
            "task.family=table",
            "task.name=python-docs",
            f"task.train={out / 'task' / 'train.tsv'}",
            f"task.dev=[{out / 'task' / 'dev.tsv'}]",
            "epochs=10",
            "batch_size=16",
            "learning_rate=2e-3",
            f"seed={seed}",
            f"tracking.run_name=demo-finetune-{name}",
            *common,
        ],
    )
    return run_finetuning(cfg)


def _compare(out: Path, uri: str) -> None:
    """The runs-compare table of the fine-tuning runs and their accuracy curves."""
    import json

    from bertpipe.app.compare import CompareQuery, print_comparison

    # this demo's runs only: an earlier demo in the same folder left its runs in the store
    export = json.loads((out / "bert-tiny-hf" / "bertpipe_export.json").read_text())
    pretrain_run = export.get("source_run_id")
    sys.stdout.write("\nFine-tuning runs (bertpipe runs compare):\n")
    print_comparison(
        CompareQuery(
            experiment=EXPERIMENT,
            tracking_uri=uri,
            stage="finetune",
            tags={"bertpipe.parent_run_id": pretrain_run} if pretrain_run else {},
            metrics=["eval/accuracy", "eval/macro_f1", "train/loss"],
            sort="eval/accuracy",
        ),
        plot=str(out / "finetune-accuracy.png"),
        plot_metrics=["eval/accuracy", "train/loss"],
        width=0,
    )


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


def _print_summary(out: Path, uri: str, results: dict[str, object], seconds: float) -> None:
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
    means = {}
    for name in ("pretrained", "random"):
        runs: list = results[f"finetune-{name}"]  # type: ignore[assignment]
        metric = runs[0].main_metric
        values = [r.metrics[metric] for r in runs]
        means[name] = sum(values) / len(values)
        lines.append(
            f"  finetune    from {name + ' weights:':19s} dev {metric} mean {means[name]:.3f} "
            f"(min {min(values):.3f}, max {max(values):.3f}; seeds "
            f"{', '.join(f'{v:.3f}' for v in values)})"
        )
    lines.append(
        f"  pre-training buys {means['pretrained'] - means['random']:+.3f} dev accuracy with "
        f"{TASK_TRAIN_PER_LABEL} labelled paragraphs per class ({len(FINETUNE_SEEDS)} seeds each)"
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
    _compare(out, uri)
