"""``bertpipe plan --fit``: the fastest configuration that fits, the recipe's global batch kept
exactly, written as a config that pretrain accepts; one line when nothing fits."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bertpipe.config import ConfigError, load_config
from bertpipe.training.plan.fit import NothingFitsError, fit, fitted_config
from bertpipe.training.plan.options import PlanOptions
from bertpipe.training.pretrain.config import PretrainConfig
from bertpipe.training.pretrain.phases import ds_config
from tests.cli_runner import run_cli
from tests.conftest import sqlite_uri

LAMB = "configs/pretrain-bert-large-lamb.yaml"
CLUSTERS = {  # (nodes, GPUs per node, GPU)
    "8x40GB": (1, 8, "a100-40g"),
    "8x80GB": (1, 8, "a100-80g"),
    "4x8x80GB": (4, 8, "a100-80g"),
}


def _recipe() -> PretrainConfig:
    return load_config(PretrainConfig, LAMB, ["tracking.enabled=false"])


@pytest.mark.parametrize("cluster", sorted(CLUSTERS))
def test_fit_keeps_the_recipes_global_batch_and_writes_a_config_pretrain_accepts(
    cluster: str, tmp_path: Path
) -> None:
    nodes, gpus, gpu = CLUSTERS[cluster]
    cfg = _recipe()
    options = PlanOptions(nodes=nodes, gpus_per_node=gpus, gpu=gpu)
    started = time.perf_counter()
    result = fit(cfg, options, {})
    assert time.perf_counter() - started < 1.0  # no trial jobs: arithmetic
    world = nodes * gpus
    assert result.world_size == world
    for choice, phase in zip(result.winner.phases, cfg.phases, strict=True):
        assert choice.micro_batch_size * choice.accumulation * world == phase.global_batch_size
        assert choice.memory_gib <= result.budget_gib
    # the runners-up are slower (or as fast with more memory)
    for other in result.runners_up:
        assert other.total_s >= result.winner.total_s
    # the written config: loads, keeps the recipe, and gives DeepSpeed the same batch
    path = tmp_path / "fit.yaml"
    done = run_cli(
        [
            "plan",
            "--config",
            LAMB,
            "--nodes",
            str(nodes),
            "--gpus-per-node",
            str(gpus),
            "--gpu",
            gpu,
            "--fit",
            "--write",
            str(path),
        ]
    )
    assert done.returncode == 0, done.stderr
    assert "winner: ZeRO" in done.stdout
    written = load_config(PretrainConfig, str(path), ["tracking.enabled=false"])
    assert written == fitted_config(cfg, result)
    assert written.optimizer == cfg.optimizer
    for phase, original, choice in zip(
        written.phases, cfg.phases, result.winner.phases, strict=True
    ):
        assert phase.global_batch_size == original.global_batch_size
        assert phase.max_steps == original.max_steps
        assert phase.learning_rate == original.learning_rate
        ds = ds_config(written, phase, world)
        assert ds["train_batch_size"] == original.global_batch_size
        assert ds["train_micro_batch_size_per_gpu"] == choice.micro_batch_size
        assert ds["gradient_accumulation_steps"] == choice.accumulation
        assert ds["zero_optimization"]["stage"] == result.winner.zero_stage
        assert written.planned[phase.name]["step_s"] == pytest.approx(choice.step_s, rel=1e-3)
    assert written.check_world(world) == {c.phase: c.accumulation for c in result.winner.phases}


def test_more_memory_allows_larger_micro_batches() -> None:
    cfg = _recipe()
    small = fit(cfg, PlanOptions(nodes=1, gpus_per_node=8, gpu="a100-40g"), {}).winner
    large = fit(cfg, PlanOptions(nodes=1, gpus_per_node=8, gpu="a100-80g"), {}).winner
    for a, b in zip(small.phases, large.phases, strict=True):
        assert b.micro_batch_size >= a.micro_batch_size
    assert large.total_s <= small.total_s


def test_nothing_fits_is_one_line_with_the_term_and_what_would() -> None:
    cfg = load_config(PretrainConfig, LAMB, ["tracking.enabled=false", "only_phase=phase2"])
    options = PlanOptions(nodes=1, gpus_per_node=1, gpu="a100-40g", gpu_memory_gib=8.0)
    with pytest.raises(NothingFitsError) as caught:
        fit(cfg, options, {})
    message = str(caught.value)
    assert "\n" not in message
    assert "phase2" in message and "largest term is" in message
    assert "would fit" in message
    done = run_cli(
        [
            "plan",
            "--config",
            LAMB,
            "only_phase=phase2",
            "--gpu",
            "a100-40g",
            "--gpu-memory-gb",
            "8",
            "--fit",
        ]
    )
    assert done.returncode != 0
    assert "nothing fits in 8 GiB" in done.stderr and "largest term" in done.stderr


def test_the_planned_section_is_validated() -> None:
    with pytest.raises(ConfigError):
        load_config(PretrainConfig, None, ["planned={phase1: {step_s: fast}}"])


@pytest.mark.integration
def test_a_written_config_pretrains_at_its_micro_batches_on_cpu(
    pretrain_shards: Path, tmp_path: Path
) -> None:
    """The 8x40 GB config as written, run for one step of each phase in one CPU process: the
    tiny model in place of BERT-Large (and fp32, the test shards), everything plan --fit
    chose unchanged (micro batch per phase, ZeRO stage, checkpointing, LAMB), the global
    batch cut to one micro batch of this one rank. The summary carries the plan's
    predictions beside what the run measured."""
    path = tmp_path / "fit.yaml"
    done = run_cli(
        ["plan", "--config", LAMB, "--gpus-per-node", "8", "--gpu", "a100-40g", "--fit",
         "--write", str(path)]
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    written = load_config(PretrainConfig, str(path), [])
    micro = [p.micro_batch_size for p in written.phases]
    overrides = [
        f"output={tmp_path / 'run'}",
        "model.preset=tiny",
        f"phases[0].data={pretrain_shards}/seq64",
        f"phases[1].data={pretrain_shards}/seq128",
        "precision=fp32",
        "data.num_workers=0",
        "log_every_steps=1",
        "eval.every_steps=0",
        "eval.max_batches=1",
        "checkpoint.every_steps=0",
        f"tracking.uri={sqlite_uri(tmp_path / 'mlflow.db')}",
    ]
    for i, m in enumerate(micro):
        overrides += [f"phases[{i}].global_batch_size={m}", f"phases[{i}].max_steps=1"]
    cfg = load_config(PretrainConfig, str(path), overrides)
    assert cfg.zero.stage == written.zero.stage and cfg.optimizer.name == "lamb"
    assert cfg.model.activation_checkpointing == written.model.activation_checkpointing
    done = run_cli(["pretrain", "--config", str(path), *overrides])
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.splitlines()[-1])
    for name in ("phase1", "phase2"):
        assert summary[name]["steps"] == 1
        measured = summary[name]["measured"]
        assert measured["planned_memory_gib"] == written.planned[name]["memory_gib"]
        assert measured["planned_budget_gib"] == written.planned[name]["budget_gib"]
        assert measured["step_s"] > 0 and measured["memory_rss_gb"] > 0
    # in MLflow: the prediction beside the measurement, at the step of each phase's log
    import mlflow

    from bertpipe.training import checkpoint as ckpt

    state, _ = ckpt.read_state(cfg.checkpoint_dir, ckpt.latest_tag(cfg.checkpoint_dir), 0)
    client = mlflow.MlflowClient(tracking_uri=cfg.tracking.uri)
    history = {
        key: [m.value for m in client.get_metric_history(state.mlflow_run_id, f"train/{key}")]
        for key in ("planned_memory_gib", "planned_step_s", "step_s", "memory_rss_gb")
    }
    assert history["planned_memory_gib"] == [
        written.planned[n]["memory_gib"] for n in written.planned
    ]
    assert history["planned_step_s"] == [written.planned[n]["step_s"] for n in written.planned]
    assert len(history["step_s"]) == len(history["memory_rss_gb"]) == 2
