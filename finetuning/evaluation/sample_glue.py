"""GLUE's task folders in the official download's formats, written from local text (for the
suite's tests and ``bertpipe bench evaluate``; nothing is downloaded).

Every task of the benchmark (and WNLI, which a suite must leave out): CoLA without a header
(``source, label, original label, sentence``), SST-2, MRPC with its quality and id columns,
STS-B's ten columns with a 0-5 score, QQP's ids, MNLI's twelve training columns and the
sixteen of ``dev_matched.tsv`` / ``dev_mismatched.tsv``, QNLI, RTE. Sentences come from a
small fixed vocabulary (:data:`WORDS`); labels follow simple rules on the words, so that a
model can learn something in a few steps and the tasks' scores differ.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bertpipe.finetuning.evaluation.suite import GLUE_FOLDERS

POSITIVE = ["good", "great", "yes", "won", "play"]
NEGATIVE = ["bad", "terrible", "no", "rejects", "boycott"]
NEUTRAL = [
    "the",
    "cat",
    "dog",
    "sat",
    "on",
    "mat",
    "city",
    "river",
    "man",
    "woman",
    "movie",
    "film",
    "new",
    "york",
    "paris",
]
MNLI_TRAIN = [
    "index",
    "promptID",
    "pairID",
    "genre",
    "sentence1_binary_parse",
    "sentence2_binary_parse",
    "sentence1_parse",
    "sentence2_parse",
    "sentence1",
    "sentence2",
    "label1",
    "gold_label",
]
MNLI_DEV = [
    "index",
    "promptID",
    "pairID",
    "genre",
    "sentence1_binary_parse",
    "sentence2_binary_parse",
    "sentence1_parse",
    "sentence2_parse",
    "sentence1",
    "sentence2",
    "label1",
    "label2",
    "label3",
    "label4",
    "label5",
    "gold_label",
]
WORDS = sorted({*POSITIVE, *NEGATIVE, *NEUTRAL, "?", "."})
"""Every word the files hold (with ``?`` and ``.``): a tokenizer over these reads them all."""
STSB = [
    "index",
    "genre",
    "filename",
    "year",
    "old_index",
    "source1",
    "source2",
    "sentence1",
    "sentence2",
    "score",
]


def _sentence(rng: np.random.Generator, mood: int) -> str:
    """A few neutral words and one word of the mood (1 positive, 0 negative)."""
    words = list(rng.choice(NEUTRAL, size=int(rng.integers(3, 8))))
    words.insert(int(rng.integers(0, len(words))), rng.choice(POSITIVE if mood else NEGATIVE))
    return " ".join(words) + "."


def _rows(task: str, n: int, rng: np.random.Generator, split: str) -> list[str]:
    out = []
    for i in range(n):
        y = int(rng.integers(0, 2))
        a, b = _sentence(rng, y), _sentence(rng, int(rng.integers(0, 2)))
        if task == "cola":
            out.append(f"src{i % 7}\t{y}\t{'' if y else '*'}\t{a}")
        elif task == "sst2":
            out.append(f"{a}\t{y}")
        elif task == "mrpc":
            out.append(f"{y}\t{1000 + i}\t{2000 + i}\t{a}\t{a if y else b}")
        elif task == "stsb":
            score = f"{(2.5 + 2.5 * (2 * y - 1) * rng.random()):.3f}"
            out.append(f"{i}\tmain-news\tfile\t2012\t{i}\tnone\tnone\t{a}\t{b}\t{score}")
        elif task == "qqp":
            out.append(f"{i}\t{3 * i}\t{3 * i + 1}\t{a}?\t{(a if y else b)}?\t{y}")
        elif task == "mnli":
            label = ("contradiction", "entailment", "neutral")[int(rng.integers(0, 3))]
            parse = f"( {a} )"
            columns = [str(i), str(i), f"{i}e", "fiction", parse, parse, parse, parse, a, b]
            columns += [label] * (6 if split.startswith("dev") else 2)
            out.append("\t".join(columns))
        elif task in ("qnli", "rte"):
            label = ("entailment", "not_entailment")[y]
            out.append(f"{i}\t{a}\t{b}\t{label}")
        elif task == "wnli":
            out.append(f"{i}\t{a}\t{b}\t{y}")
    return out


HEADERS = {
    "cola": None,
    "sst2": "sentence\tlabel",
    "mrpc": "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String",
    "stsb": "\t".join(STSB),
    "qqp": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
    "qnli": "index\tquestion\tsentence\tlabel",
    "rte": "index\tsentence1\tsentence2\tlabel",
    "wnli": "index\tsentence1\tsentence2\tlabel",
}
FOLDERS = {**GLUE_FOLDERS, "wnli": "WNLI"}
"""Every task's download folder (WNLI too: a suite must leave it out)."""


def write_glue(root: Path, train: int = 160, dev: int = 64, seed: int = 0) -> Path:
    """Every GLUE task folder under ``root`` (``train`` and ``dev`` rows each)."""
    rng = np.random.default_rng(seed)
    for task, folder in FOLDERS.items():
        path = root / folder
        path.mkdir(parents=True, exist_ok=True)
        splits = {"train.tsv": train}
        if task == "mnli":
            splits.update({"dev_matched.tsv": dev, "dev_mismatched.tsv": dev})
        else:
            splits["dev.tsv"] = dev
        for name, n in splits.items():
            header = HEADERS.get(task)
            if task == "mnli":
                header = "\t".join(MNLI_TRAIN if name == "train.tsv" else MNLI_DEV)
            lines = ([header] if header else []) + _rows(task, n, rng, name)
            (path / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root
