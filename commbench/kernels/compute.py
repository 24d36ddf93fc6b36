"""Compute on demand: matrix multiplications sized to a requested FLOP count, to stand in for a model's
work between communication phases and to measure what the device achieves."""

from __future__ import annotations

import math
import time

import torch

MAX_DIM = {"cpu": 512, "cuda": 4096}  # one matmul of n^3 stays short on each device
MIN_DIM = 8


def matmul_plan(flops: float, device_type: str) -> tuple[int, int]:
    """(n, repeats): square n x n matmuls (2 n^3 FLOPs each) whose total is closest to ``flops``."""
    if not (math.isfinite(flops) and flops > 0):
        raise ValueError(f"flops must be positive and finite, got {flops!r}")
    cap = MAX_DIM.get(device_type, MAX_DIM["cpu"])
    n = min(cap, max(MIN_DIM, round((flops / 2) ** (1 / 3))))
    repeats = max(1, round(flops / (2 * n**3)))
    return n, repeats


def burn_flops(
    flops: float, device: str | torch.device = "cpu", *, dtype: torch.dtype = torch.float32
) -> tuple[float, float]:
    """Do about ``flops`` floating-point operations of matmul on ``device``.

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
    if dev.type == "cuda":
        with torch.cuda.device(dev):  # events belong to the device the matmuls run on
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
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
