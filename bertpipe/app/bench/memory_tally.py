"""Counting the bytes a rank holds, for ``bertpipe bench memory``
(:mod:`bertpipe.app.bench.memory`, whose module doc says what goes in each category).

:class:`StorageTally` sums tensors by category with every storage counted once (keyed by
``untyped_storage().data_ptr()``, its whole ``nbytes``, so views into a flat buffer count the
buffer once); :func:`tally_engine` walks what a DeepSpeed engine and its client optimizer
hold into one. :class:`ActivationMeter` sums the tensors autograd saves for the backward
pass while it is active (parameters and views of them excluded).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

__all__ = ["ActivationMeter", "StorageTally", "tally_engine"]

WALK_DEPTH = 6
"""How many attributes, items and elements deep the walk of DeepSpeed's optimizer goes."""


def _storage(t: Any) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class StorageTally:
    """Bytes by category, each storage counted once (the first category that claims it)."""

    def __init__(self) -> None:
        self.owner: dict[int, str] = {}
        self.bytes: dict[str, int] = {}
        self.paths: dict[str, int] = {}

    def add(self, category: str, tensor: Any, path: str = "") -> None:
        import torch

        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        ptr, nbytes = _storage(tensor)
        if nbytes == 0 or ptr in self.owner:
            return
        self.owner[ptr] = category
        self.bytes[category] = self.bytes.get(category, 0) + nbytes
        if path:
            path = category + ": " + re.sub(r"\[[^]]*\]", "[i]", path)
            self.paths[path] = self.paths.get(path, 0) + nbytes

    def get(self, category: str) -> int:
        return self.bytes.get(category, 0)


def _walk(obj: Any, path: str, seen: set[int], depth: int) -> Iterator[tuple[str, Any]]:
    """(attribute path, tensor) for every tensor reachable from DeepSpeed's optimizer."""
    import torch
    from torch import nn

    if isinstance(obj, torch.Tensor):
        yield path, obj
        if obj.grad is not None:
            yield path + ".grad", obj.grad
        return
    if depth == 0 or id(obj) in seen or isinstance(obj, nn.Module | str | bytes | int | float):
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{path}[{k!r}]", seen, depth - 1)
    elif isinstance(obj, list | tuple | set):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}[{i}]", seen, depth - 1)
    elif type(obj).__module__.startswith(("deepspeed", "torch.optim", "bertpipe")):
        for k, v in vars(obj).items() if hasattr(obj, "__dict__") else ():
            yield from _walk(v, f"{path}.{k}", seen, depth - 1)


def tally_engine(engine: Any, model: Any) -> StorageTally:
    """Everything the rank's engine holds, by category (:mod:`bertpipe.app.bench.memory`'s
    module doc): ``parameters``, ``gradients``, ``optimizer_states``, ``buffers`` and ``other``."""
    tally = StorageTally()
    walked = list(_walk(engine.optimizer, "optimizer", set(), WALK_DEPTH))
    for path, t in walked:  # buckets first: a parameter's .grad may be a view of one
        if "ipg" in path.lower() or "bucket" in path.lower():
            tally.add("buffers", t, path)
    for p in model.parameters():
        tally.add("parameters", p.data, "module.parameters")
        ds_tensor = getattr(p, "ds_tensor", None)
        if ds_tensor is not None:
            tally.add("parameters", ds_tensor, "module.parameters.ds_tensor")
    for p in model.parameters():
        if p.grad is not None:
            tally.add("gradients", p.grad, "module.parameters.grad")
    client = engine.basic_optimizer
    for group in client.param_groups:
        for p in group["params"]:
            tally.add("optimizer_states", p.data, "client.params")
            if p.grad is not None:
                tally.add("gradients", p.grad, "client.params.grad")
    for state in client.state.values():
        for key, value in state.items():
            tally.add("optimizer_states", value, f"client.state.{key}")
    for path, t in walked:
        name = path.lower()
        if "grad" in name:
            tally.add("gradients", t, path)
        elif "fp32" in name:  # ZeRO 3's master partitions, not in the client's groups
            tally.add("optimizer_states", t, path)  # outside its step
        else:
            tally.add("other", t, path)
    return tally


class ActivationMeter:
    """Bytes of the tensors autograd saves for backward while active (parameters and views of
    them excluded, storages de-duplicated)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.saved: dict[int, int] = {}
        self._params: set[int] = set()
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> ActivationMeter:
        import torch

        self._params = {_storage(p.data)[0] for p in self.model.parameters()}
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def _pack(self, t: Any) -> Any:
        from torch import nn

        if not isinstance(t, nn.Parameter):
            ptr, nbytes = _storage(t)
            if ptr not in self._params:
                self.saved[ptr] = nbytes
        return t

    @property
    def total(self) -> int:
        return sum(self.saved.values())


def _unpack(t: Any) -> Any:
    return t
