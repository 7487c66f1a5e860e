"""Typed configs of the tokenizer and preprocessing stages (YAML + dotted overrides)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from bertpipe.config import ConfigError
from bertpipe.preprocessing.quality_config import QualityConfig
from bertpipe.preprocessing.readers import InputConfig
from bertpipe.tracking import TrackingConfig

if TYPE_CHECKING:
    from bertpipe.preprocessing.normalisation import Normalisation

__all__ = ["MaskingConfig", "PhaseConfig", "PreprocessConfig", "TokenizerConfig"]


@dataclass
class TokenizerConfig:
    """``bertpipe tokenizer train``: a BERT WordPiece vocabulary from a corpus sample."""

    input: InputConfig = field(default_factory=InputConfig)
    """The corpus to learn the vocabulary from."""
    output: str = "runs/tokenizer"
    """Folder for tokenizer.json, vocab.txt and tokenizer_config.json."""
    vocab_file: str | None = None
    """Use this existing vocab.txt (e.g. Google's 30,522-token uncased one) instead of training."""
    vocab_size: int = 30522
    """Target vocabulary size, special tokens included."""
    lowercase: bool = True
    """Uncased model: lower-case and strip accents (BERT's BasicTokenizer). For text in
    scripts without case (Korean, Japanese, Chinese) the cased model, ``lowercase=false``,
    is Google's advice (configs/tokenizer-ko-cased.yaml)."""
    strip_accents: bool | None = None
    """Remove accents (``café`` -> ``cafe``); null follows ``lowercase``, as BERT does."""
    accent_marks: Literal["diacritics", "all"] = "diacritics"
    """What accent stripping removes: ``diacritics``, the combining diacritical marks of
    Latin, Greek and Cyrillic letters (then recomposed: Hangul syllables, kana voicing marks,
    Indic and Thai vowel signs stay whole); ``all``, Google BERT's stripping (every
    nonspacing mark after NFD, nothing recomposed: Hangul becomes jamo, ``が`` becomes
    ``か``), only to reproduce one of Google's uncased vocabularies exactly."""
    tokenize_chinese_chars: bool = True
    """A CJK ideograph (Chinese, Japanese kanji, Korean hanja) is a word of its own."""
    clean_text: bool = True
    """Drop control characters and make every white space a plain space."""
    special_tokens: list[str] = field(
        default_factory=lambda: ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    )
    """Special tokens, given the first ids in this order."""
    min_frequency: int = 2
    """A merge must be seen this often."""
    limit_alphabet: int = 1000
    """Most characters kept in the initial alphabet."""
    sample_fraction: float = 1.0
    """Share of documents to train on, chosen by a stable hash of the document id."""
    max_documents: int | None = None
    """Stop after this many sampled documents (files are read in sorted order)."""
    max_mb: float | None = None
    """Stop after this many megabytes of sampled text. A vocabulary learnt from a few
    hundred MB of a corpus is as good as one from all of it, at a fraction of the time:
    ``sample_fraction=0.02 max_mb=300`` spreads the sample over a 20 GB corpus."""
    overwrite: bool = False
    """Replace a tokenizer already in ``output``."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def normalisation(self) -> Normalisation:
        """The tokenizer's text normalisation these settings give."""
        from bertpipe.preprocessing.normalisation import Normalisation

        return Normalisation(
            lowercase=self.lowercase,
            strip_accents=self.strip_accents,
            accent_marks=self.accent_marks,
            tokenize_chinese_chars=self.tokenize_chinese_chars,
            clean_text=self.clean_text,
        )

    def check_runnable(self) -> None:
        """What a run needs beyond a valid config (recipes may leave the inputs open)."""
        if self.vocab_file is None and not self.input.paths:
            raise ConfigError("input.paths", "give the corpus files to train on (or vocab_file)")

    def __post_init__(self) -> None:
        if self.vocab_size < len(self.special_tokens) + 10:
            raise ConfigError("vocab_size", "is too small to hold the special tokens and text")
        if not 0.0 < self.sample_fraction <= 1.0:
            raise ConfigError("sample_fraction", "must be in (0, 1]")
        if self.max_mb is not None and self.max_mb <= 0:
            raise ConfigError("max_mb", "must be positive (or null for no limit)")


@dataclass
class PhaseConfig:
    """One pre-training phase's instances: sequence length and prediction budget."""

    name: str = "seq128"
    """Folder name under ``output`` (and how training refers to the phase's data)."""
    max_seq_length: int = 128
    """Tokens per instance, ``[CLS]`` and both ``[SEP]`` included."""
    max_predictions_per_seq: int = 20
    """Cap on masked positions per instance."""
    num_shards: int | None = None
    """Training shards; null estimates it from the input size and ``target_shard_mb``."""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise ConfigError("name", "must be a plain folder name such as seq128")
        if not 8 <= self.max_seq_length <= 8192:
            raise ConfigError("max_seq_length", "must be between 8 and 8192")
        if not 1 <= self.max_predictions_per_seq <= self.max_seq_length - 3:
            raise ConfigError("max_predictions_per_seq", "must be between 1 and max_seq_length - 3")
        if self.num_shards is not None and self.num_shards < 1:
            raise ConfigError("num_shards", "must be at least 1 (or null)")


@dataclass
class MaskingConfig:
    """Masked-LM recipe."""

    mode: Literal["static", "none"] | None = None
    """``static``: masks written into the shards (a new draw per dupe); ``none``: shards
    hold unmasked text and the training loader masks at load time (dynamic masking). Null
    follows the objective: ``static`` for ``mlm+nsp`` (the BERT paper's), ``none`` for
    ``mlm`` (RoBERTa's dynamic masking); the resolved value is what the manifest records."""
    masked_lm_prob: float = 0.15
    """Share of each instance's tokens to predict (at most ``max_predictions_per_seq``): 0.15
    in BERT, 0.3 in the modern recipe (ModernBERT, after MosaicBERT)."""
    mask_token_prob: float = 0.8
    """Of the chosen tokens, share replaced by [MASK]."""
    random_token_prob: float = 0.1
    """Of the chosen tokens, share replaced by a random token (the rest stay unchanged)."""
    whole_word: bool = False
    """Mask all pieces of a word together."""

    def __post_init__(self) -> None:
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise ConfigError("masked_lm_prob", "must be in (0, 1)")
        if self.mask_token_prob < 0 or self.random_token_prob < 0:
            raise ConfigError("mask_token_prob", "probabilities must not be negative")
        if self.mask_token_prob + self.random_token_prob > 1.0:
            raise ConfigError(
                "random_token_prob", "mask_token_prob + random_token_prob must be <= 1"
            )


def _default_phases() -> list[PhaseConfig]:
    return [PhaseConfig("seq128", 128, 20), PhaseConfig("seq512", 512, 80)]


OPERATIONAL_KEYS = ("output", "overwrite", "tracking", "stall_timeout_s")
""":class:`PreprocessConfig` keys that say where and how a job runs, not what data it makes:
not in a manifest's config, and a job continued with other values is the same job."""


@dataclass
class PreprocessConfig:
    """``bertpipe preprocess``: documents to masked-LM (+ NSP) instances in WebDataset shards."""

    input: InputConfig = field(default_factory=InputConfig)
    """The corpus."""
    tokenizer: str = "runs/tokenizer"
    """Tokenizer folder (tokenizer.json and/or vocab.txt), a tokenizer.json or a vocab.txt."""
    tokenizer_sha256: str | None = None
    """If set, the run refuses a tokenizer with another checksum."""
    lowercase: bool = True
    """Only for a bare vocab.txt: whether the vocabulary is uncased."""
    output: str = "runs/shards"
    """Output root: one folder per phase with shards and manifest.json."""
    overwrite: bool = False
    """Replace shards already in the output folders."""
    phases: list[PhaseConfig] = field(default_factory=_default_phases)
    """Phases written by one run from one tokenization of the corpus."""
    seed: int = 12345
    """Seeds every random choice, through stable hashes of what it decides."""
    objective: Literal["mlm+nsp", "mlm"] = "mlm+nsp"
    """``mlm+nsp``: the BERT paper's sentence pairs ``[CLS] A [SEP] B [SEP]`` with the NSP
    label (``short_seq_prob``, ``random_next_prob``). ``mlm``: masked LM alone (RoBERTa,
    ModernBERT): whole sentences packed into ``[CLS] ... [SEP]`` instances as ``packing``
    says, one segment, no NSP label, dynamic masking unless ``masking.mode`` says otherwise."""
    packing: Literal["full_sentences", "doc_sentences"] = "full_sentences"
    """``mlm`` only, RoBERTa's names: ``full_sentences`` packs full sentences contiguously
    from one or more documents (in a random order of the documents, new each dupe pass), with
    an extra ``[SEP]`` where it crosses a document boundary; ``doc_sentences`` packs the same
    way without crossing one (each document alone: shorter instances at its end). A sentence
    longer than an instance is cut into pieces, not dropped."""
    dupe_factor: int = 5
    """Passes over the corpus, each with new pairs (``mlm``: a new document order) and masks."""
    short_seq_prob: float = 0.1
    """``mlm+nsp`` only: probability that a document pass uses a random shorter target
    length."""
    random_next_prob: float = 0.5
    """``mlm+nsp`` only: probability that segment B comes from another document."""
    min_sentences: int | None = None
    """Documents with fewer sentences are skipped (and counted as ``documents_too_short``).
    Null follows the objective: 2 for ``mlm+nsp`` (a pair needs a sentence on each side; a
    single-sentence chunk would get a random B every time), 1 for ``mlm`` (a one-sentence
    document packs as well as any)."""
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)
    """Corpus quality before instances are made: filters, decontamination against evaluation
    sets, exact and near-duplicate removal (all off: the paper recipe's output). See
    docs/corpus-quality.md."""
    heldout_fraction: float = 0.01
    """Share of documents (by stable hash of the id) written to the held-out split."""
    bucket_mb: float = 32.0
    """Input megabytes per bucket: random-next segments come from the same bucket; buckets are
    the unit of parallelism of instance creation, and what bounds a worker's memory (a
    bucket's documents are in memory while its instances are made)."""
    split_mb: float = 64.0
    """Uncompressed ``sentences``/``jsonl`` files larger than this are read in byte ranges of
    about this size by several workers at once (parquet files in runs of row groups). The
    documents of a file read in ranges are named by byte offset instead of ordinal, which
    changes which of them are held out, not the statistics: part of the data's config."""
    target_shard_mb: float = 32.0
    """Estimated output megabytes per training shard when ``num_shards`` is null. A shard is
    shuffled whole, in the memory of the worker writing it: this bounds that memory."""
    min_shards: int = 8
    """Lower bound on estimated training shard counts."""
    instances_per_sample: int = 256
    """Instances per WebDataset sample (one block)."""
    tokenize_batch_documents: int = 256
    """Documents per tokenizer ``encode_batch`` call."""
    stall_timeout_s: float = 300.0
    """On a Dask cluster: a job whose cluster runs none of its tasks for this long (a worker
    left waiting for a lost one; no task executing, none finishing) is stopped with exit
    status 75, its finished work kept for the same command to continue. 0: wait for ever.
    Not part of the data's config."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def check_runnable(self) -> None:
        """What a run needs beyond a valid config (recipes may leave the inputs open)."""
        if not self.input.paths:
            raise ConfigError("input.paths", "give at least one input file, folder or glob")

    def __post_init__(self) -> None:
        if not self.phases:
            raise ConfigError("phases", "list at least one phase")
        names = [p.name for p in self.phases]
        if len(set(names)) != len(names):
            raise ConfigError("phases", f"phase names must be unique, got {names}")
        if self.dupe_factor < 1:
            raise ConfigError("dupe_factor", "must be at least 1")
        for key in ("short_seq_prob", "random_next_prob"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(key, "must be between 0 and 1")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ConfigError("heldout_fraction", "must be in [0, 1)")
        if self.min_sentences is None:
            self.min_sentences = 1 if self.objective == "mlm" else 2
        if self.min_sentences < 1:
            raise ConfigError("min_sentences", "must be at least 1 (or null)")
        if self.masking.mode is None:
            self.masking.mode = "none" if self.objective == "mlm" else "static"
        if self.objective == "mlm":
            self._check_prediction_budget()
        for key in ("bucket_mb", "split_mb", "target_shard_mb"):
            if getattr(self, key) <= 0:
                raise ConfigError(key, "must be positive")
        if self.instances_per_sample < 1:
            raise ConfigError("instances_per_sample", "must be at least 1")
        if self.min_shards < 1:
            raise ConfigError("min_shards", "must be at least 1")
        if self.stall_timeout_s < 0:
            raise ConfigError("stall_timeout_s", "must be 0 (no bound) or a number of seconds")

    def _check_prediction_budget(self) -> None:
        """``mlm``: every phase must take ``masked_lm_prob`` of a full instance. (``mlm+nsp``
        keeps the paper's cap: Google's recipe allows 76 predictions at 512 tokens and 0.15,
        under the 77 it would ask for.)"""
        prob = self.masking.masked_lm_prob
        for i, phase in enumerate(self.phases):
            # the most positions masking asks for: masking.py's np.round(length * prob),
            # which rounds halves to even as round() does
            need = round(phase.max_seq_length * prob)
            if phase.max_predictions_per_seq < need:
                raise ConfigError(
                    f"phases[{i}].max_predictions_per_seq",
                    f"is {phase.max_predictions_per_seq}, below masking.masked_lm_prob x "
                    f"max_seq_length = {prob} x {phase.max_seq_length} = "
                    f"{phase.max_seq_length * prob:g}: raise it to at least "
                    f"{need} (or lower masking.masked_lm_prob)",
                )

    # ---- derived values (deterministic functions of the config and the input sizes) ----

    def num_buckets(self, text_bytes: int) -> int:
        return max(1, math.ceil(text_bytes / (self.bucket_mb * 1e6)))

    def num_shards(self, phase: PhaseConfig, text_bytes: int) -> int:
        """Training shards of ``phase``: given, or from the estimated output size.

        The estimate: ~4.3 characters per token, ~2.6 bytes per token in a shard (uint16 ids
        plus masked positions and labels), ``dupe_factor`` copies.
        """
        if phase.num_shards is not None:
            return phase.num_shards
        est_mb = text_bytes / 4.3 * 2.6 * self.dupe_factor / 1e6
        return max(self.min_shards, math.ceil(est_mb / self.target_shard_mb))

    def heldout_shards(self, phase: PhaseConfig, text_bytes: int) -> int:
        if self.heldout_fraction == 0:
            return 0
        return max(1, round(self.num_shards(phase, text_bytes) * self.heldout_fraction))
