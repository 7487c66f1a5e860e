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
    assert len(calls) == 1 and calls[0].startswith("training/engine.py:"), calls


def test_both_loops_step_and_save_through_the_core() -> None:
    for loop in ("training/trainer.py", "finetuning/loop.py"):
        source = (ROOT / loop).read_text()
        for name in (
            "build_engine(",
            "OptimizerStep(",
            "SkipGuard(",
            "Cadence(",
            "save_and_prune(",
        ):
            assert name in source, f"{loop} does not use {name[:-1]}"
        for own in ("engine.backward(", ".save_checkpoint(", "signal.signal("):
            assert own not in source, f"{loop} does {own[:-1]} itself"
