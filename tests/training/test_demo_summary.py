"""What the demo's summary and suite rest on: the unigram MLM baseline, the small tasks and
their suite, and the summary's scores (the compare table's)."""

from __future__ import annotations

import collections
import csv
import json
import statistics
from pathlib import Path

import pytest

from bertpipe.app.demo import unigram_baseline
from bertpipe.preprocessing.shard_format import read_shard


def test_unigram_baseline_of_static_shards(pretrain_shards: Path) -> None:
    folder = pretrain_shards / "seq128"
    manifest = json.loads((folder / "manifest.json").read_text())
    counts = {}
    for split in ("train", "heldout"):
        counts[split] = collections.Counter()
        for shard in manifest["splits"][split]["shards"]:
            for _, block in read_shard(str(folder / shard["file"])):
                counts[split].update(block.mlm_ids.tolist())
    top = counts["train"].most_common(1)[0][0]
    expected = counts["heldout"][top] / sum(counts["heldout"].values())
    assert 0 < expected < 1
    assert unigram_baseline(folder) == expected


def test_python_docs_task_keeps_a_balanced_training_subset(tmp_path: Path) -> None:
    from bertpipe.finetuning.sample_task import LABELS, write_python_docs_task

    def rows(url: str) -> list[dict[str, str]]:
        with open(url, newline="") as f:
            return list(csv.DictReader(f, delimiter="\t"))

    full_train, full_dev = write_python_docs_task(str(tmp_path / "full"))
    train, dev = write_python_docs_task(str(tmp_path / "small"), train_per_label=8)
    small = rows(train)
    assert collections.Counter(r["label"] for r in small) == {label: 8 for label in LABELS}
    assert {r["text"] for r in small} <= {r["text"] for r in rows(full_train)}
    assert rows(dev) == rows(full_dev)  # the dev set is never cut
    again, _ = write_python_docs_task(str(tmp_path / "again"), train_per_label=8)
    assert rows(again) == small  # deterministic


def _table(url: str) -> list:
    """The rows of ``url`` as the ``table`` task family reads them; no row may be refused."""
    from bertpipe.finetuning.sample_task import LABELS
    from bertpipe.finetuning.tasks.glue import TableColumns, read_table, table_spec

    columns = TableColumns(text_a="text", label="label")
    spec = table_spec("t", "classification", url, columns, labels=LABELS)
    examples, report = read_table(url, columns, spec)
    assert not report.problems, report.summary()
    assert report.rows_kept == len(examples) > 0
    return examples


@pytest.fixture(scope="module")
def demo_suite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bertpipe.finetuning.sample_task import write_demo_suite

    folder = tmp_path_factory.mktemp("suite")
    return Path(write_demo_suite(str(folder), train_per_label=8))


def test_sentence_task_keeps_a_balanced_subset_of_unseen_sentences(
    tmp_path: Path, demo_suite: Path
) -> None:
    from bertpipe.finetuning.sample_task import LABELS, write_sentence_task

    train, dev = write_sentence_task(str(tmp_path / "full"))
    full, held = _table(train), _table(dev)
    assert set(collections.Counter(e.label for e in held)) == set(range(len(LABELS)))
    texts = [e.text_a for e in full]
    assert len(set(texts)) == len(texts)  # each sentence once
    assert not {e.text_a for e in held} & set(texts)  # none of dev is in training
    assert all(len(text) >= 40 and "\n" not in text for text in texts)
    # the suite's copy (8 per label, written by another call) is a subset, with the same dev
    folder = demo_suite.parent / "package-sentence"
    small = _table(str(folder / "train.tsv"))
    assert collections.Counter(e.label for e in small) == {i: 8 for i in range(len(LABELS))}
    assert {(e.text_a, e.label) for e in small} <= {(e.text_a, e.label) for e in full}
    assert (folder / "dev.tsv").read_bytes() == Path(dev).read_bytes()
    again, _ = write_sentence_task(str(tmp_path / "again"))
    assert Path(again).read_bytes() == Path(train).read_bytes()  # deterministic


def test_demo_suite_loads_and_checks(demo_suite: Path, tmp_path: Path) -> None:
    from bertpipe.finetuning.evaluation.suite import check_suite, load_suite
    from bertpipe.finetuning.sample_task import LABELS, SUITE_NAME, write_python_docs_task

    suite = check_suite(load_suite(str(demo_suite), ""))
    assert suite.name == SUITE_NAME
    assert [t.name for t in suite.tasks] == ["package-paragraph", "package-sentence"]
    for task in suite.tasks:
        assert task.family == "table"
        assert task.score == ("accuracy",)
        assert task.task["labels"] == list(LABELS)
        assert Path(task.task["train"]) == demo_suite.parent / task.name / "train.tsv"
        rows = _table(task.task["train"])
        assert collections.Counter(e.label for e in rows) == {i: 8 for i in range(len(LABELS))}
    # the paragraph task is write_python_docs_task's, unchanged
    paragraphs = demo_suite.parent / "package-paragraph"
    train, dev = write_python_docs_task(str(tmp_path), train_per_label=8)
    assert Path(train).read_bytes() == (paragraphs / "train.tsv").read_bytes()
    assert Path(dev).read_bytes() == (paragraphs / "dev.tsv").read_bytes()


def test_summary_gives_the_compare_tables_numbers(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from bertpipe.app import demo
    from bertpipe.app.compare.suites import AVERAGE, SuiteRun, format_score
    from bertpipe.finetuning.evaluation.scores import SuiteScores, TaskScore

    def scores(a: list[float], b: list[float]) -> SuiteScores:
        tasks = []
        for name, values in (("package-paragraph", a), ("package-sentence", b)):
            mean, std = statistics.fmean(values), statistics.stdev(values)
            grid = {"0.002": (mean, std)}
            tasks.append(TaskScore(name, 2e-3, mean, std, values, {"accuracy": (mean, std)}, grid))
        per_seed = [statistics.fmean(pair) for pair in zip(a, b, strict=True)]
        average = statistics.fmean(t.mean for t in tasks)
        return SuiteScores("python-docs", tasks, average, statistics.stdev(per_seed), per_seed)

    results = {
        "pretrained": scores([0.7816, 0.7854, 0.7893], [0.7131, 0.6755, 0.7354]),
        "random-init": scores([0.6743, 0.6782, 0.6628], [0.6084, 0.6147, 0.5933]),
    }
    lines = demo._suite_lines(
        tmp_path, *(SimpleNamespace(scores=results[name], label=name) for name in demo.MODELS)
    )
    assert lines[3].split() == list(demo.MODELS)  # the columns: the suite runs' labels
    # the compare table reads the metrics the suite run logged
    runs = {
        name: SuiteRun(name, name, "FINISHED", 0, "python-docs", None, name, [], s.metrics())
        for name, s in results.items()
    }
    for row in ("package-paragraph", "package-sentence", AVERAGE):
        cells = [format_score(*runs[name].score(row)) for name in demo.MODELS]
        assert any(line.split()[:1] == [row] and all(c in line for c in cells) for line in lines)
    shown = [float(format_score(*runs[name].score(AVERAGE)).split()[0]) for name in demo.MODELS]
    assert f"pre-training buys {shown[0] - shown[1]:+.1f} points" in lines[-1]
