"""Same inputs, config and seed -> byte-identical shards, whatever the runner set-up."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

from bertpipe.config import load_config
from bertpipe.preprocessing.config import PreprocessConfig
from bertpipe.preprocessing.run import prepare, run_preprocess
from tests.preprocessing.helpers import output_digests

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _run(
    corpus: Path, tokenizer: Path, out: Path, beam_args: list[str], extra: tuple[str, ...]
) -> dict[str, str]:
    cfg = load_config(
        PreprocessConfig,
        None,
        [
            f"input.paths=[{corpus}]",
            f"tokenizer={tokenizer}",
            f"output={out}",
            "phases=[{name: seq64, max_seq_length: 64, max_predictions_per_seq: 10, num_shards: 5},"
            " {name: seq128, max_seq_length: 128, max_predictions_per_seq: 20, num_shards: 3}]",
            "dupe_factor=2",
            "heldout_fraction=0.05",
            "bucket_mb=0.03",  # several buckets, so work really is spread
            "split_mb=0.03",  # and every file read in byte ranges by several tasks
            "tokenize_batch_documents=16",  # several elements per file
            "instances_per_sample=64",
            "tracking.enabled=false",
            *extra,
        ],
    )
    assert len(prepare(cfg)[1]) > 6
    manifests = run_preprocess(cfg, beam_args)
    assert all(m["num_buckets"] > 3 for m in manifests.values())
    return output_digests(out)


# the paper's recipe, and the mlm objective's packing (static masks: its mask draws too)
OBJECTIVES = {"mlm+nsp": (), "mlm": ("objective=mlm", "masking.mode=static")}


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_in_process_multiprocessing_and_dask_agree(
    objective: str, dask_cluster: Any, corpus_dir: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    import distributed

    extra = OBJECTIVES[objective]
    in_process = _run(corpus_dir, tokenizer_dir, tmp_path / "a", [], extra)
    multi = _run(
        corpus_dir,
        tokenizer_dir,
        tmp_path / "b",
        ["--direct_running_mode=multi_processing", "--direct_num_workers=2"],
        extra,
    )
    try:
        dask = _run(
            corpus_dir,
            tokenizer_dir,
            tmp_path / "c",
            ["--runner=DaskRunner", f"--dask_client_address={dask_cluster.scheduler_address}"],
            extra,
        )
    finally:  # Beam's DaskRunner opens a client and leaves it open
        with contextlib.suppress(ValueError):
            distributed.default_client().close()
    assert len(in_process) > 10
    assert in_process == multi
    assert in_process == dask
