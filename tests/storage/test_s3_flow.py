"""The whole flow on object storage, against a real S3 server on 127.0.0.1 and a real
``mlflow server`` whose artifact store is a bucket of that server: tokenizer trained from an
s3:// corpus, preprocess s3 -> s3 on 2 Beam worker processes, pre-training streaming its
shards from s3 with its checkpoints there, export from s3 to s3 (registered), fine-tuning
from the s3 export with its checkpoints on s3. Every stage is the real CLI in a child process
that knows the store only through AWS_ENDPOINT_URL and its keys, as a MinIO or Ceph user's
job would (the stages run through the CLI's ``main`` in the test's process). At the end, the
experiment as its users see it: a headless Chromium opens the server's runs table and each
stage's run must list its dataset and its model (:mod:`tests.browser`; without Chromium the
same fields are checked through the MLflow client and the browser part is skipped)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import (
    MlflowServer,
    parity_task,
    synthetic_documents,
    write_sentence_files,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("keep_logging")]

STAGES = ("tokenizer", "preprocess", "pretrain", "finetune")
"""The stages whose runs the UI check expects with a dataset and a model."""


def _bertpipe(s3, capfd: pytest.CaptureFixture[str], *args: str) -> dict:  # type: ignore[type-arg]
    """``bertpipe ARGS`` (the CLI's main, in this process: the stages' own processes, Beam's
    workers, see the same environment); its JSON summary. Nothing it prints holds a secret."""
    from bertpipe.app.cli import main

    started = time.monotonic()
    code = main(list(args))
    out, err = capfd.readouterr()
    assert code == 0, (args[0], err[-4000:])
    assert s3.env["AWS_SECRET_ACCESS_KEY"] not in out + err
    print(f"{args[0]}: {time.monotonic() - started:.1f} s", file=sys.__stderr__)
    lines = [line for line in out.strip().splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def test_whole_flow_on_s3(
    s3, tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow
    import s3fs

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")

    fs = s3fs.S3FileSystem()
    b = s3.bucket
    write_sentence_files(tmp_path / "corpus", synthetic_documents(200, seed=1))
    fs.put(str(tmp_path / "corpus"), f"{b}/corpus".removeprefix("s3://"), recursive=True)

    server = MlflowServer(tmp_path / "mlflow", artifacts=f"{b}/mlflow", env=s3.child_env())
    (tmp_path / "mlflow").mkdir()
    server.start()
    try:
        track = [f"tracking.uri={server.uri}", "tracking.experiment=s3-flow"]
        _bertpipe(s3, capfd, "tokenizer", "train", f"input.paths=[{b}/corpus]",
                  f"output={b}/tokenizer", "vocab_size=400", "min_frequency=1",
                  *track)  # fmt: skip
        stats = _bertpipe(
            s3, capfd, "preprocess", f"input.paths=[{b}/corpus]", f"tokenizer={b}/tokenizer",
            f"output={b}/shards", "dupe_factor=2", "heldout_fraction=0.1", *track,
            "phases=[{name: seq64, max_seq_length: 64, max_predictions_per_seq: 10, "
            "num_shards: 4}]", "--", "--direct_running_mode=multi_processing",
            "--direct_num_workers=2",
        )  # fmt: skip
        assert stats["seq64"]["shards"] == 4
        assert fs.exists(f"{b}/shards/seq64/manifest.json")
        summary = _bertpipe(
            s3, capfd, "pretrain", f"output={b}/pretrain", "model.preset=tiny",
            "model.max_position_embeddings=128", "precision=fp32", "zero.stage=0",
            f"phases=[{{name: phase1, data: {b}/shards/seq64, max_steps: 6, "
            "micro_batch_size: 8, global_batch_size: 8, learning_rate: 1.0e-3, warmup: 0.5}]",
            "data.num_workers=0", "checkpoint.every_steps=3", "eval.max_batches=1",
            f"checkpoint.local_dir={tmp_path / 'staging'}", *track,
        )  # fmt: skip
        assert summary["phase1"]["global_step"] == 6
        checkpoints = f"{b}/pretrain/checkpoints"
        assert fs.cat(f"{checkpoints}/latest") == b"global_step6"
        info = _bertpipe(
            s3, capfd, "export", checkpoints, f"{b}/export", "--register", "bert-s3",
            "--tracking-uri", server.uri,
        )  # fmt: skip
        assert info["registered_model"] == "bert-s3/1"
        assert fs.exists(f"{b}/export/model.safetensors")
        assert fs.exists(f"{b}/export/bertpipe_export.json")

        train, dev = parity_task(tmp_path / "task")
        _bertpipe(
            s3, capfd, "finetune", f"init_from={b}/export", f"output={tmp_path / 'finetune'}",
            "task.family=table", "task.name=parity", f"task.train={train}",
            f"task.dev=[{dev}]", "epochs=2", "batch_size=8", "learning_rate=1e-3",
            f"checkpoint.dir={b}/finetune/checkpoints", "checkpoint.every_steps=2",
            f"checkpoint.local_dir={tmp_path / 'ft-staging'}", *track,
        )  # fmt: skip
        # a complete fine-tuning run removes its checkpoints, on the store too
        assert not fs.exists(f"{b}/finetune/checkpoints/latest")

        client = mlflow.MlflowClient(tracking_uri=server.uri)
        experiment = client.get_experiment_by_name("s3-flow")
        runs = client.search_runs([experiment.experiment_id])
        kinds = sorted(r.data.tags.get("bertpipe.stage", r.info.run_name) for r in runs)
        assert len(runs) >= 4, kinds
        finetune = next(r for r in runs if r.data.tags.get("bertpipe.task") == "parity")
        assert finetune.data.tags["bertpipe.source_run_id"] == info["source_run_id"]
        # the server keeps every artifact in the bucket, none on its local disk
        stored = fs.find(f"{b}/mlflow")
        assert any(p.endswith("bertpipe_export.json") for p in stored), stored[:20]
        assert any(finetune.info.run_id in p for p in stored)
        assert not (tmp_path / "mlflow" / "server-artifacts").exists()
        for run in runs:  # no credentials in any run's parameters or tags
            values = json.dumps({**run.data.params, **run.data.tags})
            assert s3.env["AWS_SECRET_ACCESS_KEY"] not in values
            assert s3.env["AWS_ACCESS_KEY_ID"] not in values

        stage_runs = {
            r.info.run_id: r.info.run_name
            for r in runs
            if r.data.tags.get("bertpipe.stage") in STAGES
            and not r.data.tags.get("mlflow.parentRunId")
        }
        stages = sorted(r.data.tags["bertpipe.stage"] for r in runs if r.info.run_id in stage_runs)
        assert stages == sorted(STAGES), kinds
        _check_ui(server.uri, experiment.experiment_id, stage_runs, tmp_path / "mlflow-runs.png")
    finally:
        server.stop()


def _check_ui(uri: str, experiment_id: str, runs: dict[str, str], screenshot: Path) -> None:
    """The experiment's runs table in a headless Chromium: it opens on the runs (not on the
    GenAI overview) and lists each of ``runs`` (id -> name) with its Dataset and Models
    cells filled; the same fields through the client as well. Without Chromium the client's
    check still runs and the browser part is skipped with the reason."""
    from tests.browser import check_runs_client, check_runs_in_browser, find_chromium

    rows, problems = check_runs_client(uri, experiment_id, runs)
    report = ["client:", *(f"  {rows[r].line()}" for r in runs if r in rows)]
    if find_chromium() is not None:
        started = time.monotonic()
        page, seen = check_runs_in_browser(uri, experiment_id, runs, screenshot)
        assert page.rendered is not None
        print(
            f"UI check: {time.monotonic() - started:.1f} s ({page.rendered.seconds:.1f} s in"
            f" Chromium for the last load, {page.rendered.budget_ms} ms of page time)",
            file=sys.__stderr__,
        )
        report += [f"browser ({page.rendered.url}, screenshot {page.rendered.screenshot}):"]
        report += [f"  {row.line()}" for row in page.rows.values()]
        problems = [f"table: {p}" for p in seen] + [f"store: {p}" for p in problems]
    assert not problems, "\n".join([*problems, *report])
    if find_chromium() is None:
        pytest.skip(
            "UI check: no Chromium (chromium-headless-shell, or $BERTPIPE_CHROMIUM): the runs'"
            " datasets and models were checked through the MLflow client only"
        )
