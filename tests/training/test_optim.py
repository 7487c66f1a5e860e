"""Optimizer pieces: decay groups, the LR schedule, LAMB's per-layer trust ratio (also under
DeepSpeed's mixed-precision wrapper at ZeRO 0), and the generated ds_config."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from bertpipe.config import load_config
from training.config import PhaseSpec, PretrainConfig
from training.engine import ds_config
from training.optim import Lamb, lr_lambda, param_groups


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.LayerNorm = nn.LayerNorm(5)
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.LayerNorm(self.a(x)))


def test_param_groups_skip_bias_and_layernorm() -> None:
    decay, no_decay = param_groups(Tiny(), 0.01)
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert {p.shape for p in decay["params"]} == {torch.Size([5, 6]), torch.Size([3, 5])}
    assert len(no_decay["params"]) == 4  # two biases, LayerNorm weight and bias


@pytest.mark.parametrize(
    ("decay", "expected"),
    [
        ("linear", [0.25, 0.5, 0.75, 1.0, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6]),
        (
            "poly",
            [
                0.25,
                0.5,
                0.75,
                1.0,
                1.0,
                (5 / 6) ** 0.5,
                (4 / 6) ** 0.5,
                0.5**0.5,
                (2 / 6) ** 0.5,
                (1 / 6) ** 0.5,
            ],
        ),
    ],
)
def test_warmup_then_decay(decay: str, expected: list[float]) -> None:
    phase = PhaseSpec(max_steps=10, warmup=0.4, decay=decay)  # type: ignore[arg-type]
    f = lr_lambda(phase)
    assert [f(step) for step in range(10)] == pytest.approx(expected)


def _reference_lamb_step(p: torch.Tensor, g: torch.Tensor, lr: float, wd: float) -> torch.Tensor:
    m = 0.1 * g
    v = 0.001 * g * g
    update = (m / 0.1) / ((v / 0.001).sqrt() + 1e-6) + wd * p
    ratio = (p.norm() / update.norm()).clamp(max=10.0) if p.norm() > 0 else torch.tensor(1.0)
    return p - lr * ratio * update


def test_lamb_trust_ratio_is_per_tensor() -> None:
    torch.manual_seed(0)
    model = Tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randn(4, 6)).square().sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt = Lamb(param_groups(model, 0.01), lr=0.1, betas=(0.9, 0.999), eps=1e-6)
    opt.step()
    for name, param in model.named_parameters():
        wd = 0.0 if param.ndim < 2 or "LayerNorm" in name else 0.01
        want = _reference_lamb_step(before[name], grads[name], 0.1, wd)
        assert torch.allclose(param.detach(), want, atol=1e-6), name
    ratios = [opt.state[p]["trust_ratio"] for p in model.parameters()]
    assert len(set(round(r, 6) for r in ratios)) == len(ratios)  # one ratio per tensor


@pytest.mark.integration
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_lamb_under_deepspeed_stage0_keeps_per_layer_ratios(precision: str) -> None:
    """At ZeRO 0 DeepSpeed's mixed-precision wrapper keeps one fp32 master per parameter, so a
    client LAMB computes true per-layer trust ratios (under ZeRO >= 1 the config refuses it)."""
    import deepspeed

    from training.engine import init_distributed

    init_distributed()
    torch.manual_seed(0)
    model = Tiny()
    reference = copy.deepcopy(model)
    cfg = load_config(
        PretrainConfig,
        None,
        [
            f"precision={precision}",
            "zero.stage=0",
            "optimizer.name=lamb",
            "optimizer.max_grad_norm=0",  # DeepSpeed would clip; the reference does not
            "phases=[{name: p, max_steps: 10, micro_batch_size: 4, global_batch_size: 4,"
            " learning_rate: 0.1, warmup: 0}]",
        ],
    )
    opt = Lamb(param_groups(model, 0.01), lr=0.1, betas=(0.9, 0.999), eps=1e-6)
    config = ds_config(cfg, cfg.phases[0], 1)
    if precision == "fp16":
        config["fp16"]["initial_scale_power"] = 4
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    x = torch.randn(4, 6)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    loss = engine(x.to(dtype)).float().square().sum()
    engine.backward(loss)
    engine.step()
    # the basic optimizer saw every parameter as its own tensor
    assert len(opt.state) == len(list(reference.parameters()))
    ratios = [s["trust_ratio"] for s in opt.state.values()]
    assert len({round(r, 5) for r in ratios}) >= 4  # per tensor, not one for a flat buffer
    ref_opt = Lamb(param_groups(reference, 0.01), lr=0.1, betas=(0.9, 0.999), eps=1e-6)
    reference(x).square().sum().backward()
    ref_opt.step()
    tol = 1e-6 if precision == "fp32" else 3e-2
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(mine.detach().float(), theirs.detach(), atol=tol, rtol=tol), name


def test_ds_config_follows_the_typed_config() -> None:
    cfg = load_config(
        PretrainConfig,
        None,
        [
            "precision=fp16",
            "zero.stage=2",
            "zero.offload_optimizer=cpu",
            "loss_scale_power=12",
            "checkpoint.universal=true",
            "optimizer.max_grad_norm=0.5",
            "phases=[{name: p, micro_batch_size: 8, global_batch_size: 64}]",
        ],
    )
    config = ds_config(cfg, cfg.phases[0], world_size=4)
    assert config["train_batch_size"] == 64 and config["gradient_accumulation_steps"] == 2
    assert config["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 12,
        "loss_scale_window": 1000,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }
    assert "bf16" not in config
    assert config["zero_optimization"]["stage"] == 2
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config["gradient_clipping"] == 0.5 and config["checkpoint"]["load_universal"] is True
    from bertpipe.config import ConfigError

    with pytest.raises(
        ConfigError, match="not a multiple of micro_batch_size x world size = 8 x 3"
    ):
        ds_config(cfg, cfg.phases[0], world_size=3)
