"""Benchmarks that fail on purpose, each followed by one that must still run, or be skipped saying
why where the world cannot go on. Run by tests/test_bench_suite_smoke.py; ``make bench`` leaves
this file out (its name is not test_*.py)."""

from __future__ import annotations

import pytest

from tests.bench_suite import test_collectives_bench as suite

pytestmark = pytest.mark.benchmark_suite


def _bench(benchmark, bench_world, collective: str, algorithm: str) -> None:
    suite.test_collective(benchmark, bench_world, (1, 0), collective, algorithm, 0, False, 64 << 10)


def test_wrong_result(benchmark, bench_world, monkeypatch):
    """Rank 1's checked result is wrong: the benchmark fails and is not saved."""
    results = bench_world.results
    monkeypatch.setattr(bench_world, "results", lambda: {**results(), 1: 7})
    _bench(benchmark, bench_world, "all_reduce", "ring")


def test_fails_between_calls(benchmark, bench_world, monkeypatch):
    """Rank 0 fails after its last call, before it tells the others that the benchmark is over."""

    def fail() -> dict[int, int]:
        raise RuntimeError("injected: rank 0 failed between calls")

    monkeypatch.setattr(bench_world, "results", fail)
    _bench(benchmark, bench_world, "all_reduce", "ring")


def test_runs_after_a_failure_between_calls(benchmark, bench_world):
    _bench(benchmark, bench_world, "broadcast", "builtin")


class _FailingRun:
    """A collective whose calls fail on rank 0 alone, after the others have started theirs."""

    def __init__(self, spec) -> None:
        self._spec = spec

    def __getattr__(self, name: str):
        return getattr(self._spec, name)

    def run(self, *args) -> None:
        raise RuntimeError("injected: rank 0 failed inside a call")


def test_fails_inside_a_call(benchmark, bench_world, monkeypatch):
    monkeypatch.setitem(suite.SPECS, "all_reduce", _FailingRun(suite.SPECS["all_reduce"]))
    _bench(benchmark, bench_world, "all_reduce", "ring")


def test_skipped_after_a_failure_inside_a_call(benchmark, bench_world):
    _bench(benchmark, bench_world, "broadcast", "builtin")
