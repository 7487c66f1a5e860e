"""The nine GLUE tasks: each one's :class:`TaskSpec`, the header columns its files hold, and
its file names per split (MNLI's ``dev`` is ``dev_matched.tsv``). The readers that use these
layouts are in :mod:`bertpipe.finetuning.tasks.glue`.
"""

from __future__ import annotations

from dataclasses import dataclass

from bertpipe.finetuning.tasks.base import TaskSpec

__all__ = ["GLUE_TASKS", "GlueTask", "glue_file", "glue_task"]


@dataclass(frozen=True)
class GlueTask:
    """A GLUE task: its spec, header column names, and file names per split."""

    spec: TaskSpec
    text_a: str
    text_b: str | None
    label: str
    index: str | None
    files: dict[str, str]
    label_range: tuple[float, float] | None = None


def _files(*extra: str) -> dict[str, str]:
    names = {"train": "train.tsv", "dev": "dev.tsv", "test": "test.tsv"}
    names.update({name: f"{name}.tsv" for name in extra})
    return names


def _cls(name: str, labels: tuple[str, ...], metrics: tuple[str, ...] = ("accuracy",)) -> TaskSpec:
    positive = labels[1] if "f1" in metrics else None
    return TaskSpec(name, "classification", labels, metrics[0], True, metrics, positive)


_BINARY = ("0", "1")
_NLI2 = ("entailment", "not_entailment")
_MNLI_FILES = _files("dev_matched", "dev_mismatched", "test_matched", "test_mismatched")
_MNLI_FILES.update({"dev": "dev_matched.tsv", "test": "test_matched.tsv"})

GLUE_TASKS: dict[str, GlueTask] = {
    "cola": GlueTask(
        _cls("cola", _BINARY, ("mcc", "accuracy")), "sentence", None, "label", "index", _files()
    ),
    "sst2": GlueTask(_cls("sst2", _BINARY), "sentence", None, "label", "index", _files()),
    "mrpc": GlueTask(
        _cls("mrpc", _BINARY, ("f1", "accuracy")),
        "#1 String",
        "#2 String",
        "Quality",
        "index",
        _files(),
    ),
    "stsb": GlueTask(
        TaskSpec("stsb", "regression", (), "spearman", True, ("spearman", "pearson")),
        "sentence1",
        "sentence2",
        "score",
        "index",
        _files(),
        (0.0, 5.0),
    ),
    "qqp": GlueTask(
        _cls("qqp", _BINARY, ("f1", "accuracy")),
        "question1",
        "question2",
        "is_duplicate",
        "id",
        _files(),
    ),
    "mnli": GlueTask(
        _cls("mnli", ("contradiction", "entailment", "neutral")),
        "sentence1",
        "sentence2",
        "gold_label",
        "index",
        _MNLI_FILES,
    ),
    "qnli": GlueTask(_cls("qnli", _NLI2), "question", "sentence", "label", "index", _files()),
    "rte": GlueTask(_cls("rte", _NLI2), "sentence1", "sentence2", "label", "index", _files()),
    "wnli": GlueTask(_cls("wnli", _BINARY), "sentence1", "sentence2", "label", "index", _files()),
}
"""The nine GLUE tasks, keyed by lower-case name without dashes (``sst2``, ``stsb``)."""


def glue_task(name: str) -> GlueTask:
    """The GLUE task called ``name`` (case, ``-`` and ``_`` ignored: ``SST-2`` is ``sst2``)."""
    key = name.lower().replace("-", "").replace("_", "")
    if key not in GLUE_TASKS:
        raise ValueError(f"unknown GLUE task {name!r}; choose one of {sorted(GLUE_TASKS)}")
    return GLUE_TASKS[key]


def glue_file(task: str, split: str) -> str:
    """The file name GLUE uses for ``split`` of ``task`` (MNLI ``dev`` is ``dev_matched.tsv``)."""
    files = glue_task(task).files
    if split not in files:
        raise ValueError(f"GLUE task {task} has no split {split!r}; choose one of {sorted(files)}")
    return files[split]
