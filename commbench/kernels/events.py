"""CUDA events for timing, made before the work they time."""

from __future__ import annotations

import torch


def timing_events(count: int) -> list[torch.cuda.Event]:
    """``count`` timing events on the current device, each already made.

    torch makes a CUDA event on its first ``record`` (a host call, cudaEventCreate). For an event
    that ends a timed call, that call falls between the work and the stamp, and a device done
    sooner (a copy or collective of a few KiB) waits through it: it was counted as the work's time.
    Each event here is recorded once, and the device waited for, before it is handed out.
    """
    events = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
    for event in events:
        event.record()
    torch.cuda.synchronize()
    return events
