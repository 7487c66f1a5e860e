"""The shapes of a learning-rate schedule, as multipliers of the peak rate for
``torch.optim.lr_scheduler.LambdaLR``: linear warmup to the peak, then linear (the paper) or
polynomial (NVIDIA) decay to zero (:func:`warmup_decay`), or warmup-stable-decay
(:func:`warmup_stable_decay`). Steps are optimizer steps (also under batch-size warmup,
whatever a step's batch). A pre-training phase picks its curve from its config
(:func:`bertpipe.training.pretrain.phases.lr_lambda`), fine-tuning its own; the rate itself
is set in :func:`bertpipe.training.core.optim.schedule_learning_rate`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["warmup_decay", "warmup_stable_decay"]


def warmup_decay(
    warmup: float,
    total: int,
    decay: str = "linear",
    power: float = 1.0,
    decay_from: str = "warmup",
) -> Callable[[int], float]:
    """Multiplier of the peak learning rate after ``step`` optimizer steps.

    Update ``u`` (1 ... total) uses ``u / warmup`` of the peak during warmup (``u <= warmup``;
    ``u < warmup`` with ``decay_from="start"``, as NVIDIA compares). After it, with exponent 1
    (linear) or ``power`` (poly):

    - ``decay_from="warmup"``: ``r ** exponent`` with ``r = (total - u + 1) / (total -
      warmup)``: the first update after warmup is at the peak, the last at
      ``1 / (total - warmup)`` of it;
    - ``decay_from="start"``: ``(1 - u / total) ** exponent``, the curve of NVIDIA's
      ``PolyWarmUpScheduler`` (stepped before each update): the first update after warmup
      is at ``(1 - (warmup + 1) / total) ** exponent``, the last at 0.
    """
    exponent = 1.0 if decay == "linear" else power

    def multiplier(step: int) -> float:
        update = step + 1  # the update about to be made, 1 ... total
        if decay_from == "start":
            if update < warmup:
                return update / warmup
            return math.pow(max(0.0, 1.0 - update / total), exponent)
        if update <= warmup:
            return update / warmup
        remaining = max(0.0, (total - update + 1) / max(1, total - warmup))
        return math.pow(remaining, exponent)

    return multiplier


def warmup_stable_decay(
    warmup: int,
    total: int,
    cooldown: int,
    shape: str = "1-sqrt",
    min_ratio: float = 0.0,
) -> Callable[[int], float]:
    """Warmup-stable-decay (a trapezoid): multiplier of the peak learning rate after ``step``
    optimizer steps; linear warmup, the peak, then a cooldown over the last ``cooldown`` of
    ``total`` steps to ``min_ratio`` of the peak.

    The schedule of ModernBERT (Warner et al. 2024, "Smarter, Better, Faster, Longer", arXiv
    2412.13663: trapezoidal warmup-stable-decay with a 1-sqrt decay) and of Hägele et al. 2024,
    "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations" (arXiv
    2405.18392: a constant rate and a short cooldown, linear or 1-sqrt, 1-sqrt the better,
    match a cosine schedule); MiniCPM (Hu et al. 2024, arXiv 2404.06395) named it WSD, with an
    exponential cooldown, not offered here.

    Update ``u`` (1 ... total) uses ``u / warmup`` of the peak while ``u <= warmup`` (as
    :func:`warmup_decay`), the peak until the cooldown starts after update ``s = total -
    cooldown``, then ``min_ratio + (1 - min_ratio) * f(p)`` with the cooldown's progress
    ``p = (u - 1 - s) / cooldown``: ``f(p) = 1 - sqrt(p)`` (``1-sqrt``) or ``1 - p``
    (``linear``). So the cooldown's first update is still at the peak and the rate after the
    last update (``p = 1``) is ``min_ratio``: the convention of the linear decay, whose last
    update is at ``1 / (total - warmup)`` of the peak (with warmup 0 and a linear cooldown
    over all steps the two curves are one). Steps past ``total`` stay at ``min_ratio``.
    """
    if shape not in ("1-sqrt", "linear"):
        raise ValueError(f"unknown cooldown shape {shape!r}")
    if cooldown < 1 or warmup < 0 or warmup + cooldown > total:
        raise ValueError(f"warmup {warmup} and cooldown {cooldown} do not fit in {total} steps")
    start = total - cooldown

    def multiplier(step: int) -> float:
        update = step + 1  # the update about to be made, 1 ... total
        if update <= warmup:
            return update / warmup
        if step < start:
            return 1.0
        progress = min(1.0, (step - start) / cooldown)
        left = 1.0 - (math.sqrt(progress) if shape == "1-sqrt" else progress)
        return min_ratio + (1.0 - min_ratio) * left

    return multiplier
