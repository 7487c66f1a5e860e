"""Optimizer pieces: decay groups, the LR schedule, LAMB's per-layer trust ratio (also under
DeepSpeed's mixed-precision wrapper at ZeRO 0) and its multi-tensor step against a per-tensor
transcription, which AdamW implementation ``optimizer.fused`` selects, and the generated
ds_config."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from bertpipe.config import ConfigError, load_config
from bertpipe.training.core.config import OptimizerConfig
from bertpipe.training.core.optim import Lamb, build_optimizer, param_groups
from bertpipe.training.pretrain.config import PhaseSpec, PretrainConfig
from bertpipe.training.pretrain.phases import ds_config, lr_lambda


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


def _nvidia_poly_warmup(base_lr: float, warmup: float, total: int, degree: float, update: int):
    """NVIDIA DeepLearningExamples' PolyWarmUpScheduler.get_lr, transcribed: the scheduler is
    stepped before each optimizer step, so update u (1-based) sees last_epoch = u."""
    progress = update / total
    if progress < warmup:
        return base_lr * progress / warmup
    return base_lr * (1.0 - progress) ** degree


def test_poly_decay_from_start_is_nvidias_schedule() -> None:
    """NVIDIA's BERT-Large phase 1: warmup 0.2843 of 7038 steps, degree 0.5."""
    phase = PhaseSpec(
        max_steps=7038, warmup=0.2843, decay="poly", decay_power=0.5, decay_from="start"
    )
    f = lr_lambda(phase)
    for update in (1, 2, 1000, 2000, 2001, 2002, 5000, 7037, 7038):
        want = _nvidia_poly_warmup(6e-3, 0.2843, 7038, 0.5, update)
        assert 6e-3 * f(update - 1) == pytest.approx(want, rel=1e-12, abs=1e-15), update
    # the first update after warmup is already below the peak (0.846 of it)
    assert f(2000) == pytest.approx((1 - 2001 / 7038) ** 0.5) == pytest.approx(0.8459, abs=1e-4)


def test_continuous_schedule_spans_the_phases() -> None:
    """The paper: one warmup and one linear decay over both phases at one peak."""
    cfg = load_config(
        PretrainConfig,
        None,
        [
            "schedule=continuous",
            "phases=[{name: a, max_steps: 90, warmup: 10, learning_rate: 0.1},"
            " {name: b, max_steps: 10, warmup: 0, learning_rate: 0.1}]",
        ],
    )
    one = lr_lambda(PhaseSpec(max_steps=100, warmup=10))
    a, b = (lr_lambda(p, cfg) for p in cfg.phases)
    assert [a(s) for s in range(90)] == [one(s) for s in range(90)]
    assert [b(s) for s in range(10)] == [one(90 + s) for s in range(10)]
    assert b(0) == pytest.approx(10 / 90) and b(9) == pytest.approx(1 / 90)
    for bad, key in [
        ("phases[1].learning_rate=0.2", "phases[1].learning_rate"),
        ("phases[1].warmup=5", "phases[1].warmup"),
        ("phases[1].decay=poly", "phases[1].decay"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(key)):
            load_config(PretrainConfig, None, [*_CONTINUOUS, bad])


_CONTINUOUS = [
    "schedule=continuous",
    "phases=[{name: a, max_steps: 90, warmup: 10, learning_rate: 0.1},"
    " {name: b, max_steps: 10, warmup: 0, learning_rate: 0.1}]",
]


def _reference_lamb_step(p: torch.Tensor, g: torch.Tensor, lr: float, wd: float) -> torch.Tensor:
    """The first step of apex's FusedLAMB (multi_tensor_lamb.cu, adam_w_mode, bias correction,
    grad averaging, no use_nvlamb): m_hat = g, v_hat = g^2; the trust ratio only where the
    weight decay is non-zero, and no cap."""
    m = 0.1 * g
    v = 0.001 * g * g
    update = (m / 0.1) / ((v / 0.001).sqrt() + 1e-6) + wd * p
    use_ratio = wd != 0 and p.norm() > 0 and update.norm() > 0
    ratio = p.norm() / update.norm() if use_ratio else torch.tensor(1.0)
    return p - lr * ratio * update


def test_lamb_trust_ratio_is_per_tensor() -> None:
    torch.manual_seed(0)
    model = Tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(torch.randn(4, 6)).square().sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt = Lamb(param_groups(model, 0.01), lr=0.1, betas=(0.9, 0.999), eps=1e-6)
    opt.step()
    for name, param in model.named_parameters():
        wd = 0.0 if param.ndim < 2 or "LayerNorm" in name else 0.01
        want = _reference_lamb_step(before[name], grads[name], 0.1, wd)
        assert torch.allclose(param.detach(), want, atol=1e-6), name
    decayed = param_groups(model, 0.01)[0]["params"]
    ratios = [float(opt.state[p]["trust_ratio"]) for p in decayed]
    assert len(set(round(r, 6) for r in ratios)) == len(ratios)  # one ratio per tensor
    assert all(
        float(opt.state[p]["trust_ratio"]) == 1.0 for p in param_groups(model, 0.01)[1]["params"]
    )
    stats = opt.trust_ratio_stats()  # of the tensors that take a ratio
    assert stats == pytest.approx(
        {"min": min(ratios), "mean": sum(ratios) / len(ratios), "max": max(ratios)}
    )


def _per_tensor_lamb(
    weights: list[torch.Tensor],
    grads_per_step: list[list[torch.Tensor | None]],
    lr: float,
    wd: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    max_ratio: float | None = None,
    trust_all: bool = False,
) -> tuple[list[torch.Tensor], list[float]]:
    """LAMB written out one tensor at a time (the algorithm, not our code): the weights after
    all steps and the trust ratios of the last one."""
    beta1, beta2 = betas
    weights = [w.clone() for w in weights]
    moments: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
    ratios: list[float] = []
    for grads in grads_per_step:
        ratios = []
        for i, g in enumerate(grads):
            if g is None:  # no gradient: no update, no step counted
                continue
            t, m, v = moments.get(i, (0, torch.zeros_like(g), torch.zeros_like(g)))
            t, m, v = t + 1, beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
            moments[i] = (t, m, v)
            m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
            update = m_hat / (v_hat.sqrt() + eps) + wd * weights[i]
            w_norm, u_norm = weights[i].norm(), update.norm()
            ratio = 1.0
            if (wd != 0 or trust_all) and w_norm > 0 and u_norm > 0:
                ratio = float(w_norm / u_norm)
                ratio = ratio if max_ratio is None else min(ratio, max_ratio)
            weights[i] = weights[i] - lr * ratio * update
            ratios.append(ratio)
    return weights, ratios


@pytest.mark.parametrize(("wd", "trust_all"), [(0.0, True), (0.1, False), (0.0, False)])
def test_lamb_foreach_step_matches_a_per_tensor_loop(wd: float, trust_all: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2), (6,), (4, 4)]
    weights = [torch.randn(s, generator=gen) for s in shapes]
    weights[3] = torch.zeros(6)  # a zero norm: ratio 1 until it moves (and with wd off)
    weights[4] = weights[4] * 100.0  # a large norm: the ratio is clamped
    grads_per_step: list[list[torch.Tensor | None]] = [
        [torch.randn(s, generator=gen) for s in shapes] for _ in range(4)
    ]
    grads_per_step[2][1] = None  # one tensor skips a step: its own step count and moments
    params = [nn.Parameter(w.clone()) for w in weights]
    group = {"params": params, "weight_decay": wd}
    opt = Lamb([group], lr=0.05, max_trust_ratio=5.0, trust_all=trust_all)
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = None if g is None else g.clone()
        opt.step()
    want, want_ratios = _per_tensor_lamb(
        weights, grads_per_step, 0.05, wd, max_ratio=5.0, trust_all=trust_all
    )
    for i, (p, w) in enumerate(zip(params, want, strict=True)):
        assert torch.allclose(p.detach(), w, rtol=1e-5, atol=1e-6), i
    assert [float(opt.state[p]["trust_ratio"]) for p in params] == pytest.approx(want_ratios)
    assert [opt.state[p]["step"] for p in params] == [4, 3, 4, 4, 4]
    if wd or trust_all:
        assert 5.0 in want_ratios  # the cap was exercised
        assert opt.trust_ratio_stats()["max"] == pytest.approx(5.0)
    else:  # no decay: a plain Adam step, and no ratios to report
        assert set(want_ratios) == {1.0} and opt.trust_ratio_stats() == {}


def test_lamb_groups_by_dtype_and_casts_updates() -> None:
    """fp32 and bf16 parameters in one group step as if each were alone (one foreach pass per
    dtype); the bf16 one gets its update cast to bf16, its moments stay fp32."""
    torch.manual_seed(0)
    a, b = torch.randn(5, 3), torch.randn(4).bfloat16()
    ga, gb = torch.randn(5, 3), torch.randn(4).bfloat16()
    mixed = [nn.Parameter(a.clone()), nn.Parameter(b.clone())]
    alone = [nn.Parameter(a.clone()), nn.Parameter(b.clone())]
    for p, g in zip(mixed + alone, [ga, gb, ga, gb], strict=True):
        p.grad = g.clone()
    opt = Lamb(mixed, lr=0.1)
    opt.step()
    for p in alone:
        Lamb([p], lr=0.1).step()
    for mine, theirs in zip(mixed, alone, strict=True):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)
    assert opt.state[mixed[1]]["exp_avg"].dtype == torch.float32
    assert Lamb(Tiny().parameters()).trust_ratio_stats() == {}  # no step yet


def _build(
    monkeypatch: pytest.MonkeyPatch, *, cuda: bool = False, offload: bool = False, **kw: object
) -> torch.optim.Optimizer:
    """build_optimizer on a CPU model, as if CUDA were (not) available; DeepSpeed's optimizers
    are stand-ins that record their class, so nothing JIT-compiles."""
    import deepspeed.ops.adam

    class FakeFusedAdam(torch.optim.AdamW):
        def __init__(self, params: object, adam_w_mode: bool, **kwargs: object) -> None:
            super().__init__(params, **kwargs)  # type: ignore[arg-type]

    class FakeCPUAdam(torch.optim.AdamW):
        def __init__(self, params: object, adamw_mode: bool, **kwargs: object) -> None:
            super().__init__(params, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(deepspeed.ops.adam, "FusedAdam", FakeFusedAdam, raising=False)
    monkeypatch.setattr(deepspeed.ops.adam, "DeepSpeedCPUAdam", FakeCPUAdam, raising=False)
    return build_optimizer(Tiny(), OptimizerConfig(**kw), 1e-3, offload=offload)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fused", "cuda", "want"),
    [
        ("auto", False, "foreach"),
        ("auto", True, "torch-fused"),  # the model moves to the GPU in deepspeed.initialize
        ("torch", False, "torch-fused"),  # torch >= 2.4 fuses on the CPU too
        ("torch", True, "torch-fused"),
        ("none", True, "foreach"),
        ("deepspeed", True, "FakeFusedAdam"),
    ],
)
def test_adamw_implementation_follows_fused(
    monkeypatch: pytest.MonkeyPatch, fused: str, cuda: bool, want: str
) -> None:
    opt = _build(monkeypatch, cuda=cuda, fused=fused)
    if want.startswith("Fake"):
        assert type(opt).__name__ == want
        return
    assert type(opt) is torch.optim.AdamW
    flags = {(g["fused"], g["foreach"]) for g in opt.param_groups}
    assert flags == ({(True, False)} if want == "torch-fused" else {(False, True)})
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]


def test_torch_fused_adamw_steps_on_the_cpu() -> None:
    """What ``fused=torch`` on a CPU machine runs: the same AdamW as foreach, within rounding."""
    torch.manual_seed(0)
    model = Tiny()
    twin = copy.deepcopy(model)
    for m in (model, twin):
        m(torch.ones(2, 6)).square().sum().backward()
    fused = build_optimizer(model, OptimizerConfig(fused="torch"), 1e-2, offload=False)
    plain = build_optimizer(twin, OptimizerConfig(fused="none"), 1e-2, offload=False)
    for _ in range(3):
        fused.step()
        plain.step()
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.allclose(mine, theirs, atol=1e-6)


def test_offload_and_lamb_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    assert type(_build(monkeypatch, offload=True)).__name__ == "FakeCPUAdam"
    assert type(_build(monkeypatch, offload=True, cuda=True)).__name__ == "FakeCPUAdam"
    for fused in ("torch", "deepspeed", "none"):
        with pytest.raises(ConfigError, match=r"optimizer\.fused.*offload_optimizer=cpu"):
            _build(monkeypatch, offload=True, fused=fused)
    with pytest.raises(ConfigError, match=r"'optimizer\.fused'.*needs CUDA.*use auto or torch"):
        _build(monkeypatch, cuda=False, fused="deepspeed")
    for fused in ("auto", "torch", "none"):  # LAMB has one implementation
        assert type(_build(monkeypatch, cuda=True, name="lamb", fused=fused)) is Lamb
    with pytest.raises(ConfigError, match=r"'optimizer\.fused'.*FusedLamb.*use fused=auto"):
        load_config(
            PretrainConfig,
            None,
            ["optimizer.name=lamb", "optimizer.fused=deepspeed", "zero.stage=0"],
        )


def _skip_unless_deepspeed_supports(precision: str) -> None:
    """Skip when DeepSpeed's accelerator refuses ``precision`` (its engine raises "Type fp16
    is not supported on your device"). Its CPU accelerator always allows bf16, and fp16 only
    where ``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: oneDNN's fp16 path, a CPU with
    AVX-512 FP16 or AVX-NE-CONVERT (Intel Sapphire Rapids and later), not e.g. AMD EPYC."""
    if precision == "fp32":
        return
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if precision == "fp16" and not accelerator.is_fp16_supported():
        why = (
            "oneDNN reports no fp16 support (needs AVX-512 FP16 or AVX-NE-CONVERT, "
            "torch.ops.mkldnn._is_mkldnn_fp16_supported() is False)"
            if accelerator.device_name() == "cpu"
            else "is_fp16_supported() is False"
        )
        pytest.skip(f"DeepSpeed's {accelerator.device_name()} accelerator refuses fp16: {why}")
    if precision == "bf16" and not accelerator.is_bf16_supported():
        pytest.skip(
            f"DeepSpeed's {accelerator.device_name()} accelerator refuses bf16: "
            "is_bf16_supported() is False"
        )


@pytest.mark.integration
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_lamb_under_deepspeed_stage0_keeps_per_layer_ratios(precision: str) -> None:
    """At ZeRO 0 DeepSpeed's mixed-precision wrapper keeps one fp32 master per parameter, so a
    client LAMB computes true per-layer trust ratios (ZeRO 1/2: test_lamb_zero.py)."""
    _skip_unless_deepspeed_supports(precision)
    import deepspeed

    from bertpipe.training.core.engine import init_distributed

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
    # every tensor takes a ratio, so that a flat buffer would show as one repeated ratio
    opt = Lamb(param_groups(model, 0.01), lr=0.1, eps=1e-6, trust_all=True)
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
    ratios = [float(s["trust_ratio"]) for s in opt.state.values()]
    assert len({round(r, 5) for r in ratios}) >= 4  # per tensor, not one for a flat buffer
    ref_opt = Lamb(param_groups(reference, 0.01), lr=0.1, eps=1e-6, trust_all=True)
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
