"""``bertpipe bench preprocess``: the Beam job against the tokenizer alone, on one core.

(With ``--scale-mb N`` it is the corpus-scale run of :mod:`bertpipe.app.bench.preprocess_scale`
instead: memory and MB/s of the real CLI on N MB, with 1..K workers.)

The corpus is the Python documentation (:mod:`bertpipe.preprocessing.sample_corpus`) in the
sentence-per-line format, ``replicas`` copies (about 1.3 MB each). Each measurement runs
in a fresh child process pinned to one CPU with ``RAYON_NUM_THREADS=1``, so the tokenizer's
thread pool cannot use more than that core and peak RSS is the child's own:

- ``tokenizer_only_s``: every line of the corpus through ``Tokenizer.encode_batch``;
- ``pipeline_s``: ``bertpipe preprocess`` (FnApiRunner in-process, seq 128 only,
  ``dupe_factor`` 5, shards written, no MLflow), wall time of the whole run. With
  ``--objective mlm`` the job packs sentences instead (masked_lm_prob 0.3, 39 predictions,
  the objective's default dynamic masking: no masks written).

With ``--scaling`` (default on) the pipeline also runs on a 4x corpus and reports its peak
RSS against the 1x run. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["add_arguments", "run_bench"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=3, help="corpus copies (~1.3 MB each)")
    parser.add_argument("--dupe-factor", type=int, default=5)
    parser.add_argument(
        "--objective", choices=("mlm+nsp", "mlm"), default="mlm+nsp", help="the job's objective"
    )
    parser.add_argument("--vocab-size", type=int, default=30522)
    parser.add_argument("--no-scaling", action="store_true", help="skip the 4x memory run")
    parser.add_argument("--workdir", help="keep corpus and shards here (default: a temp dir)")
    from bertpipe.app.bench.preprocess_scale import add_scale_arguments

    add_scale_arguments(parser)


def _child(
    mode: str, corpus: str, tokenizer: str, out: str, dupe: int, objective: str = "mlm+nsp"
) -> dict[str, Any]:
    """Run one measurement in a pinned child process and return its JSON result."""
    env = dict(os.environ, RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [
        sys.executable,
        "-m",
        "bertpipe.app.bench.preprocess",
        "--child",
        mode,
        corpus,
        tokenizer,
        out,
        str(dupe),
        objective,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"bench child {mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _pin_one_core() -> None:
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[0]})


def _child_main(
    mode: str, corpus: str, tokenizer: str, out: str, dupe: int, objective: str
) -> None:
    _pin_one_core()
    from bertpipe.logs import setup_logging

    setup_logging("WARNING")
    result: dict[str, Any] = {}
    if mode == "tokenizer":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json"))
        lines = [
            ln.rstrip("\n")
            for f in sorted(Path(corpus).glob("*.txt"))
            for ln in f.open()
            if ln.strip()
        ]
        started = time.perf_counter()
        encodings = tok.encode_batch(lines, add_special_tokens=False)
        result["seconds"] = time.perf_counter() - started
        result["tokens"] = sum(len(e.ids) for e in encodings)
        result["lines"] = len(lines)
    else:
        from bertpipe.config import load_config
        from bertpipe.preprocessing.config import PreprocessConfig
        from bertpipe.preprocessing.run import run_preprocess

        recipe = (
            ["phases=[{name: seq128, max_seq_length: 128, max_predictions_per_seq: 20}]"]
            if objective == "mlm+nsp"
            else [
                "objective=mlm",
                "masking.masked_lm_prob=0.3",
                "phases=[{name: seq128, max_seq_length: 128, max_predictions_per_seq: 39}]",
            ]
        )

        def overrides_for(inputs: str, output: str) -> list[str]:
            return [
                f"input.paths=[{inputs}]",
                f"tokenizer={tokenizer}",
                f"output={output}",
                "overwrite=true",
                f"dupe_factor={dupe}",
                *recipe,
                "tracking.enabled=false",
            ]

        cfg = load_config(PreprocessConfig, None, overrides_for(corpus, out))
        # a first run on a sliver of the corpus loads Beam's modules and the runner's code
        # paths: their one-off cost is reported as `warmup_s`, not counted in `seconds`
        sliver = str(Path(out) / "warmup-corpus")
        first = sorted(Path(corpus).glob("*.txt"))[0]
        Path(sliver).mkdir(parents=True, exist_ok=True)
        with first.open() as src:
            (Path(sliver) / "a.txt").write_text("".join(next(src) for _ in range(200)))
        warm = load_config(PreprocessConfig, None, [*overrides_for(sliver, out + "/warmup")])
        started = time.perf_counter()
        run_preprocess(warm)
        result["warmup_s"] = time.perf_counter() - started
        started = time.perf_counter()
        manifests = run_preprocess(cfg)
        result["seconds"] = time.perf_counter() - started
        train = manifests["seq128"]["splits"]["train"]
        heldout = manifests["seq128"]["splits"]["heldout"]
        result["instances"] = train["instances"] + heldout["instances"]
        result["bytes"] = train["bytes"] + heldout["bytes"]
        result["stats"] = manifests["seq128"]["stats"]["train"]
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    sys.stdout.write(json.dumps(result) + "\n")


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    if args.scale_mb is not None:
        from bertpipe.app.bench.preprocess_scale import run_scale

        return run_scale(args)
    from bertpipe.config import load_config
    from bertpipe.preprocessing.config import TokenizerConfig
    from bertpipe.preprocessing.sample_corpus import write_corpus
    from bertpipe.preprocessing.vocab import train_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        corpus = str(work / "corpus1x")
        write_corpus(corpus, fmt="sentences", files=4, replicas=args.replicas)
        tokenizer = str(work / "tokenizer")
        tcfg = load_config(
            TokenizerConfig,
            None,
            [
                f"input.paths=[{corpus}]",
                f"output={tokenizer}",
                f"vocab_size={args.vocab_size}",
                "overwrite=true",
                "tracking.enabled=false",
            ],
        )
        train_tokenizer(tcfg)
        text_mb = sum(p.stat().st_size for p in Path(corpus).iterdir()) / 1e6
        log.info("corpus: %.2f MB in %s; measuring the tokenizer alone", text_mb, corpus)
        tok = _child("tokenizer", corpus, tokenizer, "", args.dupe_factor)
        log.info("tokenizer alone: %.2f s; running the pipeline", tok["seconds"])
        pipe = _child(
            "pipeline", corpus, tokenizer, str(work / "shards1x"), args.dupe_factor, args.objective
        )
        result: dict[str, Any] = {
            "corpus_mb": round(text_mb, 3),
            "tokens": tok["tokens"],
            "tokenizer_only_s": round(tok["seconds"], 3),
            "pipeline_s": round(pipe["seconds"], 3),
            "pipeline_warmup_s": round(pipe["warmup_s"], 3),
            "ratio": round(pipe["seconds"] / tok["seconds"], 3),
            "instances": pipe["instances"],
            "bytes_per_instance": round(pipe["bytes"] / pipe["instances"], 1),
            "mean_tokens_per_instance": pipe["stats"]["mean_tokens_per_instance"],
            "peak_rss_mb": round(pipe["peak_rss_mb"], 1),
            "dupe_factor": args.dupe_factor,
            "objective": args.objective,
            "cores": 1,
        }
        if not args.no_scaling:
            corpus4 = str(work / "corpus4x")
            write_corpus(corpus4, fmt="sentences", files=4, replicas=4 * args.replicas)
            log.info("pipeline on the 4x corpus for peak memory")
            pipe4 = _child(
                "pipeline",
                corpus4,
                tokenizer,
                str(work / "shards4x"),
                args.dupe_factor,
                args.objective,
            )
            result["pipeline_4x_s"] = round(pipe4["seconds"], 3)
            result["peak_rss_4x_mb"] = round(pipe4["peak_rss_mb"], 1)
            result["rss_ratio_4x"] = round(pipe4["peak_rss_mb"] / pipe["peak_rss_mb"], 3)
    return result


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "--child":
        _child_main(
            sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]), sys.argv[7]
        )
    else:
        sys.exit("usage: bertpipe bench preprocess [options]")
