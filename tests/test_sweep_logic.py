"""Sweep configuration, sizes, statistics and units: pure logic, no process group."""

from __future__ import annotations

import re

import pytest
import torch

from commbench.bench.collectives import COPY, count_wrong, pattern, poison, reduced_pattern
from commbench.bench.sweep import LIMIT, SweepConfig, sizes, stats_us
from commbench.units import format_size, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [
        ("1", 1),
        ("1K", 1024),
        ("64k", 65536),
        ("16M", 16 << 20),
        ("2G", 2 << 30),
        ("4KiB", 4096),
        ("8MiB", 8 << 20),
        (" 3 GiB\n", 3 << 30),
        ("5B", 5),
        ("0", 0),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", "-1", "1.5K", "K", "12T", "ten", "1iB", "64IB", "\u0661\u0662K", "1" * 5000, "0" * 5000 + "1K"],
)
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


@pytest.mark.parametrize(
    "text, hint", [("8MB", "use 8M or 8MiB for 8 x 2^20"), ("2gb", "use 2G or 2GiB for 2 x 2^30")]
)
def test_a_size_in_kb_mb_or_gb_is_refused_as_ambiguous(text, hint):
    """8MB was taken for 8 MiB, where GB/s in the same table is 10^9 bytes: one size said, another
    meant."""
    with pytest.raises(ValueError, match=f"is ambiguous .*{re.escape(hint)}"):
        parse_size(text)


@pytest.mark.parametrize(
    "text, units",
    [
        ("2GB", "(GB: 10^9 or 2^30 bytes?)"),
        ("8Mb", "(Mb: 10^6 or 2^20 bits or bytes?)"),
        ("4kB", "(kB: 10^3 or 2^10 bytes?)"),
    ],
)
def test_the_ambiguous_size_s_message_says_both_readings_of_the_unit_as_written(text, units):
    """The message names the unit as typed and both sizes it may mean (10^(3k) or 2^(10k) bytes, and
    bits too where the b is small)."""
    with pytest.raises(ValueError) as caught:
        parse_size(text)
    assert units in str(caught.value)


def test_format_size_round_trips():
    for n in (1, 1000, 1024, 1536, 1 << 20, 3 << 30):
        assert parse_size(format_size(n)) == n


def test_format_size_takes_the_largest_exact_unit():
    cases = {0: "0", 1000: "1000", 1024: "1K", 1536: "1536", 3 << 19: "1536K", 1 << 20: "1M"}
    cases |= {(1 << 30) + (1 << 20): "1025M", 3 << 30: "3G", 1 << 40: "1024G"}
    assert {n: format_size(n) for n in cases} == cases


def test_sizes_by_factor_and_by_step():
    assert sizes(SweepConfig(min_bytes=1024, max_bytes=8192)) == [1024, 2048, 4096, 8192]
    assert sizes(SweepConfig(min_bytes=1024, max_bytes=5000, step_factor=4)) == [1024, 4096]
    assert sizes(SweepConfig(min_bytes=100, max_bytes=400, step_bytes=100)) == [100, 200, 300, 400]
    assert sizes(SweepConfig(min_bytes=1, max_bytes=3, step_factor=1.1)) == [1, 2, 3]
    # 5.5 truncates to 5, still inside the range; 13.75 is past it
    assert sizes(SweepConfig(min_bytes=2, max_bytes=5, step_factor=2.75)) == [2, 5]


def test_a_huge_step_factor_ends_the_sizes_rather_than_overflowing():
    # 4096 * 1e306 is inf as a float: int() of it raised OverflowError, a traceback at the CLI
    assert sizes(SweepConfig(min_bytes=4096, max_bytes=8192, step_factor=1e306)) == [4096]
    assert sizes(SweepConfig(min_bytes=1 << 30, max_bytes=1 << 30, step_factor=1e300)) == [1 << 30]


def test_stats():
    st = stats_us([0.001, 0.002, 0.003, 0.004, 0.010])
    assert st["time_us"] == pytest.approx(3000)
    assert st["time_us_min"] == pytest.approx(1000)
    assert st["time_us_max"] == pytest.approx(10000)
    assert st["time_us_mean"] == pytest.approx(4000)
    assert st["time_us_p90"] == pytest.approx(7600)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"min_bytes": 2048, "max_bytes": 1024}, "above maximum"),
        ({"min_bytes": 0}, "> 0"),
        ({"max_bytes": -1}, "> 0"),
        ({"step_factor": 1.0}, "step factor"),
        ({"step_bytes": 0}, "step bytes"),
        ({"max_bytes": (1 << 50) + 1}, "maximum size must be <= 1125899906842624 bytes"),
        ({"collective": "alltoall"}, "unknown collective"),
        ({"algorithms": ("ring", "bogus")}, "unknown algorithm 'bogus'"),
        ({"algorithms": ("ring", "ring")}, "twice"),
        # one series written two ways ran twice, as two rows
        ({"algorithms": ("ring@2M", "ring@2048K")}, "ring@2M and ring@2048K are one series"),
        ({"algorithms": ("ring", "ring@16M")}, "ring and ring@16M are one series"),
        ({"algorithms": ("auto@16M", "auto@16384K")}, "are one series"),
        # an op that the collective does not use, mistyped, ran the whole sweep
        ({"collective": "all_gather", "op": "foo"}, "unknown op 'foo'"),
        ({"collective": "broadcast", "op": "bogus"}, "unknown op 'bogus'"),
        ({"collective": "sendrecv", "algorithms": ("p2p",), "op": "xor"}, "unknown op 'xor'"),
        ({"algorithms": ()}, "no algorithms"),
        ({"dtype": "complex64"}, "unknown dtype"),
        ({"op": "xor"}, "unknown op"),
        ({"dtype": "int32", "op": "avg"}, "floating-point"),
        ({"iters": 0}, "iters"),
        ({"warmup": -1}, "warmup"),
        ({"block": 0}, "block must be >= 1"),
        ({"iters": 10**6 + 1}, "iters must be <= 1000000, got 1000001"),
        ({"warmup": 10**12}, "warmup must be <= 1000000"),
        ({"block": 10**7}, "block must be <= 1000000"),
        ({"probe_iters": 0}, "probe iterations must be >= 1"),
        ({"probe_iters": 10**6 + 1}, "probe iterations must be <= 1000000"),
        ({"collective": "broadcast", "algorithms": ("rd",)}, "unknown algorithm"),
        ({"algorithms": ("builtin", "naive@2M")}, "applies to ring, auto, not naive"),
        ({"collective": "broadcast", "algorithms": ("tree@1M",)}, "applies to ring, auto, not tree"),
        ({"algorithms": ("ring@0",)}, "at least 1 byte"),
        ({"algorithms": ("ring@two",)}, "at least 1 byte"),
        ({"algorithms": ("ring@",)}, "at least 1 byte"),
        # passed the config, then failed in every rank's first call
        ({"algorithms": (f"ring@{(1 << 62) + 1}",)}, "at most 2[*][*]62"),
        ({"algorithms": ("bogus@2M",)}, "unknown algorithm 'bogus'"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SweepConfig(**kwargs)


def test_series_of_different_segments_and_ops_of_every_name_are_taken():
    series = ("ring", "ring@2M", "ring@4M", "auto", "auto@2M")
    assert SweepConfig(algorithms=series).algorithms == series
    for op in OPS:
        assert SweepConfig(collective="all_gather", op=op).op == op


@pytest.mark.parametrize(
    "series, expected",
    [
        ("ring", ("ring", None)),
        ("ring@2M", ("ring", 2 << 20)),
        ("auto@64K", ("auto", 64 << 10)),
        ("p2p@7", ("p2p", 7)),
    ],
)
def test_a_series_names_an_algorithm_and_optionally_its_segment(series, expected):
    from commbench.bench.collectives import series_parts

    assert series_parts(series) == expected


def test_the_places_that_read_a_size_say_why_kb_mb_or_gb_is_refused():
    """A segment, or an environment variable's size, in MB was refused in words that asked for
    'bytes or K/M/G' and did not say MB was the trouble."""
    from commbench import comm
    from commbench.bench.collectives import series_parts
    from commbench.comm import tcp

    hint = "is ambiguous (MB: 10^6 or 2^20 bytes?); use 2M or 2MiB for 2 x 2^20 bytes"
    with pytest.raises(
        ValueError, match=f"^'ring@2MB': the segment after @ is not a size: '2MB' {re.escape(hint)}$"
    ):
        series_parts("ring@2MB")
    with pytest.raises(
        ValueError, match=f"^\\${tcp.NOTSENT_ENV}='2MB' is not a size: '2MB' {re.escape(hint)}$"
    ):
        tcp.notsent_setting({tcp.NOTSENT_ENV: "2MB"})
    with pytest.raises(
        ValueError, match=f"^\\${comm.HOST_FROM_ENV}='2MB' is not a size: '2MB' {re.escape(hint)}$"
    ):
        comm.stage_whole_from({comm.HOST_FROM_ENV: "2MB"})
    # the suffix as written; it was named "MB" for "2Mb", more often megabits
    with pytest.raises(ValueError, match=re.escape("(Mb: 10^6 or 2^20 bits or bytes?);")):
        parse_size(" 2Mb ")
    with pytest.raises(ValueError, match=re.escape("(kB: 10^3 or 2^10 bytes?); use 4K or 4KiB")):
        parse_size("4kB")


def test_segment_sizes_are_accepted_where_the_algorithm_segments():
    assert SweepConfig(algorithms=("builtin", "ring", "ring@2M", "auto@1M")).series[-1] == LIMIT
    assert SweepConfig(collective="sendrecv", algorithms=("p2p@4M",)).series == ("p2p@4M",)


def test_limit_series_is_added_except_for_sendrecv():
    assert SweepConfig().series == ("builtin", "naive", "ring", LIMIT)
    assert SweepConfig(limit=False).series == ("builtin", "naive", "ring")
    assert SweepConfig(collective="sendrecv", algorithms=("p2p",)).series == ("p2p",)


def test_count_wrong_counts_nan_inf_and_differences():
    expected = torch.ones(5)
    assert count_wrong(torch.ones(5), expected) == 0
    assert count_wrong(torch.tensor([1.0, float("nan"), float("inf"), 2.0, 1.0]), expected) == 3
    assert count_wrong(torch.tensor([1, 2, 1], dtype=torch.int32), torch.ones(3, dtype=torch.int32)) == 1


def test_poisoned_output_is_all_wrong():
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        for op in ("sum", "max"):
            expected = reduced_pattern(3, 10, op, dtype, torch.device("cpu"))
            out = expected.clone()  # an output that holds the right result before it is poisoned
            assert count_wrong(out, expected) == 0
            poison(out)
            assert count_wrong(out, expected) == 10, (dtype, op)


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "prod"])
@pytest.mark.parametrize("world", [1, 2, 5, 16])
def test_closed_form_matches_reducing_the_patterns(op, world):
    inputs = torch.stack([pattern(r, 23, op, torch.float64, torch.device("cpu")) for r in range(world)])
    direct = {
        "sum": inputs.sum(0),
        "avg": inputs.mean(0),
        "max": inputs.max(0).values,
        "min": inputs.min(0).values,
        "prod": inputs.prod(0),
    }[op]
    assert torch.equal(reduced_pattern(world, 23, op, torch.float64, torch.device("cpu")), direct)


CPU = torch.device("cpu")
OPS = ["sum", "avg", "max", "min", "prod"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("world", [1, 2, 4, 7, 8, 14, 19, 64])
def test_every_expected_result_varies_and_a_shifted_one_does_not_pass(op, world):
    """With a pattern that repeats every 7 (or 2) elements, prod at an even world, max and min
    from 7 ranks and sum at 7 and 14 ranks expected one value everywhere: data in the wrong place
    passed the check."""
    expected = reduced_pattern(world, 4096, op, torch.float64, CPU)
    assert expected.unique().numel() >= 2
    for shift in (1, 2, 7, 64, 1024):
        assert count_wrong(torch.roll(expected, shift), expected) > 100, shift


@pytest.mark.parametrize("op", ["sum", "prod", "max"])
@pytest.mark.parametrize("world, per_rank", [(2, 7), (2, 256), (4, 14), (8, 1024), (7, 49)])
def test_a_chunk_handed_to_the_wrong_rank_is_counted(op, world, per_rank):
    from commbench.bench.collectives import SPECS

    spec = SPECS["reduce_scatter"]
    whole = reduced_pattern(world, per_rank * world, op, torch.float32, CPU)
    for rank in range(world):
        b = spec.make(per_rank * world, torch.float32, CPU, rank, world, op, 0)
        b.output.copy_(whole[rank * per_rank : (rank + 1) * per_rank])
        assert spec.wrong(b, op, rank, world, 0) == 0
        other = (rank + 1) % world
        if other != rank:
            b.output.copy_(whole[other * per_rank : (other + 1) * per_rank])
            assert spec.wrong(b, op, rank, world, 0) > 0, (rank, other)


def test_every_rank_gives_a_different_block_to_gather():
    """With the reductions' pattern, 3 of the pairs of 8 ranks had the same first 4 elements, and an
    all_gather that swapped two such blocks counted 0 wrong."""
    blocks = torch.stack([pattern(r, 4, COPY, torch.float64, CPU) for r in range(300)])
    for r in range(300):
        same = (blocks == blocks[r]).all(dim=1)
        assert int(same.sum()) == 1, (r, torch.nonzero(same).flatten().tolist())
    near = torch.stack([pattern(r, 4, COPY, torch.float64, CPU) for r in range(100)])
    assert bool((near[:, None, :] != near[None, :, :]).all(dim=2).fill_diagonal_(True).all())  # all along


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("world", [1, 2, 5, 19])
def test_an_offset_window_is_that_part_of_the_whole(op, world):
    for r in (0, world - 1):
        whole = pattern(r, 70000, op, torch.float64, CPU)
        for offset in (0, 5, 65520, 65530):
            assert torch.equal(pattern(r, 400, op, torch.float64, CPU, offset), whole[offset : offset + 400])
    whole = reduced_pattern(world, 70000, op, torch.float64, CPU)
    assert torch.equal(reduced_pattern(world, 400, op, torch.float64, CPU, 65530), whole[65530:65930])


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32])
@pytest.mark.parametrize("op", ["sum", "prod"])
def test_integer_results_wrap_around_as_the_ranks_own_arithmetic_does(dtype, op):
    world = 40  # sums of up to 280 and products up to 2**40: both wrap in 8 bits, products in 32
    acc = pattern(0, 3000, op, dtype, CPU)
    for r in range(1, world):
        acc = (
            acc * pattern(r, 3000, op, dtype, CPU) if op == "prod" else acc + pattern(r, 3000, op, dtype, CPU)
        )
    assert count_wrong(acc, reduced_pattern(world, 3000, op, dtype, CPU)) == 0


def test_an_int64_product_is_2_to_the_k_then_the_lowest_value_at_63_then_0():
    """In 64 bits 2**63 wraps to the lowest value and 2**64 to 0: the expected product one bit
    before the dtype's width is its minimum, not 0."""
    from commbench.bench.collectives import _typed

    got = _typed(torch.tensor([62, 63, 64]), "prod", torch.int64)
    assert got.dtype == torch.int64
    assert got.tolist() == [2**62, -(2**63), 0]


def _in_the_ranks_arithmetic(world: int, op: str, dtype: torch.dtype, count: int, pairwise: bool):
    """A correct result as ranks compute it in ``dtype``: one rank's data after another (ring,
    naive), or pairwise (recursive doubling); avg scales each term first, as NCCL does."""
    xs = [pattern(r, count, op, dtype, CPU) for r in range(world)]
    step = {"sum": torch.add, "avg": torch.add, "prod": torch.mul, "max": torch.maximum, "min": torch.minimum}
    if op == "avg":
        xs = [x / world for x in xs]
    while len(xs) > 1:
        xs = (
            [step[op](xs[i], xs[i + 1]) if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
            if pairwise
            else [step[op](xs[0], xs[1]), *xs[2:]]
        )
    return xs[0]


@pytest.mark.parametrize(
    "dtype, op, world, twice_shows",
    [
        # allowing world * 2**-p of the result let all zeros pass; a rank's 1 to 4 more is below
        # bfloat16's resolution at sums of about 768 (a unit in the last place is 4)
        (torch.bfloat16, "sum", 256, False),
        (torch.bfloat16, "sum", 64, True),
        (torch.float16, "avg", 32, True),
        (torch.float16, "sum", 256, True),
        (torch.float32, "avg", 256, True),
    ],
)
def test_a_float_result_with_a_rank_too_many_or_none_is_wrong(dtype, op, world, twice_shows):
    from commbench.bench.collectives import SPECS

    spec = SPECS["all_reduce"]
    b = spec.make(4096, dtype, CPU, 0, world, op, 0)
    b.output.zero_()
    assert spec.wrong(b, op, 0, world, 0) == 4096
    twice = _in_the_ranks_arithmetic(world, op, dtype, 4096, True).double()
    twice += pattern(0, 4096, op, torch.float64, CPU) / (world if op == "avg" else 1)
    b.output.copy_(twice.to(dtype))
    if twice_shows:
        assert spec.wrong(b, op, 0, world, 0) > 4096 * 0.8


@pytest.mark.parametrize(
    "dtype, op, worlds",
    [
        (torch.float16, "prod", (17, 31, 40)),  # products reach inf: inf against inf was wrong
        (torch.bfloat16, "sum", (43, 63, 100)),  # sums past 256 round at every addition
        (torch.int64, "prod", (63, 64, 94)),  # 2**64 wraps to 0 on the ranks
        (torch.int8, "sum", (19, 42, 64)),  # sums past 127 wrap around
        (torch.float16, "avg", (5, 6, 7, 9, 10)),  # each term scaled first rounds
        (torch.bfloat16, "avg", (6, 11, 15)),
    ],
)
def test_a_correct_result_in_the_dtype_s_own_arithmetic_is_right(dtype, op, worlds):
    from commbench.bench.collectives import SPECS

    spec = SPECS["all_reduce"]
    for world in worlds:
        for pairwise in (False, True):
            b = spec.make(4096, dtype, CPU, 0, world, op, 0)
            b.output.copy_(_in_the_ranks_arithmetic(world, op, dtype, 4096, pairwise))
            assert spec.wrong(b, op, 0, world, 0) == 0, (world, pairwise)


def _sweep_one_rank(tmp_path, monkeypatch, **fields) -> tuple[SweepConfig, list[str], list, list]:
    """Run a one-rank all_reduce sweep of builtin and naive; returns (config, the series each call
    ran, in order, the emitted events, the records)."""
    import torch.distributed as dist

    from commbench.bench import collectives, sweep

    ran: list[str] = []
    for spec in (collectives.SPECS["all_reduce"], collectives.SPECS["sendrecv"]):
        real = spec.run
        monkeypatch.setattr(
            spec, "run", lambda b, algo, *a, _real=real: ran.append(algo) or _real(b, algo, *a)
        )
    events: list[tuple[str, object]] = []
    config = SweepConfig(
        algorithms=("builtin", "naive"), iters=2, warmup=1, probe=False, check=False, **fields
    )
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        records = sweep.run_rank(config, "cpu", lambda kind, payload: events.append((kind, payload)))
    finally:
        dist.destroy_process_group()
    return config, ran, events, records


def test_the_series_take_turns_at_running_first(tmp_path, monkeypatch):
    """No series always runs first after the barrier, or always right after the same other one."""
    config, ran, _, _ = _sweep_one_rank(tmp_path, monkeypatch, min_bytes=1024, max_bytes=1024)
    series = [s if s != LIMIT else "p2p" for s in config.series]
    assert len(series) == 3
    assert ran == [*series, *series[1:], series[0], series[2], *series[:2]]


def test_sizes_that_round_to_one_count_are_measured_once(tmp_path, monkeypatch):
    """float64 from 4 to 20 bytes by 2: 4 and 6 hold no element, 8 and 10 one, and so on."""
    _, _, events, records = _sweep_one_rank(
        tmp_path, monkeypatch, min_bytes=4, max_bytes=20, step_bytes=2, dtype="float64"
    )
    start = next(payload for kind, payload in events if kind == "start")
    assert start["sizes"] == [8, 16]
    assert [r.size_bytes for r in records if r.algorithm == "builtin"] == [8, 16]


def test_with_one_block_per_series_each_runs_its_calls_back_to_back(tmp_path, monkeypatch):
    """A block of -w + -n: one series at a time, the first one changing from size to size; every
    call counts once for progress, and the records say how the calls were ordered."""
    _, ran, events, records = _sweep_one_rank(tmp_path, monkeypatch, min_bytes=1024, max_bytes=2048, block=3)
    b, n, p = "builtin", "naive", "p2p"
    assert ran == [b] * 3 + [n] * 3 + [p] * 3 + [n] * 3 + [p] * 3 + [b] * 3
    assert sum(kind == "step" for kind, _ in events) == len(ran)
    start = next(payload for kind, payload in events if kind == "start")
    assert len(start["sizes"]) * start["iterations"] * start["series"] == len(ran)
    assert len(records) == 6 and {r.block for r in records} == {3}


def test_a_block_of_one_interleaves_call_by_call_in_rotated_order():
    from commbench.bench.sweep import rotated, schedule

    series = ("a", "b", "c")
    assert ["".join(rotated(series, it)) for it in range(4)] == ["abc", "bca", "cab", "abc"]
    assert rotated((), 3) == ()
    expected = [(s, it) for it in range(7) for s in rotated(series, it)]
    assert list(schedule(series, 7, 1)) == expected
    assert (
        "".join(s for s, _ in schedule(series, 7, 1)) == "abc" + "bca" + "cab" + "abc" + "bca" + "cab" + "abc"
    )
    assert [(s, it) for s, it in schedule(series, 4, 1, turn=1)][:3] == [("b", 0), ("c", 0), ("a", 0)]


@pytest.mark.parametrize("iterations, block", [(7, 2), (7, 3), (6, 3), (5, 5), (5, 9), (1, 4)])
def test_blocks_run_each_series_back_to_back_and_take_turns(iterations, block):
    from commbench.bench.sweep import schedule

    series = ("a", "b", "c")
    order = list(schedule(series, iterations, block))
    # Every series runs every iteration once, in order.
    for s in series:
        assert [it for name, it in order if name == s] == list(range(iterations))
    # Runs of one series are whole blocks (the last may be short), and series alternate between them.
    runs: list[tuple[str, list[int]]] = []
    for name, it in order:
        if runs and runs[-1][0] == name:
            runs[-1][1].append(it)
        else:
            runs.append((name, [it]))
    nblocks = -(-iterations // block)
    assert len(runs) == len(series) * nblocks
    for k, (_, its) in enumerate(runs):
        first = (k // len(series)) * block
        assert its == list(range(first, min(first + block, iterations)))
    # The first series of each round of blocks takes turns.
    firsts = [runs[r * len(series)][0] for r in range(nblocks)]
    assert firsts == [series[r % len(series)] for r in range(nblocks)]


def test_the_turns_start_where_they_are_told():
    from commbench.bench.sweep import schedule

    assert [s for s, _ in schedule(("a", "b", "c"), 2, 2, turn=1)] == ["b", "b", "c", "c", "a", "a"]
    assert [s for s, _ in schedule(("a", "b", "c"), 2, 2, turn=5)] == ["c", "c", "a", "a", "b", "b"]


def test_the_order_of_a_long_sweep_is_given_as_it_runs_not_made_up_front():
    """-n 10000000 made whole took a rank 29 s and 3.5 GB before its first call."""
    import itertools
    from collections.abc import Iterator

    from commbench.bench.sweep import schedule

    order = schedule(("a", "b"), 10**6, 1)
    assert isinstance(order, Iterator)
    assert list(itertools.islice(order, 5)) == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2)]


@pytest.mark.parametrize(
    "warmup, iters, block, says",
    [
        (5, 20, 1, "series interleaved call by call"),
        (5, 20, 4, "series in turns of 4 calls"),
        (5, 20, 24, "series in turns of 24 calls"),
        (5, 20, 25, "each series' calls back to back"),
        (0, 3, 7, "each series' calls back to back"),
    ],
)
def test_the_table_header_says_how_the_series_took_turns(warmup, iters, block, says):
    from commbench.bench.report import table_header

    config = SweepConfig(warmup=warmup, iters=iters, block=block)
    header = table_header(config, {"world_size": 4, "backend": "gloo", "device": "cpu"})
    timing = header.splitlines()[1]
    assert f"median of {iters} iterations (after {warmup} warm-up)" in timing
    assert f"; {says};" in timing


@pytest.mark.parametrize(
    "collective, limit, said",
    [("all_reduce", True, True), ("all_reduce", False, False), ("sendrecv", True, False)],
)
def test_the_table_header_explains_limit_only_where_there_is_a_limit_row(collective, limit, said):
    """With --no-limit (and in a send/recv sweep, which is the limit itself) the header explained
    a 'limit' row the table did not have."""
    from commbench.bench.report import table_header

    algorithms = ("p2p",) if collective == "sendrecv" else ("ring",)
    config = SweepConfig(collective=collective, limit=limit, algorithms=algorithms)
    header = table_header(config, {"world_size": 2, "backend": "gloo", "device": "cpu"})
    assert header.splitlines()[2].startswith("# busbw = algbw x bus factor (nccl-tests)")
    assert ("'limit' = bidirectional send/recv" in header) is said


@pytest.mark.parametrize(
    "collective, algorithms, world, per_series",
    [
        # all_reduce: the tensor (in place) and its pristine copy; the limit: input, output, copy
        ("all_reduce", ("builtin", "ring"), 2, lambda s: [2 * s, 2 * s, 3 * s]),
        # all_gather: a 1/world input, the whole output, and the input's copy
        ("all_gather", ("ring",), 4, lambda s: [s // 4 + s + s // 4, 3 * s]),
        ("reduce_scatter", ("naive",), 4, lambda s: [s + s // 4 + s, 3 * s]),
        # in place: the output (the input's chunk), or the input (the output's part), holds nothing more
        ("all_gather", ("ring", "in place"), 4, lambda s: [s + s // 4, 3 * s]),
        ("reduce_scatter", ("naive", "in place"), 4, lambda s: [s + s, 3 * s]),
    ],
)
def test_buffer_bytes_are_what_a_rank_holds_at_the_largest_size(collective, algorithms, world, per_series):
    from commbench.bench.sweep import buffer_bytes

    in_place = algorithms[-1] == "in place"
    algorithms = algorithms[:-1] if in_place else algorithms
    kw = dict(collective=collective, algorithms=algorithms, min_bytes=1024, check=False, in_place=in_place)
    assert buffer_bytes(SweepConfig(**kw, max_bytes=1 << 20), world) == sum(per_series(1 << 20))
    no_limit = SweepConfig(**kw, max_bytes=3 << 19, limit=False)  # 1.5 MiB: the last size is 1 MiB
    assert buffer_bytes(no_limit, world) == sum(per_series(1 << 20)[:-1])
    checked = SweepConfig(**{**kw, "check": True}, max_bytes=1 << 20)  # 48 B an element to check
    assert buffer_bytes(checked, world) == sum(per_series(1 << 20)) + 48 * ((1 << 20) // 4)


def _expected_whole(name, world, rank, root, m, op, dtype):
    """The whole expected output of ``name`` at ``rank``, made in one piece (no chunks)."""
    cpu = torch.device("cpu")
    if name in ("all_reduce", "reduce"):
        return reduced_pattern(world, m, op, dtype, cpu)
    if name == "reduce_scatter":
        return reduced_pattern(world, m * world, op, dtype, cpu)[rank * m : (rank + 1) * m]
    if name == "all_gather":
        return torch.cat([pattern(r, m, COPY, dtype, cpu) for r in range(world)])
    if name == "broadcast":
        return pattern(root, m, COPY, dtype, cpu)
    return pattern((rank - 1) % world, m, COPY, dtype, cpu)  # sendrecv: the left neighbour's input


@pytest.mark.parametrize(
    "name", ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "sendrecv"]
)
@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
def test_the_check_in_chunks_counts_what_a_whole_comparison_counts(name, chunk, monkeypatch):
    """Each chunk's expected values are the right slice: a correct output has no wrong element,
    and every planted error, chunk boundaries included, is counted once."""
    from commbench.bench import collectives

    monkeypatch.setattr(collectives, "CHECK_CHUNK", chunk)
    spec = collectives.SPECS[name]
    world, root, m = 3, 1, 11  # 11 per rank: chunks of 4 and 7 end inside a rank's part
    for op, dtype in (("sum", torch.float32), ("prod", torch.int64), ("max", torch.bfloat16)):
        for rank in range(world):
            b = spec.make(
                m * world if name in ("reduce_scatter", "all_gather") else m,
                dtype,
                torch.device("cpu"),
                rank,
                world,
                op,
                root,
            )
            if name == "reduce" and rank != root:
                assert spec.wrong(b, op, rank, world, root) == 0
                continue
            b.output.copy_(_expected_whole(name, world, rank, root, m, op, dtype))
            assert spec.wrong(b, op, rank, world, root) == 0, (op, rank)
            planted = sorted({0, 3, 4, b.output.numel() - 1} & set(range(b.output.numel())))
            b.output[planted] += 100
            assert spec.wrong(b, op, rank, world, root) == len(planted), (op, rank)


def test_the_check_needs_one_chunk_of_temporaries_not_one_message():
    from commbench.bench.collectives import CHECK_CHUNK
    from commbench.bench.sweep import CHECK_BYTES_PER_ELEMENT, buffer_bytes

    kw = dict(algorithms=("ring",), min_bytes=1 << 30, max_bytes=1 << 30, limit=False)
    extra = buffer_bytes(SweepConfig(**kw, check=True), 2) - buffer_bytes(SweepConfig(**kw, check=False), 2)
    assert extra == CHECK_BYTES_PER_ELEMENT * CHECK_CHUNK < (1 << 30) // 4


@pytest.mark.parametrize(
    "max_bytes, auto_runs",
    [(64 << 20, "ring"), (1 << 20, "naive")],  # at 4 ranks auto runs naive up to 2 MiB, then the ring
)
def test_scratch_counts_each_algorithm_that_runs_once(max_bytes, auto_runs):
    """Series share one Workspace a size: auto shares the scratch of the algorithm it runs."""
    from commbench.bench.sweep import scratch_per_rank
    from commbench.comm.costmodel import scratch_bytes

    count = max_bytes // 4
    config = SweepConfig(
        algorithms=("builtin", "naive", "ring", "auto"), min_bytes=max_bytes, max_bytes=max_bytes
    )
    naive, ring = (scratch_bytes("all_reduce", a, 4, count, 4) for a in ("naive", "ring"))
    assert naive == (3 * max_bytes, 0, 0, 0) and ring[0] > 0
    assert scratch_per_rank(config, 4) == [a + b for a, b in zip(naive, ring, strict=True)]
    without_naive = SweepConfig(algorithms=("builtin", "auto"), min_bytes=max_bytes, max_bytes=max_bytes)
    assert scratch_per_rank(without_naive, 4) == list({"ring": ring, "naive": naive}[auto_runs])
    sendrecv = SweepConfig(
        collective="sendrecv", algorithms=("p2p",), min_bytes=max_bytes, max_bytes=max_bytes
    )
    assert scratch_per_rank(sendrecv, 4) == [0] * 4


@pytest.mark.parametrize(
    "collective, world, max_bytes, root_mib",
    [("all_reduce", 4, 4 << 20, 6.0), ("reduce", 6, 32 << 20, 48.0), ("reduce_scatter", 4, 2 << 20, 4.0)],
)
def test_scratch_is_taken_at_its_most_over_the_sizes(collective, world, max_bytes, root_mib):
    """Below its crossover auto runs naive or the tree, which keep whole messages at the root:
    priced at the largest size alone, where it runs the ring, the check counted less (3 of the 6
    MiB a 4-rank all_reduce to 4 MiB holds at rank 0 at 2 MiB)."""
    import dataclasses

    from commbench.bench.sweep import scratch_per_rank

    config = SweepConfig(collective=collective, algorithms=("auto",), min_bytes=1 << 20, max_bytes=max_bytes)
    largest = scratch_per_rank(dataclasses.replace(config, min_bytes=max_bytes), world)
    assert scratch_per_rank(config, world)[0] == root_mib * (1 << 20) > largest[0]


def test_under_torchrun_the_memory_check_counts_the_local_ranks_with_most_scratch(monkeypatch):
    """Which global ranks share this host is not known before they start: naive's root may."""
    from commbench.bench import cli, launch
    from commbench.bench.sweep import buffer_bytes

    class Memory:
        available = 0

    monkeypatch.setattr("psutil.virtual_memory", lambda: Memory())
    monkeypatch.setattr(launch, "launched_externally", lambda: True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    config = SweepConfig(algorithms=("naive",), min_bytes=64 << 20, max_bytes=64 << 20, limit=False)
    spec = launch.LaunchSpec(world_size=4)
    need = buffer_bytes(config, 4) + 3 * (64 << 20)  # one rank: its buffers and the root's scratch
    Memory.available = need
    cli.check_sweep_memory(config, spec)
    Memory.available = need - 1
    with pytest.raises(ValueError, match="over 1 rank"):
        cli.check_sweep_memory(config, spec)


def test_the_ranks_on_one_gpu_need_the_sum_of_their_bytes_against_the_least_free_they_saw():
    from commbench.bench.sweep import gpu_memory_refusal

    a, b = ("host-a", "GPU-1111"), ("host-a", "GPU-2222")
    G = 1 << 30
    assert gpu_memory_refusal([(a, (0, 3 * G, G, 7 * G)), (a, (0, 3 * G, G, 6 * G))]) is None
    refusal = gpu_memory_refusal([(a, (0, 3 * G, G // 2, 7 * G)), (a, (0, 3 * G, G, 5 * G))])
    assert refusal == (
        "at 1073741824 bytes the sweep's buffers and scratch take at least 6.0 GiB on GPU 0 of host-a "
        "(2 rank(s) on it), more than its 5.0 GiB free; lower --maxbytes or run fewer algorithms"
    )
    # each rank shown its own GPU sees it as GPU 0: told apart by UUID, each holds its own rank
    assert gpu_memory_refusal([(a, (0, 3 * G, G, 5 * G)), (b, (0, 3 * G, G, 5 * G))]) is None
    assert "on GPU 0 of host-a (1 rank(s) on it)" in gpu_memory_refusal(
        [(b, (0, 1, G, 2)), (a, (0, 3 * G, G, 2 * G))]
    )


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_a_cuda_sweep_beyond_the_gpus_free_memory_is_refused_in_the_rank(monkeypatch, backend):
    """CUDA ran out of memory at the largest size, after the smaller ones had run. Scratch counts
    where it lives: gloo's hand-written calls on CUDA tensors keep it on the host (a stand-in GPU
    with 256 MiB in torch's cache; the real one: tests/test_gpu.py)."""
    import types

    from commbench import comm
    from commbench.bench.sweep import buffer_bytes, check_gpu_memory, scratch_per_rank

    monkeypatch.delenv(comm.HOST_FROM_ENV, raising=False)
    config = SweepConfig(algorithms=("builtin", "naive"), min_bytes=1 << 20, max_bytes=64 << 20)
    scratch = scratch_per_rank(config, 4, backend)[0]  # naive's root holds a message from each peer
    assert scratch == 3 * (64 << 20)
    need = buffer_bytes(config, 4) + (scratch if backend == "nccl" else 0)
    monkeypatch.setattr(comm.p2p, "backend_for", lambda group, device: backend)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 256 << 20)
    gpu = types.SimpleNamespace(uuid="GPU-1")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: gpu)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need - (256 << 20), 80 << 30))
    check_gpu_memory(config, 4, 0, torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need - (256 << 20) - 1, 80 << 30))
    with pytest.raises(ValueError, match=r"at 67108864 bytes .* on GPU 0 of .* \(1 rank\(s\) on it\)"):
        check_gpu_memory(config, 4, 0, torch.device("cuda", 0))


def test_where_host_copies_start_within_the_sweep_the_largest_size_on_the_gpu_may_be_the_worst(monkeypatch):
    """From $COMMBENCH_GLOO_CUDA_HOST_FROM's size on, gloo's hand-written calls keep their scratch
    on the host; below it on the GPU, where naive's root at 32 MiB held more than the 64 MiB size
    (the check looked at the largest size alone)."""
    import dataclasses

    from commbench import comm
    from commbench.bench.sweep import buffer_bytes, gpu_bytes, scratch_per_rank

    monkeypatch.setattr(comm.p2p, "backend_for", lambda group, device: "gloo")
    config = SweepConfig(algorithms=("builtin", "naive"), min_bytes=1 << 20, max_bytes=64 << 20)
    below = dataclasses.replace(config, max_bytes=32 << 20)
    at_32m = buffer_bytes(below, 16) + scratch_per_rank(below, 16)[0]
    assert at_32m > buffer_bytes(config, 16)
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv(comm.HOST_FROM_ENV, "64M")
    assert gpu_bytes(config, 16, 0, cuda) == (at_32m, 32 << 20)
    assert gpu_bytes(config, 16, 1, cuda) == (buffer_bytes(config, 16), 64 << 20)  # no scratch off the root
    monkeypatch.setenv(comm.HOST_FROM_ENV, "0")  # every size on host copies
    assert gpu_bytes(config, 16, 0, cuda) == (buffer_bytes(config, 16), 64 << 20)
    monkeypatch.setenv(comm.HOST_FROM_ENV, "never")
    whole = buffer_bytes(config, 16) + scratch_per_rank(config, 16)[0]
    assert gpu_bytes(config, 16, 0, cuda) == (whole, 64 << 20)


def test_series_of_one_algorithm_with_different_segments_share_its_scratch():
    """ring and ring@1M name the same Workspace buffers, which grow to the larger of the two."""
    from commbench.bench.sweep import scratch_per_rank
    from commbench.comm.costmodel import scratch_bytes

    size = 256 << 20
    default, small = (
        scratch_bytes("all_reduce", "ring", 2, size // 4, 4, **kw) for kw in ({}, {"segment_bytes": 1 << 20})
    )
    assert default != small
    config = SweepConfig(algorithms=("builtin", "ring", "ring@1M", "auto@1M"), min_bytes=size, max_bytes=size)
    assert scratch_per_rank(config, 2) == [max(a, b) for a, b in zip(default, small, strict=True)]
    alone = SweepConfig(algorithms=("ring@1M",), min_bytes=size, max_bytes=size)
    assert scratch_per_rank(alone, 2) == list(small)


@pytest.mark.parametrize(
    "collective, says",
    [
        ("all_reduce", "all_reduce always runs in place (one buffer, as in torch.distributed)"),
        ("broadcast", "broadcast always runs in place (one buffer, as in torch.distributed)"),
        ("sendrecv", "sendrecv has no in-place form"),
    ],
)
def test_in_place_is_refused_for_a_collective_without_the_other_form(collective, says):
    algorithms = ("p2p",) if collective == "sendrecv" else ("ring",)
    with pytest.raises(ValueError) as refused:
        SweepConfig(collective=collective, algorithms=algorithms, in_place=True)
    assert str(refused.value) == f"--in-place applies to reduce_scatter and all_gather; {says}"


@pytest.mark.parametrize("rank", [0, 2])
def test_the_in_place_forms_view_the_rank_s_chunk(rank):
    """nccl-tests' in-place column: reduce_scatter's output is rank r's chunk of its input, and
    all_gather's input is rank r's part of its output; the pristine copy is a buffer of its own."""
    from commbench.bench.collectives import SPECS

    world, count, cpu = 4, 40, torch.device("cpu")
    rs = SPECS["reduce_scatter"].make_for(count, torch.float32, cpu, rank, world, "sum", 0, True)
    assert rs.output._base is rs.input and rs.output.numel() == 10
    assert rs.output.data_ptr() == rs.input.data_ptr() + rank * 10 * 4
    ag = SPECS["all_gather"].make_for(count, torch.float32, cpu, rank, world, None, 0, True)
    assert ag.input._base is ag.output and ag.input.numel() == 10
    assert ag.input.data_ptr() == ag.output.data_ptr() + rank * 10 * 4
    for b in (rs, ag):
        assert b.reference.data_ptr() not in (b.input.data_ptr(), b.output.data_ptr())
    out_of_place = SPECS["reduce_scatter"].make_for(count, torch.float32, cpu, rank, world, "sum", 0, False)
    assert out_of_place.output._base is None
    assert SPECS["all_reduce"].runs_in_place(False) and SPECS["reduce_scatter"].runs_in_place(True)
    assert not SPECS["reduce_scatter"].runs_in_place(False) and not SPECS["sendrecv"].runs_in_place(True)


def test_in_place_reduce_scatter_s_ring_holds_its_result_aside():
    """The ring computes an output that is a view of its input in scratch and copies it at the end:
    one chunk more, in the cost model and in the sweep's memory check."""
    from commbench.bench.sweep import scratch_per_rank
    from commbench.comm.costmodel import scratch_bytes

    count, world = 1 << 20, 4
    out = scratch_bytes("reduce_scatter", "ring", world, count, 4)
    inside = scratch_bytes("reduce_scatter", "ring", world, count, 4, in_place=True)
    assert [b - a for a, b in zip(out, inside, strict=True)] == [count // world * 4] * world
    assert scratch_bytes("all_gather", "ring", world, count, 4, in_place=True) == (0,) * world
    kw = dict(collective="reduce_scatter", algorithms=("ring",), min_bytes=4 << 20, max_bytes=4 << 20)
    assert scratch_per_rank(SweepConfig(**kw, in_place=True), world) == list(inside)
    assert scratch_per_rank(SweepConfig(**kw), world) == list(out)


def test_the_table_header_says_in_place():
    from commbench.bench.report import table_header

    run = {"world_size": 2, "backend": "gloo", "device": "cpu"}
    config = SweepConfig(collective="all_gather", algorithms=("ring",), in_place=True)
    assert table_header(config, run).startswith("# commbench sweep: all_gather in place, 2 ranks,")
    config = SweepConfig(collective="all_gather", algorithms=("ring",))
    assert table_header(config, run).startswith("# commbench sweep: all_gather, 2 ranks,")


@pytest.mark.parametrize(
    "collective, says", [("broadcast", "broadcast, root 3, 4 ranks,"), ("reduce", "reduce, root 3, 4 ranks,")]
)
def test_the_title_names_the_root_of_a_rooted_collective_and_one_iteration_so(collective, says):
    """nccl-tests prints a root column; the title said nothing of -r, nor of the others' missing one."""
    from commbench.bench.report import table_header

    run = {"world_size": 4, "backend": "gloo", "device": "cpu"}
    lines = table_header(SweepConfig(collective=collective, root=3, iters=1), run).splitlines()
    assert lines[0].startswith(f"# commbench sweep: {says}")
    assert "median of 1 iteration (after" in lines[1]
    assert "root" not in table_header(SweepConfig(collective="all_reduce", root=3), run)


@pytest.mark.parametrize(
    "collective, count",
    [("all_reduce", 1024), ("reduce_scatter", 256), ("all_gather", 256), ("broadcast", 1024)],
)
def test_the_count_column_is_nccl_tests(collective, count):
    """nccl-tests' count is a rank's part for all_gather and reduce_scatter, whose size is the whole
    array; the column printed the whole array's, four times too many at four ranks."""
    from commbench.bench.report import table_rows

    record = {
        "collective": collective,
        "world_size": 4,
        "size_bytes": 4096,
        "count": 1024,
        "dtype": "float32",
    }
    record |= {"op": "sum", "algorithm": "ring", "time_us": 10.0, "algbw_gbps": 0.4, "busbw_gbps": 0.3}
    record |= {"wrong": 0, "busbw_ratio_to_builtin": None, "frac_of_limit": None}
    assert table_rows([record]).split()[:2] == ["4096", str(count)]


@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
@pytest.mark.parametrize("rank", [0, 1])
def test_an_all_gather_output_left_unwritten_is_wrong_on_every_rank(rank, in_place):
    """Rank 0's in-place input starts where its output does: the check told a one-buffer collective
    by equal addresses, left that output unpoisoned, and a call that wrote nothing there scored 0
    wrong with the timed calls' right result still in place."""
    from commbench.bench.collectives import SPECS, ready_for_check

    world, m, cpu = 4, 1000, torch.device("cpu")
    spec = SPECS["all_gather"]
    b = spec.make_for(m * world, torch.float32, cpu, rank, world, None, 0, in_place)
    b.output.copy_(torch.cat([pattern(r, m, COPY, torch.float32, cpu) for r in range(world)]))
    assert spec.wrong(b, None, rank, world, 0) == 0  # the timed calls' result
    ready_for_check(b)  # and then a call that writes nothing
    # in place the rank's own part is its input, which the check's copy fills
    assert spec.wrong(b, None, rank, world, 0) == (world - in_place) * m
    assert torch.equal(b.output[rank * m : (rank + 1) * m], b.reference) == in_place


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_broadcast_that_sends_nothing_is_wrong_on_every_rank_but_the_root(rank):
    """A rank other than the root starts from zeros, not the root's data: a broadcast that moved
    nothing leaves every one of its elements wrong; the root's own data is right."""
    from commbench.bench.collectives import SPECS, ready_for_check

    world, root, count, cpu = 3, 1, 1000, torch.device("cpu")
    spec = SPECS["broadcast"]
    b = spec.make(count, torch.float32, cpu, rank, world, None, root)
    ready_for_check(b)  # and then no call at all
    assert spec.wrong(b, None, rank, world, root) == (0 if rank == root else count)


def test_a_points_figures_come_from_the_slowest_ranks_median_and_every_ranks_check(worlds):
    """At 2 ranks, where an all_reduce's and a send/recv's bus factors are 1: the time of an
    iteration is the slower rank's, a point's time is the median over its iterations (not the
    mean), bandwidths are bytes over that time, the ratios divide those bandwidths, and the wrong
    elements found by any rank are counted (rank 1's alone here)."""
    times_us = {
        0: {"builtin": [1, 2, 6], "naive": [4, 8, 8], "p2p": [2, 4, 8]},
        1: {"builtin": [3, 1, 1], "naive": [4, 8, 8], "p2p": [2, 4, 8]},
    }
    results = worlds(2).run(("sweep_arithmetic", {"times_us": times_us}))
    assert results[0] == results[1]
    got = {r["algorithm"]: r for r in results[0]}
    assert sorted(got) == ["builtin", "naive", "p2p"]
    # builtin: the slower rank's iterations are 3, 2 and 6 us (each rank's median is 2 and 1)
    assert got["builtin"]["time_us"] == pytest.approx(3) and got["builtin"]["time_us_mean"] == pytest.approx(
        11 / 3
    )
    assert (got["naive"]["time_us"], got["p2p"]["time_us"]) == (pytest.approx(8), pytest.approx(4))
    for name, us in (("builtin", 3), ("naive", 8), ("p2p", 4)):
        assert got[name]["algbw_gbps"] == pytest.approx(1024 / us / 1e3), name
        assert got[name]["busbw_gbps"] == pytest.approx(1024 / us / 1e3), name
        assert got[name]["limit_busbw_gbps"] == pytest.approx(1024 / 4 / 1e3), name
    assert got["naive"]["busbw_ratio_to_builtin"] == pytest.approx(3 / 8)
    assert got["builtin"]["busbw_ratio_to_builtin"] == pytest.approx(1)
    assert got["builtin"]["frac_of_limit"] == pytest.approx(4 / 3)
    assert got["naive"]["frac_of_limit"] == pytest.approx(4 / 8)
    assert (got["builtin"]["wrong"], got["naive"]["wrong"], got["p2p"]["wrong"]) == (0, 3, 0)
