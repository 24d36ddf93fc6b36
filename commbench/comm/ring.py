"""Ring algorithms: reduce-scatter then all-gather around a ring, segmented and pipelined.

Each chunk is cut into segments; every segment of a step is in flight at once, and segment k of
step s+1 leaves as soon as segment k of step s has arrived and been reduced, so transfer and
local reduction overlap. Bytes per rank: 2 (n-1)/n of the message for all-reduce, optimal.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from commbench.comm import p2p, pipeline, tree
from commbench.comm.chunking import (
    Span,
    num_segments,
    ring_all_gather_order,
    ring_reduce_scatter_order,
    segment_bytes_cut,
    split,
    sub_span,
)
from commbench.comm.pipeline import Unit
from commbench.comm.workspace import Workspace, copy_into, overlaps, plan, scratch

# Pipeline segment. Over gloo on the 2-core CI-class VMs every message costs a round trip and
# the wake-up of a waiting thread, which outweighs what finer pipelining overlaps: measured side by
# side with `commbench sweep -a ring,ring@2M,...` (docs/PERFORMANCE.md, "Segment size").
SEGMENT_BYTES = 16 << 20


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
    slots: int,
    workspace: Workspace | None,
    *,
    in_place: bool,
) -> list[Unit]:
    """Units of a ring reduce-scatter over ``chunks`` of flat ``inp``; chunk ``rank`` ends in own_out.

    In place (all-reduce), partial sums accumulate in ``inp`` itself. Otherwise ``inp`` is left
    unchanged and partial sums alternate between ``own_out`` and one spare chunk, arranged so the
    last step lands in ``own_out``. Arriving segments go to ``slots`` scratch slots (unit i uses
    slot i mod slots, free again once unit i - slots has been reduced and the next receive into
    it is posted only then).
    """
    max_chunk = max(b - a for a, b in chunks)
    cap = math.ceil(max_chunk / nseg)
    slot_buf = scratch(workspace, "ring.slots", (slots, cap), inp)
    order = ring_reduce_scatter_order(rank, world)
    if not in_place and any(b - a != own_out.numel() for a, b in chunks):
        raise ValueError("a reduce-scatter out of place needs equal chunks")
    spare = None if in_place or world <= 2 else scratch(workspace, "ring.spare", (max_chunk,), inp)
    # Partial sums of step s go to own_out when (last - s) is even, so the last one ends there.
    last = len(order) - 1

    def acc(s: int, k: int) -> torch.Tensor:
        return _seg(own_out if (last - s) % 2 == 0 else spare, (0, max_chunk), nseg, k)

    units = []
    for s, (cs, cr) in enumerate(order):
        for k in range(nseg):
            n_recv = _local_len(chunks[cr], nseg, k)
            send = _seg(inp, chunks[cs], nseg, k) if in_place or s == 0 else acc(s - 1, k)
            out = _seg(inp, chunks[cr], nseg, k) if in_place else acc(s, k)
            units.append(
                Unit(send, slot_buf[len(units) % slots, :n_recv], (out, _seg(inp, chunks[cr], nseg, k)))
            )
    return units


def _all_gather_units(flat: torch.Tensor, chunks: list[Span], rank: int, world: int, nseg: int) -> list[Unit]:
    units = []
    for cs, cr in ring_all_gather_order(rank, world):
        for k in range(nseg):
            units.append(Unit(_seg(flat, chunks[cs], nseg, k), _seg(flat, chunks[cr], nseg, k)))
    return units


def _where(flat: torch.Tensor) -> tuple:
    """What a schedule's views of ``flat`` depend on (a key for :func:`plan`)."""
    return flat.data_ptr(), flat.numel(), flat.dtype, flat.device


def _plan(chunks: list[Span], flat: torch.Tensor, segment_bytes: int, group) -> tuple[int, int]:
    """(segments per chunk, receives posted ahead): none ahead on NCCL (see pipeline)."""
    largest, itemsize = max(b - a for a, b in chunks), flat.element_size()
    nseg = num_segments(largest, itemsize, segment_bytes)
    cut = segment_bytes_cut(largest, itemsize, segment_bytes)
    return nseg, pipeline.receives_ahead(group, cut, flat.device)


def receive_slots(nseg: int, ahead: int, world: int) -> int:
    """Scratch slots a reduce-scatter's arriving segments need: as many as receives can be
    outstanding, and no more than it has receives ((world - 1) x nseg). With receives posted ahead
    (gloo) that is the look-ahead; without (NCCL) each is posted with its unit's send, up to
    ``nseg`` (the lag) before it is reduced."""
    return max(1, min(ahead or nseg, (world - 1) * nseg))


def _run(units: list[Unit], rank: int, world: int, nseg: int, ahead: int, op: str, group) -> None:
    pipeline.run(
        units,
        right=(rank + 1) % world,
        left=(rank - 1) % world,
        lag=nseg,
        recv_ahead=ahead,
        op=op,
        group=group,
    )


def all_reduce(
    tensor: torch.Tensor,
    op: str,
    group: dist.ProcessGroup | None,
    *,
    segment_bytes: int = SEGMENT_BYTES,
    workspace: Workspace | None = None,
) -> None:
    """Ring all-reduce of ``tensor`` in place."""
    rank, world = p2p.group_rank(group)
    flat = tensor.view(-1)
    if world > 1 and flat.numel() > 0:
        chunks = split(flat.numel(), world)
        nseg, ahead = _plan(chunks, flat, segment_bytes, group)

        def build() -> list[Unit]:
            units = _reduce_scatter_units(
                flat,
                chunks,
                flat,
                rank,
                world,
                nseg,
                receive_slots(nseg, ahead, world),
                workspace,
                in_place=True,
            )
            return units + _all_gather_units(flat, chunks, rank, world, nseg)

        key = ("ring.all_reduce", _where(flat), rank, world, nseg, ahead)
        _run(plan(workspace, key, build), rank, world, nseg, ahead, op, group)
    if op == "avg":
        tensor.div_(world)


def _reduce_scatter_equal(
    flat_out: torch.Tensor,
    flat_in: torch.Tensor,
    op: str,
    group,
    segment_bytes: int,
    workspace: Workspace | None,
) -> None:
    """Reduce-scatter of ``flat_in`` (world x len(flat_out) elements) leaving the input intact."""
    rank, world = p2p.group_rank(group)
    m = flat_out.numel()
    if world == 1:
        flat_out.copy_(flat_in)
    elif m > 0:
        chunks = [(i * m, (i + 1) * m) for i in range(world)]
        nseg, ahead = _plan(chunks, flat_in, segment_bytes, group)
        key = ("ring.reduce_scatter", _where(flat_in), _where(flat_out), rank, world, nseg, ahead)
        units = plan(
            workspace,
            key,
            lambda: _reduce_scatter_units(
                flat_in,
                chunks,
                flat_out,
                rank,
                world,
                nseg,
                receive_slots(nseg, ahead, world),
                workspace,
                in_place=False,
            ),
        )
        _run(units, rank, world, nseg, ahead, op, group)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: str,
    group: dist.ProcessGroup | None,
    *,
    segment_bytes: int = SEGMENT_BYTES,
    workspace: Workspace | None = None,
) -> None:
    """Ring reduce-scatter: rank r's ``output`` gets chunk r of the reduced ``input``.

    Partial sums pass through the output buffer, so an output that is a view of the input (the
    in-place form) is computed in scratch and copied at the end.
    """
    flat_out, flat_in = output.view(-1), input.view(-1)
    if p2p.group_rank(group)[1] == 1:  # the output is the whole input: a copy (none where it is the input)
        copy_into(flat_out, flat_in)
        return
    target = (
        scratch(workspace, "ring.out", (flat_out.numel(),), flat_out)
        if overlaps(flat_out, flat_in)
        else flat_out
    )
    _reduce_scatter_equal(target, flat_in, op, group, segment_bytes, workspace)
    if target is not flat_out:
        flat_out.copy_(target)
    if op == "avg":
        output.div_(dist.get_world_size(group))


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    segment_bytes: int = SEGMENT_BYTES,
    workspace: Workspace | None = None,
) -> None:
    """Ring all-gather: ``output`` is every rank's ``input`` concatenated in rank order."""
    rank, world = p2p.group_rank(group)
    m = input.numel()
    flat = output.view(-1)
    copy_into(flat[rank * m : (rank + 1) * m], input.view(-1))
    if world > 1 and m > 0:
        chunks = [(i * m, (i + 1) * m) for i in range(world)]
        nseg, ahead = _plan(chunks, flat, segment_bytes, group)
        key = ("ring.all_gather", _where(flat), rank, world, nseg)
        units = plan(workspace, key, lambda: _all_gather_units(flat, chunks, rank, world, nseg))
        _run(units, rank, world, nseg, ahead, "sum", group)


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: dist.ProcessGroup | None,
    *,
    segment_bytes: int = SEGMENT_BYTES,
    workspace: Workspace | None = None,
) -> None:
    """Pipelined chain broadcast: src -> src+1 -> ..., each segment forwarded on arrival."""
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
    workspace: Workspace | None = None,
) -> None:
    """Ring reduce-scatter over the first world x (count // world) elements, then every rank
    sends its reduced chunk to ``dst``; the few leftover elements go up a binomial tree.

    Tensors on ranks other than ``dst`` are left unchanged.
    """
    rank, world = p2p.group_rank(group)
    flat = tensor.view(-1)
    m = flat.numel() // world
    body, tail = flat[: m * world], flat[m * world :]
    if world > 1 and m > 0:
        own = scratch(workspace, "ring.own", (m,), flat)
        _reduce_scatter_equal(own, body, op, group, segment_bytes, workspace)
        if rank == dst:
            works = [p2p.recv(body[r * m : (r + 1) * m], r, group) for r in range(world) if r != dst]
            body[dst * m : (dst + 1) * m].copy_(own)
            p2p.wait_all(works)
        else:
            p2p.wait_all([p2p.send(own, dst, group)])
    if world > 1 and tail.numel() > 0:
        tree.reduce(tail, dst, "sum" if op == "avg" else op, group, workspace=workspace)
    if op == "avg" and rank == dst:
        tensor.div_(world)
