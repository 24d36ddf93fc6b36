"""Copy bandwidth: host memory on CPU; host<->device from pinned and pageable memory and
device->device on CUDA, timed with CUDA events. GB/s counts each copied byte once (10^9 bytes/s)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from commbench.kernels.events import timing_events
from commbench.units import whole_number

HOST_TO_HOST = "host->host"
H2D_PINNED = "host->device pinned"
H2D_PAGEABLE = "host->device pageable"
D2H_PINNED = "device->host pinned"
D2H_PAGEABLE = "device->host pageable"
DEVICE_TO_DEVICE = "device->device"
OVER_PCIE = (H2D_PINNED, H2D_PAGEABLE, D2H_PINNED, D2H_PAGEABLE)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CopyResult:
    """One copy kind: median time of one copy of ``size_bytes``, its GB/s, and the link maximum
    it is bounded by (None where unknown)."""

    name: str
    size_bytes: int
    time_s: float
    gbps: float
    limit_gbps: float | None


def _check(size_bytes: int, iters: int, warmup: int) -> tuple[int, int, int]:
    """The three as Python ints, or ValueError naming the first that is not a whole number in range."""
    size, rounds, first = whole_number(size_bytes), whole_number(iters), whole_number(warmup)
    if size is None or size < 1:
        raise ValueError(f"size_bytes must be a whole number >= 1, got {size_bytes!r}")
    if rounds is None or rounds < 1:
        raise ValueError(f"iters must be >= 1, got {iters!r}")
    if first is None or first < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup!r}")
    return size, rounds, first


def _result(name: str, size_bytes: int, times: list[float], limit_gbps: float | None) -> CopyResult:
    t = statistics.median(times)
    return CopyResult(
        name=name, size_bytes=size_bytes, time_s=t, gbps=size_bytes / t / 1e9, limit_gbps=limit_gbps
    )


def host_copy(size_bytes: int, *, iters: int = 10, warmup: int = 2) -> CopyResult:
    """Host memory to host memory with ``Tensor.copy_``, timed on the wall clock."""
    size_bytes, iters, warmup = _check(size_bytes, iters, warmup)
    src = torch.ones(size_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        elapsed = time.perf_counter() - t0
        if i >= warmup:
            times.append(max(elapsed, 1e-9))
    return _result(HOST_TO_HOST, size_bytes, times, None)


_cycles_per_s: float | None = None


def _gpu_cycles_per_s() -> float:
    """The rate of the clock ``torch.cuda._sleep`` counts, measured once: a spin of 10^6 cycles."""
    global _cycles_per_s
    if _cycles_per_s is None:
        start, end = timing_events(2)
        torch.cuda._sleep(1000)  # the spin kernel loaded before it is timed
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        _cycles_per_s = 1e6 / max(start.elapsed_time(end) / 1e3, 1e-6)
    return _cycles_per_s


def _hold_stream(seconds: float) -> None:
    """Keep the current stream busy for about ``seconds`` (a spin kernel), so the host can queue
    the timed calls behind it and the device runs them back to back."""
    torch.cuda._sleep(int(seconds * _gpu_cycles_per_s()))


# Timed calls queued behind one spin: three launches each (two events and the copy), well within
# the thousand or so a stream holds before the host's next launch waits for room. Queued beyond
# that, the host fed the queue one launch at a time as the device emptied it, and a copy of a few
# KiB was timed with its launch again (on an H100, 4 KiB device->device read 3.3 us a copy at
# --iters 10 and 16.2 us at --iters 5000).
QUEUED_CALLS = 256


def _cuda_time(copy: Callable[[], object], iters: int, warmup: int, *, queued: bool = True) -> list[float]:
    """Seconds of each timed call of ``copy``, from CUDA events on the current stream.

    ``queued``: the copy returns before the device has run it (pinned and device copies), so the
    timed calls are queued behind a spin long enough to queue them all, :data:`QUEUED_CALLS` at a
    time: each then starts as soon as the one before it ends, not when the host gets to launch
    it. A copy of a few KiB takes the device a few microseconds and the host longer to launch, and
    its time was the launch's. A pageable copy waits for the device before it returns: the host's
    staging is part of it.
    """
    host_s = []
    for _ in range(warmup):
        t0 = time.perf_counter()
        copy()
        host_s.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    # The launches' host time, measured in the warm-up (50 us each without one), three times over
    # for the events between them and for any hiccup, and a millisecond more.
    per_call = statistics.median(host_s) if host_s else 50e-6
    times: list[float] = []
    for first in range(0, iters, QUEUED_CALLS):
        calls = min(QUEUED_CALLS, iters - first)
        events = timing_events(2 * calls)
        pairs = list(zip(events[::2], events[1::2], strict=True))
        if queued:
            _hold_stream(1e-3 + 3 * calls * per_call)
        for start, end in pairs:
            start.record()
            copy()
            end.record()
        torch.cuda.synchronize()
        times += [max(s.elapsed_time(e) / 1e3, 1e-9) for s, e in pairs]
    return times


def cuda_copies(
    size_bytes: int,
    *,
    iters: int = 10,
    warmup: int = 2,
    device: torch.device | str | int | None = None,
    pcie_limit_gbps: float | None = None,
) -> tuple[CopyResult, ...]:
    """The five copies of :func:`iter_cuda_copies`, all measured."""
    return tuple(
        iter_cuda_copies(
            size_bytes, iters=iters, warmup=warmup, device=device, pcie_limit_gbps=pcie_limit_gbps
        )
    )


def iter_cuda_copies(
    size_bytes: int,
    *,
    iters: int = 10,
    warmup: int = 2,
    device: torch.device | str | int | None = None,
    pcie_limit_gbps: float | None = None,
) -> Iterator[CopyResult]:
    """Host->device and device->host from pinned and pageable memory, and device->device.

    Args:
        device: the CUDA device (default the current one).
        pcie_limit_gbps: per-direction PCIe maximum, attached to the four host<->device results.
    """
    size_bytes, iters, warmup = _check(size_bytes, iters, warmup)
    if not torch.cuda.is_available():
        raise ValueError("CUDA copies asked for, but CUDA is not available here")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    with torch.cuda.device(dev):
        gpu = torch.ones(size_bytes, dtype=torch.uint8, device=dev)
        gpu2 = torch.empty_like(gpu)
        pinned = torch.ones(size_bytes, dtype=torch.uint8).pin_memory()
        pageable = torch.ones(size_bytes, dtype=torch.uint8)
        cases: list[tuple[str, Callable[[], object]]] = [
            (H2D_PINNED, lambda: gpu.copy_(pinned, non_blocking=True)),
            (H2D_PAGEABLE, lambda: gpu.copy_(pageable)),
            (D2H_PINNED, lambda: pinned.copy_(gpu, non_blocking=True)),
            (D2H_PAGEABLE, lambda: pageable.copy_(gpu)),
            (DEVICE_TO_DEVICE, lambda: gpu2.copy_(gpu)),
        ]
        for name, copy in cases:
            limit = pcie_limit_gbps if name in OVER_PCIE else None
            queued = name not in (H2D_PAGEABLE, D2H_PAGEABLE)
            yield _result(name, size_bytes, _cuda_time(copy, iters, warmup, queued=queued), limit)


def copy_bandwidth(
    size_bytes: int,
    device: str | torch.device = "cpu",
    *,
    iters: int = 10,
    warmup: int = 2,
    pcie_limit_gbps: float | None = None,
) -> tuple[CopyResult, ...]:
    """Every copy kind that applies to ``device``: host->host on CPU, the five CUDA copies on CUDA."""
    return tuple(each_copy(size_bytes, device, iters=iters, warmup=warmup, pcie_limit_gbps=pcie_limit_gbps))


def each_copy(
    size_bytes: int,
    device: str | torch.device = "cpu",
    *,
    iters: int = 10,
    warmup: int = 2,
    pcie_limit_gbps: float | None = None,
) -> Iterator[CopyResult]:
    """The kinds of :func:`copy_bandwidth`, each as soon as it is measured (a caller that writes
    them as they come keeps the finished ones when the run is stopped)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return iter([host_copy(size_bytes, iters=iters, warmup=warmup)])
    if dev.type == "cuda":
        return iter_cuda_copies(
            size_bytes,
            iters=iters,
            warmup=warmup,
            device=dev if dev.index is not None else None,
            pcie_limit_gbps=pcie_limit_gbps,
        )
    raise ValueError(f"copies are measured on cpu or cuda, not {dev.type!r}")
