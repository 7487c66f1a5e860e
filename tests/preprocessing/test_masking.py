"""Masked-LM masking pinned statistically: 15%, 80/10/10, specials, caps, whole words."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from bertpipe.preprocessing.instances import assemble, create_pairs
from bertpipe.preprocessing.masking import MaskingSpec, mask_block
from bertpipe.preprocessing.shard_format import InstanceBlock
from bertpipe.preprocessing.tokenizer import SpecialTokens, load_tokenizer
from tests.preprocessing.helpers import docset


def _block(
    tokenizer_dir: Path, max_seq_length: int = 128, n_docs: int = 300
) -> tuple[InstanceBlock, SpecialTokens, int]:
    tok = load_tokenizer(str(tokenizer_dir))
    specials = SpecialTokens.from_tokenizer(tok)
    ds = docset(tokenizer_dir, n_docs, seed=11, min_sent=4, max_sent=40)
    spec = create_pairs(
        ds,
        max_seq_length=max_seq_length,
        short_seq_prob=0.1,
        random_next_prob=0.5,
        rng=np.random.default_rng(0),
        counts=Counter(),
    )
    block = assemble(
        ds.tokens, spec, cls_id=specials.cls, sep_id=specials.sep, dtype=np.dtype(np.uint16)
    )
    return block, specials, tok.get_vocab_size()


def _spec(specials: SpecialTokens, vocab: int, max_pred: int = 20, **kw: object) -> MaskingSpec:
    return MaskingSpec(
        masked_lm_prob=0.15,
        max_predictions_per_seq=max_pred,
        mask_id=specials.mask,
        vocab_size=vocab,
        special_ids=specials.all(),
        **kw,  # type: ignore[arg-type]
    )


def test_masking_recipe_statistics(tokenizer_dir: Path) -> None:
    block, specials, vocab = _block(tokenizer_dir)
    masked = mask_block(block, _spec(specials, vocab), np.random.default_rng(1), chunk=1000)
    lengths = masked.lengths.astype(int)
    counts = masked.info[:, 2].astype(int)
    expected = np.minimum(20, np.maximum(1, np.round(lengths * 0.15))).astype(int)
    assert (counts == expected).all()
    assert counts.sum() / lengths.sum() == pytest.approx(0.15, abs=0.01)
    # 80% [MASK], 10% random, 10% unchanged, over ~tens of thousands of predictions
    offsets = masked.token_offsets
    where = np.repeat(offsets, counts) + masked.mlm_pos.astype(int)
    now = masked.tokens[where]
    is_mask = now == specials.mask
    unchanged = now == masked.mlm_ids
    assert counts.sum() > 15_000
    assert is_mask.mean() == pytest.approx(0.8, abs=0.01)
    assert unchanged.mean() == pytest.approx(0.1, abs=0.01)
    assert (~is_mask & ~unchanged).mean() == pytest.approx(0.1, abs=0.01)
    # specials are never chosen, never used as replacements; labels are the originals
    assert not np.isin(masked.mlm_ids, specials.all()).any()
    assert not np.isin(now[~is_mask], specials.all()).any()
    assert (block.tokens[where] == masked.mlm_ids).all()
    # untouched positions keep their tokens
    keep = np.ones(block.tokens.size, bool)
    keep[where] = False
    assert (masked.tokens[keep] == block.tokens[keep]).all()


def test_positions_sorted_unique_inside_and_capped(tokenizer_dir: Path) -> None:
    block, specials, vocab = _block(tokenizer_dir, max_seq_length=512, n_docs=120)
    masked = mask_block(block, _spec(specials, vocab, max_pred=30), np.random.default_rng(2))
    m0 = masked.mlm_offsets
    for i in range(len(masked)):
        n = int(masked.info[i, 2])
        pos = masked.mlm_pos[m0[i] : m0[i] + n].astype(int)
        assert n <= 30
        assert (np.diff(pos) > 0).all()
        assert pos.min() >= 1 and pos.max() <= int(masked.lengths[i]) - 2
    assert masked.mlm_pos.dtype == np.uint16  # lengths above 256


def test_deterministic_for_a_seed(tokenizer_dir: Path) -> None:
    block, specials, vocab = _block(tokenizer_dir, n_docs=50)
    a = mask_block(block, _spec(specials, vocab), np.random.default_rng(7))
    b = mask_block(block, _spec(specials, vocab), np.random.default_rng(7))
    assert a.pack() == b.pack()


def test_whole_word_masking_masks_words_together(tmp_path: Path) -> None:
    from bertpipe.preprocessing.tokenizer import save_tokenizer, train_wordpiece
    from tests.conftest import synthetic_documents

    texts = [s for d in synthetic_documents(100, seed=1) for s in d]
    save_tokenizer(
        train_wordpiece(texts, vocab_size=150, min_frequency=1), str(tmp_path), lowercase=True
    )
    tokenizer_dir = tmp_path
    tok = load_tokenizer(str(tokenizer_dir))
    vocab = tok.get_vocab()
    continuation = np.zeros(tok.get_vocab_size(), bool)
    continuation[[i for t, i in vocab.items() if t.startswith("##")]] = True
    block, specials, size = _block(tokenizer_dir, n_docs=150)
    assert continuation[block.tokens].mean() > 0.05  # the corpus has multi-piece words
    masked = mask_block(
        block,
        _spec(specials, size, whole_word=True, continuation=continuation),
        np.random.default_rng(3),
    )
    offsets, m0 = masked.token_offsets, masked.mlm_offsets
    words_checked = 0
    for i in range(len(masked)):
        n = int(masked.info[i, 2])
        start, length = int(offsets[i]), int(masked.lengths[i])
        original = block.tokens[start : start + length]
        chosen = set(masked.mlm_pos[m0[i] : m0[i] + n].astype(int).tolist())
        assert n <= 20
        for p in range(1, length - 1):
            if continuation[original[p]] and not np.isin(original[p - 1], specials.all()):
                # a ## piece is masked exactly when the piece before it is
                assert (p in chosen) == (p - 1 in chosen)
                words_checked += p in chosen
    assert words_checked > 100
