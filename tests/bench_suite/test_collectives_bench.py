"""pytest-benchmark suite: every collective and algorithm at a few sizes (``make bench``).

Runs are saved (``--benchmark-autosave``) so ``pytest-benchmark compare`` shows regressions
between commits. Times are rank 0's; barriers run in the untimed setup. Every rank checks its
result of one last call, and rooted collectives also run with a root other than rank 0. Compare
a benchmark with itself across commits: rank 0 is the pytest process, which also hosts the
launcher's monitor thread, and each benchmark runs its rounds back to back, so algorithms are
compared with each other by ``commbench sweep`` (interleaved, slowest rank), not here. With
COMMBENCH_BENCH_SMOKE=1 one size and one round run, which ``make test`` does so the suite
cannot rot.
"""

from __future__ import annotations

import pytest

from commbench.bench.collectives import SPECS
from commbench.comm import ALGORITHMS
from commbench.comm.costmodel import bus_factor
from tests.bench_suite.conftest import SMOKE, WORLD
from tests.bench_suite.world import make

pytestmark = pytest.mark.benchmark_suite

SIZES = [64 << 10] if SMOKE else [4 << 10, 1 << 20, 16 << 20]
ROUNDS, WARMUP = (1, 0) if SMOKE else (15, 3)
ROOTED = ("broadcast", "reduce")  # also run with the last rank as root, where rank 0 is not it
CASES = [
    *(pytest.param(c, a, 0, id=f"{c}-{a}") for c, algos in ALGORITHMS.items() for a in algos),
    *(pytest.param(c, a, WORLD - 1, id=f"{c}-{a}-root{WORLD - 1}") for c in ROOTED for a in ALGORITHMS[c]),
    pytest.param("sendrecv", "p2p", 0, id="sendrecv-p2p"),
]


@pytest.mark.parametrize("size_bytes", SIZES, ids=lambda s: f"{s >> 10}K")
@pytest.mark.parametrize("collective,algorithm,root", CASES)
def test_collective(benchmark, bench_world, collective, algorithm, root, size_bytes):
    spec = SPECS[collective]
    b = make(collective, size_bytes, "float32", 0, WORLD, root)
    announced = False  # whether the other ranks were told of the next call

    def setup() -> None:
        nonlocal announced
        b.input.copy_(b.reference)
        bench_world.one_more()
        announced = True

    def call() -> None:
        nonlocal announced
        if not announced:  # pytest-benchmark's profiling loops call again with no setup between
            bench_world.one_more()
        announced = False
        spec.run(b, algorithm, "sum", root, None, bench_world.workspace)
        bench_world.returned()

    benchmark.group = f"{collective} {size_bytes >> 10}K"
    try:
        with bench_world.benchmark(collective, algorithm, size_bytes, "float32", root):
            benchmark.pedantic(call, setup=setup, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1)
            setup()
            call()  # the call every rank checks: rank 0 here, the others in results()
            wrong = {0: spec.wrong(b, "sum", 0, WORLD, root), **bench_world.results()}
        assert wrong == dict.fromkeys(range(WORLD), 0), f"wrong elements on each rank: {wrong}"
    except BaseException:
        # pytest-benchmark leaves out of the saved runs only a benchmark whose timed calls raised; one
        # whose result was wrong, or that failed after its rounds, must not be saved as a measurement
        benchmark.has_error = True
        raise
    nbytes = (
        b.output.numel() * b.output.element_size()
        if collective == "all_gather"
        else (b.input.numel() * b.input.element_size())
    )
    if not benchmark.disabled:
        median = benchmark.stats.stats.median
        benchmark.extra_info["size_bytes"] = nbytes
        benchmark.extra_info["busbw_gbps"] = nbytes / median / 1e9 * bus_factor(collective, WORLD)


def test_a_wrong_result_on_another_rank_is_seen(bench_world):
    """In sendrecv rank 1 receives rank 0's input: rank 0 sends zeros, and only rank 1's result is
    wrong, which rank 0 must hear of."""
    size_bytes = 4096
    b = make("sendrecv", size_bytes, "float32", 0, WORLD)
    with bench_world.benchmark("sendrecv", "p2p", size_bytes, "float32", 0):
        bench_world.one_more()
        b.input.zero_()
        SPECS["sendrecv"].run(b, "p2p", "sum", 0, None, bench_world.workspace)
        bench_world.returned()
        assert SPECS["sendrecv"].wrong(b, "sum", 0, WORLD, 0) == 0
        assert bench_world.results()[1] == size_bytes // 4
