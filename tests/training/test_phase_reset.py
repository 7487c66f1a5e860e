"""``reset_step_counters``: NVIDIA's phase-2 step reset (DeepLearningExamples'
run_pretraining.py sets the optimizer's step to 0 before loading phase 1's state; apex's
FusedLAMB bias-corrects with ``1 - beta ** step``). After k steps and a reset, the next update
must be apex's formula with the bias correction of step 1 on the kept moments: our LAMB and
torch's AdamW, alone and inside a real DeepSpeed engine at ZeRO 1 that loaded the previous
phase's checkpoint as the trainer does."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from bertpipe.config import load_config
from bertpipe.training.core.config import OptimizerConfig
from bertpipe.training.core.optim import (
    Lamb,
    build_optimizer,
    client_optimizer,
    param_groups,
    reset_step_counters,
    zero_partitions,
)
from bertpipe.training.pretrain.config import PretrainConfig

BETAS = (0.9, 0.999)
EPS = 1e-6


class Net(nn.Module):
    """Odd sizes: ZeRO's alignment padding and round-robin order are exercised."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.LayerNorm = nn.LayerNorm(5)
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.LayerNorm(self.a(x))))


def _decays(name: str, param: torch.Tensor) -> bool:
    return param.ndim >= 2 and "LayerNorm" not in name


def _expected(
    kind: str,
    w: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: int,
    lr: float,
    wd: float,
) -> torch.Tensor:
    """One update written out (float64) from the moments before it: apex's ``multi_tensor_lamb``
    (adam_w_mode, grad averaging, bias correction ``1 - beta ** step``; the trust ratio only
    with weight decay) or torch's AdamW."""
    w, g, m, v = (t.double() for t in (w, g, m, v))
    beta1, beta2 = BETAS
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat, v_hat = m / (1 - beta1**step), v / (1 - beta2**step)
    adam = m_hat / (v_hat.sqrt() + EPS)
    if kind == "adamw":
        return w * (1 - lr * wd) - lr * adam
    update = adam + wd * w
    ratio = 1.0
    if wd and w.norm() > 0 and update.norm() > 0:
        ratio = float(w.norm() / update.norm())
    return w - lr * ratio * update


def _check_update(
    got: torch.Tensor, before: torch.Tensor, want: torch.Tensor, unreset: torch.Tensor, name: str
) -> None:
    """The update made (``got - before``) is ``want``'s to rounding (relative 1e-5), and
    measurably not ``unreset``'s: for a tensor with a LAMB trust ratio the bias correction
    moves only the share of weight decay in the direction (0.2% here), elsewhere ~45%."""
    made, wanted, other = got.double() - before, want - before, unreset - before
    assert float((made - wanted).norm() / wanted.norm()) < 1e-5, name
    assert float((other - wanted).norm() / wanted.norm()) > 1e-3, name


def _set_grads(model: nn.Module, gen: torch.Generator) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        p.grad = torch.randn(p.shape, generator=gen)
        grads[name] = p.grad.clone()
    return grads


def _optimizer(kind: str, model: nn.Module, fused: str = "none") -> torch.optim.Optimizer:
    cfg = OptimizerConfig(name=kind, betas=BETAS, eps=EPS, weight_decay=0.01, fused=fused)  # type: ignore[arg-type]
    return build_optimizer(model, cfg, 0.05, offload=False)


@pytest.mark.parametrize(
    ("kind", "fused"), [("lamb", "none"), ("adamw", "none"), ("adamw", "torch")]
)
def test_after_a_reset_the_update_is_bias_corrected_as_step_one(kind: str, fused: str) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = Net()
    opt = _optimizer(kind, model, fused)
    k = 4
    for _ in range(k):
        _set_grads(model, gen)
        opt.step()
    params = dict(model.named_parameters())
    counters = {n: opt.state[p]["step"] for n, p in params.items()}
    if kind == "adamw":  # tensors: zeroed in place, dtype and device kept
        assert all(isinstance(c, torch.Tensor) and float(c) == k for c in counters.values())
    else:
        assert set(counters.values()) == {k}
    kept = {
        n: (opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
        for n, p in params.items()
    }
    before = {n: p.detach().clone() for n, p in params.items()}

    assert reset_step_counters(opt) == len(params)

    for name, p in params.items():
        step = opt.state[p]["step"]
        if kind == "adamw":
            assert step is counters[name] and float(step) == 0
            assert step.dtype == counters[name].dtype and step.device == counters[name].device
        else:
            assert type(step) is int and step == 0
        assert torch.equal(opt.state[p]["exp_avg"], kept[name][0])  # moments kept
    grads = _set_grads(model, gen)
    opt.step()
    for name, p in params.items():
        wd = 0.01 if _decays(name, p) else 0.0
        args = (before[name], grads[name], *kept[name])
        want = _expected(kind, *args, step=1, lr=0.05, wd=wd)
        unreset = _expected(kind, *args, step=k + 1, lr=0.05, wd=wd)  # the count continued
        _check_update(p.detach(), before[name].double(), want, unreset, name)
        assert float(opt.state[p]["step"]) == 1


def test_reset_follows_wrappers_and_per_group_counters() -> None:
    """DeepSpeed's wrappers (engine, ZeRO, BF16/FP16 optimizers) hold the client optimizer
    in ``.optimizer``; apex-style optimizers count per group (int or tensor)."""

    class Wrapper:
        def __init__(self, inner: object) -> None:
            self.optimizer = inner

    model = Net()
    opt = Lamb(param_groups(model, 0.01), lr=0.1)
    _set_grads(model, torch.Generator().manual_seed(0))
    opt.step()
    opt.step()
    opt.param_groups[0]["step"] = 2
    opt.param_groups[1]["step"] = torch.tensor([2], dtype=torch.int32)
    wrapped = Wrapper(Wrapper(opt))
    assert client_optimizer(wrapped) is opt and client_optimizer(opt) is opt
    assert reset_step_counters(wrapped) == len(list(model.parameters()))
    assert {s["step"] for s in opt.state.values()} == {0}
    assert opt.param_groups[0]["step"] == 0 and type(opt.param_groups[0]["step"]) is int
    assert opt.param_groups[1]["step"].dtype == torch.int32
    assert opt.param_groups[1]["step"].tolist() == [0]
    assert reset_step_counters(Lamb(Net().parameters())) == 0  # nothing stepped yet
    with pytest.raises(TypeError, match="holds no torch optimizer"):
        reset_step_counters(Wrapper(object()))
    loop = Wrapper(None)
    loop.optimizer = loop
    with pytest.raises(TypeError):
        client_optimizer(loop)


def _config(kind: str, stage: int, precision: str = "fp32") -> PretrainConfig:
    phase = "micro_batch_size: 4, global_batch_size: 4, learning_rate: 0.02, warmup: 0"
    return load_config(
        PretrainConfig,
        None,
        [
            f"precision={precision}",
            f"zero.stage={stage}",
            f"optimizer.name={kind}",
            "optimizer.weight_decay=0.01",
            "optimizer.max_grad_norm=0",  # DeepSpeed would clip; the hand computation does not
            "optimizer.reset_step_per_phase=true",
            f"phases=[{{name: p1, max_steps: 3, {phase}}},"
            f" {{name: p2, max_steps: 3, optimizer_state: keep, {phase}}}]",
        ],
    )


def _loss(module: object, x: torch.Tensor) -> torch.Tensor:
    return module(x).float().square().mean()  # type: ignore[operator]


def _train(
    engine: object, steps: int, gen: torch.Generator, dtype: torch.dtype = torch.float32
) -> None:
    for _ in range(steps):
        loss = _loss(engine, torch.randn(4, 7, generator=gen).to(dtype))
        engine.backward(loss)  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["lamb", "adamw"])
def test_zero1_phase_two_restarts_bias_correction_on_phase_one_moments(
    tmp_path: Path, kind: str
) -> None:
    """Phase 1 trains 3 steps at ZeRO 1 and saves; phase 2 builds a new engine, loads that
    checkpoint with its optimizer state (as the trainer does for ``optimizer_state: keep``),
    resets the counters through DeepSpeed's ZeRO optimizer, and its first update is step 1's
    on the kept moments of the flat fp32 partition."""
    from bertpipe.training.core.engine import build_engine, init_distributed
    from bertpipe.training.pretrain.phases import phase_engine

    init_distributed()
    cfg = _config(kind, stage=1)
    gen = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    first = Net()
    engine1, _ = build_engine(first, phase_engine(cfg, cfg.phases[0], 1))
    _train(engine1, 3, gen)
    engine1.save_checkpoint(str(tmp_path), tag="phase1")
    saved_moments = [
        client_optimizer(engine1.optimizer).state[flat]["exp_avg"].clone()
        for flat in engine1.optimizer.single_partition_of_fp32_groups
    ]

    torch.manual_seed(1)  # other initial weights: the checkpoint's must replace them
    model = Net()
    engine, _ = build_engine(model, phase_engine(cfg, cfg.phases[1], 1))
    engine.load_checkpoint(
        str(tmp_path),
        tag="phase1",
        load_optimizer_states=True,
        load_lr_scheduler_states=False,
        load_module_only=False,
    )
    scheduler = engine.lr_scheduler  # the loaded groups hold phase 1's last rate (0 here)
    for group, base in zip(engine.optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = base * scheduler.lr_lambdas[0](0)
    inner = client_optimizer(engine.optimizer)
    assert isinstance(inner, Lamb if kind == "lamb" else torch.optim.AdamW)
    flats = list(engine.optimizer.single_partition_of_fp32_groups)
    assert [float(inner.state[f]["step"]) for f in flats] == [3.0, 3.0]
    for flat, moments in zip(flats, saved_moments, strict=True):
        assert torch.equal(inner.state[flat]["exp_avg"], moments)  # phase 1's moments

    assert reset_step_counters(engine.optimizer) == len(flats)
    assert [float(inner.state[f]["step"]) for f in flats] == [0.0, 0.0]

    names = {id(p): n for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    kept = [
        (inner.state[f]["exp_avg"].clone(), inner.state[f]["exp_avg_sq"].clone()) for f in flats
    ]
    lrs = [group["lr"] for group in inner.param_groups]
    assert lrs == [0.02, 0.02]
    x = torch.randn(4, 7, generator=gen)
    twin = copy.deepcopy(model)  # the gradient of this batch at these weights
    _loss(twin, x).backward()
    grads = {n: p.grad for n, p in twin.named_parameters()}
    engine.backward(_loss(engine, x))
    engine.step()
    assert [float(inner.state[f]["step"]) for f in flats] == [1.0, 1.0]

    checked = 0
    for i, (_, part) in enumerate(zero_partitions(engine.optimizer)):
        tensors = engine.optimizer.round_robin_bit16_groups[i]
        assert len(part.segments) == len(tensors)  # one rank: it holds every tensor
        m, v = kept[i]
        for tensor, (a, b) in zip(tensors, part.segments, strict=True):
            name = names[id(tensor)]
            shape = before[name].shape
            wd = inner.param_groups[i]["weight_decay"]
            assert wd == (0.01 if _decays(name, tensor) else 0.0)
            args = (before[name], grads[name], m[a:b].view(shape), v[a:b].view(shape))
            want = _expected(kind, *args, step=1, lr=lrs[i], wd=wd)
            unreset = _expected(kind, *args, step=4, lr=lrs[i], wd=wd)
            got = dict(model.named_parameters())[name].detach()
            _check_update(got, before[name].double(), want, unreset, name)
            checked += 1
    assert checked == len(before)


@pytest.mark.integration
def test_reset_reaches_lamb_inside_the_stage0_bf16_wrapper() -> None:
    """ZeRO 0 with bf16: DeepSpeed wraps the client LAMB in its unfused mixed-precision
    optimizer, which holds it in ``.optimizer``."""
    from bertpipe.training.core.engine import build_engine, init_distributed
    from bertpipe.training.pretrain.phases import phase_engine

    init_distributed()
    cfg = _config("lamb", stage=0, precision="bf16")
    model = Net()
    engine, _ = build_engine(model, phase_engine(cfg, cfg.phases[0], 1))
    _train(engine, 2, torch.Generator().manual_seed(0), torch.bfloat16)
    inner = client_optimizer(engine.optimizer)
    assert isinstance(inner, Lamb) and engine.optimizer is not inner
    # 3, not 2: the wrapper takes one step with zero gradients when it is built
    assert {s["step"] for s in inner.state.values()} == {3}
    assert reset_step_counters(engine.optimizer) == len(list(model.parameters()))
    assert {s["step"] for s in inner.state.values()} == {0}
