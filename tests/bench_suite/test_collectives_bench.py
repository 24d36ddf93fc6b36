"""pytest-benchmark suite: every collective and algorithm at a few sizes (``make bench``).

Runs are saved (``--benchmark-autosave``) so ``pytest-benchmark compare`` shows regressions
between commits. Times are rank 0's; barriers run in the untimed setup. Compare a benchmark with
itself across commits: rank 0 is the pytest process, which also hosts the launcher's monitor
thread, and each benchmark runs its rounds back to back, so algorithms are compared with each
other by ``commbench sweep`` (interleaved, slowest rank), not here. With
COMMBENCH_BENCH_SMOKE=1 one size and one round run, which ``make test`` does so the suite
cannot rot.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from commbench.bench.collectives import SPECS
from commbench.comm import ALGORITHMS
from commbench.comm.costmodel import bus_factor
from tests.bench_suite.conftest import SMOKE, WORLD
from tests.bench_suite.world import make

pytestmark = pytest.mark.benchmark_suite

SIZES = [64 << 10] if SMOKE else [4 << 10, 1 << 20, 16 << 20]
ROUNDS, WARMUP = (1, 0) if SMOKE else (15, 3)
CASES = [(c, a) for c, algos in ALGORITHMS.items() for a in algos] + [("sendrecv", "p2p")]


@pytest.mark.parametrize("size_bytes", SIZES, ids=lambda s: f"{s >> 10}K")
@pytest.mark.parametrize("collective,algorithm", CASES)
def test_collective(benchmark, bench_world, collective, algorithm, size_bytes):
    spec = SPECS[collective]
    b = make(collective, size_bytes, "float32", 0, WORLD)
    calls = 1 if benchmark.disabled else ROUNDS + WARMUP
    bench_world.announce(collective, algorithm, size_bytes, "float32", calls + 1)  # +1: the check

    def setup() -> None:
        b.input.copy_(b.reference)
        dist.barrier()

    benchmark.group = f"{collective} {size_bytes >> 10}K"
    benchmark.pedantic(
        spec.run,
        args=(b, algorithm, "sum", 0, None, bench_world.workspace),
        setup=setup,
        rounds=ROUNDS,
        warmup_rounds=WARMUP,
        iterations=1,
    )
    setup()
    spec.run(b, algorithm, "sum", 0, None, bench_world.workspace)
    assert spec.wrong(b, "sum", 0, WORLD, 0) == 0
    nbytes = (
        b.output.numel() * b.output.element_size()
        if collective == "all_gather"
        else (b.input.numel() * b.input.element_size())
    )
    if not benchmark.disabled:
        median = benchmark.stats.stats.median
        benchmark.extra_info["size_bytes"] = nbytes
        benchmark.extra_info["busbw_gbps"] = nbytes / median / 1e9 * bus_factor(collective, WORLD)
