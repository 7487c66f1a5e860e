"""Lineage, logged models and the MLflow model registry against a real `mlflow server`:
pre-train -> `bertpipe export --register` -> `bertpipe finetune register=...` from that export.
Both models are logged models (MLflow's `transformers` flavour) of the runs that made them,
registered from there; they load back with `mlflow.transformers.load_model` in a Python where
bertpipe cannot be imported, nothing is unpickled, and they compute what bertpipe's models
compute."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from bertpipe.app.cli import main
from bertpipe.config import load_config
from tests.cli_runner import run_cli
from tests.conftest import free_port, parity_task

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("keep_logging")]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")

# Run with `python -I -S`: no site processing, so no .pth file and no editable finder, hence
# no bertpipe; site-packages itself is put on sys.path by hand (argv[1]).
LOADER = r"""
import json, sys
sys.path.append(sys.argv[1])
try:
    import bertpipe
    bertpipe_importable = True
except ImportError:
    bertpipe_importable = False
import mlflow.transformers, torch
from safetensors.torch import load_file, save_file

events = []
def hook(event, args):
    if event == "pickle.find_class":
        events.append(f"pickle.find_class {args[0]}.{args[1]}")
    elif event == "open" and str(args[0]).endswith(PICKLE_SUFFIXES):
        events.append(f"open {args[0]}")
real_load = torch.load
def watched_load(*args, **kwargs):
    events.append("torch.load")
    return real_load(*args, **kwargs)
torch.load = torch.serialization.load = watched_load
sys.addaudithook(hook)

batch = load_file(sys.argv[2])
out, classes = {}, {}
for uri in sys.argv[4:]:
    components = mlflow.transformers.load_model(uri, return_type="components")
    model = components["model"]
    classes[uri] = [type(model).__name__, components["task"], model.training]
    with torch.no_grad():
        result = model(**batch)
    for key in ("prediction_logits", "seq_relationship_logits", "logits"):
        if getattr(result, key, None) is not None:
            out[f"{uri}:{key}"] = result[key].contiguous()
save_file(out, sys.argv[3])
print(json.dumps({"bertpipe": bertpipe_importable, "events": events, "classes": classes}))
""".replace("PICKLE_SUFFIXES", repr(PICKLE_SUFFIXES))


def _pretrain(shards: Path, out: Path, uri: str) -> Path:
    """Two steps of a tiny BERT (one phase, ZeRO 0), tracked at ``uri``; the checkpoints."""
    from bertpipe.training.pretrain.config import PretrainConfig
    from bertpipe.training.pretrain.trainer import run_pretraining

    cfg = load_config(
        PretrainConfig,
        None,
        [
            f"output={out}",
            "model.preset=tiny",
            "model.max_position_embeddings=128",
            f"phases=[{{name: phase1, data: {shards / 'seq64'}, max_steps: 2, "
            "micro_batch_size: 8, global_batch_size: 8, learning_rate: 1.0e-3, warmup: 0.5}]",
            "precision=fp32",
            "zero.stage=0",
            "data.num_workers=0",
            "log_every_steps=1",
            "eval.max_batches=1",
            f"tracking.uri={uri}",
            "tracking.experiment=registry-tests",
        ],
    )
    run_pretraining(cfg)
    return Path(cfg.checkpoint_dir)


def _inputs(vocab_size: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab_size, (2, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": mask}


def _load_without_bertpipe(
    uris: list[str], batch: dict[str, torch.Tensor], tracking_uri: str, tmp_path: Path
) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Load ``uris`` with ``mlflow.transformers`` in a Python that cannot import bertpipe and
    run ``batch`` through each; their outputs and what the process saw."""
    from safetensors.torch import load_file, save_file

    script, inputs, outputs = tmp_path / "load.py", tmp_path / "in.st", tmp_path / "out.st"
    script.write_text(LOADER)
    save_file(batch, str(inputs))
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": tracking_uri,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    site_packages = sysconfig.get_paths()["purelib"]
    proc = subprocess.run(
        [sys.executable, "-I", "-S", str(script), site_packages, str(inputs), str(outputs), *uris],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(str(outputs)), json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_one_safetensors_model(uri: str, tmp_path: Path) -> None:
    """The logged model's files: MLflow's transformers layout, safetensors weights, no pickle."""
    import mlflow

    local = Path(mlflow.artifacts.download_artifacts(uri, dst_path=str(tmp_path)))
    files = [p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()]
    assert "MLmodel" in files and "model/model.safetensors" in files, files
    assert not [f for f in files if f.endswith(PICKLE_SUFFIXES)], files
    requirements = (local / "requirements.txt").read_text()
    assert "transformers==" in requirements and "bertpipe" not in requirements


def test_export_and_finetune_log_and_register_models_that_load_without_bertpipe(
    pretrain_shards: Path,
    tmp_path: Path,
    mlflow_server: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mlflow
    import transformers

    from bertpipe import tracking
    from bertpipe.finetuning.config import FinetuneConfig
    from bertpipe.finetuning.run import load_task_model, run_finetuning
    from bertpipe.training import checkpoint as ckpt
    from bertpipe.training.export import load_checkpoint_model

    uri = mlflow_server
    checkpoints = _pretrain(pretrain_shards, tmp_path / "pretrain", uri)
    state, _ = ckpt.read_state(str(checkpoints), ckpt.latest_tag(str(checkpoints)), 0)
    pretrain_run = state.mlflow_run_id
    assert pretrain_run

    # export: the tracking URI comes from the checkpoint's config
    export = tmp_path / "hf"
    assert main(["export", str(checkpoints), str(export), "--register", "bert-pre"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["source_run_id"] == pretrain_run and info["registered_model"] == "bert-pre/1"
    pre_model = info["mlflow_model_id"]
    on_disk = json.loads((export / "bertpipe_export.json").read_text())
    assert on_disk["source_run_id"] == pretrain_run and on_disk["tracking_uri"] == uri
    assert on_disk["mlflow_model_id"] == pre_model and on_disk["registered_model"] == "bert-pre/1"
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run(pretrain_run)
    assert run.data.tags["bertpipe.export.path"] == str(export.resolve())
    assert run.data.tags["bertpipe.registered_model"] == "bert-pre/1"
    assert run.info.status == "FINISHED"  # recording the export does not reopen the run
    # the export is the run's model output (the runs table's Models column) ...
    assert [m.model_id for m in run.outputs.model_outputs] == [pre_model]
    mlflow.set_tracking_uri(uri)
    logged = mlflow.get_logged_model(pre_model)
    assert logged.source_run_id == pretrain_run and logged.name == "pretrained-model"
    assert logged.experiment_id == run.info.experiment_id
    # ... and the registered version is that logged model
    version = client.get_model_version("bert-pre", "1")
    assert version.source == f"models:/{pre_model}" and version.run_id == pretrain_run
    assert [str(v.version) for v in client.search_model_versions("name='bert-pre'")] == ["1"]
    tag = ckpt.latest_tag(str(checkpoints))
    exported = {a.path for a in client.list_artifacts(pretrain_run, f"exports/{tag}")}
    assert f"exports/{tag}/bertpipe_export.json" in exported
    _assert_one_safetensors_model("models:/bert-pre/1", tmp_path / "pre-files")

    # the registered model evaluated by its registry name: downloaded, its lineage from the
    # registry (the run that logged it), the same scores as the export's
    train, dev = parity_task(tmp_path / "task")
    suite = tmp_path / "suite.yaml"
    suite.write_text(f"name: parity\ntasks:\n  - {{name: parity, train: {train}, dev: [{dev}]}}\n")
    scores = {}
    for model in ("models:/bert-pre/1", str(export)):
        done = run_cli(
            [
                "evaluate",
                f"model={model}",
                f"suite={suite}",
                f"output={tmp_path / 'evaluate' / model.replace('/', '_')}",
                "protocol.learning_rates=[1e-3]",
                "protocol.seeds=[1]",
                "protocol.epochs=1",
                "protocol.batch_size=8",
                "threads_per_trial=1",
                f"tracking.uri={uri}",
                "tracking.experiment=registry-tests",
            ]
        )
        assert done.returncode == 0, done.stderr[-3000:]
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        scores[model] = summary["tasks"]
        suite_run = client.get_run(summary["run_id"])
        assert suite_run.data.tags["bertpipe.parent_run_id"] == pretrain_run
        if model == str(export):  # the logged model it evaluated is the suite run's input
            assert [m.model_id for m in suite_run.inputs.model_inputs] == [pre_model]
    assert scores["models:/bert-pre/1"] == scores[str(export)]

    # fine-tune from the export: lineage tag, the best model logged and registered
    cfg = load_config(
        FinetuneConfig,
        None,
        [
            f"init_from={export}",
            f"output_root={tmp_path / 'finetune'}",
            "task.family=table",
            "task.name=parity",
            f"task.train={train}",
            f"task.dev=[{dev}]",
            "epochs=2",
            "batch_size=8",
            "learning_rate=1e-3",
            f"tracking.uri={uri}",
            "tracking.experiment=registry-tests",
            "register=bert-task",
        ],
    )
    result = run_finetuning(cfg)
    assert result.registered_model == "bert-task/1" and result.model_id
    run = client.get_run(result.run_id)
    assert run.data.tags["bertpipe.source_run_id"] == pretrain_run
    assert run.data.tags["bertpipe.parent_run_id"] == pretrain_run
    assert run.data.tags["bertpipe.registered_model"] == "bert-task/1"
    assert result.model_id in [m.model_id for m in run.outputs.model_outputs]
    assert mlflow.get_logged_model(result.model_id).source_run_id == result.run_id
    assert "model" not in {a.path for a in client.list_artifacts(result.run_id)}
    version = client.get_model_version("bert-task", "1")
    assert version.source == f"models:/{result.model_id}" and version.run_id == result.run_id
    assert [str(v.version) for v in client.search_model_versions("name='bert-task'")] == ["1"]

    # both load in a Python without bertpipe, nothing unpickled, and compute bertpipe's own
    # models' logits bit for bit (fp32 on CPU)
    original, _ = load_checkpoint_model(str(checkpoints))
    original_task = load_task_model(Path(result.output) / "best")
    batch = _inputs(original.config.vocab_size)
    uris = ["models:/bert-pre/1", "models:/bert-task/1"]
    got, seen = _load_without_bertpipe(uris, batch, uri, tmp_path)
    assert seen["bertpipe"] is False
    assert seen["events"] == []  # no pickle.find_class, no torch.load, no pickle file opened
    assert seen["classes"] == {
        uris[0]: ["BertForPreTraining", "fill-mask", False],
        uris[1]: ["BertForSequenceClassification", "text-classification", False],
    }
    with torch.no_grad():
        want, want_task = original(**batch), original_task(**batch).logits
    assert torch.equal(got[f"{uris[0]}:prediction_logits"], want.mlm_logits)
    assert torch.equal(got[f"{uris[0]}:seq_relationship_logits"], want.nsp_logits)
    assert torch.equal(got[f"{uris[1]}:logits"], want_task)

    # a question-answering head: its task where transformers has one, the QA class either way
    from bertpipe.finetuning.heads import BertForQuestionAnswering
    from bertpipe.training.models.hf import save_hf_folder

    qa_folder = tmp_path / "qa"
    extra = {n: (export / n).read_bytes() for n in ("vocab.txt", "tokenizer.json")}
    save_hf_folder(BertForQuestionAnswering(original.config), qa_folder, extra_files=extra)
    qa = tracking.log_hf_model(
        qa_folder,
        task=tracking.hf_task(qa_folder),
        run_id=result.run_id,
        uri_key="tracking.uri",
    )
    assert qa is not None and qa.registered is None
    flavour = mlflow.models.get_model_info(qa.model_uri).flavors["transformers"]
    assert flavour["pipeline_model_type"] == "BertForQuestionAnswering"
    qa_pipeline = "question-answering" in transformers.pipelines.SUPPORTED_TASKS
    assert flavour["task"] == ("question-answering" if qa_pipeline else "feature-extraction")

    # an unreachable store: without register one warning and no model ...
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    dead = f"http://127.0.0.1:{free_port()}"
    mlflow.set_tracking_uri(dead)
    # a handler of its own on the logger: the CLI's logging set-up (if an earlier test in this
    # worker ran it) stops propagation, and without it a propagating one would see it twice
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    registry_log = logging.getLogger("bertpipe.tracking.registry")
    registry_log.addHandler(handler)
    try:
        dropped = tracking.log_hf_model(qa_folder, task="fill-mask", run_id="r", uri_key="x")
    finally:
        registry_log.removeHandler(handler)
        mlflow.set_tracking_uri(uri)
    assert dropped is None
    warnings = [r for r in seen if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and dead in warnings[0].getMessage()
    # ... and with it one line naming the option that holds the tracking URI
    argv = ["export", str(checkpoints), str(tmp_path / "hf2"), "--register", "x"]
    capsys.readouterr()
    assert main([*argv, "--tracking-uri", dead]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("bertpipe: error: --tracking-uri: ") and dead in last
