"""``bertpipe export``: a pre-training checkpoint -> a folder ``transformers`` loads.

The folder holds ``config.json`` and ``model.safetensors`` (``BertForPreTraining``, or
``ModernBertForMaskedLM`` for the modernbert family, the vocabulary padding stripped) plus the
tokenizer's ``vocab.txt``, ``tokenizer.json`` and ``tokenizer_config.json``, so
``AutoModelForMaskedLM.from_pretrained(folder)`` and ``AutoTokenizer.from_pretrained(folder)``
both work, and so does ``model.init_from`` of bertpipe's own pre-training and fine-tuning.
The tokenizer files are written from the tokenizer the data was made with (never copied), so
``AutoTokenizer`` gives exactly its ids (``preprocessing.tokenizer.tokenizer_files``).

Weights come from the fp32 master copies where DeepSpeed keeps them (ZeRO 1-3:
``deepspeed.utils.zero_to_fp32``), else from the module weights of the model-states file
(ZeRO 0), cast to fp32.

Lineage: ``bertpipe_export.json`` records the checkpoint and ``source_run_id``, the MLflow run
of the pre-training (which the checkpoint's ``bertpipe_state.json`` holds as
``mlflow_run_id``); fine-tuning from the export tags its run with it. When the pre-training
was tracked, the export is recorded in that run (tag ``bertpipe.export.path``, artifact
``exports/<tag>/bertpipe_export.json``) and logged as its model output ``pretrained-model``
(MLflow's ``transformers`` flavour, task ``fill-mask``: safetensors weights, no pickle, loads
with ``transformers`` alone); its id is the export's ``mlflow_model_id``. With ``register``
that logged model is also registered as a new version of the name (``registered_model``).
An export to object storage is logged from the local folder written before the upload.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bertpipe import fsio, staging, tracking
from bertpipe.errors import BertpipeError
from bertpipe.training import checkpoint as ckpt
from bertpipe.training.models.families import config_from_dict, pretraining_model

log = logging.getLogger(__name__)

__all__ = ["export_checkpoint", "load_checkpoint_model", "tokenizer_folder"]


class ExportError(BertpipeError):
    """The checkpoint or tokenizer cannot be exported."""


@contextlib.contextmanager
def _weights_only_everywhere() -> Iterator[None]:
    """Every ``torch.load`` in the block unpickles tensors, plain data and DeepSpeed's few
    checkpoint classes only, whatever its caller asks (torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD);
    a file holding anything else raises instead of running it."""
    import os
    import pickle

    from bertpipe.training.core.engine import UnsafeCheckpointError, _checkpoint_globals

    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(_checkpoint_globals()):
            yield
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UnsafeCheckpointError(
            f"a checkpoint file holds objects a checkpoint must not ({first[:200]}); refusing "
            "to unpickle it"
        ) from None
    finally:
        if before is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = before


def _module_weights(folder: str, tag: str, zero_stage: int) -> dict[str, torch.Tensor]:
    """The fp32 module weights of checkpoint ``tag`` (gathered from ZeRO's partitions; a
    checkpoint on object storage is downloaded for this)."""
    with ckpt.loadable(folder, tag, None, None) as local:
        return _local_module_weights(local, tag, zero_stage)


def _local_module_weights(folder: str, tag: str, zero_stage: int) -> dict[str, torch.Tensor]:
    path = Path(folder) / tag
    if zero_stage > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with _weights_only_everywhere():  # zero_to_fp32 asks torch.load for full unpickling
            return dict(get_fp32_state_dict_from_zero_checkpoint(folder, tag=tag))
    files = sorted(path.glob("mp_rank_*_model_states.pt"))
    if not files:
        raise ExportError(f"{path} has no mp_rank_00_model_states.pt: not a DeepSpeed checkpoint")
    states = torch.load(files[0], map_location="cpu", weights_only=True)
    return {k: v.float() for k, v in states["module"].items()}


def load_checkpoint_model(
    folder: str, tag: str | None = None
) -> tuple[torch.nn.Module, ckpt.CheckpointState]:
    """Our model (``BertForPreTraining`` or ``ModernBertForMaskedLM``, as the checkpoint
    records) with the weights of checkpoint ``tag``, in fp32. Default: ``latest``, or the
    newest whole checkpoint with one warning line when ``latest`` is damaged, as a resume
    takes it; a named ``tag`` that is damaged, or no whole checkpoint at all, is one line
    (:class:`~bertpipe.training.checkpoint.CheckpointDamagedError`, exit 2)."""
    tag = resolve_tag(folder, tag)
    state, _ = ckpt.read_state(folder, tag, 0)
    if not state.model:
        raise ExportError(f"{folder}/{tag} does not record its model config")
    model = pretraining_model(config_from_dict(state.model))
    weights = _module_weights(folder, tag, state.zero_stage)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if k not in ("cls.predictions.decoder.weight", "decoder.weight")]
    if missing or unexpected:
        raise ExportError(
            f"{folder}/{tag} does not match its model config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    model.eval()
    return model, state


def resolve_tag(folder: str, tag: str | None) -> str:
    """The checkpoint an export or a fine-tuning start reads: ``tag`` checked whole (sizes
    and checksums its markers list), or the newest whole one."""
    if tag is not None:
        ckpt.check_named(folder, tag)
        return tag
    found = ckpt.latest_complete_tag(folder, taking="reading")
    if found is None:
        raise ExportError(f"{folder} has no `latest` checkpoint: pass --tag global_stepN")
    return found


def tokenizer_folder(state: ckpt.CheckpointState, tokenizer: str | None) -> str:
    """``tokenizer`` if given, else the tokenizer the checkpoint's first phase was made with."""
    if tokenizer:
        return tokenizer
    phases = state.config.get("phases") or []
    if not phases:
        raise ExportError("the checkpoint records no phases: pass --tokenizer")
    manifest_url = fsio.join(phases[0]["data"], "manifest.json")
    try:
        with fsio.open_url(manifest_url, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ExportError(f"{manifest_url} is gone: pass --tokenizer") from None
    manifest = fsio.parse_json(raw, manifest_url, "pass --tokenizer")
    try:
        return str(manifest["config"]["tokenizer"])
    except (KeyError, TypeError):
        raise ExportError(f"{manifest_url} names no tokenizer: pass --tokenizer") from None


EXPORT_INFO = "bertpipe_export.json"
TAG_EXPORT_PATH = "bertpipe.export.path"
TAG_REGISTERED = "bertpipe.registered_model"
MODEL_NAME = "pretrained-model"
"""The name of the export's logged model in the pre-training run."""


def export_checkpoint(
    folder: str,
    out: str,
    *,
    tag: str | None = None,
    tokenizer: str | None = None,
    tracking_uri: str | None = None,
    register: str | None = None,
    track: bool = True,
    uri_key: str = "--tracking-uri",
) -> dict[str, Any]:
    """Write checkpoint ``tag`` of ``folder`` as an HF folder ``out`` with its tokenizer.

    With ``track``, the export is recorded in the pre-training's MLflow run, at
    ``tracking_uri`` or else the tracking URI of the checkpoint's config (a warning, not an
    error, if that store or run cannot be reached). ``register``: also register the model
    under this name in the MLflow model registry (any MLflow failure is then an error naming
    ``uri_key``)."""
    from bertpipe.preprocessing.tokenizer import load_tokenizer, tokenizer_files

    tag = resolve_tag(folder, tag)
    model, state = load_checkpoint_model(folder, tag)
    source = tokenizer_folder(state, tokenizer)
    tok = load_tokenizer(source)
    if tok.get_vocab_size() != model.config.vocab_size:
        raise ExportError(
            f"tokenizer {source} has {tok.get_vocab_size()} tokens, the model "
            f"{model.config.vocab_size}: pass the tokenizer the data was made with"
        )
    # written from the tokenizer, not copied: a tokenizer_config.json of an older bertpipe
    # lacked settings that transformers then took defaults for (Korean turned into [UNK])
    extra = tokenizer_files(tok, model_max_length=model.config.max_position_embeddings)
    with staging.writable_copy(out) as target:  # object storage: uploaded at the end
        info = _write_export(model, state, folder, str(tag), source, tok, target, extra)
        if track or register:
            info_path = target / EXPORT_INFO
            recorded = _record_in_mlflow(
                state, out, str(tag), tracking_uri, register, uri_key, info_path
            )
            if recorded:
                info.update(recorded)
                info_path.write_text(json.dumps(info, indent=2) + "\n")
    log.info("exported %s to %s", info["checkpoint"], out)
    return info


def _write_export(
    model: torch.nn.Module,
    state: ckpt.CheckpointState,
    folder: str,
    tag: str,
    source: str,
    tok: Any,
    target: Path,
    extra: dict[str, bytes],
) -> dict[str, Any]:
    """The HF folder and its ``bertpipe_export.json`` in local folder ``target``."""
    from bertpipe.preprocessing.tokenizer import SpecialTokens, tokenizer_checksum
    from bertpipe.training.models.hf import save_hf_folder

    specials = SpecialTokens.from_tokenizer(tok, source)
    token_ids = {"cls": specials.cls, "sep": specials.sep, "pad": specials.pad}
    save_hf_folder(model, target, extra_files=extra, token_ids=token_ids)
    info: dict[str, Any] = {
        "checkpoint": f"{folder}/{tag}",
        "global_step": state.global_step,
        "phase": state.phase,
        "tokenizer": source,
        "tokenizer_sha256": tokenizer_checksum(tok),
        "source_run_id": state.mlflow_run_id,
        "mlflow_run_id": state.mlflow_run_id,  # the older name of source_run_id
        "data_sha256": state.data_sha256,
    }
    (target / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _tracking_uri(state: ckpt.CheckpointState, tracking_uri: str | None) -> str | None:
    """``tracking_uri``, else the pre-training config's (None if it was not tracked)."""
    settings = dict(state.config.get("tracking") or {})
    if tracking_uri:
        settings["uri"] = tracking_uri
    elif not settings.get("enabled", True):
        return None
    known = {k: v for k, v in settings.items() if k in ("uri", "experiment", "enabled")}
    return tracking.TrackingConfig(**known).resolved_uri()


def _record_in_mlflow(
    state: ckpt.CheckpointState,
    out: str,
    tag: str,
    tracking_uri: str | None,
    register: str | None,
    uri_key: str,
    info_path: Path,
) -> dict[str, Any]:
    """Record the export (the local folder holding ``info_path``) in the pre-training run: tag
    it, log it as the run's model output (registered too with ``register``) and log its info
    file there. Returns what to add to the export's info."""
    run_id = state.mlflow_run_id
    uri = _tracking_uri(state, tracking_uri)
    if uri is None or (run_id is None and not register):
        if register:
            raise tracking.RegistryError(
                uri_key, "the pre-training was not tracked in MLflow: pass the tracking URI"
            )
        return {}
    problem = None
    experiment_id = None
    if uri.startswith("sqlite:///") and not os.path.exists(uri[len("sqlite://") :]):
        problem = "no such database"
    else:
        try:
            if run_id is not None:
                experiment_id = tracking.connect_to_run(uri, run_id)
            else:
                experiment = (state.config.get("tracking") or {}).get("experiment", "bertpipe")
                experiment_id = tracking.connect(
                    tracking.TrackingConfig(uri=uri, experiment=experiment)
                )
        except Exception as exc:  # unreachable server, unknown run, broken store
            problem = " ".join(str(exc).split())[:300] or type(exc).__name__
    if problem is not None:
        message = f"cannot record the export in MLflow run {run_id} at {uri}: {problem}"
        if register:
            raise tracking.RegistryError(uri_key, f"{message} (pass the right tracking URI)")
        log.warning("%s; the export is not recorded there (pass %s)", message, uri_key)
        return {}
    added: dict[str, Any] = {"tracking_uri": uri}
    logged = tracking.log_hf_model(
        info_path.parent,
        task="fill-mask",
        run_id=run_id,
        name=MODEL_NAME,
        register=register,
        uri_key=uri_key,
        experiment_id=experiment_id,
    )
    if logged is not None:
        added["mlflow_model_id"] = logged.model_id
        if logged.registered:
            added["registered_model"] = logged.registered
    if run_id is not None:
        where = str(out) if staging.is_remote(out) else str(Path(out).resolve())
        tracking.set_run_tag(run_id, TAG_EXPORT_PATH, where)
        if "registered_model" in added:
            tracking.set_run_tag(run_id, TAG_REGISTERED, added["registered_model"])
        info = json.loads(info_path.read_text())
        info.update(added)
        info_path.write_text(json.dumps(info, indent=2) + "\n")
        tracking.log_run_artifact(run_id, str(info_path), f"exports/{tag}")
        log.info("recorded the export in MLflow run %s (%s)", run_id, uri)
    return added
