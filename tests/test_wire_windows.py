"""The training byte count's idle baseline: a burst of someone else's traffic while it is taken
does not come off every step after (one rank, a fake interface counter)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from commbench.probes import host, wirecount


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    """A one-rank gloo group whose interface is "lo" (each test fakes its counters)."""
    monkeypatch.setattr(host, "selected_nic", lambda *a: "lo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_idle_baseline_is_the_quietest_interval(one_rank, monkeypatch):
    reads = itertools.count()

    def read_nic(nic: str) -> host.NicCounters:
        n = next(reads)  # one byte and one packet between readings, and 500 kB in the first interval
        b = n + (500_000 if n >= 1 else 0)
        return host.NicCounters(tx_bytes=b, rx_bytes=b, tx_packets=n, rx_packets=n)

    monkeypatch.setattr(host, "read_nic", read_nic)
    windows = wirecount.StepWindows(wirecount.WireCounter(torch.device("cpu")), idle_s=0.05)
    assert windows.idle_rate[0] < 1000 and windows.idle_rate[1] < 1000, windows.idle_rate


def test_a_sweep_points_baseline_is_its_quieter_idle_interval(one_rank, monkeypatch):
    """A point's count idles twice after the pass: a burst of someone else's 500 kB in the first
    interval is not taken away from the point's bytes; the second interval's 100 bytes are."""
    counter = wirecount.WireCounter(torch.device("cpu"))
    # the pass (2 MB), then the first idle interval (a 500 kB burst), then the second (100 B)
    tx = iter([0, 2_000_000, 2_000_000, 2_500_000, 2_500_000, 2_500_100])

    def read_nic(nic: str) -> host.NicCounters:
        b = next(tx)
        return host.NicCounters(tx_bytes=b, rx_bytes=b, tx_packets=b // 1000, rx_packets=b // 1000)

    monkeypatch.setattr(host, "read_nic", read_nic)
    wc = counter.count(lambda: None, 1, [2_000_000], [2_000_000], 2 << 20)
    (h,) = wc.hosts
    assert (h.tx_bytes, h.rx_bytes) == (2_000_000 - 100, 2_000_000 - 100)


def test_a_step_whose_counters_went_backwards_is_not_judged(one_rank, monkeypatch):
    """A reset in the middle of a step: that strategy's epoch is not judged (it raised ValueError,
    which ended the training with exit 2 as if it were bad input); the next epoch is counted."""
    counted = {"bytes": 0}

    def read_nic(nic: str) -> host.NicCounters:
        counted["bytes"] += 1000
        b = counted["bytes"]
        return host.NicCounters(tx_bytes=b, rx_bytes=b, tx_packets=b // 1000, rx_packets=b // 1000)

    def reset() -> None:
        counted["bytes"] = 0

    monkeypatch.setattr(host, "read_nic", read_nic)
    windows = wirecount.StepWindows(wirecount.WireCounter(torch.device("cpu")), idle_s=0.01)
    windows.around("ddp", reset)
    windows.around("ddp", lambda: None)
    lost = windows.take("ddp", 2, [0], [0], 1 << 20)
    windows.around("ddp", lambda: None)
    counted_epoch = windows.take("ddp", 1, [0], [0], 1 << 20)
    assert lost.wire_check.startswith("not judged: the interface counters went backwards"), lost
    assert lost.measured_wire_bytes is None and lost.hosts == []
    assert counted_epoch.measured_wire_bytes is not None and len(counted_epoch.hosts) == 1
    assert "went backwards" not in (counted_epoch.wire_check or "")


def test_no_idle_baseline_leaves_every_step_not_judged(one_rank, monkeypatch):
    """Counters that go backwards in every idle interval: there is no baseline to take away."""
    falling = itertools.count()

    def read_nic(nic: str) -> host.NicCounters:
        b = 10**9 - 1000 * next(falling)
        return host.NicCounters(tx_bytes=b, rx_bytes=b, tx_packets=b, rx_packets=b)

    monkeypatch.setattr(host, "read_nic", read_nic)
    windows = wirecount.StepWindows(wirecount.WireCounter(torch.device("cpu")), idle_s=0.01)
    monkeypatch.setattr(
        host, "read_nic", lambda nic: host.NicCounters(tx_bytes=1, rx_bytes=1, tx_packets=1, rx_packets=1)
    )
    windows.around("ddp", lambda: None)
    wc = windows.take("ddp", 1, [0], [0], 1 << 20)
    assert windows.idle_rate is None
    assert wc.wire_check.startswith("not judged: the interface counters went backwards"), wc
