"""What a pre-training run is built from: each phase's data manifest and the model config.

Read on every rank before the process group does any work, so that data that does not fit
together or the model fails with one line naming the phase.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from bertpipe import fsio
from bertpipe.config import ConfigError
from bertpipe.errors import BertpipeError
from bertpipe.training.config import PhaseSpec, PretrainConfig
from bertpipe.training.model import BertModelConfig

__all__ = ["DataMismatchError", "PhaseData", "model_config", "read_phase_data"]


class DataMismatchError(BertpipeError):
    """The phases' data do not fit together or the model."""


@dataclass
class PhaseData:
    """What a phase's manifest says."""

    url: str
    manifest: dict[str, Any]
    sha256: str

    @property
    def max_seq_length(self) -> int:
        return int(self.manifest["max_seq_length"])


def read_phase_data(phase: PhaseSpec, key: str, retry: Any = None) -> PhaseData:
    """The manifest of ``phase`` (``key``: where the phase is in the config, for errors)."""
    from bertpipe.training.manifest import read_bytes

    url = fsio.join(phase.data, "manifest.json")
    try:
        raw = read_bytes(url, retry)  # transient storage errors retried (data.read_retries)
    except FileNotFoundError:
        raise ConfigError(
            f"{key}.data", f"{url} does not exist: run `bertpipe preprocess` for this phase first"
        ) from None
    manifest = json.loads(raw)
    if manifest.get("format") != "bertpipe.instances":
        raise DataMismatchError(f"{url} is not a bertpipe shard manifest")
    return PhaseData(phase.data, manifest, hashlib.sha256(raw).hexdigest())


def model_config(cfg: PretrainConfig, data: list[PhaseData]) -> BertModelConfig:
    """The model's config: the preset, the config's changes, the data's vocabulary."""
    first = data[0].manifest
    for d in data[1:]:
        if d.manifest["tokenizer_sha256"] != first["tokenizer_sha256"]:
            raise DataMismatchError(
                f"{d.url} was made with another tokenizer than {data[0].url}: all phases must "
                "share one tokenizer"
            )
    if cfg.model.init_from:
        from bertpipe.training.hf import load_hf_folder

        model_cfg, _ = load_hf_folder(cfg.model.init_from)
        # the architecture is the checkpoint's; how it is trained is this config's
        model_cfg = dataclasses.replace(
            model_cfg,
            hidden_dropout=cfg.model.hidden_dropout,
            attention_dropout=cfg.model.attention_dropout,
            activation_checkpointing=cfg.model.activation_checkpointing,
        )
        if model_cfg.vocab_size != first["vocab_size"]:
            raise DataMismatchError(
                f"model.init_from has a vocabulary of {model_cfg.vocab_size}, the data "
                f"{first['vocab_size']}: use the tokenizer the model was trained with"
            )
    else:
        model_cfg = BertModelConfig.preset(
            cfg.model.preset,
            vocab_size=int(first["vocab_size"]),
            pad_token_id=int(first["special_token_ids"]["pad"]),
            **cfg.model.overrides(),
        )
    for i, d in enumerate(data):
        if d.max_seq_length > model_cfg.max_position_embeddings:
            raise ConfigError(
                f"phases[{i}].data",
                f"holds sequences of {d.max_seq_length} tokens but the model has "
                f"{model_cfg.max_position_embeddings} positions: raise "
                "model.max_position_embeddings",
            )
    return model_cfg
