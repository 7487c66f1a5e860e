"""Test helpers: tokenized synthetic documents and a literal port of Google's recipe."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import numpy as np

from bertpipe.preprocessing.instances import DocumentSet, TokenizedDoc
from bertpipe.preprocessing.tokenizer import load_tokenizer
from tests.conftest import synthetic_documents


def tokenized_docs(
    tokenizer_dir: Path, n_docs: int, seed: int = 0, **kw: int
) -> list[TokenizedDoc]:
    tok = load_tokenizer(str(tokenizer_dir))
    docs = []
    for i, sentences in enumerate(synthetic_documents(n_docs, seed=seed, **kw)):
        ids = [e.ids for e in tok.encode_batch(sentences, add_special_tokens=False)]
        lengths = np.array([len(x) for x in ids], dtype=np.int32)
        tokens = np.array([t for x in ids for t in x], dtype=np.uint16)
        docs.append(TokenizedDoc(f"doc{i:05d}", tokens, np.cumsum(lengths, dtype=np.int32)))
    return docs


def docset(tokenizer_dir: Path, n_docs: int, seed: int = 0, **kw: int) -> DocumentSet:
    return DocumentSet.from_docs(tokenized_docs(tokenizer_dir, n_docs, seed, **kw))


def google_reference(
    documents: list[list[list[int]]],
    max_seq_length: int,
    short_seq_prob: float,
    rng: random.Random,
) -> list[dict[str, object]]:
    """``create_instances_from_document`` of google-research/bert, transliterated (no masking).

    Documents are lists of sentences of token ids. Returns per instance the lengths of A and
    B after truncation and whether B is random.
    """
    out = []
    for document_index, document in enumerate(documents):
        max_num_tokens = max_seq_length - 3
        target_seq_length = max_num_tokens
        if rng.random() < short_seq_prob:
            target_seq_length = rng.randint(2, max_num_tokens)
        current_chunk: list[list[int]] = []
        current_length = 0
        i = 0
        while i < len(document):
            segment = document[i]
            current_chunk.append(segment)
            current_length += len(segment)
            if i == len(document) - 1 or current_length >= target_seq_length:
                if current_chunk:
                    a_end = 1
                    if len(current_chunk) >= 2:
                        a_end = rng.randint(1, len(current_chunk) - 1)
                    tokens_a = [t for seg in current_chunk[:a_end] for t in seg]
                    tokens_b: list[int] = []
                    is_random_next = False
                    if len(current_chunk) == 1 or rng.random() < 0.5:
                        is_random_next = True
                        target_b_length = target_seq_length - len(tokens_a)
                        random_document_index = 0
                        for _ in range(10):
                            random_document_index = rng.randint(0, len(documents) - 1)
                            if random_document_index != document_index:
                                break
                        random_document = documents[random_document_index]
                        random_start = rng.randint(0, len(random_document) - 1)
                        for j in range(random_start, len(random_document)):
                            tokens_b.extend(random_document[j])
                            if len(tokens_b) >= target_b_length:
                                break
                        num_unused_segments = len(current_chunk) - a_end
                        i -= num_unused_segments
                    else:
                        for j in range(a_end, len(current_chunk)):
                            tokens_b.extend(current_chunk[j])
                    truncated = max(0, len(tokens_a) + len(tokens_b) - max_num_tokens)
                    while len(tokens_a) + len(tokens_b) > max_num_tokens:
                        trunc = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
                        if rng.random() < 0.5:
                            del trunc[0]
                        else:
                            trunc.pop()
                    out.append(
                        {
                            "a_len": len(tokens_a),
                            "b_len": len(tokens_b),
                            "random": is_random_next,
                            "truncated": truncated,
                        }
                    )
                current_chunk = []
                current_length = 0
            i += 1
    return out


def output_digests(out: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file a preprocessing run wrote (its resolved config
    excepted: it names the output)."""
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != "preprocess.yaml"
    }
