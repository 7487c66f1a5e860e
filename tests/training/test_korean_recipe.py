"""The Korean recipe end to end on the GIMP manual's Korean translation (``gimp-help-ko``):
``tokenizer train --config tokenizer-ko-cased``, ``preprocess --config preprocess-ko`` and
``preprocess-mlm-ko``, a short pre-training, ``export``; then ``transformers.AutoTokenizer``
on the exported folder, in a clean interpreter, gives bertpipe's ids on every line."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cli_runner import run_cli
from tests.langtext import Pages
from tests.preprocessing.test_normalisation import (
    JAMO,
    SYLLABLE,
    korean_pages,
    transformers_ids,
)

pytestmark = pytest.mark.integration

COMPAT_JAMO = re.compile("[\u3130-\u318f]")


def _run(*args: str) -> str:
    done = run_cli([*args, "tracking.enabled=false"])
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_korean_recipe_tokenizer_to_export_and_transformers(
    gimp_help: Callable[[str], Pages], tmp_path: Path
) -> None:
    from bertpipe.preprocessing.tokenizer import load_tokenizer, vocab_in_order

    pages = korean_pages(gimp_help("ko"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, page in enumerate(pages):  # a document per file, split by the Korean rules
        (corpus / f"page-{i:03d}.txt").write_text("\n\n".join(page) + "\n")
    lines = [line for page in pages for line in page]
    text = "\n".join(lines)
    assert 150_000 < len(text.encode()) < 1_000_000

    tok_dir, shards, mlm = tmp_path / "tokenizer", tmp_path / "shards", tmp_path / "shards-mlm"
    summary = _run(
        "tokenizer",
        "train",
        "--config",
        "tokenizer-ko-cased",
        f"input.paths=[{corpus}]",
        "input.format=text",
        f"output={tok_dir}",
        "vocab_size=3000",
        "sample_fraction=1.0",
    )
    assert json.loads(summary.strip().splitlines()[-1])["vocab_size"] > 2000
    vocab = (tok_dir / "vocab.txt").read_text().splitlines()
    assert len([t for t in vocab if SYLLABLE.search(t)]) > 1500
    assert not [t for t in vocab if JAMO.search(t)]
    assert {c for t in vocab for c in COMPAT_JAMO.findall(t)} <= set(COMPAT_JAMO.findall(text))
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["do_lower_case"] is False and config["strip_accents"] is False

    phase = "phases=[{name: seq64, max_seq_length: 64, max_predictions_per_seq: 20, num_shards: 2}]"
    common = [
        f"tokenizer={tok_dir}",
        f"input.paths=[{corpus}]",
        "input.format=text",
        phase,
        "dupe_factor=1",
        "heldout_fraction=0.1",
    ]
    _run("preprocess", "--config", "preprocess-ko", f"output={shards}", *common)
    _run("preprocess", "--config", "preprocess-mlm-ko", f"output={mlm}", *common)
    for folder, objective in ((shards, "mlm+nsp"), (mlm, "mlm")):
        manifest = json.loads((folder / "seq64" / "manifest.json").read_text())
        assert manifest["config"]["objective"] == objective
        assert manifest["stats"]["train"]["instances"] > 100, manifest["stats"]

    out = tmp_path / "pretrain"
    _run(
        "pretrain",
        f"output={out}",
        "model.preset=tiny",
        "model.max_position_embeddings=64",
        f"phases=[{{name: phase1, data: {shards}/seq64, max_steps: 4, micro_batch_size: 8,"
        " global_batch_size: 8, learning_rate: 1.0e-3, warmup: 0.25}]",
        "precision=fp32",
        "zero.stage=0",
        "data.num_workers=0",
        "checkpoint.every_steps=4",
        "eval.max_batches=1",
    )
    # an older bertpipe's tokenizer_config.json in the tokenizer folder (what transformers
    # reads): the export writes its own from the tokenizer, never a copy of that file
    (tok_dir / "tokenizer_config.json").write_text('{"do_lower_case": true}')
    export = tmp_path / "hf"
    done = run_cli(["export", str(out / "checkpoints"), str(export), "--no-tracking"])
    assert done.returncode == 0, done.stderr[-3000:]
    exported = json.loads((export / "tokenizer_config.json").read_text())
    assert exported.pop("model_max_length") == 64  # the model's positions
    assert exported == {k: v for k, v in config.items() if k != "model_max_length"}

    # every line of the corpus as transformers reads the folder
    theirs = transformers_ids([export], lines, [(lines[0], lines[1])], tmp_path)[str(export)]
    ours = load_tokenizer(str(export))
    assert vocab_in_order(ours) == vocab
    mine = [e.ids for e in ours.encode_batch(lines)]
    assert [i for i, (a, b) in enumerate(zip(mine, theirs["single"], strict=True)) if a != b] == []
    unknown = ours.token_to_id("[UNK]")
    korean = [i for ids in mine[: len(lines)] for i in ids]
    assert korean.count(unknown) < 0.01 * len(korean)
