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

log = logging.getLogger(__name__)

__all__ = ["add_demo_command", "run_demo"]


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
    common = [f"tracking.uri={uri}", "tracking.experiment=bertpipe-demo"]
    results: dict[str, object] = {}
    steps: list[tuple[str, Callable[[], object]]] = [
        ("corpus", lambda: _corpus(out, documents)),
        ("tokenizer", lambda: _tokenizer(out, common)),
        ("preprocess", lambda: _preprocess(out, common)),
        ("pretrain", lambda: _pretrain(out, common)),
        ("export", lambda: _export(out)),
        ("task", lambda: _task(out)),
        ("finetune-pretrained", lambda: _finetune(out, common, random_init=False)),
        ("finetune-random", lambda: _finetune(out, common, random_init=True)),
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
    from bertpipe.cli import write_resolved_config
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
    from bertpipe.cli import write_resolved_config
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
            "dupe_factor=2",
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

    return write_python_docs_task(str(out / "task"))


def _finetune(out: Path, common: list[str], *, random_init: bool) -> object:
    """The Python-docs paragraph classification task, from the export or from random weights
    (the same architecture): the comparison shows what pre-training is worth here."""
    from bertpipe.config import load_config
    from bertpipe.finetuning.config import FinetuneConfig
    from bertpipe.finetuning.loop import run_finetuning

    name = "random" if random_init else "pretrained"
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
            "epochs=6",
            "batch_size=32",
            "learning_rate=5e-4",
            f"tracking.run_name=demo-finetune-{name}",
            *common,
        ],
    )
    return run_finetuning(cfg)


def _compare(out: Path, uri: str) -> None:
    """The runs-compare table of the two fine-tuning runs and their accuracy curves."""
    from bertpipe.cli_runs import print_comparison
    from bertpipe.runs import CompareQuery

    sys.stdout.write("\nFine-tuning runs (bertpipe runs compare):\n")
    print_comparison(
        CompareQuery(
            experiment="bertpipe-demo",
            tracking_uri=uri,
            stage="finetune",
            metrics=["eval/accuracy", "eval/macro_f1", "train/loss"],
            sort="eval/accuracy",
        ),
        plot=str(out / "finetune-accuracy.png"),
        plot_metrics=["eval/accuracy", "train/loss"],
        width=0,
    )


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
    for name, info in results["pretrain"].items():  # type: ignore[attr-defined]
        lines.append(
            f"  {name:11s} step {info['global_step']}: held-out loss {info.get('loss', nan):.3f}, "
            f"MLM accuracy {info.get('mlm_accuracy', nan):.3f}, "
            f"NSP accuracy {info.get('nsp_accuracy', nan):.3f}"
        )
    lines.append(
        f"  export      {out / 'bert-tiny-hf'}  (transformers BertForPreTraining + tokenizer)"
    )
    for name in ("pretrained", "random"):
        result = results[f"finetune-{name}"]
        metric = result.main_metric  # type: ignore[attr-defined]
        lines.append(
            f"  finetune    from {name} weights: dev {metric} "
            f"{result.metrics[metric]:.3f} (epoch {result.best_epoch})"  # type: ignore[attr-defined]
        )
    lines += [
        "",
        "Look at the runs in MLflow:",
        f"  {Path(sys.executable).parent / 'mlflow'} ui --backend-store-uri {uri}"
        f" --default-artifact-root {out / 'mlartifacts'}",
        "  then open http://127.0.0.1:5000",
        "",
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()
    _compare(out, uri)
