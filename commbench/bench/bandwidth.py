"""``commbench bandwidth``: local copy bandwidth next to what the link allows, so every later number
has a ceiling it can be read against (on CUDA, the PCIe generation and width NVML reports)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import sys
from typing import Any

from commbench.bench import signals
from commbench.bench.records import output_path
from commbench.kernels.copy import D2H_PINNED, H2D_PINNED, OVER_PCIE, CopyResult, each_copy
from commbench.probes.links import ImpossibleReading, check_rate, pcie_max_gbps
from commbench.units import format_size
from commbench.units import size_argument as _size

# A PCIe TLP with 128-256 bytes of payload carries about 24 bytes of header, sequence number, CRC
# and framing, so pinned copies reach 84-91% of the encoded link rate; 85% is what to expect.
PCIE_PAYLOAD_EFFICIENCY = 0.85
WARMUP = 2
MAX_ITERS = 1_000_000  # more copies add nothing to a median, and keep one time each in memory
CPU_LIMIT_NOTE = (
    "limit n/a on CPU: the memory system's peak (channels x speed) has no portable source, so "
    "host->host copies have no ceiling here"
)
PAGEABLE_NOTE = (
    "pageable copies are staged by the driver through pinned buffers, so their speed depends on host "
    "memcpy and no expectation is given"
)
D2D_NOTE = "device->device is bounded by device memory bandwidth, which is not read here"


@dataclasses.dataclass(frozen=True, kw_only=True)
class BandwidthRecord:
    """One copy kind, as written to ``--json``."""

    device: str
    name: str
    size_bytes: int
    iters: int
    time_s: float
    gbps: float
    expected_gbps: float | None
    limit_gbps: float | None
    limit_source: str | None
    type: str = "bandwidth"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``commbench bandwidth`` on the CLI's subparsers."""
    p = subparsers.add_parser(
        "bandwidth",
        help="copy bandwidth: host memory on CPU; host<->device (pinned, pageable) and device->device on "
        "CUDA, against the link's maximum",
        description="Time memory copies and print measured, expected and limit GB/s (10^9 bytes/s, "
        "each copied byte counted once; the time is the median of --iters copies). On CPU: "
        "host->host. On CUDA: host->device and device->host from pinned and pageable memory, and "
        "device->device; the limit is the PCIe generation x width NVML reports.",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to copy (default cpu)")
    p.add_argument(
        "--size",
        type=_size,
        default=_size("64M"),
        help="bytes per copy, or with a K/M/G suffix (2^10, 2^20, 2^30 bytes); default 64M",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=10,
        help=f"timed copies per kind, at most {MAX_ITERS}; the median is shown (default 10)",
    )
    p.add_argument(
        "--json",
        type=output_path,
        default=None,
        help="write JSON Lines here (header, then one record per copy kind)",
    )
    return p


def _pcie_limit(device_index: int) -> tuple[float | None, str]:
    """The per-direction PCIe maximum of CUDA device ``device_index`` and where it came from."""
    import torch

    from commbench.probes.nvml import Nvml

    nvml, reason = Nvml.open_with_reason()
    if nvml is None:
        return None, f"limit n/a: {reason}"
    with nvml:
        props = torch.cuda.get_device_properties(device_index)
        bus = (
            getattr(props, "pci_domain_id", 0),
            getattr(props, "pci_bus_id", -1),
            getattr(props, "pci_device_id", -1),
        )
        index = nvml.index_for_pci_bus_id(*bus)
        note = ""
        if index is None:
            index, note = device_index, f" (PCI location not matched; NVML device {device_index} assumed)"
        if index >= len(nvml.devices):
            return None, f"limit n/a: NVML lists no device {index}"
        info = nvml.devices[index]
        gen, width = info.pcie_max_generation, info.pcie_max_width
        if gen is None or width is None:
            return None, "limit n/a: NVML does not report this GPU's PCIe generation and width"
        try:
            return pcie_max_gbps(gen, width), f"limit: PCIe gen{gen} x{width} per direction, from NVML{note}"
        except ValueError as exc:
            return None, f"limit n/a: {exc}"


def expected_gbps(result: CopyResult) -> float | None:
    """What a healthy system should reach: pinned PCIe copies ~85% of the link; others unknown."""
    if result.name in (H2D_PINNED, D2H_PINNED) and result.limit_gbps is not None:
        return result.limit_gbps * PCIE_PAYLOAD_EFFICIENCY
    return None


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def format_table(records: list[BandwidthRecord]) -> str:
    """The records as an aligned text table."""
    head = ("copy", "size", "time_us", "measured_GB/s", "expected_GB/s", "limit_GB/s")
    rows = [
        (
            r.name,
            format_size(r.size_bytes),
            f"{r.time_s * 1e6:.1f}",
            _fmt(r.gbps),
            _fmt(r.expected_gbps),
            _fmt(r.limit_gbps),
        )
        for r in records
    ]
    widths = [max(len(str(row[i])) for row in [head, *rows]) for i in range(len(head))]
    lines = [
        "  ".join(
            str(c).rjust(w) if i else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in [head, *rows]
    ]
    return "\n".join(lines)


def _stops_interrupt() -> contextlib.AbstractContextManager:
    """SIGTERM and SIGHUP raise Interrupted (as Ctrl-C raises KeyboardInterrupt), so the CLI ends
    the run in one line with exit 143 or 129; the old handlers come back after (main thread only)."""
    from commbench.bench.launch import Interrupted

    def on_stop(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    return signals.handled((signal.SIGTERM, signal.SIGHUP), on_stop)


def run(args: argparse.Namespace) -> int:
    """Run ``commbench bandwidth``; bad input raises ValueError, an impossible reading returns 1."""
    import psutil
    import torch

    from commbench.bench.records import RecordWriter, check_writable

    if args.size < 1:
        raise ValueError(f"--size must be at least 1 byte, got {args.size}")
    if not 1 <= args.iters <= MAX_ITERS:
        raise ValueError(f"--iters must be in 1..{MAX_ITERS}, got {args.iters}")
    if 2 * args.size > psutil.virtual_memory().available:
        raise ValueError(
            f"--size {format_size(args.size)}: two buffers of it do not fit in available host memory"
        )
    if args.json:
        check_writable(args.json)
    notes: list[str] = []
    limit: float | None = None
    limit_source: str | None = None
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda asked for, but CUDA is not available here")
        index = torch.cuda.current_device()
        free, _ = torch.cuda.mem_get_info(index)
        if 2 * args.size > free:
            raise ValueError(
                f"--size {format_size(args.size)}: two buffers of it do not fit in free GPU memory"
            )
        limit, limit_source = _pcie_limit(index)
        notes += [limit_source, PAGEABLE_NOTE, D2D_NOTE]
        device = torch.device("cuda", index)
    else:
        notes.append(CPU_LIMIT_NOTE)
        device = torch.device("cpu")
    writer = RecordWriter(args.json, None)  # no file when --json is not given
    records: list[BandwidthRecord] = []
    impossible = None
    try:
        with _stops_interrupt():
            if args.json:
                from commbench.bench.machine import machine_info

                # first, so a stopped run still has a valid file
                writer.header(machine_info(command=getattr(args, "command_line", None)))
            results = each_copy(args.size, device, iters=args.iters, warmup=WARMUP, pcie_limit_gbps=limit)
            for r in results:  # each kind written as it comes: a stopped run keeps the finished ones
                try:  # a copy faster than its link is a broken measurement: an error, never a record
                    check_rate(r.size_bytes, r.time_s, r.limit_gbps, what=r.name)
                except ImpossibleReading as exc:
                    impossible = exc
                    break
                records.append(
                    BandwidthRecord(
                        device=args.device,
                        name=r.name,
                        size_bytes=r.size_bytes,
                        iters=args.iters,
                        time_s=r.time_s,
                        gbps=r.gbps,
                        expected_gbps=expected_gbps(r),
                        limit_gbps=r.limit_gbps,
                        limit_source=limit_source if r.name in OVER_PCIE else None,
                    )
                )
                writer.write(records[-1])
    finally:
        writer.close()
        if records:  # stopped or not, the kinds measured are shown (without --json, only here)
            print(format_table(records))
            for note in notes:
                print(f"  {note}")
            sys.stdout.flush()
    if impossible is not None:
        print(f"commbench: impossible reading: {impossible}", file=sys.stderr)
        return 1
    return 0
