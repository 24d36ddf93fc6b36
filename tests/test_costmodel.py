"""The cost model, without a process group; measured bytes are checked in test_comm_distributed."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from commbench.comm import ALGORITHMS, tuning
from commbench.comm.costmodel import SEGMENT_BYTES, bus_factor, cost, scratch_bytes
from commbench.comm.pipeline import RECV_AHEAD, RECV_AHEAD_BYTES, look_ahead

MiB = 1 << 20


def test_chain_broadcast_pays_pipeline_fill():
    big = cost("broadcast", "ring", 4, 16 * MiB, 1)
    assert big.steps == 4 - 2 + 16 * MiB // SEGMENT_BYTES
    # 10 elements make 10 segments at most: the ring sends no empty ones (was 4 - 2 + 40)
    assert cost("broadcast", "ring", 4, 10, 4, segment_bytes=1).steps == 4 - 2 + 10


def test_ring_steps_are_its_messages_in_segments():
    """Each chunk goes in segments, one message each: ring@64K sends 6 x 64 messages a rank for
    16 MiB at 4 ranks (was 6 steps whatever the segment). The backend's builtin is not segmented
    by commbench and keeps one message a step."""
    seg = 64 << 10
    assert cost("all_reduce", "ring", 4, 4 * MiB, 4, segment_bytes=seg).steps == 2 * 3 * 64
    assert cost("all_reduce", "ring", 4, 4 * MiB, 4).steps == 2 * 3
    assert cost("reduce_scatter", "ring", 4, 4 * MiB, 4, segment_bytes=seg).steps == 3 * 64
    assert cost("all_gather", "ring", 4, 4 * MiB, 4, segment_bytes=seg).steps == 3 * 64
    # reduce: what the destination receives, (n - 1) x 64 segments and n - 1 chunks
    assert cost("reduce", "ring", 4, 4 * MiB, 4, segment_bytes=seg).steps == 3 * 64 + 3
    assert cost("all_reduce", "builtin", 4, 4 * MiB, 4, segment_bytes=seg).steps == 2 * 3
    # one element: a single segment still makes its 2 (n - 1) hops around the ring
    assert cost("all_reduce", "ring", 4, 1, 4, segment_bytes=1).steps == 2 * 3


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_ring_all_reduce_moves_2_n_minus_1_over_n_per_rank(world):
    c = cost("all_reduce", "ring", world, 1 << 20, 4)
    expected = 2 * (world - 1) / world * 4 * MiB
    assert all(abs(s - expected) <= 8 for s in c.sent_bytes)
    assert c.steps == 2 * (world - 1)


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_naive_all_reduce_loads_the_root(world):
    c = cost("all_reduce", "naive", world, 1000, 4)
    assert c.sent_bytes[0] == c.recv_bytes[0] == (world - 1) * 4000
    assert all(s == 4000 for s in c.sent_bytes[1:])


@pytest.mark.parametrize("collective", sorted(ALGORITHMS))
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7])
def test_every_byte_sent_is_received(collective, world):
    """The model counts what a rank sends from its own schedule and what it receives from its
    peers' (a partner's spans in hd, the left neighbour's chunks in a ring), so the totals agree
    only where the two sides pair up. Per rank, both are checked against counted messages in
    tests/test_comm_distributed.py."""
    for algorithm in ALGORITHMS[collective]:
        for part in (0, 1, 7, 1000 * world):
            whole = collective in ("reduce_scatter", "all_gather")  # count: the whole array
            count = part * world if whole else part
            c = cost(collective, algorithm, world, count, 2, root=world - 1)
            assert sum(c.sent_bytes) == sum(c.recv_bytes), (algorithm, count)
            assert len(c.sent_bytes) == world


def test_world_of_one_moves_nothing():
    assert cost("all_reduce", "ring", 1, 100, 4).sent_bytes == (0,)


def test_alpha_beta_time():
    c = cost("all_reduce", "ring", 4, 1 << 20, 4)
    assert c.time_s(1e-5, 0.0) == pytest.approx(6e-5)
    assert c.time_s(0.0, 1e-9) == pytest.approx(c.critical_bytes * 1e-9)


def test_builtin_is_priced_as_a_ring_and_auto_as_what_it_picks():
    for backend in (None, "nccl", "gloo"):
        assert (
            cost("all_reduce", "builtin", 4, 4096, 4, backend=backend).sent_bytes
            == cost("all_reduce", "ring", 4, 4096, 4).sent_bytes
        )
    small = tuning.choose("all_reduce", 1024, 4)
    assert cost("all_reduce", "auto", 4, 256, 4).sent_bytes == cost("all_reduce", small, 4, 256, 4).sent_bytes


@pytest.mark.parametrize("collective", sorted(tuning.AUTO))
@pytest.mark.parametrize("world", [2, 4, 8, 3])
@pytest.mark.parametrize("itemsize", [4, 2])
def test_auto_is_priced_by_the_bytes_of_the_message_either_side_of_each_crossover(
    collective, world, itemsize
):
    """``auto`` picks by bytes: its price, and its scratch, are those of the algorithm it runs at
    the elements either side of each crossover (where a count of elements would pick otherwise)."""
    rows = tuning.AUTO[collective]
    edges = [limit for limit, _ in rows.get(world, rows["default"]) if limit is not None]
    assert edges
    for limit in edges:
        step = world if collective in ("reduce_scatter", "all_gather") else 1  # whole arrays split evenly
        below = limit // itemsize // step * step
        above = below + step
        picked = [tuning.choose(collective, n * itemsize, world) for n in (below, above)]
        assert picked[0] != picked[1] and tuning.choose(collective, below, world) == picked[0]
        for count, algorithm in zip((below, above), picked, strict=True):
            auto = cost(collective, "auto", world, count, itemsize)
            assert (auto.sent_bytes, auto.steps) == (
                cost(collective, algorithm, world, count, itemsize).sent_bytes,
                cost(collective, algorithm, world, count, itemsize).steps,
            ), (limit, count, algorithm)
            assert scratch_bytes(collective, "auto", world, count, itemsize) == scratch_bytes(
                collective, algorithm, world, count, itemsize
            )


# Bytes each rank sent in gloo's broadcast, in messages, root 0 (TCP_INFO, 1.5 MiB of float32)
GLOO_BROADCAST = {
    3: [2, 0, 0],
    4: [2, 1, 0, 0],
    5: [3, 1, 0, 0, 0],
    6: [3, 2, 0, 0, 0, 0],
    7: [3, 2, 1, 0, 0, 0, 0],
    8: [3, 2, 1, 1, 0, 0, 0, 0],
}


@pytest.mark.parametrize("world", sorted(GLOO_BROADCAST))
def test_gloos_builtin_broadcast_is_its_binomial_tree(world):
    """Measured with root 0 and root n - 1 alike (a ring chain priced [1, ..., 1, 0] before)."""
    for root in (0, world - 1):
        c = cost("broadcast", "builtin", world, 1000, 4, root=root, backend="gloo")
        assert [c.sent_bytes[(x + root) % world] // 4000 for x in range(world)] == GLOO_BROADCAST[world]
        assert c.recv_bytes == tuple(0 if r == root else 4000 for r in range(world))
        assert c.steps == math.ceil(math.log2(world)) and c.critical_bytes == c.steps * 4000
    # NCCL's, or a backend not said, stays the pipelined chain
    assert cost("broadcast", "builtin", world, 1000, 4, backend="nccl").sent_bytes == tuple(
        4000 if r < world - 1 else 0 for r in range(world)
    )


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloos_builtin_reduce_scatter_is_an_allreduce_of_the_whole_array(world):
    """Measured per rank: 2049 KiB at 3 ranks and 2305 at 4 for 1.5 MiB, the ring all_reduce's
    2048 and 2304, against a ring reduce-scatter's 1024 and 1152."""
    count = 12 << 15
    gloo = cost("reduce_scatter", "builtin", world, count, 4, backend="gloo")
    ring = cost("all_reduce", "ring", world, count, 4)
    assert (gloo.sent_bytes, gloo.recv_bytes, gloo.steps, gloo.critical_bytes) == (
        ring.sent_bytes,
        ring.recv_bytes,
        ring.steps,
        ring.critical_bytes,
    )
    for backend in (None, "nccl"):
        assert cost("reduce_scatter", "builtin", world, count, 4, backend=backend).sent_bytes == tuple(
            [(world - 1) * count // world * 4] * world
        )


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_halving_doubling_moves_what_a_ring_moves_in_logarithmic_steps(world):
    core = 1 << (world.bit_length() - 1)
    count = 1 << 20
    hd, ring = cost("all_reduce", "hd", world, count, 4), cost("all_reduce", "ring", world, count, 4)
    folded = 2 * (world - core)  # ranks that fold in: the odd ones also move the whole message
    for r in range(folded, world):
        assert hd.sent_bytes[r] == hd.recv_bytes[r] == 2 * (core - 1) * 4 * count // core
    assert all(hd.sent_bytes[r] == 4 * count for r in range(0, folded, 2))
    assert hd.steps == 2 * (core.bit_length() - 1) + (2 if folded else 0)
    if world == core:
        assert hd.sent_bytes == ring.sent_bytes and hd.critical_bytes == ring.critical_bytes


@pytest.mark.parametrize("world", [2, 3, 4, 6, 7, 8])
@pytest.mark.parametrize("count", [0, 1, 3, 7, 1021])
def test_halving_doubling_at_any_count_moves_each_element_once_a_round(world, count):
    """Each round the pairs split what they share, so the core's sends in one phase add up to
    (core - 1) messages whatever the count; a folded pair adds one whole message each way."""
    core = 1 << (world.bit_length() - 1)
    folds = world - core
    hd = cost("all_reduce", "hd", world, count, 2)
    assert sum(hd.sent_bytes) == sum(hd.recv_bytes) == 2 * 2 * count * (core - 1) + 2 * folds * 2 * count


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_gather", 4) == 0.75
    assert bus_factor("reduce_scatter", 2) == 0.5
    assert bus_factor("broadcast", 8) == bus_factor("sendrecv", 8) == 1.0


def test_unknown_names_raise():
    with pytest.raises(ValueError, match="collective"):
        cost("alltoall", "ring", 2, 10, 4)
    with pytest.raises(ValueError, match="no cost"):
        cost("all_reduce", "tree", 2, 10, 4)
    with pytest.raises(ValueError, match="world_size"):
        cost("all_reduce", "ring", 0, 10, 4)


@pytest.mark.parametrize(
    "args, kwargs, needle",
    [
        # one rank, or no elements, returned zeros before the names were looked at
        (("alltoall", "ring", 1, 10, 4), {}, "unknown collective"),
        (("all_reduce", "tree", 4, 0, 4), {}, "no cost"),
        (("bogus", "auto", 2, 10, 4), {}, "unknown collective"),  # was a KeyError from the auto table
        (("all_reduce", "naive", 3, -5, 4), {}, "count must be >= 0"),  # was negative bytes
        (("broadcast", "tree", 4, 10, 4), {"root": 9}, "root must be a rank in [0, 4)"),  # was root 1
        # a whole array that ranks cannot share equally: was priced as 6.5 float32 elements a rank
        (("reduce_scatter", "ring", 4, 10, 4), {}, "count 10 is the whole (gathered) array"),
        (("all_gather", "naive", 3, 7, 4), {}, "must be a multiple of world_size 3"),
        # a segment of no bytes: refused only where a ring had a chunk to cut (4 ranks, 10 elements)
        (("all_reduce", "ring", 1, 10, 4), {"segment_bytes": 0}, "segment_bytes must be >= 1, got 0"),
        (("reduce", "ring", 4, 0, 4), {"segment_bytes": -1}, "segment_bytes must be >= 1, got -1"),
        (("broadcast", "naive", 4, 10, 4), {"segment_bytes": 0}, "segment_bytes must be >= 1, got 0"),
    ],
)
def test_a_call_that_cannot_be_priced_raises_at_any_size(args, kwargs, needle):
    from commbench.comm.costmodel import scratch_bytes

    for price in (cost, scratch_bytes):
        with pytest.raises(ValueError, match=re.escape(needle)):
            price(*args, **kwargs)


@pytest.mark.parametrize(
    "args, kwargs, needle",
    [
        # a float world size failed inside ("can't multiply sequence by non-int"), a fractional
        # count or item size was priced as fractional bytes, a bool world size as one rank
        (("all_reduce", "ring", 2.0, 10, 4), {}, "world_size must be an integer, got float 2.0"),
        (("all_reduce", "ring", True, 10, 4), {}, "world_size must be an integer, got True"),
        (("all_gather", "ring", 2, 10.5, 4), {}, "count must be an integer, got float 10.5"),
        (("all_reduce", "ring", 2, 10, 2.5), {}, "itemsize must be an integer, got float 2.5"),
        (("broadcast", "tree", 2, 10, 4), {"root": 1.0}, "root must be an integer, got float 1.0"),
        (("all_reduce", "ring", 2, 10, 4), {"segment_bytes": None}, "segment_bytes must be an integer"),
    ],
)
def test_a_number_that_is_no_whole_number_is_a_type_error(args, kwargs, needle):
    from commbench.comm.costmodel import scratch_bytes

    for price in (cost, scratch_bytes):
        with pytest.raises(TypeError, match=re.escape(needle)):
            price(*args, **kwargs)
    assert (
        cost("all_reduce", "ring", np.int64(2), np.int32(10), 4).sent_bytes
        == cost("all_reduce", "ring", 2, 10, 4).sent_bytes
    )
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        bus_factor("all_reduce", 0)  # was ZeroDivisionError


def test_auto_table_is_well_formed():
    for collective, rows in tuning.AUTO.items():
        assert "default" in rows
        for table in rows.values():
            assert table[-1][0] is None
            limits = [lim for lim, _ in table[:-1]]
            assert limits == sorted(limits)
            for _, algorithm in table:
                assert algorithm in ALGORITHMS[collective]


def test_auto_picks_by_size_and_world():
    assert tuning.choose("all_reduce", 2 << 20, 2) == "rd"
    assert tuning.choose("all_reduce", 4 << 20, 2) == "ring"
    assert tuning.choose("all_reduce", 4 << 20, 4) == "ring"
    assert tuning.choose("all_reduce", 1024, 4) == "naive"
    assert tuning.choose("all_reduce", 1024, 8) == "naive"
    assert tuning.choose("all_reduce", 4 << 20, 8) == "naive"
    assert tuning.choose("all_reduce", (4 << 20) + 4, 8) == "hd"
    assert tuning.choose("all_reduce", 1024, 16) == "rd"
    assert tuning.choose("all_reduce", 4 << 20, 16) == "ring"
    assert tuning.choose("all_reduce", 64 << 20, 2) == "ring"
    assert tuning.choose("broadcast", 1024, 3) == "naive"
    assert tuning.choose("reduce", 1024, 3) == "tree"
    assert tuning.choose("all_reduce", 1024, 1) == "builtin"


@pytest.mark.parametrize("segment_bytes", [4 << 10, 2 << 20, 16 << 20, 96 << 20])
@pytest.mark.parametrize("world", [2, 4])
def test_a_rings_receive_slots_stay_within_the_look_ahead_bytes_however_large_the_message(
    segment_bytes, world
):
    # Slots hold the receives posted ahead, each up to a segment: their bytes are capped by
    # pipeline.RECV_AHEAD_BYTES (or one segment, where a segment alone is larger), not by the message.
    cap = max(RECV_AHEAD_BYTES, segment_bytes)
    # 32 GiB of float32: chunks past MAX_SEGMENTS segments of 1 MiB, cut into larger ones (the
    # slots were sized by the 1 MiB asked for, and came to 256 MiB at 2 ranks)
    for count in (1 << 20, 1 << 28, 1 << 33):  # 4 MiB, 1 GiB and 32 GiB of float32
        for collective in ("all_reduce", "reduce_scatter"):
            got = scratch_bytes(collective, "ring", world, count, 4, segment_bytes=segment_bytes)
            spare = 0 if collective == "all_reduce" or world <= 2 else count // world * 4
            assert max(got) - spare <= cap, (collective, count)
    assert look_ahead(segment_bytes) * min(segment_bytes, RECV_AHEAD_BYTES) <= RECV_AHEAD_BYTES
    assert look_ahead(segment_bytes) >= 1


def test_small_segments_keep_the_full_look_ahead():
    assert look_ahead(2 << 20) == RECV_AHEAD
    assert look_ahead(16 << 20) == RECV_AHEAD_BYTES // (16 << 20)


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8])
def test_recursive_doubling_pays_two_steps_to_fold_a_world_that_is_no_power_of_two(world):
    """rd exchanges the whole vector log2(p) times over the power-of-two core p; where n is not a
    power of two the first 2(n - p) ranks fold into their neighbours before (one whole message)
    and get the result back after (one more): log2(p) + 2 steps, not + 1 (a mutant pricing the
    fold as one step went unnoticed). Every message of rd is the whole vector, so the busiest
    path carries steps x size bytes."""
    size = 1000 * 4
    core = 1 << (world.bit_length() - 1)  # the largest power of two <= world
    rounds = {2: 1, 4: 2, 8: 3}[core]
    fold = 0 if world == core else 2
    c = cost("all_reduce", "rd", world, 1000, 4)
    assert c.steps == rounds + fold
    assert c.critical_bytes == (rounds + fold) * size
    if fold:  # a folded-in rank sends its vector once and gets the result once, nothing else
        assert c.sent_bytes[0] == c.recv_bytes[0] == size


@pytest.mark.parametrize(
    "world, count, expected",
    [
        # 4 ranks, 4000 float32: chunks of 1000 elements (4000 bytes); reduce-scatter 3 chunks
        # around the ring, then 3 chunks into the root: 2 x 3 x 4000 bytes, no tail
        (4, 4000, 2 * 3 * 4000),
        # 4003 elements: the same body, and 3 leftover elements (12 bytes) up a binomial tree of
        # 2 rounds (ceil(log2 4)): 24000 + 2 x 12
        (4, 4003, 2 * 3 * 4000 + 2 * 12),
        # 3 ranks, 3002 elements: chunks of 1000, 2 x 2 x 4000, then 2 elements (8 bytes) over
        # ceil(log2 3) = 2 rounds
        (3, 3002, 2 * 2 * 4000 + 2 * 8),
        # fewer elements than ranks: the tree alone, 3 rounds at 8 ranks of 5 x 4 bytes
        (8, 5, 3 * 5 * 4),
    ],
)
def test_ring_reduce_critical_bytes_are_the_reduce_scatter_then_the_gather_to_the_root(
    world, count, expected
):
    """The ring reduce is a reduce-scatter of world x (count // world) elements (n - 1 chunks
    along each link, one after another) and then every rank's reduced chunk sent to the root
    (n - 1 chunks into the root's one link): 2 (n - 1) chunks in sequence, plus the leftover
    elements' tree rounds. A mutant dropping the 2 (pricing the gather as free) went unnoticed."""
    c = cost("reduce", "ring", world, count, 4)
    assert c.critical_bytes == expected
    # the root's inbound link carries all of the body in sequence: what it receives of it
    body = world * (count // world)
    if body:
        root_body = c.recv_bytes[0] - cost("reduce", "ring", world, count - body, 4).recv_bytes[0]
        assert root_body == 2 * (world - 1) * (count // world) * 4
