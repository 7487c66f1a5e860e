"""DeepSpeed checkpoints are loaded with ``weights_only=True``: a checkpoint file that would
run code when unpickled (anyone who can write the checkpoint folder on shared storage could
plant one) is refused with its name, and nothing in it runs; real checkpoints load."""

from __future__ import annotations

import pathlib
from pathlib import Path

import pytest
import torch
from torch import nn

from bertpipe.config import load_config
from bertpipe.training.core.engine import (
    UnsafeCheckpointError,
    build_engine,
    init_distributed,
)
from bertpipe.training.pretrain.config import PretrainConfig
from bertpipe.training.pretrain.phases import phase_engine

pytestmark = pytest.mark.integration


class _Planted:
    """Unpickling this touches a file: the stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (pathlib.Path.touch, (self.marker,))


def _engine(stage: int, precision: str):  # type: ignore[no-untyped-def]
    init_distributed()
    cfg = load_config(
        PretrainConfig,
        None,
        [
            f"precision={precision}",
            f"zero.stage={stage}",
            "phases=[{name: p, max_steps: 4, micro_batch_size: 2, global_batch_size: 2,"
            " learning_rate: 0.01, warmup: 0}]",
        ],
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    engine, _ = build_engine(model, phase_engine(cfg, cfg.phases[0], 1))
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    loss = engine(torch.randn(2, 4).to(dtype)).float().square().mean()
    engine.backward(loss)
    engine.step()
    return engine


@pytest.mark.parametrize(("stage", "precision"), [(0, "fp32"), (1, "fp32"), (2, "bf16")])
def test_real_checkpoints_load_with_weights_only(tmp_path: Path, stage: int, precision: str):
    engine = _engine(stage, precision)
    engine.save_checkpoint(str(tmp_path), tag="t")
    saved = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    fresh = _engine(stage, precision)
    path, _ = fresh.load_checkpoint(str(tmp_path), tag="t")
    assert path is not None
    for key, value in fresh.module.state_dict().items():
        assert torch.equal(value, saved[key]), key


def test_planted_pickle_is_refused_and_never_runs(tmp_path: Path):
    engine = _engine(1, "fp32")
    engine.save_checkpoint(str(tmp_path), tag="t")
    (optim,) = (tmp_path / "t").glob("*optim_states.pt")
    marker = tmp_path / "code-ran"
    torch.save({"optimizer_state_dict": _Planted(marker)}, optim)
    with pytest.raises(UnsafeCheckpointError, match=optim.name):
        _engine(1, "fp32").load_checkpoint(str(tmp_path), tag="t")
    assert not marker.exists()


def test_export_of_a_zero_checkpoint_refuses_a_planted_pickle(tmp_path: Path):
    """Export reads ZeRO checkpoints through DeepSpeed's zero_to_fp32, which asks torch for
    full unpickling: bertpipe forces weights-only loading around it."""
    from bertpipe.training.export import _module_weights

    engine = _engine(1, "fp32")
    engine.save_checkpoint(str(tmp_path), tag="t")
    weights = _module_weights(str(tmp_path), "t", zero_stage=1)
    assert set(weights) == set(engine.module.state_dict())
    (optim,) = (tmp_path / "t").glob("*optim_states.pt")
    marker = tmp_path / "code-ran"
    torch.save({"optimizer_state_dict": _Planted(marker)}, optim)
    with pytest.raises(UnsafeCheckpointError):
        _module_weights(str(tmp_path), "t", zero_stage=1)
    assert not marker.exists()
