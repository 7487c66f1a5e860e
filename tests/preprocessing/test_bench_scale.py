"""``bertpipe bench preprocess --scale-mb``: the scale bench runs the real CLI and reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bertpipe.preprocessing.synthetic import synthetic_text, write_synthetic_corpus

pytestmark = pytest.mark.integration


def test_synthetic_corpus_is_deterministic_and_document_shaped(tmp_path: Path) -> None:
    a = b"".join(synthetic_text(0.2, seed=3))
    assert a == b"".join(synthetic_text(0.2, seed=3)) != b"".join(synthetic_text(0.2, seed=4))
    assert 200_000 <= len(a) < 260_000 and a.endswith(b".\n\n")
    paths = write_synthetic_corpus(tmp_path, 0.2, files=3, seed=3)
    assert sum(p.stat().st_size for p in paths) == len(a)
    docs = [d for d in a.decode().split("\n\n") if d]
    sentences = [len(d.splitlines()) for d in docs]
    assert len(docs) > 20 and min(sentences) == 1 and max(sentences) > 20


def test_scale_bench_on_parquet_reports_one_json_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bertpipe.app.cli", "bench", "preprocess", "--scale-mb", "1",
         "--files", "2", "--format", "parquet", "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["format"] == "parquet" and result["workers"] == 1
    assert 0.9 < result["mb"] < 1.2 and result["instances"] > 5000
    assert result["peak_rss_mb"] > 100 and result["mb_per_s"] > 0
