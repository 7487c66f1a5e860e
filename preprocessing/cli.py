"""``bertpipe tokenizer`` and ``bertpipe preprocess`` (parsers only; work happens in run.py)."""

from __future__ import annotations

import argparse
import json
import sys

from bertpipe.cli_args import add_stage_command, config_from_args, write_resolved_config
from bertpipe.storage_check import preflight


def add_tokenizer_command(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("tokenizer", help="train or import the WordPiece tokenizer")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    train = add_stage_command(
        actions,
        "train",
        help="train a BERT WordPiece vocabulary (or import vocab_file=vocab.txt)",
        description=(
            "Trains a BERT WordPiece vocabulary on (a sample of) the corpus in input.paths, or "
            "imports an existing vocab.txt (vocab_file=...), and writes tokenizer.json, "
            "vocab.txt and tokenizer_config.json to `output`."
        ),
        config="bertpipe.preprocessing.config:TokenizerConfig",
        example="vocab_size=32000 sample_fraction=0.1",
        examples=[
            "bertpipe tokenizer train --config tokenizer 'input.paths=[corpus/wiki/*.txt.gz]' "
            "output=runs/tokenizer",
            "bertpipe tokenizer train vocab_file=uncased_L-12_H-768_A-12/vocab.txt "
            "output=runs/google-vocab",
        ],
        handler=_tokenizer_train,
    )
    train.add_argument("--overwrite", action="store_true", help="replace an existing tokenizer")


def _tokenizer_train(args: argparse.Namespace, passthrough: list[str]) -> int:
    from bertpipe.preprocessing.config import TokenizerConfig

    cfg = config_from_args(TokenizerConfig, args, ["overwrite=true"] if args.overwrite else [])
    if cfg is None:  # --print-config: Beam is not imported
        return 0
    from bertpipe import tracking

    reads = [("input.paths", p) for p in cfg.input.paths]
    if cfg.vocab_file:
        reads.append(("vocab_file", cfg.vocab_file))
    preflight(reads, [("output", cfg.output)])
    tracking.check_new_run(cfg.tracking)  # before Beam is imported
    from bertpipe.preprocessing.vocab import train_tokenizer

    summary = train_tokenizer(cfg)
    write_resolved_config(cfg, cfg.output)
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0


def add_preprocess_command(sub: argparse._SubParsersAction) -> None:
    parser = add_stage_command(
        sub,
        "preprocess",
        help="documents -> masked-LM/NSP instances in WebDataset shards (Apache Beam)",
        description=(
            "Runs the Beam job for every configured phase. Arguments after `--` go to Beam's "
            "PipelineOptions, e.g. `-- --direct_running_mode=multi_processing "
            "--direct_num_workers=4` or `-- --runner=DaskRunner --dask_client_address=HOST:8786`."
        ),
        config="bertpipe.preprocessing.config:PreprocessConfig",
        example="dupe_factor=10 'phases[1].max_predictions_per_seq=76'",
        examples=[
            "bertpipe preprocess --config preprocess 'input.paths=[corpus/]' "
            "tokenizer=runs/tokenizer output=runs/shards",
            "bertpipe preprocess --config preprocess 'input.paths=[s3://bucket/wiki/*.jsonl.gz]' "
            "input.format=jsonl masking.whole_word=true dupe_factor=10",
        ],
        handler=_preprocess,
    )
    parser.add_argument("--overwrite", action="store_true", help="replace existing shards")
    parser.add_argument(
        "--dry-run-quality",
        action="store_true",
        help="run only the quality steps (quality.*) and print what they would remove, by "
        "reason; writes <output>/quality-report/, no shards",
    )


def _preprocess(args: argparse.Namespace, passthrough: list[str]) -> int:
    from bertpipe.preprocessing.config import PreprocessConfig

    cfg = config_from_args(PreprocessConfig, args, ["overwrite=true"] if args.overwrite else [])
    if cfg is None:
        return 0
    from bertpipe import tracking

    preflight(
        [*(("input.paths", p) for p in cfg.input.paths), ("tokenizer", cfg.tokenizer)],
        [("output", cfg.output)],
    )
    if not args.dry_run_quality:  # the dry run opens no MLflow run
        tracking.check_new_run(cfg.tracking)  # before Beam is imported
    from bertpipe.preprocessing.run import run_preprocess

    if args.dry_run_quality:
        from bertpipe.preprocessing.quality_report import run_quality_report

        report = run_quality_report(cfg, passthrough)
        sys.stdout.write(json.dumps(report, sort_keys=True) + "\n")
        return 0
    manifests = run_preprocess(cfg, passthrough)
    write_resolved_config(cfg, cfg.output, "preprocess.yaml")
    summary = {
        name: {
            "instances": m["splits"]["train"]["instances"],
            "heldout_instances": m["splits"]["heldout"]["instances"],
            "shards": m["splits"]["train"]["num_shards"],
            "manifest_sha256": m["_sha256"],
        }
        for name, m in manifests.items()
    }
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0
