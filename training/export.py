"""``bertpipe export``: a pre-training checkpoint -> a folder ``transformers`` loads.

The folder holds ``config.json`` and ``model.safetensors`` (``BertForPreTraining``, the
vocabulary padding stripped) plus the tokenizer's ``vocab.txt``, ``tokenizer.json`` and
``tokenizer_config.json``, so ``BertForPreTraining.from_pretrained(folder)`` and
``BertTokenizerFast.from_pretrained(folder)`` both work, and so does ``model.init_from`` of
bertpipe's own pre-training and fine-tuning.

Weights come from the fp32 master copies where DeepSpeed keeps them (ZeRO 1-3:
``deepspeed.utils.zero_to_fp32``), else from the module weights of the model-states file
(ZeRO 0), cast to fp32.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from bertpipe import fsio
from bertpipe.errors import BertpipeError
from bertpipe.training import checkpoint as ckpt
from bertpipe.training.model import BertForPreTraining, BertModelConfig

log = logging.getLogger(__name__)

__all__ = ["export_checkpoint", "load_checkpoint_model", "tokenizer_folder"]

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json")


class ExportError(BertpipeError):
    """The checkpoint or tokenizer cannot be exported."""


def _module_weights(folder: str, tag: str, zero_stage: int) -> dict[str, torch.Tensor]:
    path = Path(folder) / tag
    if zero_stage > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(folder, tag=tag))
    files = sorted(path.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise ExportError(f"{path} has no mp_rank_00_model_states.pt: not a DeepSpeed checkpoint")
    states = torch.load(files[0], map_location="cpu", weights_only=True)
    return {k: v.float() for k, v in states["module"].items()}


def load_checkpoint_model(
    folder: str, tag: str | None = None
) -> tuple[BertForPreTraining, ckpt.CheckpointState]:
    """Our model with the weights of checkpoint ``tag`` (default: ``latest``), in fp32."""
    tag = tag or ckpt.latest_tag(folder)
    if tag is None:
        raise ExportError(f"{folder} has no `latest` checkpoint: pass --tag global_stepN")
    state, _ = ckpt.read_state(folder, tag, 0)
    if not state.model:
        raise ExportError(f"{folder}/{tag} does not record its model config")
    model = BertForPreTraining(BertModelConfig(**state.model))
    weights = _module_weights(folder, tag, state.zero_stage)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if k != "cls.predictions.decoder.weight"]  # tied
    if missing or unexpected:
        raise ExportError(
            f"{folder}/{tag} does not match its model config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    model.eval()
    return model, state


def tokenizer_folder(state: ckpt.CheckpointState, tokenizer: str | None) -> str:
    """``tokenizer`` if given, else the tokenizer the checkpoint's first phase was made with."""
    if tokenizer:
        return tokenizer
    phases = state.config.get("phases") or []
    if not phases:
        raise ExportError("the checkpoint records no phases: pass --tokenizer")
    manifest_url = fsio.join(phases[0]["data"], "manifest.json")
    try:
        with fsio.open_url(manifest_url, "rt") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ExportError(f"{manifest_url} is gone: pass --tokenizer") from None
    return str(manifest["config"]["tokenizer"])


def export_checkpoint(
    folder: str, out: str, *, tag: str | None = None, tokenizer: str | None = None
) -> dict[str, Any]:
    """Write checkpoint ``tag`` of ``folder`` as an HF folder ``out`` with its tokenizer."""
    from bertpipe.preprocessing.tokenizer import load_tokenizer, tokenizer_checksum
    from bertpipe.training.hf import save_hf_folder

    model, state = load_checkpoint_model(folder, tag)
    source = tokenizer_folder(state, tokenizer)
    tok = load_tokenizer(source)
    if tok.get_vocab_size() != model.config.vocab_size:
        raise ExportError(
            f"tokenizer {source} has {tok.get_vocab_size()} tokens, the model "
            f"{model.config.vocab_size}: pass the tokenizer the data was made with"
        )
    extra = {}
    for name in TOKENIZER_FILES:
        url = fsio.join(source, name)
        if fsio.exists(url):
            with fsio.open_url(url, "rb") as f:
                extra[name] = f.read()
    save_hf_folder(model, out, extra_files=extra)
    info = {
        "checkpoint": f"{folder}/{tag or ckpt.latest_tag(folder)}",
        "global_step": state.global_step,
        "phase": state.phase,
        "tokenizer": source,
        "tokenizer_sha256": tokenizer_checksum(tok),
        "mlflow_run_id": state.mlflow_run_id,
        "data_sha256": state.data_sha256,
    }
    (Path(out) / "bertpipe_export.json").write_text(json.dumps(info, indent=2) + "\n")
    log.info("exported %s to %s", info["checkpoint"], out)
    return info
