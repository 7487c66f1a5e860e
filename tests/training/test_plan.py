"""``bertpipe plan``: parameter count, ZeRO memory arithmetic, activations, batch arithmetic,
data per rank, time, and the command line (JSON and table, manifest present or not)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import bertpipe.app.cli
from bertpipe.config import ConfigError, from_dict
from bertpipe.errors import BertpipeError
from bertpipe.formatting import format_hmm
from bertpipe.training.models.bert.model import BertLayer, BertModelConfig
from bertpipe.training.models.flops import peak_flops, training_flops_per_sequence
from bertpipe.training.plan.data import data_plan, read_manifest
from bertpipe.training.plan.memory import (
    GIB,
    activation_bytes,
    buffer_bytes,
    estimate_memory,
    model_state_bytes,
)
from bertpipe.training.plan.options import PlanOptions
from bertpipe.training.plan.plan import make_plan
from bertpipe.training.plan.time import comm_bytes_per_step, comm_passes_per_step, step_time
from bertpipe.training.plan.world import resolve_world
from bertpipe.training.pretrain.config import PretrainConfig
from bertpipe.training.pretrain.data.loader import partition_blocks


def tiny_model(**overrides: Any) -> BertModelConfig:
    fields: dict[str, Any] = {"vocab_size": 1003, "hidden_size": 32, "num_layers": 2}
    fields |= {"num_heads": 4, "intermediate_size": 128, "max_position_embeddings": 512}
    return BertModelConfig(**{**fields, **overrides})


def pretrain_config(**data: Any) -> PretrainConfig:
    base: dict[str, Any] = {
        "model": {"preset": "tiny"},
        "phases": [
            {"name": "phase1", "data": "/nonexistent/seq128", "max_steps": 100,
             "micro_batch_size": 4, "global_batch_size": 64, "warmup": 0.1},
            {"name": "phase2", "data": "/nonexistent/seq512", "max_steps": 20,
             "micro_batch_size": 2, "global_batch_size": 32, "warmup": 2},
        ],
    }  # fmt: skip
    return from_dict(PretrainConfig, {**base, **data})


# --------------------------------------------------------------------------- parameters, memory


def test_bert_large_parameter_count() -> None:
    cfg = BertModelConfig.preset("large", 30522)
    assert 335e6 <= cfg.num_parameters() <= 340e6


def test_stage0_mixed_precision_adam_is_16_bytes_per_parameter() -> None:
    cfg = BertModelConfig.preset("large", 30522)
    psi = cfg.num_parameters()
    params, grads, optim, host = model_state_bytes(psi, "bf16", 0, 8, offload=False)
    assert (params, grads, optim, host) == (2 * psi, 2 * psi, 12 * psi, 0)
    mem = estimate_memory(
        cfg,
        precision="bf16",
        zero_stage=0,
        world_size=8,
        offload=False,
        seq_len=128,
        micro_batch=8,
        num_masked=20,
        bucket_size=50_000_000,
        cuda_overhead_bytes=GIB,
        capacity_bytes=80 * GIB,
    )
    states = mem.total - mem.activations - mem.buffers - mem.cuda_overhead
    assert states == 16 * psi
    assert mem.activations > 0 and mem.fits is True
    assert mem.buffers == psi * 2  # stage 0 flattens all gradients (< 5e8) for the all-reduce
    assert buffer_bytes(psi, "bf16", 2, 50_000_000) == 2 * 50_000_000 * 2
    assert buffer_bytes(10**9, "fp32", 0, 1000) == 5 * 10**8 * 4


def test_fp32_states_are_4_4_8() -> None:
    assert model_state_bytes(1000, "fp32", 0, 1, offload=False) == (4000, 4000, 8000, 0)


@pytest.mark.parametrize("world", [1, 3, 4, 7])
def test_zero_stages_partition_exactly(world: int) -> None:
    psi = tiny_model().num_parameters()
    shard = math.ceil(psi / world)
    assert model_state_bytes(psi, "bf16", 0, world, False) == (2 * psi, 2 * psi, 12 * psi, 0)
    assert model_state_bytes(psi, "bf16", 1, world, False) == (2 * psi, 2 * psi, 12 * shard, 0)
    assert model_state_bytes(psi, "bf16", 2, world, False) == (2 * psi, 2 * shard, 12 * shard, 0)
    assert model_state_bytes(psi, "bf16", 3, world, False) == (
        2 * shard,
        2 * shard,
        12 * shard,
        0,
    )


def test_offload_moves_optimizer_states_off_the_gpu() -> None:
    cfg = tiny_model()
    psi = cfg.num_parameters()
    common: dict[str, Any] = {
        "precision": "bf16",
        "zero_stage": 2,
        "world_size": 4,
        "seq_len": 64,
        "micro_batch": 2,
        "num_masked": 10,
        "bucket_size": 1000,
        "cuda_overhead_bytes": 0,
        "capacity_bytes": None,
    }
    on_gpu = estimate_memory(cfg, offload=False, **common)
    offloaded = estimate_memory(cfg, offload=True, **common)
    moved = 12 * math.ceil(psi / 4)
    assert on_gpu.optimizer_states == moved and on_gpu.host_optimizer_states == 0
    assert offloaded.optimizer_states == 0 and offloaded.host_optimizer_states == moved
    assert on_gpu.total - offloaded.total == moved
    assert offloaded.fits is None


def test_activation_formula() -> None:
    cfg = tiny_model()  # h=32, I=4h, a=4, L=2, V=1008
    s, b, h, a = 64, 2, 32, 4
    act = activation_bytes(cfg, s, b, num_masked=10, precision="bf16", checkpointing=False)
    assert act.per_layer == 34 * s * b * h  # Korthikanti et al. without the s^2 term
    scores = activation_bytes(cfg, s, b, 10, "bf16", False, attention_scores_stored=True)
    assert scores.per_layer == s * b * h * 34 + 5 * a * s * s * b
    assert act.embeddings == s * b * (2 * h + h)
    assert act.head == b * 10 * (4 * 2 * h + 1008 * (2 + 8)) + b * 3 * 2 * h
    assert act.total == 2 * act.per_layer + act.embeddings + act.head
    ckpt = activation_bytes(cfg, s, b, 10, "bf16", checkpointing=True)
    assert ckpt.encoder == 2 * 2 * s * b * h + act.per_layer
    fp32 = activation_bytes(cfg, s, b, 10, "fp32", False)
    assert fp32.per_layer == s * b * (4 * (8 * h + 2 * 128) + 2 * h)


def test_activation_formula_matches_the_tensors_a_layer_saves() -> None:
    """The 8h + 2I stored values per token are what BertLayer's autograd graph keeps (bf16,
    SDPA's fused kernel, dropout off so no masks; within 1% for LayerNorm statistics and
    SDPA's log-sum-exp)."""
    cfg = tiny_model(
        hidden_size=128,
        num_heads=2,
        intermediate_size=512,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    layer = BertLayer(cfg).to(torch.bfloat16).train()
    s, b = 64, 3
    x = torch.randn(b, s, 128, dtype=torch.bfloat16, requires_grad=True)
    out = layer(x, None)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    saved: dict[int, int] = {}
    seen: set[Any] = set()
    stack = [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for attr in dir(fn):
            value = getattr(fn, attr) if attr.startswith("_saved_") else None
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                if storage.data_ptr() not in params:
                    saved[storage.data_ptr()] = storage.nbytes()
        stack += [f for f, _ in fn.next_functions]
    masks = 2 * s * b * cfg.hidden_size  # the two 1-byte dropout masks, absent at p = 0
    formula = activation_bytes(cfg, s, b, 0, "bf16", False).per_layer - masks
    assert formula <= sum(saved.values()) <= 1.01 * formula


# --------------------------------------------------------------------------- batch, data, world


def test_batch_arithmetic_and_indivisible_batch() -> None:
    cfg = pretrain_config()
    plan = make_plan(cfg, PlanOptions(nodes=2, gpus_per_node=4))
    p1, p2 = plan.phases
    assert (p1.micro_batch_size, p1.accumulation, p1.world_size) == (4, 2, 8)
    for p in plan.phases:
        assert p.micro_batch_size * p.accumulation * p.world_size == p.global_batch_size
    assert p1.tokens_per_step == 64 * 128 and p2.tokens_per_step == 32 * 512
    assert (p1.warmup_steps, p2.warmup_steps) == (10, 2)
    assert (p1.samples, p1.tokens) == (6400, 6400 * 128)
    with pytest.raises(ConfigError) as err:
        make_plan(cfg, PlanOptions(nodes=1, gpus_per_node=3))
    assert err.value.key == "phases[0].global_batch_size"
    assert "config key 'phases[0].global_batch_size'" in str(err.value)


def test_world_from_options_environment_or_default() -> None:
    env = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    assert (resolve_world(None, None, env).nodes, resolve_world(None, None, env).size) == (2, 16)
    assert resolve_world(None, None, {"WORLD_SIZE": "6"}).size == 6
    assert resolve_world(None, None, {}).size == 1
    explicit = resolve_world(4, 8, env)
    assert (explicit.nodes, explicit.gpus_per_node) == (4, 8)
    with pytest.raises(BertpipeError):
        resolve_world(None, None, {"WORLD_SIZE": "many"})


def write_manifest(
    folder: Path, counts: list[int], seq: int = 64, max_pred: int = 10, per_sample: int = 10
) -> Path:
    """A manifest.json as docs/data-format.md describes it, with (empty) shard files."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = []
    for i, n in enumerate(counts):
        name = f"train-{i:05d}.tar"
        (folder / name).write_bytes(b"")
        samples = -(-n // per_sample)
        shards.append({"file": name, "instances": n, "samples": samples, "bytes": 0, "sha256": ""})
    split = {"num_shards": len(shards), "instances": sum(counts), "samples": 0, "bytes": 0}
    manifest = {
        "format": "bertpipe.instances",
        "schema_version": 1,
        "phase": f"seq{seq}",
        "max_seq_length": seq,
        "max_predictions_per_seq": max_pred,
        "masking": "static",
        "token_dtype": "uint16",
        "vocab_size": 1000,
        "special_token_ids": {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4},
        "tokenizer_sha256": "0" * 64,
        "instances_per_sample": per_sample,
        "seed": 0,
        "num_buckets": 1,
        "splits": {
            "train": {**split, "shards": shards},
            "heldout": {"num_shards": 0, "instances": 0, "samples": 0, "bytes": 0, "shards": []},
        },
        "stats": {},
        "config": {},
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_data_per_rank_from_shard_counts(tmp_path: Path) -> None:
    equal = read_manifest(str(write_manifest(tmp_path / "equal", [640] * 4, per_sample=64)))
    assert read_manifest(str(tmp_path / "absent")) is None
    # 2 ranks x 2 readers: one shard of 640 each, 640 // 8 = 80 batches per reader
    data = data_plan("x", equal, 2, num_workers=2, micro_batch=8, accumulation=4, samples=5120)
    assert data.found and data.num_shards == 4 and data.instances == 2560
    assert data.shards_per_rank == 2.0 and data.readers_per_rank == 2
    assert data.min_instances_per_reader == 640 and data.batches_per_rank_per_epoch == 160
    assert data.steps_per_epoch == 40 and data.instances_used_per_epoch == 2560
    assert data.epochs == pytest.approx(2.0)

    unequal = read_manifest(str(write_manifest(tmp_path / "unequal", [700, 690, 680, 650])))
    assert unequal is not None
    groups = partition_blocks(unequal.block_sizes("train"), 2)
    smallest = min(sum(r.stop - r.start for r in g) * 10 for g in groups)  # full blocks of 10
    data = data_plan("x", unequal, 2, num_workers=0, micro_batch=8, accumulation=2, samples=1)
    assert data.min_instances_per_reader == smallest and 1300 <= smallest <= 1360
    assert data.batches_per_rank_per_epoch == smallest // 8
    assert not data_plan("x", None, 2, 0, 4, 2, 86).found


# --------------------------------------------------------------------------- time


def test_communication_volume() -> None:
    psi = 1_000_000
    ring = 15 / 16
    assert comm_bytes_per_step(psi, 0, 16, 4, "bf16") == pytest.approx(2 * ring * psi * 2)
    assert comm_bytes_per_step(psi, 1, 16, 4, "fp32") == pytest.approx(2 * ring * psi * 4)
    assert comm_bytes_per_step(psi, 2, 16, 4, "bf16") == pytest.approx(5 * ring * psi * 2)
    assert comm_bytes_per_step(psi, 3, 16, 4, "bf16") == pytest.approx(12 * ring * psi * 2)
    assert comm_bytes_per_step(psi, 3, 1, 4, "bf16") == 0.0
    # with no accumulation these are ZeRO's 2 psi and 3 psi
    assert [comm_passes_per_step(stage, 1) for stage in range(4)] == [2, 2, 2, 3]


def test_step_time_hand_computed() -> None:
    t = step_time(
        flops_per_step=8e15,
        world_size=8,
        peak_flops_per_gpu=1e15,
        mfu=0.5,
        comm_bytes=2.5e9,
        link="inter-node",
        bandwidth_gbps=100.0,  # 12.5 GB/s
        overlap=0.5,
        steps=100,
    )
    assert t.compute_s == pytest.approx(2.0)  # 8e15 / (8 * 1e15 * 0.5)
    assert t.comm_s == pytest.approx(0.2)  # 2.5e9 / 12.5e9
    assert t.exposed_comm_s == pytest.approx(0.1)
    assert t.step_s == pytest.approx(2.1) and t.phase_s == pytest.approx(210.0)
    assert format_hmm(210.0) == "0:04" and format_hmm(3725.0) == "1:02"


def test_plan_time_matches_flops_peak_and_bandwidth() -> None:
    cfg = pretrain_config(zero={"stage": 1})
    plan = make_plan(cfg, PlanOptions(nodes=2, gpus_per_node=4, gpu="h100", mfu=0.5))
    model = BertModelConfig.preset("tiny", 30522)
    p1 = plan.phases[0]
    assert p1.time is not None and plan.total_time_s is not None
    flops = training_flops_per_sequence(model, 128, 20) * 64
    peak = peak_flops("h100", "bf16")
    assert peak is not None
    assert p1.time.compute_s == pytest.approx(flops / (8 * peak * 0.5))
    psi = model.num_parameters()
    assert p1.time.comm_s == pytest.approx(2 * 7 / 8 * psi * 2 / (100e9 / 8))
    assert p1.time.link == "inter-node"
    assert plan.total_time_s == pytest.approx(sum(p.time.phase_s for p in plan.phases if p.time))
    one_node = make_plan(cfg, PlanOptions(nodes=1, gpus_per_node=8, gpu="h100"))
    assert one_node.phases[0].time is not None
    assert one_node.phases[0].time.link == "intra-node"
    assert plan.gpu_memory_gib == pytest.approx(79.6) and plan.phases[0].memory.fits


def test_gpu_without_peak_or_unknown() -> None:
    plan = make_plan(pretrain_config(), PlanOptions(gpus_per_node=8, gpu="a10g"))
    assert plan.gpu_memory_gib == pytest.approx(22.5) and plan.total_time_s is None
    assert any("a10g" in w for w in plan.warnings)
    given = make_plan(pretrain_config(device_peak_tflops=125.0), PlanOptions(gpu="a10g"))
    assert given.total_time_s is not None
    with pytest.raises(BertpipeError, match="unknown --gpu"):
        make_plan(pretrain_config(), PlanOptions(gpu="h1000"))
    with pytest.raises(BertpipeError, match="mfu"):
        PlanOptions(mfu=1.5)


def test_sequence_lengths_from_option_and_position_limit() -> None:
    plan = make_plan(pretrain_config(), PlanOptions(gpus_per_node=8, seq_lens=(64, 256)))
    assert [(p.seq_len, p.seq_len_source) for p in plan.phases] == [
        (64, "--seq-len"),
        (256, "--seq-len"),
    ]
    assert plan.phases[0].num_masked == math.ceil(0.15 * 64)
    with pytest.raises(ConfigError) as err:
        make_plan(pretrain_config(), PlanOptions(gpus_per_node=8, seq_lens=(1024,)))
    assert err.value.key == "model.max_position_embeddings"


# --------------------------------------------------------------------------- command line


@pytest.fixture
def plan_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the plan command in the parser, and no launcher environment."""
    assert bertpipe.app.cli.COMMANDS["plan"] == "bertpipe.training.plan.cli:add_plan_command"
    monkeypatch.setattr(bertpipe.app.cli, "COMMANDS", {"plan": bertpipe.app.cli.COMMANDS["plan"]})
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def write_config(tmp_path: Path, phase1_data: Path, **extra: Any) -> Path:
    data = {
        "model": {"preset": "base"},
        "phases": [
            {"name": "phase1", "data": str(phase1_data), "max_steps": 1000,
             "micro_batch_size": 8, "global_batch_size": 256, "warmup": 0.1},
            {"name": "phase2", "data": str(tmp_path / "seq512"), "max_steps": 200,
             "micro_batch_size": 4, "global_batch_size": 128, "warmup": 0.1},
        ],
        **extra,
    }  # fmt: skip
    path = tmp_path / "pretrain.yaml"
    path.write_text(json.dumps(data))  # JSON is YAML
    return path


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = bertpipe.app.cli.main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.usefixtures("plan_cli")
def test_cli_json_without_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config(tmp_path, tmp_path / "seq128")
    args = ["plan", "--config", str(path), "--nodes", "2", "--gpus-per-node", "8"]
    code, out, _ = run_cli([*args, "--gpu", "h100", "--json"], capsys)
    assert code == 0
    plan = json.loads(out.strip().splitlines()[-1])
    assert (plan["world_size"], plan["nodes"], plan["gpus_per_node"]) == (16, 2, 8)
    p1, p2 = plan["phases"]
    assert (p1["micro_batch_size"], p1["accumulation"], p1["global_batch_size"]) == (8, 2, 256)
    assert (p2["accumulation"], p2["seq_len"], p2["seq_len_source"]) == (
        2,
        512,
        "default by phase order",
    )
    assert p1["tokens_per_step"] == 256 * 128 and p1["warmup_steps"] == 100
    assert p1["data"]["found"] is False and p1["data"]["num_shards"] is None
    assert p1["memory"]["fits"] is True and p1["time"]["link"] == "inter-node"
    assert plan["model"]["num_parameters"] == BertModelConfig.preset("base", 30522).num_parameters()
    assert plan["total_time_hmm"] and plan["assumptions"]

    code, text, _ = run_cli(args, capsys)
    assert code == 0
    assert "data not found" in text and "16 GPUs = 2 nodes x 8" in text
    assert "8 x 2 x 16 = 256" in text and "assumptions:" in text
    assert "CUDA context/workspace allowance 1.5 GiB" in text and "MFU" not in text


@pytest.mark.usefixtures("plan_cli")
def test_cli_reads_the_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seq = write_manifest(tmp_path / "seq128", [700, 690, 680, 650], seq=96)
    path = write_config(tmp_path, seq, data={"num_workers": 0})
    code, out, _ = run_cli(
        ["plan", "-c", str(path), "--nodes", "1", "--gpus-per-node", "2", "--json"], capsys
    )
    assert code == 0
    plan = json.loads(out.strip().splitlines()[-1])
    p1, p2 = plan["phases"]
    assert (p1["seq_len"], p1["seq_len_source"], p1["num_masked"]) == (96, "manifest", 10)
    assert (
        plan["model"]["vocab_size"] == 1000 and plan["model"]["vocab_source"] == "phase1 manifest"
    )
    data = p1["data"]
    assert (data["num_shards"], data["shards_per_rank"], data["instances"]) == (4, 2.0, 2720)
    smallest = data["min_instances_per_reader"]  # the loader's partition: about 2720 / 2
    assert 1300 <= smallest <= 1360 and data["readers_per_rank"] == 1
    assert data["batches_per_rank_per_epoch"] == smallest // 8
    assert data["steps_per_epoch"] == smallest // 8 // 16
    assert data["epochs"] == pytest.approx(1000 * 256 / 2720)
    assert p2["data"]["found"] is False and p1["time"] is None  # no --gpu: no time


@pytest.mark.usefixtures("plan_cli")
@pytest.mark.parametrize(
    ("extra", "args", "key"),
    [
        ({}, ["--gpus-per-node", "3"], "phases[0].global_batch_size"),
        ({"optimizer": {"name": "lamb"}, "zero": {"stage": 3}}, [], "zero.stage"),
        ({}, ["phases=[{max_steps: 10, warmup: 20}]"], "phases[0].warmup"),
        ({}, ["model.hidden_size=100"], "model.hidden_size"),
    ],
)
def test_cli_config_errors(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: dict[str, Any],
    args: list[str],
    key: str,
) -> None:
    path = write_config(tmp_path, tmp_path / "seq128", **extra)
    code, out, err = run_cli(["plan", "--config", str(path), *args, "--gpu", "h100"], capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"bertpipe: error: config key '{key}': ")


@pytest.mark.usefixtures("plan_cli")
def test_cli_world_from_launcher_environment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    path = write_config(tmp_path, tmp_path / "seq128")
    code, out, _ = run_cli(["plan", "-c", str(path), "--seq-len", "64,256", "--json"], capsys)
    assert code == 0
    plan = json.loads(out.strip().splitlines()[-1])
    assert (plan["nodes"], plan["gpus_per_node"]) == (2, 8)
    assert [p["seq_len"] for p in plan["phases"]] == [64, 256]


def test_plan_with_a_named_gpu_does_not_import_torch() -> None:
    """``bertpipe plan`` gates every multi-node launch (bertpipe-preflight runs it twice):
    importing torch would be 2 of its ~2.5 s. torch is imported only to look at this machine
    (no ``--gpu``)."""
    import subprocess
    import sys

    config = Path(__file__).resolve().parents[2] / "infra" / "k8s" / "config" / "pretrain.yaml"
    code = (
        "import sys; from bertpipe.app.cli import main; "
        f"rc = main(['plan', '--config', {str(config)!r}, '--nodes', '4', "
        "'--gpus-per-node', '8', '--gpu', 'h100']); "
        "sys.exit(rc or (3 if 'torch' in sys.modules else 0))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "32 GPUs = 4 nodes x 8" in proc.stdout
