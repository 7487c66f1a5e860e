"""infra/gpu/: the GPU check's scripts, without a GPU.

Fast: the scripts parse, the Makefile targets exist (``gpu-check`` depends on nothing and
does not pass the Makefile's ``DS_ACCELERATOR=cpu`` on), every command of the run list is
accepted by the real parsers (the dry-run mode prints them), the bookkeeping helper records
and summarises runs, and training plus the benchmark import without MLflow or Beam (the GPU
machine has neither). Slow: the whole check end to end in its CPU smoke mode, on shards made
by the real pipeline.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "infra" / "gpu"
CHECK = GPU / "check.sh"
WHEELS = GPU / "wheels.sh"
HELPER = GPU / "gpu_check.py"
BENCH_RUNS = [
    "p1-unpad",
    "p1-hf",
    "p1-pad",
    "p2-unpad",
    "p2-hf",
    "p2-pad",
    "p1-modern",
    "p2-modern",
    "p1-unpad-compiled",
    "p2-unpad-compiled",
]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHON"] = sys.executable
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("GPU_CHECK_ONLY", None)
    env.update(extra)
    return env


def _dry_run(tmp_path: Path, **extra: str) -> dict[str, list[str]]:
    """name -> argument list of every run, as the dry-run mode prints them."""
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(CHECK)],
        env=_env(OUT_DIR=str(out), GPU_CHECK_DRY_RUN="1", **extra),
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = {}
    for line in proc.stdout.splitlines():
        match = re.match(r"\+ ([\w-]+): (.*)$", line)
        if match:
            runs[match.group(1)] = shlex.split(match.group(2))
    records = [json.loads(line) for line in (out / "gpu-check.jsonl").read_text().splitlines()]
    assert [r["name"] for r in records] == list(runs)
    assert all(r["skipped"] == "dry run" for r in records)
    return runs


# --------------------------------------------------------------------------- fast


def test_scripts_parse_and_are_executable() -> None:
    for path in (CHECK, WHEELS):
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{path}: {proc.stderr}"
        assert os.access(path, os.X_OK), f"{path} is not executable"
    proc = subprocess.run([sys.executable, str(HELPER), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0


def test_makefile_targets() -> None:
    text = (ROOT / "Makefile").read_text()
    # gpu-check runs where there is no .venv and no network: no prerequisites at all
    assert re.search(r"^gpu-check:[ \t]*$", text, re.MULTILINE), "gpu-check must not depend"
    assert re.search(r"^gpu-wheels:", text, re.MULTILINE)
    assert re.search(r"^/\.gpu-wheels/$", (ROOT / ".gitignore").read_text(), re.MULTILINE)
    # run as `make test` runs it: a parent make's MAKEFLAGS/MAKELEVEL add directory lines
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", "gpu-check", "OUT_DIR=/x/out"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    (line,) = [line for line in proc.stdout.splitlines() if line.strip()]
    assert "env -u DS_ACCELERATOR" in line and "infra/gpu/check.sh" in line
    assert 'OUT_DIR="/x/out"' in line
    proc = subprocess.run(
        ["make", "--no-print-directory", "-n", "gpu-wheels"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0 and "infra/gpu/wheels.sh" in proc.stdout


def test_run_list_order_and_commands_are_accepted(tmp_path: Path) -> None:
    from bertpipe.config import load_config
    from bertpipe.training.pretrain.config import PretrainConfig

    runs = _dry_run(tmp_path)
    bench = [name for name in runs if name in BENCH_RUNS]
    assert "fused_adam_build" not in runs  # torch's fused AdamW: no op to compile
    assert bench == BENCH_RUNS  # the most important figures first
    assert list(runs).index("pretrain-demo") < list(runs).index("p1-unpad-compiled")
    for name in BENCH_RUNS:
        args = runs[name]
        cut = args.index("bench")
        assert args[cut - 2 : cut + 2] == ["-m", "bertpipe.app.cli", "bench", "train"]
        options = args[cut + 2 :]
        assert options[options.index("--name") + 1] == name
        assert options[options.index("--preset") + 1] == "large"
        assert options[options.index("--precision") + 1] == "bf16"
        assert options[options.index("--device") + 1] == "cuda"
        assert ("--compile" in options) == name.endswith("-compiled")
        modern = name.endswith("-modern")
        assert ("--family" in options) == modern
        if modern:  # the last --preset wins
            assert options[len(options) - 1 - options[::-1].index("--preset") + 1] == (
                "modernbert-large"
            )
        shape = ["128", "64"] if name.startswith("p1") else ["512", "16"]
        assert [options[options.index(o) + 1] for o in ("--seq-len", "--micro-batch")] == shape
        import argparse

        from bertpipe.app.bench.train import add_arguments

        parser = argparse.ArgumentParser()
        add_arguments(parser)
        parsed = parser.parse_args(options)  # exits on an unknown option
        assert parsed.zero == 1 and parsed.optimizer == "adamw"
    args = runs["pretrain-demo"]
    cut = args.index("pretrain")
    assert args[cut + 1 : cut + 3] == ["--config", "configs/pretrain-demo.yaml"]
    cfg = load_config(PretrainConfig, str(ROOT / args[cut + 2]), args[cut + 3 :])
    assert cfg.only_phase == "phase1"
    assert cfg.phases[0].max_steps == 200
    assert cfg.precision == "bf16"
    assert cfg.log_every_steps == 20
    assert cfg.checkpoint.every_steps == 0
    assert not cfg.tracking.enabled
    assert cfg.phases[0].data.endswith("runs/demo/shards/seq128")


def test_plan_fit_runs_and_its_planned_runs_are_accepted(tmp_path: Path) -> None:
    """plan --fit for the H200 and the LAMB recipe, run for real from the dry run's command
    line; each planned run's overrides, with the chosen micro batch, load on the written
    config into one micro batch per step at the plan's ZeRO stage and budget."""
    from bertpipe.config import load_config
    from bertpipe.training.pretrain.config import PretrainConfig
    from tests.cli_runner import run_cli

    runs = _dry_run(tmp_path)
    names = list(runs)
    order = ["pretrain-demo", "plan-fit", "planned-p1", "planned-p2", "p1-modern"]
    assert [names.index(n) for n in order] == sorted(names.index(n) for n in order)
    args = runs["plan-fit"]
    options = args[args.index("plan") + 1 :]
    assert options[options.index("--config") + 1] == "configs/pretrain-bert-large-lamb.yaml"
    assert options[options.index("--gpu") + 1] == "h200"
    assert "--fit" in options and "--json" in options and "precision=bf16" in options
    written = tmp_path / "planned.yaml"
    options[options.index("--write") + 1] = str(written)
    done = run_cli(["plan", *options])
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    winner = result["winner"]
    for i, name in enumerate(("planned-p1", "planned-p2")):
        args = runs[name]
        cut = args.index("pretrain")
        assert args[cut + 1] == "--config" and args[cut + 2].endswith("/planned.yaml")
        micros = [p["micro_batch_size"] for p in winner["phases"]]
        overrides = args[cut + 3 :]
        for j, micro in enumerate(micros):  # the dry run prints MICRO for what plan-fit chose
            key = f"phases[{j}].global_batch_size="
            overrides = [f"{key}{micro}" if o == f"{key}MICRO" else o for o in overrides]
        micro = micros[i]
        cfg = load_config(PretrainConfig, str(written), overrides)
        phase = cfg.phases[i]
        assert cfg.only_phase == phase.name and not cfg.tracking.enabled
        assert phase.micro_batch_size == phase.global_batch_size == micro
        assert cfg.check_world(1)[phase.name] == 1
        assert cfg.zero.stage == winner["zero_stage"] and cfg.precision == "bf16"
        assert cfg.model.activation_checkpointing == winner["activation_checkpointing"]
        assert cfg.planned[phase.name]["budget_gib"] == result["budget_gib"]
        assert cfg.planned[phase.name]["memory_gib"] <= result["budget_gib"]


def test_smoke_run_list_is_small(tmp_path: Path) -> None:
    runs = _dry_run(tmp_path, GPU_CHECK_SMOKE="1")
    assert "fused_adam_build" not in runs
    for name in BENCH_RUNS:
        options = runs[name]
        assert options[options.index("--device") + 1] == "cpu"
        assert options[options.index("--preset") + 1] == "tiny"
        assert options[options.index("--precision") + 1] == "fp32"
        assert options[options.index("--steps") + 1] == "2"
    assert "phases[0].max_steps=4" in runs["pretrain-demo"]


def _helper(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HELPER), *args], capture_output=True, text=True, check=False
    )


def test_helper_records_and_summarises(tmp_path: Path) -> None:
    jsonl = tmp_path / "runs.jsonl"
    out, err = tmp_path / "out", tmp_path / "err"
    bench = {"name": "p1-unpad", "seq_per_s": 1234.5, "tflops": 300.0, "mfu_real": 0.4}
    out.write_text("Loading extension module fused_adam...\n" + json.dumps(bench) + "\n")
    err.write_text("")
    common = ["--stdout", str(out), "--stderr", str(err), "--timeout", "90"]

    def record(name: str, rc: int, wall: float, *extra: str) -> subprocess.CompletedProcess[str]:
        return _helper(
            "record", str(jsonl), name, "--rc", str(rc), "--wall", str(wall), *common, *extra
        )

    assert record("p1-unpad", 0, 31.2).returncode == 0
    err.write_text("Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory\n")
    proc = record("p1-hf", 1, 5)
    assert proc.returncode == 1 and "FAILED" in proc.stdout
    out.write_text("no json here\n")
    err.write_text("")
    assert record("p1-pad", 124, 90).returncode == 1
    line = "12:00:00 INFO bertpipe.training.pretrain.trainer: phase1 step {s}/200 (global {s}): "
    line += "loss {l} mlm 1 nsp 0.6 mlm_acc 0.1 nsp_acc 0.5 lr 1.0e-03 {r} seq/s"
    points = ((20, 9.5, 100.0), (200, 6.25, 2500.5))
    err.write_text("\n".join(line.format(s=s, l=loss, r=r) for s, loss, r in points))
    out.write_text('{"phase1": {"steps": 200, "loss": 6.1}}\n')
    assert record("pretrain-demo", 0, 40, "--pretrain").returncode == 0
    _helper("skip", str(jsonl), "p2-unpad-compiled", "time budget: 50 s left")
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["name"] for r in records] == [
        "p1-unpad",
        "p1-hf",
        "p1-pad",
        "pretrain-demo",
        "p2-unpad-compiled",
    ]
    assert records[0]["seq_per_s"] == 1234.5 and records[0]["wall_s"] == 31.2
    assert "error" not in records[0]
    assert "out of memory" in records[1]["error"]
    assert records[2]["error"].startswith("timed out after 90 s")
    pre = records[3]
    assert (pre["first_step"], pre["first_loss"], pre["last_step"], pre["last_loss"]) == (
        20,
        9.5,
        200,
        6.25,
    )
    assert pre["last_window_seq_per_s"] == 2500.5 and pre["summary"]["phase1"]["steps"] == 200
    assert records[4]["skipped"].startswith("time budget")
    proc = _helper("summary", str(jsonl), "--elapsed", "300", "--budget", "465")
    assert proc.returncode == 0
    text = proc.stdout
    assert re.search(r"^p1-unpad\s+1,234\s", text, re.MULTILINE), text
    assert "FAILED p1-hf" in text and "FAILED p1-pad: timed out" in text
    assert "pretrain-demo: loss 9.5000 at step 20 -> 6.2500 at step 200" in text
    assert "skipped p2-unpad-compiled" in text
    assert "2 of 5 runs ok, 2 failed, 1 skipped; 300 s of a 465 s budget" in text


def test_training_and_the_benchmark_import_without_mlflow_or_beam() -> None:
    """The GPU machine has neither MLflow nor Beam; `bertpipe pretrain` and `bertpipe bench
    train` must not need them to start (MLflow is imported only when tracking is on)."""
    code = (
        "import sys\n"
        "for name in ('mlflow', 'apache_beam'):\n"
        "    sys.modules[name] = None  # any import of them raises ImportError\n"
        "import bertpipe.training.pretrain.trainer, bertpipe.training.pretrain.data.loader\n"
        "import bertpipe.training.core.engine\n"
        "import bertpipe.app.cli\n"
        "bertpipe.app.cli.build_parser()  # imports every command's module\n"
        "import os\n"
        "if os.path.exists('bertpipe/app/bench/train.py'):\n"
        "    import bertpipe.app.bench.train\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=_env()
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


# --------------------------------------------------------------------------- slow

# what the end-to-end smoke run runs, in the check's order: plan --fit, then the pre-training
# of its written config at both phases, each phase's peak memory recorded beside the plan
# (processes of ~3-14 s on CPU). The benchmark runs differ only in their arguments, which
# test_run_list_order_and_commands_are_accepted parses with bench train's own parser; bench
# train itself runs in tests/training/test_bench_train.py (transformers' model too) and
# torch.compile in tests/training/test_unpad.py; a benchmark's record and its row in the
# summary table: test_helper_records_and_summarises.
SMOKE_RUNS = ["plan-fit", "planned-p1", "planned-p2"]


@pytest.mark.integration
@pytest.mark.slow
def test_check_runs_end_to_end_in_smoke_mode(
    tmp_path: Path,
    pretrain_shards: Path,
) -> None:
    # the demo's layout: seq128 for phase 1; phase 2's folder is only read for its manifest
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "seq128").symlink_to(pretrain_shards / "seq128")
    (shards / "seq512").symlink_to(pretrain_shards / "seq128")
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(CHECK)],
        env=_env(
            OUT_DIR=str(out),
            GPU_CHECK_SMOKE="1",
            GPU_CHECK_SHARDS=str(shards),
            GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"),
            GPU_CHECK_ONLY="^(" + "|".join(SMOKE_RUNS) + ")$",
            DS_ACCELERATOR="cpu",
        ),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=1500,
    )
    log = (out / "gpu-check.log").read_text() if (out / "gpu-check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:] + log[-4000:]
    records = [json.loads(line) for line in (out / "gpu-check.jsonl").read_text().splitlines()]
    assert [r["name"] for r in records] == SMOKE_RUNS
    for r in records:
        assert "error" not in r and "skipped" not in r, r
    by_name = {r["name"]: r for r in records}
    fit = by_name["plan-fit"]
    assert fit["world_size"] == 1 and fit["budget_gib"] > 0
    for i, name in enumerate(("planned-p1", "planned-p2")):
        pre = by_name[name]
        assert (pre["first_step"], pre["last_step"], pre["max_steps"]) == (1, 2, 2)
        assert all(isinstance(pre[k], float) for k in ("first_loss", "last_loss"))
        assert pre["phase"] == f"phase{i + 1}"
        assert pre["planned_memory_gib"] == fit["winner"]["phases"][i]["memory_gib"]
        assert pre["budget_gib"] == fit["budget_gib"] and pre["peak_rss_gib"] > 0
        assert pre["measured_step_s"] > 0 and pre["planned_step_s"] > 0
    assert "logged losses" in log and "phase1 step 2/2" in log and "phase2 step 2/2" in log
    summary = (out / "gpu-check-summary.txt").read_text()
    assert "plan-fit: ZeRO" in summary and "peak RSS" in summary, summary
    assert f"{len(SMOKE_RUNS)} of {len(SMOKE_RUNS)} runs ok, 0 failed, 0 skipped" in summary
    assert json.loads((out / "gpu-check-env.json").read_text())["deepspeed"]
