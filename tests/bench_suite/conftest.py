from __future__ import annotations

import os

import pytest

from tests.bench_suite.world import THREADS, BenchWorld

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


# What differs from run to run on one machine, or between commits: in machine_info, every
# --benchmark-compare warned "Benchmark machine_info is different" (pytest-benchmark keeps the
# commit in commit_info), hiding a real change of machine.
NOT_THE_MACHINE = ("command", "commbench", "commit", "commit_modified")


def pytest_benchmark_update_machine_info(config, machine_info):
    """Saved runs carry commbench's machine information beside pytest-benchmark's, with the world's
    size and the torch threads each of its ranks runs (not the pytest process's own count)."""
    from commbench.bench.machine import machine_info as commbench_info

    info = commbench_info("gloo")
    for name in NOT_THE_MACHINE:
        info.pop(name)
    machine_info["commbench"] = {**info, "world_size": WORLD, "torch_threads": THREADS}


@pytest.fixture(scope="session")
def bench_rounds(pytestconfig) -> tuple[int, int]:
    """Timed rounds and warm-up rounds of each benchmark: 15 and 3, or --benchmark-min-rounds where
    it asks for more (1 and 0 in the smoke run). Each round needs an untimed setup on every rank,
    so the suite runs pytest-benchmark's pedantic mode, which --benchmark-max-time and
    --benchmark-warmup do not reach."""
    if SMOKE:
        return 1, 0
    return max(15, pytestconfig.getoption("benchmark_min_rounds", 0) or 0), 3


@pytest.fixture(scope="module")
def bench_world():
    """The pytest process joins as rank 0; the group ends with the module, as the default group of
    a process must before a later module's tests start their own."""
    world = BenchWorld(WORLD)
    yield world
    world.close()
