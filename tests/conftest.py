from __future__ import annotations

import pytest

from tests.world import World


@pytest.fixture(scope="session")
def worlds():
    """Gloo worlds of 1 to 5 CPU ranks, started on first use and kept for the session."""
    from tests.cases import run_case

    started: dict[int, World] = {}

    def get(size: int) -> World:
        if size not in started:
            started[size] = World(size, run_case)
        return started[size]

    yield get
    for w in started.values():
        w.close()
