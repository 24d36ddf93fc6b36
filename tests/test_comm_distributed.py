"""The hand-written collectives against the backend's own and the closed form, on real gloo ranks."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from commbench.comm import (
    ALGORITHMS,
    STAGE_WHOLE_FROM_BYTES,
    builtin,
    p2p,
    pipeline,
    resolve,
    staged_whole,
    tcp,
)
from commbench.comm.costmodel import cost
from commbench.comm.ops import DTYPES, OPS

SMALL = [0, 1, 2, 3, 5, 7, 13, 31, 127, 1021, 4099]
# 5 ranks on CI's 2 cores, the most crowded world, in `make test-slow` (CI's ten minutes); 3 ranks
# keep a world that is not a power of two in `make test`.
FIVE = pytest.param(5, marks=pytest.mark.slow)
counts = st.one_of(
    st.sampled_from(SMALL),
    st.integers(min_value=0, max_value=20_000),
    st.sampled_from([(1 << 20) + 3, 786_431]),  # a few MiB of float32, odd element counts
)
cases = st.fixed_dictionaries(
    {
        "collective": st.sampled_from(sorted(ALGORITHMS)),
        "count": counts,
        "dtype": st.sampled_from(sorted(DTYPES)),
        "op": st.sampled_from(OPS),
        "root": st.integers(min_value=0, max_value=4),
        "workspace": st.booleans(),
    }
)


# For the slow run: fresh random cases every time, and messages up to 24 MiB. At the ring's default
# segment of 16 MiB (it was 2 MiB when this was written) a chunk is one segment, and the ring
# broadcast, which cuts the whole message, two at most; the ring cut into many segments is
# test_ring_pipeline_with_many_segments's.
large_cases = cases.filter(lambda c: c["dtype"] in ("float32", "int32")) | st.fixed_dictionaries(
    {
        "collective": st.sampled_from(sorted(ALGORITHMS)),
        "count": st.integers(min_value=1 << 20, max_value=6 << 20),
        "dtype": st.sampled_from(["float32", "int32"]),
        "op": st.sampled_from(OPS),
        "root": st.integers(min_value=0, max_value=4),
        "workspace": st.booleans(),
    }
)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, FIVE])
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(case=cases)
def test_every_algorithm_matches_builtin_and_closed_form(worlds, world_size, case):
    _check_case(worlds, world_size, case)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4, FIVE])
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=large_cases)
def test_random_and_large_cases_match_builtin_and_closed_form(worlds, world_size, case):
    _check_case(worlds, world_size, case)


def _check_case(worlds, world_size: int, case: dict) -> None:
    assume(case["op"] != "avg" or DTYPES[case["dtype"]].is_floating_point)
    assume(case["count"] < 100_000 or case["dtype"] in ("float32", "int32"))
    results = worlds(world_size).run(("collective", case))
    problems = [
        p
        for rank_result in results
        for p in (rank_result if isinstance(rank_result, list) else [str(rank_result)])
    ]
    assert problems == []


@pytest.mark.parametrize("world_size", [2, 3, 4, FIVE])
@pytest.mark.parametrize("collective", sorted(ALGORITHMS))
def test_every_dtype_and_op_at_every_world_size(worlds, world_size, collective):
    """The property test above samples; this covers the whole dtype x op grid once per world size."""
    case = {"collective": collective, "count": 1021, "root": world_size - 1}
    assert worlds(world_size).run(("grid", case)) == [[]] * world_size


@pytest.mark.parametrize("world_size", [2, 3, FIVE])
@pytest.mark.parametrize(("count", "segment_bytes"), [(211, 16), (7, 4), (0, 4), (4099, 1024), (150, 4)])
def test_ring_pipeline_with_many_segments(worlds, world_size, count, segment_bytes):
    case = {"count": count, "segment_bytes": segment_bytes}
    assert worlds(world_size).run(("segmented", case)) == [[]] * world_size


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_segment_size_given_to_the_api_reaches_the_ring(worlds, world_size):
    """The sweep's "ring@64": every collective stays right, and an all_reduce of 1000 elements
    sends 2 (n - 1) x nseg messages, nseg = ceil(334 x 4 / 64) = 21 at 3 ranks and 32 at 2,
    against one a step with the default segment; auto passes the segment on where it picks the
    ring (3 MiB at 2 and 3 ranks), and runs what it picks unsegmented below that."""
    big = {"count": 3 << 18, "segment_bytes": 256 << 10}
    case = {"count": 1000, "segment_bytes": 64, "ring_by_auto": big}
    results = worlds(world_size).run(("segments", case))
    nseg = math.ceil(math.ceil(1000 / world_size) * 4 / 64)
    assert resolve("all_reduce", "auto", 4000, world_size) != "ring"  # auto@64 runs what auto runs
    assert resolve("all_reduce", "auto", big["count"] * 4, world_size) == "ring"
    nseg_big = math.ceil(math.ceil(big["count"] / world_size) * 4 / big["segment_bytes"])
    assert nseg_big > 1
    for result in results:
        assert result["failures"] == []
        sends = result["sends"]
        assert sends["ring"] == 2 * (world_size - 1)
        assert sends["ring@64"] == 2 * (world_size - 1) * nseg
        assert sends["auto@64"] == sends["auto"] > 0, result
        assert sends["big auto"] == 2 * (world_size - 1)  # the ring with its default segment
        assert sends["big auto@262144"] == sends["big ring@262144"] == 2 * (world_size - 1) * nseg_big


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize(("count", "segment_bytes"), [(1000, 64), (10, 1), (7, 4)])
def test_ring_steps_are_the_messages_on_the_critical_path(worlds, world_size, count, segment_bytes):
    """The cost model's steps against the messages the ring sends, counted: the busiest rank's
    sends (at least the 2 (n - 1) hops of an all_reduce's segment), a broadcast's root's sends
    and the n - 2 hops its last segment makes after it, and what a reduce's destination receives.
    With one byte a segment, 10 elements make 10 segments, not 40 (empty ones are not sent)."""
    n = world_size
    results = worlds(n).run(("ring_messages", {"count": count, "segment_bytes": segment_bytes}))
    for name in sorted(ALGORITHMS):
        sends, recvs = [r[name][0] for r in results], [r[name][1] for r in results]
        counted = {
            "all_reduce": max(*sends, 2 * (n - 1)),
            "broadcast": sends[n - 1] + n - 2,
            "reduce": recvs[n - 1],
        }.get(name, max(sends))
        total = count * (n if name in ("reduce_scatter", "all_gather") else 1)
        model = cost(name, "ring", n, total, 4, root=n - 1, segment_bytes=segment_bytes)
        assert model.steps == counted, (name, sends, recvs)


@pytest.mark.parametrize("world_size", [2, 3])
def test_tensors_that_require_grad_and_tensor_roots_are_taken(worlds, world_size):
    results = worlds(world_size).run(("autograd", {}))
    assert all(all(r.values()) for r in results), results


@pytest.mark.parametrize("world_size", [2, 3])
def test_tensors_made_in_inference_mode_are_taken(worlds, world_size):
    assert worlds(world_size).run(("inference", {})) == [[]] * world_size


@pytest.mark.parametrize("world_size", [2, 3, 4, FIVE])
@pytest.mark.parametrize("collective", sorted(ALGORITHMS))
def test_bytes_on_the_wire_match_the_cost_model(worlds, world_size, collective):
    world = worlds(world_size)
    for algorithm in ALGORITHMS[collective]:
        if algorithm in ("builtin", "auto"):  # builtin's messages are gloo's: counted by TCP_INFO below
            continue
        for count in (1, 5, 1000, 1 << 19):
            root = world_size - 1
            measured = world.run(
                ("bytes", {"collective": collective, "algorithm": algorithm, "count": count, "root": root})
            )
            total = count * (world_size if collective in ("reduce_scatter", "all_gather") else 1)
            model = cost(collective, algorithm, world_size, total, 4, root=root)
            assert [m[0] for m in measured] == list(model.sent_bytes), (algorithm, count)
            assert [m[1] for m in measured] == list(model.recv_bytes), (algorithm, count)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("collective", sorted(ALGORITHMS))
def test_builtin_bytes_on_the_wire_match_the_cost_model_for_gloo(worlds, world_size, collective):
    """builtin is gloo's own code, out of sight of the counting above: its bytes are the kernel's
    count of each rank's TCP payload, within 1% and 4 KiB for gloo's message headers and the
    barriers around the call. gloo's reduce_scatter runs an allreduce of the whole array (twice a
    ring reduce-scatter's bytes: 2049 KiB a rank at 3 ranks and 1.5 MiB, against 1024); its
    broadcast is a binomial tree, whose root sends ceil(log2 n) copies."""
    if sys.platform != "linux":
        pytest.skip("the kernel's per-connection byte counts are read from Linux's TCP_INFO")
    world = worlds(world_size)
    root = world_size - 1
    for count in (1000, 1 << 18):  # 1 MiB of float32 a rank
        case = {"collective": collective, "algorithm": "builtin", "count": count, "root": root}
        measured = world.run(("wire_bytes", case))
        total = count * (world_size if collective in ("reduce_scatter", "all_gather") else 1)
        model = cost(collective, "builtin", world_size, total, 4, root=root, backend="gloo")
        for got, want in zip(
            [m[0] for m in measured] + [m[1] for m in measured],
            model.sent_bytes + model.recv_bytes,
            strict=True,
        ):
            assert abs(got - want) <= 0.01 * want + 4096, (count, measured, model)


@pytest.mark.parametrize("collective", ["reduce_scatter", "broadcast"])
def test_a_sweep_prices_builtin_as_its_backend_runs_it(worlds, collective):
    """The sweep's computed bytes for builtin are gloo's: an allreduce's for reduce_scatter, the
    tree's for broadcast (root 1 of 3 sends both copies), not a ring's."""
    size = 3 << 16
    root = 1 if collective == "broadcast" else 0
    computed = worlds(3).run(("sweep_priced", {"collective": collective, "size_bytes": size, "root": root}))
    model = cost(collective, "builtin", 3, size // 4, 4, root=root, backend="gloo")
    assert computed == [list(model.sent_bytes)] * 3
    assert model.sent_bytes != cost(collective, "builtin", 3, size // 4, 4, root=root).sent_bytes


@pytest.mark.parametrize(
    ("vary", "algorithm"),
    [(v, a) for v in ("size", "op", "local") for a in ("ring", "naive", "rd", "hd", "builtin")]
    + [("segment", "ring"), ("segment", "auto"), ("huge segment", "ring"), ("workspace", "ring")]
    + [("backend", "ring"), ("backend", "builtin"), ("collective", "hd"), ("collective", "auto")],
)
def test_mismatched_calls_raise_on_every_rank(worlds, vary, algorithm):
    results = worlds(3).run(("mismatch", {"count": 10, "op": "sum", "algorithm": algorithm, "vary": vary}))
    if vary == "local":  # the rank with the bad tensor says what is wrong; the others see disagreement
        assert "contiguous" in results[1] and all("ranks disagree" in results[r] for r in (0, 2)), results
    elif vary == "huge segment":  # 2**70 does not fit the int64 the ranks agree with: the others waited
        assert "at most 2**62" in results[1] and all("ranks disagree" in results[r] for r in (0, 2)), results
    elif vary == "workspace":  # a dict in place of a Workspace failed in the algorithm, on that rank alone
        assert "workspace must be" in results[1] and all("ranks disagree" in results[r] for r in (0, 2)), (
            results
        )
    else:
        assert all("ranks disagree" in r for r in results), results
    # in words, not codes ("rank 0 has [10, 0, 0, 2, 0, 0]" named no dtype, op or algorithm)
    if vary == "size":
        first = f"rank 0 has all_reduce, 10 elements of float32, op sum, algorithm {algorithm}, root 0"
        assert first in results[0], results
        assert "rank 1 has all_reduce, 11 elements" in results[0], results
        assert "rank 2 has all_reduce, 12 elements" in results[0], results
    elif vary == "op":
        assert "op sum" in results[0], results
        assert "rank 1 has all_reduce, 10 elements of float32, op max" in results[0], results
    elif vary == "segment":
        assert "segment bytes default" in results[0] and "segment bytes 8" in results[0], results
    elif vary == "local":
        assert "rank 1 has arguments it refused" in results[0], results
    elif vary == "collective":  # each named from its own collective's table (hd: an IndexError before)
        for r in (0, 2):
            assert f"all_reduce, 10 elements of float32, op sum, algorithm {algorithm}," in results[r]
            assert "rank 1 has all_gather, 10 elements of float32, op sum, algorithm builtin," in results[r]
    elif vary == "backend":  # each would have waited in a backend the other never uses
        assert "segment bytes default, backend gloo; rank 1 has" in results[0], results
        assert results[0].endswith("segment bytes default, backend nccl"), results


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [6, 7, 8])
def test_all_reduce_beyond_five_ranks(worlds, world_size):
    """auto picks hd at 8 ranks; 6 and 7 fold two and three ranks into a core of 4."""
    for count in (1021, 300_001):
        case = {"collective": "all_reduce", "count": count, "root": 0}
        assert worlds(world_size).run(("grid", case)) == [[]] * world_size, count


@pytest.mark.parametrize("world_size", [2, 3, 4, FIVE])
@pytest.mark.parametrize("count", [1, 7, 300_001])
def test_in_place_reduce_scatter(worlds, world_size, count):
    assert worlds(world_size).run(("in_place_rs", {"count": count})) == [[]] * world_size


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_gathered_and_scattered_tensors_of_any_shape_with_the_right_sizes(worlds, world_size):
    """The arguments are checked by element counts, so every algorithm takes (2, 3n) beside (6,):
    gloo's own collectives checked the first dimension and refused them, so builtin (and auto on
    one rank, which runs it) raised where the hand-written ones ran."""
    assert worlds(world_size).run(("shapes", {})) == [[]] * world_size


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_inputs_and_outputs_that_share_memory_anywhere(worlds, world_size):
    """An all_gather input that overlaps its own part of the output in part was refused by torch's
    copy on the ranks where it did (the others waited for them until the timeout), and naive sent
    the input after that copy had changed it; gloo's own takes it. A one-rank naive reduce_scatter
    into an output that overlaps its input in part was refused the same way."""
    assert worlds(world_size).run(("aliased", {})) == [[]] * world_size


def test_bad_arguments_raise_clear_errors(worlds):
    expected = {
        "non-contiguous": "contiguous",
        "unknown algorithm": "choose from builtin, naive, ring, rd, hd, auto",
        "tree all_reduce": "unknown algorithm 'tree'",
        "unknown op": "unknown op 'xor'",
        "avg on integers": "floating-point",
        "unsupported dtype": "unsupported dtype",
        "gather output size": "all_gather: output must have world_size x 4",
        "scatter input size": "reduce_scatter: input must have world_size x 4",
        "scatter one tensor twice": "reduce_scatter: input must have world_size x 4 = 8 elements, got 4",
        "dtype mismatch": "share dtype",
        "root out of range": "src must be a rank",
        "root a float": "src must be an integer rank, got float 0.0",
        "root a bool": "dst must be an integer rank, got True",
        "not a tensor": "must be a torch.Tensor",
        "sparse": "ValueError: tensor must be a dense tensor, got torch.sparse_coo (call .to_dense() first)",
        "op a list": "ValueError: unknown op ['sum']; choose from sum",
        "segment on naive": "segment_bytes applies to ring (or auto where it picks one), not 'naive'",
        "segment on a typo": "unknown algorithm 'rign' for all_reduce; choose from",
        "segment of 0": "segment_bytes must be a positive integer, got 0",
        "segment a float": "segment_bytes must be a positive integer, got 8.0",
        "meta": "ValueError: a meta tensor holds no data to move; give a cpu or cuda tensor",
    }
    results = worlds(2).run(("validation", {}))
    for rank_result in results:
        for name, needle in expected.items():
            assert needle in rank_result[name], (name, rank_result[name])
    assert [r["meta on rank 0"] for r in results] == [
        "ValueError: a meta tensor holds no data to move; give a cpu or cuda tensor",
        "ValueError: ranks disagree: rank 0 has arguments it refused; rank 1 has all_reduce, 4 elements of "
        "float32, op sum, algorithm auto, root 0, segment bytes default, backend gloo",
    ]


def test_numpy_segment_sizes_and_ranks_outside_the_group(worlds):
    results = worlds(2).run(("membership", {}))
    assert [r["numpy segment"] for r in results] == ["right", "right"], results
    assert results[0]["outside"] == "no error"  # the group's one member
    assert results[1]["outside"] == "ValueError: this rank is not a member of the group it was given"


def test_two_threads_on_one_group_are_refused_not_cross_matched(tmp_path, monkeypatch):
    """Every message of a group shares one tag on one connection, so two threads' collectives on
    one group were cross-matched (gloo aborted the process on a size mismatch); the second call
    is refused, and a thread with a group of its own goes ahead."""
    import threading

    from commbench import comm

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        entered, leave = threading.Event(), threading.Event()
        ring_all_reduce = comm._IMPLS["all_reduce"]["ring"]

        def slow(*args, **kwargs):
            entered.set()
            leave.wait(30)
            ring_all_reduce(*args, **kwargs)

        monkeypatch.setitem(comm._IMPLS["all_reduce"], "ring", slow)
        first = threading.Thread(target=comm.all_reduce, args=(torch.ones(4), "sum", "ring"))
        first.start()
        try:
            assert entered.wait(30)
            with pytest.raises(RuntimeError, match="another thread is running a collective on this group"):
                comm.all_reduce(torch.ones(4), "sum", "ring")
            own = dist.new_group([0])
            t = torch.ones(4)
            comm.all_reduce(t, "sum", "builtin", group=own)
        finally:
            leave.set()
            first.join(30)
        comm.all_reduce(torch.ones(4), "sum", "ring")  # released once the first call ended
        assert comm._RUNNING == {}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_two_gloo_ranks_use_one_connection_per_direction(worlds, world_size):
    results = worlds(world_size).run(("routes", {}))
    assert all(r["sum_ok"] for r in results)
    assert all(r["upward_is_group"] for r in results)
    # two ranks: rank 1 -> rank 0 goes through the companion; three or more: one group
    assert [r["downward_is_group"] for r in results] == [world_size > 2] * world_size
    if world_size == 2:
        assert all(r["sends_on_my_route"] for r in results)
    assert [r["exchange_calls"] for r in results] == [0] * world_size
    assert all(r["empty_moves_nothing"] for r in results)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_rank_ends_with_the_same_bits_for_max_and_min_of_signed_zeros(worlds, world_size):
    """Recursive doubling reduced each partner's own data first: for max and min of -0.0 and
    +0.0 the two partners then ended with different zeros (at 64 elements, not at 1)."""
    results = worlds(world_size).run(("signed_zeros", {}))
    for key in results[0]:
        assert len({r[key] for r in results}) == 1, (key, [r[key] for r in results])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_max_and_min_give_nan_wherever_any_rank_holds_one(worlds, world_size):
    assert worlds(world_size).run(("nans", {})) == [[]] * world_size


def test_two_rank_subgroups_leave_later_groups_creatable(worlds):
    """Also, on the group of ranks 1 and 2: the backend's rooted calls and the batched sends NCCL
    takes (forced here on gloo) address its ranks by their global numbers."""
    results = worlds(3).run(("subgroups_of_two", {}))
    high = ("high", "high_one_connection", "high_builtin_broadcast", "high_builtin_reduce", "high_batched")
    assert results == [
        {"low": True, "low_one_connection": True, "everyone": True},
        {"low": True, "low_one_connection": True, **dict.fromkeys(high, True), "everyone": True},
        {**dict.fromkeys(high, True), "everyone": True},
    ]


@pytest.mark.parametrize("backend", ["undefined", "cpu:gloo"], ids=["torch-default", "per-device"])
def test_a_group_with_a_backend_per_device_or_none_is_taken_for_what_moves_each_tensor(worlds, backend):
    """A group made without a backend (torch's default) or with one per device is named
    "undefined" or "cpu:gloo"; commbench compared that name with "gloo" and "nccl", so two such
    ranks kept one connection for both directions (and on a GPU, CUDA tensors went to NCCL
    without the batching its send/recv pairs need)."""
    results = worlds(2).run(("per_device_group", {"backend": backend}))
    refusal = "the process group has no backend for meta tensors (it has cpu:gloo)"
    expected = {"name": backend, "host": "gloo", "one_connection": False, "failures": [], "refused": refusal}
    assert results == [expected, expected]


def test_threads_first_calls_on_groups_of_their_own_keep_each_groups_connections(worlds):
    results = worlds(2).run(("threads_first_calls", {}))
    assert results == [{"sums": [[2.0], [200.0]], "two_connections": [True, True]}] * 2


PEER = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
from commbench import comm
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False, timeout=timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=timedelta(seconds=20))
tensor = torch.ones(1000)
comm.all_reduce(tensor, algorithm="ring")
dist.destroy_process_group()
sys.exit(0 if bool((tensor == 2).all()) else 3)
"""


def test_a_process_in_its_second_world_pairs_with_a_fresh_peer_and_the_first_is_shut():
    """This process is rank 0 of two 2-rank worlds in turn, each with a new peer (as the benchmark
    suite's pytest process is). The companions were keyed by how many this process had made, so
    the second world's two ranks waited under different keys until the timeout. And one of a
    group still held after destroy_process_group kept its connection open."""
    import subprocess
    from datetime import timedelta

    from commbench import comm
    from commbench.comm import p2p

    held = []
    # Both stores listen from the start (on ports of their own choosing, so none can be taken in
    # between), and both peers start now, so that their imports overlap.
    stores = [
        dist.TCPStore(
            "127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False
        )
        for _ in range(2)
    ]
    peers = []
    try:
        peers += [subprocess.Popen([sys.executable, "-c", PEER, str(store.port)]) for store in stores]
        for store in stores:
            dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=timedelta(seconds=20))
            try:
                tensor = torch.ones(1000)
                comm.all_reduce(tensor, algorithm="ring")
                assert bool((tensor == 2).all())
                held.append(dist.group.WORLD)
                assert p2p._companion(None) is not None
            finally:
                dist.destroy_process_group()
        assert [peer.wait(60) for peer in peers] == [0, 0]
    finally:
        for peer in peers:
            if peer.poll() is None:
                peer.kill()
                peer.wait()
    p2p._close_destroyed()  # as the next hand-written call does
    assert [p2p._COMPANIONS.get(g) for g in held] == [None, None]


def test_duplex_can_be_turned_off_for_comparison(worlds):
    assert worlds(2).run(("routes_off", {})) == [True, True]


def test_no_local_connection_of_a_rank_paces(worlds):
    # where the kernel's default paces (BBR on the CI-class VM) the launch had all of them to switch
    world = worlds(3)
    for rank_result in world.run(("congestion", {"store_port": world.store.port})):
        assert rank_result["after_launch"], "a rank of three has connections to its peers"
        assert not any(tcp.paces(name) for name in rank_result["after_launch"]), rank_result
        assert set(rank_result["notsent_after_launch"]) == {tcp.NOTSENT_AUTO_BYTES}, rank_result


def test_a_new_groups_paced_connections_are_switched_before_its_first_collective(worlds):
    if "bbr" not in tcp.available():
        pytest.skip("this kernel has no BBR to start the connections from")
    world = worlds(3)
    for rank_result in world.run(("congestion", {"force": "bbr", "store_port": world.store.port})):
        assert set(rank_result["forced"]) == {"bbr"}, rank_result
        assert rank_result["sum_ok"]
        assert set(rank_result["after_first_call"]) == {tcp.UNPACED}, rank_result


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_destroyed_group_is_freed_not_kept_until_the_exit(worlds, world_size):
    for rank_result in worlds(world_size).run(("freed", {})):
        assert rank_result["sum_ok"], rank_result
        assert rank_result["alive"] == [False] * (1 + (world_size == 2)), rank_result


@pytest.mark.parametrize("world_size", [2, 3])
def test_kept_schedules_serve_only_their_own_tensors(worlds, world_size):
    assert worlds(world_size).run(("plan_reuse", {})) == [[]] * world_size


def test_a_sweep_frees_each_sizes_buffers_before_making_the_next(worlds):
    """Schedules kept from one size held its tensors through the next sizes: at 1 GiB a rank
    held the 512, 256 and 128 MiB ring buffers too."""
    alive = worlds(2).run(("sweep_freed", {"algorithms": ["builtin", "ring", "auto", "rd", "naive"]}))
    assert alive == [[0, 0, 0, 0]] * 2


@pytest.mark.parametrize(
    "world_size, backend",
    [(2, "gloo"), *(pytest.param(n, "gloo", marks=pytest.mark.slow) for n in (3, 4)), (3, "nccl")],
    ids=str,
)
def test_scratch_memory_is_what_the_cost_model_says(worlds, world_size, backend):
    """Per rank and byte for byte, for every collective and algorithm; 3,000,001 elements take
    several ring segments and leave a tail for ring reduce's tree. "nccl": the ring posts no
    receive ahead, as on NCCL, and holds a slot per segment of a chunk (the GPU memory check took
    gloo's look-ahead for it, a quarter of the slots at 4 segments)."""
    from commbench.comm.costmodel import scratch_bytes

    root = 1
    case = {"counts": [1000, 3_000_001], "root": root, "nccl_receives": backend == "nccl"}
    per_rank = worlds(world_size).run(("scratch", case))
    assert per_rank[0].keys() == per_rank[-1].keys() and len(per_rank[0]) == 2 * sum(
        map(len, ALGORITHMS.values())
    )
    for key in per_rank[0]:
        collective, algorithm, count = key.split("/")
        model = scratch_bytes(collective, algorithm, world_size, int(count), 4, root=root, backend=backend)
        assert tuple(held[key] for held in per_rank) == model, key


@pytest.mark.parametrize("world_size", [1, 3])
def test_the_in_place_forms_are_right_and_hold_the_scratch_the_cost_model_says(worlds, world_size):
    """``sweep --in-place``: reduce_scatter's output its rank's chunk of the input (the ring then
    keeps the result aside until the end), all_gather's input its part of the output, for every
    algorithm; at 3 ranks the ring's out-of-place spare chunk is held too, and at 1 rank, where
    the output is the whole input, nothing (the ring held a message's copy there)."""
    from commbench.comm.costmodel import scratch_bytes

    case = {"counts": [1000, 300_001], "root": world_size - 1, "in_place": True}
    per_rank = worlds(world_size).run(("scratch", case))
    rings = [held for key, held in per_rank[0].items() if key.startswith("reduce_scatter/ring/")]
    assert rings and all((held > 0) == (world_size > 1) for held in rings)
    for key in per_rank[0]:
        collective, algorithm, count = key.split("/")
        model = scratch_bytes(
            collective, algorithm, world_size, int(count), 4, root=world_size - 1, in_place=True
        )
        assert tuple(held[key] for held in per_rank) == model, key


def test_hand_written_calls_on_gloo_with_cuda_tensors_run_on_host_copies(monkeypatch):
    """No CUDA needed: the choice is made from the device's type, the backend and the size alone."""
    monkeypatch.delenv("COMMBENCH_GLOO_CUDA_HOST_FROM", raising=False)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert STAGE_WHOLE_FROM_BYTES == 0  # every size (docs/PERFORMANCE.md, "Threads per rank on a GPU host")
    assert staged_whole(cuda, "ring", "gloo", 0) and staged_whole(cuda, "naive", "gloo", 64 << 20)
    assert not staged_whole(cuda, "builtin", "gloo", 64 << 20)  # gloo stages its own
    assert not staged_whole(cuda, "ring", "nccl", 64 << 20)
    assert not staged_whole(cpu, "ring", "gloo", 64 << 20)


def test_the_environment_moves_where_host_copies_start(monkeypatch):
    from commbench.comm import HOST_FROM_ENV, NEVER, stage_whole_from

    assert stage_whole_from({}) == stage_whole_from({HOST_FROM_ENV: " auto "}) == STAGE_WHOLE_FROM_BYTES
    assert stage_whole_from({HOST_FROM_ENV: "0"}) == 0
    assert stage_whole_from({HOST_FROM_ENV: "16M"}) == 16 << 20
    assert stage_whole_from({HOST_FROM_ENV: NEVER}) is None
    for bad in ("-1", "16X", "yes", "1.5M"):
        with pytest.raises(ValueError, match=rf"^\${HOST_FROM_ENV}='{bad}' is not auto, never or a size"):
            stage_whole_from({HOST_FROM_ENV: bad})
    cuda, big = torch.device("cuda", 0), 64 << 20
    monkeypatch.setenv(HOST_FROM_ENV, "0")
    assert staged_whole(cuda, "ring", "gloo", 0) and staged_whole(cuda, "naive", "gloo", 4)
    assert not staged_whole(cuda, "builtin", "gloo", big)
    assert not staged_whole(torch.device("cpu"), "ring", "gloo", big)
    monkeypatch.setenv(HOST_FROM_ENV, "1M")
    assert staged_whole(cuda, "ring", "gloo", 1 << 20)
    assert not staged_whole(cuda, "ring", "gloo", (1 << 20) - 1)
    monkeypatch.setenv(HOST_FROM_ENV, NEVER)
    assert not staged_whole(cuda, "ring", "gloo", 1 << 40)
    monkeypatch.setenv(HOST_FROM_ENV, "sometimes")
    with pytest.raises(ValueError, match="HOST_FROM='sometimes'"):
        staged_whole(cuda, "ring", "gloo", big)


def test_the_environment_turns_the_second_gloo_connection_off_and_nothing_else():
    assert p2p.duplex_setting({}) is p2p.duplex_setting({p2p.DUPLEX_ENV: " 1 "}) is True
    assert p2p.duplex_setting({p2p.DUPLEX_ENV: "0"}) is False
    for bad in ("off", "false", "no", "2"):  # each was taken for 1 without a word
        with pytest.raises(ValueError, match=rf"^\${p2p.DUPLEX_ENV}='{bad}' is not 0 .* or 1 "):
            p2p.duplex_setting({p2p.DUPLEX_ENV: bad})


@pytest.mark.parametrize(
    ("name", "config"),
    [("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"), ("undefined", "cpu:gloo,cuda:nccl")],
    ids=["per-device", "torch-default"],
)
def test_a_group_with_nccl_for_cuda_tensors_batches_those_and_leaves_host_tensors_to_gloo(
    monkeypatch, name, config
):
    """What a GPU host's torch makes of init_process_group() without a backend, decided without
    CUDA: CUDA tensors take NCCL's paths (batched send/recv pairs, no receives posted ahead, its
    own average, no host copies), host tensors gloo's, and the ranks agree in host memory."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: name)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    cuda, host, meta = torch.device("cuda", 0), torch.device("cpu"), torch.device("meta")
    assert [p2p.backend_for(None, d) for d in (host, cuda, meta)] == ["gloo", "nccl", ""]
    assert p2p._needs_batching(None, cuda) and not p2p._needs_batching(None, host)
    assert pipeline.receives_ahead(None, 1 << 20, cuda) == 0 < pipeline.receives_ahead(None, 1 << 20, host)
    assert builtin._native_avg(None, cuda) and not builtin._native_avg(None, host)
    assert not staged_whole(cuda, "ring", p2p.backend_for(None, cuda), 64 << 20)
    assert p2p.moves_host_tensors(None)


def test_a_group_of_one_backend_gives_its_name_for_every_device(monkeypatch):
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: pytest.fail("read the config"))
    cuda, host = torch.device("cuda", 0), torch.device("cpu")
    for name in ("gloo", "nccl"):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, name=name: name)
        assert p2p.backend_for(None, host) == p2p.backend_for(None, cuda) == name
        assert p2p.moves_host_tensors(None) == (name == "gloo")
