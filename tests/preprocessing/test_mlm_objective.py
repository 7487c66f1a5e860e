"""The ``mlm`` objective (RoBERTa's FULL-SENTENCES / DOC-SENTENCES packing, no NSP) beside the
paper's ``mlm+nsp``, whose shards must stay byte-for-byte what they were."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from bertpipe.config import ConfigError, field_docs, load_config
from bertpipe.preprocessing.config import PreprocessConfig
from bertpipe.preprocessing.instances import DocumentSet
from bertpipe.preprocessing.packing import SentenceTable, assemble_packed, pack_sentences
from bertpipe.preprocessing.run import run_preprocess
from bertpipe.preprocessing.shard_format import InstanceBlock, read_shard
from bertpipe.training.pretrain.data.loader import PretrainingData
from bertpipe.training.pretrain.data.manifest import DataError, load_manifest, validate_manifest
from tests.conftest import synthetic_documents, write_sentence_files
from tests.preprocessing.helpers import tokenized_docs


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


# --------------------------------------------------------------------------- packing


def _reference(
    docs: list[list[list[int]]], max_seq_length: int, cross: bool, cls: int, sep: int
) -> list[list[int]]:
    """The packing spelled out token list by token list: greedy whole sentences, an extra
    [SEP] between documents, a sentence longer than an instance cut to fill what is left."""
    room = max_seq_length - 2
    out: list[list[int]] = []
    cur: list[int] = []

    def close() -> None:
        nonlocal cur
        out.append([cls, *cur, sep])
        cur = []

    for doc in docs:
        if cur and not cross:
            close()
        for i, sentence in enumerate(doc):
            gap = [sep] if cur and i == 0 else []
            if len(cur) + len(gap) + len(sentence) <= room:
                cur += gap + sentence
                continue
            if len(sentence) <= room:
                close()
                cur = list(sentence)
                continue
            rest = list(sentence)
            left = room - len(cur) - len(gap)
            if cur and left >= 1:
                cur += gap + rest[:left]
                rest = rest[left:]
            if cur:
                close()
            while len(rest) > room:
                out.append([cls, *rest[:room], sep])
                rest = rest[room:]
            cur = rest
    if cur:
        close()
    return out


@pytest.mark.parametrize("packing", ["full_sentences", "doc_sentences"])
@pytest.mark.parametrize("max_seq_length", [12, 24, 64])
def test_packing_is_greedy_whole_sentences_and_loses_nothing(
    packing: str, max_seq_length: int, tokenizer_dir: Path
) -> None:
    """Every instance is [CLS] ... [SEP] within max_seq_length, one segment, no random next;
    the instances are the reference's; their non-special tokens are the documents' tokens in
    the permuted order; long sentences are cut; doc_sentences never holds two documents."""
    docs = tokenized_docs(tokenizer_dir, 60, seed=3, min_sent=1, max_sent=8)
    docset = DocumentSet.from_docs(docs)
    table = SentenceTable.from_docset(docset)
    order = np.random.default_rng(max_seq_length).permutation(len(docs))
    cls, sep = 2, 3
    counts: Counter[str] = Counter()
    cross = packing == "full_sentences"
    spec = pack_sentences(
        table, order, max_seq_length=max_seq_length, cross_documents=cross, counts=counts
    )
    # assembled in two chunks, as the pipeline does with CHUNK_INSTANCES
    half = len(spec) // 2
    blocks = [
        assemble_packed(
            docset.tokens, part, cls_id=cls, sep_id=sep, dtype=np.dtype(np.uint16), counts=counts
        )
        for part in (spec.slice(0, half), spec.slice(half, len(spec)))
    ]
    block = InstanceBlock.concat(blocks)
    instances = [
        block.tokens[o : o + n].tolist()
        for o, n in zip(block.token_offsets, block.lengths, strict=True)
    ]

    split = [
        [
            d.tokens[s:e].tolist()
            for s, e in zip([0, *d.sentence_ends[:-1]], d.sentence_ends, strict=True)
        ]
        for d in (docs[i] for i in order)
    ]
    assert instances == _reference(split, max_seq_length, cross, cls, sep)
    assert all(
        x[0] == cls and x[-1] == sep and len(x) <= max_seq_length and cls not in x[1:]
        for x in instances
    )
    assert (block.info[:, 1] == block.info[:, 0]).all()  # a_end == length: token types all 0
    assert not block.info[:, 3].any() and not block.info[:, 2].any()
    assert not any(t in (cls, sep) for d in docs for t in d.tokens.tolist())
    content = [t for x in instances for t in x if t not in (cls, sep)]
    assert content == np.concatenate([docs[i].tokens for i in order]).tolist()

    boundaries = sum(x[1:-1].count(sep) for x in instances)
    assert counts["document_boundaries"] == boundaries
    assert counts["document_passes"] == len(docs)
    long = sum(int((np.diff([0, *d.sentence_ends]) > max_seq_length - 2).sum()) for d in docs)
    assert counts["sentences_cut"] == long
    if max_seq_length == 12:
        assert long > 5  # the corpus does have sentences to cut
    if cross:
        assert boundaries > 0 and counts["multi_document_instances"] > 0
    else:
        assert boundaries == 0 and counts["multi_document_instances"] == 0


# --------------------------------------------------------------------------- the job


_MLM = (
    "objective=mlm",
    "masking.masked_lm_prob=0.3",
    "phases=[{name: seq64, max_seq_length: 64, max_predictions_per_seq: 19, num_shards: 3},"
    " {name: seq16, max_seq_length: 16, max_predictions_per_seq: 5, num_shards: 2}]",
    "dupe_factor=2",
    "heldout_fraction=0.1",
    "instances_per_sample=32",
    "tracking.enabled=false",
)


@pytest.fixture(scope="module")
def mlm_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[str]]]:
    """120 documents of 1 to 10 sentences (single-sentence ones included)."""
    docs = synthetic_documents(120, seed=5, min_sent=1, max_sent=10)
    folder = tmp_path_factory.mktemp("mlm-corpus")
    write_sentence_files(folder, docs)
    return folder, docs


@pytest.fixture(scope="module")
def mlm_shards(
    tmp_path_factory: pytest.TempPathFactory,
    mlm_corpus: tuple[Path, list[list[str]]],
    tokenizer_dir: Path,
) -> tuple[Path, dict[str, dict]]:  # type: ignore[type-arg]
    out = tmp_path_factory.mktemp("mlm-shards")
    cfg = load_config(
        PreprocessConfig,
        None,
        [f"input.paths=[{mlm_corpus[0]}]", f"tokenizer={tokenizer_dir}", f"output={out}", *_MLM],
    )
    return out, run_preprocess(cfg)


@pytest.mark.integration
def test_mlm_job_writes_packed_single_segment_instances(
    mlm_shards: tuple[Path, dict[str, dict]],  # type: ignore[type-arg]
    mlm_corpus: tuple[Path, list[list[str]]],
) -> None:
    """The job's shards: [CLS] ... [SEP] instances, one segment, unmasked (dynamic masking by
    default), every token of every document in each dupe pass; single-sentence documents
    kept; the manifest says what the trainer needs (objective, packing, masking)."""
    out, manifests = mlm_shards
    assert sum(len(d) == 1 for d in mlm_corpus[1]) > 5
    for name, max_len in (("seq64", 64), ("seq16", 16)):
        m = manifests[name]
        assert (m["objective"], m["packing"], m["masking"]) == ("mlm", "full_sentences", "none")
        assert m["config"]["min_sentences"] == 1 and m["config"]["masking"]["mode"] == "none"
        corpus = m["stats"]["corpus"]
        assert corpus.get("documents_too_short", 0) == 0
        assert corpus["documents_kept"] == len(mlm_corpus[1])
        ids = m["special_token_ids"]
        content = 0
        for split in ("train", "heldout"):
            stats = m["stats"][split]
            assert stats["random_next_fraction"] == 0 and stats["masked_tokens"] == 0
            assert 0.5 < stats["fill_fraction"] <= 1.0
            n = 0
            for shard in sorted((out / name).glob(f"{split}-*.tar")):
                for _, block in read_shard(str(shard)):
                    info = block.info.astype(np.int64)
                    n += len(block)
                    assert (info[:, 0] <= max_len).all() and (info[:, 1] == info[:, 0]).all()
                    assert not info[:, 2:].any() and block.mlm_pos.size == 0
                    starts = block.token_offsets
                    assert (block.tokens[starts] == ids["cls"]).all()
                    assert (block.tokens[starts + info[:, 0] - 1] == ids["sep"]).all()
                    special = np.isin(block.tokens, [ids["cls"], ids["sep"]])
                    content += int((~special).sum())
            assert n == stats["instances"] == m["splits"][split]["instances"]
        # nothing lost: each of the two dupe passes holds every token of the corpus
        assert content == 2 * corpus["tokens"]
        assert m["stats"]["train"]["multi_document_instances"] > 0
    assert manifests["seq16"]["stats"]["train"]["sentences_cut"] > 0

    manifest = load_manifest(str(out / "seq64"))
    assert manifest.objective == "mlm" and manifest.masking == "none"
    raw = json.loads((out / "seq64" / "manifest.json").read_text())
    del raw["objective"], raw["packing"]  # a manifest written before the mlm objective
    assert validate_manifest(str(out / "seq64"), raw).objective == "mlm+nsp"
    with pytest.raises(DataError, match="objective 'nsp'"):
        validate_manifest(str(out / "seq64"), {**raw, "objective": "nsp"})


@pytest.mark.integration
def test_loader_masks_mlm_shards_at_the_manifests_rate(
    mlm_shards: tuple[Path, dict[str, dict]],  # type: ignore[type-arg]
) -> None:
    """training/pretrain/data/loader.py on the mlm shards (masking none): every instance gets
    round(0.3 x length) predictions drawn among its non-special tokens, 80% of them [MASK]."""
    out, manifests = mlm_shards
    ids = manifests["seq64"]["special_token_ids"]
    data = PretrainingData(str(out / "seq64"), "train", micro_batch_size=8, seed=1, train=False)
    masked = tokens = replaced = budget = 0
    for batch in data:
        lengths = batch["attention_mask"].sum(dim=1)
        budget += int(torch.round(lengths.double() * 0.3).sum())
        real = batch["input_ids"][batch["attention_mask"].bool()]
        tokens += int((~torch.isin(real, torch.tensor([ids["cls"], ids["sep"]]))).sum())
        flat = batch["input_ids"].reshape(-1)[batch["mlm_positions"]]
        masked += batch["mlm_labels"].numel()
        replaced += int((flat == ids["mask"]).sum())
        assert not torch.isin(batch["mlm_labels"], torch.tensor(list(ids.values()))).any()
        assert not batch["token_type_ids"].any() and not batch["nsp_labels"].any()
    assert tokens > 3000
    assert masked == budget
    assert 0.29 < masked / tokens < 0.33
    assert abs(replaced / masked - 0.8) < 0.04


# --------------------------------------------------------------------------- config


def _config(*overrides: str) -> PreprocessConfig:
    return load_config(PreprocessConfig, None, list(overrides))


def test_objective_sets_the_defaults_it_needs_and_explicit_values_win() -> None:
    paper = _config()
    assert (paper.objective, paper.masking.mode, paper.min_sentences) == ("mlm+nsp", "static", 2)
    mlm = _config("objective=mlm")
    assert (mlm.masking.mode, mlm.min_sentences, mlm.packing) == ("none", 1, "full_sentences")
    explicit = _config("objective=mlm", "masking.mode=static", "min_sentences=2")
    assert (explicit.masking.mode, explicit.min_sentences) == ("static", 2)
    assert _config("masking.mode=none").masking.mode == "none"
    # the recipe of the modern encoder: dynamic masking at 30%, packed full sentences
    recipe = load_config(PreprocessConfig, "preprocess-mlm")
    assert (recipe.objective, recipe.packing, recipe.masking.mode) == (
        "mlm",
        "full_sentences",
        "none",
    )
    assert recipe.masking.masked_lm_prob == 0.3 and recipe.dupe_factor == 1
    docs = field_docs(PreprocessConfig)
    assert "FULL" in docs["packing"].upper() and "mlm+nsp" in docs["objective"]


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (
            ("objective=mlm", "masking.masked_lm_prob=0.3"),
            "phases[0].max_predictions_per_seq",
            "38",
        ),
        (
            (
                "objective=mlm",
                "masking.masked_lm_prob=0.3",
                "phases=[{name: a, max_seq_length: 64, max_predictions_per_seq: 19},"
                " {name: b, max_seq_length: 512, max_predictions_per_seq: 80}]",
            ),
            "phases[1].max_predictions_per_seq",
            "154",
        ),
        (("objective=nsp",), "objective", "mlm"),
        (("objective=mlm", "packing=documents"), "packing", "doc_sentences"),
        (("min_sentences=0",), "min_sentences", "at least 1"),
    ],
)
def test_config_errors_name_the_key(overrides: tuple[str, ...], key: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        _config(*overrides)
    assert info.value.key == key
    assert says in str(info.value) and "\n" not in str(info.value)


def test_paper_recipe_keeps_its_prediction_cap() -> None:
    """mlm+nsp caps predictions as the paper's recipe does (Google's 76 at 512 and 0.15):
    today's configs stay valid."""
    cfg = _config(
        "masking.masked_lm_prob=0.3",
        "phases=[{name: seq512, max_seq_length: 512, max_predictions_per_seq: 76}]",
    )
    assert cfg.phases[0].max_predictions_per_seq == 76
