"""``import_deepspeed``: a rank imports DeepSpeed without the MLflow import DeepSpeed's
autotuner makes on the way (~2 s of CPU in every rank), and MLflow still imports afterwards
for bertpipe's tracking. In a fresh interpreter: this test process has both imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_CHECK = textwrap.dedent(
    """
    import sys
    from bertpipe.training.core.engine import import_deepspeed

    deepspeed = import_deepspeed()
    from deepspeed.autotuning import autotuner

    assert deepspeed.initialize and "mlflow" not in sys.modules, sorted(sys.modules)
    assert not autotuner.has_mlflow
    import mlflow  # bertpipe's tracking, after DeepSpeed: imports as before

    assert mlflow.MlflowClient is not None
    assert import_deepspeed() is deepspeed
    print("ok")
    """
)


def test_deepspeed_imports_without_mlflow_and_mlflow_imports_after() -> None:
    proc = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
