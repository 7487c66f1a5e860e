"""Where a fine-tuning run's encoder comes from: an export (or any HF BERT folder), a
pre-training checkpoint, or a fine-tuned model of a task.

:func:`load_initialisation` reads ``init_from`` (local or object storage) into an
:class:`Initialisation`: the model config, its weights, the tokenizer that goes with them and
the lineage (the pre-training MLflow run, data checksums, the logged model), which the run's
tags and inputs record. :func:`check_tokenizer` refuses a tokenizer other than the one the
encoder was pre-trained with; :func:`load_task_model` loads a fine-tuned ``best/`` folder back.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bertpipe import fsio, staging
from bertpipe.config import ConfigError
from bertpipe.finetuning.config import FinetuneConfig
from bertpipe.finetuning.heads import TASK_MODELS, BertTaskModel
from bertpipe.training import checkpoint as ckpt
from bertpipe.training.models.bert.model import BertModelConfig

__all__ = [
    "Initialisation",
    "check_tokenizer",
    "file_sha256",
    "load_initialisation",
    "load_task_model",
]


@dataclass
class Initialisation:
    """Where the encoder comes from and the lineage that goes with it."""

    model_cfg: BertModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer_dir: str
    pretrain_run_id: str | None
    """The pre-training MLflow run (``source_run_id`` of an export, or the checkpoint's)."""
    data_sha256: dict[str, str]
    head_labels: list[str] | None
    """Label names of a task head already in ``init_from`` (a fine-tuned model), if any."""
    own_tokenizer_dir: str | None = None
    """The tokenizer that came with ``init_from`` (the export's, or the pre-training's)."""
    model_id: str | None = None
    """The MLflow logged model of ``init_from`` (``mlflow_model_id`` of an export), if any."""


def load_initialisation(cfg: FinetuneConfig) -> Initialisation:
    """Read ``init_from``: an HF BERT folder (an export) or a pre-training checkpoint folder,
    local or on object storage (an export there is downloaded to be read)."""
    url = str(cfg.init_from)
    if staging.is_remote(url):
        if fsio.exists(fsio.join(url, "config.json")):
            with staging.local_copy(url) as local:
                return _load_hf_initialisation(cfg, local, url)
        if ckpt.latest_tag(url) is not None:
            return _load_checkpoint_initialisation(cfg, url)
        raise ConfigError(
            "init_from",
            f"{url} is neither an HF BERT folder (config.json) nor a checkpoint folder (latest)",
        )
    source = Path(url)
    if (source / "config.json").exists():
        return _load_hf_initialisation(cfg, source, str(source))
    if (source / "latest").exists():
        return _load_checkpoint_initialisation(cfg, str(source))
    raise ConfigError(
        "init_from",
        f"{source} is neither an HF BERT folder (config.json) nor a checkpoint folder (latest)",
    )


def _load_hf_initialisation(cfg: FinetuneConfig, source: Path, url: str) -> Initialisation:
    """An export read from local folder ``source`` (a copy of ``url``)."""
    from bertpipe.training.models.hf import load_hf_folder

    model_cfg, weights = load_hf_folder(source)
    lineage = {}
    if (source / "bertpipe_export.json").exists():
        lineage = json.loads((source / "bertpipe_export.json").read_text())
    hf_config = json.loads((source / "config.json").read_text())
    labels = None
    pretraining = ("BertForPreTraining", "ModernBertForMaskedLM")
    if any(a not in pretraining for a in hf_config.get("architectures", [])):
        id2label = hf_config.get("id2label") or {}
        labels = [id2label[k] for k in sorted(id2label, key=int)] or None
    return Initialisation(
        model_cfg,
        weights,
        cfg.tokenizer or url,
        lineage.get("source_run_id") or lineage.get("mlflow_run_id"),
        lineage.get("data_sha256", {}),
        labels,
        url,
        lineage.get("mlflow_model_id"),
    )


def _load_checkpoint_initialisation(cfg: FinetuneConfig, folder: str) -> Initialisation:
    from bertpipe.training.export import load_checkpoint_model, tokenizer_folder

    model, state = load_checkpoint_model(folder)
    own = tokenizer_folder(state, None)
    return Initialisation(
        model.config,
        model.state_dict(),
        cfg.tokenizer or own,
        state.mlflow_run_id,
        state.data_sha256,
        None,
        own,
    )


def load_task_model(folder: str | Path) -> BertTaskModel:
    """The fine-tuned model saved in ``folder`` (a run's ``best/``) as its bertpipe task model,
    in eval mode."""
    from bertpipe.training.models.hf import load_hf_folder, load_into

    hf_config = json.loads((Path(folder) / "config.json").read_text())
    architecture = (hf_config.get("architectures") or [""])[0]
    model_cfg, weights = load_hf_folder(folder)
    num_labels = len(hf_config.get("id2label") or {}) or 1
    kind = TASK_MODELS.get(architecture)
    if kind is None:
        raise ValueError(f"{folder} holds a {architecture or 'non-task'} model, not a task model")
    model = kind(model_cfg) if kind.span_qa else kind(model_cfg, num_labels)  # type: ignore[call-arg]
    load_into(model, weights, strict_heads=True)
    return model.eval()


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with fsio.open_url(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _vocab_fingerprint(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def check_tokenizer(tokenizer: Any, init: Initialisation, model_cfg: BertModelConfig) -> None:
    """The tokenizer must be the one the encoder was pre-trained with: ids of another vocabulary
    index the wrong embeddings (or none at all), the run would still "work", and ``best/``
    would ship the wrong tokenizer."""
    from bertpipe.preprocessing.tokenizer import load_tokenizer

    size = tokenizer.get_vocab_size()
    if size > model_cfg.vocab_size:
        raise ConfigError(
            "tokenizer",
            f"{init.tokenizer_dir} has {size} tokens, the model's embeddings "
            f"{model_cfg.vocab_size}: use the tokenizer the model was pre-trained with (leave "
            "tokenizer unset)",
        )
    own = init.own_tokenizer_dir
    if own is None or Path(own).resolve() == Path(init.tokenizer_dir).resolve():
        return
    try:
        theirs = load_tokenizer(own)
    except Exception:  # the source ships no tokenizer: nothing to compare with
        return
    mine, expected = _vocab_fingerprint(tokenizer), _vocab_fingerprint(theirs)
    if mine != expected:
        raise ConfigError(
            "tokenizer",
            f"{init.tokenizer_dir} is not the tokenizer of {own} (vocabulary sha256 "
            f"{mine[:12]} vs {expected[:12]}): leave tokenizer unset to use the model's own",
        )
