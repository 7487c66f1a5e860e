"""Time one forward+backward of our BertForPreTraining against transformers' on the same batch.

Both models get the same configuration, the same weights (copied with
:func:`bertpipe.training.models.bert.hf.export_state_dict`) and the same inputs: 15% of the real
tokens masked. transformers gets the usual ``labels`` tensor (-100 except at masked positions) and
builds the full ``[B, S, V]`` logits; ours gets the flat masked positions and predicts only there.
Both run in train mode with dropout on. Usage::

    PYTHONPATH=. python -m bertpipe.app.bench.model --preset base --batch-size 8 --seq-len 128

The last line of stdout is one JSON object: median wall seconds per step (``ours_s``,
``hf_s``, ``ratio``), the same in process CPU seconds (``*_cpu_s``, ``cpu_ratio``; steadier
when other processes share the machine) and the settings.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from bertpipe.training.models.bert.model import BertForPreTraining, BertModelConfig
from bertpipe.training.models.hf import TIED_KEYS, export_state_dict, hf_config_dict

log = logging.getLogger(__name__)

__all__ = ["bench_model", "main", "make_batch"]

VOCAB_SIZE = 30522
MASK_FRACTION = 0.15


def make_batch(batch_size: int, seq_len: int, vocab_size: int, seed: int) -> dict[str, Tensor]:
    """Random token ids with a quarter of the rows padded to a random shorter length, and
    15% of each row's real tokens (never [CLS] at 0) chosen for MLM."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, vocab_size, (batch_size, seq_len), generator=g)
    lengths = torch.full((batch_size,), seq_len)
    short = torch.arange(batch_size) % 4 == 3
    lengths[short] = torch.randint(seq_len // 2, seq_len, (int(short.sum()),), generator=g)
    cols = torch.arange(seq_len)
    attention_mask = (cols[None, :] < lengths[:, None]).long()
    input_ids = input_ids * attention_mask  # [PAD] = 0
    token_type_ids = ((cols[None, :] >= lengths[:, None] // 2) & attention_mask.bool()).long()
    positions = []
    for row, length in enumerate(lengths.tolist()):
        n = max(1, round(MASK_FRACTION * length))
        chosen = 1 + torch.randperm(length - 1, generator=g)[:n]
        positions.append(row * seq_len + chosen.sort().values)
    mlm_positions = torch.cat(positions)
    mlm_labels = input_ids.view(-1)[mlm_positions].clone()
    hf_labels = torch.full((batch_size * seq_len,), -100, dtype=torch.long)
    hf_labels[mlm_positions] = mlm_labels
    return {
        "input_ids": input_ids,
        "token_type_ids": token_type_ids,
        "attention_mask": attention_mask,
        "mlm_positions": mlm_positions,
        "mlm_labels": mlm_labels,
        "hf_labels": hf_labels.view(batch_size, seq_len),
        "nsp_labels": torch.randint(0, 2, (batch_size,), generator=g),
    }


def _median_step_times(
    step_fns: Sequence[Callable[[], Tensor]], steps: int, warmup: int
) -> list[tuple[float, float]]:
    """Median (wall, process CPU) seconds per call of each function. Calls are interleaved so
    that drift and other processes' load hit all functions alike; CPU time is the steadier
    figure on a shared machine."""
    for _ in range(warmup):
        for fn in step_fns:
            fn()
    times: list[list[tuple[float, float]]] = [[] for _ in step_fns]
    for _ in range(steps):
        for fn, fn_times in zip(step_fns, times, strict=True):
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            fn_times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return [(statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for t in times]


def _check_same_loss(
    ours: torch.nn.Module, theirs: torch.nn.Module, batch: dict[str, Tensor]
) -> None:
    """Both models start from the same weights: their eval-mode losses must agree."""
    ours.eval()
    theirs.eval()
    with torch.no_grad():
        a = ours(
            batch["input_ids"],
            batch["token_type_ids"],
            batch["attention_mask"],
            mlm_positions=batch["mlm_positions"],
            mlm_labels=batch["mlm_labels"],
            nsp_labels=batch["nsp_labels"],
        ).loss
        b = theirs(
            input_ids=batch["input_ids"],
            token_type_ids=batch["token_type_ids"],
            attention_mask=batch["attention_mask"],
            labels=batch["hf_labels"],
            next_sentence_label=batch["nsp_labels"],
        ).loss
    ours.train()
    theirs.train()
    if a is None or not torch.allclose(a, b, atol=1e-4):
        raise RuntimeError(f"same weights but different losses: ours {a}, transformers {b}")
    log.info("same weights, same eval loss: ours %.5f, transformers %.5f", a.item(), b.item())


def bench_model(
    preset: str = "base",
    batch_size: int = 8,
    seq_len: int = 128,
    steps: int = 5,
    warmup: int = 2,
    threads: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Median seconds of forward+backward for ours and transformers' BertForPreTraining."""
    import transformers

    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    cfg = BertModelConfig.preset(preset, VOCAB_SIZE, max_position_embeddings=max(512, seq_len))
    ours = BertForPreTraining(cfg).train()
    hf_cfg = transformers.BertConfig(**{**hf_config_dict(cfg), "attn_implementation": "sdpa"})
    theirs = transformers.BertForPreTraining(hf_cfg).train()
    result = theirs.load_state_dict(export_state_dict(ours), strict=False)
    if not set(result.missing_keys) <= set(TIED_KEYS) or result.unexpected_keys:
        raise RuntimeError(f"weights did not map one-to-one onto transformers': {result}")
    batch = make_batch(batch_size, seq_len, VOCAB_SIZE, seed)
    _check_same_loss(ours, theirs, batch)
    log.info(
        "%s: %.1fM parameters, batch %d x %d, %d masked, %d threads",
        preset,
        cfg.num_parameters() / 1e6,
        batch_size,
        seq_len,
        batch["mlm_positions"].numel(),
        torch.get_num_threads(),
    )

    def ours_step() -> Tensor:
        ours.zero_grad(set_to_none=True)
        out = ours(
            batch["input_ids"],
            batch["token_type_ids"],
            batch["attention_mask"],
            mlm_positions=batch["mlm_positions"],
            mlm_labels=batch["mlm_labels"],
            nsp_labels=batch["nsp_labels"],
        )
        assert out.loss is not None
        out.loss.backward()
        return out.loss.detach()

    def hf_step() -> Tensor:
        theirs.zero_grad(set_to_none=True)
        out = theirs(
            input_ids=batch["input_ids"],
            token_type_ids=batch["token_type_ids"],
            attention_mask=batch["attention_mask"],
            labels=batch["hf_labels"],
            next_sentence_label=batch["nsp_labels"],
        )
        out.loss.backward()
        return out.loss.detach()

    (ours_s, ours_cpu_s), (hf_s, hf_cpu_s) = _median_step_times([ours_step, hf_step], steps, warmup)
    log.info("ours %.3f s/step, transformers %.3f s/step (wall)", ours_s, hf_s)
    log.info("ours %.3f s/step, transformers %.3f s/step (CPU)", ours_cpu_s, hf_cpu_s)
    return {
        "ours_s": ours_s,
        "hf_s": hf_s,
        "ratio": ours_s / hf_s,
        "ours_cpu_s": ours_cpu_s,
        "hf_cpu_s": hf_cpu_s,
        "cpu_ratio": ours_cpu_s / hf_cpu_s,
        "preset": preset,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="base")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    return bench_model(
        preset=args.preset,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        steps=args.steps,
        warmup=args.warmup,
        threads=args.threads,
        seed=args.seed,
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    from bertpipe.logs import setup_logging

    setup_logging()
    result = run_bench(args)
    print(json.dumps(result), flush=True)  # the one line of output callers parse
    return result


if __name__ == "__main__":
    main()
