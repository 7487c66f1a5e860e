"""Which settings a resume may change (pure functions of :mod:`bertpipe.training.core.resume`)."""

from __future__ import annotations

import re

import pytest

from bertpipe.config import ConfigError, load_config, to_dict
from bertpipe.training.core.resume import (
    PRETRAIN_FIXED,
    changed_settings,
    check_changes,
    mlflow_tags,
    with_model_shape,
)
from bertpipe.training.pretrain.config import PretrainConfig

PHASES = "phases=[{name: p1, max_steps: 10}, {name: p2, max_steps: 4}]"


def _dict(*overrides: str) -> dict:  # type: ignore[type-arg]
    return to_dict(load_config(PretrainConfig, None, [PHASES, *overrides]))


def test_changes_are_listed_by_dotted_key_and_unchanged_values_are_not() -> None:
    old = _dict()
    new = _dict("phases[0].learning_rate=5e-5", "optimizer.betas=[0.9, 0.98]", "seed=42")
    assert changed_settings(old, new) == {
        "optimizer.betas": ([0.9, 0.999], [0.9, 0.98]),
        "phases[0].learning_rate": (1e-4, 5e-5),
    }
    assert changed_settings({}, new) == {}  # a checkpoint without its config: nothing to say
    # bookkeeping of the resume itself is no change
    assert changed_settings(old, _dict("checkpoint.resume=global_step8")) == {}


def test_fixed_settings_are_refused_unless_allowed() -> None:
    old = _dict()
    safe = changed_settings(old, _dict("optimizer.weight_decay=0.1", "max_bad_steps=3"))
    check_changes(safe, PRETRAIN_FIXED, [], "global_step8")  # applied, not refused
    unsafe = changed_settings(old, _dict("phases[1].micro_batch_size=8", "precision=fp32"))
    with pytest.raises(ConfigError) as error:
        check_changes(unsafe, PRETRAIN_FIXED, [], "global_step8")
    message = str(error.value)
    assert "phases[1].micro_batch_size 32 -> 8" in message
    assert "precision 'bf16' -> 'fp32'" in message
    assert "\n" not in message
    assert "checkpoint.allow_changes=[phases[1].micro_batch_size,precision]" in message
    check_changes(unsafe, PRETRAIN_FIXED, ["precision", "phases[1]"], "global_step8")
    # a phase added after the checkpoint's is not a change of a fixed setting
    added = changed_settings(_dict(PHASES.replace(", {name: p2, max_steps: 4}", "")), old)
    assert added["phases[1].name"][1] == "p2"
    check_changes(added, PRETRAIN_FIXED, [], "global_step8")


def test_the_model_shape_is_compared_as_resolved() -> None:
    written = changed_settings(_dict("model.preset=base"), _dict("model.hidden_size=768"))
    same = {"hidden_size": 768, "num_layers": 12, "vocab_size": 400}
    assert with_model_shape(written, same, same) == {}  # other words, the same model
    other = with_model_shape({}, same, {**same, "hidden_size": 1024})
    assert other == {"model.hidden_size": (768, 1024)}
    with pytest.raises(ConfigError, match=re.escape("model.hidden_size 768 -> 1024")):
        check_changes(other, PRETRAIN_FIXED, [], "global_step8")


def test_changes_become_mlflow_tags() -> None:
    tags = mlflow_tags({"phases[0].learning_rate": (1e-4, 5e-5)}, 300)
    assert tags == {
        "bertpipe.changed_at_resume.phases.0.learning_rate": "0.0001 -> 5e-05 (from step 300)"
    }
