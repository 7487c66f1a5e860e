"""The GPUs a planned run has: the world (nodes x GPUs per node) and each GPU's memory.

Part of ``bertpipe plan`` (:mod:`bertpipe.training.plan.plan`): the world comes from the plan's
options or the launcher's environment, the memory of a named GPU type from
:data:`GPU_MEMORY_GIB`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from bertpipe.errors import BertpipeError

__all__ = ["GPU_MEMORY_GIB", "World", "gpu_key", "gpu_memory_gib", "resolve_world"]

# Total memory of one GPU in GiB as nvidia-smi reports it (MiB / 1024), by the short names
# ``--gpu`` accepts. Plain "a100" and "v100" are taken as their smaller models, so a "fits"
# verdict is never optimistic; name the larger one (a100-80g, v100-32g) when that is the card.
GPU_MEMORY_GIB: Mapping[str, float] = {
    "h200": 140.4,
    "h100": 79.6,
    "h100-sxm": 79.6,
    "h100-pcie": 79.6,
    "h100-nvl": 93.6,
    "a100-80g": 80.0,
    "a100-40g": 40.0,
    "a100": 40.0,
    "l40s": 45.0,
    "a10g": 22.5,
    "a10": 22.5,
    "l4": 22.5,
    "v100-32g": 31.7,
    "v100-16g": 15.8,
    "v100": 15.8,
    "t4": 14.7,
}


@dataclass(frozen=True)
class World:
    """The GPUs of the run: ``nodes`` x ``gpus_per_node`` ranks."""

    nodes: int
    gpus_per_node: int
    source: str
    """Where the figures came from (options, the launcher's environment or the default)."""

    @property
    def size(self) -> int:
        return self.nodes * self.gpus_per_node


def resolve_world(nodes: int | None, gpus_per_node: int | None, env: Mapping[str, str]) -> World:
    """The world from explicit options, else the launcher's WORLD_SIZE (split into nodes by
    LOCAL_WORLD_SIZE when that divides it), else one node with one GPU."""
    local_env = _env_int(env, "LOCAL_WORLD_SIZE")
    if nodes is not None or gpus_per_node is not None:
        g = gpus_per_node if gpus_per_node is not None else (local_env or 1)
        return World(nodes or 1, g, "--nodes/--gpus-per-node")
    world_env = _env_int(env, "WORLD_SIZE")
    if world_env is not None:
        local = local_env if local_env and world_env % local_env == 0 else world_env
        return World(world_env // local, local, f"WORLD_SIZE={world_env} from the environment")
    return World(1, 1, "default (no --nodes/--gpus-per-node, no WORLD_SIZE)")


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise BertpipeError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < 1:
        raise BertpipeError(f"environment variable {name}={value} must be at least 1")
    return value


def gpu_memory_gib(gpu: str) -> float | None:
    """Memory of a GPU type from :data:`GPU_MEMORY_GIB` (``"A100 80GB"`` -> ``a100-80g``)."""
    return GPU_MEMORY_GIB.get(gpu_key(gpu))


def gpu_key(gpu: str) -> str:
    """The table key of a GPU name: lower case, dashes, ``nvidia-`` and ``GB`` shortened."""
    key = re.sub(r"[\s_]+", "-", gpu.strip().lower()).removeprefix("nvidia-")
    return re.sub(r"(\d+)gb$", r"\1g", key)
