"""Naive gather-scatter through a root: every rank sends its whole tensor to the root, which
reduces (or assembles) and sends the result back. Simple, and the root's link carries (n-1)x
the message each way, which is what it is here to show."""

from __future__ import annotations

import torch
import torch.distributed as dist

from commbench.comm import p2p
from commbench.comm.workspace import Workspace, copy_into, scratch
from commbench.kernels import reduce_into

ROOT = 0


def _reduce_at(
    flat: torch.Tensor, out: torch.Tensor, root: int, op: str, group, workspace: Workspace | None
) -> None:
    """Root receives every other rank's ``flat`` and reduces them, in rank order, into ``out``."""
    rank, world = p2p.group_rank(group)
    if rank != root:
        p2p.wait_all([p2p.send(flat, root, group)])
        return
    peers = [r for r in range(world) if r != root]
    bufs = scratch(workspace, "naive.recv", (len(peers), flat.numel()), flat)
    works = [p2p.recv(buf, r, group) for buf, r in zip(bufs, peers, strict=True)]
    if out.data_ptr() != flat.data_ptr():
        out.copy_(flat)
    for buf, work in zip(bufs, works, strict=True):
        if work is not None:
            work.wait()
        reduce_into(out, out, buf, op)


def all_reduce(
    tensor: torch.Tensor, op: str, group: dist.ProcessGroup | None, *, workspace: Workspace | None = None
) -> None:
    """Reduce at rank 0, then rank 0 sends the result to every rank."""
    rank, world = p2p.group_rank(group)
    flat = tensor.view(-1)
    if world > 1 and flat.numel() > 0:
        _reduce_at(flat, flat, ROOT, op, group, workspace)
        _scatter_whole(flat, ROOT, group)
    if op == "avg":
        tensor.div_(world)


def _scatter_whole(flat: torch.Tensor, root: int, group) -> None:
    """Root sends all of ``flat`` to every other rank."""
    rank, world = p2p.group_rank(group)
    if rank == root:
        p2p.wait_all([p2p.send(flat, r, group) for r in range(world) if r != root])
    else:
        p2p.wait_all([p2p.recv(flat, root, group)])


def broadcast(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None, *, workspace: Workspace | None = None
) -> None:
    """``src`` sends the whole tensor to every other rank directly."""
    if tensor.numel() > 0:
        _scatter_whole(tensor.view(-1), src, group)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: str,
    group: dist.ProcessGroup | None,
    *,
    workspace: Workspace | None = None,
) -> None:
    """Every rank sends to ``dst``, which reduces in rank order; other tensors stay unchanged."""
    rank, world = p2p.group_rank(group)
    flat = tensor.view(-1)
    if world > 1 and flat.numel() > 0:
        _reduce_at(flat, flat, dst, op, group, workspace)
    if op == "avg" and rank == dst:
        tensor.div_(world)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: str,
    group: dist.ProcessGroup | None,
    *,
    workspace: Workspace | None = None,
) -> None:
    """Reduce the whole input at rank 0, then rank 0 sends chunk r to rank r."""
    rank, world = p2p.group_rank(group)
    flat_in, flat_out = input.view(-1), output.view(-1)
    m = flat_out.numel()
    if world == 1 or m == 0:
        copy_into(flat_out, flat_in)
    elif rank == ROOT:
        total = scratch(workspace, "naive.total", (flat_in.numel(),), flat_in)
        _reduce_at(flat_in, total, ROOT, op, group, workspace)
        works = [p2p.send(total[r * m : (r + 1) * m], r, group) for r in range(world) if r != ROOT]
        flat_out.copy_(total[ROOT * m : (ROOT + 1) * m])
        p2p.wait_all(works)
    else:
        _reduce_at(flat_in, flat_in, ROOT, op, group, workspace)
        p2p.wait_all([p2p.recv(flat_out, ROOT, group)])
    if op == "avg":
        output.div_(world)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    workspace: Workspace | None = None,
) -> None:
    """Every rank sends its input to rank 0, which assembles the output and sends it to all."""
    rank, world = p2p.group_rank(group)
    m = input.numel()
    flat = output.view(-1)
    own = flat[rank * m : (rank + 1) * m]
    copy_into(own, input.view(-1))
    if world == 1 or m == 0:
        return
    if rank == ROOT:
        p2p.wait_all([p2p.recv(flat[r * m : (r + 1) * m], r, group) for r in range(world) if r != ROOT])
    else:  # own, not input: an input that overlaps it in part was changed by the copy
        p2p.wait_all([p2p.send(own, ROOT, group)])
    _scatter_whole(flat, ROOT, group)
