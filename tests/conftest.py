from __future__ import annotations

import pytest

from tests import recorded
from tests.world import worlds_of


@pytest.fixture(scope="session")
def recorded_sweep(tmp_path_factory) -> recorded.Run:
    """The session's one real sweep (see tests/recorded.py)."""
    return recorded.record_sweep(tmp_path_factory.mktemp("recorded-sweep"))


@pytest.fixture(scope="session")
def recorded_compare(tmp_path_factory) -> recorded.Run:
    """The session's one real compare (see tests/recorded.py)."""
    return recorded.record_compare(tmp_path_factory.mktemp("recorded-compare"))


@pytest.fixture(scope="module")
def worlds():
    """Gloo worlds of 1 to 5 CPU ranks, started on first use and kept for the module (idle ranks
    and their launchers are not left polling while later modules run)."""
    from tests.cases import run_case

    with worlds_of(run_case) as get:
        yield get


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is present; elsewhere they are skipped with the reason."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible to torch here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
