"""The NVML wrapper against a fake pynvml: unsupported is None (never 0), one failing reading loses
nothing else, counters unwrap by their value type, and the PCIe fallback is labelled an estimate."""

from __future__ import annotations

import ctypes
import time

import pytest

from commbench.probes.nvml import Counter, Nvml, nvml_unavailable_reason
from tests import fake_nvml as fk
from tests.fake_nvml import FakeDevice, FakeNvmlModule


def _open(*devices: FakeDevice) -> tuple[Nvml, FakeNvmlModule]:
    module = FakeNvmlModule(list(devices) or None)
    nvml = Nvml.open(module)
    assert nvml is not None
    return nvml, module


def test_reads_every_field_of_a_full_device():
    nvml, _ = _open(FakeDevice())
    r = nvml.read(0)
    assert (r.gpu_util_pct, r.mem_util_pct) == (40.0, 10.0)
    assert (r.memory_used_bytes, r.memory_total_bytes) == (2 << 30, 80 << 30)
    assert (r.sm_clock_mhz, r.mem_clock_mhz, r.power_w) == (1980, 2619, 250.0)
    assert (r.pcie_generation, r.pcie_width, r.pcie_max_generation, r.pcie_max_width) == (5, 16, 5, 16)
    info = nvml.devices[0]
    assert info.name == "Fake GPU" and info.nvlink_link_count == 18 and info.pcie_counters
    assert r.counters.pcie_tx == Counter(value=0, unit_bytes=1, wrap=1 << 32)
    assert r.counters.nvlink_rx == Counter(value=0, unit_bytes=1024, wrap=1 << 64)
    gauges = nvml.read(0, counters=False)  # what the sampler's ticks read: it reads counters itself
    assert gauges.counters is None and gauges.power_w == 250.0


def test_unsupported_is_none_never_zero_and_probed_once():
    dev = FakeDevice(power_mw="unsupported", pcie_gen="unsupported", util="unsupported")
    dev.fields[fk.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX] = fk.NVML_ERROR_NOT_SUPPORTED
    del dev.fields[fk.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX]
    nvml, _ = _open(dev)
    before = dict(dev.calls)
    for _ in range(3):
        r = nvml.read(0)
        assert r.power_w is None and r.pcie_generation is None
        assert r.gpu_util_pct is None and r.mem_util_pct is None
        assert r.counters.nvlink_tx is None and r.counters.nvlink_rx is None
        assert r.pcie_width == 16 and r.counters.pcie_tx is not None  # the rest is still there
    assert dev.calls.get("power", 0) == before.get("power", 0)  # capability probed at start only
    assert "power" not in nvml.devices[0].supported


def test_a_failing_reading_loses_no_other_reading():
    dev = FakeDevice()
    nvml, _ = _open(dev)
    dev.power_mw = "error"  # a transient error after start: None this time, retried next time
    dev.fields[fk.NVML_FI_DEV_PCIE_COUNT_RX_BYTES] = fk.NVML_ERROR_UNKNOWN  # one field's own nvmlReturn
    r = nvml.read(0)
    assert r.power_w is None and r.counters.pcie_rx is None
    assert r.counters.pcie_tx is not None and r.counters.nvlink_tx is not None
    assert r.sm_clock_mhz == 1980 and r.gpu_util_pct == 40.0
    dev.power_mw = 100_000
    assert nvml.read(0).power_w == 100.0


def test_whole_field_call_failing_gives_none_counters_not_zero():
    nvml, module = _open(FakeDevice())
    module.fail_field_call = True
    c = nvml.counters(0)
    assert (c.pcie_tx, c.pcie_rx, c.nvlink_tx, c.nvlink_rx) == (None, None, None, None)
    assert nvml.read(0).power_w == 250.0


def test_32_bit_counter_wraps_and_64_bit_does_not():
    dev = FakeDevice()
    nvml, _ = _open(dev)
    dev.set_field(fk.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, (1 << 32) - 100)
    dev.set_field(fk.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 5000)
    a = nvml.counters(0)
    dev.set_field(fk.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 50)  # wrapped past 2^32
    dev.set_field(fk.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 5010)
    b = nvml.counters(0)
    assert b.pcie_tx.bytes_since(a.pcie_tx) == 150
    assert b.nvlink_tx.bytes_since(a.nvlink_tx) == 10 * 1024  # KiB counter
    dev.set_field(fk.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 10)  # a 64-bit counter going back: reset
    c = nvml.counters(0)
    assert c.nvlink_tx.bytes_since(b.nvlink_tx) is None


def test_unsigned_short_and_unsigned_long_counters_wrap_at_their_own_width():
    """An unsigned short rolls over at 2^16 and an unsigned long at the C type's width (64 bits on
    Linux, 32 on Windows): a difference across the wrap is taken modulo that width."""
    dev = FakeDevice()
    dev.fields[fk.NVML_FI_DEV_PCIE_COUNT_TX_BYTES] = (fk.USHORT, (1 << 16) - 100)
    dev.fields[fk.NVML_FI_DEV_PCIE_COUNT_RX_BYTES] = (fk.ULONG, 7)
    nvml, _ = _open(dev)
    a = nvml.counters(0)
    assert a.pcie_tx == Counter(value=(1 << 16) - 100, unit_bytes=1, wrap=1 << 16)
    assert a.pcie_rx == Counter(value=7, unit_bytes=1, wrap=1 << (8 * ctypes.sizeof(ctypes.c_ulong)))
    dev.set_field(fk.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 50)  # wrapped past 2^16
    assert nvml.counters(0).pcie_tx.bytes_since(a.pcie_tx) == 150


def test_nvlink_read_over_all_links():
    dev = FakeDevice()
    nvml, module = _open(dev)
    seen = []
    original = module.nvmlDeviceGetFieldValues

    def spy(h, ids):
        seen.extend(ids)
        return original(h, ids)

    module.nvmlDeviceGetFieldValues = spy
    nvml.counters(0)
    assert (fk.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, 0xFFFFFFFF) in seen


def test_pcie_fallback_only_without_counters_and_labelled_estimate():
    full, _ = _open(FakeDevice())
    assert "pcie_estimate" not in full.devices[0].supported
    assert full.pcie_estimate(0).tx_bytes_per_s is None
    dev = FakeDevice()
    dev.fields[fk.NVML_FI_DEV_PCIE_COUNT_TX_BYTES] = fk.NVML_ERROR_NOT_SUPPORTED
    nvml, _ = _open(dev)
    assert not nvml.devices[0].pcie_counters
    est = nvml.pcie_estimate(0)
    assert (est.tx_bytes_per_s, est.rx_bytes_per_s) == (1000 * 1024, 2000 * 1024)
    assert "estimate" in est.source


@pytest.mark.parametrize("code,needle", [(12, "Library Not Found"), (9, "Driver Not Loaded")])
def test_missing_library_or_driver_is_none_with_a_one_line_reason(code, needle):
    module = FakeNvmlModule(init_error=code)
    assert Nvml.open(module) is None
    reason = nvml_unavailable_reason(module)
    assert reason is not None and needle in reason and "\n" not in reason


def test_reason_is_none_where_nvml_works_and_open_close_balance():
    module = FakeNvmlModule()
    assert nvml_unavailable_reason(module) is None
    with Nvml.open(module) as nvml:
        assert len(nvml.devices) == 1
    assert module.inits == module.shutdowns == 2


def test_this_machine_without_nvml_gives_a_reason():
    """The real pynvml: without a driver a one-line reason; where it opens, no reason, and every
    GPU torch can see among its devices (CUDA_VISIBLE_DEVICES hides GPUs from torch, not NVML)."""
    import torch

    nvml, reason = Nvml.open_with_reason()
    if nvml is None:
        assert reason and reason.startswith("NVML unavailable") and "\n" not in reason
        assert not torch.cuda.is_available(), f"torch sees a GPU, but {reason}"
        return
    with nvml:
        assert reason is None and nvml_unavailable_reason() is None
        assert len(nvml.devices) >= torch.cuda.device_count()
        assert [d.index for d in nvml.devices] == list(range(len(nvml.devices)))


def test_pci_bus_id_maps_to_nvml_index():
    nvml, _ = _open(FakeDevice(bus_id="00000000:17:00.0"), FakeDevice(bus_id="00000000:65:00.0"))
    assert nvml.index_for_pci_bus_id(0, 0x65, 0) == 1
    assert nvml.index_for_pci_bus_id(0, 0x17, 0) == 0
    assert nvml.index_for_pci_bus_id(0, 0x99, 0) is None


@pytest.mark.gpu
def test_real_nvml_on_a_gpu():
    """With a GPU: the real library opens, reads and the PCIe counters (or estimate) move with copies."""
    import torch

    nvml = Nvml.open()
    assert nvml is not None, nvml_unavailable_reason()
    with nvml:
        assert len(nvml.devices) >= 1
        r = nvml.read(0)
        assert r.memory_total_bytes is None or r.memory_total_bytes > 0
        assert r.pcie_max_width is None or r.pcie_max_width >= 1
        if not nvml.devices[0].pcie_counters:
            assert "pcie_estimate" in nvml.devices[0].supported  # the fallback the sampler uses
            return
        x = torch.ones(64 << 20, dtype=torch.uint8).pin_memory()
        copied = 4 * x.numel()  # 256 MiB host to device, about 10-30 ms on PCIe gen3-5
        a = nvml.counters(0)
        for _ in range(4):
            x.cuda()
        torch.cuda.synchronize()

        def since(before: Counter | None, after: Counter | None) -> int:
            return (after.bytes_since(before) or 0) if before is not None and after is not None else 0

        moved = 0
        deadline = time.monotonic() + 2.0  # the driver may publish its counters a little late
        while moved < copied and time.monotonic() < deadline:
            time.sleep(0.05)
            b = nvml.counters(0)
            # Whichever direction the driver counts the copy in (other traffic only adds). The 32-bit
            # counters wrap every 4 GiB, far more than this copy moves.
            moved = max(since(a.pcie_rx, b.pcie_rx), since(a.pcie_tx, b.pcie_tx))
        # Payload plus TLP headers and completions: at least the bytes copied, less 10% for a
        # counter that counts in coarse units or lags the copy's last few transfers.
        assert moved >= 0.9 * copied, f"{moved} bytes counted for {copied} copied"
