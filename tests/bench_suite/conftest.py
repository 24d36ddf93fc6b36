from __future__ import annotations

import os

import pytest

from tests.bench_suite.world import BenchWorld

SMOKE = os.environ.get("COMMBENCH_BENCH_SMOKE") == "1"


def _world_size(text: str) -> tuple[int, str | None]:
    """The benchmark world's size given COMMBENCH_BENCH_WORLD, and why it is refused (None if it is not)."""
    size = int(text) if text.strip().isdigit() else 0
    if size >= 2:
        return size, None
    return size, (
        f"COMMBENCH_BENCH_WORLD must be a whole number of ranks >= 2 (rank 0 is the pytest process, "
        f"the others follow its calls), got {text!r}"
    )


WORLD, WORLD_REFUSED = _world_size(os.environ.get("COMMBENCH_BENCH_WORLD", "2"))


def pytest_collection_finish(session):
    """A world the benchmarks cannot run in is refused in one line before any of them starts."""
    if WORLD_REFUSED and any("bench_world" in getattr(item, "fixturenames", ()) for item in session.items):
        pytest.exit(WORLD_REFUSED, returncode=2)


def pytest_benchmark_update_machine_info(config, machine_info):
    """Saved runs carry commbench's machine information beside pytest-benchmark's."""
    from commbench.bench.machine import machine_info as commbench_info

    machine_info["commbench"] = commbench_info("gloo")
    machine_info["commbench"]["world_size"] = WORLD


@pytest.fixture(scope="module")
def bench_world():
    """The pytest process joins as rank 0; the group ends with the module, as the default group of
    a process must before a later module's tests start their own."""
    world = BenchWorld(WORLD)
    yield world
    world.close()
