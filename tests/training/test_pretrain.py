"""Pre-training end to end with real DeepSpeed on CPU: phases, metrics, resume, launch, export."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bertpipe.config import load_config, to_yaml
from bertpipe.training import checkpoint as ckpt
from bertpipe.training.pretrain.config import PretrainConfig
from bertpipe.training.pretrain.trainer import run_pretraining
from tests.cli_runner import run_cli
from tests.conftest import sqlite_uri
from tests.faultenv import FAULT_IN_SAVE, child_pythonpath

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _overrides(
    shards: Path | str, out: Path, uri: str, steps: int = 8, **extra: object
) -> list[str]:
    phases = (
        "phases=["
        f"{{name: phase1, data: {shards}/seq64, max_steps: {steps}, micro_batch_size: 8,"
        " global_batch_size: 16, learning_rate: 2.0e-3, warmup: 0.25},"
        f" {{name: phase2, data: {shards}/seq128, max_steps: 4, micro_batch_size: 4,"
        " global_batch_size: 8, learning_rate: 1.0e-3, warmup: 0.25}]"
    )
    items = [
        f"output={out}",
        "model.preset=tiny",
        "model.max_position_embeddings=128",
        phases,
        "precision=fp32",
        "zero.stage=1",
        "data.num_workers=0",
        "log_every_steps=1",
        "checkpoint.every_steps=4",
        "checkpoint.keep_last=1",
        "eval.max_batches=4",
        f"tracking.uri={uri}",
        "tracking.experiment=pretrain-tests",
    ]
    items += [f"{k.replace('__', '.')}={v}" for k, v in extra.items()]
    return items


def _cfg(*args: object, **kw: object) -> PretrainConfig:
    return load_config(PretrainConfig, None, _overrides(*args, **kw))  # type: ignore[arg-type]


def _history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _env() -> dict[str, str]:
    """The environment of a child job: not the distributed settings of this process's job."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["PYTHONPATH"] = child_pythonpath(REPO)  # with the fault-injection hook
    return env


@pytest.fixture(scope="module")
def reference_run(
    pretrain_shards: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, object]:
    """Both phases, uninterrupted, in this process."""
    out = tmp_path_factory.mktemp("reference")
    uri = sqlite_uri(out / "mlflow.db")
    cfg = _cfg(pretrain_shards, out / "run", uri, steps=24, tracking__system_metrics_interval_s=0.5)
    summary = run_pretraining(cfg)
    state, _ = ckpt.read_state(cfg.checkpoint_dir, ckpt.latest_tag(cfg.checkpoint_dir), 0)
    return {"cfg": cfg, "uri": uri, "summary": summary, "run_id": state.mlflow_run_id, "out": out}


def test_two_phases_metrics_and_checkpoints(reference_run: dict) -> None:  # type: ignore[type-arg]
    cfg, uri, run_id = reference_run["cfg"], reference_run["uri"], reference_run["run_id"]
    summary = reference_run["summary"]
    assert summary["phase1"]["steps"] == 24 and summary["phase2"]["global_step"] == 28
    losses = [v for _, v in _history(uri, run_id, "train/loss")]
    assert len(losses) == 28
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5  # visibly falling
    import mlflow

    run = mlflow.MlflowClient(tracking_uri=uri).get_run(run_id)
    for key in (
        "train/mlm_loss",
        "train/nsp_loss",
        "train/mlm_accuracy",
        "train/nsp_accuracy",
        "train/lr",
        "train/grad_norm",
        "train/samples_per_s",
        "train/tokens_per_s",
        "train/tflops_per_device",
        "train/memory_rss_gb",
        "eval/loss",
        "eval/mlm_accuracy",
    ):
        assert key in run.data.metrics, key
    assert run.data.tags["bertpipe.stage"] == "pretrain"
    assert "bertpipe.data_manifest_sha256.phase1" in run.data.tags
    assert run.data.params["zero.stage"] == "1"
    # MLflow's own views: each phase's shards as a dataset input, the machine's load sampled
    inputs = {i.dataset.name: i.dataset for i in run.inputs.dataset_inputs}
    assert set(inputs) == {"phase1-shards", "phase2-shards"}
    sha = run.data.tags["bertpipe.data_manifest_sha256.phase1"]
    assert inputs["phase1-shards"].digest == sha[:32]
    assert json.loads(inputs["phase1-shards"].source)["uri"].endswith("/seq64/manifest.json")
    profile = json.loads(inputs["phase1-shards"].profile)
    assert profile["sha256"] == sha and profile["train_instances"] > 0
    for key in ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"):
        assert key in run.data.metrics, key
    # checkpoints: phase ends kept, older ones pruned, latest published
    folder = Path(cfg.checkpoint_dir)
    tags = sorted(p.name for p in folder.iterdir() if p.name.startswith("global_step"))
    assert tags == ["global_step24", "global_step28"]
    assert (folder / "latest").read_text() == "global_step28"
    state = json.loads((folder / "global_step28" / "bertpipe_state.json").read_text())
    assert (
        state["phase"] == "phase2" and state["phase_complete"] and state["mlflow_run_id"] == run_id
    )
    # the warmup/decay schedule is the one configured
    lrs = [v for _, v in _history(uri, run_id, "train/lr")]
    assert lrs[0] == pytest.approx(2e-3 / 6) and max(lrs[:24]) == pytest.approx(2e-3)
    assert lrs[24] == pytest.approx(1e-3)  # phase 2: warmup of 1 step


def _pretrain_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "bertpipe.app.cli", "pretrain", *args]


@pytest.mark.slow
def test_resume_after_sigterm_is_exact(pretrain_shards: Path, tmp_path: Path, s3) -> None:
    """An uninterrupted run and a run stopped by SIGTERM then resumed log the same losses.

    The stopped run keeps its shards and checkpoints on the S3 test server, reached through a
    fault proxy: the SIGTERM arrives while checkpoint global_step4 is uploading, and shard
    reads, uploads, ``latest`` and the resume's downloads meet 503 SlowDown and connection
    resets. It publishes both checkpoints, exits 143, and the same command resumes. Both run
    in fresh single-threaded processes, as a real job does, and the uninterrupted reference on
    one thread too (in this process: local files only): CPU kernels may round differently with
    another thread count, which is not what this pins.
    """
    import s3fs

    from tests.faultproxy import FaultProxy

    env = {**_env(), "OMP_NUM_THREADS": "1"}
    reference = tmp_path / "reference"
    ref_uri = sqlite_uri(tmp_path / "reference.db")
    done = run_cli(["pretrain", *_overrides(pretrain_shards, reference, ref_uri, steps=24)], env)
    assert done.returncode == 0, done.stderr[-3000:]
    shards = f"{s3.bucket}/shards"
    s3fs.S3FileSystem().put(str(pretrain_shards), shards.removeprefix("s3://"), recursive=True)
    folder = f"{s3.bucket}/run/checkpoints"
    uri = sqlite_uri(tmp_path / "mlflow.db")
    args = _overrides(
        shards,
        tmp_path / "run",
        uri,
        steps=24,
        checkpoint__dir=folder,
        checkpoint__local_dir=tmp_path / "staging",
    )
    with FaultProxy(s3.server.url) as proxy:
        env.update(s3.env, AWS_ENDPOINT_URL=proxy.url)
        proxy.inject("503", 1, "GET", r"seq64/manifest\.json")
        proxy.inject("reset_mid", 2, "GET", r"seq64/train-0000[01]\.tar", after_bytes=4096)
        proxy.inject("503", 2, "PUT", r"mp_rank_00_model_states\.pt")
        proxy.inject("reset", 2, "PUT", r"bertpipe_rank00000\.json")
        proxy.inject("503", 1, "PUT", r"checkpoints/latest")
        stopped = subprocess.run(
            _pretrain_cmd(args),
            env={**env, FAULT_IN_SAVE: "term-upload:global_step4"},
            capture_output=True,
            text=True,
        )
        assert stopped.returncode == 143, stopped.stderr[-3000:]
        assert proxy.pending == 0 and sum(proxy.served.values()) == 8, proxy.served
        latest = ckpt.latest_tag(folder)
        assert latest is not None and 4 < int(latest.removeprefix("global_step")) < 24
        assert ckpt.latest_complete_tag(folder) == latest
        assert "checkpoint global_step4 published" in stopped.stderr  # the one in flight
        index = json.loads(ckpt._Folder(folder).read_text(ckpt.INDEX_FILE) or "[]")
        assert [e["tag"] for e in index] == [latest]  # keep_last=1: pruned on the store
        assert ckpt.tags(folder) == [latest]
        assert not list((tmp_path / "staging").rglob("*.pt"))  # uploaded, then cleared

        # resume from `latest` in a fresh process, its downloads throttled and cut off too
        proxy.inject("503", 2, "GET", r"mp_rank_00_model_states\.pt")
        proxy.inject("reset_mid", 1, "GET", r"optim_states\.pt", after_bytes=4096)
        again = subprocess.run(_pretrain_cmd(args), env=env, capture_output=True, text=True)
        assert again.returncode == 0, again.stderr[-3000:]
        assert proxy.pending == 0, proxy.served
    state, _ = ckpt.read_state(folder, "global_step28", 0)
    ref_state, _ = ckpt.read_state(str(reference / "checkpoints"), "global_step28", 0)
    assert state.mlflow_run_id is not None
    want = _history(ref_uri, ref_state.mlflow_run_id, "train/loss")
    got = _history(uri, state.mlflow_run_id, "train/loss")
    assert [s for s, _ in got] == list(range(1, 29))  # one run, every step once
    assert got == want  # bit for bit


def test_export_loads_in_transformers_with_same_logits(reference_run: dict, tmp_path: Path) -> None:  # type: ignore[type-arg]
    transformers = pytest.importorskip("transformers")
    from bertpipe.training.export import export_checkpoint, load_checkpoint_model

    cfg = reference_run["cfg"]
    info = export_checkpoint(cfg.checkpoint_dir, str(tmp_path / "hf"))
    assert info["global_step"] == 28
    names = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "vocab.txt", "tokenizer.json"} <= names
    ours, _ = load_checkpoint_model(cfg.checkpoint_dir)
    hf = transformers.BertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    tok = transformers.BertTokenizerFast.from_pretrained(tmp_path / "hf")
    enc = tok(
        ["The state government said.", "Early"],
        ["It was important.", "x"],
        return_tensors="pt",
        padding=True,
    )
    with torch.no_grad():
        theirs = hf(**enc)
        mine = ours(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"])
    assert torch.allclose(theirs.prediction_logits, mine.mlm_logits, atol=1e-5)
    assert torch.allclose(theirs.seq_relationship_logits, mine.nsp_logits, atol=1e-5)


def _launch(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, env=_env(), stdout=log.open("wb"), stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_two_ranks_zero2_and_universal_resume(pretrain_shards: Path, tmp_path: Path) -> None:
    """A 2-rank ZeRO-2 run; a universal checkpoint of it resumes on 1 rank. (2 nodes of 1
    rank each, under every launcher: tests/multihost/test_launch_paths.py.)"""
    from deepspeed.checkpoint import ds_to_universal

    bin_dir = Path(sys.executable).parent  # the environment's scripts, activated or not
    bertpipe, deepspeed = str(bin_dir / "bertpipe"), str(bin_dir / "deepspeed")
    assert Path(bertpipe).exists(), "bertpipe must be installed (make install)"
    out = tmp_path / "one_node"
    out.mkdir()
    uri = sqlite_uri(out / "mlflow.db")
    cfg = _cfg(pretrain_shards, out / "run", uri, steps=6, zero__stage=2)
    (out / "cfg.yaml").write_text(to_yaml(cfg))
    script = [bertpipe, "pretrain", "--config", str(out / "cfg.yaml"), "only_phase=phase1"]
    proc = _launch([deepspeed, "--num_gpus", "2", "--master_port", "29631", *script], out / "log")
    assert proc.wait(timeout=600) == 0, (out / "log").read_text()[-3000:]
    state, _ = ckpt.read_state(str(out / "run" / "checkpoints"), "global_step6", 0)
    assert state.world_size == 2
    assert len(_history(uri, state.mlflow_run_id, "train/loss")) == 6

    # universal checkpoint: convert the 2-rank ZeRO-2 checkpoint (DeepSpeed's converter, what
    # `python -m deepspeed.checkpoint.ds_to_universal` runs, here in this process without its
    # worker pools), continue phase 1 on 1 rank
    folder = tmp_path / "one_node" / "run" / "checkpoints"
    ds_to_universal.main(
        argparse.Namespace(
            input_folder=str(folder / "global_step6"),
            output_folder=str(folder / "global_step6_universal"),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=False,
        )
    )
    shutil.copy(folder / "global_step6" / "bertpipe_state.json", folder / "global_step6_universal")
    uri = sqlite_uri(tmp_path / "one_node" / "mlflow.db")
    cfg = _cfg(
        pretrain_shards,
        tmp_path / "one_node" / "run",
        uri,
        steps=8,
        zero__stage=2,
        checkpoint__resume="global_step6_universal",
        checkpoint__universal="true",
        only_phase="phase1",
    )
    run_pretraining(cfg)
    state, _ = ckpt.read_state(str(folder), "global_step8", 0)
    assert state.world_size == 1 and state.global_step == 8
    history = _history(uri, state.mlflow_run_id, "train/loss")
    assert [s for s, _ in history] == list(range(1, 9))
    assert history[-1][1] < history[0][1]


@pytest.mark.parametrize(
    ("override", "key", "fragment"),
    [
        (["phases[0].global_batch_size=20"], "phases[0].global_batch_size", "not a multiple"),
        (["optimizer.name=lamb", "zero.stage=3"], "zero.stage", "zero.stage=1 or 2"),
        (["model.max_position_embeddings=64"], "phases[1].data", "positions"),
    ],
)
def test_config_errors_before_training(
    pretrain_shards: Path, tmp_path: Path, override: list[str], key: str, fragment: str
) -> None:
    from bertpipe.config import ConfigError

    items = _overrides(pretrain_shards, tmp_path / "run", f"sqlite:///{tmp_path / 'db'}")
    with pytest.raises(ConfigError) as info:
        if override[0].startswith("phases[0]"):
            cfg = load_config(PretrainConfig, None, items)
            cfg.phases[0].global_batch_size = 20
            cfg.check_world(1)
        else:
            run_pretraining(load_config(PretrainConfig, None, [*items, *override]))
    assert info.value.key == key and fragment in str(info.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_lamb_at_zero1_trains_and_resumes_exactly(pretrain_shards: Path, tmp_path: Path) -> None:
    """The BERT-Large recipe's optimizer set-up (LAMB, ZeRO 1, NVIDIA's schedule) through the
    trainer: it learns, logs its trust ratios, and a resume from its checkpoint is exact."""
    import mlflow

    uri = sqlite_uri(tmp_path / "mlflow.db")
    extra = {
        "optimizer__name": "lamb",
        "phases[0]__decay": "poly",
        "phases[0]__decay_from": "start",
        "phases[0]__learning_rate": 0.02,  # LAMB steps are lr x ||w||: larger rates than Adam
        "only_phase": "phase1",
    }
    extra["checkpoint__keep_last"] = 3
    cfg = _cfg(pretrain_shards, tmp_path / "full", uri, steps=12, **extra)
    run_pretraining(cfg)
    state, _ = ckpt.read_state(cfg.checkpoint_dir, ckpt.latest_tag(cfg.checkpoint_dir), 0)
    losses = [v for _, v in _history(uri, state.mlflow_run_id, "train/loss")]
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3]) - 0.3
    metrics = mlflow.MlflowClient(tracking_uri=uri).get_run(state.mlflow_run_id).data.metrics
    assert 0 < metrics["train/trust_ratio_min"] <= metrics["train/trust_ratio_max"]
    # as if the run had died after step 8: back to that checkpoint, and the same command
    folder = Path(cfg.checkpoint_dir)
    shutil.rmtree(folder / "global_step12")
    (folder / "latest").write_text("global_step8")
    run_pretraining(_cfg(pretrain_shards, tmp_path / "full", uri, steps=12, **extra))
    history = _history(uri, state.mlflow_run_id, "train/loss")
    again = [v for s, v in history if s > 8]
    assert len(again) == 8 and again[0::2] == again[1::2]  # steps 9-12 twice, bit-exact
