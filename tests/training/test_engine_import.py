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


_TAKEN_PORT = textwrap.dedent(
    """
    import socket

    import torch
    from bertpipe.training.core.engine import init_distributed

    # another process takes any port this one asked the kernel for (bind to port 0) the moment
    # this one closes that socket: what a "free port" found beforehand can meet on a busy host
    bind, close, asked, taken = socket.socket.bind, socket.socket.close, set(), []

    def bind_noting(self, address):
        bind(self, address)
        if address[1] == 0:
            asked.add(id(self))

    def close_then_taken(self):
        address = self.getsockname() if id(self) in asked else None
        close(self)
        if address is not None:
            other = socket.socket()
            other.bind(address)
            other.listen()
            taken.append(other)

    socket.socket.bind, socket.socket.close = bind_noting, close_then_taken
    info = init_distributed(timeout_minutes=1)
    total = torch.ones(1)
    torch.distributed.all_reduce(total)
    assert info.world_size == 1 and total.item() == 1.0 and not taken, taken
    print("ok")
    """
)


def test_a_one_process_job_keeps_the_port_its_store_binds() -> None:
    """A one-process run (no launcher, no MASTER_PORT) forms its group on a store that binds a
    port the kernel assigns, not on a port found free beforehand: one-process runs started
    together (an evaluation's trial workers) cannot take each other's."""
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _TAKEN_PORT], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
