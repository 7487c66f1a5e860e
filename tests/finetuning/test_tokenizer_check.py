"""Fine-tuning refuses a tokenizer that is not the model's: another vocabulary (ids index the
wrong embeddings) or a larger one (ids past the embeddings), before any work; the model's
own tokenizer, given explicitly or not, passes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bertpipe.config import ConfigError
from bertpipe.finetuning.run import run_finetuning
from tests.conftest import sqlite_uri
from tests.finetuning.test_loop import _cfg

pytestmark = pytest.mark.integration


def _edited_tokenizer(source: Path, folder: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    folder.mkdir()
    data = json.loads((source / "tokenizer.json").read_text())
    edit(data["model"]["vocab"])
    (folder / "tokenizer.json").write_text(json.dumps(data))
    shutil.copy(source / "tokenizer_config.json", folder / "tokenizer_config.json")
    return folder


def _swap_two(vocab: dict[str, int]) -> None:
    a, b = sorted(vocab, key=vocab.get)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]


def _add_tokens(vocab: dict[str, int]) -> None:
    for i in range(64):
        vocab[f"zzextra{i}"] = len(vocab)


CASES = [(_swap_two, "is not the tokenizer of"), (_add_tokens, "the model's embeddings")]


@pytest.mark.parametrize(("edit", "fragment"), CASES)
def test_a_different_tokenizer_is_refused(pretrained: Path, tmp_path: Path, edit, fragment):
    other = _edited_tokenizer(pretrained, tmp_path / "other-tokenizer", edit)
    uri = sqlite_uri(tmp_path / "mlflow.db")
    cfg = _cfg(pretrained, tmp_path, uri, "glue", "epochs=1", f"tokenizer={other}")
    with pytest.raises(ConfigError, match=fragment) as info:
        run_finetuning(cfg)
    assert info.value.key == "tokenizer" and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()  # refused before any output


def test_the_models_own_tokenizer_passes_given_or_not(pretrained: Path, tmp_path: Path):
    copy = tmp_path / "copy"
    shutil.copytree(pretrained, copy, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    uri = sqlite_uri(tmp_path / "mlflow.db")
    cfg = _cfg(pretrained, tmp_path, uri, "glue", "epochs=1", f"tokenizer={copy}")
    result = run_finetuning(cfg)
    assert Path(result.output, "best", "tokenizer.json").exists()
