from __future__ import annotations

import os

import pytest

from tests.bench_suite.world import BenchWorld

SMOKE = os.environ.get("COMMBENCH_BENCH_SMOKE") == "1"
WORLD = int(os.environ.get("COMMBENCH_BENCH_WORLD", "2"))


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
