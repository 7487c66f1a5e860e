"""What the demo's summary and task rest on: the unigram MLM baseline and the small task."""

from __future__ import annotations

import collections
import csv
import json
from pathlib import Path

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
