"""What the sweep driver needs from each collective, in one small interface (as nccl-tests does).

Each entry says how a message size maps to element counts, makes and fills its buffers with a
closed-form pattern, runs one call, and counts wrong elements against the closed-form result.
Adding a collective is one class here and one line in ``SPECS``; the driver never changes.

The pattern: element i of rank r holds a small whole number, 1 to 4 (1 or 2 for prod), the sum
of a part that depends on i alone (a fixed hash of i) and a part that depends on i and r. The
second is rank r's turn in a sequence that spreads every level evenly over consecutive ranks
(the fractional parts of multiples of the golden ratio), started at a place hashed from i. So
every element's sum over ranks stays near 3 per rank (bfloat16 adds it exactly up to 84 ranks,
int8 up to 41), a product of 1s and 2s near 2**(ranks / 2), and yet the expected result of every
op varies from element to element at any world size. Data in the wrong place (a chunk sent to
the wrong rank, a result shifted by a few elements) differs from the expected result, unless it
moved by a multiple of :data:`PERIOD` elements, after which the pattern repeats.

Collectives that reduce nothing (all_gather, broadcast, send/recv) take a pattern of their own
with 100 values (:data:`COPY`), in which two ranks' inputs differ in every element (nearly every
one, for ranks a multiple of 100 apart), so that a short block from the wrong rank shows too.

Expected results are computed as the ranks compute them where that matters: integer sums and
products wrap around, and a float product past the dtype's range is inf.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from commbench import comm
from commbench.comm import p2p, pipeline, ring
from commbench.comm.chunking import num_segments, segment_bytes_cut, split
from commbench.comm.costmodel import bus_factor
from commbench.comm.pipeline import Unit
from commbench.units import AmbiguousSize, parse_size


@dataclass
class Buffers:
    """``reference`` is this rank's pristine input, copied into ``input`` before every call."""

    input: torch.Tensor
    output: torch.Tensor
    reference: torch.Tensor


# The collectives whose output and input are distinct buffers of different sizes, and which also
# run in place as nccl-tests' second column does (``--in-place``): reduce_scatter's output is its
# rank's chunk of the input, all_gather's input its rank's part of the output. all_reduce,
# broadcast and reduce take one buffer (torch.distributed's form), so they always run in place.
TWO_FORMS = ("reduce_scatter", "all_gather")
ONE_BUFFER = ("all_reduce", "broadcast", "reduce")


def in_place_form(record: dict) -> bool:
    """Whether a sweep record's point is the in-place form of a collective with two (records
    written before ``--in-place`` existed are out of place)."""
    return record.get("in_place") is True and record.get("collective") in TWO_FORMS


def form_name(collective: str, in_place: bool) -> str:
    """How headings and keys name a collective's form: "all_gather in place", or its name alone."""
    return f"{collective} in place" if in_place else collective


PERIOD = 65521  # the largest prime below 2**16: a rank's pattern repeats after this many elements
GOLDEN = (5**0.5 - 1) / 2  # its multiples' fractional parts: the ranks' turns in the rank part
COPY = "copy"  # the pattern of collectives that move data without reducing it


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
    if op == COPY:  # nothing is reduced: 100 values, and two ranks' inputs differ all along
        return 1 + (_hashed(0xD1CE, 100) + rank + (1 + _hashed(0xFACE, 99)) * (rank // 100)) % 100
    turn = torch.frac((_hashed(0xC0FFEE, PERIOD) + rank).double() * GOLDEN)
    if op == "prod":
        return 1 + (turn < 0.5).long()
    return 1 + _hashed(0xBEEF, 2) + (3 * turn).floor().long()


def _window(one_period: torch.Tensor, count: int, offset: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Elements offset .. offset+count of the sequence that repeats ``one_period``."""
    start = offset % PERIOD
    if count <= PERIOD:  # a block of a few elements (all_gather at many ranks) need not copy a period
        return one_period[(torch.arange(count) + start) % PERIOD].to(dtype=dtype, device=device)
    base = torch.roll(one_period, -start).to(dtype=dtype, device=device)
    return base.repeat(-(-count // PERIOD))[:count].contiguous()


def pattern(
    rank: int, count: int, op: str, dtype: torch.dtype, device: torch.device, offset: int = 0
) -> torch.Tensor:
    """Elements offset .. offset+count of rank ``rank``'s input for ``op``."""
    return _window(_period_of(rank, op), count, offset, dtype, device)


@functools.lru_cache(maxsize=8)
def _reduced_period(world: int, op: str) -> torch.Tensor:
    """One period of the reduction over ranks 0 .. world-1: float64 (exact: the values are small),
    and for prod the power of two each product is (int64)."""
    if op == "prod":
        return sum((_period_of(r, op) - 1 for r in range(world)), torch.zeros(PERIOD, dtype=torch.int64))
    step = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}[op]
    acc = _period_of(0, op).double()
    for r in range(1, world):
        acc = step(acc, _period_of(r, op).double())
    return acc / world if op == "avg" else acc


def _typed(table: torch.Tensor, op: str, dtype: torch.dtype) -> torch.Tensor:
    """One period of expected results in ``dtype``, as the ranks' own arithmetic leaves them."""
    if dtype.is_floating_point:
        if op == "prod":  # past the dtype's range a product of 1s and 2s is inf, and stays inf
            return torch.pow(2.0, table.double()).to(dtype)
        return table.to(dtype)
    info = torch.iinfo(dtype)
    if op == "prod":  # 2**k in the dtype's bits: 0 once k reaches them, the lowest value one before
        out = torch.zeros_like(table)
        small = table < min(info.bits, 63)
        out[small] = torch.pow(2, table[small])
        if info.min < 0:
            out[table == info.bits - 1] = info.min
        return out.to(dtype)
    if op != "avg" and info.bits < 64:  # sums wrap around as the ranks' own additions do
        return ((table.to(torch.int64) - info.min) % (1 << info.bits) + info.min).to(dtype)
    return table.to(dtype)


def reduced_pattern(
    world: int, count: int, op: str, dtype: torch.dtype, device: torch.device, offset: int = 0
):
    """The reduction over all ranks of elements offset .. offset+count of the pattern."""
    return _window(_typed(_reduced_period(world, op), op, dtype), count, offset, dtype, device)


def poison(t: torch.Tensor) -> None:
    """Fill an output with a value no pattern produces (NaN, or -1), so unwritten parts show up."""
    t.fill_(float("nan") if t.dtype.is_floating_point else -1)


def ready_for_check(b: Buffers) -> None:
    """Before a checked call: the output poisoned and the pristine input in place. A one-buffer
    collective's output is its input, which the copy overwrites; an in-place all_gather's output
    is poisoned around the rank's own part, which the copy then fills (rank 0's part starts where
    the output does, so the two are told apart by identity, not by address). An in-place
    reduce_scatter's output lies inside its input and starts as the rank's own chunk, which a
    missing write leaves: wrong at every element for sum and prod, but for max, min and avg only
    where the rank's own value is not the result."""
    if b.output is not b.input:
        poison(b.output)
    b.input.copy_(b.reference)


CHECK_CHUNK = 1 << 20  # elements compared at a time: the check's temporaries stay under 48 MiB


def count_wrong(got: torch.Tensor, expected: torch.Tensor, op: str | None = None, world: int = 1) -> int:
    """Elements of ``got`` that differ from ``expected`` beyond the dtype's rounding.

    For a float reduction over ``world`` ranks (``op``) the rounding of the ranks' additions
    counts too. A sum adds whole numbers exactly until it passes 2**p (p: the dtype's digits, 11
    for float16, 8 for bfloat16); past that, ranks adding in turn round each partial sum by up
    to half a unit of its last place, and the partial sums grow to the result about evenly: at
    most (world / 2 + 1) * 2**-p * |result| in all, less the whole-number part below 2**p. An
    average that scales each term before it adds (NCCL's) rounds from the first term on. Equal
    infinities are right; NaN is wrong.
    """
    if got.numel() == 0:
        return 0
    if not got.dtype.is_floating_point:
        return int((got != expected).sum().item())
    rtol = {torch.float16: 1e-3, torch.bfloat16: 1e-2}.get(got.dtype, 1e-5)
    g, e = got.double(), expected.double()
    size = e.abs()
    allowed = rtol * size + 1e-6
    if op in ("sum", "avg") and world > 1:
        exact = 2 / torch.finfo(got.dtype).eps  # 2**p: whole numbers up to it are exact
        rounding = (world / 2 + 1) * size / exact
        if op == "sum":  # below 2**p the additions were exact
            rounding = torch.where(size > exact, rounding * (1 - (exact / size.clamp(min=exact)) ** 2), 0.0)
        allowed = allowed + rounding
    right = (g == e) | ((g - e).abs() <= allowed)
    return int((~right).sum().item())


def count_wrong_at(
    got: torch.Tensor, expected_at: Callable[[int, int], torch.Tensor], op: str | None = None, world: int = 1
) -> int:
    """:func:`count_wrong` of flat ``got`` against ``expected_at(start, n)``, the expected values of
    elements start .. start+n, :data:`CHECK_CHUNK` elements at a time, so that checking a message
    of any size takes a bounded amount of memory beside it."""
    return sum(
        count_wrong(got[a : a + CHECK_CHUNK], expected_at(a, min(CHECK_CHUNK, got.numel() - a)), op, world)
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
    except AmbiguousSize as error:
        raise ValueError(f"{series!r}: the segment after @ is {error}") from None
    except ValueError:
        segment = 0
    if not 1 <= segment <= comm.MAX_SEGMENT_BYTES:
        raise ValueError(
            f"{series!r}: the segment after @ must be a size of at least 1 byte and at most 2**62 "
            "(bytes or K/M/G: ring@2M)"
        )
    return algorithm, segment


class _Spec:
    name = ""
    needs_op = True
    has_root = False  # broadcast and reduce; the others' records say root null, as op null

    def make_for(self, count, dtype, device, rank, world, op, root, in_place: bool = False) -> Buffers:
        """:meth:`make`, in the in-place form where ``in_place`` and the collective has one."""
        if in_place and self.name in TWO_FORMS:
            return self.make_in_place(count, dtype, device, rank, world, op, root)
        return self.make(count, dtype, device, rank, world, op, root)

    def runs_in_place(self, in_place: bool) -> bool:
        """Whether a sweep's call writes over its input (the record's ``in_place``)."""
        return self.name in ONE_BUFFER or (in_place and self.name in TWO_FORMS)

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
        return count_wrong_at(
            out, lambda a, n: reduced_pattern(world, n, op, out.dtype, out.device, a), op, world
        )


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

    def make_in_place(self, count, dtype, device, rank, world, op, root) -> Buffers:
        """The output is this rank's chunk of the input (``recvbuff = sendbuff + rank * recvcount``)."""
        t = torch.empty(count, dtype=dtype, device=device)
        m = count // world
        return Buffers(t, t[rank * m : (rank + 1) * m], pattern(rank, count, op, dtype, device))

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
            out, lambda a, n: reduced_pattern(world, n, op, out.dtype, out.device, rank * m + a), op, world
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
            pattern(rank, m, COPY, dtype, device),
        )

    def make_in_place(self, count, dtype, device, rank, world, op, root) -> Buffers:
        """The input is this rank's part of the output (``sendbuff = recvbuff + rank * sendcount``)."""
        t = torch.empty(count, dtype=dtype, device=device)
        m = count // world
        return Buffers(t[rank * m : (rank + 1) * m], t, pattern(rank, m, COPY, dtype, device))

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
                parts.append(pattern(r, hi - lo, COPY, out.dtype, out.device, lo - r * m))
            return torch.cat(parts)

        return count_wrong_at(out, expected_at)


class Broadcast(_Spec):
    name = "broadcast"
    needs_op = False
    has_root = True

    def make(self, count, dtype, device, rank, world, op, root) -> Buffers:
        t = torch.empty(count, dtype=dtype, device=device)
        ref = pattern(root, count, COPY, dtype, device) if rank == root else torch.zeros_like(t)
        return Buffers(t, t, ref)

    def call(self, b, algorithm, op, root, group, workspace, segment_bytes) -> None:
        comm.broadcast(
            b.input, root, algorithm, group, check=False, workspace=workspace, segment_bytes=segment_bytes
        )

    def wrong(self, b, op, rank, world, root) -> int:
        out = b.output
        return count_wrong_at(out, lambda a, n: pattern(root, n, COPY, out.dtype, out.device, a))


class Reduce(_Spec):
    name = "reduce"
    has_root = True

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
        return count_wrong_at(
            out, lambda a, n: reduced_pattern(world, n, op, out.dtype, out.device, a), op, world
        )


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
            pattern(rank, count, COPY, dtype, device),
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
            recv_ahead=pipeline.receives_ahead(
                group, segment_bytes_cut(n, b.input.element_size(), segment_bytes), b.input.device
            ),
            op="sum",
            group=group,
        )

    def wrong(self, b, op, rank, world, root) -> int:
        out, left = b.output, (rank - 1) % world
        return count_wrong_at(out, lambda a, n: pattern(left, n, COPY, out.dtype, out.device, a))


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
