from __future__ import annotations

import pytest

from tests.world import World


@pytest.fixture(scope="module")
def worlds():
    """Gloo worlds of 1 to 5 CPU ranks, started on first use and kept for the module (idle ranks
    and their launchers are not left polling while later modules run)."""
    from tests.cases import run_case

    started: dict[int, World] = {}

    def get(size: int) -> World:
        if size not in started:
            started[size] = World(size, run_case)
        return started[size]

    yield get
    for w in started.values():
        w.close()


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is present; elsewhere they are skipped with the reason."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible to torch here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
