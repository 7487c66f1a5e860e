"""Fixtures of the preprocessing tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.langtext import gimp_help  # noqa: F401  (the GIMP manual's text, for every test here)


@pytest.fixture(scope="module")
def dask_cluster() -> Iterator[Any]:
    """One local Dask cluster per test module (starting one takes seconds)."""
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
    ) as cluster:
        yield cluster
