"""Precision and fused-op checks against the device, before anything starts: simulated
hardware (a CPU without fp16, a GPU without bf16), and the real CLI paths."""

from __future__ import annotations

import pytest

from bertpipe.app.cli import main
from bertpipe.config import ConfigError
from bertpipe.training.core import hardware
from bertpipe.training.core.hardware import Hardware, check_hardware, gpu_by_name

CPU_NO_FP16 = Hardware("CPU Test", "cpu", fp16=False, bf16=True, why_not="no AVX-512 FP16")
V100 = Hardware("Tesla V100", "cuda", fp16=True, bf16=False, why_not="compute capability 7.0")
H100 = Hardware("H100", "cuda", fp16=True, bf16=True)


@pytest.mark.parametrize(
    ("hw", "precision", "fused", "key", "hint"),
    [
        (CPU_NO_FP16, "fp16", "auto", "precision", "use precision=bf16"),
        (V100, "bf16", "auto", "precision", "use precision=fp16"),
        (CPU_NO_FP16, "fp32", "deepspeed", "optimizer.fused", "use fused=auto"),
    ],
)
def test_unsupported_combinations_name_the_key_in_one_line(hw, precision, fused, key, hint):
    with pytest.raises(ConfigError) as err:
        check_hardware(hw, precision=precision, fused=fused)
    text = str(err.value)
    assert f"'{key}'" in text and hint in text and hw.name in text
    assert "\n" not in text


@pytest.mark.parametrize(
    ("hw", "precision", "fused"),
    [(CPU_NO_FP16, "bf16", "auto"), (CPU_NO_FP16, "fp32", "torch"), (V100, "fp16", "deepspeed"),
     (H100, "bf16", "torch"), (Hardware("?", "cuda", None, None), "bf16", "auto")],
)  # fmt: skip
def test_supported_combinations_pass(hw, precision, fused):
    check_hardware(hw, precision=precision, fused=fused)


def test_gpu_names_as_plan_takes_them():
    assert gpu_by_name("v100-32g").bf16 is False
    assert gpu_by_name("h100-pcie").bf16 is True
    assert gpu_by_name("a100-80g").bf16 is True
    assert gpu_by_name("t4").fp16 is True
    assert gpu_by_name("mystery-9000") is None


def test_local_cpu_reports_what_deepspeed_will_say(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    hw = hardware.local_hardware()
    assert hw.kind == "cpu" and hw.bf16 is True
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    assert hw.fp16 == bool(CPU_Accelerator().is_fp16_supported())


def _not_reached():
    raise AssertionError("the process group was started before the hardware check")


def _simulate_cpu_without_fp16(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setattr(hardware, "cpu_fp16_supported", lambda: False)


def test_pretrain_refuses_fp16_before_the_process_group(monkeypatch, capsys, tmp_path):
    """On a CPU without fp16 (simulated where the CPU has it) ``pretrain`` ends in one line
    naming the key, before any process group, DeepSpeed engine or output exists."""
    _simulate_cpu_without_fp16(monkeypatch)
    monkeypatch.setattr("bertpipe.training.pretrain.trainer.init_distributed", _not_reached)
    out = tmp_path / "run"
    code = main(["pretrain", "--config", "demo", f"output={out}", "precision=fp16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("bertpipe: error: config key 'precision'")
    assert "use precision=bf16" in err[0]
    assert not out.exists()


def test_plan_checks_against_the_named_gpu(monkeypatch, capsys):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    code = main(["plan", "--config", "bert-large-lamb", "--gpu", "v100-32g", "--nodes", "4",
                 "--gpus-per-node", "8"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "config key 'precision'" in err and "use precision=fp16" in err
    assert main(["plan", "--config", "bert-large-lamb", "--gpu", "h100", "--nodes", "4",
                 "--gpus-per-node", "8"]) == 0  # fmt: skip


def test_plan_checks_a_cpu_run_against_this_cpu(monkeypatch, capsys):
    _simulate_cpu_without_fp16(monkeypatch)
    assert main(["plan", "--config", "demo", "precision=fp16"]) == 2
    assert "use precision=bf16" in capsys.readouterr().err


def test_finetune_refuses_fp16_before_the_process_group(monkeypatch, tmp_path):
    _simulate_cpu_without_fp16(monkeypatch)
    monkeypatch.setattr("bertpipe.finetuning.run.init_distributed", _not_reached)
    from bertpipe.config import load_config
    from bertpipe.finetuning.config import FinetuneConfig
    from bertpipe.finetuning.run import run_finetuning

    cfg = load_config(
        FinetuneConfig, None, [f"output={tmp_path / 'ft'}", "precision=fp16", "init_from=null"]
    )
    with pytest.raises(ConfigError, match=r"'precision'.*use precision=bf16"):
        run_finetuning(cfg)
    assert not (tmp_path / "ft").exists()
