"""What a pre-training phase is built from: the model config (a preset or checkpoint, fitted
to the data) and the phase's engine, with its batch, peak learning rate and curve.

The model config is checked on every rank before the process group does any work, so that
phases whose data do not fit together or the model fail with one line naming the phase (the
phases' manifests are read by :func:`bertpipe.training.pretrain.data.manifest.read_phase_data`).
The learning rate goes from the config (``phases[i].learning_rate`` and the curve's keys)
through :func:`phase_engine` to the shared engine builder
(:func:`bertpipe.training.core.engine.build_engine`), which sets it on the optimizer
(:func:`bertpipe.training.core.optim.schedule_learning_rate`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from bertpipe.config import ConfigError
from bertpipe.training.core.engine import EngineSpec, engine_spec
from bertpipe.training.core.schedules import warmup_decay, warmup_stable_decay
from bertpipe.training.models.families import ModelConfig, family_of, preset_config
from bertpipe.training.pretrain.config import PhaseSpec, PretrainConfig
from bertpipe.training.pretrain.data.manifest import DataMismatchError, PhaseData

__all__ = ["ds_config", "lr_lambda", "model_config", "phase_engine"]

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
        from bertpipe.training.models.hf import load_hf_folder

        model_cfg, _ = load_hf_folder(cfg.model.init_from)
        # the architecture is the checkpoint's; how it is trained is this config's
        model_cfg = dataclasses.replace(model_cfg, **_training_settings(cfg, model_cfg))
        family = family_of(model_cfg).name
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
    family = family_of(model_cfg)
    for i, d in enumerate(data):
        if not family.nsp and d.parsed.objective != "mlm":
            log.warning(
                "phases[%d].data %s holds mlm+nsp pairs; %s has no NSP head: they are "
                "trained as masked LM only (objective mlm packs full sentences instead)",
                i,
                d.url,
                family.title,
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
    family = family_of(model_cfg)
    out: dict[str, object] = {"activation_checkpointing": cfg.model.activation_checkpointing}
    hidden, attention = cfg.model.hidden_dropout, cfg.model.attention_dropout
    hidden = family.default_dropout if hidden is None else hidden
    attention = family.default_dropout if attention is None else attention
    if hidden is not None:
        out.update(dict.fromkeys(family.hidden_dropout_keys, hidden))
    if attention is not None:
        out["attention_dropout"] = attention
    return out


def phase_engine(cfg: PretrainConfig, phase: PhaseSpec, world_size: int) -> EngineSpec:
    """The engine of a pre-training phase on ``world_size`` processes: its batch, its peak
    learning rate and its curve (:func:`lr_lambda`), the config's engine sections."""
    phase.accumulation(world_size)  # a clear config error for an indivisible batch
    return engine_spec(
        cfg,
        micro_batch_size=phase.micro_batch_size,
        global_batch_size=phase.global_batch_size,
        world_size=world_size,
        learning_rate=phase.learning_rate,
        schedule=lr_lambda(phase, cfg),
    )


def ds_config(cfg: PretrainConfig, phase: PhaseSpec, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config of ``phase`` on ``world_size`` processes."""
    return phase_engine(cfg, phase, world_size).ds_config()


def lr_lambda(phase: PhaseSpec, cfg: PretrainConfig | None = None) -> Callable[[int], float]:
    """The multiplier schedule of a pre-training phase (see :func:`warmup_decay` and
    :func:`warmup_stable_decay`); with ``cfg.schedule == "continuous"`` the phase's stretch
    of one schedule over all phases: phase 1's warmup and curve over the steps of all phases
    (a ``wsd`` cooldown is the last ``decay_fraction`` of those)."""
    if cfg is None or cfg.schedule == "per_phase":
        return _curve(phase, phase.max_steps)
    index = next(i for i, p in enumerate(cfg.phases) if p.name == phase.name)
    offset = sum(p.max_steps for p in cfg.phases[:index])
    whole = _curve(cfg.phases[0], sum(p.max_steps for p in cfg.phases))
    return lambda step: whole(offset + step)


def _curve(phase: PhaseSpec, total: int) -> Callable[[int], float]:
    """``phase``'s warmup and decay settings over ``total`` optimizer steps."""
    if phase.decay == "wsd":
        return warmup_stable_decay(
            phase.warmup_steps(),
            total,
            phase.cooldown_steps(total),
            phase.decay_shape,
            phase.min_lr_ratio,
        )
    return warmup_decay(_warmup(phase), total, phase.decay, phase.decay_power, phase.decay_from)


def _warmup(phase: PhaseSpec) -> float:
    """Warmup in updates; unrounded for ``decay_from="start"``, as NVIDIA's scheduler takes
    the fraction itself (0.2843 of 7038 steps is 2000.9)."""
    if phase.decay_from == "start" and phase.warmup < 1:
        return phase.warmup * phase.max_steps
    return phase.warmup_steps()
