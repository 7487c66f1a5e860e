"""The ``mlm`` objective (RoBERTa's FULL-SENTENCES / DOC-SENTENCES packing, no NSP) beside the
paper's ``mlm+nsp``, whose shards must stay byte-for-byte what they were."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from bertpipe.config import load_config
from bertpipe.preprocessing.config import PreprocessConfig
from bertpipe.preprocessing.run import run_preprocess


def _preprocess(corpus: Path, tokenizer: Path, out: Path, *extra: str) -> dict[str, dict]:  # type: ignore[type-arg]
    cfg = load_config(
        PreprocessConfig,
        None,
        [
            f"input.paths=[{corpus}]",
            f"tokenizer={tokenizer}",
            f"output={out}",
            "phases=[{name: seq64, max_seq_length: 64, max_predictions_per_seq: 10, num_shards: 4},"
            " {name: seq128, max_seq_length: 128, max_predictions_per_seq: 20, num_shards: 4}]",
            "dupe_factor=2",
            "heldout_fraction=0.1",
            "instances_per_sample=32",
            "tracking.enabled=false",
            *extra,
        ],
    )
    return run_preprocess(cfg)


def _digests(out: Path, manifests: dict[str, dict]) -> tuple[str, str]:  # type: ignore[type-arg]
    """One sha256 over every shard's path and sha256, one over the phases' statistics."""
    shards = "\n".join(
        f"{p.relative_to(out)} {hashlib.sha256(p.read_bytes()).hexdigest()}"
        for p in sorted(out.rglob("*.tar"))
    )
    stats = json.dumps({name: m["stats"] for name, m in manifests.items()}, sort_keys=True)
    return (
        hashlib.sha256(shards.encode()).hexdigest(),
        hashlib.sha256(stats.encode()).hexdigest(),
    )


# Pinned on the code before the mlm objective existed (commit 2ad1e21): the paper's recipe
# (the default objective) must give the same shards and statistics, byte for byte.
_PAPER_RECIPE = {
    "default": (
        (),
        "70d71b1435e3e5e235efa574ca15180a47c630991439e67a0f0f5184728e8b6f",
        "605f5204d7d1ceed0cc36ecf50cbe376ae3359d196eb69c6a4b747908c633c14",
    ),
    "buckets-wwm-short": (
        ("bucket_mb=0.03", "masking.whole_word=true", "short_seq_prob=0.3"),
        "300c6c6e9379f0e91543a64ea6df9e1e43aecf2bfb811265b139509f90ea7f04",
        "48d6ae21a18c5849040b51c7acbd088a49741427a21d800c9b0f008b020445be",
    ),
    "unmasked": (
        ("masking.mode=none",),
        "e08f877cd7b76f619c1c069aaa4cf967c2b3d19b11a70282647478a4c006a022",
        "21e729ff6d8b5d59007017ad6acbd491ffbc614681baa886169db8a24964ba38",
    ),
}


@pytest.mark.integration
@pytest.mark.parametrize("variant", sorted(_PAPER_RECIPE))
def test_paper_recipe_shards_unchanged(
    variant: str, corpus_dir: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    extra, shards_sha, stats_sha = _PAPER_RECIPE[variant]
    manifests = _preprocess(corpus_dir, tokenizer_dir, tmp_path, *extra)
    got = _digests(tmp_path, manifests)
    assert got == (shards_sha, stats_sha)
