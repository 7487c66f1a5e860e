"""Resuming with a changed config: what may change, what is refused, and applying the changes.

At a resume the resolved config is compared with the one the checkpoint was trained with (it
is stored in the checkpoint). Every difference is logged as ``changed at resume: KEY old ->
new`` and recorded on the MLflow run. Settings that fix what the checkpoint *is* (the model's
shape, the batch, the data order, the precision, the optimizer's kind) cannot change: such a
resume is refused with one line naming the keys, unless ``checkpoint.allow_changes`` lists
them. Everything else (peak learning rate and schedule, weight decay, betas, clipping,
``max_bad_steps``, cadences, paths, tracking) is taken from the new config:
:meth:`~bertpipe.training.core.engine.EngineSpec.apply_to` writes the optimizer's hyperparameters
and the learning-rate schedule over the ones DeepSpeed's ``load_checkpoint`` restored, so
that the run trains with the new values from its next step on.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from bertpipe.config import ConfigError

log = logging.getLogger(__name__)

__all__ = [
    "FINETUNE_FIXED",
    "MODEL_SHAPE",
    "PRETRAIN_FIXED",
    "changed_settings",
    "check_changes",
    "log_changes",
    "mlflow_tags",
    "with_model_shape",
]

MODEL_SHAPE = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "intermediate_size",
    "max_position_embeddings",
    "type_vocab_size",
    "pre_layer_norm",
    "position_embedding",
    "pad_vocab_multiple",
)
"""Fields of the resolved ``BertModelConfig`` that make a checkpoint's tensors what they are."""

# config keys that only choose the shape: compared as the resolved model, not as written
_SHAPE_CHOICES = (
    "model.preset",
    "model.num_layers",
    "model.hidden_size",
    "model.num_heads",
    "model.intermediate_size",
)

PRETRAIN_FIXED = (
    *(f"model.{key}" for key in MODEL_SHAPE),
    "phases[].name",
    "phases[].micro_batch_size",
    "phases[].global_batch_size",
    "precision",
    "mixed_precision",
    "zero.stage",
    "zero.offload_optimizer",
    "optimizer.name",
    "seed",
)
"""Pre-training settings a resume cannot change: the model's shape (of the resolved model,
see :func:`with_model_shape`), the batch, the data order (seed), precision and the
optimizer's kind and partitioning."""

FINETUNE_FIXED = (
    "init_from",
    "random_init",
    "tokenizer",
    "task.family",
    "task.name",
    "task.train",
    "task.kind",
    "task.text_a",
    "task.text_b",
    "task.label",
    "task.labels",
    "task.max_seq_length",
    "task.version_2",
    "task.doc_stride",
    "task.max_query_length",
    "batch_size",
    "micro_batch_size",
    "seed",
    "precision",
    "mixed_precision",
    "zero.stage",
    "zero.offload_optimizer",
    "optimizer.name",
)
"""Fine-tuning settings a resume cannot change: the encoder and tokenizer, the training data
and how it becomes inputs, the batch, the data order (seed), precision, the optimizer's kind
and partitioning."""

# bookkeeping that differs between any two runs of the same job
_IGNORED = ("checkpoint.resume", "overwrite")
_MISSING = object()


def flat_settings(data: Any, prefix: str = "") -> dict[str, Any]:
    """A config dict as dotted keys: ``{"phases": [{"name": "p"}]}`` -> ``{"phases[0].name":
    "p"}``; lists of plain values stay whole."""
    out: dict[str, Any] = {}
    if isinstance(data, Mapping):
        for key, value in data.items():
            out.update(flat_settings(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(data, list | tuple) and any(isinstance(v, Mapping) for v in data):
        for i, value in enumerate(data):
            out.update(flat_settings(value, f"{prefix}[{i}]"))
    else:
        out[prefix] = list(data) if isinstance(data, tuple) else data
    return out


def changed_settings(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``key -> (old, new)`` for every setting that differs between two config dicts (a key
    present in one only, such as a phase added since, has ``MISSING`` on the other side). An
    empty ``old`` (a checkpoint without its config) gives no changes."""
    if not old:
        return {}
    a, b = flat_settings(old), flat_settings(new)
    out = {}
    for key in sorted(set(a) | set(b)):
        before, after = a.get(key, _MISSING), b.get(key, _MISSING)
        if key in _IGNORED or _equal(before, after):
            continue
        out[key] = (before, after)
    return out


def with_model_shape(
    changes: Mapping[str, tuple[Any, Any]], saved: Mapping[str, Any], current: Mapping[str, Any]
) -> dict[str, tuple[Any, Any]]:
    """``changes`` with the resolved model's shape in place of the keys that choose it: a
    preset or override written differently but giving the same model is no change, and a
    changed shape is named by the field that changed (``model.hidden_size 128 -> 64``).
    ``saved``/``current``: the ``BertModelConfig`` of the checkpoint and of this run, as dicts
    (a checkpoint without one compares nothing)."""
    out = {k: v for k, v in changes.items() if k not in _SHAPE_CHOICES}
    for key in MODEL_SHAPE:
        if saved and key in saved and not _equal(saved[key], current.get(key)):
            out[f"model.{key}"] = (saved[key], current.get(key))
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return float(a) == float(b)
    return bool(a == b)


def _pattern(key: str) -> str:
    return re.sub(r"\[\d+\]", "[]", key)


def _matches(key: str, patterns: Iterable[str]) -> bool:
    """Whether ``key`` is one of ``patterns`` or inside one (``model`` covers
    ``model.hidden_size``); ``[]`` in a pattern stands for any list index, ``*`` for any
    text."""
    plain = _pattern(key)
    for pattern in patterns:
        pattern = _pattern(pattern)
        for candidate in (plain, key):
            if candidate == pattern or candidate.startswith(pattern + "."):
                return True
            if "*" in pattern and fnmatch.fnmatchcase(candidate, pattern.replace("[]", "[[]]")):
                return True
    return False


def check_changes(
    changes: Mapping[str, tuple[Any, Any]],
    fixed: Sequence[str],
    allowed: Sequence[str],
    tag: str,
) -> None:
    """Raise :class:`ConfigError` (one line) if ``changes`` touch a ``fixed`` setting that
    ``allowed`` (``checkpoint.allow_changes``) does not list. A setting present on one side
    only (a phase added after the checkpoint's) is not a change of a fixed setting."""
    refused = [
        key
        for key, (old, new) in changes.items()
        if old is not _MISSING and new is not _MISSING and _matches(key, fixed)
        if not _matches(key, allowed)
    ]
    if not refused:
        return
    listing = ", ".join(
        f"{key} {_shown(changes[key][0])} -> {_shown(changes[key][1])}" for key in refused
    )
    raise ConfigError(
        "checkpoint.resume",
        f"{tag} was trained with other settings that a resume cannot change ({listing}): "
        "resume with the checkpoint's values, start a new run (another output or "
        "checkpoint.dir), or accept the change with "
        f"checkpoint.allow_changes=[{','.join(refused)}]",
    )


def _shown(value: Any) -> str:
    return "(unset)" if value is _MISSING else repr(value)


def log_changes(changes: Mapping[str, tuple[Any, Any]], tag: str) -> None:
    for key, (old, new) in changes.items():
        log.warning("changed at resume from %s: %s %s -> %s", tag, key, _shown(old), _shown(new))


def mlflow_tags(changes: Mapping[str, tuple[Any, Any]], step: int) -> dict[str, str]:
    """One tag per changed setting, ``bertpipe.changed_at_resume.KEY``: ``old -> new (from
    step N)`` (MLflow params cannot change once logged)."""
    out = {}
    for key, (old, new) in changes.items():
        name = re.sub(r"\[(\d+)\]", r".\1", key)
        text = f"{_shown(old)} -> {_shown(new)} (from step {step})"
        out[f"bertpipe.changed_at_resume.{name}"] = text[:5000]
    return out
