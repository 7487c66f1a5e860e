"""What operators do to a preprocessing job: SIGTERM it (a preemption) with tracking off, run the
same command again, delete an input file under it, point it at an output it cannot write.

The job is the one of the session's ``pretrain_shards`` fixture (same corpus, tokenizer and
config), so an uninterrupted run's bytes are already there to compare with.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bertpipe.preprocessing import run as preprocess_run
from tests.cli_runner import run_cli
from tests.faultenv import FAULT_PREPROCESS_HOLD, FAULT_PREPROCESS_TERM, child_pythonpath

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _args(corpus: Path, tokenizer: Path, out: Path, *extra: str) -> list[str]:
    """``bertpipe preprocess`` as the ``pretrain_shards`` fixture runs it, into ``out``."""
    return [
        "preprocess",
        f"input.paths=[{corpus}]",
        f"tokenizer={tokenizer}",
        f"output={out}",
        "phases=[{name: seq64, max_seq_length: 64, max_predictions_per_seq: 10, num_shards: 4},"
        " {name: seq128, max_seq_length: 128, max_predictions_per_seq: 20, num_shards: 4}]",
        "dupe_factor=2",
        "heldout_fraction=0.1",
        "instances_per_sample=32",
        "tracking.enabled=false",
        *extra,
    ]


def _files(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _descendants(pid: int) -> set[int]:
    from bertpipe.preprocessing.job_output import _descendants as descendants

    return set(descendants(pid))


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_with_tracking_off_stops_workers_and_the_same_command_continues(
    corpus_dir: Path, tokenizer_dir: Path, pretrain_shards: Path, tmp_path: Path
) -> None:
    """Two Beam worker processes; the driver gets SIGTERM once a worker wrote its first
    shard: exit 143 and no worker left (none finishes a shard after the driver). The same
    command then continues the job (no ``--overwrite``): no ``.tmp-*`` file left, output
    byte-identical to the uninterrupted run's, and the finished tasks not run again."""
    out = tmp_path / "out"
    args = _args(corpus_dir, tokenizer_dir, out)
    beam = ["--", "--direct_num_workers=2", "--direct_running_mode=multi_processing"]
    env = {
        **os.environ,
        "PYTHONPATH": child_pythonpath(REPO),
        FAULT_PREPROCESS_TERM: "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    job = subprocess.Popen(
        [sys.executable, "-m", "bertpipe.app.cli", *args, *beam],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers: set[int] = set()
    deadline = time.monotonic() + 240
    while job.poll() is None and time.monotonic() < deadline:
        workers |= _descendants(job.pid)
        time.sleep(0.05)
    _, err = job.communicate(timeout=30)
    assert job.returncode == 143, err[-3000:]
    assert "bertpipe: terminated (SIGTERM)" in err
    assert workers, "the job ran no worker process"
    time.sleep(0.5)
    assert not [pid for pid in workers if _alive(pid)]  # stopped with the driver
    shards = sorted(p.name for p in out.glob("seq*/*.tar"))
    assert shards and not list(out.glob("seq*/manifest.json"))  # stopped in the shard stage

    again = run_cli(args, {**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert again.returncode == 0, again.stderr[-3000:]
    assert "continuing the stopped job" in again.stderr
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
    assert sorted(p.name for p in out.iterdir()) == ["preprocess.yaml", "seq128", "seq64"]
    for phase in ("seq64", "seq128"):
        assert _files(out / phase) == _files(pretrain_shards / phase), phase


def test_a_finished_dataset_is_still_refused_and_another_config_cannot_continue(
    corpus_dir: Path, tokenizer_dir: Path, pretrain_shards: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    shutil.copytree(pretrain_shards, out)
    done = run_cli(_args(corpus_dir, tokenizer_dir, out))
    assert done.returncode == 2 and "pass --overwrite" in done.stderr
    # a stopped job (shards, no manifest) of another config: refused, nothing touched
    (out / "seq64" / "manifest.json").unlink()
    (out / "seq128" / "manifest.json").unlink()
    (out / "_resume").mkdir()
    (out / "_resume" / "job.json").write_text('{"digest": "another"}')
    before = _files(out)
    other = run_cli(_args(corpus_dir, tokenizer_dir, out, "dupe_factor=3"))
    assert other.returncode == 2, other.stderr[-2000:]
    assert "of a stopped job with another config or input" in other.stderr
    assert _files(out) == before


def test_an_input_file_deleted_under_the_job_fails_it_in_one_line(
    corpus_dir: Path, tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file the plan listed is gone when its turn comes: exit 75 and one line naming it,
    no manifest; with ``input.allow_partial=true`` the job goes on and counts it."""
    corpus = tmp_path / "corpus"
    shutil.copytree(corpus_dir, corpus)
    victim = sorted(corpus.iterdir())[1]
    real = preprocess_run.prepare

    def planned_then_deleted(cfg):  # type: ignore[no-untyped-def]
        planned = real(cfg)
        if victim.exists():
            victim.rename(tmp_path / victim.name)  # gone after the plan listed it
        return planned

    monkeypatch.setattr(preprocess_run, "prepare", planned_then_deleted)
    out = tmp_path / "out"
    failed = run_cli(_args(corpus, tokenizer_dir, out))
    lines = [x for x in failed.stderr.splitlines() if x.startswith("bertpipe: error:")]
    assert failed.returncode == 75 and len(lines) == 1, failed.stderr[-3000:]
    assert f"{victim} was listed when the job was planned and cannot be read now" in lines[0]
    assert "input.allow_partial=true" in lines[0]
    assert not list(out.glob("seq*/manifest.json"))

    (tmp_path / victim.name).rename(victim)
    partial = run_cli(
        _args(corpus, tokenizer_dir, tmp_path / "partial", "input.allow_partial=true")
    )
    assert partial.returncode == 0, partial.stderr[-3000:]
    manifest = json.loads((tmp_path / "partial" / "seq64" / "manifest.json").read_text())
    assert manifest["stats"]["corpus"]["files_failed"] == 1


def test_an_input_deleted_with_two_worker_processes_is_one_line_and_a_log(
    corpus_dir: Path, tokenizer_dir: Path, pretrain_shards: Path, tmp_path: Path
) -> None:
    """Two Beam worker processes hold before their first read range; the test deletes an
    input file (unlinked for real), then lets them go. The console has at most 5 lines, the
    last the error naming the file and the log; the log (beside the output, not in it) has
    the workers' tracebacks. The same command, the file back, continues the job to the
    uninterrupted run's bytes."""
    corpus = tmp_path / "corpus"
    shutil.copytree(corpus_dir, corpus)
    victim = sorted(corpus.iterdir())[1]
    kept = victim.read_bytes()
    out = tmp_path / "out"
    hold = tmp_path / "hold"
    hold.touch()
    args = _args(corpus, tokenizer_dir, out)
    beam = ["--", "--direct_num_workers=2", "--direct_running_mode=multi_processing"]
    env = {
        **os.environ,
        "PYTHONPATH": child_pythonpath(REPO),
        FAULT_PREPROCESS_HOLD: f"ReadTokenize:{hold}",
        "BERTPIPE_FAULT_STALL_S": "120",
        "TOKENIZERS_PARALLELISM": "false",
    }
    job = subprocess.Popen(
        [sys.executable, "-m", "bertpipe.app.cli", *args, *beam],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    held = hold.with_name("hold.held")
    deadline = time.monotonic() + 120
    while not held.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    victim.unlink()  # a worker holds its first range: nothing has been read yet
    hold.unlink()
    _, err = job.communicate(timeout=180)
    lines = err.strip().splitlines()
    assert job.returncode == 75, err[-3000:]
    assert len(lines) <= 5, err[-3000:]
    log_file = tmp_path / "logs" / "out-preprocess.log"
    assert lines[-1] == (
        f"bertpipe: error: {victim} was listed when the job was planned and cannot be read now "
        f"(FileNotFoundError: [Errno 2] No such file or directory: '{victim}'): the storage may "
        "be unavailable; rerun the same command (it continues the job), or set "
        "input.allow_partial=true to go on without it; the workers' tracebacks are in "
        f"{log_file}"
    )
    logged = log_file.read_text()
    assert "Traceback (most recent call last)" in logged and "InputGoneError" in logged
    assert not list(out.rglob("*.log"))

    victim.write_bytes(kept)
    again = run_cli(args, {**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert again.returncode == 0, again.stderr[-3000:]
    assert "continuing the stopped job" in again.stderr
    for phase in ("seq64", "seq128"):
        shards, reference = _files(out / phase), _files(pretrain_shards / phase)
        manifest, expected = (json.loads(f.pop("manifest.json")) for f in (shards, reference))
        assert shards == reference, phase
        assert (manifest["splits"], manifest["stats"]) == (expected["splits"], expected["stats"])


def test_a_worker_failing_for_another_reason_is_one_line_naming_the_log(
    corpus_dir: Path, tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer folder emptied after the plan checked it: the worker's setup fails with
    an error that is not bertpipe's; one line with its cause and the log, exit 1."""
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, tokenizer)
    real = preprocess_run.prepare

    def planned_then_removed(cfg):  # type: ignore[no-untyped-def]
        planned = real(cfg)
        for path in tokenizer.iterdir():
            path.unlink()
        return planned

    monkeypatch.setattr(preprocess_run, "prepare", planned_then_removed)
    out = tmp_path / "out"
    failed = run_cli(_args(corpus_dir, tokenizer, out))
    lines = [x for x in failed.stderr.splitlines() if x.startswith("bertpipe: error:")]
    assert failed.returncode == 1 and len(lines) == 1, failed.stderr[-3000:]
    assert lines[0] == (
        f"bertpipe: error: a preprocessing worker failed: FileNotFoundError: tokenizer "
        f"{tokenizer} holds neither tokenizer.json nor vocab.txt: run `bertpipe tokenizer "
        "train` or point at a vocab.txt; the workers' tracebacks are in "
        f"{tmp_path / 'logs' / 'out-preprocess.log'}"
    )
    assert "Traceback" not in failed.stderr
    assert "Traceback" in (tmp_path / "logs" / "out-preprocess.log").read_text()


@contextlib.contextmanager
def _read_only(folder: Path) -> Iterator[None]:
    """``folder`` as a read-only bind mount of itself (root ignores file modes)."""
    made = subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {made.stderr.decode().strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
        yield
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def test_unwritable_outputs_fail_before_any_work_and_overwrite_keeps_the_manifests(
    corpus_dir: Path, tokenizer_dir: Path, pretrain_shards: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    shutil.copytree(pretrain_shards, out)
    before = _files(out)
    with _read_only(out / "seq128"):
        for extra in ((), ("--overwrite",)):
            failed = run_cli([*_args(corpus_dir, tokenizer_dir, out), *extra])
            lines = [x for x in failed.stderr.splitlines() if x.startswith("bertpipe: error:")]
            assert failed.returncode == 2 and len(lines) == 1, failed.stderr[-3000:]
            assert f"{out / 'seq128'} cannot be written (Read-only file system)" in lines[0]
            assert _files(out) == before  # seq64's manifest too: nothing deleted, no scratch
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    failed = run_cli(_args(corpus_dir, tokenizer_dir, a_file))
    assert failed.returncode == 2 and f"{a_file} cannot be written" in failed.stderr
    assert a_file.read_text() == "x"
