"""The pytest-benchmark suite runs (one size, one round), so it cannot rot between `make bench` runs.

It runs with profiling on, in loops of two: pytest-benchmark then calls each collective once more
after its rounds and once with no setup before it, which the other ranks must follow too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_suite_smoke():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/bench_suite",
            "-m",
            "benchmark_suite",
            "-q",
            "-p",
            "no:cacheprovider",
            "--benchmark-columns=median,rounds",
            "--benchmark-cprofile=cumtime",
            "--benchmark-cprofile-loops=2",
            "--benchmark-cprofile-top=1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COMMBENCH_BENCH_SMOKE": "1"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "failed" not in out.stdout.splitlines()[-1]
    assert "passed" in out.stdout.splitlines()[-1]
