"""Binomial trees: broadcast and reduce in ceil(log2 n) rounds, for small messages."""

from __future__ import annotations

import torch
import torch.distributed as dist

from commbench.comm import p2p
from commbench.comm.chunking import binomial_children, binomial_parent
from commbench.comm.workspace import Workspace, scratch
from commbench.kernels import reduce_into


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: dist.ProcessGroup | None,
    *,
    workspace: Workspace | None = None,
) -> None:
    """Each rank receives from its parent, then forwards to its children, farthest first."""
    rank, world = p2p.group_rank(group)
    flat = tensor.view(-1)
    if world == 1 or flat.numel() == 0:
        return
    rel = (rank - src) % world
    parent = binomial_parent(rel)
    if parent is not None:
        p2p.wait_all([p2p.recv(flat, (parent + src) % world, group)])
    p2p.wait_all([p2p.send(flat, (c + src) % world, group) for c in binomial_children(rel, world)])


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: str,
    group: dist.ProcessGroup | None,
    *,
    workspace: Workspace | None = None,
) -> None:
    """Children's partial results flow up to ``dst``; other tensors stay unchanged."""
    rank, world = p2p.group_rank(group)
    flat = tensor.view(-1)
    if world > 1 and flat.numel() > 0:
        rel = (rank - dst) % world
        children = binomial_children(rel, world)
        bufs = scratch(workspace, "tree.recv", (len(children), flat.numel()), flat)
        works = [p2p.recv(b, (c + dst) % world, group) for b, c in zip(bufs, children, strict=True)]
        acc = flat
        # Nearest child first: it finishes earliest.
        for buf, work in reversed(list(zip(bufs, works, strict=True))):
            if work is not None:
                work.wait()
            # Off the destination the caller's tensor is only read: partial sums go to a copy.
            if acc is flat and rank != dst:
                out = scratch(workspace, "tree.acc", (flat.numel(),), flat)
            else:
                out = acc
            reduce_into(out, acc, buf, op)
            acc = out
        parent = binomial_parent(rel)
        if parent is not None:
            p2p.wait_all([p2p.send(acc, (parent + dst) % world, group)])
    if op == "avg" and rank == dst:
        tensor.div_(world)
