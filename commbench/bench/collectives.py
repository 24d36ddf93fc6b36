"""What the sweep driver needs from each collective, in one small interface (as nccl-tests does).

Each entry says how a message size maps to element counts, makes and fills its buffers with a
closed-form pattern, runs one call, and counts wrong elements against the closed-form result.
Adding a collective is one class here and one line in ``SPECS``; the driver never changes.

The pattern: element i of rank r holds a small whole number, 1 to 7 (1 or 2 for prod), so that
every reduction has an exact expected value in every dtype. It is made of a part that depends on
i alone and a part that depends on i and r, each drawn from a fixed hash of the index, and it
repeats only every :data:`PERIOD` elements. So the expected result of every op varies from
element to element at any world size, and data in the wrong place (a chunk sent to the wrong
rank, a result shifted by a few elements, one rank's part missing) differs from it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from commbench import comm
from commbench.comm import p2p, pipeline, ring
from commbench.comm.chunking import num_segments, split
from commbench.comm.costmodel import bus_factor
from commbench.comm.pipeline import Unit
from commbench.units import parse_size


@dataclass
class Buffers:
    """``reference`` is this rank's pristine input, copied into ``input`` before every call."""

    input: torch.Tensor
    output: torch.Tensor
    reference: torch.Tensor


PERIOD = 65521  # the largest prime below 2**16: a rank's pattern repeats after this many elements
RANK_STRIDE = 7919  # a prime: rank r's index-and-rank part is rank 0's moved on by r * RANK_STRIDE


@functools.lru_cache(maxsize=4)
def _hashed(salt: int, values: int) -> torch.Tensor:
    """One period of a fixed pseudo-random sequence of 0 .. values-1 (the same on every machine)."""
    out = []
    for j in range(PERIOD):
        h = (j * 2654435761 + salt) & 0xFFFFFFFF
        h = ((h ^ (h >> 15)) * 2246822519) & 0xFFFFFFFF
        out.append((h ^ (h >> 13)) % values)
    return torch.tensor(out, dtype=torch.int64)


@functools.lru_cache(maxsize=8)
def _period_of(rank: int, op: str) -> torch.Tensor:
    """Elements 0 .. PERIOD-1 of rank ``rank``'s input (int64, on the CPU)."""
    moved = (torch.arange(PERIOD) + rank * RANK_STRIDE) % PERIOD
    if op == "prod":  # products of 1s and 2s: exact while 2**world fits the dtype
        return 1 + _hashed(0x5EED, 2)[moved]
    return 1 + 2 * _hashed(0xC0FFEE, 3) + _hashed(0xBEEF, 3)[moved]


def _window(one_period: torch.Tensor, count: int, offset: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Elements offset .. offset+count of the sequence that repeats ``one_period``."""
    if count == 0:
        return torch.empty(0, dtype=dtype, device=device)
    base = torch.roll(one_period, -(offset % PERIOD)).to(dtype=dtype, device=device)
    return base.repeat(-(-count // PERIOD))[:count].contiguous()


def pattern(
    rank: int, count: int, op: str, dtype: torch.dtype, device: torch.device, offset: int = 0
) -> torch.Tensor:
    """Elements offset .. offset+count of rank ``rank``'s input for ``op``."""
    return _window(_period_of(rank, op), count, offset, dtype, device)


@functools.lru_cache(maxsize=8)
def _reduced_period(world: int, op: str) -> torch.Tensor:
    """One period of the reduction over ranks 0 .. world-1 (float64, exact: the values are small)."""
    step = {"sum": torch.add, "avg": torch.add, "prod": torch.mul, "max": torch.maximum, "min": torch.minimum}
    acc = _period_of(0, op).double()
    for r in range(1, world):
        acc = step[op](acc, _period_of(r, op).double())
    return acc / world if op == "avg" else acc


def reduced_pattern(
    world: int, count: int, op: str, dtype: torch.dtype, device: torch.device, offset: int = 0
):
    """The reduction over all ranks of elements offset .. offset+count of the pattern."""
    table = _reduced_period(world, op)
    if not dtype.is_floating_point and op != "avg" and torch.iinfo(dtype).bits < 64:
        # Integer sums and products wrap around as the ranks' own additions do (int8 from 19 ranks).
        info = torch.iinfo(dtype)
        table = (table.to(torch.int64) - info.min) % (1 << info.bits) + info.min
    return _window(table, count, offset, dtype, device)


def poison(t: torch.Tensor) -> None:
    """Fill an output with a value no pattern produces (NaN, or -1), so unwritten parts show up."""
    t.fill_(float("nan") if t.dtype.is_floating_point else -1)


CHECK_CHUNK = 1 << 20  # elements compared at a time: the check's temporaries stay under 48 MiB


def count_wrong(got: torch.Tensor, expected: torch.Tensor) -> int:
    """Elements of ``got`` that differ from ``expected`` beyond the dtype's rounding."""
    if got.numel() == 0:
        return 0
    if got.dtype.is_floating_point:
        rtol = {torch.float16: 1e-3, torch.bfloat16: 1e-2}.get(got.dtype, 1e-5)
        g, e = got.double(), expected.double()
        return int((~((g - e).abs() <= rtol * e.abs() + 1e-6)).sum().item())  # NaN counts as wrong
    return int((got != expected).sum().item())


def count_wrong_at(got: torch.Tensor, expected_at: Callable[[int, int], torch.Tensor]) -> int:
    """:func:`count_wrong` of flat ``got`` against ``expected_at(start, n)``, the expected values of
    elements start .. start+n, :data:`CHECK_CHUNK` elements at a time, so that checking a message
    of any size takes a bounded amount of memory beside it."""
    return sum(
        count_wrong(got[a : a + CHECK_CHUNK], expected_at(a, min(CHECK_CHUNK, got.numel() - a)))
        for a in range(0, got.numel(), CHECK_CHUNK)
    )


def series_parts(series: str) -> tuple[str, int | None]:
    """A sweep series' algorithm and pipeline segment: "ring@2M" is ("ring", 2097152), "ring" is
    ("ring", None) (the algorithm's default). Raises ValueError on a size that does not parse."""
    algorithm, at, size = series.partition("@")
    if not at:
        return series, None
    try:
        segment = parse_size(size)
    except ValueError:
        segment = 0
    if segment < 1:
        raise ValueError(
            f"{series!r}: the segment after @ must be a size of at least 1 byte (bytes or K/M/G: ring@2M)"
        )
    return algorithm, segment


class _Spec:
    name = ""
    needs_op = True

    def count(self, size_bytes: int, itemsize: int, world: int) -> int:
        return size_bytes // itemsize

    def run(self, b: Buffers, series: str, op, root, group, workspace) -> None:
        """One call of ``series`` (an algorithm, with "@SIZE" for its pipeline segment)."""
        algorithm, segment_bytes = series_parts(series)
        self.call(b, algorithm, op, root, group, workspace, segment_bytes)

    def bus_factor(self, world: int) -> float:
        return bus_factor(self.name, world)


class AllReduce(_Spec):
    name = "all_reduce"

    def make(self, count, dtype, device, rank, world, op, root) -> Buffers:
        t = torch.empty(count, dtype=dtype, device=device)
        return Buffers(t, t, pattern(rank, count, op, dtype, device))

    def call(self, b: Buffers, algorithm, op, root, group, workspace, segment_bytes) -> None:
        comm.all_reduce(
            b.input, op, algorithm, group, check=False, workspace=workspace, segment_bytes=segment_bytes
        )

    def wrong(self, b: Buffers, op, rank, world, root) -> int:
        out = b.output
        return count_wrong_at(out, lambda a, n: reduced_pattern(world, n, op, out.dtype, out.device, a))


class ReduceScatter(_Spec):
    name = "reduce_scatter"

    def count(self, size_bytes, itemsize, world):
        return size_bytes // (itemsize * world) * world

    def make(self, count, dtype, device, rank, world, op, root) -> Buffers:
        return Buffers(
            torch.empty(count, dtype=dtype, device=device),
            torch.empty(count // world, dtype=dtype, device=device),
            pattern(rank, count, op, dtype, device),
        )

    def call(self, b, algorithm, op, root, group, workspace, segment_bytes) -> None:
        comm.reduce_scatter(
            b.output,
            b.input,
            op,
            algorithm,
            group,
            check=False,
            workspace=workspace,
            segment_bytes=segment_bytes,
        )

    def wrong(self, b, op, rank, world, root) -> int:
        out, m = b.output, b.output.numel()
        return count_wrong_at(
            out, lambda a, n: reduced_pattern(world, n, op, out.dtype, out.device, rank * m + a)
        )


class AllGather(_Spec):
    name = "all_gather"
    needs_op = False

    def count(self, size_bytes, itemsize, world):
        return size_bytes // (itemsize * world) * world

    def make(self, count, dtype, device, rank, world, op, root) -> Buffers:
        m = count // world
        return Buffers(
            torch.empty(m, dtype=dtype, device=device),
            torch.empty(count, dtype=dtype, device=device),
            pattern(rank, m, "sum", dtype, device),
        )

    def call(self, b, algorithm, op, root, group, workspace, segment_bytes) -> None:
        comm.all_gather(
            b.output, b.input, algorithm, group, check=False, workspace=workspace, segment_bytes=segment_bytes
        )

    def wrong(self, b, op, rank, world, root) -> int:
        out, m = b.output, b.input.numel()

        def expected_at(a: int, n: int) -> torch.Tensor:
            # Rank r's input fills elements r*m .. (r+1)*m.
            parts = []
            for r in range(a // m, (a + n - 1) // m + 1):
                lo, hi = max(a, r * m), min(a + n, (r + 1) * m)
                parts.append(pattern(r, hi - lo, "sum", out.dtype, out.device, lo - r * m))
            return torch.cat(parts)

        return count_wrong_at(out, expected_at)


class Broadcast(_Spec):
    name = "broadcast"
    needs_op = False

    def make(self, count, dtype, device, rank, world, op, root) -> Buffers:
        t = torch.empty(count, dtype=dtype, device=device)
        ref = pattern(root, count, "sum", dtype, device) if rank == root else torch.zeros_like(t)
        return Buffers(t, t, ref)

    def call(self, b, algorithm, op, root, group, workspace, segment_bytes) -> None:
        comm.broadcast(
            b.input, root, algorithm, group, check=False, workspace=workspace, segment_bytes=segment_bytes
        )

    def wrong(self, b, op, rank, world, root) -> int:
        out = b.output
        return count_wrong_at(out, lambda a, n: pattern(root, n, "sum", out.dtype, out.device, a))


class Reduce(_Spec):
    name = "reduce"

    def make(self, count, dtype, device, rank, world, op, root) -> Buffers:
        t = torch.empty(count, dtype=dtype, device=device)
        return Buffers(t, t, pattern(rank, count, op, dtype, device))

    def call(self, b, algorithm, op, root, group, workspace, segment_bytes) -> None:
        comm.reduce(
            b.input, root, op, algorithm, group, check=False, workspace=workspace, segment_bytes=segment_bytes
        )

    def wrong(self, b, op, rank, world, root) -> int:
        if rank != root:
            return 0
        out = b.output
        return count_wrong_at(out, lambda a, n: reduced_pattern(world, n, op, out.dtype, out.device, a))


class SendRecv(_Spec):
    """Bidirectional exchange between ring neighbours: the transport's own limit.

    Segmented and pipelined exactly like the ring algorithms, so it measures what the transport
    can carry with the same pipelining, not a single blocking message.
    """

    name = "sendrecv"
    needs_op = False

    def make(self, count, dtype, device, rank, world, op, root) -> Buffers:
        return Buffers(
            torch.empty(count, dtype=dtype, device=device),
            torch.empty(count, dtype=dtype, device=device),
            pattern(rank, count, "sum", dtype, device),
        )

    def call(self, b, algorithm, op, root, group, workspace, segment_bytes) -> None:
        rank, world = p2p.group_rank(group)
        if world == 1:
            b.output.copy_(b.input)
            return
        p2p.prepare(group)  # as the hand-written collectives do, so the limit stays comparable
        n = b.input.numel()
        segment_bytes = segment_bytes or ring.SEGMENT_BYTES
        nseg = num_segments(n, b.input.element_size(), segment_bytes)
        units = [Unit(b.input[a:z], b.output[a:z]) for a, z in split(n, nseg)]
        pipeline.run(
            units,
            right=(rank + 1) % world,
            left=(rank - 1) % world,
            lag=1,
            recv_ahead=pipeline.receives_ahead(group, segment_bytes),
            op="sum",
            group=group,
        )

    def wrong(self, b, op, rank, world, root) -> int:
        out, left = b.output, (rank - 1) % world
        return count_wrong_at(out, lambda a, n: pattern(left, n, "sum", out.dtype, out.device, a))


SPECS: dict[str, _Spec] = {
    s.name: s for s in (AllReduce(), ReduceScatter(), AllGather(), Broadcast(), Reduce(), SendRecv())
}


def algorithms_for(collective: str) -> tuple[str, ...]:
    """Algorithm names a sweep accepts for ``collective``."""
    if collective == "sendrecv":
        return ("p2p",)
    return comm.ALGORITHMS[collective]


def segmented_for(collective: str) -> tuple[str, ...]:
    """The algorithms of ``collective`` that take a segment size ("ring@2M"): those that pipeline
    in segments, ``auto`` (passed on where it picks one) and the segmented exchange of sendrecv."""
    if collective == "sendrecv":
        return ("p2p",)
    return tuple(a for a in comm.ALGORITHMS[collective] if a in (*comm.SEGMENTED, "auto"))
