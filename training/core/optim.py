"""Optimizers for pre-training.

- :func:`param_groups`: weight decay on weight matrices and embeddings only, never on biases
  or LayerNorm parameters (as BERT does).
- :class:`Lamb`: LAMB (You et al., 2019) with a true per-layer trust ratio: each parameter
  tensor (one layer's weight matrix, bias, LayerNorm...) gets ``||w|| / ||update||``. It
  runs at ZeRO stages 0, 1 and 2 (the config refuses 3 and an offloaded optimizer). At
  stage 0 it sees whole tensors; with fp16/bf16 there DeepSpeed wraps it in its unfused
  mixed-precision optimizer, which keeps one fp32 master tensor per parameter, so the ratio
  stays per layer (tested); that wrapper takes one step with zero gradients when it is built
  (DeepSpeed 0.19), so the step count starts at 1 and, with the ratio ``1 / wd`` of an
  update ``wd * w``, the decayed tensors' masters start at ``(1 - lr) * w`` for the first
  rate ``lr`` of the schedule. At stages 1 and 2 DeepSpeed hands it flat partitions that cut
  through tensors; :func:`attach_zero_partitions` tells it where each tensor lies, and one
  all-reduce per step gives every rank the whole tensors' norms (see the class).
  The step is multi-tensor and free of host synchronisation.
- :func:`reset_step_counters`: restart the bias correction on kept moments, as NVIDIA's BERT
  phase 2 does (``optimizer.reset_step_per_phase``).
- :func:`build_optimizer`: AdamW as ``optimizer.fused`` says (by default torch's fused AdamW
  on GPU, its foreach AdamW on CPU), DeepSpeed's CPU Adam when the optimizer is offloaded;
  or LAMB.
- :func:`apply_settings`: a resume applies the config's (maybe changed) hyperparameters,
  rate and curve to a restored optimizer (the curves are in
  :mod:`bertpipe.training.core.schedules`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bertpipe.config import ConfigError
from bertpipe.training.core.config import OptimizerConfig

__all__ = [
    "Lamb",
    "ZeroPartition",
    "apply_settings",
    "attach_zero_partitions",
    "build_optimizer",
    "client_optimizer",
    "param_groups",
    "reset_step_counters",
    "schedule_learning_rate",
]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: decayed (weights of Linear layers and embeddings) and not decayed."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:  # tied weights appear once
            continue
        seen.add(id(param))
        if param.ndim < 2 or "LayerNorm" in name or name.endswith(".bias"):
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class Lamb(torch.optim.Optimizer):
    """LAMB as NVIDIA's BERT recipe runs it (apex ``FusedLAMB``, DeepLearningExamples).

    Per tensor, with bias-corrected Adam moments (fp32) and decoupled weight decay ``wd``:

        update = m_hat / (sqrt(v_hat) + eps) + wd * w
        w <- w - lr * ratio * update

    ``ratio = ||w|| / ||update||`` (1 when either norm is 0) for tensors in a group with
    weight decay; tensors without (biases, LayerNorm) take a plain Adam step, ratio 1, as
    apex does unless ``use_nvlamb`` (here ``trust_all=True``). No cap by default
    (``max_trust_ratio`` sets one). The global gradient-norm clipping NVIDIA does inside the
    optimizer happens before the step here: DeepSpeed's ``gradient_clipping``.

    The step is multi-tensor (``torch._foreach_*``, one pass per param group, device and
    dtype) and never waits for the device: the ratios stay on it, and
    :meth:`trust_ratio_stats` reads them (once) only when asked, for logging.

    Under ZeRO stages 1 and 2 DeepSpeed hands the optimizer one flat fp32 partition per
    group, a slice that cuts through many tensors. :func:`attach_zero_partitions` tells the
    optimizer where each tensor lies in it; each rank then sums the squares of its pieces of
    every tensor's weight and update, one all-reduce of 2 x (tensors in the group) floats
    gives every rank the whole tensors' norms, and each piece takes its tensor's ratio: the
    same step as on one rank with whole tensors. Every rank so holds the ratios of all the
    group's tensors, and :meth:`trust_ratio_stats` reports them all, on every rank.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        max_trust_ratio: float | None = None,
        trust_all: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "max_trust_ratio": max_trust_ratio,
            "trust_all": trust_all,
        }
        super().__init__(params, defaults)
        # the last step's ratios of the groups that use them, one 1-D tensor per pass
        self._last_ratios: dict[int, list[torch.Tensor]] = {}
        self._zero: dict[int, ZeroPartition] = {}  # id(flat partition) -> where tensors lie

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            ratios = []
            with_grad = [p for p in group["params"] if p.grad is not None]
            flat = [p for p in with_grad if id(p) in self._zero]
            for p in flat:
                ratios.append(self._update_partition(group, p, self._zero[id(p)]))
            whole = [p for p in with_grad if id(p) not in self._zero]
            for params in _by_device_and_dtype(whole):
                ratios.append(self._update(group, params))
            # by group: DeepSpeed's ZeRO optimizer steps one group at a time
            if ratios and self._uses_ratio(group):
                self._last_ratios[id(group)] = ratios
        return loss

    def _adam_updates(
        self, group: dict[str, Any], params: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The Adam direction plus decoupled decay for ``params`` (fp32), and the fp32
        weights (the parameters themselves when fp32)."""
        beta1, beta2 = group["betas"]
        states = [self.state[p] for p in params]
        for p, state in zip(params, states, strict=True):
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["step"] += 1
        grads = [p.grad.float() for p in params]  # type: ignore[union-attr]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        # bias corrections are host floats (the step counts are ints): no device read
        updates = list(torch._foreach_div(exp_avgs, [1 - beta1 ** s["step"] for s in states]))
        denom = torch._foreach_div(exp_avg_sqs, [1 - beta2 ** s["step"] for s in states])
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, group["eps"])
        torch._foreach_div_(updates, denom)
        del denom
        weights = [p.float() for p in params]
        if group["weight_decay"]:
            torch._foreach_add_(updates, weights, alpha=group["weight_decay"])
        return updates, weights

    @staticmethod
    def _uses_ratio(group: dict[str, Any]) -> bool:
        return bool(group["weight_decay"]) or bool(group["trust_all"])

    @staticmethod
    def _ratio(group: dict[str, Any], w_norm: torch.Tensor, u_norm: torch.Tensor) -> torch.Tensor:
        ratio = w_norm / u_norm
        if group["max_trust_ratio"] is not None:
            ratio = ratio.clamp(max=group["max_trust_ratio"])
        return torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))

    @staticmethod
    def _apply(group: dict[str, Any], params: list[torch.Tensor], updates: list[torch.Tensor]):
        if params[0].dtype != torch.float32:
            updates = [u.to(params[0].dtype) for u in updates]
        torch._foreach_add_(params, updates, alpha=-group["lr"])

    def _update(self, group: dict[str, Any], params: list[torch.Tensor]) -> torch.Tensor:
        """One step for whole tensors ``params`` (one group's, one device and dtype); returns
        their trust ratios, shape (len(params),), fp32."""
        updates, weights = self._adam_updates(group, params)
        if self._uses_ratio(group):
            w_norm = torch.stack(torch._foreach_norm(weights))
            u_norm = torch.stack(torch._foreach_norm(updates))
            ratio = self._ratio(group, w_norm, u_norm)
            per_tensor = ratio.unbind()
            torch._foreach_mul_(updates, per_tensor)
        else:
            ratio = torch.ones(len(params), device=params[0].device)
            per_tensor = ratio.unbind()
        for p, r in zip(params, per_tensor, strict=True):
            self.state[p]["trust_ratio"] = r
        self._apply(group, params, updates)
        return ratio

    def _update_partition(
        self, group: dict[str, Any], flat: torch.Tensor, part: ZeroPartition
    ) -> torch.Tensor:
        """One step for a ZeRO flat partition; returns the ratios of all the tensors of the
        group (of those held on any rank), shape (``part.num_tensors``,), or ones for the
        pieces held here when the group takes no ratio."""
        import torch.distributed as dist

        (update,), (weight,) = self._adam_updates(group, [flat])
        count = len(part.segments)
        if not self._uses_ratio(group):
            ratio = torch.ones(count, device=flat.device)
        else:
            u_views = [update[a:b] for a, b in part.segments]
            sums = torch.zeros(2, part.num_tensors, device=flat.device, dtype=torch.float32)
            if count:
                w_views = [weight[a:b] for a, b in part.segments]
                local = torch.stack(
                    [
                        torch.stack(torch._foreach_norm(w_views)),
                        torch.stack(torch._foreach_norm(u_views)),
                    ]
                )
                sums[:, part.first : part.first + count] = local.square()
            dist.all_reduce(sums, group=part.group)  # the one collective of the step
            norms = sums.sqrt()
            # the ratios of all the group's tensors, the same on every rank: the statistics
            # take them all (each tensor once), the pieces held here their own
            ratio = self._ratio(group, norms[0], norms[1])
            if count:
                torch._foreach_mul_(u_views, ratio[part.first : part.first + count].unbind())
        self._apply(group, [flat], [update])
        return ratio

    def trust_ratio_stats(self) -> dict[str, float]:
        """``min``, ``mean`` and ``max`` of the trust ratios of the tensors with weight decay
        (all tensors with ``trust_all``) the last step updated, in one device-to-host read;
        empty before the first step.

        Under ZeRO 1 and 2 they cover every tensor of the model, each once (also one that
        spans two ranks' partitions), and are the same on every rank (within rounding of the
        mean) and as on one rank: the step already all-reduced every tensor's norms, so each
        rank holds all ratios. No collective: a rank may call this alone."""
        last = [r for ratios in self._last_ratios.values() for r in ratios]
        if not last:
            return {}
        ratios = torch.cat([r.to(last[0].device) for r in last])
        if not ratios.numel():
            return {}
        low, mean, high = torch.stack([ratios.min(), ratios.mean(), ratios.max()]).tolist()
        return {"min": low, "mean": mean, "max": high}


@dataclass(frozen=True)
class ZeroPartition:
    """Where the tensors of one param group lie in this rank's ZeRO flat partition."""

    segments: tuple[tuple[int, int], ...]
    """(start, end) in the flat partition of each tensor piece it holds, in tensor order."""
    first: int
    """Index (in the group's flattening order) of the first tensor with a piece here."""
    num_tensors: int
    """Tensors in the whole group, on all ranks."""
    group: Any
    """The data-parallel process group the partitions are spread over."""


def zero_partitions(zero_optimizer: Any) -> list[tuple[torch.Tensor, ZeroPartition]]:
    """The flat fp32 partition of each param group of DeepSpeed's ZeRO stage 1/2 optimizer
    (``DeepSpeedZeroOptimizer``) with the layout of the tensors in it, from the optimizer's
    own bookkeeping: each tensor's offset in the flattened group (after round-robin
    reordering and alignment padding) and the partition size."""
    import torch.distributed as dist

    out = []
    for i, flat in enumerate(zero_optimizer.single_partition_of_fp32_groups):
        group = zero_optimizer.real_dp_process_group[i]
        size = int(zero_optimizer.partition_size[i])
        start = dist.get_rank(group=group) * size
        tensors = zero_optimizer.round_robin_bit16_groups[i]
        offsets = zero_optimizer.round_robin_bit16_offsets[i]
        held = []
        for k, (tensor, offset) in enumerate(zip(tensors, offsets, strict=True)):
            a, b = max(offset, start), min(offset + tensor.numel(), start + size)
            if a < b:
                held.append((k, a - start, b - start))
        first = held[0][0] if held else 0
        if [k for k, _, _ in held] != list(range(first, first + len(held))):
            raise RuntimeError("a ZeRO partition holds non-consecutive tensors")
        segments = tuple((a, b) for _, a, b in held)
        out.append((flat, ZeroPartition(segments, first, len(tensors), group)))
    return out


def attach_zero_partitions(optimizer: Lamb, zero_optimizer: Any) -> None:
    """Make ``optimizer`` (the client optimizer DeepSpeed wrapped at ZeRO stage 1 or 2)
    compute trust ratios of whole tensors across the ranks' partitions."""
    optimizer._zero = {id(flat): part for flat, part in zero_partitions(zero_optimizer)}


def client_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` that holds the per-parameter state: ``optimizer`` itself,
    or the one inside DeepSpeed's wrappers, followed through their ``.optimizer``: a DeepSpeed
    engine, its ZeRO 1/2 optimizer (``DeepSpeedZeroOptimizer``, whose inner optimizer's
    parameters are the flat fp32 partitions), ``BF16_Optimizer``, ``FP16_Optimizer`` and
    ``FP16_UnfusedOptimizer`` (ZeRO 0 with fp16/bf16). Raises :class:`TypeError` when there
    is none."""
    inner, seen = optimizer, set()
    while not isinstance(inner, torch.optim.Optimizer):
        seen.add(id(inner))
        nested = getattr(inner, "optimizer", None)
        if nested is None or id(nested) in seen:
            raise TypeError(f"{type(optimizer).__name__} holds no torch optimizer")
        inner = nested
    return inner


def reset_step_counters(optimizer: Any) -> int:
    """Set the step counter of every parameter state of ``optimizer`` to 0, keeping the
    moments, so the next step's bias correction is that of step 1 on them; returns how many
    parameter states were reset.

    This is what NVIDIA's BERT recipe does at the start of phase 2 (``optimizer_state: keep``
    with ``optimizer.reset_step_per_phase``). DeepLearningExamples,
    ``PyTorch/LanguageModeling/BERT/run_pretraining.py``, ``prepare_model_and_optimizer``:
    with ``--phase2`` it sets ``global_step = resume_step - phase1_end_step`` (0 when phase 2
    starts from phase 1's final checkpoint), then, before ``optimizer.load_state_dict``::

        for key in keys:
            checkpoint['optimizer']['state'][key]['step'] = global_step
        for iter, item in enumerate(checkpoint['optimizer']['param_groups']):
            checkpoint['optimizer']['param_groups'][iter]['step'] = global_step
            ... t_total, warmup and lr of phase 2

    apex's ``FusedLAMB`` keeps one counter per param group, ``group['step']``, adds 1 before
    each step and hands it to ``multi_tensor_lamb``, which divides the moments by
    ``1 - beta1 ** step`` and ``1 - beta2 ** step``: phase 2's first update uses
    ``1 - beta1`` and ``1 - beta2`` on phase 1's moments. On moments near their steady
    state that shrinks the Adam direction ``m_hat / sqrt(v_hat)`` by
    ``sqrt(1 - beta2**t) / (1 - beta1**t)`` at phase step ``t`` (betas 0.9, 0.999: 0.32 at
    step 1, 0.15 around step 12, 0.8 at step 1000); LAMB's trust ratio still gives a decayed
    tensor's update the norm ``||w||``, so there the share of weight decay changes, and the
    plain Adam steps of biases and LayerNorm are smaller. A phase-2 run resumed mid-phase
    continues the phase's own count (its checkpoint is named by the global step, the count
    is that minus ``phase1_end_step``), as a DeepSpeed checkpoint here does: call this only
    when a phase starts from the previous phase's checkpoint, never at a resume within a
    phase.

    Covers our :class:`Lamb` (``state["step"]``, an int), torch's AdamW (a tensor: zeroed in
    place, dtype and device kept), DeepSpeed's CPU Adam (an int; its kernel recomputes
    ``beta ** step`` when the count does not follow the last one) and optimizers that count
    per group as apex does (``group["step"]``, int or tensor). ``optimizer`` may be any of the
    wrappers :func:`client_optimizer` follows; under ZeRO 1/2 each rank resets the states of
    its own partitions, so call it on every rank.
    """
    inner = client_optimizer(optimizer)
    count = 0
    for state in inner.state.values():
        if isinstance(state, dict) and "step" in state:
            state["step"] = _zeroed(state["step"])
            count += 1
    for group in inner.param_groups:
        if "step" in group:
            group["step"] = _zeroed(group["step"])
    return count


def _zeroed(step: Any) -> Any:
    if isinstance(step, torch.Tensor):
        return step.zero_()  # in place: dtype, device and identity (CUDA graphs) kept
    return type(step)(0)


def _by_device_and_dtype(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` split by (device, dtype), in order: a foreach op takes one of each."""
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        buckets.setdefault((p.device, p.dtype), []).append(p)
    return list(buckets.values())


def build_optimizer(
    model: nn.Module, cfg: OptimizerConfig, lr: float, *, offload: bool
) -> torch.optim.Optimizer:
    """The configured optimizer over ``model``'s parameters (see the module docstring).

    Raises :class:`ConfigError` for an AdamW implementation this machine or setup cannot use.
    """
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "lamb":  # its own multi-tensor step; the config refuses fused=deepspeed
        return Lamb(
            groups,
            lr=lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            max_trust_ratio=cfg.max_trust_ratio,
            trust_all=cfg.trust_ratio == "all",
        )
    if offload:
        if cfg.fused != "auto":
            raise ConfigError(
                "optimizer.fused",
                f"{cfg.fused} does not apply with zero.offload_optimizer=cpu, where DeepSpeed's "
                "CPU Adam steps on the host; use fused=auto",
            )
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, adamw_mode=True)
    if cfg.fused == "deepspeed":
        if not torch.cuda.is_available():
            raise ConfigError(
                "optimizer.fused",
                "deepspeed (FusedAdam) needs CUDA, and none is available; use auto or torch",
            )
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, adam_w_mode=True)
    fused = cfg.fused == "torch" or (cfg.fused == "auto" and _steps_on_cuda(groups))
    return torch.optim.AdamW(
        groups, lr=lr, betas=cfg.betas, eps=cfg.eps, fused=fused, foreach=not fused
    )


def _steps_on_cuda(groups: list[dict[str, Any]]) -> bool:
    """Whether every parameter is, or will be, on a CUDA device when the optimizer steps.

    Both callers build the optimizer before ``deepspeed.initialize`` moves a CPU model to the
    GPU, so CPU parameters count as CUDA ones when CUDA is available. Should they stay on the
    CPU, torch's fused AdamW steps there too (torch 2.13 does; tested).
    """
    params = [p for group in groups for p in group["params"]]
    return torch.cuda.is_available() and all(p.device.type in ("cuda", "cpu") for p in params)


def apply_settings(
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    cfg: OptimizerConfig,
    peak: float,
    schedule: Callable[[int], float],
) -> torch.optim.lr_scheduler.LambdaLR:
    """Write ``cfg``'s hyperparameters over the ones a checkpoint restored into ``scheduler``'s
    optimizer, and return its schedule with ``peak`` and ``schedule`` from the update it had
    reached (:func:`schedule_learning_rate`): an unchanged config leaves every value as it
    was, bit for bit; a changed one trains with the new values from the next update on.

    The groups are :func:`param_groups`': the first is decayed, the second keeps weight decay
    0. LAMB's own group keys (``max_trust_ratio``, ``trust_all``) are set where present."""
    optimizer = scheduler.optimizer
    extra = {"max_trust_ratio": cfg.max_trust_ratio, "trust_all": cfg.trust_ratio == "all"}
    for i, group in enumerate(optimizer.param_groups):
        group["weight_decay"] = cfg.weight_decay if i == 0 else 0.0
        if "betas" in group:
            group["betas"] = tuple(cfg.betas)
        if "eps" in group:
            group["eps"] = cfg.eps
        for key, value in extra.items():
            if key in group:
                group[key] = value
    return schedule_learning_rate(optimizer, peak, schedule, scheduler.last_epoch)


def schedule_learning_rate(
    optimizer: torch.optim.Optimizer,
    peak: float,
    schedule: Callable[[int], float],
    updates: int = 0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning-rate schedule of ``optimizer`` from now on: update ``u`` (counted from 0,
    ``updates`` already made) uses ``peak * schedule(u)``; the next one's rate is set at once.

    The only place bertpipe sets a learning rate: when an engine is built (``updates`` 0) and
    when a resume applies the config's rate and curve to a restored optimizer (``updates``:
    the restored scheduler's count, see :func:`apply_settings`). It takes torch's public
    resume path: each group's ``initial_lr`` is the peak and the new ``LambdaLR`` starts at
    ``last_epoch = updates - 1``. DeepSpeed steps the schedule once per applied update (a
    skipped step is not counted) and saves it in its checkpoints.
    """
    for group in optimizer.param_groups:
        group["initial_lr"] = peak
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule, last_epoch=updates - 1)
