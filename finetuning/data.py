"""Task data for the fine-tuning loop: read, featurize, batch, score, write predictions.

One :class:`TaskData` per run holds the task's spec, the training features and one
:class:`EvalSet` per evaluation file. The family-specific parts (readers, featurizers, span
decoding, entity scoring, prediction files) live in :mod:`bertpipe.finetuning.tasks`; this module
only dispatches on the family and turns features into model inputs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from bertpipe.config import ConfigError
from bertpipe.finetuning.config import TaskConfig
from bertpipe.finetuning.metrics import compute_task_metrics
from bertpipe.finetuning.tasks import conll, glue, glue_tasks, klue, squad, squad_scores
from bertpipe.finetuning.tasks.base import (
    Features,
    ReadReport,
    TaskSpec,
    check_dev_labels,
    check_max_seq_length,
    take,
)
from bertpipe.seeding import rng_for
from bertpipe.training.core.step import to_device

log = logging.getLogger(__name__)

__all__ = [
    "EvalSet",
    "TaskData",
    "TrainBatches",
    "batches",
    "load_task",
    "model_inputs",
    "score",
]

MODEL_KEYS = ("input_ids", "token_type_ids", "attention_mask")
LABEL_KEYS = ("labels", "start_positions", "end_positions")


@dataclass
class EvalSet:
    """An evaluation file: its features and the examples its predictions map back to."""

    name: str
    path: str
    features: Features
    examples: list[Any]
    report: ReadReport


@dataclass
class TaskData:
    spec: TaskSpec
    family: str
    train: Features
    train_report: ReadReport
    dev: list[EvalSet] = field(default_factory=list)
    version_2: bool = False
    """SQuAD 2.0: questions may have no answer."""

    @property
    def reports(self) -> list[ReadReport]:
        return [self.train_report, *(d.report for d in self.dev)]


def _stem(path: str) -> str:
    name = Path(path).name
    for suffix in (".gz", ".bz2", ".zst", ".tsv", ".csv", ".jsonl", ".json", ".txt", ".conll"):
        name = name.removesuffix(suffix)
    return name


def load_task(cfg: TaskConfig, tokenizer: Tokenizer, max_positions: int) -> TaskData:
    """Read and featurize the task's files; bad rows are counted and logged with file and line."""
    check_max_seq_length(cfg.max_seq_length, max_positions)
    if cfg.family in ("glue", "table"):
        data = _pairs(cfg, tokenizer)
    elif cfg.family == "squad":
        data = _squad(cfg, tokenizer)
    elif cfg.family == "klue":
        data = _klue(cfg, tokenizer)
    else:
        data = _conll(cfg, tokenizer)
    if cfg.main_metric:
        if cfg.main_metric not in data.spec.metrics:
            raise ConfigError(
                "task.main_metric", f"must be one of {', '.join(data.spec.metrics)} for this task"
            )
        data.spec = data.spec.replace(main_metric=cfg.main_metric)
    log.info(
        "task %s (%s): %d training inputs; evaluation: %s",
        data.spec.name,
        data.spec.kind,
        len(data.train["input_ids"]),
        ", ".join(f"{d.name} {len(d.features['input_ids'])}" for d in data.dev),
    )
    return data


def _pairs(cfg: TaskConfig, tokenizer: Tokenizer) -> TaskData:
    if cfg.family == "glue":
        spec = glue_tasks.glue_task(cfg.name).spec

        def read(path: str) -> tuple[list[glue.PairExample], ReadReport]:
            return glue.read_glue(cfg.name, path)
    else:
        columns = glue.TableColumns(text_a=cfg.text_a, text_b=cfg.text_b, label=cfg.label)
        spec = glue.table_spec(cfg.name, cfg.kind, cfg.train, columns, labels=cfg.labels)

        def read(path: str) -> tuple[list[glue.PairExample], ReadReport]:
            return glue.read_table(path, columns, spec)

    return _pair_task(cfg, tokenizer, spec, read)


def _pair_task(
    cfg: TaskConfig,
    tokenizer: Tokenizer,
    spec: TaskSpec,
    read: Any,
) -> TaskData:
    """A sentence (pair) task: every file read with ``read``; a dev label the training
    file lacks is refused (:func:`check_dev_labels`)."""
    examples, report = read(cfg.train)
    train = glue.featurize_pairs(tokenizer, examples, spec, cfg.max_seq_length)
    dev = []
    for path in cfg.dev:
        dev_examples, dev_report = read(path)
        if spec.kind == "classification":
            check_dev_labels(
                cfg.train,
                (spec.labels[int(e.label)] for e in examples if e.label is not None),
                path,
                ((e.line, spec.labels[int(e.label)]) for e in dev_examples if e.label is not None),
            )
        features = glue.featurize_pairs(tokenizer, dev_examples, spec, cfg.max_seq_length)
        dev.append(EvalSet(_stem(path), path, features, dev_examples, dev_report))
    return TaskData(spec, cfg.family, train, report, dev)


def _klue(cfg: TaskConfig, tokenizer: Tokenizer) -> TaskData:
    """A KLUE task (:mod:`~bertpipe.finetuning.tasks.klue`) as its release lays it out."""
    try:
        task = klue.klue_task(cfg.name)
    except ValueError as exc:
        raise ConfigError("task.name", str(exc)) from None
    spec = task.spec
    if spec.kind in ("classification", "regression"):
        return _pair_task(cfg, tokenizer, spec, lambda path: klue.read_klue_pairs(spec.name, path))
    if spec.kind == "span_qa":
        squad.check_squad_lengths(cfg.max_seq_length, cfg.max_query_length, cfg.doc_stride)
        options = {
            "max_seq_length": cfg.max_seq_length,
            "doc_stride": cfg.doc_stride,
            "max_query_length": cfg.max_query_length,
        }
        examples, report = klue.read_klue_mrc(cfg.train)
        train = squad.featurize_squad(tokenizer, examples, training=True, **options)
        dev = []
        for path in cfg.dev:
            dev_examples, dev_report = klue.read_klue_mrc(path)
            features = squad.featurize_squad(tokenizer, dev_examples, training=False, **options)
            dev.append(EvalSet(_stem(path), path, features, dev_examples, dev_report))
        return TaskData(spec, "klue", train, report, dev, version_2=True)
    sentences, report = klue.read_klue_ner(cfg.train)
    train = klue.featurize_klue_ner(tokenizer, sentences, spec, cfg.max_seq_length)
    dev = []
    for path in cfg.dev:
        dev_sentences, dev_report = klue.read_klue_ner(path)
        features = klue.featurize_klue_ner(tokenizer, dev_sentences, spec, cfg.max_seq_length)
        dev.append(EvalSet(_stem(path), path, features, dev_sentences, dev_report))
    return TaskData(spec, "klue", train, report, dev)


def _squad(cfg: TaskConfig, tokenizer: Tokenizer) -> TaskData:
    squad.check_squad_lengths(cfg.max_seq_length, cfg.max_query_length, cfg.doc_stride)
    examples, report = squad.read_squad(cfg.train, cfg.version_2)
    version_2 = (
        cfg.version_2 if cfg.version_2 is not None else any(e.is_impossible for e in examples)
    )
    spec = squad.squad_spec(version_2).replace(name=cfg.name)
    options = {
        "max_seq_length": cfg.max_seq_length,
        "doc_stride": cfg.doc_stride,
        "max_query_length": cfg.max_query_length,
    }
    train = squad.featurize_squad(tokenizer, examples, training=True, **options)
    dev = []
    for path in cfg.dev:
        dev_examples, dev_report = squad.read_squad(path, version_2)
        features = squad.featurize_squad(tokenizer, dev_examples, training=False, **options)
        dev.append(EvalSet(_stem(path), path, features, dev_examples, dev_report))
    return TaskData(spec, "squad", train, report, dev, version_2=version_2)


def _conll(cfg: TaskConfig, tokenizer: Tokenizer) -> TaskData:
    sentences, report = conll.read_conll(cfg.train, cfg.labels)
    spec = conll.conll_spec(cfg.name, sentences, cfg.labels)
    train = conll.featurize_conll(tokenizer, sentences, spec, cfg.max_seq_length)
    dev = []
    for path in cfg.dev:
        dev_sentences, dev_report = conll.read_conll(path, spec.labels)
        features = conll.featurize_conll(tokenizer, dev_sentences, spec, cfg.max_seq_length)
        dev.append(EvalSet(_stem(path), path, features, dev_sentences, dev_report))
    return TaskData(spec, "conll", train, report, dev)


# --------------------------------------------------------------------------- batching


def model_inputs(
    batch: Features, device: torch.device, with_labels: bool
) -> dict[str, torch.Tensor]:
    """The tensors the task head takes (bookkeeping arrays are left out), on ``device``: as
    pre-training's batches, pinned and copied without blocking on a GPU."""
    out = {k: torch.from_numpy(np.asarray(batch[k], dtype=np.int64)) for k in MODEL_KEYS}
    if with_labels:
        for key in LABEL_KEYS:
            if key in batch:
                value = np.asarray(batch[key])
                dtype = np.float32 if value.dtype.kind == "f" else np.int64
                out[key] = torch.from_numpy(value.astype(dtype))
    if device.type == "cuda":
        out = {k: v.pin_memory() for k, v in out.items()}
    return to_device(out, device)


def batches(
    features: Features,
    batch_size: int,
    *,
    order: np.ndarray | None = None,
    rank: int = 0,
    world_size: int = 1,
    skip: int = 0,
) -> Iterator[Features]:
    """Micro-batches of ``features`` in ``order`` (default: as stored), from batch ``skip``.

    Training: every rank takes every ``world_size``-th row of the shuffled order and only
    whole batches, so all ranks step the same number of times.
    Evaluation (``world_size=1``): every row, the last batch may be short.
    """
    n = len(features["input_ids"])
    index = np.arange(n) if order is None else order
    if world_size > 1:
        per_rank = (n // world_size) // batch_size * batch_size
        index = index[rank::world_size][:per_rank]
    for start in range(skip * batch_size, len(index), batch_size):
        yield take(features, index[start : start + batch_size])


class TrainBatches:
    """One rank's training micro-batches, epoch after epoch (from 1), exactly resumable.

    Epoch ``e`` reads the rows in the order ``rng_for(seed, "finetune-order", e)`` gives,
    every rank its share (:func:`batches`), ``per_epoch`` micro-batches each. Like the
    pre-training loader it is a ``Stateful``: ``state_dict()`` is ``{"epoch": e, "batches":
    c}`` (c micro-batches of epoch e handed out), and a fresh one given it by
    ``load_state_dict`` yields exactly the batches that would have come next.
    """

    def __init__(
        self,
        features: Features,
        micro_batch_size: int,
        *,
        per_epoch: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.features = features
        self.micro_batch_size = micro_batch_size
        self.per_epoch = per_epoch
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.epoch, self.batches = 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        epoch, consumed = int(state["epoch"]), int(state["batches"])
        if epoch < 1 or not 0 <= consumed < self.per_epoch:
            raise ValueError(f"invalid position {state} for {self.per_epoch} batches per epoch")
        self.epoch, self.batches = epoch, consumed

    def __iter__(self) -> Iterator[Features]:
        n = len(self.features["input_ids"])
        while True:
            order = rng_for(self.seed, "finetune-order", self.epoch).permutation(n)
            epoch = batches(
                self.features,
                self.micro_batch_size,
                order=order,
                rank=self.rank,
                world_size=self.world_size,
                skip=self.batches,
            )
            for batch in epoch:
                self.batches += 1
                if self.batches == self.per_epoch:
                    self.epoch, self.batches = self.epoch + 1, 0
                yield batch
                if self.batches == 0:
                    break


# --------------------------------------------------------------------------- scoring


def score(
    data: TaskData, dev: EvalSet, outputs: dict[str, np.ndarray], cfg: TaskConfig
) -> tuple[dict[str, float], dict[str, Any]]:
    """Metrics of one evaluation and what its prediction files need.

    ``outputs`` holds the concatenated head outputs over ``dev`` in order: ``logits``
    ([N, C], [N, 1] or a list of [S_i, C] rows for token labels) or ``start_logits`` /
    ``end_logits`` (lists of [S_i] rows).
    """
    spec = data.spec
    if data.family in ("glue", "table") or spec.kind in ("classification", "regression"):
        logits = outputs["logits"]
        predictions = logits[:, 0] if spec.kind == "regression" else logits.argmax(-1)
        metrics = (
            compute_task_metrics(spec, predictions, dev.features["labels"])
            if "labels" in dev.features
            else {}
        )
        return metrics, {"predictions": predictions}
    if spec.kind == "span_qa":
        answers, nbest, null_odds = squad.decode(
            dev.examples,
            dev.features,
            outputs["start_logits"],
            outputs["end_logits"],
            n_best_size=cfg.n_best_size,
            max_answer_length=cfg.max_answer_length,
            version_2=data.version_2,
            null_score_diff_threshold=cfg.null_score_diff_threshold,
        )
        gold = squad_scores.gold_answers(dev.examples)
        if data.family == "klue":
            metrics = klue.klue_mrc_metrics(answers, gold)
        else:
            metrics = squad_scores.squad_metrics(answers, gold, language=cfg.language)
        return metrics, {"answers": answers, "nbest": nbest, "null_odds": null_odds}
    if data.family == "klue":
        chars = klue.align_klue_ner(dev.features, outputs["logits"], dev.examples, spec)
        return klue.klue_ner_metrics(dev.examples, chars, spec.labels), {"labels": chars}
    word_labels = conll.align_predictions(dev.features, outputs["logits"], dev.examples, spec)
    gold = [s.labels for s in dev.examples]
    return conll.entity_scores(gold, word_labels), {"labels": word_labels}


def write_predictions(
    data: TaskData, dev: EvalSet, predicted: dict[str, Any], folder: Path
) -> list[Path]:
    """The family's prediction files for one evaluation, under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    if data.spec.kind in ("classification", "regression"):
        path = folder / f"{dev.name}.tsv"
        guids = [e.guid for e in dev.examples]
        glue.write_glue_predictions(path, guids, predicted["predictions"], data.spec)
        return [path]
    if data.spec.kind == "span_qa":
        squad.write_squad_predictions(
            str(folder), predicted["answers"], predicted["nbest"], predicted["null_odds"]
        )
        return sorted(folder.glob("*.json"))
    if data.family == "klue":
        path = folder / f"{dev.name}.tsv"
        klue.write_klue_ner_predictions(path, dev.examples, predicted["labels"])
        return [path]
    path = folder / f"{dev.name}.conll"
    conll.write_conll_predictions(path, dev.examples, predicted["labels"])
    return [path]
