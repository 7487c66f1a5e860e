"""The model config a pre-training run is built from: a preset or checkpoint, fitted to the data.

Checked on every rank before the process group does any work, so that phases whose data do
not fit together or the model fail with one line naming the phase. The phases' manifests
are read by :func:`bertpipe.training.pretrain.data.manifest.read_phase_data`.
"""

from __future__ import annotations

import dataclasses
import logging

from bertpipe.config import ConfigError
from bertpipe.training.models.families import ModelConfig, preset_config
from bertpipe.training.models.modernbert.config import ModernBertModelConfig
from bertpipe.training.pretrain.config import PretrainConfig
from bertpipe.training.pretrain.data.manifest import DataMismatchError, PhaseData

__all__ = ["model_config"]

log = logging.getLogger(__name__)


def model_config(cfg: PretrainConfig, data: list[PhaseData]) -> ModelConfig:
    """The model's config: the preset, the config's changes, the data's vocabulary."""
    first = data[0].manifest
    for d in data[1:]:
        if d.manifest["tokenizer_sha256"] != first["tokenizer_sha256"]:
            raise DataMismatchError(
                f"{d.url} was made with another tokenizer than {data[0].url}: all phases must "
                "share one tokenizer"
            )
    if cfg.model.init_from:
        from bertpipe.training.models.bert.hf import load_hf_folder

        model_cfg, _ = load_hf_folder(cfg.model.init_from)
        # the architecture is the checkpoint's; how it is trained is this config's
        model_cfg = dataclasses.replace(model_cfg, **_training_settings(cfg, model_cfg))
        family = getattr(model_cfg, "family", "bert")
        if cfg.model.family is not None and cfg.model.family != family:
            raise ConfigError(
                "model.family",
                f"is {cfg.model.family} but model.init_from holds a {family} model: set "
                f"model.family={family} (or null)",
            )
        if model_cfg.vocab_size != first["vocab_size"]:
            raise DataMismatchError(
                f"model.init_from has a vocabulary of {model_cfg.vocab_size}, the data "
                f"{first['vocab_size']}: use the tokenizer the model was trained with"
            )
    else:
        model_cfg = preset_config(
            cfg.model.resolved_family,
            cfg.model.preset,
            vocab_size=int(first["vocab_size"]),
            pad_token_id=int(first["special_token_ids"]["pad"]),
            **cfg.model.overrides(),
        )
    for i, d in enumerate(data):
        if isinstance(model_cfg, ModernBertModelConfig) and d.parsed.objective != "mlm":
            log.warning(
                "phases[%d].data %s holds mlm+nsp pairs; ModernBERT has no NSP head: they are "
                "trained as masked LM only (objective mlm packs full sentences instead)",
                i,
                d.url,
            )
        if d.max_seq_length > model_cfg.max_position_embeddings:
            raise ConfigError(
                f"phases[{i}].data",
                f"holds sequences of {d.max_seq_length} tokens but the model has "
                f"{model_cfg.max_position_embeddings} positions: raise "
                "model.max_position_embeddings",
            )
    return model_cfg


def _training_settings(cfg: PretrainConfig, model_cfg: ModelConfig) -> dict[str, object]:
    """What this config sets of a checkpoint's architecture: dropout and recomputation."""
    out: dict[str, object] = {"activation_checkpointing": cfg.model.activation_checkpointing}
    hidden, attention = cfg.model.hidden_dropout, cfg.model.attention_dropout
    if isinstance(model_cfg, ModernBertModelConfig):
        if hidden is not None:
            out["embedding_dropout"] = out["mlp_dropout"] = hidden
        if attention is not None:
            out["attention_dropout"] = attention
        return out
    out["hidden_dropout"] = 0.1 if hidden is None else hidden
    out["attention_dropout"] = 0.1 if attention is None else attention
    return out
