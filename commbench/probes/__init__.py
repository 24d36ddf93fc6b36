"""What the hardware says happened: NVML and host samplers, cumulative counters read at phase
boundaries, link maxima, and computed-versus-measured wire-byte checks.

- :mod:`~commbench.probes.nvml`: the one wrapper over NVML (unsupported -> None, never 0).
- :mod:`~commbench.probes.host`: interface, CPU and memory readings through psutil.
- :mod:`~commbench.probes.sampler`: a background sampler with phase markers -> :class:`Timeline`.
- :mod:`~commbench.probes.links`: PCIe/NVLink maxima and :class:`ImpossibleReading`.
- :mod:`~commbench.probes.wirecheck`: expected TCP overhead and tolerance per interconnect.
"""

from commbench.probes.host import nic_delta, nic_for_address, read_nic, selected_nic
from commbench.probes.links import ImpossibleReading, check_rate, nvlink_max_gbps, pcie_max_gbps
from commbench.probes.nvml import Nvml, nvml_unavailable_reason
from commbench.probes.sampler import PhaseBytes, Sampler, Timeline
from commbench.probes.wirecheck import TOLERANCES, WireCheck, compare, expected_overhead

__all__ = [
    "TOLERANCES",
    "ImpossibleReading",
    "Nvml",
    "PhaseBytes",
    "Sampler",
    "Timeline",
    "WireCheck",
    "check_rate",
    "compare",
    "expected_overhead",
    "nic_delta",
    "nic_for_address",
    "nvlink_max_gbps",
    "nvml_unavailable_reason",
    "pcie_max_gbps",
    "read_nic",
    "selected_nic",
]
