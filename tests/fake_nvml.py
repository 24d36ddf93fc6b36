"""A stand-in for the ``pynvml`` module: the functions and constants commbench.probes.nvml uses, over
devices whose readings and counters a test sets."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_UNKNOWN = 999
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
NVML_FI_DEV_NVLINK_LINK_COUNT = 91
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
NVML_FI_DEV_PCIE_COUNT_TX_BYTES = 197
NVML_FI_DEV_PCIE_COUNT_RX_BYTES = 198
UINT = 1  # NVML_VALUE_TYPE_UNSIGNED_INT
ULONG = 2  # NVML_VALUE_TYPE_UNSIGNED_LONG
ULL = 3  # NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
USHORT = 6  # NVML_VALUE_TYPE_UNSIGNED_SHORT
_ATTR = {UINT: "uiVal", ULONG: "ulVal", ULL: "ullVal", USHORT: "usVal"}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {
            NVML_ERROR_NOT_SUPPORTED: "Not Supported",
            12: "NVML Shared Library Not Found",
            9: "Driver Not Loaded",
        }.get(self.value, "Unknown Error")


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - the name pynvml gives it
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_NOT_SUPPORTED)


@dataclasses.dataclass
class FakeDevice:
    """One GPU. A reading set to ``"unsupported"`` raises NotSupported; ``"error"`` another error.
    ``fields`` maps field id -> (value type, value) or an nvmlReturn code (int) for a failing field."""

    name: str = "Fake GPU"
    bus_id: str = "00000000:65:00.0"
    util: Any = (40, 10)
    memory: Any = (2 << 30, 80 << 30)
    sm_clock: Any = 1980
    mem_clock: Any = 2619
    power_mw: Any = 250_000
    pcie_gen: Any = 5
    pcie_width: Any = 16
    pcie_max_gen: Any = 5
    pcie_max_width: Any = 16
    pcie_throughput_kb: Any = (1000, 2000)
    fields: dict[int, Any] = dataclasses.field(
        default_factory=lambda: {
            NVML_FI_DEV_PCIE_COUNT_TX_BYTES: (UINT, 0),
            NVML_FI_DEV_PCIE_COUNT_RX_BYTES: (UINT, 0),
            NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: (ULL, 0),
            NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: (ULL, 0),
            NVML_FI_DEV_NVLINK_LINK_COUNT: (UINT, 18),
        }
    )
    calls: dict[str, int] = dataclasses.field(default_factory=dict)

    def set_field(self, field_id: int, value: int) -> None:
        kind, _ = self.fields[field_id]
        self.fields[field_id] = (kind, value)


def _value(v: Any) -> Any:
    if v == "unsupported":
        raise NVMLError_NotSupported()
    if v == "error":
        raise NVMLError(NVML_ERROR_UNKNOWN)
    return v


class FakeNvmlModule:
    """The module: pass an instance as ``module=`` to ``Nvml.open``."""

    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported

    def __init__(self, devices: list[FakeDevice] | None = None, init_error: int | None = None) -> None:
        self.devices = [FakeDevice()] if devices is None else devices
        self.init_error = init_error
        self.inits = 0
        self.shutdowns = 0
        self.fail_field_call = False
        for k, v in globals().items():
            if k.startswith("NVML_"):
                setattr(self, k, v)

    def _dev(self, h: int, what: str) -> FakeDevice:
        d = self.devices[h]
        d.calls[what] = d.calls.get(what, 0) + 1
        return d

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml names
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.inits += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:  # noqa: N802
        return self._dev(h, "name").name.encode()

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:  # noqa: N802
        return SimpleNamespace(busId=self._dev(h, "pci").bus_id.encode())

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:  # noqa: N802
        gpu, mem = _value(self._dev(h, "util").util)
        return SimpleNamespace(gpu=gpu, memory=mem)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:  # noqa: N802
        used, total = _value(self._dev(h, "memory").memory)
        return SimpleNamespace(used=used, total=total, free=total - used)

    def nvmlDeviceGetClockInfo(self, h: int, kind: int) -> int:  # noqa: N802
        d = self._dev(h, "clock")
        return _value(d.sm_clock if kind == NVML_CLOCK_SM else d.mem_clock)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:  # noqa: N802
        return _value(self._dev(h, "power").power_mw)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:  # noqa: N802
        return _value(self._dev(h, "gen").pcie_gen)

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:  # noqa: N802
        return _value(self._dev(h, "width").pcie_width)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:  # noqa: N802
        return _value(self._dev(h, "max_gen").pcie_max_gen)

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:  # noqa: N802
        return _value(self._dev(h, "max_width").pcie_max_width)

    def nvmlDeviceGetPcieThroughput(self, h: int, counter: int) -> int:  # noqa: N802
        return _value(self._dev(h, "pcie_throughput").pcie_throughput_kb)[counter]

    def nvmlDeviceGetFieldValues(self, h: int, field_ids: list[Any]) -> list[Any]:  # noqa: N802
        d = self._dev(h, "fields")
        if self.fail_field_call:
            raise NVMLError(NVML_ERROR_UNKNOWN)
        out = []
        for item in field_ids:
            fid, scope = item if isinstance(item, tuple) else (item, 0)
            entry = d.fields.get(fid, NVML_ERROR_NOT_SUPPORTED)
            value = SimpleNamespace(dVal=0.0, uiVal=0, ulVal=0, ullVal=0, sllVal=0, siVal=0, usVal=0)
            if isinstance(entry, tuple):
                kind, raw = entry
                setattr(value, _ATTR[kind], raw)
                out.append(
                    SimpleNamespace(fieldId=fid, scopeId=scope, valueType=kind, nvmlReturn=0, value=value)
                )
            else:
                out.append(
                    SimpleNamespace(fieldId=fid, scopeId=scope, valueType=0, nvmlReturn=entry, value=value)
                )
        return out
