"""Compute on demand: matrix multiplications sized to a requested FLOP count, to stand in for a model's
work between communication phases and to measure what the device achieves."""

from __future__ import annotations

import math
import time

import torch

from commbench.kernels.events import timing_events

MAX_DIM = {"cpu": 512, "cuda": 4096}  # one matmul of n^3 stays short on each device
MIN_DIM = 8


def matmul_plan(flops: float, device_type: str) -> tuple[int, int]:
    """(n, repeats): the fewest square n x n matmuls (2 n^3 FLOPs each, n from MIN_DIM to the
    device's cap) whose FLOPs can add up to ``flops``, with the n that brings their total closest.

    Fewest first, as large matmuls measure the device better than many small ones. Past the cap
    the count is rounded up, so each matmul keeps at least half the cap's FLOPs and the total is
    within about 1.5 / n of ``flops`` (a count rounded to the nearest could miss by a third).
    """
    if not (math.isfinite(flops) and flops > 0):
        raise ValueError(f"flops must be positive and finite, got {flops!r}")
    cap = MAX_DIM.get(device_type, MAX_DIM["cpu"])
    repeats = max(1, math.ceil(flops / (2 * cap**3)))
    root = (flops / (2 * repeats)) ** (1 / 3)  # the n at which the total would be exact
    # Of the whole numbers either side of it, the nearer in FLOPs (cubes grow unevenly, so not
    # always the nearer in n); in floats, so a total past the float range compares as inf.
    sides = (min(cap, max(MIN_DIM, k)) for k in (math.floor(root), math.floor(root) + 1))
    n = min(sides, key=lambda k: abs(2.0 * repeats * k**3 - flops))
    return n, repeats


def burn_flops(
    flops: float, device: str | torch.device = "cpu", *, dtype: torch.dtype = torch.float32
) -> tuple[float, float]:
    """Do about ``flops`` floating-point operations of matmul on ``device``, timed, after one
    untimed matmul of the same size.

    Returns:
        (seconds, achieved_flops_per_s): wall time on CPU, CUDA-event time on CUDA; the rate counts
        the FLOPs actually done (whole matmuls), which may differ slightly from ``flops``.
    """
    dev = torch.device(device)
    if dev.type not in MAX_DIM:
        raise ValueError(f"burn_flops runs on cpu or cuda, not {dev.type!r}")
    n, repeats = matmul_plan(flops, dev.type)
    a = torch.rand(n, n, device=dev, dtype=dtype)
    b = torch.rand(n, n, device=dev, dtype=dtype)
    out = torch.empty(n, n, device=dev, dtype=dtype)
    # One untimed matmul first: the first on a device also sets up its library (cuBLAS handle and
    # workspace, kernel loading; on CPU the thread pool), which is no part of the rate measured.
    torch.mm(a, b, out=out)
    if dev.type == "cuda":
        with torch.cuda.device(dev):  # events belong to the device the matmuls run on
            start, end = timing_events(2)  # and the device waited for
            start.record()
            for _ in range(repeats):
                torch.mm(a, b, out=out)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b, out=out)
        seconds = time.perf_counter() - t0
    seconds = max(seconds, 1e-9)
    return seconds, repeats * 2 * n**3 / seconds
