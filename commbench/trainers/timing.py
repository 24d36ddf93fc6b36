"""Per-step clocks and interval arithmetic for the step-time breakdown.

On CPU a stamp is ``time.perf_counter()``. On CUDA a stamp is an event recorded on the current
stream, so asynchronous GPU work is timed where it runs, not where Python launched it; the step
resolves its events once, after one synchronisation at its end. The events are made before the
step (see :func:`commbench.kernels.events.timing_events`), so no stamp waits for one to be made.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

from commbench.kernels.events import timing_events


class Clock:
    """Makes stamps and turns them into seconds since the step's first stamp.

    On CUDA it holds events made ahead, ``stamps_per_step`` to begin with, and tops them up after
    each step (in :meth:`settle`) to the most that one step has taken. A step that takes more than
    are left makes the rest as it records them, as torch does, with that host call in its times.
    Each event is recorded once: a stamp may be read after the step that took it.
    """

    def __init__(self, device: torch.device, stamps_per_step: int = 64) -> None:
        self.cuda = device.type == "cuda"
        self.per_step = stamps_per_step
        self.taken = 0  # stamps since the last settle
        self.spare: list[torch.cuda.Event] = timing_events(stamps_per_step) if self.cuda else []

    def stamp(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        self.taken += 1
        try:
            event = self.spare.pop()  # atomic: stamps also come from the sync's threads
        except IndexError:
            event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, origin: Any, stamp: Any) -> float:
        """Seconds from ``origin`` to ``stamp`` (both from this clock; CUDA: after ``settle``)."""
        if not self.cuda:
            return stamp - origin
        return origin.elapsed_time(stamp) / 1e3

    def settle(self) -> None:
        """Wait until every recorded stamp has happened, then make the next step's events (CUDA);
        nothing to do on CPU."""
        if self.cuda:
            torch.cuda.synchronize()
            self.per_step, self.taken = max(self.per_step, self.taken), 0
            if len(self.spare) < self.per_step:
                self.spare += timing_events(self.per_step - len(self.spare))


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
