"""transformers folders of every family (:mod:`bertpipe.training.models.families`), without
importing transformers: the reader of transformers' config files, and the weights.

A folder holds ``config.json`` (its ``model_type`` names the family: ``bert``,
``modernbert``; each family's ``hf`` module maps its fields) and ``model.safetensors`` (or, for
older checkpoints, ``pytorch_model.bin``). Parameter names are the same on both sides (see
:mod:`bertpipe.training.models.bert.model`); what changes on the way is:

* the vocabulary padding: stripped on export, re-added (zero rows) on import;
* the tied decoder (``cls.predictions.decoder.{weight,bias}``): not written, as transformers
  does not write it either and re-ties it on load; ignored on import;
* old checkpoint names: ``LayerNorm.gamma/beta`` become ``weight/bias``, and keys of a bare
  encoder's checkpoint (``embeddings.*``, ``encoder.*``, ``pooler.*``; ModernBERT's
  ``layers.*``, ``final_norm.*``) get the family's prefix (``bert.``, ``model.``).

Paths are plain local paths; callers copy from or to remote storage themselves.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from bertpipe.training.models.families import (
    DEFAULT_FAMILY,
    FAMILIES,
    ModelConfig,
    by_model_type,
    family_of,
)

log = logging.getLogger(__name__)

__all__ = [
    "LoadReport",
    "config_from_hf",
    "export_state_dict",
    "hf_config_dict",
    "load_hf_folder",
    "load_into",
    "save_hf_folder",
]

CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
TORCH_BIN_NAME = "pytorch_model.bin"
# aliases of bert.embeddings.word_embeddings.weight and cls.predictions.bias
TIED_KEYS = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias", "decoder.weight")


def hf_config_dict(
    cfg: ModelConfig,
    architecture: str | None = None,
    num_labels: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """The family's transformers config (``BertConfig``, ``ModernBertConfig``) as written to
    config.json (vocab_size is the real size); ``architecture``: the family's pre-training
    class unless given."""
    family = family_of(cfg)
    architecture = architecture or family.reference_model
    return family.module("hf").hf_config_dict(cfg, architecture, num_labels, dtype)  # type: ignore[no-any-return]


def config_from_hf(data: Mapping[str, Any], pad_vocab_multiple: int = 8) -> ModelConfig:
    """The model config of a transformers config.json mapping, of the family its
    ``model_type`` names (``bert`` when it names none)."""
    model_type = data.get("model_type", FAMILIES[DEFAULT_FAMILY].model_type)
    family = by_model_type(model_type)
    if family is None:
        known = ", ".join(f.model_type for f in FAMILIES.values())
        raise ValueError(f"not a checkpoint of a known family: model_type={model_type!r} ({known})")
    return family.module("hf").config_from_hf(data, pad_vocab_multiple)  # type: ignore[no-any-return]


def export_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Transformers-named CPU tensors of ``model`` (any model with a ``config`` attribute
    holding a :class:`BertModelConfig`): vocab padding stripped, tied aliases dropped, each
    tensor a contiguous copy (so safetensors accepts them and later training cannot alter them).
    """
    cfg: ModelConfig = model.config  # type: ignore[assignment]
    family_of(cfg).module("hf").check_exportable(cfg)
    out: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        if key in TIED_KEYS:
            continue
        if _is_vocab_key(key):
            value = value[: cfg.vocab_size]
        out[key] = value.detach().to(device="cpu", copy=True).contiguous()
    return out


def save_hf_folder(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    extra_files: Mapping[str, bytes] | None = None,
    token_ids: Mapping[str, int] | None = None,
) -> Path:
    """Write config.json, model.safetensors and ``extra_files`` (name -> bytes, e.g. vocab.txt,
    tokenizer.json) into ``out_dir``; returns the folder. ``token_ids``: the tokenizer's
    ``cls``/``sep``/``pad``/``mask`` ids, written into a ModernBERT config.json (whose
    defaults are ModernBERT's own vocabulary's)."""
    from safetensors.torch import save_file

    architecture = type(model).__name__
    state = export_state_dict(model)
    dtype = next(iter(state.values())).dtype
    config = hf_config_dict(
        model.config,  # type: ignore[arg-type]
        architecture,
        getattr(model, "num_labels", None),
        dtype,
    )
    if token_ids:
        config.update(family_of(model.config).module("hf").token_config(token_ids))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in extra_files or {}:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"extra file name {name!r} must be relative and stay in the folder")
        if name in (CONFIG_NAME, SAFETENSORS_NAME):
            raise ValueError(f"extra file {name!r} would overwrite the model's own file")
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(state, str(out / SAFETENSORS_NAME), metadata={"format": "pt"})
    for name, data in (extra_files or {}).items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    log.info("saved %s (%d tensors) to %s", architecture, len(state), out)
    return out


def load_hf_folder(
    path: str | os.PathLike[str], pad_vocab_multiple: int = 8
) -> tuple[ModelConfig, dict[str, Tensor]]:
    """Read a transformers BERT (or ModernBERT) folder: its config and its weights with
    canonical names (``bert.``/``model.``-prefixed, ``LayerNorm.weight/bias``), vocabulary not
    yet padded."""
    folder = Path(path)
    config = config_from_hf(json.loads((folder / CONFIG_NAME).read_text()), pad_vocab_multiple)
    if (folder / SAFETENSORS_NAME).exists():
        from safetensors.torch import load_file

        raw = load_file(str(folder / SAFETENSORS_NAME))
    elif (folder / SAFETENSORS_INDEX_NAME).exists():
        from safetensors.torch import load_file

        index = json.loads((folder / SAFETENSORS_INDEX_NAME).read_text())
        raw = {}
        for shard in sorted(set(index["weight_map"].values())):
            raw.update(load_file(str(folder / shard)))
    elif (folder / TORCH_BIN_NAME).exists():
        raw = torch.load(folder / TORCH_BIN_NAME, map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(
            f"{folder} has no {SAFETENSORS_NAME}, {SAFETENSORS_INDEX_NAME} or {TORCH_BIN_NAME}"
        )
    return config, canonical_names(raw)


def canonical_names(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Map older transformers names to current ones (``gamma``/``beta``) and a bare encoder's
    names to those of a model with heads (``bert.``; ``model.`` for ModernBERT)."""
    firsts = {k.split(".", 1)[0] for k in state_dict}
    # the family whose encoder prefix, or bare parts no other family has, the names show
    default = FAMILIES[DEFAULT_FAMILY]
    family = next(
        (
            f
            for f in FAMILIES.values()
            if f.encoder_prefix.rstrip(".") in firsts
            or firsts & (set(f.bare_parts) - set(default.bare_parts))
        ),
        default,
    )
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        name = key.replace("LayerNorm.gamma", "LayerNorm.weight")
        name = name.replace("LayerNorm.beta", "LayerNorm.bias")
        if name.split(".", 1)[0] in family.bare_parts:
            name = family.encoder_prefix + name
        out[name] = value
    return out


@dataclasses.dataclass
class LoadReport:
    """What :func:`load_into` could not match."""

    missing: list[str]
    """Keys of the model that the state dict did not provide (kept at their init)."""
    unexpected: list[str]
    """Keys of the state dict that the model has no place for (ignored)."""


def load_into(
    model: nn.Module, state_dict: Mapping[str, Tensor], strict_heads: bool = True
) -> LoadReport:
    """Copy ``state_dict`` (transformers or our names, padded vocab or not) into ``model``.

    Works for :class:`~bertpipe.training.models.bert.model.BertForPreTraining`, a bare ``BertModel``
    and the fine-tuning heads. Missing embedding or encoder weights always raise; other missing keys
    (pooler, MLM/NSP heads, task heads) raise only with ``strict_heads``, else they keep their
    initialisation and are reported. Unexpected keys are reported and ignored."""
    cfg: ModelConfig = model.config  # type: ignore[assignment]
    family = family_of(cfg)
    prefix, core_parts = family.encoder_prefix, family.encoder_parts
    target = model.state_dict()
    source = canonical_names(state_dict)
    if "cls.predictions.bias" not in source and "cls.predictions.decoder.bias" in source:
        source["cls.predictions.bias"] = source["cls.predictions.decoder.bias"]
    bare = not any(k.startswith(prefix) for k in target)
    mapped: dict[str, Tensor] = {}
    unexpected: list[str] = []
    for key, value in source.items():
        if key in TIED_KEYS:
            continue
        name = key.removeprefix(prefix) if bare else key
        if name not in target:
            unexpected.append(key)
            continue
        want = target[name].shape
        if _is_vocab_key(name) and value.shape[0] == cfg.vocab_size and want[0] > value.shape[0]:
            padding = value.new_zeros((want[0] - value.shape[0], *value.shape[1:]))
            value = torch.cat([value, padding])
        if value.shape != want:
            raise ValueError(
                f"{key}: checkpoint shape {tuple(value.shape)} does not fit the model's "
                f"{tuple(want)}; is the config (vocab_size, sizes) the checkpoint's?"
            )
        mapped[name] = value
    missing = [k for k in target if k not in mapped and k not in TIED_KEYS]
    core = [k for k in missing if k.removeprefix(prefix).split(".")[0] in core_parts]
    if core or (missing and strict_heads):
        raise ValueError(f"checkpoint lacks {len(missing)} weights of the model: {missing[:8]}")
    model.load_state_dict(mapped, strict=False)
    if missing:
        log.warning("not in the checkpoint, left at their initialisation: %s", missing)
    if unexpected:
        log.info("checkpoint weights the model does not use: %s", unexpected)
    return LoadReport(missing=missing, unexpected=unexpected)


def _is_vocab_key(key: str) -> bool:
    return key.endswith(
        ("word_embeddings.weight", "predictions.bias", "tok_embeddings.weight")
    ) or (key == "decoder.bias")
