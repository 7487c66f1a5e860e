"""Pre-training and fine-tuning share one training core (issue 14): one engine builder, one
guarded step, one checkpoint module. Read from the source, so a second copy fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = [
    p
    for folder in ("bertpipe", "preprocessing", "training", "finetuning")
    for p in sorted((ROOT / folder).rglob("*.py"))
]


def _calls(pattern: str) -> list[str]:
    found = []
    for path in PRODUCT:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(pattern, code) and "``" not in code:
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def test_one_deepspeed_initialize() -> None:
    calls = _calls(r"\bdeepspeed\.initialize\(")
    assert len(calls) == 1 and calls[0].startswith("training/core/engine.py:"), calls


def test_one_loop_for_both_stages() -> None:
    """One training loop (training/core/loop.py, issue 24) steps, guards, follows the cadence and
    saves for both stages; the stages build their engine and checkpoints from the core and
    hand them to it, and neither steps, saves or loads a checkpoint itself."""
    loop = (ROOT / "training/core/loop.py").read_text()
    for name in ("OptimizerStep(", "guard.record(", "cadence.after_step(", "checkpoints.save("):
        assert name in loop, f"training/core/loop.py does not use {name[:-1]}"
    assert "save_after_error(" in loop
    for stage in ("training/pretrain/trainer.py", "finetuning/run.py"):
        source = (ROOT / stage).read_text()
        for name in ("build_engine(", "run_loop(", "CheckpointManager(", "SkipGuard(", "Cadence("):
            assert name in source, f"{stage} does not use {name[:-1]}"
        for own in (
            "engine.backward(",
            "OptimizerStep(",
            ".save_checkpoint(",
            ".load_checkpoint(",
            "save_and_prune(",
            "signal.signal(",
            "CheckpointState(",
        ):
            assert own not in source, f"{stage} does {own[:-1]} itself"
    steppers = [p for p in PRODUCT if "OptimizerStep(" in p.read_text()]
    assert {str(p.relative_to(ROOT)) for p in steppers} <= {
        "training/core/step.py",
        "training/core/loop.py",
        "bertpipe/app/bench/train.py",  # benchmarks of the step itself
        "bertpipe/app/bench/memory.py",
    }, steppers


def test_the_stages_read_no_fault_variables_and_make_no_mlflow_call() -> None:
    """Fault injection is configured at the tests' entry points only (tests/faultenv.py);
    the stages talk to MLflow through bertpipe.tracking only."""
    assert not _calls(r"BERTPIPE_FAULT_"), _calls(r"BERTPIPE_FAULT_")
    stages = [p for p in PRODUCT if p.relative_to(ROOT).parts[0] != "bertpipe"]
    found = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in stages
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.match(r"\s*(import mlflow|from mlflow)", line)
    ]
    assert not found, found


def test_stage_modules_are_at_most_600_lines() -> None:
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for folder in ("training", "finetuning")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > 600
    ]
    assert not long, long
