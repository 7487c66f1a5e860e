"""``bertpipe bench loader``: decoded, collated pre-training instances per second, one process.

Synthetic seq-128 shards are written to a temporary folder with
:mod:`~bertpipe.preprocessing.shard_format`: random uint16 token ids (vocabulary 30,522),
90% of the
instances 128 tokens long and 10% uniformly shorter (16-127), segment B starting somewhere
in the middle, static masks chosen by
:func:`~bertpipe.preprocessing.masking.mask_block` (15%, at most
20 per instance, ~19 at length 128), 256 instances per sample, by default 8 shards of 20,000
instances. The loader (:class:`bertpipe.training.pretrain.data.loader.PretrainingData`,
``num_workers`` 0: reading, decoding, shuffling and collation all in the calling process) then
produces padded micro-batches of 32 after a short warm-up; ``instances_per_s`` is wall-clock,
``instances_per_cpu_s`` uses the process's CPU time (steadier on a shared machine). With
``--dynamic`` the shards are unmasked and the loader masks them itself.

With ``--data URL`` the loader reads an existing phase folder instead (``bertpipe
preprocess`` output; any fsspec URL). A remote one (``s3://...``: ``AWS_ENDPOINT_URL`` and
keys in the environment for MinIO/Ceph) is measured first, then copied to a local temporary
folder and measured again: ``instances_per_s`` (remote) stands beside ``local`` and
``remote_vs_local``; ``first_batch_s`` is the time to the first batch (the first shard's
read). ``--step-ms`` sleeps after every batch, as a training step would compute, and reports
``wait_fraction``: the share of the wall clock spent waiting for data, what a trainer loses.

The target is 20,000 instances/s per loader process. The last line of output is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["add_arguments", "run_bench"]

SEQ_LEN = 128
BATCH_SIZE = 32
VOCAB_SIZE = 30522
INSTANCES_PER_SAMPLE = 256
MAX_PREDICTIONS = 20
TARGET = 20_000
SPECIALS = {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instances", type=int, default=160_000, help="instances in all shards")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=50, help="batches before timing starts")
    parser.add_argument(
        "--batches", type=int, default=0, help="batches to time (0: the rest of the epoch)"
    )
    parser.add_argument("--shuffle-blocks", type=int, default=4)
    parser.add_argument("--num-workers", type=int, default=0, help="0: in process (the target)")
    parser.add_argument("--dynamic", action="store_true", help="unmasked shards, mask at load")
    parser.add_argument("--workdir", help="keep the shards here (default: a temp dir)")
    parser.add_argument(
        "--data",
        help="measure this phase folder (any fsspec URL: a local path, s3://...) instead of "
        "synthetic shards; a remote one is also copied to a local temp dir and measured there",
    )
    parser.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="sleep this long after each batch (a training step's compute) and report the "
        "share of time spent waiting for data (wait_fraction)",
    )


def loader_lengths(rng: Any, n: int, seq_len: int) -> Any:
    """This benchmark's lengths: 90% ``seq_len``, 10% uniform in [16, seq_len)."""
    import numpy as np

    lengths = np.full(n, seq_len, dtype=np.int64)
    short = rng.random(n) < 0.1
    lengths[short] = rng.integers(16, seq_len, int(short.sum()))
    return lengths


def _synthetic_block(
    rng: Any, n: int, masking: Any, seq_len: int = SEQ_LEN, lengths_fn: Any = loader_lengths
) -> Any:
    """``n`` random instances as an InstanceBlock, masked with ``masking`` unless None;
    ``lengths_fn(rng, n, seq_len)`` draws their lengths."""
    import numpy as np

    from bertpipe.preprocessing.masking import mask_block
    from bertpipe.preprocessing.shard_format import InstanceBlock

    lengths = lengths_fn(rng, n, seq_len)
    a_end = (lengths * rng.uniform(0.2, 0.8, n)).astype(np.int64).clip(2, lengths - 2)
    tokens = rng.integers(1000, VOCAB_SIZE, int(lengths.sum())).astype(np.uint16)
    starts = np.cumsum(lengths) - lengths
    tokens[starts] = SPECIALS["cls"]
    tokens[starts + a_end - 1] = SPECIALS["sep"]
    tokens[starts + lengths - 1] = SPECIALS["sep"]
    info = np.zeros((n, 4), dtype=np.uint16)
    info[:, 0], info[:, 1] = lengths, a_end
    info[:, 3] = rng.random(n) < 0.5
    block = InstanceBlock(tokens, info, np.zeros(0, np.uint8), np.zeros(0, np.uint16))
    return block if masking is None else mask_block(block, masking, rng)


def write_shards(
    folder: str,
    instances: int,
    shards: int,
    masked: bool,
    seed: int = 0,
    *,
    seq_len: int = SEQ_LEN,
    max_predictions: int = MAX_PREDICTIONS,
    lengths_fn: Any = loader_lengths,
) -> int:
    """Write the synthetic phase folder (shards + manifest.json); returns the bytes written."""
    import numpy as np

    from bertpipe import fsio
    from bertpipe.preprocessing.masking import MaskingSpec
    from bertpipe.preprocessing.shard_format import FORMAT_NAME, SCHEMA_VERSION, write_tar
    from bertpipe.seeding import rng_for

    spec = MaskingSpec(0.15, max_predictions, SPECIALS["mask"], VOCAB_SIZE, (0, 100, 101, 102, 103))
    counts = np.full(shards, instances // shards)
    counts[: instances % shards] += 1
    records = []
    for shard, count in enumerate(counts.tolist()):
        rng = rng_for(seed, "bench-loader", shard)
        block = _synthetic_block(rng, count, spec if masked else None, seq_len, lengths_fn)
        samples = (
            (f"{shard:05d}-{i:06d}", part.to_sample())
            for i, part in enumerate(block.split(INSTANCES_PER_SAMPLE))
        )
        name = f"train-{shard:05d}.tar"
        with fsio.atomic_writer(fsio.join(folder, name)) as f:
            size = write_tar(f, samples)
        samples_n = -(-count // INSTANCES_PER_SAMPLE)
        records.append({"file": name, "instances": count, "samples": samples_n, "bytes": size})
    split = {
        "num_shards": shards,
        "instances": instances,
        "samples": sum(r["samples"] for r in records),
        "bytes": sum(r["bytes"] for r in records),
        "shards": records,
    }
    manifest = {
        "format": FORMAT_NAME,
        "schema_version": SCHEMA_VERSION,
        "phase": f"seq{seq_len}",
        "max_seq_length": seq_len,
        "max_predictions_per_seq": max_predictions,
        "masking": "static" if masked else "none",
        "token_dtype": "uint16",
        "vocab_size": VOCAB_SIZE,
        "special_token_ids": SPECIALS,
        "instances_per_sample": INSTANCES_PER_SAMPLE,
        "seed": seed,
        "num_buckets": shards,
        "splits": {"train": split, "heldout": {**split, "num_shards": 0, "shards": []}},
        "stats": {},
        "config": {},
    }
    fsio.atomic_write_text(fsio.join(folder, "manifest.json"), json.dumps(manifest, indent=2))
    return int(split["bytes"])


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    if args.data:
        return _bench_folder(args)
    from bertpipe.training.pretrain.data.loader import PretrainingData

    with tempfile.TemporaryDirectory() as tmp:
        folder = str(Path(args.workdir or tmp) / "seq128")
        started = time.perf_counter()
        size = write_shards(folder, args.instances, args.shards, masked=not args.dynamic)
        log.info(
            "wrote %d shards (%.1f MB) in %.1f s",
            args.shards,
            size / 1e6,
            time.perf_counter() - started,
        )
        data = PretrainingData(
            folder,
            "train",
            BATCH_SIZE,
            num_workers=args.num_workers,
            shuffle_blocks=args.shuffle_blocks,
        )
        figures = _measure(data, args)
    rate = figures["instances_per_s"]
    return {
        **figures,
        "batch_size": BATCH_SIZE,
        "seq_len": SEQ_LEN,
        "num_workers": args.num_workers,
        "warmup_batches": args.warmup,
        "masking": "dynamic" if args.dynamic else "static",
        "shuffle_blocks": args.shuffle_blocks,
        "shards": args.shards,
        "instances": args.instances,
        "bytes_per_instance": round(size / args.instances, 1),
        "target_instances_per_s": TARGET,
        "meets_target": rate >= TARGET,
    }


def _measure(data: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Time ``data``'s batches after ``args.warmup`` of them; with ``args.step_ms`` each
    batch is followed by that much sleep (a training step's compute, during which only
    background reads progress) and ``wait_fraction`` is the share of the timed wall clock
    spent waiting for the next batch."""
    import itertools

    step = args.step_ms / 1e3
    warmup = max(1, args.warmup)  # the first batch is timed on its own (first_batch_s)
    batches = args.batches or data.batches_per_epoch - warmup
    if batches < 1:
        raise ValueError(
            f"{data.batches_per_epoch} batches per epoch leave none to time after "
            f"{warmup} of warm-up: lower --warmup or give more data"
        )
    started = time.perf_counter()
    stream = iter(data)
    next(stream)
    first_batch = time.perf_counter() - started
    for _ in itertools.islice(stream, warmup - 1):
        time.sleep(step)
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = masked = timed = 0
    waited = 0.0
    while timed < batches:
        asked = time.perf_counter()
        batch = next(stream, None)
        waited += time.perf_counter() - asked
        if batch is None:
            break
        tokens += batch["input_ids"].numel()
        masked += batch["mlm_positions"].numel()
        timed += 1
        if step:
            time.sleep(step)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    size = data.micro_batch_size
    return {
        "instances_per_s": round(timed * size / wall, 1),
        "instances_per_cpu_s": round(timed * size / cpu, 1) if cpu > 0 else None,
        "wait_fraction": round(waited / wall, 4) if step else None,
        "first_batch_s": round(first_batch, 3),
        "batches": timed,
        "seconds": round(wall, 3),
        "cpu_seconds": round(cpu, 3),
        "padded_tokens_per_batch": round(tokens / max(timed, 1), 1),
        "masked_per_instance": round(masked / max(timed * size, 1), 2),
    }


def _bench_folder(args: argparse.Namespace) -> dict[str, Any]:
    """The loader over an existing phase folder (``--data``, any fsspec URL). A remote folder
    (``s3://``, ``gs://`` ...) is then copied to a local temporary folder and measured there
    too, so the figures of object storage stand beside those of local disk."""
    from bertpipe import fsio
    from bertpipe.training.pretrain.data.loader import PretrainingData
    from bertpipe.training.pretrain.data.manifest import Manifest, load_manifest

    def loader(source: str | Manifest) -> Any:
        return PretrainingData(
            source,
            "train",
            BATCH_SIZE,
            num_workers=args.num_workers,
            shuffle_blocks=args.shuffle_blocks,
        )

    url = fsio.absolute(args.data)
    manifest = load_manifest(url)
    shards = manifest.splits["train"]
    size = sum(s.bytes or 0 for s in shards)
    instances = sum(s.instances for s in shards)
    out: dict[str, Any] = {
        "data": args.data,
        **_measure(loader(manifest), args),
        "batch_size": BATCH_SIZE,
        "seq_len": manifest.max_seq_length,
        "num_workers": args.num_workers,
        "warmup_batches": args.warmup,
        "step_ms": args.step_ms,
        "masking": "dynamic" if manifest.masking == "none" else "static",
        "shuffle_blocks": args.shuffle_blocks,
        "shards": len(shards),
        "instances": instances,
        "mb": round(size / 1e6, 1),
        "bytes_per_instance": round(size / max(instances, 1), 1),
    }
    fs, path = fsio.to_fs(url)
    if "://" not in url or url.startswith("file://"):
        return out
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        started = time.perf_counter()
        files = [s.file for split in manifest.splits.values() for s in split]
        for name in ["manifest.json", *files]:
            fs.get_file(fsio.join(path, name), str(Path(tmp) / name))
        copy = time.perf_counter() - started
        log.info("copied %.1f MB to %s in %.1f s", size / 1e6, tmp, copy)
        local = _measure(loader(tmp), args)
    out["local"] = local
    out["copy_mb_per_s"] = round(size / 1e6 / max(copy, 1e-9), 1)
    out["remote_vs_local"] = round(out["instances_per_s"] / max(local["instances_per_s"], 1e-9), 3)
    return out
