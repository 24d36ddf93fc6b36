"""Ring algorithms: reduce-scatter then all-gather around a ring, segmented and pipelined.

Each chunk is cut into segments; every segment of a step is in flight at once, and segment k of
step s+1 leaves as soon as segment k of step s has arrived and been reduced, so transfer and
local reduction overlap. Bytes per rank: 2 (n-1)/n of the message for all-reduce, optimal.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from commbench.comm import p2p, pipeline
from commbench.comm.chunking import (
    Span,
    num_segments,
    ring_all_gather_order,
    ring_reduce_scatter_order,
    split,
    sub_span,
)
from commbench.comm.pipeline import Unit

SEGMENT_BYTES = 1 << 20  # measured: 256 KiB to 1 MiB segments run fastest over gloo on loopback


class _Slots:
    """``nseg`` fixed scratch slots, so segment k always lands at the same place."""

    def __init__(self, nseg: int, max_chunk: int, like: torch.Tensor, copies: int = 1) -> None:
        self.cap = math.ceil(max_chunk / nseg) if max_chunk else 0
        self.buf = torch.empty((copies, nseg, self.cap), dtype=like.dtype, device=like.device)

    def get(self, k: int, length: int, copy: int = 0) -> torch.Tensor:
        return self.buf[copy, k, :length]


def _seg(flat: torch.Tensor, span: Span, nseg: int, k: int) -> torch.Tensor:
    a, b = sub_span(span, nseg, k)
    return flat[a:b]


def _local_len(span: Span, nseg: int, k: int) -> int:
    a, b = sub_span(span, nseg, k)
    return b - a


def _reduce_scatter_units(
    inp: torch.Tensor,
    chunks: list[Span],
    own_out: torch.Tensor,
    rank: int,
    world: int,
    nseg: int,
    in_place: bool,
) -> list[Unit]:
    """Units of a ring reduce-scatter over ``chunks`` of flat ``inp``; chunk ``rank`` ends in own_out.

    In place (all-reduce), partial sums accumulate in ``inp`` itself; otherwise ``inp`` is left
    unchanged and partial sums rotate through two slot buffers.
    """
    max_chunk = max(b - a for a, b in chunks)
    scratch = _Slots(nseg, max_chunk, inp)
    acc = None if in_place or world <= 2 else _Slots(nseg, max_chunk, inp, copies=2)
    units = []
    order = ring_reduce_scatter_order(rank, world)
    for s, (cs, cr) in enumerate(order):
        last = s == len(order) - 1
        for k in range(nseg):
            n_recv = _local_len(chunks[cr], nseg, k)
            if in_place or s == 0:
                send = _seg(inp, chunks[cs], nseg, k)
            else:
                send = acc.get(k, _local_len(chunks[cs], nseg, k), (s - 1) % 2)
            if in_place:
                out = _seg(inp, chunks[cr], nseg, k)
            elif last:
                out = _seg(own_out, (0, own_out.numel()), nseg, k)
            else:
                out = acc.get(k, n_recv, s % 2)
            units.append(
                Unit(send, scratch.get(k, n_recv), (out, _seg(inp, chunks[cr], nseg, k)))
            )
    return units


def _all_gather_units(
    flat: torch.Tensor, chunks: list[Span], rank: int, world: int, nseg: int
) -> list[Unit]:
    units = []
    for cs, cr in ring_all_gather_order(rank, world):
        for k in range(nseg):
            units.append(Unit(_seg(flat, chunks[cs], nseg, k), _seg(flat, chunks[cr], nseg, k)))
    return units


def _nseg(chunks: list[Span], itemsize: int, segment_bytes: int) -> int:
    return num_segments(max(b - a for a, b in chunks), itemsize, segment_bytes)


def all_reduce(
    tensor: torch.Tensor,
    op: str,
    group: dist.ProcessGroup | None,
    *,
    segment_bytes: int = SEGMENT_BYTES,
) -> None:
    """Ring all-reduce of ``tensor`` in place."""
    rank, world = p2p.group_rank(group)
    flat = tensor.view(-1)
    if world > 1 and flat.numel() > 0:
        chunks = split(flat.numel(), world)
        nseg = _nseg(chunks, flat.element_size(), segment_bytes)
        units = _reduce_scatter_units(flat, chunks, flat, rank, world, nseg, in_place=True)
        units += _all_gather_units(flat, chunks, rank, world, nseg)
        pipeline.run(
            units, right=(rank + 1) % world, left=(rank - 1) % world, window=nseg, op=op,
            group=group,
        )
    if op == "avg":
        tensor.div_(world)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: str,
    group: dist.ProcessGroup | None,
    *,
    segment_bytes: int = SEGMENT_BYTES,
) -> None:
    """Ring reduce-scatter: rank r's ``output`` gets chunk r of the reduced ``input``."""
    rank, world = p2p.group_rank(group)
    m = output.numel()
    flat_in, flat_out = input.view(-1), output.view(-1)
    if world == 1:
        flat_out.copy_(flat_in)
    elif m > 0:
        chunks = [(i * m, (i + 1) * m) for i in range(world)]
        nseg = _nseg(chunks, flat_in.element_size(), segment_bytes)
        units = _reduce_scatter_units(flat_in, chunks, flat_out, rank, world, nseg, in_place=False)
        pipeline.run(
            units, right=(rank + 1) % world, left=(rank - 1) % world, window=nseg, op=op,
            group=group,
        )
    if op == "avg":
        output.div_(world)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    segment_bytes: int = SEGMENT_BYTES,
) -> None:
    """Ring all-gather: ``output`` is every rank's ``input`` concatenated in rank order."""
    rank, world = p2p.group_rank(group)
    m = input.numel()
    flat = output.view(-1)
    flat[rank * m : (rank + 1) * m].copy_(input.view(-1))
    if world > 1 and m > 0:
        chunks = [(i * m, (i + 1) * m) for i in range(world)]
        nseg = _nseg(chunks, flat.element_size(), segment_bytes)
        pipeline.run(
            _all_gather_units(flat, chunks, rank, world, nseg),
            right=(rank + 1) % world, left=(rank - 1) % world, window=nseg, op="sum",
            group=group,
        )


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: dist.ProcessGroup | None,
    *,
    segment_bytes: int = SEGMENT_BYTES,
) -> None:
    """Pipelined chain broadcast: src -> src+1 -> ... , each segment forwarded on arrival."""
    rank, world = p2p.group_rank(group)
    flat = tensor.view(-1)
    if world == 1 or flat.numel() == 0:
        return
    rel = (rank - src) % world
    right, left = (rank + 1) % world, (rank - 1) % world
    nseg = num_segments(flat.numel(), flat.element_size(), segment_bytes)
    segs = [flat[a:b] for a, b in split(flat.numel(), nseg)]
    sends: list[p2p.Work | None] = []
    if rel == 0:
        sends = [p2p.send(s, right, group) for s in segs]
    else:
        recvs = [p2p.recv(s, left, group) for s in segs]
        for seg, work in zip(segs, recvs, strict=True):
            if work is not None:
                work.wait()
            if rel < world - 1:
                sends.append(p2p.send(seg, right, group))
    p2p.wait_all(sends)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: str,
    group: dist.ProcessGroup | None,
    *,
    segment_bytes: int = SEGMENT_BYTES,
) -> None:
    """Ring reduce-scatter, then every rank sends its reduced chunk to ``dst``.

    Tensors on ranks other than ``dst`` are left unchanged.
    """
    rank, world = p2p.group_rank(group)
    flat = tensor.view(-1)
    if world > 1 and flat.numel() > 0:
        chunks = split(flat.numel(), world)
        nseg = _nseg(chunks, flat.element_size(), segment_bytes)
        a, b = chunks[rank]
        own = torch.empty(b - a, dtype=flat.dtype, device=flat.device)
        units = _reduce_scatter_units(flat, chunks, own, rank, world, nseg, in_place=False)
        pipeline.run(
            units, right=(rank + 1) % world, left=(rank - 1) % world, window=nseg, op=op,
            group=group,
        )
        if rank == dst:
            works = [p2p.recv(flat[c0:c1], r, group) for r, (c0, c1) in enumerate(chunks)
                     if r != dst]
            flat[a:b].copy_(own)
            p2p.wait_all(works)
        else:
            p2p.wait_all([p2p.send(own, dst, group)])
    if op == "avg" and rank == dst:
        tensor.div_(world)
