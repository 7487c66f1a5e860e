"""Masked-LM masking, vectorised over a block of instances.

BERT's recipe: in each instance, ``num_to_predict = min(max_predictions_per_seq,
max(1, round(length * masked_lm_prob)))`` positions are chosen uniformly among the
non-special tokens; of them 80% become ``[MASK]``, 10% a random token and 10% stay as they
are; the original ids are the labels. Special tokens (``[CLS]``, ``[SEP]``, ``[PAD]``,
``[UNK]``, ``[MASK]``) are never chosen, and random replacements are never special tokens.

With whole-word masking the candidates are words (a token and the ``##`` pieces after it),
taken in random order; a word that does not fit in what is left of the budget is skipped,
as the reference implementation does.

Used by ``bertpipe preprocess`` (static masks, one per ``dupe_factor`` copy) and by the
training loader (dynamic masking of unmasked shards).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bertpipe.preprocessing.shard_format import LENGTH, NUM_MASKED, InstanceBlock

__all__ = ["MaskingSpec", "mask_block"]


@dataclass(frozen=True)
class MaskingSpec:
    """What masking needs to know about the recipe and the vocabulary."""

    masked_lm_prob: float
    max_predictions_per_seq: int
    mask_id: int
    vocab_size: int
    special_ids: tuple[int, ...]
    mask_token_prob: float = 0.8
    random_token_prob: float = 0.1
    whole_word: bool = False
    continuation: np.ndarray | None = None
    """[vocab] bool, True for ``##`` pieces; required for whole-word masking."""

    def special_table(self) -> np.ndarray:
        table = np.zeros(max(self.vocab_size, max(self.special_ids) + 1), dtype=bool)
        table[list(self.special_ids)] = True
        return table

    def replacement_ids(self) -> np.ndarray:
        """Ids a random replacement may take: every non-special token."""
        table = self.special_table()[: self.vocab_size]
        return np.flatnonzero(~table)


def mask_block(
    block: InstanceBlock, spec: MaskingSpec, rng: np.random.Generator, chunk: int = 4096
) -> InstanceBlock:
    """A copy of ``block`` (which must be unmasked) with masks applied and labels recorded.

    Works ``chunk`` instances at a time, so its scratch memory is bounded (about 1 KB per
    instance of the chunk at length 128) whatever the block's size.
    """
    n = len(block)
    if n == 0:
        return block
    if n > chunk:
        parts = [
            _mask_chunk(block.take(np.arange(i, min(i + chunk, n))), spec, rng)
            for i in range(0, n, chunk)
        ]
        return InstanceBlock.concat(parts)
    return _mask_chunk(block, spec, rng)


def _mask_chunk(block: InstanceBlock, spec: MaskingSpec, rng: np.random.Generator) -> InstanceBlock:
    n = len(block)
    lengths = block.info[:, LENGTH].astype(np.int64)
    offsets = np.cumsum(lengths) - lengths
    max_len = int(lengths.max())
    special = spec.special_table()

    # [n, max_len] view of the tokens; padding counts as special (never a candidate)
    rows = np.repeat(np.arange(n), lengths)
    cols = np.arange(lengths.sum()) - np.repeat(offsets, lengths)
    flat_index = rows * max_len + cols
    candidate = np.zeros(n * max_len, dtype=bool)
    candidate[flat_index] = ~special[block.tokens]
    candidate = candidate.reshape(n, max_len)
    n_candidates = candidate.sum(axis=1)
    budget = np.minimum(
        spec.max_predictions_per_seq,
        np.maximum(1, np.round(lengths * spec.masked_lm_prob).astype(np.int64)),
    )

    if spec.whole_word:
        positions, counts = _choose_whole_words(block, candidate, budget, spec, rng)
    else:
        budget = np.minimum(budget, n_candidates)
        positions, counts = _choose_tokens(candidate, budget, spec.max_predictions_per_seq, rng)

    # 80% [MASK], 10% random token, 10% unchanged
    token_index = np.repeat(offsets, counts) + positions
    labels = block.tokens[token_index]
    tokens = block.tokens.copy()
    draw = rng.random(positions.size)
    to_mask = draw < spec.mask_token_prob
    to_random = (draw >= spec.mask_token_prob) & (
        draw < spec.mask_token_prob + spec.random_token_prob
    )
    tokens[token_index[to_mask]] = spec.mask_id
    choices = spec.replacement_ids()
    random_ids = choices[rng.integers(0, choices.size, int(to_random.sum()))]
    tokens[token_index[to_random]] = random_ids.astype(tokens.dtype)

    info = block.info.copy()
    info[:, NUM_MASKED] = counts
    pos_dtype = np.uint8 if max_len <= 256 else np.uint16
    return InstanceBlock(tokens, info, positions.astype(pos_dtype), labels.astype(tokens.dtype))


def _choose_tokens(
    candidate: np.ndarray, budget: np.ndarray, max_predictions: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Row i's ``budget[i]`` candidates with the smallest random keys, ascending by position."""
    n, width = candidate.shape
    keys = rng.random((n, width))
    keys[~candidate] = 2.0
    take = min(max_predictions, width)
    if take < width:
        chosen = np.argpartition(keys, take - 1, axis=1)[:, :take]
    else:
        chosen = np.broadcast_to(np.arange(width), (n, width)).copy()
    chosen_keys = np.take_along_axis(keys, chosen, axis=1)
    order = np.argsort(chosen_keys, axis=1, kind="stable")
    chosen = np.take_along_axis(chosen, order, axis=1)
    keep = np.arange(take)[None, :] < budget[:, None]
    chosen = np.where(keep, chosen, width)
    chosen.sort(axis=1)  # the kept positions, ascending, then the `width` fillers
    return chosen[keep], budget.astype(np.int64)


def _choose_whole_words(
    block: InstanceBlock,
    candidate: np.ndarray,
    budget: np.ndarray,
    spec: MaskingSpec,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    if spec.continuation is None:
        raise ValueError("whole-word masking needs the vocabulary's continuation table")
    positions: list[np.ndarray] = []
    counts = np.zeros(len(block), dtype=np.int64)
    offsets = block.token_offsets
    lengths = block.lengths.astype(np.int64)
    for i in range(len(block)):
        cand = candidate[i, : lengths[i]]
        idx = np.flatnonzero(cand)
        if idx.size == 0:
            positions.append(idx)
            continue
        toks = block.tokens[offsets[i] + idx]
        # a candidate starts a new word unless it is a ## piece right after another candidate
        joins = spec.continuation[toks] & np.concatenate(([False], np.diff(idx) == 1))
        word_starts = np.flatnonzero(~joins)
        word_sizes = np.diff(np.append(word_starts, idx.size))
        order = rng.permutation(word_starts.size)
        left = int(budget[i])
        picked: list[int] = []
        for w in order.tolist():
            if left <= 0:
                break
            size = int(word_sizes[w])
            if size > left:
                continue
            start = int(word_starts[w])
            picked.extend(range(start, start + size))
            left -= size
        chosen = np.sort(idx[picked]) if picked else idx[:0]
        positions.append(chosen)
        counts[i] = chosen.size
    return np.concatenate(positions) if positions else np.zeros(0, np.int64), counts
