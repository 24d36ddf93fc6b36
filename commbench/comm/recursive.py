"""All-reduce by pairwise exchanges over a power-of-two core of ranks.

- ``rd``, recursive doubling: log2(p) rounds, each a full exchange of the message, for small
  messages.
- ``hd``, recursive halving then doubling: a reduce-scatter whose partners swap half of what
  they hold each round, then an all-gather that retraces the rounds. It moves what a ring moves,
  2(p-1)/p of the message per rank, in 2 log2(p) rounds where a ring takes 2(p-1).

For n ranks not a power of two, the first 2(n - p) ranks pair up first: the even one hands its
data to the odd one and sits out, then gets the result back at the end (two extra rounds).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from commbench.comm import p2p
from commbench.comm.chunking import (
    halving_schedule,
    recursive_doubling_layout,
    recursive_doubling_rank,
    recursive_doubling_real,
)
from commbench.comm.workspace import Workspace, scratch
from commbench.kernels import reduce_into

# (flat, receive scratch, core rank, core size, world size, op, group): the rounds on the core
Rounds = Callable[..., None]


def _over_core(
    tensor: torch.Tensor,
    op: str,
    group: dist.ProcessGroup | None,
    workspace: Workspace | None,
    name: str,
    core_scratch: Callable[[int], int],
    rounds: Rounds,
) -> None:
    """Fold the ranks beyond the power-of-two core in, run ``rounds`` on the core, hand results
    back. ``core_scratch(count)`` is the receive scratch (elements) a core rank needs that takes
    no fold; one that takes a fold needs ``count``."""
    rank, world = p2p.group_rank(group)
    flat = tensor.view(-1)
    count = flat.numel()
    if world > 1 and count > 0:
        core, folded = recursive_doubling_layout(world)
        me = recursive_doubling_rank(rank, world)
        if me is None:  # folded: hand over, then wait for the result
            p2p.wait_all([p2p.send(flat, rank + 1, group)])
            p2p.wait_all([p2p.recv(flat, rank + 1, group)])
        else:
            takes_fold = rank < 2 * folded
            buf = scratch(workspace, name, (count if takes_fold else core_scratch(count),), flat)
            if takes_fold:
                p2p.wait_all([p2p.recv(buf, rank - 1, group)])
                reduce_into(flat, flat, buf, op)
            rounds(flat, buf, me, core, world, op, group)
            if takes_fold:
                p2p.wait_all([p2p.send(flat, rank - 1, group)])
    if op == "avg":
        tensor.div_(world)


def _doubling(flat, buf, me, core, world, op, group) -> None:
    mask = 1
    while mask < core:
        peer = recursive_doubling_real(me ^ mask, world)
        p2p.wait_all(list(p2p.exchange(flat, peer, buf, peer, group)))
        # Both partners reduce (lower rank's data) op (higher rank's): max and min of -0.0 and +0.0
        # depend on the order, and took it differently at different sizes, so partners disagreed.
        if me < (me ^ mask):
            reduce_into(flat, flat, buf, op)
        else:
            reduce_into(flat, buf, flat, op)
        mask <<= 1


def _halving_doubling(flat, buf, me, core, world, op, group) -> None:
    rounds = halving_schedule(me, core, flat.numel())
    for partner, (k0, k1), (g0, g1) in rounds:
        peer = recursive_doubling_real(partner, world)
        kept = flat[k0:k1]
        part = buf[: k1 - k0]
        p2p.wait_all(list(p2p.exchange(flat[g0:g1], peer, part, peer, group)))
        reduce_into(kept, kept, part, op)  # only this rank reduces this span: no order to agree on
    lo, hi = rounds[-1][1] if rounds else (0, flat.numel())
    for partner, _, (g0, g1) in reversed(rounds):
        peer = recursive_doubling_real(partner, world)
        p2p.wait_all(list(p2p.exchange(flat[lo:hi], peer, flat[g0:g1], peer, group)))
        lo, hi = min(lo, g0), max(hi, g1)


def all_reduce(
    tensor: torch.Tensor,
    op: str,
    group: dist.ProcessGroup | None,
    *,
    workspace: Workspace | None = None,
) -> None:
    """Recursive doubling all-reduce of ``tensor`` in place."""
    _over_core(tensor, op, group, workspace, "rd.recv", lambda count: count, _doubling)


def halving_doubling_all_reduce(
    tensor: torch.Tensor,
    op: str,
    group: dist.ProcessGroup | None,
    *,
    workspace: Workspace | None = None,
) -> None:
    """Recursive halving then doubling all-reduce of ``tensor`` in place."""
    _over_core(tensor, op, group, workspace, "hd.recv", lambda count: (count + 1) // 2, _halving_doubling)
