"""The NSP pair recipe, pinned statistically and against a port of Google's reference."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from bertpipe.preprocessing.instances import _removals, assemble, create_pairs
from bertpipe.preprocessing.tokenizer import SpecialTokens, load_tokenizer
from tests.preprocessing.helpers import docset, google_reference, tokenized_docs


def _passes(ds, max_seq_length: int, dupes: int, seed: int = 0):  # type: ignore[no-untyped-def]
    counts: Counter[str] = Counter()
    specs = [
        create_pairs(
            ds,
            max_seq_length=max_seq_length,
            short_seq_prob=0.1,
            random_next_prob=0.5,
            rng=np.random.default_rng([seed, d]),
            counts=counts,
        )
        for d in range(dupes)
    ]
    return specs, counts


def test_recipe_statistics(tokenizer_dir: Path) -> None:
    ds = docset(tokenizer_dir, 300, seed=5, min_sent=8, max_sent=60)
    specs, counts = _passes(ds, 128, dupes=10)
    a_len = np.concatenate([s.a_len for s in specs])
    b_len = np.concatenate([s.b_len for s in specs])
    random_next = np.concatenate([s.is_random_next for s in specs])
    lengths = a_len + b_len + 3
    assert lengths.max() <= 128 and a_len.min() >= 1 and b_len.min() >= 1
    # short targets: drawn once per document pass with probability 0.1
    assert counts["document_passes"] == 3000
    assert counts["documents_short_target"] / 3000 == pytest.approx(0.1, abs=0.02)
    # NSP: 50/50 where the recipe has a choice; single-sentence chunks are always random
    forced = counts["random_next_forced"]
    free = random_next.size - forced
    assert (random_next.sum() - forced) / free == pytest.approx(0.5, abs=0.02)
    # most instances fill the sequence; truncation only when the pair is too long
    assert np.median(lengths) >= 120


def test_pairs_are_contiguous_or_from_another_document(tokenizer_dir: Path) -> None:
    docs = tokenized_docs(tokenizer_dir, 50, seed=2, min_sent=4, max_sent=30)
    from bertpipe.preprocessing.instances import DocumentSet

    ds = DocumentSet.from_docs(docs)
    (spec,), _ = _passes(ds, 64, dupes=1)
    doc_start = np.array([s[0] for s in ds.starts])
    doc_of = lambda pos: np.searchsorted(doc_start, pos, side="right") - 1  # noqa: E731
    untruncated = spec.truncated == 0
    same = ~spec.is_random_next
    # B right after A in the same document when nothing was cut
    ok = (spec.a_start + spec.a_len == spec.b_start)[same & untruncated]
    assert ok.all() and ok.size > 20
    assert (doc_of(spec.a_start) == doc_of(spec.b_start))[same].all()
    # random next: B from another document (there are 50)
    assert (doc_of(spec.a_start) != doc_of(spec.b_start))[spec.is_random_next].all()
    # A and B each stay inside one document
    assert (doc_of(spec.a_start) == doc_of(spec.a_start + spec.a_len - 1)).all()
    assert (doc_of(spec.b_start) == doc_of(spec.b_start + spec.b_len - 1)).all()


def _starts(doc) -> list[int]:  # type: ignore[no-untyped-def]
    return [0, *doc.sentence_ends[:-1].tolist()]


def test_matches_googles_reference_in_distribution(tokenizer_dir: Path) -> None:
    docs = tokenized_docs(tokenizer_dir, 200, seed=9, min_sent=2, max_sent=40)
    documents = [
        [doc.tokens[s:e].tolist() for s, e in zip(_starts(doc), doc.sentence_ends, strict=True)]
        for doc in docs
    ]
    from bertpipe.preprocessing.instances import DocumentSet

    ds = DocumentSet.from_docs(docs)
    ref = [
        inst for d in range(10) for inst in google_reference(documents, 128, 0.1, random.Random(d))
    ]
    specs, _ = _passes(ds, 128, dupes=10)
    ours_n = sum(len(s) for s in specs)
    ours_len = np.concatenate([s.a_len + s.b_len for s in specs]).mean()
    ours_random = np.concatenate([s.is_random_next for s in specs]).mean()
    ours_trunc = np.concatenate([s.truncated > 0 for s in specs]).mean()
    ref_len = np.mean([r["a_len"] + r["b_len"] for r in ref])
    assert ours_n == pytest.approx(len(ref), rel=0.03)
    assert ours_len == pytest.approx(ref_len, rel=0.03)
    assert ours_random == pytest.approx(np.mean([r["random"] for r in ref]), abs=0.02)
    assert ours_trunc == pytest.approx(np.mean([r["truncated"] > 0 for r in ref]), abs=0.02)


@pytest.mark.parametrize("la", range(0, 12))
@pytest.mark.parametrize("lb", range(0, 12))
def test_removals_match_one_token_at_a_time(la: int, lb: int) -> None:
    for limit in range(1, la + lb):
        a, b = la, lb
        ra = rb = 0
        while a + b > limit:
            if a > b:
                a, ra = a - 1, ra + 1
            else:
                b, rb = b - 1, rb + 1
        assert _removals(la, lb, la + lb - limit) == (ra, rb)


def test_truncation_cuts_front_and_back(tokenizer_dir: Path) -> None:
    ds = docset(tokenizer_dir, 40, seed=4, min_sent=20, max_sent=40)
    (spec,), _ = _passes(ds, 32, dupes=1)
    sentence_starts = {s for doc in ds.starts for s in doc}
    cut = spec.truncated > 0
    assert cut.mean() > 0.5
    front_cut = ~np.isin(spec.a_start[cut], list(sentence_starts))
    # about half of the truncated A segments lost tokens at the front
    assert 0.2 < front_cut.mean() < 0.8


def test_assemble_layout(tokenizer_dir: Path) -> None:
    ds = docset(tokenizer_dir, 20, seed=1)
    (spec,), _ = _passes(ds, 64, dupes=1)
    specials = SpecialTokens.from_tokenizer(load_tokenizer(str(tokenizer_dir)))
    block = assemble(
        ds.tokens, spec, cls_id=specials.cls, sep_id=specials.sep, dtype=np.dtype(np.uint16)
    )
    for i in (0, 1, len(block) - 1):
        inst = block.instance(i)
        la, lb = int(spec.a_len[i]), int(spec.b_len[i])
        ids = inst.input_ids
        assert ids[0] == specials.cls and ids[la + 1] == specials.sep and ids[-1] == specials.sep
        assert (
            ids[1 : la + 1].tolist() == ds.tokens[spec.a_start[i] : spec.a_start[i] + la].tolist()
        )
        assert (
            ids[la + 2 : -1].tolist() == ds.tokens[spec.b_start[i] : spec.b_start[i] + lb].tolist()
        )
        assert inst.token_type_ids.tolist() == [0] * (la + 2) + [1] * (lb + 1)
        assert inst.is_random_next == bool(spec.is_random_next[i])
