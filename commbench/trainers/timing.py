"""Per-step clocks and interval arithmetic for the step-time breakdown.

On CPU a stamp is ``time.perf_counter()``. On CUDA a stamp is an event recorded on the current
stream, so asynchronous GPU work is timed where it runs, not where Python launched it; the step
resolves its events once, after one synchronisation at its end.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch


class Clock:
    """Makes stamps and turns them into seconds since the step's first stamp."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def stamp(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, origin: Any, stamp: Any) -> float:
        """Seconds from ``origin`` to ``stamp`` (both from this clock; CUDA: after ``settle``)."""
        if not self.cuda:
            return stamp - origin
        return origin.elapsed_time(stamp) / 1e3

    def settle(self) -> None:
        """Wait until every recorded stamp has happened (CUDA); nothing to do on CPU."""
        if self.cuda:
            torch.cuda.synchronize()


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def overlap_length(intervals: Iterable[tuple[float, float]], window: tuple[float, float]) -> float:
    """Length of the intervals' union that falls inside ``window``."""
    lo, hi = window
    return union_length((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo))
