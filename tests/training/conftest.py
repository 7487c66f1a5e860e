"""Fixtures for the training tests: small pre-training shards made by the real pipeline."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def pretrain_shards(
    tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path, tokenizer_dir: Path
) -> Path:
    """Shards of the synthetic corpus: ``seq64`` and ``seq128`` phases, with held-out splits."""
    from bertpipe.config import load_config
    from bertpipe.preprocessing.config import PreprocessConfig
    from bertpipe.preprocessing.run import run_preprocess

    out = tmp_path_factory.mktemp("shards")
    cfg = load_config(
        PreprocessConfig,
        None,
        [
            f"input.paths=[{corpus_dir}]",
            f"tokenizer={tokenizer_dir}",
            f"output={out}",
            "phases=[{name: seq64, max_seq_length: 64, max_predictions_per_seq: 10, num_shards: 4},"
            " {name: seq128, max_seq_length: 128, max_predictions_per_seq: 20, num_shards: 4}]",
            "dupe_factor=2",
            "heldout_fraction=0.1",
            "instances_per_sample=32",
            "tracking.enabled=false",
        ],
    )
    run_preprocess(cfg)
    return out
