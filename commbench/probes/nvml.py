"""One small lazy wrapper over nvidia-ml-py (``pynvml``): what the device does not support reads as
None, never as 0, and one failing reading never loses the others.

Cumulative byte counters come from NVML field values (PCIe count TX/RX bytes, NVLink data
throughput TX/RX in KiB summed over all links); each reading keeps the width its value type gives it
so that a difference across a wrap is still right (:meth:`Counter.bytes_since`).
``nvmlDeviceGetPcieThroughput`` (a 20 ms sample, in KB/s) is used only where the PCIe byte counters
are missing, and is labelled an estimate.
"""

from __future__ import annotations

import ctypes
import dataclasses
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

# Field ids (nvml.h); the module's own constants win where it has them.
_FIELD_DEFAULTS = {
    "NVML_FI_DEV_PCIE_COUNT_TX_BYTES": 197,
    "NVML_FI_DEV_PCIE_COUNT_RX_BYTES": 198,
    "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX": 138,
    "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX": 139,
    "NVML_FI_DEV_NVLINK_LINK_COUNT": 91,
}
ALL_LINKS = 0xFFFFFFFF  # scopeId UINT_MAX: the NVLink throughput counters summed over every link
KIB = 1024

# valueType -> (union member, bits); signed and floating values get no wrap modulus.
_VALUE_TYPES: dict[int, tuple[str, int | None]] = {
    0: ("dVal", None),
    1: ("uiVal", 32),
    2: ("ulVal", 8 * ctypes.sizeof(ctypes.c_ulong)),
    3: ("ullVal", 64),
    4: ("sllVal", None),
    5: ("siVal", None),
    6: ("usVal", 16),
}

# Counters read through field values: name -> (field constant, scopeId, bytes per unit).
_COUNTER_FIELDS = {
    "pcie_tx": ("NVML_FI_DEV_PCIE_COUNT_TX_BYTES", 0, 1),
    "pcie_rx": ("NVML_FI_DEV_PCIE_COUNT_RX_BYTES", 0, 1),
    "nvlink_tx": ("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", ALL_LINKS, KIB),
    "nvlink_rx": ("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", ALL_LINKS, KIB),
}
COUNTER_NAMES = tuple(_COUNTER_FIELDS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Counter:
    """One reading of a cumulative counter: ``value`` in units of ``unit_bytes``; ``wrap`` is the
    modulus at which it rolls over (2^32 or 2^64), None where its type does not wrap."""

    value: int
    unit_bytes: int
    wrap: int | None

    def bytes_since(self, before: Counter) -> int | None:
        """Bytes counted between ``before`` and this reading, across at most one wrap; None where the
        counter went backwards without a wrap to explain it (a reset)."""
        delta = self.value - before.value
        if delta < 0:
            if self.wrap is None or self.wrap > 1 << 32:  # a 64-bit counter does not wrap in practice
                return None
            delta += self.wrap
        return delta * self.unit_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuCounters:
    """The cumulative counters of one GPU at one instant; None where not supported."""

    index: int
    t_s: float
    pcie_tx: Counter | None
    pcie_rx: Counter | None
    nvlink_tx: Counter | None
    nvlink_rx: Counter | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceInfo:
    """What is known of one GPU once, at start: static facts and which readings it supports."""

    index: int
    name: str | None
    pci_bus_id: str | None
    memory_total_bytes: int | None
    pcie_max_generation: int | None
    pcie_max_width: int | None
    nvlink_link_count: int | None
    supported: frozenset[str]

    @property
    def pci(self) -> str | None:
        """The PCI address as the rank lines write a GPU's (domain:bus:device.function, in four, two
        and two hex digits), or None where NVML gave none or one of another form."""
        try:
            dom, bus, rest = (self.pci_bus_id or "").lower().split(":")
            dev, fn = rest.split(".")
            return f"{int(dom, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(fn, 16)}"
        except ValueError:
            return None

    @property
    def pcie_counters(self) -> bool:
        """True where PCIe bytes come from counters; False where only the 20 ms estimate exists."""
        return {"pcie_tx", "pcie_rx"} <= self.supported


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuReading:
    """Instantaneous state of one GPU plus its cumulative counters (None where not read: see
    :meth:`Nvml.read`); None where not supported."""

    index: int
    t_s: float
    gpu_util_pct: float | None
    mem_util_pct: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    sm_clock_mhz: int | None
    mem_clock_mhz: int | None
    power_w: float | None
    pcie_generation: int | None
    pcie_width: int | None
    pcie_max_generation: int | None
    pcie_max_width: int | None
    counters: GpuCounters | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PcieEstimate:
    """``nvmlDeviceGetPcieThroughput`` rates: a 20 ms sample, not a count; ``source`` says so."""

    tx_bytes_per_s: float | None
    rx_bytes_per_s: float | None
    source: str = "estimate (nvmlDeviceGetPcieThroughput, 20 ms sample)"


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Nvml:
    """An initialised NVML with one handle and its capabilities per device. Open with :meth:`open`;
    close with :meth:`close` (or use it as a context manager)."""

    # Gauges whose support is probed once per device at start (see _gauge for the NVML call).
    _GAUGES = (
        "utilization",
        "memory",
        "sm_clock",
        "mem_clock",
        "power",
        "pcie_generation",
        "pcie_width",
    )

    def __init__(self, module: ModuleType) -> None:
        self._m = module
        self._fields = {
            name: int(getattr(module, const, _FIELD_DEFAULTS[const]))
            for name, (const, _, _) in _COUNTER_FIELDS.items()
        }
        self._not_supported = getattr(module, "NVMLError_NotSupported", None)
        self._handles: list[Any] = []
        self.devices: tuple[DeviceInfo, ...] = ()
        self._closed = False

    # -- opening ----------------------------------------------------------------------------------

    @classmethod
    def open_with_reason(cls, module: ModuleType | None = None) -> tuple[Nvml | None, str | None]:
        """An open :class:`Nvml`, or None and a one-line reason (no nvidia-ml-py, no library, no
        driver). ``module`` replaces ``pynvml`` (tests pass a fake)."""
        if module is None:
            try:
                import pynvml as module  # type: ignore[no-redef]
            except ImportError:
                return None, "NVML unavailable: nvidia-ml-py (module pynvml) is not installed"
        try:
            module.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ... or an OSError
            text = " ".join(str(exc).split()) or type(exc).__name__
            return None, f"NVML unavailable: {text} (no NVIDIA driver or library on this machine?)"
        nvml = cls(module)
        try:
            count = int(module.nvmlDeviceGetCount())
            nvml._handles = [module.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            nvml.devices = tuple(nvml._probe(i) for i in range(count))
        except Exception as exc:
            nvml.close()
            return None, f"NVML unavailable: listing devices failed: {' '.join(str(exc).split())}"
        return nvml, None

    @classmethod
    def open(cls, module: ModuleType | None = None) -> Nvml | None:
        """An open :class:`Nvml`, or None where NVML cannot be used (see :func:`nvml_unavailable_reason`)."""
        return cls.open_with_reason(module)[0]

    def close(self) -> None:
        """Shut NVML down (NVML counts opens, so other users keep theirs)."""
        if not self._closed:
            self._closed = True
            try:
                self._m.nvmlShutdown()
            except Exception:  # shutting down is best effort; there is nothing to recover
                pass

    def __enter__(self) -> Nvml:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- capabilities -----------------------------------------------------------------------------

    def _call(self, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """(supported, value): NotSupported gives (False, None); any other error (True, None)."""
        try:
            return True, fn()
        except Exception as exc:
            if self._not_supported is not None and isinstance(exc, self._not_supported):
                return False, None
            return True, None

    def _probe(self, index: int) -> DeviceInfo:
        h = self._handles[index]
        m = self._m
        supported: set[str] = set()
        for gauge in self._GAUGES:
            ok, _ = self._call(lambda g=gauge: self._gauge(g, h))
            if ok:
                supported.add(gauge)
        values = self._field_values(
            h, list(self._fields.values()), [s for _, s, _ in _COUNTER_FIELDS.values()]
        )
        for name, value in zip(self._fields, values, strict=True):
            if value is not None:
                supported.add(name)
        if not {"pcie_tx", "pcie_rx"} <= supported:  # only then is the 20 ms estimate worth probing
            tx = getattr(m, "NVML_PCIE_UTIL_TX_BYTES", 0)
            if self._call(lambda: m.nvmlDeviceGetPcieThroughput(h, tx))[0]:
                supported.add("pcie_estimate")
        _, raw_name = self._call(lambda: m.nvmlDeviceGetName(h))
        _, pci = self._call(lambda: m.nvmlDeviceGetPciInfo(h))
        _, mem = self._call(lambda: m.nvmlDeviceGetMemoryInfo(h))
        _, gen = self._call(lambda: m.nvmlDeviceGetMaxPcieLinkGeneration(h))
        _, width = self._call(lambda: m.nvmlDeviceGetMaxPcieLinkWidth(h))
        link_field = int(
            getattr(m, "NVML_FI_DEV_NVLINK_LINK_COUNT", _FIELD_DEFAULTS["NVML_FI_DEV_NVLINK_LINK_COUNT"])
        )
        (links,) = self._field_values(h, [link_field], [0])
        return DeviceInfo(
            index=index,
            name=None if raw_name is None else _decode(raw_name),
            pci_bus_id=None if pci is None else _decode(getattr(pci, "busId", "")) or None,
            memory_total_bytes=None if mem is None else int(mem.total),
            pcie_max_generation=None if gen is None else int(gen),
            pcie_max_width=None if width is None else int(width),
            nvlink_link_count=None if links is None else int(links.value),
            supported=frozenset(supported),
        )

    def _gauge(self, gauge: str, h: Any) -> Any:
        m = self._m
        if gauge == "utilization":
            return m.nvmlDeviceGetUtilizationRates(h)
        if gauge == "memory":
            return m.nvmlDeviceGetMemoryInfo(h)
        if gauge == "sm_clock":
            return m.nvmlDeviceGetClockInfo(h, getattr(m, "NVML_CLOCK_SM", 1))
        if gauge == "mem_clock":
            return m.nvmlDeviceGetClockInfo(h, getattr(m, "NVML_CLOCK_MEM", 2))
        if gauge == "power":
            return m.nvmlDeviceGetPowerUsage(h)
        if gauge == "pcie_generation":
            return m.nvmlDeviceGetCurrPcieLinkGeneration(h)
        if gauge == "pcie_width":
            return m.nvmlDeviceGetCurrPcieLinkWidth(h)
        raise ValueError(f"unknown gauge {gauge!r}")

    def _field_values(self, h: Any, field_ids: list[int], scopes: list[int]) -> list[Counter | None]:
        """Counters for ``field_ids``; None for any field whose own nvmlReturn is not success."""
        try:
            # (id, scope) pairs only where a scope is needed: older nvidia-ml-py takes bare ids only
            ids = [f if scope == 0 else (f, scope) for f, scope in zip(field_ids, scopes, strict=True)]
            raw = self._m.nvmlDeviceGetFieldValues(h, ids)
        except Exception:  # the whole call failed: every field is unknown this time, not zero
            return [None] * len(field_ids)
        success = getattr(self._m, "NVML_SUCCESS", 0)
        out: list[Counter | None] = []
        for v in raw:
            kind = _VALUE_TYPES.get(int(v.valueType))
            if int(v.nvmlReturn) != success or kind is None:
                out.append(None)
                continue
            attr, bits = kind
            out.append(
                Counter(
                    value=int(getattr(v.value, attr)), unit_bytes=1, wrap=None if bits is None else 1 << bits
                )
            )
        return out

    # -- reading ----------------------------------------------------------------------------------

    def _read_gauge(self, info: DeviceInfo, gauge: str) -> Any:
        if gauge not in info.supported:
            return None
        return self._call(lambda: self._gauge(gauge, self._handles[info.index]))[1]

    def counters(self, index: int) -> GpuCounters:
        """The cumulative PCIe and NVLink byte counters of device ``index`` now (one NVML call)."""
        info = self.devices[index]
        names = [n for n in COUNTER_NAMES if n in info.supported]
        values = (
            self._field_values(
                self._handles[index],
                [self._fields[n] for n in names],
                [_COUNTER_FIELDS[n][1] for n in names],
            )
            if names
            else []
        )
        got: dict[str, Counter | None] = dict.fromkeys(COUNTER_NAMES)
        for name, value in zip(names, values, strict=True):
            if value is not None:
                value = dataclasses.replace(value, unit_bytes=_COUNTER_FIELDS[name][2])
            got[name] = value
        return GpuCounters(index=index, t_s=time.monotonic(), **got)

    def read(self, index: int, *, counters: bool = True) -> GpuReading:
        """Utilisation, memory, clocks, power, PCIe link state and counters of device ``index``;
        ``counters=False`` leaves the counters out (None), for a caller that reads them itself."""
        info = self.devices[index]
        util = self._read_gauge(info, "utilization")
        mem = self._read_gauge(info, "memory")
        power = self._read_gauge(info, "power")
        gen = self._read_gauge(info, "pcie_generation")
        width = self._read_gauge(info, "pcie_width")
        sm = self._read_gauge(info, "sm_clock")
        memclk = self._read_gauge(info, "mem_clock")
        got = self.counters(index) if counters else None
        return GpuReading(
            index=index,
            t_s=got.t_s if got is not None else time.monotonic(),
            gpu_util_pct=None if util is None else float(util.gpu),
            mem_util_pct=None if util is None else float(util.memory),
            memory_used_bytes=None if mem is None else int(mem.used),
            memory_total_bytes=None if mem is None else int(mem.total),
            sm_clock_mhz=None if sm is None else int(sm),
            mem_clock_mhz=None if memclk is None else int(memclk),
            power_w=None if power is None else power / 1000.0,
            pcie_generation=None if gen is None else int(gen),
            pcie_width=None if width is None else int(width),
            pcie_max_generation=info.pcie_max_generation,
            pcie_max_width=info.pcie_max_width,
            counters=got,
        )

    def pcie_estimate(self, index: int) -> PcieEstimate:
        """PCIe TX/RX rates from ``nvmlDeviceGetPcieThroughput`` (20 ms each, KB/s read as KiB/s):
        the fallback where the byte counters are missing. Costs about 40 ms; None where unsupported."""
        if "pcie_estimate" not in self.devices[index].supported:
            return PcieEstimate(tx_bytes_per_s=None, rx_bytes_per_s=None)
        h = self._handles[index]
        m = self._m
        rates = []
        for counter in (getattr(m, "NVML_PCIE_UTIL_TX_BYTES", 0), getattr(m, "NVML_PCIE_UTIL_RX_BYTES", 1)):
            _, kb = self._call(lambda c=counter: m.nvmlDeviceGetPcieThroughput(h, c))
            rates.append(None if kb is None else float(kb) * KIB)
        return PcieEstimate(tx_bytes_per_s=rates[0], rx_bytes_per_s=rates[1])

    def index_for_pci_bus_id(self, domain: int, bus: int, device: int) -> int | None:
        """The NVML index of the GPU at PCI ``domain:bus:device`` (how CUDA names it), or None."""
        for info in self.devices:
            if info.pci_bus_id is None:
                continue
            try:
                dom, b, rest = info.pci_bus_id.lower().split(":")
                if (int(dom, 16), int(b, 16), int(rest.split(".")[0], 16)) == (domain, bus, device):
                    return info.index
            except ValueError:
                continue
        return None


def nvml_unavailable_reason(module: ModuleType | None = None) -> str | None:
    """One line saying why NVML cannot be used here, or None where it can."""
    nvml, reason = Nvml.open_with_reason(module)
    if nvml is not None:
        nvml.close()
    return reason
