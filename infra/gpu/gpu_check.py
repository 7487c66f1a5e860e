"""The bookkeeping of infra/gpu/check.sh: versions, one JSON line per run, the summary.

Standard library only, so that it runs on any Python the check runs on::

    python3 infra/gpu/gpu_check.py env OUT.json
    python3 infra/gpu/gpu_check.py record JSONL NAME --rc RC --wall S --timeout S \
        --stdout FILE --stderr FILE [--pretrain]
    python3 infra/gpu/gpu_check.py skip JSONL NAME REASON
    python3 infra/gpu/gpu_check.py planned-micro JSONL PLAN_RUN PHASE_INDEX
    python3 infra/gpu/gpu_check.py summary JSONL [--env OUT.json] [--elapsed S --budget S]

``record`` reads a run's captured output: a benchmark's last stdout line is its JSON object;
a pre-training run's losses are read from its log lines, and where the run's config came from
``bertpipe plan --fit --write`` its measured peak memory is set beside the plan's prediction
and the budget the plan fitted into (over the budget on a GPU: the run failed). It appends
one object to the JSONL (``{"name": ..., "error": ...}`` for a run that failed) and exits 1
for a failed run.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
from pathlib import Path
from typing import Any

# what `bertpipe pretrain` logs every log_every_steps optimizer steps (training/pretrain/trainer.py)
LOSS_LINE = re.compile(
    r"(?P<phase>\S+) step (?P<step>\d+)/(?P<total>\d+) \(global \d+\): "
    r"loss (?P<loss>\S+) .*? (?P<rate>[0-9.]+) seq/s"
)
# columns of the benchmark table: key in the JSON object -> heading
BENCH_COLUMNS = {
    "seq_per_s": "seq/s",
    "real_tokens_per_s": "real tok/s",
    "tflops": "TFLOP/s",
    "mfu_real": "MFU real",
    "mfu_padded": "MFU padded",
    "peak_memory_gb": "peak GB",
    "step_s": "step s",
    "forward_s": "fwd s",
    "backward_s": "bwd s",
    "data_wait_s": "data s",
    "wall_s": "wall s",
}


def environment() -> dict[str, Any]:
    """Versions of what the check runs on; a package that does not import is named so."""
    info: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info["gpu"] = props.name
            info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
            info["gpu_capability"] = f"{props.major}.{props.minor}"
            info["gpu_count"] = torch.cuda.device_count()
    except Exception as exc:  # a broken install is what this reports, not a reason to stop
        info["torch"] = f"not importable: {exc}"
    for name in ("deepspeed", "transformers", "tokenizers", "webdataset", "pydantic", "numpy"):
        try:
            module = __import__(name)
            info[name] = str(getattr(module, "__version__", "?"))
            info[f"{name}_path"] = str(Path(module.__file__ or "?").parent)
        except Exception as exc:
            info[name] = f"not importable: {type(exc).__name__}: {exc}"
    return info


def last_json(text: str) -> dict[str, Any] | None:
    """The JSON object on the last non-empty line of ``text``, or None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if not line:
            continue
        try:
            value = json.loads(line)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None
    return None


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _failure(rc: int, timeout: float, stderr: str) -> str:
    if rc in (124, 137):
        return f"timed out after {timeout:.0f} s (exit {rc})"
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else "no output on stderr"
    return f"exit {rc}: {last[:400]}"


def pretrain_record(stdout: str, stderr: str) -> dict[str, Any]:
    """First and last logged loss (and the whole curve) of a ``bertpipe pretrain`` run."""
    points = [m for m in LOSS_LINE.finditer(stderr + "\n" + stdout)]
    if not points:
        return {"error": "no loss lines ('... step N/M (global G): loss X ...') in the log"}
    losses = [[int(m["step"]), float(m["loss"])] for m in points]
    out: dict[str, Any] = {
        "phase": points[-1]["phase"],
        "first_step": losses[0][0],
        "first_loss": losses[0][1],
        "last_step": losses[-1][0],
        "last_loss": losses[-1][1],
        "max_steps": int(points[-1]["total"]),
        "last_window_seq_per_s": float(points[-1]["rate"]),
        "losses": losses,
    }
    if not all(math.isfinite(loss) for _, loss in losses):
        out["error"] = "a logged loss is not finite"
    summary = last_json(stdout)
    if summary is not None:
        out["summary"] = summary
        out.update(planned_record(summary))
    return out


def planned_record(summary: dict[str, Any]) -> dict[str, Any]:
    """A ``plan --fit`` config's run: its peak memory against the plan's prediction and
    budget (from the pre-training summary's ``measured`` section of the last phase run).
    On a GPU the peak is ``torch.cuda.max_memory_allocated`` (the plan's memory counts
    tensors; the allocator's reserve is reported beside it); on a CPU, the process's peak
    RSS, which holds the libraries and is only context."""
    phases = [v for v in summary.values() if isinstance(v, dict) and "measured" in v]
    if not phases:
        return {}
    measured = phases[-1]["measured"]
    if "planned_memory_gib" not in measured:
        return {}
    out: dict[str, Any] = {
        "planned_memory_gib": measured["planned_memory_gib"],
        "budget_gib": measured.get("planned_budget_gib"),
        "planned_step_s": measured.get("planned_step_s"),
        "measured_step_s": measured.get("step_s"),
    }
    if "memory_allocated_gb" in measured:
        peak = measured["memory_allocated_gb"]
        out["peak_memory_gib"] = peak
        out["reserved_memory_gib"] = measured.get("memory_reserved_gb")
        out["peak_over_planned"] = peak / measured["planned_memory_gib"]
        budget = out["budget_gib"]
        if budget is not None and peak > budget:
            out["error"] = (
                f"peak memory {peak:.1f} GiB is over the {budget:.1f} GiB budget "
                f"plan --fit chose this config for (planned {measured['planned_memory_gib']:.1f})"
            )
    elif "memory_rss_gb" in measured:
        out["peak_rss_gib"] = measured["memory_rss_gb"]
    return out


def cmd_planned_micro(args: argparse.Namespace) -> int:
    """Print the micro batch ``plan --fit`` chose for phase ``index`` (its recorded run)."""
    for line in _read(args.jsonl).splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("name") == args.plan_run and "winner" in record:
            print(record["winner"]["phases"][args.index]["micro_batch_size"])
            return 0
    print(f"no successful {args.plan_run} record in {args.jsonl}", file=sys.stderr)
    return 1


def cmd_record(args: argparse.Namespace) -> int:
    stdout, stderr = _read(args.stdout), _read(args.stderr)
    record: dict[str, Any] = {"name": args.name}
    if args.pretrain:
        record.update(pretrain_record(stdout, stderr))
        if args.rc != 0:
            record["error"] = _failure(args.rc, args.timeout, stderr)
    elif args.rc != 0:
        record["error"] = _failure(args.rc, args.timeout, stderr)
    else:
        result = last_json(stdout)
        if result is None:
            record["error"] = "exit 0 but the last stdout line is not a JSON object"
        else:
            reported = result.pop("name", args.name)
            record.update(result)
            if reported != args.name:
                record["reported_name"] = reported
    record["exit_code"] = args.rc
    record["wall_s"] = round(args.wall, 1)
    with open(args.jsonl, "a") as f:
        f.write(json.dumps(record) + "\n")
    status = f"FAILED: {record['error']}" if "error" in record else "ok"
    print(f"[gpu-check] {args.name}: {status} ({args.wall:.0f} s)")
    return 1 if "error" in record else 0


def cmd_skip(args: argparse.Namespace) -> int:
    with open(args.jsonl, "a") as f:
        f.write(json.dumps({"name": args.name, "skipped": args.reason}) + "\n")
    print(f"[gpu-check] {args.name}: skipped ({args.reason})")
    return 0


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def _table(headings: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headings)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headings, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(lines)


def summary_text(
    records: list[dict[str, Any]],
    env: dict[str, Any] | None,
    elapsed: float | None,
    budget: float | None,
) -> str:
    out: list[str] = []
    if env:
        keys = (
            "python",
            "torch",
            "torch_cuda",
            "gpu",
            "gpu_memory_gib",
            "deepspeed",
            "transformers",
        )
        out.append("environment: " + ", ".join(f"{k} {env.get(k, '-')}" for k in keys))
    bench = [r for r in records if "seq_per_s" in r and "error" not in r]
    if bench:
        cols = [c for c in BENCH_COLUMNS if any(c in r for r in bench)]
        rows = [[r["name"], *(_fmt(r.get(c)) for c in cols)] for r in bench]
        out.append(_table(["run", *(BENCH_COLUMNS[c] for c in cols)], rows))
    for r in records:
        if "first_loss" in r:
            out.append(
                f"{r['name']}: loss {r['first_loss']:.4f} at step {r['first_step']} -> "
                f"{r['last_loss']:.4f} at step {r['last_step']} of {r['max_steps']}, "
                f"last window {r['last_window_seq_per_s']:.1f} seq/s, {r['wall_s']:.0f} s"
                + (f"  FAILED: {r['error']}" if "error" in r else "")
            )
            if "planned_memory_gib" in r:
                out.append("    " + _planned_line(r))
        elif "winner" in r and "error" not in r:
            w = r["winner"]
            micro = ", ".join(f"{p['phase']} {p['micro_batch_size']}" for p in w["phases"])
            out.append(
                f"{r['name']}: ZeRO {w['zero_stage']}, checkpointing "
                f"{'on' if w['activation_checkpointing'] else 'off'}, offload "
                f"{'on' if w['offload'] else 'off'}; micro batch {micro}; budget "
                f"{r['budget_gib']:.1f} GiB"
            )
        elif "build_s" in r and "error" not in r:
            out.append(f"{r['name']}: {r['build_s']:.1f} s")
    failed = [r for r in records if "error" in r and "first_loss" not in r]
    skipped = [r for r in records if "skipped" in r]
    out += [f"FAILED {r['name']}: {r['error']}" for r in failed]
    out += [f"skipped {r['name']}: {r['skipped']}" for r in skipped]
    ok = sum(1 for r in records if "error" not in r and "skipped" not in r)
    tail = f"{ok} of {len(records)} runs ok, {len(failed)} failed, {len(skipped)} skipped"
    if elapsed is not None:
        tail += f"; {elapsed:.0f} s" + (f" of a {budget:.0f} s budget" if budget else "")
    out.append(tail)
    return "\n".join(out)


def _planned_line(r: dict[str, Any]) -> str:
    budget = _fmt(r.get("budget_gib"))
    planned = f"planned {r['planned_memory_gib']:.2f} GiB of a {budget} GiB budget"
    if "peak_memory_gib" in r:
        text = (
            f"peak allocated {r['peak_memory_gib']:.2f} GiB ({r['peak_over_planned']:.2f}x "
            f"the plan; reserved {_fmt(r.get('reserved_memory_gib'))}), {planned}"
        )
    else:
        text = f"peak RSS {_fmt(r.get('peak_rss_gib'))} GiB (CPU: context only), {planned}"
    if r.get("measured_step_s") is not None and r.get("planned_step_s"):
        text += f"; step {r['measured_step_s']:.3f} s against {r['planned_step_s']:.3f} planned"
    return text


def cmd_summary(args: argparse.Namespace) -> int:
    records = [json.loads(line) for line in _read(args.jsonl).splitlines() if line.strip()]
    env = json.loads(_read(args.env)) if args.env and _read(args.env) else None
    print(summary_text(records, env, args.elapsed, args.budget))
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    info = environment()
    Path(args.out).write_text(json.dumps(info, indent=2) + "\n")
    for key, value in info.items():
        if not key.endswith("_path"):
            print(f"  {key:16s} {value}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("env", help="print versions and write them as JSON")
    p.add_argument("out")
    p.set_defaults(func=cmd_env)
    p = sub.add_parser("record", help="append one run's JSON object to the JSONL")
    p.add_argument("jsonl")
    p.add_argument("name")
    p.add_argument("--rc", type=int, required=True)
    p.add_argument("--wall", type=float, required=True)
    p.add_argument("--timeout", type=float, default=0.0)
    p.add_argument("--stdout", required=True)
    p.add_argument("--stderr", required=True)
    p.add_argument("--pretrain", action="store_true", help="a bertpipe pretrain run")
    p.set_defaults(func=cmd_record)
    p = sub.add_parser("skip", help="record a run left out")
    p.add_argument("jsonl")
    p.add_argument("name")
    p.add_argument("reason")
    p.set_defaults(func=cmd_skip)
    p = sub.add_parser("planned-micro", help="the micro batch plan --fit chose for a phase")
    p.add_argument("jsonl")
    p.add_argument("plan_run")
    p.add_argument("index", type=int)
    p.set_defaults(func=cmd_planned_micro)
    p = sub.add_parser("summary", help="print the summary table")
    p.add_argument("jsonl")
    p.add_argument("--env")
    p.add_argument("--elapsed", type=float)
    p.add_argument("--budget", type=float)
    p.set_defaults(func=cmd_summary)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
