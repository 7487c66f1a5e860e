"""What ``bertpipe plan`` needs beyond the pretrain config: the cluster and the assumptions.

:class:`PlanOptions` is read by :func:`bertpipe.training.plan.plan.make_plan`, and its fields are
``bertpipe plan``'s flags (generated in :mod:`bertpipe.training.plan.cli`: name, type, default
and the docstring as help). It lives apart from the arithmetic so that building the command
line imports neither the model (torch) nor the pretrain config.
"""

from __future__ import annotations

from dataclasses import dataclass

from bertpipe.errors import BertpipeError

__all__ = ["DEFAULT_SEQ_LENS", "DEFAULT_VOCAB_SIZE", "PlanOptions"]

DEFAULT_SEQ_LENS = (128, 512)
"""Sequence length by phase order when neither a manifest nor ``--seq-len`` gives one
(BERT's two phases; later phases repeat the last)."""

DEFAULT_VOCAB_SIZE = 30522
"""Google's uncased English WordPiece vocabulary, used when no manifest gives the size."""


@dataclass(frozen=True)
class PlanOptions:
    """What the plan needs beyond the config: the cluster and the stated assumptions."""

    nodes: int | None = None
    """Nodes; unset: from the launcher's environment (WORLD_SIZE / LOCAL_WORLD_SIZE), else 1."""
    gpus_per_node: int | None = None
    """GPUs per node; unset: LOCAL_WORLD_SIZE from the environment, else 1."""
    gpu: str | None = None
    """GPU type for peak FLOP/s and memory: h100, h100-pcie, h200, a100-80g, a100-40g,
    v100-32g, a10g, l4, l40s, t4 (no time estimate without it)."""
    gpu_memory_gib: float | None = None
    """GPU memory in GiB (2^30 bytes); unset: from the GPU type."""
    mfu: float = 0.40
    """Assumed model FLOP utilisation: achieved / dense peak FLOP/s."""
    inter_node_gbps: float = 100.0
    """Achieved inter-node bandwidth per GPU in Gbit/s (a DGX-class node with one 400 Gb/s
    InfiniBand NIC per GPU gives up to ~400; 100 is a cautious cloud/Ethernet figure)."""
    intra_node_gbps: float = 2400.0
    """Achieved intra-node (NVLink) bus bandwidth per GPU in Gbit/s (2400 = 300 GB/s)."""
    overlap: float = 0.0
    """Fraction (0..1) of the communication hidden behind compute."""
    seq_lens: tuple[int, ...] = ()
    """Sequence length per phase (in order) where a phase has no manifest; unset: 128, then
    512 (BERT's two phases; later phases repeat the last)."""
    vocab_size: int | None = None
    """Vocabulary size where no manifest gives one; unset: 30522 (Google's uncased English
    WordPiece)."""
    cuda_overhead_gib: float = 1.5
    """CUDA context, cuBLAS/NCCL workspaces and allocator slack per GPU, in GiB (assumed)."""
    mask_fraction: float = 0.15
    """Masked share of a sequence where no manifest gives ``max_predictions_per_seq``."""
    attention_scores_stored: bool = False
    """Count the s x s attention scores as stored activations (an eager attention); the
    model's SDPA kernels do not store them."""
    cpu: bool = False
    """Plan a run on DeepSpeed's CPU accelerator: torch's CPU attention keeps the s x s
    probabilities (and their dropout), and CPU dropout keeps 16-bit masks (measured:
    BENCHMARKS.md, "Memory")."""

    def stores_scores(self, attention_dropout: float) -> bool:
        """Whether the s x s scores are kept: asked for, or the CPU attention with dropout
        (torch's fused CPU kernel takes no dropout; the math path it falls back to keeps
        them)."""
        return self.attention_scores_stored or (self.cpu and attention_dropout > 0)

    def mask_bytes(self, precision: str) -> int:
        """A dropout mask's element: 1 byte on a GPU, the activations' dtype on the CPU."""
        return (4 if precision == "fp32" else 2) if self.cpu else 1

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "vocab_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise BertpipeError(f"plan option {name}={value}: must be at least 1")
        if not 0.0 < self.mfu <= 1.0:
            raise BertpipeError(f"plan option mfu={self.mfu}: must be in (0, 1]")
        if not 0.0 <= self.overlap <= 1.0:
            raise BertpipeError(f"plan option overlap={self.overlap}: must be in [0, 1]")
        for name in ("inter_node_gbps", "intra_node_gbps"):
            if getattr(self, name) <= 0:
                raise BertpipeError(f"plan option {name}={getattr(self, name)}: must be positive")
        if self.gpu_memory_gib is not None and self.gpu_memory_gib <= 0:
            raise BertpipeError(f"plan option gpu_memory_gib={self.gpu_memory_gib}: must be > 0")
        if self.cuda_overhead_gib < 0:
            raise BertpipeError("plan option cuda_overhead_gib: must not be negative")
        if not 0.0 < self.mask_fraction < 1.0:
            raise BertpipeError(f"plan option mask_fraction={self.mask_fraction}: not in (0, 1)")
        if any(s < 1 for s in self.seq_lens):
            raise BertpipeError(f"plan option seq_lens={list(self.seq_lens)}: must be >= 1")
