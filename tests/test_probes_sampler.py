"""The sampler with real psutil (and a fake NVML for GPU columns): ticks on its interval, markers
carry counters read at that instant, bytes are attributed between markers, its cost is measured."""

from __future__ import annotations

import itertools
import json
import time
import types

import pytest

from commbench.probes import nvml as nvml_module
from commbench.probes.nvml import Nvml
from commbench.probes.sampler import ESTIMATE_SOURCE, Sampler
from tests import fake_nvml as fk
from tests.fake_nvml import FakeDevice, FakeNvmlModule
from tests.test_probes_host import _send_through_loopback

INTERVAL = 0.02


def test_ticks_markers_and_loopback_bytes_between_markers():
    s = Sampler(INTERVAL, nic="lo").start()
    time.sleep(0.1)
    s.mark("start")
    _send_through_loopback(2 << 20)
    s.mark("sent")
    time.sleep(0.1)
    s.mark("idle")
    tl = s.stop()
    assert tl.wall_s >= 0.2
    assert len(tl.samples) >= 5  # about 10 expected; a loaded machine may skip some
    ts = [x.t_s for x in tl.samples]
    assert ts == sorted(ts) and ts[0] >= INTERVAL * 0.9
    assert len(ts) <= tl.wall_s / INTERVAL + 1  # a fixed grid: never more ticks than intervals
    assert [m.label for m in tl.markers] == ["start", "sent", "idle"]
    sent = tl.phase_bytes("start", "sent")
    assert sent.nic_tx_bytes >= 2 << 20 and sent.nic_rx_bytes >= 2 << 20
    assert sent.seconds > 0
    assert tl.phase_bytes("sent", "idle").nic_tx_bytes >= 0  # other tests' traffic may share lo
    assert max(x.nic_tx_bytes_per_s for x in tl.samples) > 0
    assert all(x.gpus == () for x in tl.samples)
    assert 0 <= tl.overhead_core_fraction < 0.5
    assert tl.sampler_cpu_s > 0
    # the sampler's cost: its thread's CPU time over the run's wall time, in cores
    assert tl.overhead_core_fraction == pytest.approx(tl.sampler_cpu_s / tl.wall_s, rel=1e-9)
    assert tl.overhead_core_fraction > 0


def test_summary_and_json_have_nulls_where_not_measured():
    with Sampler(INTERVAL) as s:
        time.sleep(0.08)
        s.mark("a")
    tl = s.timeline
    assert tl is not None and tl.markers[0].nic_tx_bytes is None
    summary = tl.summary()
    assert summary["nic_tx_bytes_per_s"] is None and summary["gpus"] == []
    assert summary["rss_bytes"]["max"] > 0 and summary["samples"] == len(tl.samples)
    doc = json.loads(json.dumps(tl.to_json()))
    assert doc["overhead_core_fraction"] == tl.overhead_core_fraction
    assert doc["markers"][0]["label"] == "a" and len(doc["samples"]) == len(tl.samples)


def test_cpu_shares_at_a_millisecond_interval_stay_within_the_cores():
    """CPU times move in 10 ms clock ticks: read each millisecond, this process's CPU was 0 or
    1000% of one core (2019% on the 2-core VM), and the machine's often not measured at all."""
    import hashlib
    import os

    data = bytes(1 << 20)
    with Sampler(0.001) as s:
        end = time.monotonic() + 0.5
        while time.monotonic() < end:  # one core busy, mostly without the GIL the sampler needs
            hashlib.sha256(data).digest()
    samples = s.timeline.samples
    cores = os.cpu_count() or 1
    # over 50 ms or more, a tick's 10 ms is at most 20% of one core either side
    measured = [x for x in samples if x.process_cpu_pct is not None]
    assert len(measured) > 100 and all(x.cpu_user_pct is not None for x in measured)
    assert max(x.process_cpu_pct for x in measured) <= 100 * cores + 40
    assert all(x.process_cpu_pct is None for x in samples if x.t_s < 0.049)  # a tick or two: none


def test_the_stretch_after_the_last_tick_is_sampled_at_stop():
    """Ticks came only on the interval's grid: the end of a run, up to a whole interval (60 s at
    the longest --probe-interval), was in no sample, and a run shorter than its interval had none.
    The bounds leave a loaded machine 0.1 s or more either way: a tick late by more than a tenth
    of the interval moves the grid, and the stop then finds under half an interval to sample."""
    s = Sampler(1.0, nic="lo").start()  # shorter than its interval: sampled at stop
    time.sleep(0.8)
    samples = s.stop().samples
    assert samples and samples[-1].t_s >= 0.5 and samples[-1].rss_bytes > 0, samples
    s = Sampler(1.0, nic="lo").start()  # the grid's tick at 1 s, then 0.75 s more: sampled at stop
    time.sleep(1.75)
    tl = s.stop()
    assert tl.wall_s - tl.samples[-1].t_s < 0.65 and tl.samples[-1].nic_tx_bytes_per_s is not None
    s = Sampler(1.0, nic="lo").start()  # under half an interval: no tick of a few clock ticks
    time.sleep(0.05)
    assert s.stop().samples == ()


def _stamps_apart(monkeypatch, seconds: float) -> None:
    """NVML counter readings stamped ``seconds`` apart, whenever they are taken."""
    clock = itertools.count()
    monkeypatch.setattr(nvml_module, "time", types.SimpleNamespace(monotonic=lambda: next(clock) * seconds))


def test_gpu_counters_unwrap_across_ticks_and_markers(monkeypatch):
    # gen3 x8 (7.9 GB/s) needs 0.55 s between two readings to wrap 2^32 twice: no note with
    # readings 0.2 s apart, in which the link can move the 1.6 GB that 1e9 bytes a reading needs.
    _stamps_apart(monkeypatch, 0.2)
    module = FakeNvmlModule([FakeDevice(pcie_max_gen=3, pcie_max_width=8)])
    dev = module.devices[0]
    nvml = Nvml.open(module)
    value = 0
    with Sampler(INTERVAL, nvml=nvml) as s:
        s.mark("a")
        for _ in range(8):  # 8 x 1e9 bytes: the 32-bit counter wraps about twice
            value += 1_000_000_000
            dev.set_field(fk.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, value % (1 << 32))
            dev.set_field(fk.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, value // 1024)
            time.sleep(INTERVAL * 1.5)
        s.mark("b")
        time.sleep(INTERVAL * 3)
        s.mark("c")
    tl = s.timeline
    phase = tl.phase_bytes("a", "b")
    (g,) = phase.gpus
    assert g.pcie_tx_bytes == 8_000_000_000 and g.pcie_rx_bytes == 0 and g.pcie_source == "counter"
    assert g.nvlink_rx_bytes == (8_000_000_000 // 1024) * 1024 and g.nvlink_tx_bytes == 0
    (idle,) = tl.phase_bytes("b", "c").gpus  # ticks in between read the counters too, and add nothing
    assert (idle.pcie_tx_bytes, idle.nvlink_rx_bytes) == (0, 0)
    rows = [x.gpus[0] for x in tl.samples]
    assert all(r.power_w == 250.0 and r.pcie_rate_source == "counter" for r in rows)
    assert max(r.pcie_tx_bytes_per_s for r in rows) > 1e9
    assert tl.summary()["gpus"][0]["power_w"] == {"mean": 250.0, "max": 250.0}
    assert tl.notes == ()


def test_a_32_bit_counter_that_went_back_further_than_its_link_allows_was_reset():
    """A reset reads like a wrap: 5 MB back to near 0 was 4.29 GB in one tick of a 7.9 GB/s link,
    with no note. A wrap the link can carry in the gap still counts."""
    module = FakeNvmlModule([FakeDevice(pcie_max_gen=3, pcie_max_width=8)])
    dev = module.devices[0]
    s = Sampler(INTERVAL, nvml=Nvml.open(module))  # driven tick by tick, without its thread
    dev.set_field(fk.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, (1 << 32) - 100)
    point = s._point()
    dev.set_field(fk.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 50)  # wrapped: 150 bytes
    time.sleep(0.01)
    point, sample = s._tick(point)
    assert sample.gpus[0].pcie_tx_bytes_per_s > 0 and point.gpus[0].pcie_tx_bytes == 150
    dev.set_field(fk.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 5_000_000)
    time.sleep(0.01)
    point, sample = s._tick(point)
    dev.set_field(fk.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 1000)  # reset, then 1 kB
    time.sleep(0.01)
    point, sample = s._tick(point)
    assert sample.gpus[0].pcie_tx_bytes_per_s is None
    assert s._notes() == ("GPU 0 pcie_tx counter went backwards 1 time(s); those ticks are lost",)
    dev.set_field(fk.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, 3000)
    time.sleep(0.01)
    point, sample = s._tick(point)  # counts on from the reset
    assert point.gpus[0].pcie_tx_bytes == 150 + 4_999_950 + 2000  # the 1 kB before it is lost


def test_a_wrap_within_the_links_margin_counts_and_one_past_it_is_a_reset():
    """Link maxima are believed with a 5% margin (clocks and counters are not exact): at 1e9 B/s
    a 0.1 s gap may carry up to 1.05e8 bytes, so a wrap of 1.03e8 counts and one of 1.06e8 is a
    reset. A mutant judging by the bare maximum (1e8) went unnoticed."""
    from commbench.probes.nvml import Counter
    from commbench.probes.sampler import _Accumulator

    wrap = 1 << 32
    for delta, counted in ((103_000_000, True), (106_000_000, False)):
        acc = _Accumulator(max_bytes_per_s=1e9)
        start = wrap - 1000
        acc.update(Counter(value=start, unit_bytes=1, wrap=wrap), 10.0)
        acc.update(Counter(value=(start + delta) % wrap, unit_bytes=1, wrap=wrap), 10.1)
        if counted:
            assert (acc.total, acc.resets, acc.now()) == (delta, 0, delta)
        else:
            assert (acc.total, acc.resets, acc.now()) == (0, 1, None)


def _estimated(t_s: float, rate: float):
    """A tick whose one GPU's PCIe rates are the NVML estimate, ``rate`` bytes/s each way."""
    from commbench.probes.sampler import GpuSample, Sample

    gpu = GpuSample(
        index=0,
        gpu_util_pct=None,
        mem_util_pct=None,
        memory_used_bytes=None,
        sm_clock_mhz=None,
        mem_clock_mhz=None,
        power_w=None,
        pcie_generation=None,
        pcie_width=None,
        pcie_tx_bytes_per_s=rate,
        pcie_rx_bytes_per_s=rate,
        pcie_rate_source=ESTIMATE_SOURCE,
        nvlink_tx_bytes_per_s=None,
        nvlink_rx_bytes_per_s=None,
    )
    return Sample(
        t_s=t_s,
        cpu_user_pct=None,
        cpu_system_pct=None,
        process_cpu_pct=None,
        rss_bytes=0,
        nic_tx_bytes_per_s=None,
        nic_rx_bytes_per_s=None,
        gpus=(gpu,),
    )


def test_estimated_phase_bytes_take_the_ticks_after_its_start_up_to_its_end():
    """A tick's rate is over the interval that ends at it, so a phase from 1.0 s to 2.0 s takes the
    tick at 2.0 s (10 B/s) and not the one at 1.0 s (100 B/s), which is the interval before:
    10 bytes, not the 55 of both averaged (a mutant taking the tick at the start went
    unnoticed)."""
    from commbench.probes.sampler import GpuTotals, Marker, Timeline

    def marker(label: str, t_s: float) -> Marker:
        no_counters = GpuTotals(
            index=0, pcie_tx_bytes=None, pcie_rx_bytes=None, nvlink_tx_bytes=None, nvlink_rx_bytes=None
        )
        return Marker(label=label, t_s=t_s, nic_tx_bytes=None, nic_rx_bytes=None, gpus=(no_counters,))

    tl = Timeline(
        interval_s=1.0,
        nic=None,
        wall_s=3.0,
        sampler_cpu_s=0.0,
        overhead_core_fraction=0.0,
        devices=(),
        samples=(_estimated(0.5, 1000.0), _estimated(1.0, 100.0), _estimated(2.0, 10.0)),
        markers=(marker("a", 1.0), marker("b", 2.0)),
        notes=(),
    )
    (g,) = tl.phase_bytes("a", "b").gpus
    assert g.pcie_source == ESTIMATE_SOURCE
    assert (g.pcie_tx_bytes, g.pcie_rx_bytes) == (10.0, 10.0)


def test_note_when_a_32_bit_counter_could_wrap_twice_in_a_tick():
    """63 GB/s (gen5 x16) for 0.1 s is 6.3 GB, more than 2^32: say so with the numbers."""
    nvml = Nvml.open(FakeNvmlModule([FakeDevice()]))
    s = Sampler(0.1, nvml=nvml).start()
    time.sleep(0.25)  # two ticks, 0.1 s apart
    s.mark("a")
    tl = s.stop()
    assert any("32-bit" in n and "pcie_tx" in n for n in tl.notes)


class _OneSlowTick(FakeNvmlModule):
    """One utilisation read stalls (a slow NVML call, or the GIL held by the training thread)."""

    stall_s = 0.0

    def nvmlDeviceGetUtilizationRates(self, h: int):  # noqa: N802
        stall, self.stall_s = self.stall_s, 0.0
        time.sleep(stall)
        return super().nvmlDeviceGetUtilizationRates(h)


def test_note_when_a_late_tick_leaves_room_for_a_second_wrap():
    """gen4 x16 (31.5 GB/s) moves 3.15 GB in a 0.1 s tick, under 2^32; one tick 0.15 s late makes a
    0.25 s gap, 7.9 GB, in which a second wrap goes unseen. The note was taken from the nominal
    interval, so that gap lost 4 GiB without a word."""
    module = _OneSlowTick([FakeDevice(pcie_max_gen=4, pcie_max_width=16)])
    nvml = Nvml.open(module)
    s = Sampler(0.1, nvml=nvml).start()
    time.sleep(0.05)
    module.stall_s = 0.15
    time.sleep(0.4)
    s.mark("a")
    tl = s.stop()
    assert module.stall_s == 0.0  # the slow tick happened
    (note,) = [n for n in tl.notes if "pcie_tx" in n]
    assert "32-bit" in note and "interval 0.1 s" in note
    gap = float(note.split(" and ")[1].split(" s passed")[0])
    assert gap >= 0.2


def test_a_failed_or_backwards_gpu_counter_read_is_not_measured_rather_than_zero():
    """A failed field-values call kept the last total, so that tick read 0 B/s and the next one the
    bytes of both; a counter that went backwards read 0 B/s too. Those ticks are None now, and the
    phase totals still hold every byte."""
    module = FakeNvmlModule([FakeDevice(pcie_max_gen=3, pcie_max_width=8, pcie_throughput_kb="unsupported")])
    dev = module.devices[0]
    s = Sampler(INTERVAL, nvml=Nvml.open(module))  # driven tick by tick, without its thread
    rates = []
    point = s._point()
    for value, failing in [(10**9, False), (2 * 10**9, True), (3 * 10**9, False), (4 * 10**9, False)]:
        dev.set_field(fk.NVML_FI_DEV_PCIE_COUNT_TX_BYTES, value)
        dev.set_field(fk.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, value // 1024)
        module.fail_field_call = failing
        time.sleep(0.01)
        point, sample = s._tick(point)
        rates.append(sample.gpus[0].pcie_tx_bytes_per_s)
    assert rates[0] > 0 and rates[3] > 0
    assert rates[1:3] == [None, None]  # the failed read's tick, and the one that starts from it
    assert point.gpus[0].pcie_tx_bytes == 4 * 10**9
    # Backwards: a 32-bit PCIe counter wrapped, a 64-bit NVLink counter was reset.
    dev.set_field(fk.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 5)
    point, sample = s._tick(point)
    assert sample.gpus[0].nvlink_rx_bytes_per_s is None
    assert s._notes() == ("GPU 0 nvlink_rx counter went backwards 1 time(s); those ticks are lost",)


def test_a_tick_across_a_reset_that_a_mark_saw_is_not_measured():
    """Only a reset the tick itself read made its rate None: one a mark read in between gave the
    tick a rate short of the bytes lost in the reset, where the interface's tick had none."""
    module = FakeNvmlModule([FakeDevice(pcie_max_gen=3, pcie_max_width=8)])
    dev = module.devices[0]
    s = Sampler(INTERVAL, nvml=Nvml.open(module))  # driven tick by tick, without its thread
    point = s._point()
    dev.set_field(fk.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 10**6)
    time.sleep(0.01)
    point, sample = s._tick(point)
    assert sample.gpus[0].nvlink_rx_bytes_per_s > 0
    dev.set_field(fk.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 2 * 10**6)
    s._thread = object()  # mark() wants a started sampler; this one is driven by hand
    s.mark("before the reset")
    dev.set_field(fk.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 5)  # reset: the driver reloaded
    s.mark("after the reset")
    dev.set_field(fk.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, 10)
    time.sleep(0.01)
    point, sample = s._tick(point)
    assert sample.gpus[0].nvlink_rx_bytes_per_s is None
    assert sample.gpus[0].nvlink_tx_bytes_per_s == 0  # the other counters are still measured
    time.sleep(0.01)
    point, sample = s._tick(point)  # the tick after counts on
    assert sample.gpus[0].nvlink_rx_bytes_per_s == 0


def test_a_tick_reads_the_counters_once():
    """The tick read every counter twice (once in the gauges' read, thrown away, then again)."""
    module = FakeNvmlModule([FakeDevice()])
    nvml = Nvml.open(module)
    opened = module.devices[0].calls["fields"]  # the capability probe at open
    with Sampler(INTERVAL, nvml=nvml) as s:
        time.sleep(INTERVAL * 5)
        s.mark("a")
    tl = s.timeline
    assert len(tl.samples) >= 1
    # one reading when the thread starts, one a tick, one a mark
    assert module.devices[0].calls["fields"] - opened == 1 + len(tl.samples) + len(tl.markers)


def test_unsupported_gpu_fields_are_none_and_pcie_falls_back_to_estimate():
    dev = FakeDevice(power_mw="unsupported")
    dev.fields[fk.NVML_FI_DEV_PCIE_COUNT_TX_BYTES] = fk.NVML_ERROR_NOT_SUPPORTED
    dev.fields[fk.NVML_FI_DEV_PCIE_COUNT_RX_BYTES] = fk.NVML_ERROR_NOT_SUPPORTED
    nvml = Nvml.open(FakeNvmlModule([dev]))
    with Sampler(INTERVAL, nvml=nvml) as s:
        time.sleep(0.01)
        s.mark("a")
        time.sleep(INTERVAL * 4)
        s.mark("b")
    tl = s.timeline
    rows = [x.gpus[0] for x in tl.samples]
    assert rows and all(r.power_w is None and r.pcie_rate_source == ESTIMATE_SOURCE for r in rows)
    assert rows[0].pcie_tx_bytes_per_s == 1000 * 1024
    (g,) = tl.phase_bytes("a", "b").gpus
    assert g.pcie_source == ESTIMATE_SOURCE and g.pcie_tx_bytes == pytest.approx(
        1000 * 1024 * tl.phase_bytes("a", "b").seconds
    )
    assert tl.summary()["gpus"][0]["power_w"] is None


def test_misuse_raises():
    with pytest.raises(ValueError, match="interval_s"):
        Sampler(0)
    with pytest.raises(ValueError, match="no network interface"):
        Sampler(nic="nope0")
    s = Sampler(INTERVAL)
    with pytest.raises(RuntimeError):
        s.mark("early")
    with pytest.raises(RuntimeError):
        s.stop()
    s.start()
    s.mark("x")
    with pytest.raises(ValueError, match="unique"):
        s.mark("x")
    tl = s.stop()
    with pytest.raises(KeyError, match="nope"):
        tl.phase_bytes("x", "nope")
    with pytest.raises(RuntimeError):
        s.start()


def test_thread_error_is_reported_by_stop():
    module = FakeNvmlModule()
    nvml = Nvml.open(module)

    def boom(index: int, **kwargs: object) -> None:
        raise OSError("device fell off the bus")

    nvml.read = boom  # type: ignore[method-assign]
    s = Sampler(INTERVAL, nvml=nvml).start()
    time.sleep(INTERVAL * 3)
    with pytest.raises(RuntimeError, match="fell off the bus"):
        s.stop()


def _lo_counters(monkeypatch, shift: dict) -> None:
    """psutil's per-interface counters, with lo's moved by ``shift["bytes"]`` (or lo gone when it
    is None)."""
    import psutil

    real = psutil.net_io_counters

    def counters(pernic: bool = True, nowrap: bool = False):
        got = dict(real(pernic=True, nowrap=False))
        if shift["bytes"] is None:
            got.pop("lo", None)
        else:
            c = got["lo"]
            got["lo"] = c._replace(
                bytes_sent=c.bytes_sent + shift["bytes"], bytes_recv=c.bytes_recv + shift["bytes"]
            )
        return got

    monkeypatch.setattr(psutil, "net_io_counters", counters)


def test_interface_counters_that_go_backwards_lose_ticks_not_sign(monkeypatch):
    """A link reset or driver reload sets the counters back: rates and phase bytes came out
    negative (-6e14 B/s) where they now stay at or above zero, and a note says ticks were lost.
    The tick that spans the reset has no rate (None), not the 0 B/s it showed."""
    shift = {"bytes": 1 << 40}
    _lo_counters(monkeypatch, shift)
    s = Sampler(INTERVAL, nic="lo").start()
    time.sleep(0.1)
    s.mark("a")
    shift["bytes"] = 0  # back by a terabyte
    _send_through_loopback(1 << 20)
    time.sleep(0.1)
    s.mark("b")
    time.sleep(INTERVAL * 3)  # a tick after the mark, should the mark have been first to see it
    tl = s.stop()
    rates = [x.nic_tx_bytes_per_s for x in tl.samples]
    assert sum(r is None for r in rates) == 1 and min(r for r in rates if r is not None) >= 0
    assert 0 <= tl.phase_bytes("a", "b").nic_tx_bytes < 1 << 30
    assert any("counters went backwards" in n for n in tl.notes)


def test_an_interface_that_goes_away_ends_its_counting_not_the_run(monkeypatch):
    """The sampler's thread died on the missing interface, and the next mark() raised in the run.
    After it has gone nothing is measured: rates and phase bytes are None, where they were a
    frozen total's 0 B/s and 0 bytes."""
    shift = {"bytes": 0}
    _lo_counters(monkeypatch, shift)
    s = Sampler(INTERVAL, nic="lo").start()
    time.sleep(0.05)
    s.mark("a")
    shift["bytes"] = None
    time.sleep(0.1)
    s.mark("b")
    tl = s.stop()
    assert tl.markers[0].nic_tx_bytes is not None
    assert tl.phase_bytes("a", "b").nic_tx_bytes is None
    after = [x for x in tl.samples if x.t_s > tl.markers[0].t_s + 0.05]
    assert after and all(x.nic_tx_bytes_per_s is None and x.nic_rx_bytes_per_s is None for x in after)
    assert any("went away" in n for n in tl.notes)
