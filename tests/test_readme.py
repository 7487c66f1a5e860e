"""Every command block of the README runs, at a tiny size, so the README and the program stay
in step.

The README's ```bash blocks are read as a user reads them: continued lines joined, comments
dropped, a lone ``...`` standing for the arguments of the block's first command of the same
kind. Each command either runs here, in a scratch folder laid out as the README assumes
(``runs/demo`` from ``bertpipe demo --smoke``, ``corpus/``, ``mytask/``, ``glue_data/``,
``squad/``, ``conll2003/``, ...), or matches one of :data:`NOT_HERE`, which says why it needs
what a test machine does not have (object storage over the network, GPUs behind a launcher,
hosts) and which test covers it instead. The size is made tiny by appending arguments
(:data:`TINY`: steps, sizes, seeds; the last value of a key or flag wins); the demo's own
configs are run as they are (``--smoke`` made them tiny). The ```text blocks that show a
command's output (``$ bertpipe ...``) must be what the command prints now.

Blocks are grouped by the README section they sit in (:data:`FLOWS`); a block in a section no
flow runs fails :func:`test_every_command_block_is_run_or_excused`, so a new example cannot
go untested.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cli_runner import run_cli
from tests.conftest import sqlite_uri
from tests.finetuning.klue_layout import write_klue

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

NOT_HERE: list[tuple[str, str]] = [
    (r"^make test\b", "the test suite itself"),
    (r"^make demo\b", "run here as `bertpipe demo --smoke` (tests/test_readme.py)"),
    (r"^source \S+/activate$", "the shell's PATH: the test runs bertpipe from this environment"),
    (
        r"s3://|gs://|^export AWS_",
        "object storage over the network: tests/storage/ runs the same commands against a "
        "local S3 server",
    ),
    (
        r"^(deepspeed|torchrun|srun|mpirun)\b",
        "ranks on GPUs or hosts behind a launcher: tests/multihost/ and "
        "tests/training/test_launchers.py",
    ),
    (r"--dask_client_address", "a Dask cluster: tests/multihost/test_dask_hosts.py"),
    (r"^mlflow server\b", "a tracking server with object storage: tests/storage/test_s3_flow.py"),
]
"""Commands that need what a test machine does not have, and where they are tested instead."""

_PRETRAIN_TINY = [
    "model.preset=tiny",
    "precision=fp32",
    "phases[0].max_steps=3",
    "phases[0].micro_batch_size=4",
    "phases[0].global_batch_size=4",
    "phases[0].warmup=0.1",
    "phases[1].max_steps=2",
    "phases[1].micro_batch_size=2",
    "phases[1].global_batch_size=2",
    "phases[1].warmup=0.1",
    "eval.every_steps=2",
    "eval.max_batches=1",
    "checkpoint.every_steps=2",
    "log_every_steps=1",
]
_FINETUNE_TINY = ["epochs=1", "batch_size=8"]
_PROTOCOL_TINY = [
    "protocol.seeds=[1]",
    "protocol.learning_rates=[5e-4]",
    "protocol.epochs=1",
    "protocol.batch_size=8",
]
TINY: dict[str, list[str]] = {
    "demo": ["--smoke"],
    "tokenizer train": ["vocab_size=400"],
    # the README's preprocess lines are alternatives over one output: each replaces the last
    "preprocess": ["dupe_factor=1", "--overwrite"],
    "pretrain": _PRETRAIN_TINY,
    "finetune": _FINETUNE_TINY,
    "sweep": [
        "sweep.learning_rate=[5e-4]",
        "sweep.batch_size=[8]",
        "sweep.epochs=[1]",
    ],
    "evaluate": _PROTOCOL_TINY,
    "bench preprocess": [
        "--replicas",
        "1",
        "--no-scaling",
        "--dupe-factor",
        "1",
        "--vocab-size",
        "2000",
    ],
    "bench model": ["--preset", "tiny", "--steps", "1", "--warmup", "0", "--seq-len", "32"],
    "bench loader": ["--instances", "256", "--batches", "4", "--warmup", "1"],
    "bench train": ["--preset", "tiny", "--seq-len", "64", "--micro-batch", "2", "--steps", "1"],
    "bench evaluate": ["--preset", "tiny", "--rows", "16", "--tasks", "rte", "--seeds", "1"],
    "bench memory": ["--preset", "tiny", "--ranks", "1", "--steps", "1"],
    "bench recipes": [
        "--preset",
        "tiny",
        "--documents",
        "400",
        "--steps",
        "4",
        "--seeds",
        "1",
        "--no-wall-time",
        "--no-downstream",
    ],
}
"""Arguments appended to make each kind of command tiny."""


@dataclass(frozen=True)
class Command:
    section: str
    line: int
    text: str

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text)

    @property
    def kind(self) -> str:
        argv = self.argv
        if argv[0] != "bertpipe":
            return argv[0]
        two = " ".join(argv[1:3])
        return two if two in TINY or argv[1] in ("bench", "runs", "tokenizer") else argv[1]

    def excused(self) -> str | None:
        for pattern, why in NOT_HERE:
            if re.search(pattern, self.text):
                return why
        return None


@dataclass(frozen=True)
class Block:
    section: str
    lang: str
    line: int
    body: str


def readme_blocks() -> list[Block]:
    """The fenced blocks of the README with the ``##``/``###`` heading they sit under."""
    blocks, section, fence = [], "", None
    lines = README.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        if fence is None and line.startswith("#"):
            section = line.lstrip("#").strip()
        elif fence is None and line.startswith("```"):
            fence = (line[3:].strip(), number, [])
        elif fence is not None and line.startswith("```"):
            blocks.append(Block(section, fence[0], fence[1], "\n".join(fence[2])))
            fence = None
        elif fence is not None:
            fence[2].append(line)
    return blocks


def block_commands(block: Block) -> list[Command]:
    """The commands of a bash block: continuations joined, comments and blank lines dropped,
    a lone ``...`` replaced by the arguments of the block's first command of its kind."""
    commands: list[Command] = []
    first: dict[str, list[str]] = {}
    pending, start = "", 0
    for offset, raw in enumerate(block.body.splitlines()):
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if not pending:
            start = block.line + 1 + offset
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        if not text:
            continue
        command = Command(block.section, start, text)
        argv = command.argv
        if "..." in argv and argv[0] == "bertpipe":
            base = first.get(command.kind)
            if base is not None:  # else a placeholder for the reader (an excused command)
                i = argv.index("...")
                argv = argv[:i] + base + argv[i + 1 :]
                command = Command(block.section, start, shlex.join(argv))
        elif argv[0] == "bertpipe":
            first.setdefault(command.kind, argv[len(command.kind.split()) + 1 :])
        commands.append(command)
    return commands


FLOWS = {
    "demo": ["Quick start"],
    "own": [
        "Your own corpus, from raw text to a fine-tuned model",
        "`bertpipe tokenizer train`",
        "`bertpipe preprocess`",
        "`bertpipe plan` and `bertpipe pretrain`",
        "`bertpipe export`",
        "`bertpipe finetune`, `bertpipe sweep`, `bertpipe runs compare`",
        "`bertpipe evaluate`: what a model is worth, the paper's way",
    ],
    "bench": ["`bertpipe bench ...`"],
    "elsewhere": ["Launching", "Cloud storage"],
}
"""Which test runs the blocks of which README section (``elsewhere``: every command there
must be excused by :data:`NOT_HERE`)."""


def _flow_commands(flow: str) -> list[Command]:
    return [
        command
        for block in readme_blocks()
        if block.lang == "bash" and block.section in FLOWS[flow]
        for command in block_commands(block)
    ]


def test_every_command_block_is_run_or_excused() -> None:
    sections = {section for flow in FLOWS.values() for section in flow}
    for block in readme_blocks():
        if block.lang == "bash":
            assert block.section in sections, (
                f"README line {block.line}: a bash block under '{block.section}', which no "
                "test runs: add the section to FLOWS in tests/test_readme.py"
            )
            commands = block_commands(block)
            assert commands, f"README line {block.line}: an empty bash block"
            for command in commands:
                if command.section in FLOWS["elsewhere"]:
                    assert command.excused(), f"README line {command.line}: {command.text}"
                elif command.excused() is None:
                    assert "..." not in command.argv, f"README line {command.line}: `...`"
                    assert command.argv[0] in ("bertpipe", ".venv/bin/mlflow"), (
                        f"README line {command.line}: `{command.argv[0]}` is neither run by "
                        "tests/test_readme.py nor excused in NOT_HERE"
                    )
        elif block.body.startswith("$ "):
            assert block.lang == "text", f"README line {block.line}: a `$ ` block is ```text"
    for section in sections:
        assert any(block.section == section for block in readme_blocks()), (
            f"FLOWS names '{section}', which is no longer a README heading with a block"
        )


def test_help_samples_are_what_the_program_prints() -> None:
    """A ```text block starting ``$ bertpipe ...`` shows that command's output in a terminal
    100 columns wide: each line the README shows (the sample may end early, with ``...``) is
    the program's, in order."""
    samples = [b for b in readme_blocks() if b.lang == "text" and b.body.startswith("$ ")]
    assert samples, "the README shows no command output"
    for block in samples:
        first, *shown = block.body.splitlines()
        result = run_cli(shlex.split(first[2:])[1:], env={**os.environ, "COLUMNS": "100"})
        assert result.returncode == 0, result.stderr
        printed = result.stdout.splitlines()
        position = 0
        for line in shown:
            if line.lstrip().startswith("..."):
                break  # the rest is elided
            assert line in printed[position:], (
                f"README line {block.line}: `{first[2:]}` no longer prints {line!r}"
            )
            position = printed.index(line, position) + 1


def test_the_readme_names_every_command_and_benchmark() -> None:
    from bertpipe.app.cli import build_parser

    text = README.read_text(encoding="utf-8")
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name in sub.choices:
        assert f"bertpipe {name}" in text, f"the README never shows `bertpipe {name}`"
    bench = run_cli(["bench", "--help"]).stdout
    names = re.findall(
        r"^  (\w+)\s{2,}", bench.split("benchmarks:")[1].split("positional arguments")[0], re.M
    )
    assert len(names) >= 7, bench
    for name in names:
        assert f"bertpipe bench {name}" in text, f"the README never shows `bertpipe bench {name}`"
    assert any("--fit" in c.argv for c in _flow_commands("own") if c.kind == "plan")


# --- the workspace a reader has ---------------------------------------------------------


def _write_inputs(ws: Path) -> None:
    """What the README assumes the reader has: a corpus, a labelled table, GLUE, SQuAD and
    CoNLL-2003 laid out as their downloads, a parquet export, Google's vocab.txt."""
    from bertpipe.finetuning.evaluation.sample_glue import write_glue
    from bertpipe.finetuning.sample_task import write_python_docs_task
    from bertpipe.preprocessing.sample_corpus import iter_python_docs

    corpus = ws / "corpus"
    corpus.mkdir()
    texts = []
    for i, (_, text) in enumerate(iter_python_docs()):
        if i == 60:
            break
        (corpus / f"doc{i:03d}.txt").write_text(text, encoding="utf-8")
        texts.append(text)
    import pyarrow as pa
    import pyarrow.parquet as pq

    (ws / "wiki").mkdir()
    pq.write_table(pa.table({"text": texts}), ws / "wiki" / "part-0.parquet")
    write_python_docs_task(str(ws / "mytask"), train_per_label=8)
    write_glue(ws / "glue_data", train=24, dev=16)
    _write_squad(ws / "squad")
    _write_conll(ws / "conll2003")
    write_klue(ws / "klue_benchmark", copies=2)
    (ws / "my-suite.yaml").write_text(
        "name: my-suite\n"
        "tasks:\n"
        "  - {name: rte, family: glue, folder: glue_data/RTE}\n"
        "  - {name: package, family: table, train: mytask/train.tsv, dev: [mytask/dev.tsv]}\n"
    )


def _write_squad(folder: Path) -> None:
    folder.mkdir()
    context = "paris is the capital of france . the river seine flows through paris ."
    qas = [
        ("what is the capital of france ?", "paris"),
        ("what river flows through paris ?", "seine"),
        ("what is paris the capital of ?", "france"),
    ]

    def data(copies: int) -> dict:
        return {
            "version": "1.1",
            "data": [
                {
                    "title": f"t{i}",
                    "paragraphs": [
                        {
                            "context": context,
                            "qas": [
                                {
                                    "id": f"q{i}-{j}",
                                    "question": q,
                                    "answers": [{"text": a, "answer_start": context.index(a)}],
                                }
                                for j, (q, a) in enumerate(qas)
                            ],
                        }
                    ],
                }
                for i in range(copies)
            ],
        }

    (folder / "train-v1.1.json").write_text(json.dumps(data(6)))
    (folder / "dev-v1.1.json").write_text(json.dumps(data(1)))


def _write_conll(folder: Path) -> None:
    folder.mkdir()
    sentences = [
        [("john", "B-PER"), ("lives", "O"), ("in", "O"), ("london", "B-LOC")],
        [("peter", "B-PER"), ("blackburn", "I-PER"), ("said", "O"), ("hello", "O")],
        [("new", "B-LOC"), ("york", "I-LOC"), ("mayor", "O"), ("said", "O"), ("yes", "O")],
    ]
    body = "".join("".join(f"{w} NN O {t}\n" for w, t in sentence) + "\n" for sentence in sentences)
    (folder / "train.txt").write_text("-DOCSTART- -X- -X- O\n\n" + body * 4)
    (folder / "dev.txt").write_text("-DOCSTART- -X- -X- O\n\n" + body)


def _google_vocab(ws: Path) -> None:
    folder = ws / "uncased_L-12_H-768_A-12"
    folder.mkdir()
    words = ["[PAD]", *(f"[unused{i}]" for i in range(20)), "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    words += sorted(
        {
            w
            for line in (ws / "mytask" / "train.tsv").read_text().split()
            for w in re.findall(r"[a-z]+", line.lower())
        }
    )[:300]
    words += [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"] + list("abcdefghijklmnopqrstuvwxyz")
    (folder / "vocab.txt").write_text("\n".join(dict.fromkeys(words)) + "\n")


# --- running commands -------------------------------------------------------------------


def tiny_argv(command: Command, tiny: dict[str, list[str]]) -> list[str]:
    """The command with its kind's tiny arguments after its own (before a ``--``), so that
    they win: the last value of a key or flag is the one used."""
    argv = command.argv
    add = tiny.get(command.kind, [])
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut] + add + argv[cut:]
    return argv + add


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mlflow_ui(command: Command, ws: Path) -> None:
    """The UI the README opens: it serves the demo's store and its artifact folder exists."""
    argv = [a.replace("$PWD", str(ws)) for a in command.argv]
    assert argv[0] == ".venv/bin/mlflow"
    argv[0] = str(Path(sys.executable).parent / "mlflow")
    root = argv[argv.index("--default-artifact-root") + 1]
    assert Path(root).is_dir(), f"README line {command.line}: {root} does not exist"
    port = _free_port()
    proc = subprocess.Popen(
        [*argv, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        cwd=ws,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert proc.poll() is None, f"mlflow ui exited {proc.returncode}"
                assert time.monotonic() < deadline, "mlflow ui did not answer in 60 s"
                time.sleep(0.5)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/2.0/mlflow/experiments/get-by-name"
            "?experiment_name=bertpipe-demo"
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            experiment = json.load(r)["experiment"]
        assert experiment["artifact_location"].startswith(f"file://{root}") or experiment[
            "artifact_location"
        ].startswith(root), experiment
    finally:
        import os
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def run_commands(
    commands: list[Command],
    ws: Path,
    monkeypatch: pytest.MonkeyPatch,
    tiny: dict[str, list[str]] = TINY,
) -> None:
    monkeypatch.chdir(ws)
    for store in ("runs/mlflow.db", "runs/demo/mlflow.db"):  # the default and the demo's
        sqlite_uri(ws / store)  # empty stores, copied: MLflow's migrations take 10-20 s
    for command in commands:
        if command.excused():
            continue
        if command.argv[0] == ".venv/bin/mlflow":
            _mlflow_ui(command, ws)
            continue
        assert command.argv[0] == "bertpipe", command
        argv = tiny_argv(command, tiny)
        t0 = time.monotonic()
        result = run_cli(argv[1:])
        print(f"README line {command.line}: {time.monotonic() - t0:5.1f} s  {shlex.join(argv)}")
        assert result.returncode == 0, (
            f"README line {command.line}: `{command.text}` (run as `{shlex.join(argv)}`) "
            f"exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )


@pytest.mark.integration
@pytest.mark.slow
def test_quick_start_and_what_follows_the_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``make demo`` (as ``bertpipe demo --smoke``) then every command the README runs on its
    outputs."""
    commands = _flow_commands("demo")
    demo = [c for c in commands if c.argv[:2] == ["make", "demo"]]
    assert len(demo) == 1, "the quick start runs `make demo`"
    smoke = Command(demo[0].section, demo[0].line, "bertpipe demo --out runs/demo")
    # the demo's outputs are tiny already: its own configs run as they are, but for the steps
    # a continued phase 2 adds (the smoke's phase 2 has 4)
    tiny = {"demo": TINY["demo"], "pretrain": ["phases[1].max_steps=6"]}
    run_commands([smoke, *commands], tmp_path, monkeypatch, tiny=tiny)
    assert (tmp_path / "runs" / "demo" / "mlartifacts").is_dir()


@pytest.mark.integration
@pytest.mark.slow
def test_own_corpus_to_fine_tuned_model_and_the_stage_examples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The own-corpus quick start, then the examples of each stage's section, in the order
    the README gives them, in the folder the first made."""
    _write_inputs(tmp_path)
    _google_vocab(tmp_path)
    run_commands(_flow_commands("own"), tmp_path, monkeypatch)
    assert (tmp_path / "runs" / "mybert" / "hf" / "config.json").is_file()


BENCH_ELSEWHERE = {
    "preprocess --scale-mb": "tests/preprocessing/test_bench_scale.py::"
    "test_scale_bench_on_parquet_reports_one_json_line",
    "train": "tests/training/test_bench_train.py::test_bench_train_reference_and_peak",
    "memory": "tests/training/test_bench_memory.py::test_bench_memory_tiny_zero2_on_two_ranks",
    "evaluate": "tests/finetuning/test_evaluate.py::test_bench_evaluate_reports_seconds_per_task",
    "loader": "tests/training/test_data_s3.py::"
    "test_bench_loader_on_s3_reports_the_local_figures_beside",
    "sentences": "tests/preprocessing/test_languages.py::"
    "test_bench_sentences_reports_each_language",
    "language": "tests/finetuning/test_bench_language.py::"
    "test_bench_language_pretrains_and_fine_tunes_both_models",
}
"""Benchmarks whose README lines another test runs at a tiny size (a benchmark at a tiny
size costs what its own test costs: running it twice would only add time). The README test
checks their lines against the benchmark's own options and runs the others."""


def _bench_key(command: Command) -> str:
    name = command.argv[2]
    return f"{name} --scale-mb" if "--scale-mb" in command.argv else name


def test_benchmark_lines_take_the_benchmarks_options_and_are_run_somewhere() -> None:
    import argparse
    import importlib

    from bertpipe.app.bench import BENCHMARKS
    from bertpipe.cli_args import add_global_options

    commands = _flow_commands("bench")
    assert {c.argv[2] for c in commands} == set(BENCHMARKS), "a benchmark the README skips"
    for command in commands:
        module = importlib.import_module(BENCHMARKS[command.argv[2]][0])
        parser = argparse.ArgumentParser(prog=f"bertpipe bench {command.argv[2]}")
        module.add_arguments(parser)
        add_global_options(parser)
        try:
            parser.parse_args(command.argv[3:])
        except SystemExit:
            pytest.fail(f"README line {command.line}: `{command.text}`: options it does not take")
        test = BENCH_ELSEWHERE.get(_bench_key(command))
        if test is not None:
            path, name = test.split("::")
            assert f"def {name}(" in (ROOT / path).read_text(), f"{test} is gone"


@pytest.mark.integration
@pytest.mark.slow
def test_benchmark_examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's benchmark lines that no other test runs, at a tiny size."""
    commands = [c for c in _flow_commands("bench") if _bench_key(c) not in BENCH_ELSEWHERE]
    assert commands
    run_commands(commands, tmp_path, monkeypatch)
