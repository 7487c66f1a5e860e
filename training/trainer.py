"""The pre-training loop: phases, DeepSpeed steps, metrics, evaluation, checkpoints.

Run by ``bertpipe pretrain`` on every rank (the ``deepspeed`` launcher starts one process per
GPU, on every node). Phases run in order; a later phase builds a fresh engine for its own
batch and schedule and starts from the previous phase's final checkpoint (module weights,
plus optimizer moments with ``optimizer_state: keep``). ``checkpoint.resume=auto`` continues
a run from its ``latest`` checkpoint: model, optimizer, LR schedule (DeepSpeed's state),
data position, every rank's RNG states and the MLflow run id (bertpipe's state), so a
resumed run on CPU in fp32 reproduces the uninterrupted run's losses exactly.

A SIGTERM (preemption) is turned into a flag that all ranks agree on at the next optimizer
step; the run then saves a checkpoint and exits with status 143.

Non-finite values: a step whose loss or gradient is NaN or infinite on any rank is skipped,
never applied (see :func:`_poisoned` and :func:`_skip_nonfinite_updates`), counted in
``train/skipped_steps``, and ``max_bad_steps`` such steps in a row stop the run
(:class:`NonFiniteError`). No checkpoint with non-finite weights is ever written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from bertpipe import fsio, tracking
from bertpipe.config import ConfigError, redacted, to_dict, to_yaml
from bertpipe.errors import BertpipeError
from bertpipe.fsio import RetryPolicy
from bertpipe.progress import ProgressLine
from bertpipe.training import checkpoint as ckpt
from bertpipe.training.config import PhaseSpec, PretrainConfig
from bertpipe.training.engine import DistInfo, build_engine, ds_config, init_distributed
from bertpipe.training.flops import mfu, peak_flops
from bertpipe.training.hardware import check_hardware, local_hardware
from bertpipe.training.model import BertForPreTraining, BertModelConfig, compile_layers
from bertpipe.training.step import BatchPrep, BatchStats

log = logging.getLogger(__name__)

__all__ = ["NonFiniteError", "PreemptedError", "run_pretraining"]

PREEMPTED_EXIT_CODE = 143

FAULT_NAN_STEPS = "BERTPIPE_FAULT_NAN_STEPS"
FAULT_RAISE_STEP = "BERTPIPE_FAULT_RAISE_STEP"
FAULT_RANK = "BERTPIPE_FAULT_RANK"


class PreemptedError(Exception):
    """The run was asked to stop (SIGTERM) and saved a checkpoint."""


class NonFiniteError(BertpipeError):
    """Too many consecutive steps with a non-finite loss or gradient, or non-finite weights
    at a checkpoint: the run stops without saving them (``bertpipe: error: ...``, status 2)."""


class _Faults:
    """Fault injection for tests, read from the environment (unset in real runs).

    ``BERTPIPE_FAULT_NAN_STEPS=5,6`` or ``=8-`` (global optimizer steps counted from 1; ``8-``
    is every step from 8 on) multiplies those steps' loss by NaN; ``BERTPIPE_FAULT_RAISE_STEP=6``
    raises ``RuntimeError`` before step 6's first forward pass; ``BERTPIPE_FAULT_RANK=1``
    limits both to that rank (default: every rank)."""

    def __init__(self, rank: int, environ: Any = os.environ) -> None:
        self.nan_steps: set[int] = set()
        self.nan_from: int | None = None
        self.raise_step: int | None = None
        only = environ.get(FAULT_RANK)
        if only is not None and int(only) != rank:
            return
        for item in filter(None, environ.get(FAULT_NAN_STEPS, "").replace(" ", "").split(",")):
            if item.endswith("-"):
                self.nan_from = int(item[:-1])
            elif "-" in item:
                first, last = (int(x) for x in item.split("-"))
                self.nan_steps.update(range(first, last + 1))
            else:
                self.nan_steps.add(int(item))
        raise_step = environ.get(FAULT_RAISE_STEP)
        self.raise_step = int(raise_step) if raise_step else None
        if self.nan_steps or self.nan_from is not None or self.raise_step is not None:
            log.warning(
                "fault injection (tests only): %s=%s %s=%s",
                FAULT_NAN_STEPS,
                environ.get(FAULT_NAN_STEPS),
                FAULT_RAISE_STEP,
                raise_step,
            )

    def nan(self, step: int) -> bool:
        return step in self.nan_steps or (self.nan_from is not None and step >= self.nan_from)

    def before_step(self, step: int) -> None:
        if step == self.raise_step:
            raise RuntimeError(f"fault injection: {FAULT_RAISE_STEP}={step}")


def _poisoned(loss: torch.Tensor) -> torch.Tensor:
    """The loss to back-propagate: the loss itself (x 1.0, bit for bit) when finite, else x NaN,
    so that a non-finite loss always makes every gradient NaN (a loss of inf can have finite
    gradients). The gradients' own reduction then carries a bad micro-batch of any rank to all
    ranks: the all-reduce at ZeRO 0, the gradient-norm all-reduce of DeepSpeed's ZeRO optimizer
    at stages 1-3. No device read."""
    finite = torch.isfinite(loss)
    return loss * torch.where(finite, torch.ones_like(loss), torch.full_like(loss, math.nan))


def _skip_nonfinite_updates(engine: Any) -> bool:
    """Make the engine skip steps with non-finite gradients where DeepSpeed does not.

    DeepSpeed's own optimizer wrappers (ZeRO 1-3, fp16, bf16) set ``overflow`` when the global
    gradient norm is not finite (at ZeRO 1/2 in fp32 too), skip the update, and the engine
    then counts ``skipped_steps`` and does not step the LR schedule. At ZeRO 0 in fp32 (and
    with ``torch_autocast``) the engine calls the client optimizer directly, which would write
    NaN into every weight. This wraps that optimizer's ``step`` to check the (already
    all-reduced, so identical on every rank) gradients first and to set ``overflow`` like
    DeepSpeed's wrappers do, so the engine's own skip accounting applies. It costs one device
    read per optimizer step, at ZeRO 0 only. Returns whether the guard was installed."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "overflow"):
        return False
    step = optimizer.step

    @functools.wraps(step)  # keeps the LR scheduler's mark on the wrapped step
    def guarded_step(*args: Any, **kwargs: Any) -> Any:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        total = torch.stack(torch._foreach_norm(grads)).sum() if grads else None
        optimizer.overflow = total is not None and not bool(torch.isfinite(total))
        if optimizer.overflow:
            return None
        return step(*args, **kwargs)

    optimizer.overflow = False
    optimizer.step = guarded_step
    return True


def _weights_finite(engine: Any, collective: bool = True) -> bool:
    """Whether every weight of the engine's model is finite (on all ranks if ``collective``).
    Under ZeRO 3 this rank's partition of each parameter is checked."""
    tensors = [getattr(p, "ds_tensor", p).detach() for p in engine.module.parameters()]
    checks = [torch.isfinite(t).all() for t in tensors if t.numel()]
    device = tensors[0].device if tensors else torch.device("cpu")
    bad = (~torch.stack(checks).all()).float().reshape(1) if checks else torch.zeros(1)
    bad = bad.to(device)
    if collective:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad.item() > 0)


class DataMismatchError(BertpipeError):
    """The phases' data do not fit together or the model."""


@dataclass
class PhaseData:
    """What a phase's manifest says."""

    url: str
    manifest: dict[str, Any]
    sha256: str

    @property
    def max_seq_length(self) -> int:
        return int(self.manifest["max_seq_length"])


def read_phase_data(phase: PhaseSpec, key: str, retry: Any = None) -> PhaseData:
    import hashlib

    from bertpipe.training.data import read_bytes

    url = fsio.join(phase.data, "manifest.json")
    try:
        raw = read_bytes(url, retry)  # transient storage errors retried (data.read_retries)
    except FileNotFoundError:
        raise ConfigError(
            f"{key}.data", f"{url} does not exist: run `bertpipe preprocess` for this phase first"
        ) from None
    manifest = json.loads(raw)
    if manifest.get("format") != "bertpipe.instances":
        raise DataMismatchError(f"{url} is not a bertpipe shard manifest")
    return PhaseData(phase.data, manifest, hashlib.sha256(raw).hexdigest())


def model_config(cfg: PretrainConfig, data: list[PhaseData]) -> BertModelConfig:
    """The model's config: the preset, the config's changes, the data's vocabulary."""
    first = data[0].manifest
    for d in data[1:]:
        if d.manifest["tokenizer_sha256"] != first["tokenizer_sha256"]:
            raise DataMismatchError(
                f"{d.url} was made with another tokenizer than {data[0].url}: all phases must "
                "share one tokenizer"
            )
    if cfg.model.init_from:
        from bertpipe.training.hf import load_hf_folder

        model_cfg, _ = load_hf_folder(cfg.model.init_from)
        # the architecture is the checkpoint's; how it is trained is this config's
        model_cfg = dataclasses.replace(
            model_cfg,
            hidden_dropout=cfg.model.hidden_dropout,
            attention_dropout=cfg.model.attention_dropout,
            activation_checkpointing=cfg.model.activation_checkpointing,
        )
        if model_cfg.vocab_size != first["vocab_size"]:
            raise DataMismatchError(
                f"model.init_from has a vocabulary of {model_cfg.vocab_size}, the data "
                f"{first['vocab_size']}: use the tokenizer the model was trained with"
            )
    else:
        model_cfg = BertModelConfig.preset(
            cfg.model.preset,
            vocab_size=int(first["vocab_size"]),
            pad_token_id=int(first["special_token_ids"]["pad"]),
            **cfg.model.overrides(),
        )
    for i, d in enumerate(data):
        if d.max_seq_length > model_cfg.max_position_embeddings:
            raise ConfigError(
                f"phases[{i}].data",
                f"holds sequences of {d.max_seq_length} tokens but the model has "
                f"{model_cfg.max_position_embeddings} positions: raise "
                "model.max_position_embeddings",
            )
    return model_cfg


class _StopFlag:
    """Set by SIGTERM; checked collectively at every optimizer step."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        self._previous = signal.signal(signal.SIGTERM, self._handler)

    def uninstall(self) -> None:
        signal.signal(signal.SIGTERM, getattr(self, "_previous", signal.SIG_DFL))

    def _handler(self, signum: int, frame: object) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)


class _Window:
    """Sums over the optimizer steps since the last log line (this rank). Losses and counts
    stay on the device, so that no step waits for the device; what the batches held and cost
    (:class:`~bertpipe.training.step.BatchStats`) and the time spent waiting for data are host
    sums."""

    FIELDS = ("loss", "mlm_loss", "nsp_loss", "mlm_correct", "mlm_count", "nsp_correct")
    HOST_FIELDS = ("sequences", "tokens", "padded_tokens", "flops", "padded_flops", "data_wait")

    def __init__(self, device: torch.device) -> None:
        self.sums = torch.zeros(len(self.FIELDS), dtype=torch.float64, device=device)
        self.batch = BatchStats()
        self.data_wait = 0.0
        self.steps = 0
        self.lr = 0.0
        self.started = time.monotonic()

    def add(self, out: Any, stats: BatchStats, accumulation: int) -> None:
        values = torch.stack(
            [
                out.loss.detach().double() / accumulation,
                out.mlm_loss.detach().double() / accumulation,
                out.nsp_loss.detach().double() / accumulation,
                out.mlm_correct.double(),
                out.mlm_count.double(),
                out.nsp_correct.double(),
            ]
        )
        self.sums += values
        self.batch += stats

    def reduce(self, world: int) -> dict[str, float]:
        b = self.batch
        host = [b.sequences, b.real_tokens, b.padded_tokens, b.flops, b.padded_flops]
        values = torch.cat(
            [self.sums, torch.tensor([*host, self.data_wait], dtype=torch.float64).to(self.sums)]
        )
        dist.all_reduce(values)
        total = dict(zip(self.FIELDS + self.HOST_FIELDS, values.tolist(), strict=True))
        seconds = max(time.monotonic() - self.started, 1e-9)
        steps = max(self.steps, 1)
        return {
            "loss": total["loss"] / steps / world,
            "mlm_loss": total["mlm_loss"] / steps / world,
            "nsp_loss": total["nsp_loss"] / steps / world,
            "mlm_accuracy": total["mlm_correct"] / max(total["mlm_count"], 1.0),
            "nsp_accuracy": total["nsp_correct"] / max(total["sequences"], 1.0),
            "samples_per_s": total["sequences"] / seconds,
            "tokens_per_s": total["tokens"] / seconds,
            "padding_fraction": 1.0 - total["tokens"] / max(total["padded_tokens"], 1.0),
            "tflops_per_device": total["flops"] / seconds / world / 1e12,
            "padded_tflops_per_device": total["padded_flops"] / seconds / world / 1e12,
            "data_wait_fraction": total["data_wait"] / world / seconds,
        }


def _memory_metrics(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {
            "memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            "memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    import resource

    return {"memory_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def _loss_scale(engine: Any) -> float | None:
    optimizer = engine.optimizer
    for name in ("cur_scale", "loss_scale"):
        value = getattr(optimizer, name, None)
        if isinstance(value, int | float):
            return float(value)
    return None


class Trainer:
    """One pre-training job on this rank. Build it, then call :meth:`run`."""

    def __init__(self, cfg: PretrainConfig, info: DistInfo) -> None:
        self.cfg = cfg
        self.info = info
        self.world = info.world_size
        self.accumulation = cfg.check_world(self.world)
        retry = RetryPolicy(cfg.data.read_retries, cfg.data.read_retry_delay)
        self.data = [read_phase_data(p, f"phases[{i}]", retry) for i, p in enumerate(cfg.phases)]
        self.model_cfg = model_config(cfg, self.data)
        self.folder = cfg.checkpoint_dir
        self.stop = _StopFlag()
        self.run_id: str | None = None
        self.global_step = 0
        self.samples_seen = 0
        self.skipped_steps = 0  # steps not applied for non-finite values, all phases
        self.bad_streak = 0  # consecutive skipped steps up to the last one
        self.faults = _Faults(info.rank)
        self.peak = self._peak_flops()

    # ---------------------------------------------------------------- set-up

    def _peak_flops(self) -> float | None:
        if self.cfg.device_peak_tflops:
            return self.cfg.device_peak_tflops * 1e12
        if self.info.device.type != "cuda":
            return None
        return peak_flops(torch.cuda.get_device_name(self.info.device), self.cfg.precision)

    def new_model(self) -> BertForPreTraining:
        """The phase's model: the same initial weights on every rank, compiled if asked."""
        torch.manual_seed(self.cfg.seed)  # the same initial weights on every rank
        model = BertForPreTraining(self.model_cfg)
        if self.cfg.model.init_from:
            from bertpipe.training.hf import load_hf_folder, load_into

            _, weights = load_hf_folder(self.cfg.model.init_from)
            load_into(model, weights, strict_heads=False)
        torch.manual_seed(self.cfg.seed + 1000 * self.info.rank)  # dropout differs per rank
        if self.cfg.model.compile:
            compile_layers(model)
        return model

    def _start(self) -> tuple[int, str | None]:
        """(first phase to run, checkpoint tag to resume from)."""
        resume = self.cfg.checkpoint.resume
        if resume == "none":
            if ckpt.has_checkpoints(self.folder):
                raise ConfigError(
                    "checkpoint.resume",
                    f"is none but {self.folder} holds checkpoints: resume with auto, or use "
                    "another output / checkpoint.dir",
                )
            tag = None
        elif resume == "auto":
            tag = ckpt.latest_tag(self.folder)
        else:
            tag = resume
        names = [p.name for p in self.cfg.phases]
        if self.cfg.only_phase is not None:
            index = names.index(self.cfg.only_phase)
            if tag is None and index > 0:
                tag = ckpt.phase_end_tag(self.folder, names[index - 1])
                if tag is None:
                    raise ConfigError(
                        "only_phase",
                        f"{self.cfg.only_phase} starts from {names[index - 1]}'s final checkpoint, "
                        f"which is not in {self.folder}: run {names[index - 1]} first",
                    )
            return index, tag
        if tag is None:
            return 0, None
        state, _ = ckpt.read_state(self.folder, tag, self.info.rank)
        index = state.phase_index + (1 if self._complete(state) else 0)
        return index, tag

    # ---------------------------------------------------------------- the run

    def run(self) -> dict[str, Any]:
        first, tag = self._start()
        if tag is not None:  # refuse a resume into other data (checkpoint.allow_data_change)
            state, _ = ckpt.read_state(self.folder, tag, self.info.rank)
            current = {p.name: d.sha256 for p, d in zip(self.cfg.phases, self.data, strict=True)}
            ckpt.check_data(state, current, tag, self.cfg.checkpoint.allow_data_change)
        self.stop.install()
        last = len(self.cfg.phases) - 1 if self.cfg.only_phase is None else first
        summary: dict[str, Any] = {}
        try:
            with self._tracking(tag):
                for index in range(first, last + 1):
                    summary[self.cfg.phases[index].name] = self._run_phase(index, tag)
                    tag = ckpt.latest_tag(self.folder)
        finally:
            self.stop.uninstall()
        return summary

    @contextlib.contextmanager
    def _tracking(self, tag: str | None) -> Iterator[None]:
        """The MLflow run (rank 0 only): the one recorded in the checkpoint, or a new one."""
        if tag is not None:
            state, _ = ckpt.read_state(self.folder, tag, self.info.rank)
            self.run_id = state.mlflow_run_id
            self.global_step = state.global_step
            self.samples_seen = state.samples_seen
            self.skipped_steps = state.skipped_steps
        if not self.info.is_main:
            yield
            return
        tags = {
            f"{tracking.TAG_DATA_CHECKSUM}.{p.name}": d.sha256
            for p, d in zip(self.cfg.phases, self.data, strict=True)
        }
        tags["bertpipe.tokenizer_sha256"] = self.data[0].manifest["tokenizer_sha256"]
        with tracking.start_run(
            self.cfg.tracking,
            "pretrain",
            config=self.cfg if self.run_id is None else None,
            run_name=self.cfg.tracking.run_name or "pretrain",
            tags=tags,
            parent_run_id=self.cfg.tracking.tags.get(tracking.TAG_PARENT),
            resume_run_id=self.run_id,
            buffer=tracking.buffer_path(self.cfg.output),
        ) as run:
            if run is not None:
                self.run_id = run.info.run_id
                tracking.log_dict(asdict(self.model_cfg), "model_config.json")
            yield

    def _run_phase(self, index: int, tag: str | None) -> dict[str, Any]:
        from bertpipe.training.data import PretrainingData

        cfg, phase = self.cfg, self.cfg.phases[index]
        accumulation = self.accumulation[phase.name]
        model = self.new_model()
        engine, dsconf = build_engine(model, cfg, phase, self.world)
        if _skip_nonfinite_updates(engine):
            log.debug("ZeRO 0: non-finite gradients are checked before each update")
        phase_step = 0
        data_state: dict[str, int] | None = None
        if tag is not None:
            phase_step, data_state = self._restore(engine, index, tag)
        loader = PretrainingData(
            phase.data,
            "train",
            micro_batch_size=phase.micro_batch_size,
            rank=self.info.rank,
            world_size=self.world,
            seed=cfg.seed,
            num_workers=cfg.data.num_workers,
            shuffle_blocks=cfg.data.shuffle_blocks,
            read_retries=cfg.data.read_retries,
            read_retry_delay=cfg.data.read_retry_delay,
            verify_checksums=cfg.data.verify_checksums,
        )
        if data_state is not None:
            loader.load_state_dict(data_state)
        if self.info.is_main:
            self._log_phase_start(index, dsconf, loader)
        seq_len = self.data[index].max_seq_length
        progress = (
            ProgressLine(phase.name, phase.max_steps, initial=phase_step, unit="step")
            if self.info.is_main
            else None
        )
        window = _Window(self.info.device)
        batches = iter(loader)
        ended = phase_step >= phase.max_steps
        prep = BatchPrep(self.model_cfg, self.info.device, unpad=cfg.model.unpad)
        done = (phase_step, loader.state_dict())  # the last completed step and data position
        try:
            while not ended:
                window.lr = float(engine.optimizer.param_groups[0]["lr"])  # this update's rate
                skipped_before = engine.skipped_steps
                self.faults.before_step(self.global_step + 1)
                for _ in range(accumulation):
                    waited = time.perf_counter()
                    host = next(batches)
                    window.data_wait += time.perf_counter() - waited
                    batch, stats = prep(host)
                    out = engine(**batch)
                    if self.faults.nan(self.global_step + 1):
                        out.loss = out.loss * math.nan
                    engine.backward(_poisoned(out.loss))
                    engine.step()
                    window.add(out, stats, accumulation)
                phase_step += 1
                self.global_step += 1
                self.samples_seen += phase.micro_batch_size * accumulation
                done = (phase_step, loader.state_dict())
                window.steps += 1
                # DeepSpeed's host-side count: no device read (its ZeRO optimizer, or the
                # ZeRO 0 guard, already read the all-reduced gradient norm in the step)
                skipped = engine.skipped_steps - skipped_before
                self.skipped_steps += skipped
                self.bad_streak = self.bad_streak + 1 if skipped else 0
                if skipped and self.info.is_main:
                    log.warning(
                        "%s step %d (global %d): non-finite loss or gradient, update skipped "
                        "(%d in a row, %d in all; the run stops at %d in a row)",
                        phase.name,
                        phase_step,
                        self.global_step,
                        self.bad_streak,
                        self.skipped_steps,
                        cfg.max_bad_steps,
                    )
                too_many = self.bad_streak >= cfg.max_bad_steps
                ended = phase_step >= phase.max_steps
                if progress is not None:  # host only: the bar, or a log line every minute
                    progress.update(phase_step)
                logging_now = phase_step % cfg.log_every_steps == 0 or ended or too_many
                # the stop flag costs a device read: only every few steps, never in between
                stopping = (
                    logging_now or phase_step % cfg.checkpoint.preemption_check_steps == 0
                ) and self.stop.agreed(self.info.device)
                if logging_now:
                    self._log_window(engine, window, phase, phase_step, progress)
                    window = _Window(self.info.device)
                if too_many:
                    raise NonFiniteError(
                        f"{phase.name} step {phase_step} (global {self.global_step}): "
                        f"{self.bad_streak} steps in a row had a non-finite loss or gradient "
                        f"(max_bad_steps={cfg.max_bad_steps}); none was applied and nothing "
                        f"was saved, the latest checkpoint is "
                        f"{ckpt.latest_tag(self.folder) or 'none'}: lower the learning rate or "
                        "check the data, then resume"
                    )
                if cfg.eval.every_steps and phase_step % cfg.eval.every_steps == 0 and not ended:
                    self._evaluate(engine, index)
                every = cfg.checkpoint.every_steps
                if stopping or ended or (every and phase_step % every == 0):
                    if self.bad_streak and not (stopping or ended):
                        # keep the last good checkpoint `latest` (and unpruned) during a streak
                        log.warning(
                            "%s step %d: checkpoint deferred, the last %d steps were skipped",
                            phase.name,
                            phase_step,
                            self.bad_streak,
                        )
                    else:
                        self._save(
                            engine,
                            index,
                            phase_step,
                            ended,
                            loader.state_dict(),
                            good=not self.bad_streak,
                        )
                if stopping:
                    if progress:
                        progress.close()
                    raise PreemptedError(f"stopped by SIGTERM at {phase.name} step {phase_step}")
        except (PreemptedError, NonFiniteError):
            raise
        except Exception:
            self._save_after_error(engine, index, *done)
            raise
        finally:
            # stop the loader's workers now (they ignore SIGTERM), not at interpreter exit
            batches.close()
        if progress:
            progress.close()
        metrics = self._evaluate(engine, index)
        del engine
        return {"steps": phase_step, "global_step": self.global_step, **metrics, "seq_len": seq_len}

    def _complete(self, state: ckpt.CheckpointState) -> bool:
        """Whether the checkpoint's phase is done by *this* config's step count (raising
        ``max_steps`` of a finished phase continues it)."""
        return state.phase_step >= self.cfg.phases[state.phase_index].max_steps

    def _restore(self, engine: Any, index: int, tag: str) -> tuple[int, dict[str, int] | None]:
        """Load checkpoint ``tag`` into this phase's engine; returns (phase step, data state)."""
        phase = self.cfg.phases[index]
        state, rank_state = ckpt.read_state(self.folder, tag, self.info.rank)
        same_phase = state.phase_index == index and not self._complete(state)
        if same_phase:
            engine.load_checkpoint(self.folder, tag=tag)
            if rank_state is not None and state.world_size == self.world:
                ckpt.restore_rng(rank_state["rng"])
                data = rank_state["data"]
            else:  # another world size: same data position in samples, fresh RNG streams
                consumed = state.data["batches"] * state.world_size // self.world
                data = {"epoch": state.data["epoch"], "batches": consumed}
                torch.manual_seed(self.cfg.seed + 1000 * self.info.rank + state.global_step)
                log.warning(
                    "resuming on %d ranks from %d: RNG streams restart",
                    self.world,
                    state.world_size,
                )
            log.info("resumed %s at step %d from %s", phase.name, state.phase_step, tag)
            return state.phase_step, data
        # a new phase from the previous phase's final checkpoint
        keep = phase.optimizer_state == "keep"
        engine.load_checkpoint(
            self.folder,
            tag=tag,
            load_optimizer_states=keep,
            load_lr_scheduler_states=False,
            load_module_only=not keep,
        )
        scheduler = engine.lr_scheduler
        for group, base in zip(engine.optimizer.param_groups, scheduler.base_lrs, strict=True):
            group["lr"] = base * scheduler.lr_lambdas[0](0)
        log.info(
            "%s starts from %s (%s optimizer state)", phase.name, tag, "kept" if keep else "fresh"
        )
        return 0, None

    def _save(
        self,
        engine: Any,
        index: int,
        phase_step: int,
        ended: bool,
        data: dict[str, int],
        *,
        good: bool = True,
    ) -> None:
        phase = self.cfg.phases[index]
        tag = f"global_step{self.global_step}"
        if not _weights_finite(engine):  # all ranks agree; never publish NaN weights
            raise NonFiniteError(
                f"{phase.name} step {phase_step}: the weights are not finite, so {tag} was not "
                f"saved; the latest checkpoint is {ckpt.latest_tag(self.folder) or 'none'}"
            )
        state = ckpt.CheckpointState(
            phase=phase.name,
            phase_index=index,
            phase_step=phase_step,
            global_step=self.global_step,
            phase_complete=ended,
            data=data,
            world_size=self.world,
            mlflow_run_id=self.run_id,
            samples_seen=self.samples_seen,
            model=asdict(self.model_cfg),
            zero_stage=self.cfg.zero.stage,
            precision=self.cfg.precision,
            data_sha256={p.name: d.sha256 for p, d in zip(self.cfg.phases, self.data, strict=True)},
            config=redacted(to_dict(self.cfg)),
            skipped_steps=self.skipped_steps,
        )
        ckpt.save(engine, self.folder, tag, state, self.info.rank, good=good)
        if self.info.is_main:
            ckpt.prune(self.folder, self.cfg.checkpoint.keep_last)
        dist.barrier()

    def _save_after_error(
        self, engine: Any, index: int, phase_step: int, data: dict[str, int]
    ) -> None:
        """After an unexpected exception in the loop: save the last completed step if its
        state is finite and not saved yet, so the run resumes from there (not bit for bit:
        the RNG states are those at the error). One process only: with several ranks the
        others may be inside a collective of the step, and a save would hang."""
        phase = self.cfg.phases[index]
        tag = f"global_step{self.global_step}"
        if ckpt.latest_tag(self.folder) == tag:
            return
        if self.world > 1:
            log.error(
                "%s: no checkpoint after the error (%d ranks: the others may be waiting in a "
                "collective); resume from %s",
                phase.name,
                self.world,
                ckpt.latest_tag(self.folder),
            )
            return
        try:
            if self.bad_streak or not _weights_finite(engine, collective=False):
                log.error("%s: the state is not finite: no checkpoint after the error", phase.name)
                return
            ended = phase_step >= phase.max_steps
            self._save(engine, index, phase_step, ended, data)
            log.error("%s: saved %s after an error at step %d", phase.name, tag, phase_step + 1)
        except Exception:
            log.exception("%s: could not save a checkpoint after the error", phase.name)

    # ---------------------------------------------------------------- metrics

    def _log_phase_start(self, index: int, dsconf: dict[str, Any], loader: Any) -> None:
        phase = self.cfg.phases[index]
        log.info(
            "%s: %d steps, %d x %d x %d = %d sequences/step of %d tokens, %d batches per rank per "
            "epoch, ds_config %s",
            phase.name,
            phase.max_steps,
            phase.micro_batch_size,
            self.accumulation[phase.name],
            self.world,
            phase.global_batch_size,
            self.data[index].max_seq_length,
            loader.batches_per_epoch,
            json.dumps(dsconf),
        )
        if self.run_id is not None:
            tracking.log_dict(dsconf, f"ds_config_{phase.name}.json")

    def _log_window(
        self,
        engine: Any,
        window: _Window,
        phase: PhaseSpec,
        phase_step: int,
        progress: ProgressLine | None,
    ) -> None:
        metrics = window.reduce(self.world)
        metrics["lr"] = window.lr
        grad_norm = engine.get_global_grad_norm()
        if grad_norm is not None:  # inf or NaN after a skipped step: logged as such
            metrics["grad_norm"] = float(grad_norm)
        metrics["skipped_steps"] = self.skipped_steps
        lamb = getattr(engine.optimizer, "optimizer", engine.optimizer)
        if hasattr(lamb, "trust_ratio_stats"):  # LAMB: one device read, at log steps only
            # under ZeRO 1/2 of the tensors with a piece on this rank
            for key, value in lamb.trust_ratio_stats().items():
                metrics[f"trust_ratio_{key}"] = value
        scale = _loss_scale(engine)
        if self.cfg.precision == "fp16" and scale is not None:
            metrics["loss_scale"] = scale
        utilisation = mfu(metrics["tflops_per_device"] * 1e12, self.peak)
        if utilisation is not None:
            metrics["mfu"] = utilisation  # on real tokens
            metrics["mfu_padded"] = mfu(metrics["padded_tflops_per_device"] * 1e12, self.peak)
        metrics.update(_memory_metrics(self.info.device))
        metrics["phase_step"] = phase_step
        if not self.info.is_main:
            return
        named = {f"train/{k}": v for k, v in metrics.items()}
        if self.run_id is not None:
            tracking.log_metrics(named, step=self.global_step)
        if progress is not None and progress.tty:
            progress.update(
                phase_step, f"loss {metrics['loss']:.4f} lr {metrics['lr']:.2e}", force=True
            )
        else:
            log.info(
                "%s step %d/%d (global %d): loss %.4f mlm %.4f nsp %.4f mlm_acc %.3f nsp_acc %.3f "
                "lr %.3e %.1f seq/s | %s",
                phase.name,
                phase_step,
                phase.max_steps,
                self.global_step,
                metrics["loss"],
                metrics["mlm_loss"],
                metrics["nsp_loss"],
                metrics["mlm_accuracy"],
                metrics["nsp_accuracy"],
                metrics["lr"],
                metrics["samples_per_s"],
                progress.line(phase_step) if progress is not None else "",
            )
            if progress is not None:
                progress.touch()

    @torch.no_grad()
    def _evaluate(self, engine: Any, index: int) -> dict[str, float]:
        """Loss and accuracies on the phase's held-out split, averaged over all ranks."""
        from bertpipe.training.data import DataError, PretrainingData

        phase = self.cfg.phases[index]
        split = self.cfg.data.heldout_split
        if not self.data[index].manifest["splits"].get(split, {}).get("instances"):
            return {}
        try:
            loader = PretrainingData(
                phase.data,
                split,
                micro_batch_size=phase.micro_batch_size,
                rank=self.info.rank,
                world_size=self.world,
                seed=self.cfg.seed,
                num_workers=0,
                shuffle_blocks=1,
                train=False,
                max_batches=self.cfg.eval.max_batches or None,
                read_retries=self.cfg.data.read_retries,
                read_retry_delay=self.cfg.data.read_retry_delay,
                verify_checksums=self.cfg.data.verify_checksums,
            )
        except DataError as exc:  # too little held-out data for this many ranks
            if self.info.is_main:
                log.warning("%s: no evaluation: %s", phase.name, exc)
            return {}
        engine.eval()
        window = _Window(self.info.device)
        prep = BatchPrep(self.model_cfg, self.info.device, unpad=self.cfg.model.unpad)
        for host in loader:
            batch, stats = prep(host)
            out = engine(**batch)
            window.add(out, stats, 1)
            window.steps += 1
        engine.train()
        metrics = window.reduce(self.world)
        result = {
            k: metrics[k] for k in ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy")
        }
        if self.info.is_main:
            log.info(
                "%s eval at global step %d: %s",
                phase.name,
                self.global_step,
                json.dumps({k: round(v, 4) for k, v in result.items()}),
            )
            if self.run_id is not None:
                tracking.log_metrics(
                    {f"eval/{k}": v for k, v in result.items()}, step=self.global_step
                )
        return result


def run_pretraining(cfg: PretrainConfig) -> dict[str, Any]:
    """Join (or form) the distributed job and pre-train; rank 0 returns the summary."""
    # before the process group: a device that cannot run the config is one line per rank
    check_hardware(local_hardware(), precision=cfg.precision, fused=cfg.optimizer.fused)
    info = init_distributed()
    cfg.check_world(info.world_size)
    trainer = Trainer(cfg, info)
    if info.is_main:
        fsio.atomic_write_text(fsio.join(cfg.output, "pretrain.yaml"), to_yaml(cfg))
        for phase in cfg.phases:
            fsio.atomic_write_text(
                fsio.join(cfg.output, f"ds_config_{phase.name}.json"),
                json.dumps(ds_config(cfg, phase, info.world_size), indent=2),
            )
    try:
        summary = trainer.run()
    except PreemptedError as exc:
        log.warning("%s", exc)
        raise
    if info.is_main:
        fsio.atomic_write_text(fsio.join(cfg.output, "summary.json"), json.dumps(summary, indent=2))
    return summary
