"""The send/receive pipeline behind the segmented ring algorithms.

A schedule is a list of units; unit i sends one segment to the right neighbour and receives one
from the left, optionally reducing what arrived into place. Unit i sends what unit i - lag
received, so its send starts as soon as that unit is finished. Receives are posted ahead of
time, up to ``recv_ahead`` units beyond the last finished one, so a neighbour's data always finds
a posted receive and flows at once (over gloo a receive that is not yet posted costs a round
trip). NCCL queues a receive and a send on one stream, so there a unit's receive is posted
together with its send instead (``recv_ahead=0``).

Before unit i reduces, the send of unit i - lag is complete, so a buffer that unit i overwrites
has left the rank.

Every message goes to the same two neighbours, so their connections are looked up once per run
(:func:`commbench.comm.p2p.link`), not once per message.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from commbench.comm import p2p
from commbench.kernels import reduce_into

RECV_AHEAD = 64  # receives posted ahead on gloo, at most ...
RECV_AHEAD_BYTES = 128 << 20  # ... and at most this many bytes of segments: a ring's scratch holds them


def look_ahead(segment_bytes: int) -> int:
    """Receives to post ahead over gloo for segments of ``segment_bytes``: :data:`RECV_AHEAD`, fewer
    where that many would pass :data:`RECV_AHEAD_BYTES`, and at least one."""
    return max(1, min(RECV_AHEAD, RECV_AHEAD_BYTES // max(1, segment_bytes)))


def receives_ahead(group: dist.ProcessGroup | None, segment_bytes: int, device: torch.device) -> int:
    """How many receives to post ahead on the backend that moves ``device``'s tensors in ``group``
    (0 on NCCL, see above)."""
    return 0 if p2p.backend_for(group, device) == "nccl" else look_ahead(segment_bytes)


@dataclass(frozen=True)
class Unit:
    """One pipeline step. ``combine`` = (out, a): after the receive, out = a (op) recv."""

    send: torch.Tensor | None
    recv: torch.Tensor | None
    combine: tuple[torch.Tensor, torch.Tensor] | None = None


def run(
    units: list[Unit],
    *,
    right: int,
    left: int,
    lag: int,
    recv_ahead: int,
    op: str,
    group: dist.ProcessGroup | None,
) -> None:
    """Run ``units``; returns when every send and receive is complete.

    Args:
        lag: unit i sends data produced by unit i - lag (>= 1).
        recv_ahead: receives posted beyond the last finished unit; 0 pairs each receive with
            its unit's send.
    """
    if lag < 1 or recv_ahead < 0:
        raise ValueError(f"need lag >= 1 and recv_ahead >= 0, got {lag} and {recv_ahead}")
    n = len(units)
    if n == 0:
        return
    device = next((t.device for u in units for t in (u.send, u.recv) if t is not None), torch.device("cpu"))
    post_send, post_recv = p2p.link(group, right, left, device)
    sends: list[p2p.Work | None] = [None] * n
    recvs: list[p2p.Work | None] = [None] * n
    posted = 0  # receives posted so far (eager mode)
    done = 0

    def post_receives(upto: int) -> None:
        nonlocal posted
        while recv_ahead and posted < min(upto, n):
            recvs[posted] = post_recv(units[posted].recv)
            posted += 1

    def finish(j: int) -> None:
        if j >= lag and sends[j - lag] is not None:
            sends[j - lag].wait()
            sends[j - lag] = None  # a gloo work must be waited once: a second wait blocks
        if recvs[j] is not None:
            recvs[j].wait()
        unit = units[j]
        if unit.combine is not None and unit.recv is not None and unit.recv.numel() > 0:
            out, a = unit.combine
            reduce_into(out, a, unit.recv, op)

    # The first step's receives, its sends, then the rest of the look-ahead: every receive
    # posted costs a message of its own to the peer, and the first sends need none of them.
    post_receives(min(lag, recv_ahead))
    for i, unit in enumerate(units):
        if i == lag:
            post_receives(recv_ahead)
        while done <= i - lag:
            finish(done)
            done += 1
            post_receives(done + recv_ahead)
        if recv_ahead:
            sends[i] = post_send(unit.send)
        else:
            sends[i], recvs[i] = p2p.exchange(unit.send, right, unit.recv, left, group)
    while done < n:
        finish(done)
        done += 1
        post_receives(done + recv_ahead)
    p2p.wait_all(sends)
