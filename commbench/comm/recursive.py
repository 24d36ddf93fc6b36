"""Recursive doubling all-reduce: log2(n) rounds of pairwise full exchanges, for small messages.

For n not a power of two, the first 2(n - p) ranks pair up first: the even one hands its data to
the odd one and sits out, then gets the result back at the end (two extra rounds).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commbench.comm import p2p
from commbench.comm.chunking import (
    recursive_doubling_layout,
    recursive_doubling_rank,
    recursive_doubling_real,
)
from commbench.comm.workspace import Workspace, scratch
from commbench.kernels import reduce_into


def all_reduce(
    tensor: torch.Tensor,
    op: str,
    group: dist.ProcessGroup | None,
    *,
    workspace: Workspace | None = None,
) -> None:
    """Recursive doubling all-reduce of ``tensor`` in place."""
    rank, world = p2p.group_rank(group)
    flat = tensor.view(-1)
    if world > 1 and flat.numel() > 0:
        core, folded = recursive_doubling_layout(world)
        me = recursive_doubling_rank(rank, world)
        buf = scratch(workspace, "rd.recv", (flat.numel(),), flat)
        if me is None:  # folded: hand over, then wait for the result
            p2p.wait_all([p2p.send(flat, rank + 1, group)])
            p2p.wait_all([p2p.recv(flat, rank + 1, group)])
        else:
            if rank < 2 * folded:
                p2p.wait_all([p2p.recv(buf, rank - 1, group)])
                reduce_into(flat, flat, buf, op)
            mask = 1
            while mask < core:
                peer = recursive_doubling_real(me ^ mask, world)
                p2p.wait_all(list(p2p.exchange(flat, peer, buf, peer, group)))
                # a (op) b == b (op) a bit for bit, so both partners hold identical results.
                reduce_into(flat, flat, buf, op)
                mask <<= 1
            if rank < 2 * folded:
                p2p.wait_all([p2p.send(flat, rank - 1, group)])
    if op == "avg":
        tensor.div_(world)
