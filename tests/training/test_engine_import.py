"""A rank's start-up imports, in a fresh interpreter (this test process has all of them):

- ``import_deepspeed`` imports DeepSpeed without the MLflow import DeepSpeed's autotuner makes
  on the way (~2 s of CPU in every rank), and MLflow still imports afterwards for bertpipe's
  tracking;
- ``build_engine`` builds a ZeRO engine and steps it without importing TorchInductor for the
  kernels of DeepSpeed's Muon optimizer (~2 s more), which bertpipe never uses, and leaves
  ``torch.compile`` working for a model compiled afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_CHECK = textwrap.dedent(
    """
    import os
    import sys
    from bertpipe.training.core.engine import import_deepspeed

    deepspeed = import_deepspeed()
    from deepspeed.autotuning import autotuner

    assert deepspeed.initialize and "mlflow" not in sys.modules, sorted(sys.modules)
    assert not autotuner.has_mlflow
    import mlflow  # bertpipe's tracking, after DeepSpeed: imports as before

    assert mlflow.MlflowClient is not None
    assert import_deepspeed() is deepspeed

    import tempfile

    import torch
    from bertpipe.training.core.config import OptimizerConfig, ZeroConfig
    from bertpipe.training.core.engine import EngineSpec, build_engine

    # a one-rank group on a file store: no port to race the suite's other jobs for
    store = tempfile.mktemp(prefix="bertpipe-engine-import-")
    os.environ["LOCAL_RANK"] = "0"
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1
    )
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    spec = EngineSpec(
        micro_batch_size=2, global_batch_size=2, world_size=1, zero=ZeroConfig(stage=2),
        precision="fp32", optimizer=OptimizerConfig(), learning_rate=1e-2,
        schedule=lambda step: 1.0,
    )
    engine, _ = build_engine(model, spec)
    before = [p.detach().clone() for p in model.parameters()]
    engine.backward(engine(torch.ones(2, 8)).square().sum())
    engine.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    from deepspeed.runtime.zero.muon import original_muon

    assert "torch._inductor.compile_fx" not in sys.modules, "Inductor imported for Muon"
    assert "TORCHDYNAMO_DISABLE" not in os.environ
    assert not hasattr(original_muon.zeropower_via_newtonschulz5, "_torchdynamo_orig_callable")

    def f(x):
        return x + 1

    compiled = torch.compile(f)  # a model compiled after the engine: compiled as before
    assert compiled is not f and hasattr(compiled, "_torchdynamo_orig_callable"), compiled
    print("ok")
    """
)


def test_a_rank_imports_neither_mlflow_with_deepspeed_nor_inductor_for_muon() -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK"}}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.pop("TORCHDYNAMO_DISABLE", None)
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
