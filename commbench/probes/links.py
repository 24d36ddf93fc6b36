"""Link maxima (GB/s = 10^9 bytes a second, per direction) and the check that turns a reading above
them into an error: a rate no link can carry is a broken measurement, not a result."""

from __future__ import annotations

import math

# Per lane and direction after line encoding (8b/10b to gen2, 128b/130b from gen3, FLIT from gen6).
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
PCIE_WIDTHS = (1, 2, 4, 8, 12, 16, 32)

# Per link and direction: NVLink 1 (P100) 20, 2 (V100) 25, 3 (A100) 25, 4 (H100) 25, 5 (B200) 50.
NVLINK_LINK_GBPS = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}

DEFAULT_MARGIN = 0.05  # counters and clocks are not exact; 5% above the maximum is still believed


class ImpossibleReading(RuntimeError):
    """A measured rate above what the link can carry (or a negative byte count)."""


def pcie_max_gbps(generation: int, width: int) -> float:
    """Per-direction payload maximum of a PCIe link, e.g. gen4 x16 -> 31.5 GB/s."""
    if generation not in PCIE_LANE_GBPS:
        raise ValueError(f"unknown PCIe generation {generation!r}; known: {sorted(PCIE_LANE_GBPS)}")
    if width not in PCIE_WIDTHS:
        raise ValueError(f"PCIe width must be one of {PCIE_WIDTHS}, got {width!r}")
    return PCIE_LANE_GBPS[generation] * width


def nvlink_max_gbps(links: int, generation_or_per_link: int | float) -> float:
    """Per-direction maximum of ``links`` NVLinks. An ``int`` is the NVLink generation (1-5);
    a ``float`` is the per-link, per-direction GB/s itself (e.g. from a data sheet)."""
    if isinstance(links, bool) or not isinstance(links, int) or links < 1:
        raise ValueError(f"links must be a positive whole number, got {links!r}")
    g = generation_or_per_link
    if isinstance(g, bool):
        raise ValueError(f"not an NVLink generation or per-link rate: {g!r}")
    if isinstance(g, int):
        if g not in NVLINK_LINK_GBPS:
            raise ValueError(f"unknown NVLink generation {g}; known: {sorted(NVLINK_LINK_GBPS)}")
        return links * NVLINK_LINK_GBPS[g]
    if not (isinstance(g, float) and math.isfinite(g) and g > 0):
        raise ValueError(f"per-link GB/s must be a positive finite float, got {g!r}")
    return links * g


def check_rate(
    measured_bytes: float,
    seconds: float,
    max_gbps: float | None,
    *,
    margin: float = DEFAULT_MARGIN,
    what: str = "link",
    burst_bytes: int = 0,
) -> float:
    """The measured rate in GB/s; raises :class:`ImpossibleReading` when it exceeds ``max_gbps`` by
    more than ``margin`` (a fraction), beside the ``burst_bytes`` a shaped link lets through at
    once (its token bucket, full after an idle spell), or the byte count is negative.
    ``max_gbps`` None checks only the sign."""
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"seconds must be positive and finite, got {seconds!r}")
    if not math.isfinite(measured_bytes) or measured_bytes < 0:
        raise ImpossibleReading(f"{what}: {measured_bytes!r} bytes measured in {seconds:.6g} s")
    gbps = measured_bytes / seconds / 1e9
    if max_gbps is not None and measured_bytes > max_gbps * 1e9 * seconds * (1 + margin) + burst_bytes:
        bucket = f" and a burst of {burst_bytes} bytes" if burst_bytes else ""
        raise ImpossibleReading(
            f"{what}: {_gbps(gbps)} GB/s measured ({measured_bytes:.0f} bytes in {seconds:.6g} s) exceeds "
            f"the link maximum of {_gbps(max_gbps)} GB/s by more than {margin:.0%}{bucket}"
        )
    return gbps


def _gbps(value: float) -> str:
    """A rate in GB/s to three decimals, or three figures below 0.1 (a 10 Mbit/s link's 0.00125
    and a reading above it were both "0.001")."""
    return f"{value:.3f}" if value >= 0.1 else f"{value:.3g}"
