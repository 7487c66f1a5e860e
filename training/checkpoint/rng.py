"""A process's RNG states (Python, NumPy, torch CPU and CUDA) as JSON-safe values, saved in
each rank's checkpoint file so that a resume on the same world size continues every stream."""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as JSON-safe values."""
    state: dict[str, Any] = {
        "python": _jsonable(random.getstate()),
        "numpy": _numpy_state(),
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
    }
    if torch.cuda.is_available():
        state["cuda"] = [
            base64.b64encode(s.numpy().tobytes()).decode("ascii")
            for s in torch.cuda.get_rng_state_all()
        ]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(_tupled(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(
        torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8)
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [
                torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
                for s in state["cuda"]
            ]
        )


def _numpy_state() -> list[Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    return [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value


def _tupled(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tupled(v) for v in value)
    return value
