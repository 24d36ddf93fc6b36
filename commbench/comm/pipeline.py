"""A windowed send/receive pipeline: the engine behind the segmented ring algorithms.

A schedule is a list of units; unit i sends one segment to the right neighbour and receives one
from the left, optionally reducing what arrived into place. Unit i may depend on what unit
i - window received, so at most ``window`` units are in flight, and the send of unit i - window
is complete before unit i starts (its buffer may be overwritten by unit i).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from commbench.comm import p2p
from commbench.kernels import reduce_into


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
    window: int,
    op: str,
    group: dist.ProcessGroup | None,
) -> None:
    """Run ``units`` in order with up to ``window`` in flight; returns when all are done."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    sends: list[p2p.Work | None] = []
    recvs: deque[p2p.Work | None] = deque()
    done = 0
    for unit in units:
        if len(sends) >= window:
            # Keep the window: finish the oldest unit before starting a new one.
            _finish(units[done], recvs.popleft(), op)
            done += 1
            old = len(sends) - window
            if sends[old] is not None:
                sends[old].wait()
                sends[old] = None  # a gloo work must be waited once: a second wait blocks
        send_work, recv_work = p2p.exchange(unit.send, right, unit.recv, left, group)
        sends.append(send_work)
        recvs.append(recv_work)
    while recvs:
        _finish(units[done], recvs.popleft(), op)
        done += 1
    p2p.wait_all(sends)


def _finish(unit: Unit, recv_work: p2p.Work | None, op: str) -> None:
    if recv_work is not None:
        recv_work.wait()
    if unit.combine is not None and unit.recv is not None and unit.recv.numel() > 0:
        out, a = unit.combine
        reduce_into(out, a, unit.recv, op)
