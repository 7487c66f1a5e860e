"""Shared fixtures: a small BERT-style WordPiece tokenizer built in memory.

The special tokens sit at ids 0-4, not at Google's 100-103, so code that hard-codes special
ids fails these tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PUNCTUATION = list(".,!?'\"()-:;")
WORDS = """
a an the cat cats dog sat on mat is was what who where when did in of and to it
new york mayor said hello play eu rejects german call boycott british lamb peter
blackburn brussels japan won cup john lives london city river flows through
question answer context paris france capital fortress built year river seine
he she they good bad movie film great terrible man men woman women quick brown fox
jumps over lazy yes no one two three four five six seven eight nine ten 1999 2000
""".split()  # noqa: SIM905 (a word list reads best as text)
PIECES = ["##s", "##ing", "##er", "##ed"]
VOCAB = SPECIALS + PUNCTUATION + WORDS + PIECES


def build_tokenizer() -> Tokenizer:
    """WordPiece + BertNormalizer + BertPreTokenizer + BERT's pair template, ids from VOCAB."""
    vocab = {token: i for i, token in enumerate(dict.fromkeys(VOCAB))}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls_id, sep_id = vocab["[CLS]"], vocab["[SEP]"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return build_tokenizer()


@pytest.fixture
def write(tmp_path: Path):
    """write(name, text) -> path of a new UTF-8 file under the test's tmp folder."""

    def _write(name: str, text: str) -> str:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return str(path)

    return _write


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT exported like `bertpipe export` does, with its tokenizer and lineage."""
    from bertpipe.preprocessing.tokenizer import build_from_vocab, save_tokenizer
    from bertpipe.training.models.bert.model import BertForPreTraining, BertModelConfig
    from bertpipe.training.models.hf import save_hf_folder

    folder = tmp_path_factory.mktemp("bert")
    tokenizer = build_from_vocab(list(dict.fromkeys(VOCAB)))
    save_tokenizer(tokenizer, str(folder), lowercase=True)
    torch.manual_seed(0)
    cfg = BertModelConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        max_position_embeddings=128,
    )
    extra = {n: (folder / n).read_bytes() for n in ("vocab.txt", "tokenizer.json")}
    save_hf_folder(BertForPreTraining(cfg), folder, extra_files=extra)
    lineage = {"mlflow_run_id": "pretrain-run-123", "data_sha256": {"phase1": "abc"}}
    (folder / "bertpipe_export.json").write_text(json.dumps(lineage))
    return folder


@pytest.fixture(scope="session")
def modern_pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny ModernBERT exported like `bertpipe export` does (local window 16 tokens)."""
    from bertpipe.preprocessing.tokenizer import build_from_vocab, save_tokenizer
    from bertpipe.training.models.hf import save_hf_folder
    from bertpipe.training.models.modernbert.model import (
        ModernBertForMaskedLM,
        ModernBertModelConfig,
    )

    folder = tmp_path_factory.mktemp("modernbert")
    tokenizer = build_from_vocab(list(dict.fromkeys(VOCAB)))
    save_tokenizer(tokenizer, str(folder), lowercase=True)
    torch.manual_seed(0)
    cfg = ModernBertModelConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=32,
        num_layers=3,
        num_heads=2,
        intermediate_size=48,
        local_attention=16,
        max_position_embeddings=128,
    )
    extra = {n: (folder / n).read_bytes() for n in ("vocab.txt", "tokenizer.json")}
    save_hf_folder(ModernBertForMaskedLM(cfg), folder, extra_files=extra)
    lineage = {"mlflow_run_id": "pretrain-run-456", "data_sha256": {"phase1": "def"}}
    (folder / "bertpipe_export.json").write_text(json.dumps(lineage))
    return folder
