"""The test S3 server is real HTTP S3 with authentication: s3fs reaches it through
``AWS_ENDPOINT_URL`` and refuses a wrong key."""

from __future__ import annotations

import pytest


def test_s3fs_round_trip_and_auth(s3) -> None:
    import s3fs

    fs = s3fs.S3FileSystem()
    path = s3.bucket.removeprefix("s3://") + "/a/b.bin"
    fs.pipe(path, b"x" * 1000)
    assert fs.cat(path) == b"x" * 1000
    wrong = s3fs.S3FileSystem(
        key=s3.env["AWS_ACCESS_KEY_ID"], secret="nope", skip_instance_cache=True
    )
    with pytest.raises(PermissionError):
        wrong.ls(s3.bucket.removeprefix("s3://"))


def test_reading_a_corpus_file_from_s3_reads_blocks_not_a_block_per_line(
    s3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsspec's remote ``readline`` reads and copies a whole block for every line
    (``readuntil``): the readers put a buffer over remote files, so that a file of many
    lines is fetched in a few large reads, with the documents unchanged."""
    from collections import Counter

    import fsspec
    import fsspec.spec

    from bertpipe.preprocessing import readers
    from bertpipe.preprocessing.config import InputConfig

    lines = [f"sentence {i} of document {i // 7} here." for i in range(20000)]
    text = "".join(line + ("\n\n" if i % 7 == 6 else "\n") for i, line in enumerate(lines))
    url = f"{s3.bucket}/corpus/part-0.txt"
    fsspec.filesystem("s3").pipe(url, text.encode())
    calls = Counter()
    real_readuntil = fsspec.spec.AbstractBufferedFile.readuntil
    real_read = fsspec.spec.AbstractBufferedFile.read

    def readuntil(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls["readuntil"] += 1
        return real_readuntil(self, *args, **kwargs)

    def read(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls["read"] += 1
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(fsspec.spec.AbstractBufferedFile, "readuntil", readuntil)
    monkeypatch.setattr(fsspec.spec.AbstractBufferedFile, "read", read)
    cfg = InputConfig(paths=[f"{s3.bucket}/corpus"], split_sentences=False)
    docs = list(readers.read_documents(url, cfg, Counter()))
    assert len(docs) == -(-20000 // 7)
    assert docs[1].sentences[0] == "sentence 7 of document 1 here."
    assert calls["readuntil"] == 0 and calls["read"] < 10, calls  # 0.8 MB: a few 1 MB reads
    # a byte range starting mid-file finds its first whole document the same way
    half = list(readers.read_documents(url, cfg, Counter(), start=len(text) // 2, offset_ids=True))
    assert 0 < len(half) < len(docs) and half[-1].sentences == docs[-1].sentences
    assert calls["readuntil"] <= 2, calls  # the seek to the range's first line
