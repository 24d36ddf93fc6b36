"""What the ranks of a test world run (see tests/world.py). Each case returns plain data."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import socket
import struct
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commbench import comm
from commbench.bench.collectives import SPECS, ready_for_check
from commbench.comm import p2p, ring, tcp
from commbench.comm.ops import DTYPES, OPS
from commbench.comm.workspace import PLANS_KEPT


def _collective(case: dict[str, Any], group: dist.ProcessGroup | None = None) -> list[str]:
    """Run every algorithm of one collective on one input; return what went wrong."""
    rank, world = p2p.group_rank(group)
    spec = SPECS[case["collective"]]
    dtype, op, root = DTYPES[case["dtype"]], case["op"], case["root"] % world
    count = case["count"] * (world if case["collective"] in ("reduce_scatter", "all_gather") else 1)
    workspace = comm.Workspace() if case["workspace"] else None
    failures: list[str] = []
    reference_output = None
    for algorithm in comm.ALGORITHMS[case["collective"]]:
        b = spec.make(count, dtype, torch.device("cpu"), rank, world, op, root)
        for attempt in range(2 if workspace is not None else 1):  # a reused workspace must not leak
            ready_for_check(b)  # an output the algorithm leaves unwritten cannot look right
            ptr = b.output.data_ptr()
            spec.run(b, algorithm, op, root, group, workspace)
            where = f"{algorithm} (run {attempt + 1}) on rank {rank}"
            wrong = spec.wrong(b, op, rank, world, root)
            if wrong:
                failures.append(
                    f"{where}: {wrong} of {b.output.numel()} elements differ from the closed form"
                )
            if b.output.data_ptr() != ptr:
                failures.append(f"{where}: output storage was replaced")
            hand_written = algorithm != "builtin"
            only_root = case["collective"] == "reduce" and rank != root
            if algorithm == "builtin":
                reference_output = b.output.clone()
            elif not only_root and not torch.equal(b.output, reference_output):
                failures.append(f"{where}: result differs from builtin")
            if (
                hand_written
                and case["collective"] == "reduce_scatter"
                and not torch.equal(b.input, b.reference)
            ):
                failures.append(f"{where}: input was modified")
            if hand_written and only_root and not torch.equal(b.input, b.reference):
                failures.append(f"{where}: tensor of non-destination rank was modified")
    return failures


def _grid(case: dict[str, Any]) -> list[str]:
    """Every dtype and every op it allows, every algorithm of one collective, one odd count."""
    failures = []
    ops = OPS if SPECS[case["collective"]].needs_op else ("sum",)
    for i, (dtype, op) in enumerate((d, o) for d in DTYPES for o in ops):
        if op == "avg" and not DTYPES[dtype].is_floating_point:
            continue
        one = {**case, "dtype": dtype, "op": op, "workspace": i % 2 == 0}
        failures += [f"{dtype} {op}: {f}" for f in _collective(one)]
    return failures


def _ring_call(name: str, b: Any, op: str, root: int, segment_bytes: int, workspace: Any) -> None:
    """One ring collective on the buffers ``b`` with pipeline segments of ``segment_bytes``."""
    kw = {"segment_bytes": segment_bytes, "workspace": workspace}
    if name == "all_reduce":
        ring.all_reduce(b.input, op, None, **kw)
    elif name == "reduce_scatter":
        ring.reduce_scatter(b.output, b.input, op, None, **kw)
    elif name == "all_gather":
        ring.all_gather(b.output, b.input, None, **kw)
    elif name == "broadcast":
        ring.broadcast(b.input, root, None, **kw)
    else:
        ring.reduce(b.input, root, op, None, **kw)


def _segmented(case: dict[str, Any]) -> list[str]:
    """The ring collectives cut into many pipeline segments (a few elements each), twice with one
    Workspace, against the closed form."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root = world - 1
    workspace = comm.Workspace()
    failures = []
    for name in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"):
        spec = SPECS[name]
        count = case["count"] * (world if name in ("reduce_scatter", "all_gather") else 1)
        for dtype, op in (("float32", "sum"), ("float64", "avg"), ("int32", "max"), ("int64", "prod")):
            op = op if spec.needs_op else "sum"
            b = spec.make(count, DTYPES[dtype], torch.device("cpu"), rank, world, op, root)
            for attempt in range(2):
                ready_for_check(b)
                _ring_call(name, b, op, root, case["segment_bytes"], workspace)
                wrong = spec.wrong(b, op, rank, world, root)
                if wrong:
                    failures.append(
                        f"{name} {dtype} {op} (run {attempt + 1}) on rank {rank}: {wrong} of "
                        f"{b.output.numel()} elements wrong"
                    )
    return failures


def _bytes(case: dict[str, Any]) -> tuple[int, int]:
    """Bytes this rank sent and received through commbench.comm.p2p for one call."""
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = SPECS[case["collective"]]
    count = case["count"] * (world if case["collective"] in ("reduce_scatter", "all_gather") else 1)
    b = spec.make(count, torch.float32, torch.device("cpu"), rank, world, "sum", case["root"])
    b.input.copy_(b.reference)
    counted = [0, 0]
    with _counting_messages(lambda tensor: tensor.numel() * tensor.element_size(), counted):
        spec.run(b, case["algorithm"], "sum", case["root"], None, None)
    return counted[0], counted[1]


def _tcp_bytes() -> tuple[int, int]:
    """Payload bytes this process has sent (less retransmissions) and received over its TCP
    connections within the host, from the kernel's own count (TCP_INFO)."""
    sent = received = 0
    for sock in tcp.local_connections():
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        if len(info) < 216:
            raise RuntimeError("this kernel's TCP_INFO has no tcpi_bytes_sent (Linux 4.19 and later)")
        # struct tcp_info: tcpi_bytes_received at 128, tcpi_bytes_sent and _retrans at 200 and 208
        received += struct.unpack_from("Q", info, 128)[0]
        bytes_sent, retrans = struct.unpack_from("QQ", info, 200)
        sent += bytes_sent - retrans
    return sent, received


def _wire_bytes(case: dict[str, Any]) -> tuple[int, int]:
    """Bytes this rank's TCP connections sent and received during one call of ``case["algorithm"]``
    (builtin: what the backend's own collective puts on the wire, headers included), between two
    barriers whose few bytes count too."""
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = SPECS[case["collective"]]
    count = case["count"] * (world if case["collective"] in ("reduce_scatter", "all_gather") else 1)
    b = spec.make(count, torch.float32, torch.device("cpu"), rank, world, "sum", case["root"])
    b.input.copy_(b.reference)
    dist.barrier()
    sent0, received0 = _tcp_bytes()
    spec.run(b, case["algorithm"], "sum", case["root"], None, None)
    dist.barrier()  # every rank's call has ended: what it sent has arrived
    sent1, received1 = _tcp_bytes()
    if spec.wrong(b, "sum", rank, world, case["root"]):
        raise AssertionError(f"{case['collective']}/{case['algorithm']} went wrong on rank {rank}")
    return sent1 - sent0, received1 - received0


def _sweep_arithmetic(case: dict[str, Any]) -> list[dict[str, Any]]:
    """One size of an all_reduce sweep (builtin, naive and the limit) whose calls take set times:
    the k-th timed call of a series takes ``TIMES_US[series][k]`` on every rank, and rank 1's
    check finds 3 wrong elements in naive. Returns each record's fields."""
    from commbench.bench import sweep

    spec, limit_spec = SPECS["all_reduce"], SPECS["sendrecv"]
    ran: list[str] = []
    calls: dict[str, int] = {}
    real_run, real_limit_run, real_wrong = spec.run, limit_spec.run, spec.wrong

    def timed(self: Any, fn: Callable[[], None]) -> float:
        fn()
        k = calls[ran[-1]] = calls.get(ran[-1], -1) + 1
        return case["times_us"][dist.get_rank()][ran[-1]][k] / 1e6

    spec.run = lambda b, algo, *a: ran.append(algo) or real_run(b, algo, *a)
    limit_spec.run = lambda b, algo, *a: ran.append(algo) or real_limit_run(b, algo, *a)
    spec.wrong = lambda b, op, r, *a: 3 if r == 1 and ran[-1] == "naive" else real_wrong(b, op, r, *a)
    real_time, sweep._Timer.time = sweep._Timer.time, timed
    try:
        config = sweep.SweepConfig(
            algorithms=("builtin", "naive"), min_bytes=1024, max_bytes=1024, iters=3, warmup=0, probe=False
        )
        records = sweep.run_rank(config, "cpu", lambda kind, payload: None)
    finally:
        spec.run, limit_spec.run, spec.wrong = real_run, real_limit_run, real_wrong
        sweep._Timer.time = real_time
    return [dataclasses.asdict(r) for r in records]


def _sweep_priced(case: dict[str, Any]) -> list[int]:
    """The bytes a one-size sweep of ``case["collective"]`` records for builtin to send per rank."""
    from commbench.bench import sweep

    config = sweep.SweepConfig(
        collective=case["collective"],
        algorithms=("builtin",),
        min_bytes=case["size_bytes"],
        max_bytes=case["size_bytes"],
        iters=1,
        warmup=0,
        probe=False,
        check=False,
        limit=False,
        root=case["root"],
    )
    (record,) = sweep.run_rank(config, "cpu", lambda kind, payload: None)
    return record.computed_sent_bytes_per_rank


@contextlib.contextmanager
def _counting_messages(measure: Callable[[torch.Tensor], int], counted: list[int]) -> Iterator[None]:
    """Add ``measure(tensor)`` of every message this rank starts sending to ``counted[0]``, and of
    every receive it starts to ``counted[1]``: at the two calls every gloo path ends in."""
    send_on, recv_on = p2p.isend_on, p2p.irecv_on

    def sending(pg: dist.ProcessGroup, tensor: torch.Tensor, peer: int) -> p2p.Work:
        counted[0] += measure(tensor)
        return send_on(pg, tensor, peer)

    def receiving(pg: dist.ProcessGroup, tensor: torch.Tensor, peer: int) -> p2p.Work:
        counted[1] += measure(tensor)
        return recv_on(pg, tensor, peer)

    p2p.isend_on, p2p.irecv_on = sending, receiving
    try:
        yield
    finally:
        p2p.isend_on, p2p.irecv_on = send_on, recv_on


def _segments(case: dict[str, Any]) -> dict[str, Any]:
    """Every collective's ring run as the sweep's series "ring@N" names it, against the closed
    form; and how many messages an all_reduce sends with the default segment and with N bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    series, root = f"ring@{case['segment_bytes']}", world - 1
    failures = []
    for name in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"):
        spec = SPECS[name]
        count = case["count"] * (world if name in ("reduce_scatter", "all_gather") else 1)
        b = spec.make(count, torch.float32, torch.device("cpu"), rank, world, "sum", root)
        b.input.copy_(b.reference)
        spec.run(b, series, "sum", root, None, comm.Workspace())
        if spec.wrong(b, "sum", rank, world, root):
            failures.append(f"{name} {series} on rank {rank}")
    sends = {}
    for s in ("ring", series, "auto", f"auto@{case['segment_bytes']}"):
        counted = [0, 0]
        b = SPECS["all_reduce"].make(case["count"], torch.float32, torch.device("cpu"), rank, world, "sum", 0)
        with _counting_messages(lambda tensor: 1, counted):
            SPECS["all_reduce"].run(b, s, "sum", 0, None, None)
        sends[s] = counted[0]
    big = case.get("ring_by_auto")  # {count, segment_bytes}: a size at which auto runs the ring
    if big:
        for s in ("auto", f"auto@{big['segment_bytes']}", f"ring@{big['segment_bytes']}"):
            counted = [0, 0]
            b = SPECS["all_reduce"].make(
                big["count"], torch.float32, torch.device("cpu"), rank, world, "sum", 0
            )
            b.input.copy_(b.reference)
            with _counting_messages(lambda tensor: 1, counted):
                SPECS["all_reduce"].run(b, s, "sum", 0, None, None)
            if SPECS["all_reduce"].wrong(b, "sum", rank, world, 0):
                failures.append(f"all_reduce {s} of {big['count']} on rank {rank}")
            sends[f"big {s}"] = counted[0]
    return {"failures": failures, "sends": sends}


def _ring_messages(case: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Messages this rank starts sending and receiving in each collective's ring with pipeline
    segments of ``case["segment_bytes"]`` (root: the last rank), keyed by collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root, out = world - 1, {}
    for name in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"):
        spec = SPECS[name]
        count = case["count"] * (world if name in ("reduce_scatter", "all_gather") else 1)
        b = spec.make(count, torch.float32, torch.device("cpu"), rank, world, "sum", root)
        b.input.copy_(b.reference)
        counted = [0, 0]
        with _counting_messages(lambda tensor: 1, counted):
            spec.run(b, f"ring@{case['segment_bytes']}", "sum", root, None, None)
        if spec.wrong(b, "sum", rank, world, root):
            raise AssertionError(f"{name} ring@{case['segment_bytes']} went wrong on rank {rank}")
        out[name] = (counted[0], counted[1])
    return out


def _mismatch(case: dict[str, Any]) -> str:
    """Ranks call all_reduce with different sizes; the error every rank raised."""
    rank = dist.get_rank()
    tensor = torch.ones(case["count"] + (rank if case["vary"] == "size" else 0))
    if case["vary"] == "local" and rank == 1:  # only this rank's own checks can see the problem
        tensor = torch.ones(case["count"], 2).t()[0]
    op = case["op"] if case["vary"] != "op" or rank == 0 else "max"
    segment = {"segment": 8, "huge segment": 1 << 70}.get(case["vary"]) if rank == 1 else None
    workspace = {} if case["vary"] == "workspace" and rank == 1 else None
    backend_code = comm._backend_code
    if case["vary"] == "backend" and rank == 1:
        # a group with a backend per device where this rank's tensor is on the other device: NCCL
        # for a CUDA tensor here (no GPU), gloo for the others' host tensors
        comm._backend_code = lambda group, device: comm._BACKENDS.index("nccl")
    try:
        if case["vary"] == "collective" and rank == 1:  # its algorithm codes are another table's
            comm.all_gather(torch.empty(tensor.numel() * dist.get_world_size()), tensor, "builtin")
        else:
            comm.all_reduce(tensor, op, case["algorithm"], segment_bytes=segment, workspace=workspace)
    except (ValueError, TypeError) as exc:
        return str(exc)
    finally:
        comm._backend_code = backend_code
    return "no error"


def _validation(case: dict[str, Any]) -> dict[str, str]:
    """Bad arguments each raise a clear error before any communication (so nothing hangs)."""
    world = dist.get_world_size()
    calls = {
        "non-contiguous": lambda: comm.all_reduce(torch.ones(4, 4).t(), algorithm="ring"),
        "unknown algorithm": lambda: comm.all_reduce(torch.ones(4), algorithm="butterfly"),
        "tree all_reduce": lambda: comm.all_reduce(torch.ones(4), algorithm="tree"),
        "unknown op": lambda: comm.all_reduce(torch.ones(4), op="xor"),
        "avg on integers": lambda: comm.all_reduce(torch.ones(4, dtype=torch.int32), op="avg"),
        "unsupported dtype": lambda: comm.all_reduce(torch.ones(4, dtype=torch.complex64)),
        "gather output size": lambda: comm.all_gather(torch.empty(4 * world + 1), torch.ones(4)),
        "scatter input size": lambda: comm.reduce_scatter(torch.empty(4), torch.ones(4 * world - 1)),
        "scatter one tensor twice": lambda: comm.reduce_scatter(*[torch.ones(4)] * 2),
        "dtype mismatch": lambda: comm.all_gather(torch.empty(4 * world, dtype=torch.float64), torch.ones(4)),
        "root out of range": lambda: comm.broadcast(torch.ones(4), src=world),
        "root a float": lambda: comm.broadcast(torch.ones(4), src=0.0),
        "root a bool": lambda: comm.reduce(torch.ones(4), dst=True),
        "not a tensor": lambda: comm.all_reduce([1.0, 2.0]),
        "sparse": lambda: comm.all_reduce(torch.ones(4).to_sparse(), algorithm="ring"),
        "op a list": lambda: comm.all_reduce(torch.ones(4), op=["sum"]),
        "segment on naive": lambda: comm.all_reduce(torch.ones(4), algorithm="naive", segment_bytes=1024),
        "segment on a typo": lambda: comm.all_reduce(torch.ones(4), algorithm="rign", segment_bytes=64),
        "segment of 0": lambda: comm.broadcast(torch.ones(4), 0, algorithm="ring", segment_bytes=0),
        "segment a float": lambda: comm.all_gather(torch.empty(4 * world), torch.ones(4), segment_bytes=8.0),
        "meta": lambda: comm.all_reduce(torch.ones(4, device="meta"), algorithm="ring"),
        # rank 0 returned, having moved nothing, and the others waited for it
        "meta on rank 0": lambda: comm.all_reduce(
            torch.ones(4, device="meta" if dist.get_rank() == 0 else "cpu")
        ),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def _membership(case: dict[str, Any]) -> dict[str, str]:
    """A NumPy integer is a segment size as an int is; a rank outside the group it is given is told
    so (torch's "Invalid process group specified" came from deep inside before)."""
    import numpy as np

    world = dist.get_world_size()
    t = torch.ones(100)
    comm.all_reduce(t, algorithm="ring", segment_bytes=np.int64(64))
    out = {"numpy segment": "right" if bool((t == world).all()) else f"wrong: {t[:4].tolist()}"}
    alone = dist.new_group([0])  # every rank takes part in making it
    try:
        comm.all_reduce(torch.ones(4), algorithm="ring", group=alone)
        out["outside"] = "no error"
    except ValueError as exc:
        out["outside"] = f"ValueError: {exc}"
    dist.barrier()
    return out


def _autograd(case: dict[str, Any]) -> dict[str, bool]:
    """Each algorithm on a leaf tensor that requires grad, as the backend's own collective takes it;
    a root given as a 0-dim tensor works as an int."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for algorithm in comm.ALGORITHMS["all_reduce"]:
        tensor = torch.full((1000,), float(rank + 1), requires_grad=True)
        comm.all_reduce(tensor, "sum", algorithm)
        out[f"all_reduce {algorithm}"] = bool(torch.all(tensor == world * (world + 1) / 2))
    for algorithm in comm.ALGORITHMS["broadcast"]:
        tensor = torch.full((10,), float(rank))
        comm.broadcast(tensor, torch.tensor(world - 1), algorithm)
        out[f"broadcast {algorithm}"] = bool(torch.all(tensor == world - 1))
    return out


def _inference(case: dict[str, Any]) -> list[str]:
    """Every algorithm of every collective on tensors made under ``torch.inference_mode`` and passed
    outside it (the backend's own takes them), then with a Workspace first used inside it. The
    hand-written ones wrote into them and failed on some ranks only, whose peers waited.
    ``case["device"]``: "cuda" puts the tensors on this rank's GPU (host memory otherwise)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total = world * (world + 1) // 2
    failures = []
    device = torch.device("cuda", torch.cuda.current_device()) if case.get("device") == "cuda" else None

    def run(collective: str, algorithm: str, workspace: comm.Workspace | None, inference: bool) -> bool:
        with torch.inference_mode(inference):
            mine = torch.full((12 * world,), float(rank + 1), device=device)
            out = torch.zeros(12 * world if collective == "all_gather" else 12, device=device)
        if collective == "all_reduce":
            comm.all_reduce(mine, "sum", algorithm, workspace=workspace)
            return bool(torch.all(mine == total))
        if collective == "reduce_scatter":
            comm.reduce_scatter(out, mine, "sum", algorithm, workspace=workspace)
            return bool(torch.all(out == total))
        if collective == "all_gather":
            comm.all_gather(out, mine[:12], algorithm, workspace=workspace)
            return bool(torch.equal(out.cpu(), torch.arange(1, world + 1).repeat_interleave(12).float()))
        if collective == "broadcast":
            comm.broadcast(mine, world - 1, algorithm, workspace=workspace)
            return bool(torch.all(mine == world))
        comm.reduce(mine, 0, "sum", algorithm, workspace=workspace)
        return rank != 0 or bool(torch.all(mine == total))

    for collective, algorithms in comm.ALGORITHMS.items():
        for algorithm in algorithms:
            if not run(collective, algorithm, None, inference=True):
                failures.append(f"{collective} {algorithm}: inference tensors")
            workspace = comm.Workspace()
            with torch.inference_mode():
                first = run(collective, algorithm, workspace, inference=False)
            if not (first and run(collective, algorithm, workspace, inference=False)):
                failures.append(f"{collective} {algorithm}: a workspace first used in inference mode")
    return failures


def _in_place_reduce_scatter(case: dict[str, Any]) -> list[str]:
    """reduce_scatter with output a view of input chunk r, against the closed form."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m = case["count"]
    failures = []
    for algorithm in comm.ALGORITHMS["reduce_scatter"]:
        if algorithm == "builtin":
            continue
        data = torch.tensor([r * 10 + i % 3 for r in range(world) for i in range(m)], dtype=torch.float64)
        data += rank  # rank-dependent, so the sum over ranks is exact and known
        output = data[rank * m : (rank + 1) * m]
        comm.reduce_scatter(output, data, "sum", algorithm, workspace=comm.Workspace())
        expected = torch.tensor(
            [world * (rank * 10 + i % 3) + sum(range(world)) for i in range(m)], dtype=torch.float64
        )
        if not torch.equal(output, expected):
            failures.append(f"{algorithm} on rank {rank}: {output[:4].tolist()} != {expected[:4].tolist()}")
    return failures


def _shapes(case: dict[str, Any]) -> list[str]:
    """reduce_scatter and all_gather on tensors of other shapes with the right element counts, every
    algorithm (builtin and auto too), against the closed form: rank r's input holds r + 1."""
    rank, world = dist.get_rank(), dist.get_world_size()
    failures = []
    for big, small in (((2, 3 * world), (6,)), ((6 * world,), (2, 3)), ((world, 3, 2), (3, 2))):
        for algorithm in comm.ALGORITHMS["reduce_scatter"]:
            output = torch.zeros(small)
            try:
                comm.reduce_scatter(output, torch.full(big, rank + 1.0), "sum", algorithm)
                wrong = not torch.all(output == world * (world + 1) / 2)
            except RuntimeError as exc:
                wrong = str(exc).splitlines()[0]
            if wrong:
                failures.append(f"reduce_scatter {algorithm} {big} -> {small} on rank {rank}: {wrong}")
        for algorithm in comm.ALGORITHMS["all_gather"]:
            output = torch.zeros(big)
            try:
                comm.all_gather(output, torch.full(small, rank + 1.0), algorithm)
                expected = torch.arange(1, world + 1.0).repeat_interleave(6)
                wrong = not torch.equal(output.view(-1), expected)
            except RuntimeError as exc:
                wrong = str(exc).splitlines()[0]
            if wrong:
                failures.append(f"all_gather {algorithm} {small} -> {big} on rank {rank}: {wrong}")
    return failures


def _aliased(case: dict[str, Any]) -> list[str]:
    """all_gather with its input anywhere in its output, and reduce_scatter with its output anywhere
    in or beside its input, every algorithm, against the closed form: what the backend's own take."""
    rank, world = dist.get_rank(), dist.get_world_size()
    m, failures = 3, []
    gathered = torch.cat([torch.arange(m) + 10.0 * r for r in range(world)])
    for algorithm in comm.ALGORITHMS["all_gather"]:
        for at in range(m * (world - 1) + 1):
            output = torch.full((m * world,), -1.0)
            input = output[at : at + m]
            input.copy_(torch.arange(m) + 10.0 * rank)
            try:
                comm.all_gather(output, input, algorithm)
                wrong = output.tolist() if not torch.equal(output, gathered) else None
            except RuntimeError as exc:
                wrong = str(exc).splitlines()[0]
            if wrong:
                failures.append(f"all_gather {algorithm}, input at {at}, on rank {rank}: {wrong}")
    reduced = (torch.arange(m * world) * world * (world + 1) / 2)[rank * m : (rank + 1) * m]
    for algorithm in comm.ALGORITHMS["reduce_scatter"]:
        for at in range(m * world + 1):
            buffer = torch.zeros(m * world + m)
            input, output = buffer[: m * world], buffer[at : at + m]
            input.copy_(torch.arange(m * world) * (rank + 1.0))
            try:
                comm.reduce_scatter(output, input, "sum", algorithm)
                wrong = output.tolist() if not torch.equal(output, reduced) else None
            except RuntimeError as exc:
                wrong = str(exc).splitlines()[0]
            if wrong:
                failures.append(f"reduce_scatter {algorithm}, output at {at}, on rank {rank}: {wrong}")
    return failures


def _routes(case: dict[str, Any]) -> dict[str, Any]:
    """After one hand-written allreduce: which group carries each direction, and what gloo sends through."""
    tensor = torch.ones(1000)
    comm.all_reduce(tensor, algorithm="ring")
    upward, downward = p2p.route(None, 0, 1), p2p.route(None, 1, 0)
    carried: list[Any] = []
    exchanged = [0]
    original, exchange = p2p.isend_on, p2p.exchange

    def noting(pg, tensor, peer):
        carried.append(pg)
        return original(pg, tensor, peer)

    def routed_per_message(*args: Any) -> tuple[p2p.Work | None, p2p.Work | None]:
        exchanged[0] += 1
        return exchange(*args)

    p2p.isend_on, p2p.exchange = noting, routed_per_message
    try:
        comm.all_reduce(tensor, algorithm="ring")
    finally:
        p2p.isend_on, p2p.exchange = original, exchange
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    mine = p2p.route(None, me, peer) or dist.group.WORLD
    world = dist.get_world_size()
    post_send, post_recv = p2p.link(None, (me + 1) % world, (me - 1) % world, torch.device("cpu"))
    return {
        "sum_ok": bool(torch.all(tensor == world**2)),
        "upward_is_group": upward is None,
        "downward_is_group": downward is None,
        "sends_on_my_route": bool(carried) and all(g is mine for g in carried),
        # the ring's messages are routed once per call (p2p.link), not one by one
        "exchange_calls": exchanged[0],
        "empty_moves_nothing": [post_send(torch.empty(0)), post_send(None), post_recv(torch.empty(0))]
        == [None, None, None],
    }


def _threads_first_calls(case: dict[str, Any]) -> dict[str, Any]:
    """Two threads, each with a group of its own, make the first hand-written call on it, in
    opposite orders on the two ranks (rank 0 starts with the first group, rank 1 with the
    second, and the other thread follows a second later). Each group's second connection was
    made by ``dist.new_group``, which pairs groups in the order they are made: the two ranks'
    first companions were joined, one for each group, and the sums came back mixed."""
    import threading

    rank = dist.get_rank()
    groups = [dist.new_group(timeout=timedelta(seconds=30)) for _ in range(2)]
    values, sums = (1.0, 100.0), {}

    def work(i: int) -> None:
        tensor = torch.full((1000,), values[i])
        comm.all_reduce(tensor, algorithm="ring", group=groups[i])
        sums[i] = sorted(set(tensor.tolist()))

    order = (0, 1) if rank == 0 else (1, 0)
    threads = [threading.Thread(target=work, args=(i,)) for i in order]
    threads[0].start()
    time.sleep(1)
    threads[1].start()
    for t in threads:
        t.join(60)
    return {
        "sums": [sums.get(i) for i in range(2)],
        "two_connections": [p2p.route(g, 1, 0) is not g for g in groups],
    }


def _routes_off(case: dict[str, Any]) -> bool:
    """With $COMMBENCH_GLOO_DUPLEX=0 a fresh group of two keeps one connection for both directions."""
    group = dist.new_group([0, 1])
    saved = os.environ.get(p2p.DUPLEX_ENV)
    os.environ[p2p.DUPLEX_ENV] = "0"
    try:
        tensor = torch.ones(10)
        comm.all_reduce(tensor, algorithm="ring", group=group)
    finally:
        if saved is None:
            del os.environ[p2p.DUPLEX_ENV]
        else:
            os.environ[p2p.DUPLEX_ENV] = saved
    return p2p.route(group, 1, 0) is group and bool(torch.all(tensor == 2))


def _signed_zeros(case: dict[str, Any]) -> dict[str, int]:
    """How many elements come out as -0.0 when rank 0 holds -0.0 and the others +0.0 (max and
    min of the two depend on the order of the operands)."""
    out = {}
    for n in (1, 64):
        for op in ("max", "min"):
            for algorithm in comm.ALGORITHMS["all_reduce"]:
                tensor = torch.full((n,), -0.0 if dist.get_rank() == 0 else 0.0)
                comm.all_reduce(tensor, op, algorithm)
                out[f"{algorithm} {op} {n}"] = int(torch.signbit(tensor).sum())
    return out


def _nans(case: dict[str, Any]) -> list[str]:
    """max and min with NaNs on some ranks: each hand-written algorithm gives NaN at every element
    where any rank holds one, on every rank that gets the result (gloo's own keeps or drops a NaN
    by its rank and place in gloo's ring, so it is not the reference here)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = 3 * (world + 1) + 1  # elements of each rank's share: every pattern, an odd count
    place = torch.arange(world * per_rank)
    nan_at = place % (world + 1) < world  # rank r holds a NaN where place % (world + 1) == r
    failures = []
    for name in ("all_reduce", "reduce", "reduce_scatter"):
        for op, pick in (("max", torch.amax), ("min", torch.amin)):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                values = torch.stack([(place % 97 + 3 * r).to(dtype) for r in range(world)])
                expected = torch.where(nan_at, torch.nan, pick(values, dim=0)).to(dtype)
                mine = torch.where(place % (world + 1) == rank, torch.nan, values[rank]).to(dtype)
                for algorithm in comm.ALGORITHMS[name]:
                    if algorithm == "builtin":
                        continue
                    tensor = mine.clone()
                    if name == "all_reduce":
                        comm.all_reduce(tensor, op, algorithm)
                        got, want = tensor, expected
                    elif name == "reduce":
                        comm.reduce(tensor, world - 1, op, algorithm)
                        got, want = (tensor, expected) if rank == world - 1 else (tensor, mine)
                    else:
                        got = torch.empty(per_rank, dtype=dtype)
                        comm.reduce_scatter(got, tensor, op, algorithm)
                        want = expected[rank * per_rank : (rank + 1) * per_rank]
                    if not torch.equal(got.isnan(), want.isnan()) or not torch.equal(
                        got.nan_to_num(), want.nan_to_num()
                    ):
                        failures.append(f"{name} {algorithm} {op} {dtype} on rank {rank}")
    return failures


def _subgroups_of_two(case: dict[str, Any]) -> dict[str, Any]:
    """Hand-written calls on two overlapping 2-rank subgroups of three ranks, then a group of all
    three made and used: groups made by some ranks only would leave torch's count of groups
    different between ranks, and the last group's creation would wait until its timeout."""
    timeout = timedelta(seconds=20)
    rank = dist.get_rank()
    low, high = dist.new_group([0, 1], timeout=timeout), dist.new_group([1, 2], timeout=timeout)
    out: dict[str, Any] = {}
    for name, group, members in (("low", low, (0, 1)), ("high", high, (1, 2))):
        if rank in members:
            tensor = torch.full((1000,), float(rank + 1))
            comm.all_reduce(tensor, algorithm="ring", group=group)
            out[name] = bool(torch.all(tensor == sum(m + 1 for m in members)))
            out[f"{name}_one_connection"] = p2p.route(group, 1, 0) is group
    if rank in (1, 2):
        # Roots and peers are the group's ranks, which the backend's calls and batched sends take
        # as global ranks: group rank 0 of [1, 2] is global rank 1.
        tensor = torch.full((1000,), float(rank))
        comm.broadcast(tensor, 0, algorithm="builtin", group=high)
        out["high_builtin_broadcast"] = bool(torch.all(tensor == 1))
        tensor = torch.full((1000,), float(rank))
        comm.reduce(tensor, 0, algorithm="builtin", group=high)
        out["high_builtin_reduce"] = rank != 1 or bool(torch.all(tensor == 3))
        real, p2p._needs_batching = p2p._needs_batching, lambda g, d: True  # as NCCL's sends go
        try:
            tensor = torch.full((1000,), float(rank))
            comm.all_reduce(tensor, algorithm="ring", group=high)
            out["high_batched"] = bool(torch.all(tensor == 3))
        finally:
            p2p._needs_batching = real
    everyone = dist.new_group([0, 1, 2], timeout=timeout)
    tensor = torch.ones(10)
    comm.all_reduce(tensor, algorithm="ring", group=everyone)
    out["everyone"] = bool(torch.all(tensor == 3))
    return out


def _per_device_group(case: dict[str, Any]) -> dict[str, Any]:
    """Every collective on a group made with a backend per device ("cpu:gloo") or with none
    (torch's default, named "undefined"): what commbench takes it for, and what went wrong."""
    group = dist.new_group(backend=case["backend"], timeout=timedelta(seconds=30))
    failures = []
    for collective in sorted(comm.ALGORITHMS):
        body = {"collective": collective, "count": 1021, "dtype": "float32", "op": "avg", "root": 1}
        failures += _collective({**body, "workspace": False}, group)
    try:
        comm.all_reduce(torch.empty(8, device="meta"), group=group)
        refused = "nothing"
    except ValueError as exc:
        refused = str(exc)
    return {
        "name": str(dist.get_backend(group)),
        "host": p2p.backend_for(group, torch.device("cpu")),
        "one_connection": p2p.route(group, 1, 0) is group,
        "failures": failures,
        "refused": refused,
    }


def _local_ccs(skip_port: int | None = None) -> list[str]:
    """The congestion control of each of this rank's TCP connections within the host, but for
    those to port ``skip_port`` (the test's own store, connected after the launch)."""
    return [tcp.congestion_control(s) for s in tcp.local_connections() if s.getpeername()[1] != skip_port]


def _congestion(case: dict[str, Any]) -> dict[str, Any]:
    """Local connections after the launch (congestion control, and limit on unsent bytes); then,
    with ``force``, every one set to ``force`` by hand before a fresh group's first collective,
    and after it."""
    result: dict[str, Any] = {
        "after_launch": _local_ccs(case["store_port"]),
        "notsent_after_launch": [
            tcp.notsent_lowat(s) for s in tcp.local_connections() if s.getpeername()[1] != case["store_port"]
        ],
    }
    if case.get("force"):
        group = dist.new_group()
        for sock in tcp.local_connections():
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, case["force"].encode())
        result["forced"] = _local_ccs()
        tensor = torch.ones(10)
        comm.all_reduce(tensor, algorithm="ring", group=group)
        result["sum_ok"] = bool(torch.all(tensor == dist.get_world_size()))
        result["after_first_call"] = _local_ccs()
    return result


def _freed(case: dict[str, Any]) -> dict[str, Any]:
    """A group the hand-written algorithms used (prepared, with a companion at two ranks) is freed
    once destroyed: commbench's tables must not keep it, or its gloo threads, until the exit."""
    group = dist.new_group()
    tensor = torch.ones(10)
    comm.all_reduce(tensor, algorithm="ring", group=group)
    companion = p2p._companion(group)
    refs = [weakref.ref(g) for g in [group] + ([companion] if companion is not None else [])]
    dist.destroy_process_group(group)  # the companion is no group of torch's: it goes with it
    del group, companion
    gc.collect()
    return {
        "sum_ok": bool(torch.all(tensor == dist.get_world_size())),
        "alive": [r() is not None for r in refs],
    }


def _plan_reuse(case: dict[str, Any]) -> list[str]:
    """One Workspace, many tensors: a kept schedule must never serve another tensor's call."""
    rank, world = dist.get_rank(), dist.get_world_size()
    workspace = comm.Workspace()
    failures = []
    kept = []
    for i in range(3 * PLANS_KEPT):
        count = (1000, 1000, 1001)[i % 3]  # the size of the call before, then a new size
        mine = float(rank + i)
        total = float(sum(range(world)) + world * i)
        tensor = torch.full((count,), mine)
        if i % 2:
            kept.append(tensor)  # stays alive: later tensors get addresses of their own
        comm.all_reduce(tensor, algorithm="ring", workspace=workspace)
        scattered = torch.empty(count // world)
        comm.reduce_scatter(
            scattered, torch.full((scattered.numel() * world,), mine), algorithm="ring", workspace=workspace
        )
        gathered = torch.empty(count * world)
        comm.all_gather(gathered, torch.full((count,), mine), algorithm="ring", workspace=workspace)
        everyone = torch.cat([torch.full((count,), float(r + i)) for r in range(world)])
        for name, ok in (
            ("all_reduce", bool(torch.all(tensor == total))),
            ("reduce_scatter", bool(torch.all(scattered == total))),
            ("all_gather", torch.equal(gathered, everyone)),
        ):
            if not ok:
                failures.append(f"call {i} ({name}, {count} elements) on rank {rank}")
    # One input scattered into two outputs in turn: the second's schedule is not the first's,
    # which would write into the first output again.
    data = torch.full((world * 500,), float(rank + 1))
    outputs = [torch.full((500,), float("nan")) for _ in range(2)]
    for out in outputs:
        comm.reduce_scatter(out, data, algorithm="ring", workspace=workspace)
    if not all(bool(torch.all(out == world * (world + 1) / 2)) for out in outputs):
        failures.append(f"reduce_scatter of one input into a second output on rank {rank}")
    # One output gathered in one segment, then in many: a schedule is kept per segment count.
    gathered, mine = torch.empty(world * 500), torch.full((500,), float(rank))
    everyone = torch.cat([torch.full((500,), float(r)) for r in range(world)])
    real_run, seen = ring._run, []
    ring._run = lambda units, r, w, nseg, *a: (
        seen.append(len(units) == (w - 1) * nseg) or real_run(units, r, w, nseg, *a)
    )
    try:
        for segment in (1 << 20, 64):
            gathered.fill_(float("nan"))
            comm.all_gather(gathered, mine, algorithm="ring", workspace=workspace, segment_bytes=segment)
            if not torch.equal(gathered, everyone):
                failures.append(f"all_gather in segments of {segment} B on rank {rank}")
    finally:
        ring._run = real_run
    if seen != [True, True]:
        failures.append(f"all_gather's schedules by segment count on rank {rank}: {seen}")
    return failures


def _sweep_sizes_freed(case: dict[str, Any]) -> list[int]:
    """A sweep holds one size's memory at a time: when it makes a size's buffers, how many
    storages of the sizes before it are still alive (kept schedules view their tensors)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from commbench.bench import sweep

    specs = (SPECS["all_reduce"], SPECS["sendrecv"])  # the algorithms' and the limit's
    made: list[tuple[int, StorageWeakRef]] = []  # (element count, storage) of every buffer made
    alive_at_make: dict[int, int] = {}

    def wrap(real: Any) -> Any:
        def make(count: int, *args: Any) -> Any:
            gc.collect()
            earlier = sum(not ref.expired() for c, ref in made if c != count)
            alive_at_make[count] = max(alive_at_make.get(count, 0), earlier)
            b = real(count, *args)
            made.extend(
                (count, StorageWeakRef(t.untyped_storage())) for t in (b.input, b.output, b.reference)
            )
            return b

        return make

    for spec in specs:
        spec.make = wrap(spec.make)  # an instance attribute, removed below
    try:
        config = sweep.SweepConfig(
            algorithms=tuple(case["algorithms"]),
            min_bytes=1 << 16,
            max_bytes=1 << 19,
            iters=1,
            warmup=1,
            probe=False,
        )
        sweep.run_rank(config, "cpu", lambda kind, payload: None)
    finally:
        for spec in specs:
            del spec.make
    return [alive_at_make[c] for c in sorted(alive_at_make)]


def _scratch(case: dict[str, Any]) -> dict[str, int]:
    """Bytes a fresh Workspace holds after one call of each collective and algorithm, called as
    the sweep calls them (with ``in_place``, as ``sweep --in-place`` does); keyed
    "collective/algorithm/count". With ``nccl_receives`` the ring posts no receive ahead, as on NCCL
    (for this call alone: the world's processes serve later tests, which took NCCL's count)."""
    from commbench.comm import pipeline

    ahead = pipeline.receives_ahead
    if case.get("nccl_receives"):
        pipeline.receives_ahead = lambda group, segment_bytes, device: 0
    try:
        return _scratch_held(case)
    finally:
        pipeline.receives_ahead = ahead


def _scratch_held(case: dict[str, Any]) -> dict[str, int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    held = {}
    for name, algorithms in comm.ALGORITHMS.items():
        spec = SPECS[name]
        for count in case["counts"]:
            count = spec.count(count * 4, 4, world)
            for algorithm in algorithms:
                workspace = comm.Workspace()
                b = spec.make_for(
                    count,
                    torch.float32,
                    torch.device("cpu"),
                    rank,
                    world,
                    "sum",
                    case["root"],
                    case.get("in_place", False),
                )
                ready_for_check(b)  # as the sweep's check does: an output left unwritten shows
                spec.run(b, algorithm, "sum", case["root"], None, workspace)
                if spec.wrong(b, "sum", rank, world, case["root"]):
                    raise AssertionError(f"{name}/{algorithm} at {count} went wrong")
                held[f"{name}/{algorithm}/{count}"] = sum(
                    t.numel() * t.element_size() for t in workspace._buffers.values()
                )
    return held


def _wire_faults(case: dict[str, Any]) -> str | None:
    """One counted pass on every rank, each rank its own host, with rank ``case["rank"]``'s reading
    broken by ``case["fault"]``: "reset" (its counters back to zero when the pass closes),
    "impossible" (10 GB more than was sent, on a 1 Gbit/s link) or "idle_reset" (back to zero at
    the end of the first idle interval only). Returns this rank's ``wire_check``."""
    import dataclasses
    import itertools

    from commbench.probes import host, wirecount

    rank, world = dist.get_rank(), dist.get_world_size()
    counter = wirecount.WireCounter(torch.device("cpu"))
    counter.hosts = [[r] for r in range(world)]
    counter.info = [(f"veth{r}", f"198.18.0.{r + 1}") for r in range(world)]  # hosts of their own
    faulty = rank == case["rank"]
    counter.link_gbps = 0.125 if faulty else None  # only the faulty host's link is checked
    # Readings: 0 opens the pass, 1 closes it, 2 and 3 bound the first idle interval.
    broken_at = {"reset": 1, "impossible": 1, "idle_reset": 3}[case["fault"]]
    real, reads = host.read_nic, itertools.count()

    def read_nic(nic: str) -> host.NicCounters:
        c = real(nic)
        if not faulty or next(reads) != broken_at:
            return c
        if case["fault"] == "impossible":
            return dataclasses.replace(c, tx_bytes=c.tx_bytes + 10**10)
        return host.NicCounters(tx_bytes=0, rx_bytes=0, tx_packets=0, rx_packets=0)

    checked_pass_s = wirecount.CHECKED_PASS_S
    host.read_nic, wirecount.CHECKED_PASS_S = read_nic, 0.0  # judge even this short pass
    try:
        return counter.count(lambda: None, 1, [0] * world, [0] * world, 1 << 20).wire_check
    finally:
        host.read_nic, wirecount.CHECKED_PASS_S = real, checked_pass_s


def _bad_nic_on_one_host(case: dict[str, Any]) -> str:
    """``agreed_nic`` with a ``$COMMBENCH_NIC`` that names no interface on rank 1 alone: what each
    rank raised (it was rank 1's error, while rank 0 waited in the all-gather)."""
    from commbench.probes import host, wirecount

    saved = os.environ.get(host.NIC_ENV)
    if dist.get_rank() == 1:
        os.environ[host.NIC_ENV] = "eth-not-here"
    try:
        wirecount.agreed_nic()
        return "no error"
    except ValueError as exc:
        return str(exc)
    finally:
        if saved is None:
            os.environ.pop(host.NIC_ENV, None)
        else:
            os.environ[host.NIC_ENV] = saved


def run_case(case: tuple[str, dict[str, Any]]) -> Any:
    kind, body = case
    return {
        "collective": _collective,
        "grid": _grid,
        "segmented": _segmented,
        "autograd": _autograd,
        "inference": _inference,
        "bad_nic_on_one_host": _bad_nic_on_one_host,
        "bytes": _bytes,
        "mismatch": _mismatch,
        "validation": _validation,
        "membership": _membership,
        "in_place_rs": _in_place_reduce_scatter,
        "shapes": _shapes,
        "aliased": _aliased,
        "routes": _routes,
        "routes_off": _routes_off,
        "threads_first_calls": _threads_first_calls,
        "subgroups_of_two": _subgroups_of_two,
        "signed_zeros": _signed_zeros,
        "nans": _nans,
        "plan_reuse": _plan_reuse,
        "congestion": _congestion,
        "freed": _freed,
        "sweep_freed": _sweep_sizes_freed,
        "scratch": _scratch,
        "segments": _segments,
        "ring_messages": _ring_messages,
        "wire_bytes": _wire_bytes,
        "sweep_priced": _sweep_priced,
        "sweep_arithmetic": _sweep_arithmetic,
        "per_device_group": _per_device_group,
        "wire_faults": _wire_faults,
    }[kind](body)
