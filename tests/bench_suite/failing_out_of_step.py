"""Rank 0 out of step with the others: their "done" is lost, and rank 0 asks for the next benchmark
while they still repeat the last. They must stop rather than run the old call against the new one.
Run by tests/test_bench_suite_smoke.py; ``make bench`` leaves this file out."""

from __future__ import annotations

import pytest

from tests.bench_suite import test_collectives_bench as suite

pytestmark = pytest.mark.benchmark_suite


def test_done_is_lost(bench_world, monkeypatch):
    monkeypatch.setattr(bench_world, "_done", lambda what: None)
    with bench_world.benchmark("broadcast", "builtin", 4 << 10, "float32", 0):
        pass


def test_the_next_benchmark_fails(benchmark, bench_world):
    suite.test_collective(benchmark, bench_world, (1, 0), "all_reduce", "ring", 0, False, 64 << 10)


def test_skipped_after_it(benchmark, bench_world):
    suite.test_collective(benchmark, bench_world, (1, 0), "broadcast", "builtin", 0, False, 64 << 10)
