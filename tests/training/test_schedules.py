"""The modern recipe's two training options beside the paper's: the warmup-stable-decay
learning-rate schedule (``decay: wsd``) and batch-size warmup (``batch_warmup_steps``).

The curve's values at known steps, its continuous stretch over phases, the config's one-line
errors; the batch ramp; DeepSpeed steps of a changing accumulation against plain torch; and a
real run with both, stopped in the middle of the batch warmup and resumed, against the
uninterrupted run, bit for bit."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from bertpipe.config import ConfigError, from_dict, load_config
from bertpipe.training.core.optim import param_groups
from bertpipe.training.core.schedules import warmup_stable_decay
from bertpipe.training.pretrain.config import PhaseSpec, PretrainConfig
from bertpipe.training.pretrain.phases import lr_lambda

# --------------------------------------------------------------------------- the curve


def test_wsd_warms_up_holds_the_peak_then_cools_down_linearly() -> None:
    """10 steps, warmup 2, cooldown 0.4 x 10 = 4 steps: updates 7-10 cool down; the rate after
    the last update is 0 (the linear decay's convention)."""
    phase = PhaseSpec(max_steps=10, warmup=2, decay="wsd", decay_fraction=0.4, decay_shape="linear")
    f = lr_lambda(phase)
    assert [f(step) for step in range(10)] == [0.5, 1, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25]
    assert f(10) == 0.0 and f(15) == 0.0  # after the last update, and past it (max_steps raised)


def test_wsd_one_minus_sqrt_cooldown_to_a_floor() -> None:
    """Hägele et al.'s 1-sqrt cooldown, ending at min_lr_ratio of the peak."""
    phase = PhaseSpec(max_steps=10, warmup=2, decay="wsd", decay_fraction=0.4, min_lr_ratio=0.1)
    f = lr_lambda(phase)
    floor = 0.1
    want = [0.5, 1, 1, 1, 1, 1, 1]
    want += [floor + (1 - floor) * (1 - math.sqrt(k / 4)) for k in (1, 2, 3, 4)]
    assert [f(step) for step in range(11)] == pytest.approx(want, rel=1e-15)
    assert f(7) == pytest.approx(0.55) and f(10) == pytest.approx(0.1)


def test_wsd_over_all_steps_without_warmup_is_the_papers_linear_decay() -> None:
    """The two conventions agree: a linear cooldown over every step is ``decay: linear``."""
    wsd = lr_lambda(
        PhaseSpec(max_steps=10, warmup=0, decay="wsd", decay_fraction=1.0, decay_shape="linear")
    )
    linear = lr_lambda(PhaseSpec(max_steps=10, warmup=0, decay="linear"))
    assert [wsd(s) for s in range(11)] == pytest.approx([linear(s) for s in range(11)], rel=1e-15)


def test_wsd_cooldown_length_rounds_and_is_at_least_one_step() -> None:
    assert PhaseSpec(max_steps=7038, decay="wsd", decay_fraction=0.1).cooldown_steps(7038) == 704
    assert PhaseSpec(max_steps=3, warmup=0, decay="wsd", decay_fraction=0.01).cooldown_steps(3) == 1
    with pytest.raises(ValueError, match="do not fit"):
        warmup_stable_decay(5, 10, 6)


_CONTINUOUS_WSD = [
    "schedule=continuous",
    "phases=[{name: a, max_steps: 90, warmup: 10, learning_rate: 0.1, decay: wsd,"
    " decay_fraction: 0.2},"
    " {name: b, max_steps: 10, warmup: 0, learning_rate: 0.1, decay: wsd, decay_fraction: 0.2}]",
]


def test_continuous_wsd_cools_down_over_the_last_steps_of_all_phases() -> None:
    cfg = load_config(PretrainConfig, None, _CONTINUOUS_WSD)
    one = lr_lambda(PhaseSpec(max_steps=100, warmup=10, decay="wsd", decay_fraction=0.2))
    a, b = (lr_lambda(p, cfg) for p in cfg.phases)
    assert [a(s) for s in range(90)] == [one(s) for s in range(90)]
    assert [b(s) for s in range(11)] == [one(90 + s) for s in range(11)]
    assert a(79) == 1.0 and a(80) == 1.0 and a(85) == pytest.approx(0.5)  # 1 - sqrt(5/20)
    assert b(10) == 0.0
    for bad in ("decay_fraction=0.3", "decay_shape=linear", "min_lr_ratio=0.1"):
        key = f"phases[1].{bad.split('=')[0]}"
        with pytest.raises(ConfigError, match=re.escape(key)):
            load_config(PretrainConfig, None, [*_CONTINUOUS_WSD, f"phases[1].{bad}"])
    # the cooldown is checked against all phases' steps, not phase 1's alone: 10 + 50 <= 100
    load_config(
        PretrainConfig,
        None,
        [*_CONTINUOUS_WSD, "phases[0].decay_fraction=0.5", "phases[1].decay_fraction=0.5"],
    )
    with pytest.raises(ConfigError, match=re.escape("phases[0].decay_fraction")):
        load_config(
            PretrainConfig,
            None,
            [*_CONTINUOUS_WSD, "phases[0].decay_fraction=0.95", "phases[1].decay_fraction=0.95"],
        )


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        (["decay=wsd", "decay_fraction=0"], "decay_fraction", "must be in (0, 1]"),
        (["decay=wsd", "decay_fraction=1.5"], "decay_fraction", "must be in (0, 1]"),
        (["decay=wsd", "warmup=0.5", "decay_fraction=0.6"], "decay_fraction", "overlaps"),
        (["decay=wsd", "decay_shape=cosine"], "decay_shape", "one of"),
        (["decay=wsd", "min_lr_ratio=-0.1"], "min_lr_ratio", "[0, 1]"),
        (["min_lr_ratio=0.1"], "min_lr_ratio", "applies to decay=wsd"),
        (["decay=wsd", "decay_from=start"], "decay_from", "decay_from=warmup"),
        (["batch_warmup_steps=-1"], "batch_warmup_steps", "at least 0"),
        (["batch_warmup_steps=11"], "batch_warmup_steps", "exceeds max_steps"),
        (["batch_warmup_start=4"], "batch_warmup_start", "batch_warmup_steps is 0"),
        (["batch_warmup_steps=4", "batch_warmup_start=1"], "batch_warmup_start", "between"),
        (["batch_warmup_steps=4", "batch_warmup_start=32"], "batch_warmup_start", "between"),
    ],
)
def test_config_errors_name_the_key(overrides: list[str], key: str, fragment: str) -> None:
    base = ["phases=[{name: p, max_steps: 10, micro_batch_size: 2, global_batch_size: 16}]"]
    with pytest.raises(ConfigError) as info:
        load_config(PretrainConfig, None, [*base, *(f"phases[0].{o}" for o in overrides)])
    assert info.value.key == f"phases[0].{key}" and fragment in str(info.value)
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- the batch ramp


def test_batch_grows_linearly_in_whole_micro_batches_per_rank() -> None:
    phase = PhaseSpec(
        max_steps=10,
        micro_batch_size=2,
        global_batch_size=16,
        batch_warmup_steps=4,
        batch_warmup_start=4,
    )
    # one rank: 2 -> 8 micro-batches, a0 + 6 (s - 1) // 4 for steps 1-4, then 8
    assert [phase.global_batch_at(s, 1) for s in range(1, 8)] == [4, 6, 10, 12, 16, 16, 16]
    # two ranks: the batch moves in steps of micro x world = 4
    assert [phase.accumulation_at(s, 2) for s in range(1, 7)] == [1, 1, 2, 3, 4, 4]
    assert [phase.global_batch_at(s, 2) for s in range(1, 7)] == [4, 4, 8, 12, 16, 16]
    # null start: one micro-batch per rank
    null = PhaseSpec(max_steps=10, micro_batch_size=2, global_batch_size=16, batch_warmup_steps=2)
    assert [null.global_batch_at(s, 1) for s in (1, 2, 3)] == [2, 8, 16]
    # off (the default): the full batch at every step
    plain = PhaseSpec(max_steps=10, micro_batch_size=2, global_batch_size=16)
    assert {plain.accumulation_at(s, 1) for s in range(1, 11)} == {8}
    cfg = from_dict(
        PretrainConfig,
        {
            "phases": [
                {
                    "name": "p",
                    "max_steps": 10,
                    "micro_batch_size": 2,
                    "global_batch_size": 16,
                    "batch_warmup_steps": 4,
                    "batch_warmup_start": 6,
                }
            ]
        },
    )
    assert cfg.check_world(1) == {"p": 8}
    with pytest.raises(ConfigError) as info:
        cfg.check_world(2)  # 6 is not a multiple of 2 x 2
    assert info.value.key == "phases[0].batch_warmup_start" and "2 x 2 = 4" in str(info.value)


def test_plan_takes_the_new_options() -> None:
    """``bertpipe plan`` plans the full batch (its memory and step time) and the wsd phase."""
    from bertpipe.training.plan.options import PlanOptions
    from bertpipe.training.plan.plan import make_plan

    cfg = from_dict(
        PretrainConfig,
        {
            "model": {"preset": "tiny"},
            "phases": [
                {
                    "name": "p",
                    "data": "/nonexistent/seq128",
                    "max_steps": 100,
                    "micro_batch_size": 4,
                    "global_batch_size": 64,
                    "warmup": 0.1,
                    "decay": "wsd",
                    "batch_warmup_steps": 20,
                    "batch_warmup_start": 16,
                }
            ],
        },
    )
    (phase,) = make_plan(cfg, PlanOptions(nodes=1, gpus_per_node=4)).phases
    assert (phase.accumulation, phase.global_batch_size, phase.warmup_steps) == (4, 64, 10)


# --------------------------------------------------------------------------- DeepSpeed steps


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.b = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        out = self.b(torch.tanh(self.a(x))).squeeze(-1)
        return SimpleNamespace(loss=nn.functional.mse_loss(out, y))


@pytest.mark.integration
@pytest.mark.parametrize("stage", [0, 2])
def test_steps_of_a_growing_batch_equal_plain_torch(stage: int) -> None:
    """An engine built for 3 micro-batches per step takes steps of 1, 2, 3 and 3 (then 1
    again): each update is AdamW's on the mean gradient of exactly that step's micro-batches,
    as plain torch computes it. (DeepSpeed's own boundary, its micro-batch count modulo the
    accumulation, would step after the wrong micro-batch once the count changed.)"""
    import copy

    from bertpipe.training.core.engine import build_engine, init_distributed
    from bertpipe.training.core.step import OptimizerStep
    from bertpipe.training.pretrain.phases import phase_engine

    init_distributed()
    cfg = load_config(
        PretrainConfig,
        None,
        [
            "precision=fp32",
            f"zero.stage={stage}",
            "optimizer.max_grad_norm=0",
            "phases=[{name: p, max_steps: 10, micro_batch_size: 2, global_batch_size: 6,"
            " learning_rate: 0.05, warmup: 0, batch_warmup_steps: 3}]",
        ],
    )
    torch.manual_seed(0)
    model = _Net()
    reference = copy.deepcopy(model)
    engine, _ = build_engine(model, phase_engine(cfg, cfg.phases[0], 1))
    opt = cfg.optimizer
    ref_opt = torch.optim.AdamW(
        param_groups(reference, opt.weight_decay),
        lr=0.05,
        betas=opt.betas,
        eps=opt.eps,
        foreach=True,
    )
    gen = torch.Generator().manual_seed(1)
    step = OptimizerStep(engine, cfg.check_world(1)["p"])
    for n, count in enumerate([1, 2, 3, 3, 1], start=1):
        micro = [
            {"x": torch.randn(2, 7, generator=gen), "y": torch.randn(2, generator=gen)}
            for _ in range(count)
        ]
        result = step(n, iter(micro), accumulation=count)
        assert result.micro_batches == count and not result.skipped
        assert engine.train_batch_size() == 2 * count
        for group in ref_opt.param_groups:
            group["lr"] = result.lr
        ref_opt.zero_grad()
        for batch in micro:
            (reference(**batch).loss / count).backward()
        ref_opt.step()
        for (name, mine), theirs in zip(
            model.named_parameters(), reference.parameters(), strict=True
        ):
            assert torch.allclose(mine.detach(), theirs.detach(), rtol=1e-5, atol=1e-6), (n, name)
    assert engine.global_steps == 5


# --------------------------------------------------------------------------- a real run


_FAMILIES = {
    "bert": [],
    # the data's 64-token sequences exceed the window: local and global layers differ
    "modernbert": ["model.family=modernbert", "model.local_attention=16"],
}


def _run_config(shards: Path, out: Path, uri: str, family: str) -> PretrainConfig:
    """6 steps of micro-batches of 2: the batch grows 2, 2, 4, 6 then 8 (steps 5-6); warmup 1
    step, then the peak, and a 1-sqrt cooldown over the last 3 steps."""
    return load_config(
        PretrainConfig,
        None,
        [
            f"output={out}",
            "model.preset=tiny",
            *_FAMILIES[family],
            "model.max_position_embeddings=64",
            f"phases=[{{name: phase1, data: {shards}/seq64, max_steps: 6, micro_batch_size: 2,"
            " global_batch_size: 8, batch_warmup_steps: 4, batch_warmup_start: 2,"
            " learning_rate: 2.0e-3, warmup: 1, decay: wsd, decay_fraction: 0.5}]",
            "precision=fp32",
            "zero.stage=1",
            "data.num_workers=0",
            "log_every_steps=1",
            "checkpoint.every_steps=3",
            "checkpoint.keep_last=3",
            "eval.max_batches=1",
            f"tracking.uri={uri}",
            "tracking.experiment=schedule-tests",
        ],
    )


@pytest.mark.integration
@pytest.mark.parametrize("family", sorted(_FAMILIES))
def test_wsd_and_batch_warmup_resume_mid_warmup_exactly(
    pretrain_shards: Path, tmp_path: Path, family: str
) -> None:
    """Both model families: the run logs each step's global batch and the wsd rate; stopped
    after step 3 (in the middle of the batch warmup) and resumed, steps 4-6 give the
    uninterrupted run's losses bit for bit, and the data position counts every micro-batch
    taken."""
    import mlflow

    from bertpipe.training import checkpoint as ckpt
    from bertpipe.training.pretrain.trainer import run_pretraining
    from tests.conftest import sqlite_uri

    uri = sqlite_uri(tmp_path / "mlflow.db")
    cfg = _run_config(pretrain_shards, tmp_path / "run", uri, family)
    run_pretraining(cfg)
    folder = Path(cfg.checkpoint_dir)
    state, _ = ckpt.read_state(str(folder), ckpt.latest_tag(str(folder)), 0)
    client = mlflow.MlflowClient(tracking_uri=uri)

    def history(key: str) -> list[tuple[int, float]]:
        return sorted(
            (m.step, m.value) for m in client.get_metric_history(state.mlflow_run_id, key)
        )

    assert [v for _, v in history("train/global_batch_size")] == [2, 2, 4, 6, 8, 8]
    assert state.samples_seen == 30  # one rank: the sequences of all six steps
    assert state.data == {"epoch": 0, "batches": 15}  # the micro-batches of all six steps
    peak, shape = 2.0e-3, [1, 1, 1, 1, 1 - math.sqrt(1 / 3), 1 - math.sqrt(2 / 3)]
    assert [v for _, v in history("train/lr")] == pytest.approx([peak * m for m in shape])
    losses = history("train/loss")
    assert len(losses) == 6 and all(math.isfinite(v) for _, v in losses)

    # as if the run had died after step 3: back to that checkpoint, and the same command
    shutil.rmtree(folder / "global_step6")
    (folder / "latest").write_text("global_step3")
    run_pretraining(_run_config(pretrain_shards, tmp_path / "run", uri, family))
    again = [v for s, v in history("train/loss") if s > 3]
    assert len(again) == 6 and again[0::2] == again[1::2]  # steps 4-6 twice, bit-exact
    batches = [v for s, v in history("train/global_batch_size") if s > 3]
    assert batches == [6, 6, 8, 8, 8, 8]
