"""Schedules with no process group: chunk boundaries, ring orders, trees, recursive doubling and
halving."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from commbench.comm.chunking import (
    MAX_SEGMENTS,
    binomial_children,
    binomial_parent,
    halving_schedule,
    num_segments,
    recursive_doubling_layout,
    recursive_doubling_rank,
    recursive_doubling_real,
    ring_all_gather_order,
    ring_reduce_scatter_order,
    split,
    sub_span,
    tree_depth,
)


@given(count=st.integers(0, 10_000), parts=st.integers(1, 64))
def test_split_covers_everything_once_and_is_balanced(count, parts):
    spans = split(count, parts)
    assert len(spans) == parts
    assert spans[0][0] == 0 and spans[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    sizes = [b - a for a, b in spans]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


def test_split_rejects_bad_arguments():
    with pytest.raises(ValueError, match="parts"):
        split(10, 0)
    with pytest.raises(ValueError, match="count"):
        split(-1, 2)


@given(start=st.integers(0, 100), length=st.integers(0, 1000), parts=st.integers(1, 16))
def test_sub_spans_tile_their_span(start, length, parts):
    span = (start, start + length)
    subs = [sub_span(span, parts, k) for k in range(parts)]
    assert subs[0][0] == start and subs[-1][1] == start + length
    assert all(a[1] == b[0] for a, b in zip(subs, subs[1:], strict=False))


@given(start=st.integers(0, 100), length=st.integers(0, 1000), parts=st.integers(1, 16), data=st.data())
def test_a_sub_span_is_that_span_of_the_whole_split(start, length, parts, data):
    index = data.draw(st.integers(0, parts - 1))
    a, b = split(length, parts)[index]
    assert sub_span((start, start + length), parts, index) == (start + a, start + b)


def test_a_sub_span_is_worked_out_alone_not_from_the_whole_split():
    """A ring's schedule takes one sub_span per segment: building the whole split for each made it
    quadratic in the segments (2.5 s of Python for a 2-rank all_reduce of 2048 segments a chunk). One span
    of a million takes no memory for the other 999,999 (the whole split held 64 MB)."""
    import tracemalloc

    tracemalloc.start()
    try:
        got = sub_span((10, 20), 1_000_000, 999_999)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == (20, 20)
    assert peak < 100_000, peak
    with pytest.raises(IndexError):
        sub_span((0, 10), 4, 4)


def test_num_segments():
    assert num_segments(0, 4, 1 << 20) == 1
    assert num_segments(1 << 18, 4, 1 << 20) == 1
    assert num_segments((1 << 18) + 1, 4, 1 << 20) == 2
    assert num_segments(10, 4, 1) == 10  # not 40: segments past the elements would be empty
    assert num_segments(1 << 18, 4, 4) == MAX_SEGMENTS  # not 262144 segments of one element
    assert num_segments(MAX_SEGMENTS * 2, 4, 8) == MAX_SEGMENTS
    with pytest.raises(ValueError):
        num_segments(10, 4, 0)


@pytest.mark.parametrize("world", range(1, 9))
def test_ring_reduce_scatter_leaves_chunk_r_fully_reduced_at_rank_r(world):
    # Simulate: holdings[r][c] = set of ranks whose contribution to chunk c rank r holds.
    holdings = [[{r} for _ in range(world)] for r in range(world)]
    orders = [ring_reduce_scatter_order(r, world) for r in range(world)]
    for step in range(world - 1):
        sent = [(orders[r][step][0], set(holdings[r][orders[r][step][0]])) for r in range(world)]
        for r in range(world):
            chunk, contrib = sent[(r - 1) % world]  # what the left neighbour sent
            assert chunk == orders[r][step][1], "receiver expects the chunk the sender sends"
            holdings[r][chunk] |= contrib
    for r in range(world):
        assert holdings[r][r] == set(range(world))


@pytest.mark.parametrize("world", range(1, 9))
def test_ring_all_gather_delivers_every_chunk_everywhere(world):
    have = [{r} for r in range(world)]
    orders = [ring_all_gather_order(r, world) for r in range(world)]
    for step in range(world - 1):
        for r in range(world):
            send_chunk = orders[(r - 1) % world][step][0]
            assert send_chunk in have[(r - 1) % world]
            assert send_chunk == orders[r][step][1]
        for r in range(world):
            have[r].add(orders[r][step][1])
    assert all(h == set(range(world)) for h in have)


@pytest.mark.parametrize("world", range(1, 20))
def test_binomial_tree_is_a_spanning_tree_of_logarithmic_depth(world):
    for rel in range(world):
        for child in binomial_children(rel, world):
            assert binomial_parent(child) == rel
        parent = binomial_parent(rel)
        if parent is not None:
            assert rel in binomial_children(parent, world)
    depth = [0] * world
    for rel in range(1, world):
        depth[rel] = depth[binomial_parent(rel)] + 1
    # Rounds: the root sends to its children one after another, so the tree needs ceil(log2 n).
    assert max(depth) <= tree_depth(world) == len(binomial_children(0, world))


@pytest.mark.parametrize("world", range(1, 20))
def test_recursive_doubling_folds_to_a_power_of_two(world):
    core, folded = recursive_doubling_layout(world)
    assert core & (core - 1) == 0 and core <= world < 2 * core and folded == world - core
    core_ranks = [recursive_doubling_rank(r, world) for r in range(world)]
    assert sorted(c for c in core_ranks if c is not None) == list(range(core))
    for r, c in enumerate(core_ranks):
        if c is not None:
            assert recursive_doubling_real(c, world) == r


@given(log_core=st.integers(0, 5), count=st.integers(0, 300))
def test_recursive_halving_reduces_each_span_once_and_doubling_gathers_it_back(log_core, count):
    core = 1 << log_core
    plans = [halving_schedule(r, core, count) for r in range(core)]
    assert all(len(p) == log_core for p in plans)
    # holdings[r][i] = ranks whose contribution to element i rank r holds
    holdings = [[{r} for _ in range(count)] for r in range(core)]
    span = [(0, count)] * core
    for step in range(log_core):
        moved = []
        for r in range(core):
            partner, keep, give = plans[r][step]
            assert plans[partner][step][0] == r, "partners name each other"
            assert span[r] == span[partner], "partners share the span they split"
            assert plans[partner][step][2] == keep and plans[partner][step][1] == give
            assert (min(keep[0], give[0]), max(keep[1], give[1])) == span[r] and keep[1] - keep[0] >= 0
            moved.append((partner, give, [set(holdings[r][i]) for i in range(*give)]))
        for partner, (g0, g1), contrib in moved:
            for i, c in zip(range(g0, g1), contrib, strict=True):
                holdings[partner][i] |= c
        span = [plans[r][step][1] for r in range(core)]
    # after the halving, core rank r holds the r-th span, fully reduced; the spans tile the message
    starts = sorted(span)
    assert [a for a, _ in starts[1:]] == [b for _, b in starts[:-1]]
    assert starts[0][0] == 0 and starts[-1][1] == count
    assert [span[r] for r in range(core)] == starts
    for r in range(core):
        assert all(holdings[r][i] == set(range(core)) for i in range(*span[r]))
    # the doubling retraces the rounds: each rank's span grows to the whole message
    for step in reversed(range(log_core)):
        grown = []
        for r in range(core):
            partner, _, give = plans[r][step]
            assert span[partner] == give, "a rank receives what it gave, now reduced"
            grown.append((min(span[r][0], give[0]), max(span[r][1], give[1])))
        span = grown
    assert span == [(0, count)] * core


def test_halving_schedule_rejects_a_core_not_a_power_of_two():
    with pytest.raises(ValueError, match="power of two, got 3"):
        halving_schedule(0, 3, 10)
