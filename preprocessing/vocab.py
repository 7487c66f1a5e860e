"""``bertpipe tokenizer train``: a WordPiece vocabulary learnt from a corpus (read as
``preprocess`` reads it, sampled by a stable hash of each document), or built from Google's
``vocab.txt``, written with its tokenizer files and recorded in MLflow."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from bertpipe import fsio, tracking
from bertpipe.fsio import common_root
from bertpipe.preprocessing.config import TokenizerConfig
from bertpipe.preprocessing.job_output import (
    OutputExistsError,
)
from bertpipe.preprocessing.readers import (
    NoTrainingDataError,
    check_input_format,
    read_documents,
)
from bertpipe.preprocessing.tokenizer import (
    SpecialTokens,
    build_from_vocab,
    read_vocab_txt,
    sample_statistics,
    save_tokenizer,
    tokenizer_checksum,
    train_wordpiece,
)
from bertpipe.seeding import stable_unit

log = logging.getLogger(__name__)


def train_tokenizer(cfg: TokenizerConfig) -> dict[str, Any]:
    """Train (or import) the WordPiece tokenizer and write it to ``cfg.output``.

    Its MLflow run spans the work: the corpus (or vocabulary file) is its dataset input, the
    tokenizer its logged model output (tagged with its checksum, which is how preprocessing
    runs find it as their model input)."""
    out_json = fsio.join(cfg.output, "tokenizer.json")
    if fsio.exists(out_json) and not cfg.overwrite:
        raise OutputExistsError(
            f"{out_json} already exists: pass --overwrite (overwrite=true) or choose another output"
        )
    cfg.check_runnable()
    files = fsio.expand_urls(cfg.input.paths) if cfg.input.paths else []
    if not cfg.vocab_file:
        check_input_format(files, cfg.input)
    with tracking.start_run(
        cfg.tracking, "tokenizer", config=cfg, run_name=cfg.tracking.run_name or "tokenizer"
    ) as run:
        if run is not None:
            source = [cfg.vocab_file] if cfg.vocab_file else files
            tracking.log_inputs(
                [tracking.files_dataset("vocabulary" if cfg.vocab_file else "corpus", source)]
            )
        summary = _train_tokenizer(cfg, files)
        if run is not None:
            sha = summary["tokenizer_sha256"]
            tracking.set_tags({tracking.TAG_TOKENIZER: sha})
            tracking.log_metrics({k: v for k, v in summary.items() if k != "tokenizer_sha256"})
            tracking.log_folder_model(
                cfg.output,
                run.info.run_id,
                name="tokenizer",
                model_type="tokenizer",
                tags={tracking.TAG_TOKENIZER: sha},
            )
    return summary


def _train_tokenizer(cfg: TokenizerConfig, files: list[str]) -> dict[str, Any]:
    started = time.monotonic()
    counts: Counter[str] = Counter()
    if cfg.vocab_file:
        tokenizer = build_from_vocab(
            read_vocab_txt(cfg.vocab_file), normalisation=cfg.normalisation()
        )
        SpecialTokens.from_tokenizer(tokenizer, cfg.vocab_file)
    else:

        def sample():  # type: ignore[no-untyped-def]  # read twice: alphabet, then training
            counts.clear()
            return _sample_sentences(cfg, files, counts)

        tokenizer = train_wordpiece(
            sample,
            vocab_size=cfg.vocab_size,
            normalisation=cfg.normalisation(),
            min_frequency=cfg.min_frequency,
            limit_alphabet=cfg.limit_alphabet,
            special_tokens=cfg.special_tokens,
            counts=counts,
        )
        if not counts["documents_sampled"]:
            raise NoTrainingDataError(_nothing_sampled(cfg, files, counts))
        if tokenizer.get_vocab_size() < cfg.vocab_size:
            _warn_small_vocabulary(cfg, tokenizer.get_vocab_size(), sample, counts)
    save_tokenizer(tokenizer, cfg.output)
    summary = {
        "vocab_size": tokenizer.get_vocab_size(),
        "tokenizer_sha256": tokenizer_checksum(tokenizer),
        "seconds": round(time.monotonic() - started, 2),
        **dict(sorted(counts.items())),
    }
    log.info("tokenizer written to %s: %s", cfg.output, json.dumps(summary))
    return summary


def _nothing_sampled(cfg: TokenizerConfig, files: Sequence[str], counts: Counter[str]) -> str:
    """One line: no document reached the trainer, why, and what to do."""
    skipped = ", ".join(
        f"{k}={v}"
        for k, v in sorted(counts.items())
        if v and k.startswith(("files_skipped", "files_failed", "records_", "documents_empty"))
    )
    fraction = (
        f", or raise sample_fraction (={cfg.sample_fraction}: no document was drawn)"
        if cfg.sample_fraction < 1.0 and counts.get("files_read")
        else ""
    )
    fields = (
        f" and input.text_field={cfg.input.text_field}"
        if cfg.input.format
        in (
            "jsonl",
            "parquet",
        )
        else ""
    )
    return (
        f"no document to train the vocabulary on in the {len(files)} file(s) matching "
        f"input.paths={list(cfg.input.paths)}: {counts.get('files_read', 0)} file(s) read "
        f"({skipped or 'nothing skipped'}, see the warnings above); check input.paths and "
        f"input.format={cfg.input.format}{fields}{fraction}; nothing was written to {cfg.output}"
    )


def _warn_small_vocabulary(
    cfg: TokenizerConfig, size: int, sample: Any, counts: Counter[str]
) -> None:
    """One warning line when the vocabulary came out smaller than ``vocab_size``: what the
    sample holds (read once more: a sample this small is quick to read) and what to change."""
    words, characters = sample_statistics(sample(), normalisation=cfg.normalisation())
    frequent = sum(1 for n in words.values() if n >= cfg.min_frequency)
    capped = [
        f"{key}={value}"
        for key, value in (("max_documents", cfg.max_documents), ("max_mb", cfg.max_mb))
        if value is not None
    ]
    drawn = f"sample_fraction={cfg.sample_fraction} of the documents" + "".join(
        f", {c}" for c in capped
    )
    raise_it = (
        f"raise {' / '.join(['sample_fraction'] * (cfg.sample_fraction < 1.0) + capped)}"
        if cfg.sample_fraction < 1.0 or capped
        else "give more text"
    )
    log.warning(
        "tokenizer: the vocabulary has %d tokens, fewer than vocab_size=%d: it learned from %s "
        "(%d document(s)), which hold %d distinct words (%d of them seen min_frequency=%d "
        "times or more) and %d distinct characters; %s, lower min_frequency, or ask for a "
        "smaller vocab_size",
        size,
        cfg.vocab_size,
        drawn,
        counts["documents_sampled"],
        len(words),
        frequent,
        cfg.min_frequency,
        len(characters),
        raise_it,
    )


def _sample_sentences(cfg: TokenizerConfig, files: list[str], counts: Counter[str]):  # type: ignore[no-untyped-def]
    root = common_root(files)
    taken = 0
    budget = None if cfg.max_mb is None else cfg.max_mb * 1e6
    text = 0

    def sampled(doc_id: str) -> bool:
        return stable_unit("sample", doc_id) < cfg.sample_fraction

    keep = sampled if cfg.sample_fraction < 1.0 else None
    for url in files:
        for doc in read_documents(url, cfg.input, counts, root=root, keep=keep):
            if keep is not None and not keep(doc.doc_id):  # the sentences layout
                continue
            taken += 1
            counts["documents_sampled"] += 1
            yield from doc.sentences
            text += sum(len(s) + 1 for s in doc.sentences)
            if cfg.max_documents is not None and taken >= cfg.max_documents:
                return
            if budget is not None and text >= budget:
                return
