"""The suites' tasks: found in the standard download layouts, or named by a YAML file, and
checked (every file read, every row) before any trial runs.

* ``glue``: the task folders as GLUE's download script lays them out (``CoLA/``, ``SST-2/``,
  ``MRPC/``, ``STS-B/``, ``QQP/``, ``MNLI/``, ``QNLI/``, ``RTE/``), each with ``train.tsv``
  and ``dev.tsv`` (MNLI: ``dev_matched.tsv`` and ``dev_mismatched.tsv``); the tasks present
  are used. WNLI is left out, as the BERT paper does (its dev set is adversarial to
  training-set memorisation; every system scores the majority class). A task's score is the
  GLUE benchmark's: CoLA Matthews correlation, MRPC and QQP the mean of F1 and accuracy, STS-B
  the mean of Pearson and Spearman, MNLI the mean of matched and mismatched accuracy, the
  others accuracy.
* ``squad``: ``train-v1.1.json`` and ``dev-v1.1.json`` (or ``-v2.0``) in ``data``; scored by
  F1 (exact match reported beside it).
* ``conll``: ``train.txt`` and ``dev.txt`` (or CoNLL-2003's ``eng.train`` and ``eng.testa``)
  in ``data``; scored by entity F1.
* ``klue``: the task folders of KLUE's release (``klue_benchmark/`` of
  github.com/KLUE-benchmark/KLUE): ``ynat-v1.1/``, ``klue-sts-v1.1/``, ``klue-nli-v1.1/``,
  ``klue-ner-v1.1/``, ``klue-mrc-v1.1/`` (or ``-v1``), each with ``<folder>_train`` and
  ``<folder>_dev`` (``.json``; NER ``.tsv``); the tasks present are used. Scored by KLUE's
  metrics (:mod:`bertpipe.finetuning.tasks.klue`); a task with two (STS, NER, MRC) averages
  them, as GLUE's rule does.
* a YAML file: ``name`` and ``tasks``, each a family (``glue``, ``table``, ``squad``,
  ``conll``, ``klue``), files and the metrics its score averages (docs/evaluation.md).

Every file is read before any trial runs (:func:`check_suite`); a dev label that the task's
training file lacks (a class, or an entity type) stops the suite with one line whatever
``bad_rows`` says: a model trained without a class never predicts it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bertpipe import fsio
from bertpipe.config import ConfigError
from bertpipe.finetuning.config import TaskConfig
from bertpipe.finetuning.tasks.base import ReadReport, TaskDataError, TaskSpec, check_dev_labels

log = logging.getLogger(__name__)

__all__ = ["GLUE_FOLDERS", "Suite", "SuiteTask", "check_suite", "load_suite", "seq_length"]

GLUE_FOLDERS = {
    "cola": "CoLA",
    "sst2": "SST-2",
    "mrpc": "MRPC",
    "stsb": "STS-B",
    "qqp": "QQP",
    "mnli": "MNLI",
    "qnli": "QNLI",
    "rte": "RTE",
}
"""GLUE's tasks in the paper's table order (WNLI left out), and their download folders."""

GLUE_SCORE = {
    "cola": ("mcc",),
    "sst2": ("accuracy",),
    "mrpc": ("f1", "accuracy"),
    "stsb": ("pearson", "spearman"),
    "qqp": ("f1", "accuracy"),
    "mnli": ("accuracy", "dev_mismatched/accuracy"),
    "qnli": ("accuracy",),
    "rte": ("accuracy",),
}
"""The metrics each GLUE task's score averages (the GLUE benchmark's rule)."""

SEQ_LENGTH = {"glue": 128, "table": 128, "conll": 128, "squad": 384, "klue": 128}
"""The protocol's default tokens per input by family (the paper's: 128; SQuAD 384); KLUE's
MRC takes SQuAD's (:func:`seq_length`)."""

KLUE_SCORE = {
    "ynat": ("macro_f1",),
    "sts": ("pearson", "f1"),
    "nli": ("accuracy",),
    "ner": ("entity_macro_f1", "character_macro_f1"),
    "mrc": ("exact_match", "rouge_w"),
}
"""The KLUE tasks bertpipe reads, in KLUE's order, and the metrics each score averages (all
of the task's KLUE metrics)."""
KLUE_VERSIONS = ("v1.1", "v1")
"""Releases found in a KLUE folder, the first present taken."""


@dataclass(frozen=True)
class SuiteTask:
    """One task of a suite: the ``task.*`` settings its trials fine-tune with, and how it is
    scored."""

    name: str
    """The task's name in tables and metric names (``mrpc``, ``squad``, ``ner``)."""
    task: dict[str, Any]
    """``bertpipe finetune``'s ``task`` section (family, name, train, dev, options)."""
    score: tuple[str, ...]
    """The metrics (as a fine-tuning run reports them) whose mean is the task's score."""
    metrics: tuple[str, ...] = ()
    """Every metric reported for the task (the score's first); filled by :func:`check_suite`."""

    @property
    def family(self) -> str:
        return str(self.task["family"])


def seq_length(task: SuiteTask) -> int:
    """The protocol's default tokens per input for ``task`` (:data:`SEQ_LENGTH`; a KLUE
    MRC task as SQuAD's)."""
    if task.family == "klue" and _klue_kind(task) == "span_qa":
        return SEQ_LENGTH["squad"]
    return SEQ_LENGTH[task.family]


def _klue_kind(task: SuiteTask) -> str:
    from bertpipe.finetuning.tasks.klue import klue_task

    try:
        return klue_task(str(task.task["name"])).spec.kind
    except ValueError:
        return ""


@dataclass(frozen=True)
class Suite:
    name: str
    tasks: list[SuiteTask] = field(default_factory=list)
    source: str = ""
    """The folder or YAML file the suite was read from."""

    def describe(self) -> dict[str, Any]:
        """What identifies the suite (its tasks, files and scores), for a folder's record."""
        return {
            "name": self.name,
            "tasks": [{"name": t.name, "task": t.task, "score": list(t.score)} for t in self.tasks],
        }


def load_suite(suite: str, data: str, only: Sequence[str] = ()) -> Suite:
    """The suite ``suite`` (``glue``, ``squad``, ``conll``, ``klue`` or a YAML file) over
    ``data``; ``only``: just these tasks (each must be in the suite)."""
    if suite == "glue":
        found = Suite("glue", _glue_tasks(data, only), data)
    elif suite == "squad":
        found = Suite("squad", [_squad_task(data)], data)
    elif suite == "conll":
        found = Suite("conll", [_conll_task(data)], data)
    elif suite == "klue":
        found = Suite("klue", _klue_tasks(data), data)
    elif suite.endswith((".yaml", ".yml")):
        found = _yaml_suite(suite, data)
    else:
        raise ConfigError(
            "suite", f"{suite!r}: give glue, squad, conll, klue or a suite .yaml file"
        )
    if only:
        names = [t.name for t in found.tasks]
        unknown = [n for n in only if n not in names]
        if unknown and suite != "glue":  # glue: _glue_tasks reported it with the folder
            raise ConfigError("tasks", f"{unknown[0]!r} is not a task of {found.name}: {names}")
        found = dataclasses.replace(found, tasks=[t for t in found.tasks if t.name in only])
    if not found.tasks:
        raise ConfigError("data", f"{data or suite} holds no task of the {found.name} suite")
    return found


# --------------------------------------------------------------------------- standard layouts


def _isdir(url: str) -> bool:
    fs, path = fsio.to_fs(url)
    return bool(fs.isdir(path))


def _names(url: str) -> list[str]:
    fs, path = fsio.to_fs(url)
    return sorted(str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))


def _parent(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[0] if "/" in url.rstrip("/") else "."


def _find(folder: str, names: Sequence[str]) -> str | None:
    for name in names:
        url = fsio.join(folder, name)
        if fsio.exists(url):
            return url
    return None


def _glue_folder(data: str, key: str) -> str | None:
    """The task's folder in ``data`` (GLUE's name, or any case of it, or the plain key)."""
    wanted = {GLUE_FOLDERS[key].lower(), key}
    if fsio.exists(fsio.join(data, GLUE_FOLDERS[key])):
        return fsio.join(data, GLUE_FOLDERS[key])
    if not _isdir(data):
        raise ConfigError("data", f"{data} is not a folder: give the folder of GLUE's tasks")
    for name in _names(data):
        if name.lower().replace("_", "-") in wanted and _isdir(fsio.join(data, name)):
            return fsio.join(data, name)
    return None


def _glue_tasks(data: str, only: Sequence[str]) -> list[SuiteTask]:
    from bertpipe.finetuning.tasks.glue_tasks import glue_task

    keys = list(GLUE_FOLDERS)
    if only:
        wanted = []
        for name in only:
            key = name.lower().replace("-", "").replace("_", "")
            if key == "wnli" or key not in GLUE_FOLDERS:
                raise ConfigError("tasks", f"{name!r} is not a GLUE task of the suite: {keys}")
            wanted.append(key)
        keys = [k for k in keys if k in wanted]
    tasks = []
    for key in keys:
        folder = _glue_folder(data, key)
        if folder is None:
            if only:
                raise ConfigError("tasks", f"{data} has no {GLUE_FOLDERS[key]} folder for {key}")
            continue
        files = glue_task(key).files
        train = fsio.join(folder, files["train"])
        devs = [fsio.join(folder, files["dev"])]
        if key == "mnli":
            devs.append(fsio.join(folder, files["dev_mismatched"]))
        for url in (train, *devs):
            if not fsio.exists(url):
                raise TaskDataError(
                    f"{url} is missing: the {GLUE_FOLDERS[key]} folder needs it (as GLUE's "
                    "download lays it out), or leave the task out with tasks=[...]"
                )
        task = {"family": "glue", "name": key, "train": train, "dev": devs}
        tasks.append(SuiteTask(key, task, GLUE_SCORE[key]))
    return tasks


def _squad_task(data: str) -> SuiteTask:
    for version in ("v2.0", "v1.1"):
        train = _find(data, [f"train-{version}.json"])
        dev = _find(data, [f"dev-{version}.json"])
        if train or dev:
            if not (train and dev):
                missing = f"{'dev' if train else 'train'}-{version}.json"
                raise TaskDataError(f"{fsio.join(data, missing)} is missing: SQuAD needs both")
            name = "squad2" if version == "v2.0" else "squad"
            task = {"family": "squad", "name": name, "train": train, "dev": [dev]}
            return SuiteTask(name, task, ("f1",))
    raise ConfigError("data", f"{data} has no train-v1.1.json/dev-v1.1.json (or v2.0)")


def _conll_task(data: str) -> SuiteTask:
    train = _find(data, ["train.txt", "eng.train"])
    dev = _find(data, ["dev.txt", "valid.txt", "eng.testa"])
    if train is None or dev is None:
        raise TaskDataError(
            f"{data} needs a training file (train.txt or eng.train) and a dev file (dev.txt, "
            "valid.txt or eng.testa) in CoNLL-2003's layout"
        )
    task = {"family": "conll", "name": "conll", "train": train, "dev": [dev]}
    return SuiteTask("conll", task, ("f1",))


def _klue_tasks(data: str) -> list[SuiteTask]:
    """The KLUE tasks whose release folder is in ``data`` (``klue_benchmark/``)."""
    from bertpipe.finetuning.tasks.klue import klue_task

    if not _isdir(data):
        raise ConfigError(
            "data", f"{data} is not a folder: give KLUE's klue_benchmark folder (its task folders)"
        )
    tasks = []
    for name, score in KLUE_SCORE.items():
        klue = klue_task(name)
        for version in KLUE_VERSIONS:
            folder_name, train_name, dev_name = klue.files(version)
            folder = fsio.join(data, folder_name)
            if not fsio.exists(folder):
                continue
            train, dev = fsio.join(folder, train_name), fsio.join(folder, dev_name)
            for url in (train, dev):
                if not fsio.exists(url):
                    raise TaskDataError(
                        f"{url} is missing: the {folder_name} folder needs it (as KLUE's release "
                        "lays it out), or leave the task out with tasks=[...]"
                    )
            task = {"family": "klue", "name": name, "train": train, "dev": [dev]}
            tasks.append(SuiteTask(name, task, score))
            break
    return tasks


# --------------------------------------------------------------------------- YAML suites

_TASK_KEYS = {"name", "family", "folder", "train", "dev", "score", "task"}
_TASK_FIELDS = {f.name for f in dataclasses.fields(TaskConfig)} - {"family", "train", "dev"}


def _yaml_suite(path: str, data: str) -> Suite:
    import yaml

    try:
        with fsio.open_url(path, "rb") as f:
            raw = yaml.safe_load(f.read())
    except FileNotFoundError:
        raise ConfigError("suite", f"{path} does not exist") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError("suite", f"{path} is not valid YAML{where}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("tasks"), list) or not raw["tasks"]:
        raise ConfigError("suite", f"{path}: give `name` and a non-empty list `tasks`")
    unknown = sorted(set(raw) - {"name", "tasks"})
    if unknown:
        raise ConfigError("suite", f"{path}: unknown key {unknown[0]!r} (name, tasks)")
    base = data or _parent(path)
    name = str(raw.get("name") or Path(path).stem)
    tasks = [_yaml_task(path, base, i, entry) for i, entry in enumerate(raw["tasks"])]
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise ConfigError("suite", f"{path}: two tasks are called the same: {names}")
    return Suite(name, tasks, path)


def _yaml_task(path: str, base: str, i: int, entry: Any) -> SuiteTask:
    key = f"tasks[{i}]"

    def bad(what: str) -> ConfigError:
        return ConfigError("suite", f"{path}: {key}{what}")

    if not isinstance(entry, dict) or "name" not in entry:
        raise bad(": give at least `name` (and `family`, files)")
    unknown = sorted(set(entry) - _TASK_KEYS)
    if unknown:
        raise bad(f".{unknown[0]}: unknown key (choose from {sorted(_TASK_KEYS)})")
    name, family = str(entry["name"]), str(entry.get("family", "table"))
    if family not in ("glue", "table", "squad", "conll", "klue"):
        raise bad(f".family: unknown family {family!r} (glue, table, squad, conll, klue)")
    folder = _rel(base, str(entry["folder"])) if "folder" in entry else None
    if family == "glue" and "train" not in entry:  # a GLUE task by name, in its folder
        from bertpipe.finetuning.tasks.glue_tasks import glue_task

        try:
            glue_task(name)
        except ValueError as exc:
            raise bad(f".name: {exc}") from None
        tasks = _glue_tasks(_parent(folder) if folder else base, [name])
        found = tasks[0]
        score = _score(entry, found.score, bad)
        return dataclasses.replace(found, name=name, score=score)
    if "train" not in entry or "dev" not in entry:
        raise bad(": give `train` and `dev` (files, relative to the suite's data folder)")
    root = folder or base
    dev = entry["dev"] if isinstance(entry["dev"], list) else [entry["dev"]]
    options = entry.get("task") or {}
    if not isinstance(options, dict):
        raise bad(".task: give a mapping of bertpipe finetune task.* settings")
    for option in options:
        if option not in _TASK_FIELDS:
            raise bad(f".task.{option}: not a task setting (choose from {sorted(_TASK_FIELDS)})")
    task_name = str(options.get("name", name))
    task = {
        **options,
        "family": family,
        "name": task_name,
        "train": _rel(root, str(entry["train"])),
        "dev": [_rel(root, str(d)) for d in dev],
    }
    default: tuple[str, ...] = ("f1",) if family in ("squad", "conll") else ()
    if family == "klue":
        from bertpipe.finetuning.tasks.klue import klue_task

        try:
            default = KLUE_SCORE[klue_task(task_name).spec.name]
        except ValueError as exc:
            raise bad(f".name: {exc}") from None
    return SuiteTask(name, task, _score(entry, default, bad))


def _score(entry: dict[str, Any], default: tuple[str, ...], bad: Callable[[str], Exception]):
    score = entry.get("score", list(default))
    if isinstance(score, str):
        score = [score]
    if not isinstance(score, list) or not all(isinstance(s, str) for s in score):
        raise bad(".score: give a metric name or a list of them")
    return tuple(score)


def _rel(base: str, path: str) -> str:
    if "://" in path or path.startswith("/"):
        return path
    return fsio.join(base, path)


# --------------------------------------------------------------------------- checking


def check_suite(suite: Suite, bad_rows: str = "fail") -> Suite:
    """Read every file of every task (no tokenizer, no model): a missing file, a file that
    cannot be used, or, with ``bad_rows=fail``, any row that cannot be read (wrong column
    count, unknown label, a dev label that training lacks) raises one line naming the file
    and line. Returns the suite with each task's metrics filled in and its score checked."""
    checked = []
    for task in suite.tasks:
        spec, reports, labels = _read_task(task)
        for report in reports:
            report.require_rows()
            problems = _fatal(task, report)
            if problems and bad_rows == "fail":
                first = problems[0]
                more = f" (and {len(problems) - 1} more rows)" if len(problems) > 1 else ""
                raise TaskDataError(
                    f"{first.file}:{first.line}: {first.reason}{more}: fix the file, or pass "
                    "bad_rows=skip to drop such rows"
                )
            if problems:
                report.log()
        if labels is not None:  # whatever bad_rows says: not a row to drop
            (train, seen, what), *devs = labels
            for dev, rows, _ in devs:
                check_dev_labels(train, seen, dev, rows, what)
        metrics = _metrics(task, spec)
        score = task.score or (spec.main_metric,)
        for name in score:
            if name not in metrics:
                raise ConfigError(
                    "suite",
                    f"{suite.source}: task {task.name} has no metric {name!r} to score by "
                    f"(it reports {', '.join(metrics)})",
                )
        rest = tuple(m for m in metrics if m not in score)
        checked.append(dataclasses.replace(task, score=score, metrics=(*score, *rest)))
    return dataclasses.replace(suite, tasks=checked)


def _fatal(task: SuiteTask, report: ReadReport) -> list[Any]:
    """The problems that ``bad_rows=fail`` refuses: every problem of a row, except SQuAD's
    (and KLUE-MRC's) answers that do not match their context (the question is kept; the
    official files hold a few)."""
    if task.family == "squad" or (task.family == "klue" and _klue_kind(task) == "span_qa"):
        return [p for p in report.problems if "context" not in p.reason]
    return list(report.problems)


def _metrics(task: SuiteTask, spec: TaskSpec) -> tuple[str, ...]:
    """The metric names a fine-tuning run of ``task`` reports (its later dev files prefixed
    with their name, as the run logs them)."""
    names = list(spec.metrics)
    for dev in task.task["dev"][1:]:
        stem = Path(str(dev)).name
        for suffix in (".gz", ".tsv", ".csv", ".jsonl", ".json", ".txt"):
            stem = stem.removesuffix(suffix)
        names += [f"{stem}/{m}" for m in spec.metrics]
    return tuple(names)


Labels = list[tuple[str, list[Any], str]]
"""Per file of a task (training first): its name, its labels (training: the set; dev:
(line, label) per row or entity) and what they are (``label`` or ``entity type``)."""


def _read_task(task: SuiteTask) -> tuple[TaskSpec, list[ReadReport], Labels | None]:
    """The task's spec, a read report of each of its files and, for the families with
    labels, the labels of each file (None for SQuAD, KLUE-MRC and regression)."""
    from bertpipe.finetuning.tasks import conll, glue, klue, squad
    from bertpipe.finetuning.tasks.glue_tasks import glue_task

    cfg = TaskConfig(**task.task)
    for url in (cfg.train, *cfg.dev):
        if not fsio.exists(url):
            raise TaskDataError(f"{url} is missing: task {task.name} of the suite needs it")
    reports: list[ReadReport] = []
    read: list[tuple[str, list[Any]]] = []
    what = "label"
    if cfg.family in ("glue", "table") or (
        cfg.family == "klue" and _klue_kind(task) in ("classification", "regression")
    ):
        if cfg.family == "glue":
            spec = glue_task(cfg.name).spec

            def rows(url: str) -> tuple[list[Any], ReadReport]:
                return glue.read_glue(cfg.name, url)
        elif cfg.family == "klue":
            spec = klue.klue_task(cfg.name).spec

            def rows(url: str) -> tuple[list[Any], ReadReport]:
                return klue.read_klue_pairs(spec.name, url)
        else:
            columns = glue.TableColumns(text_a=cfg.text_a, text_b=cfg.text_b, label=cfg.label)
            spec = glue.table_spec(cfg.name, cfg.kind, cfg.train, columns, labels=cfg.labels)

            def rows(url: str) -> tuple[list[Any], ReadReport]:
                return glue.read_table(url, columns, spec)

        for url in (cfg.train, *cfg.dev):
            examples, report = rows(url)
            reports.append(report)
            if spec.kind == "classification":
                labelled = [e for e in examples if e.label is not None]
                read.append((url, [(e.line, spec.labels[int(e.label)]) for e in labelled]))
        if spec.kind == "regression":
            return spec, reports, None
    elif cfg.family == "squad":
        examples, report = squad.read_squad(cfg.train, cfg.version_2)
        version_2 = cfg.version_2
        if version_2 is None:
            version_2 = any(e.is_impossible for e in examples)
        spec = squad.squad_spec(version_2)
        return spec, [report, *(squad.read_squad(url, version_2)[1] for url in cfg.dev)], None
    elif cfg.family == "klue" and _klue_kind(task) == "span_qa":
        spec = klue.klue_task(cfg.name).spec
        return spec, [klue.read_klue_mrc(url)[1] for url in (cfg.train, *cfg.dev)], None
    else:
        what = "entity type"
        if cfg.family == "klue":
            spec = klue.klue_task(cfg.name).spec
            files = [klue.read_klue_ner(url) for url in (cfg.train, *cfg.dev)]
        else:
            sentences, report = conll.read_conll(cfg.train, cfg.labels)
            spec = conll.conll_spec(cfg.name, sentences, cfg.labels)
            files = [(sentences, report)]
            files += [conll.read_conll(url, spec.labels) for url in cfg.dev]
        for url, (sentences, report) in zip((cfg.train, *cfg.dev), files, strict=True):
            reports.append(report)
            read.append((url, _entity_types(sentences)))
    (train, train_rows), *devs = read
    labels: Labels = [(train, sorted({label for _, label in train_rows}), what)]
    labels += [(url, found, what) for url, found in devs]
    return spec, reports, labels


def _entity_types(sentences: Sequence[Any]) -> list[tuple[int, str]]:
    """(line, type) of each entity type's first tag in each sentence (a sentence's words or
    characters sit on consecutive lines from its ``line``)."""
    found = []
    for sentence in sentences:
        first: dict[str, int] = {}
        for i, tag in enumerate(sentence.labels):
            if tag != "O":
                first.setdefault(tag[2:], sentence.line + i)
        found += [(line, kind) for kind, line in first.items()]
    return found
