"""pytest-benchmark suite: every collective and algorithm at a few sizes (``make bench``).

Runs are saved (``--benchmark-autosave``) so ``pytest-benchmark compare`` shows regressions
between commits. A call is timed on rank 0 from its start until every rank has returned from
it: a barrier closes each call, its own cost timed too (before, a root's broadcast was timed
until it returned, 18% short of the receivers' end at 16 MiB), and a barrier in the untimed
setup starts it. Every rank checks its result of one last call, made as every call is from a
poisoned output (an in-place reduce_scatter's, inside its input, from the rank's own chunk), so
a call that writes nothing fails. Rooted collectives also run with a root other than rank 0,
and reduce_scatter and all_gather in their in-place form too (``sweep --in-place``), in groups
of their own. Each name and group says the world's size. Compare a benchmark with itself across
commits: rank 0 is the pytest process, which also hosts the launcher's monitor thread, and each
benchmark runs its rounds back to back, so algorithms are compared with each other by
``commbench sweep`` (interleaved, slowest rank), not here. With COMMBENCH_BENCH_SMOKE=1 one size
and one round run, which ``make test`` does so the suite cannot rot.
"""

from __future__ import annotations

import pytest

from commbench.bench.collectives import SPECS, TWO_FORMS, Buffers, form_name, ready_for_check
from commbench.comm import ALGORITHMS
from commbench.comm.costmodel import bus_factor
from tests.bench_suite.conftest import SMOKE, WORLD
from tests.bench_suite.world import make

pytestmark = pytest.mark.benchmark_suite

SIZES = [64 << 10] if SMOKE else [4 << 10, 1 << 20, 16 << 20]
ROOTED = ("broadcast", "reduce")  # also run with the last rank as root, where rank 0 is not it
CASES = [
    *(pytest.param(c, a, 0, False, id=f"{c}-{a}") for c, algos in ALGORITHMS.items() for a in algos),
    *(
        pytest.param(c, a, WORLD - 1, False, id=f"{c}-{a}-root{WORLD - 1}")
        for c in ROOTED
        for a in ALGORITHMS[c]
    ),
    *(pytest.param(c, a, 0, True, id=f"{c}-{a}-in-place") for c in TWO_FORMS for a in ALGORITHMS[c]),
    pytest.param("sendrecv", "p2p", 0, False, id="sendrecv-p2p"),
]


def _prepare(b: Buffers, bench_world) -> None:
    """Before each call, on every rank: the output poisoned and the pristine input in place, so the
    rounds' results cannot stand in for a last call that wrote nothing."""
    ready_for_check(b)
    bench_world.one_more()


# The world's size is in each benchmark's name and group: runs saved at another size were compared
# with these without a word.
@pytest.mark.parametrize("size_bytes", SIZES, ids=lambda s: f"{s >> 10}K-{WORLD}ranks")
@pytest.mark.parametrize("collective,algorithm,root,in_place", CASES)
def test_collective(benchmark, bench_world, bench_rounds, collective, algorithm, root, in_place, size_bytes):
    spec = SPECS[collective]
    b = make(collective, size_bytes, "float32", 0, WORLD, root, in_place)
    # the form benchmarked is the form named: in place, output and input share one buffer
    shared = b.output.untyped_storage().data_ptr() == b.input.untyped_storage().data_ptr()
    assert shared == spec.runs_in_place(in_place)
    announced = False  # whether the other ranks were told of the next call

    def setup() -> None:
        nonlocal announced
        _prepare(b, bench_world)
        announced = True

    def call() -> None:
        nonlocal announced
        if not announced:  # pytest-benchmark's profiling loops call again with no setup between
            bench_world.one_more()
        announced = False
        spec.run(b, algorithm, "sum", root, None, bench_world.workspace)
        bench_world.returned()

    benchmark.group = f"{form_name(collective, in_place)} {size_bytes >> 10}K, {WORLD} ranks"
    rounds, warmup = bench_rounds
    try:
        with bench_world.benchmark(collective, algorithm, size_bytes, "float32", root, in_place):
            benchmark.pedantic(call, setup=setup, rounds=rounds, warmup_rounds=warmup, iterations=1)
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
        benchmark.extra_info["world_size"] = WORLD
        benchmark.extra_info["rounds"] = rounds  # pedantic mode: what options.min_rounds says is not used
        benchmark.extra_info["warmup_rounds"] = warmup
        benchmark.extra_info["size_bytes"] = nbytes
        benchmark.extra_info["in_place"] = spec.runs_in_place(in_place)
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


@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
@pytest.mark.parametrize("collective", TWO_FORMS)
def test_a_last_call_that_writes_nothing_is_seen(bench_world, collective, in_place):
    """Every rank's checked call writes into other buffers: each output, right after a round that
    left it correct, must count as wrong. An in-place reduce_scatter's output starts as the rank's
    own chunk, which is not the sum of several ranks' chunks."""
    spec, size_bytes = SPECS[collective], 4096
    b = make(collective, size_bytes, "float32", 0, WORLD, 0, in_place)
    elsewhere = make(collective, size_bytes, "float32", 0, WORLD, 0, in_place)
    # every element, but for the rank's own part where that is an in-place all_gather's input
    unwritten = b.output.numel() - (b.input.numel() if in_place and collective == "all_gather" else 0)
    with bench_world.benchmark(collective, "ring", size_bytes, "float32", 0, in_place):
        _prepare(b, bench_world)
        spec.run(b, "ring", "sum", 0, None, bench_world.workspace)
        bench_world.returned()
        assert spec.wrong(b, "sum", 0, WORLD, 0) == 0
        ready_for_check(b)
        ready_for_check(elsewhere)
        bench_world.one_more(elsewhere=True)
        spec.run(elsewhere, "ring", "sum", 0, None, bench_world.workspace)
        bench_world.returned()
        assert spec.wrong(elsewhere, "sum", 0, WORLD, 0) == 0
        assert spec.wrong(b, "sum", 0, WORLD, 0) == unwritten
        assert bench_world.results() == dict.fromkeys(range(1, WORLD), unwritten)
