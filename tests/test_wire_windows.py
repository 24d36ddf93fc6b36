"""The training byte count's idle baseline: a burst of someone else's traffic while it is taken
does not come off every step after (one rank, a fake interface counter)."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from commbench.probes import host, wirecount


def test_the_idle_baseline_is_the_quietest_interval(tmp_path, monkeypatch):
    reads = itertools.count()

    def read_nic(nic: str) -> host.NicCounters:
        n = next(reads)  # one byte and one packet between readings, and 500 kB in the first interval
        b = n + (500_000 if n >= 1 else 0)
        return host.NicCounters(tx_bytes=b, rx_bytes=b, tx_packets=n, rx_packets=n)

    monkeypatch.setattr(host, "read_nic", read_nic)
    monkeypatch.setattr(host, "selected_nic", lambda *a: "lo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        windows = wirecount.StepWindows(wirecount.WireCounter(torch.device("cpu")), idle_s=0.05)
    finally:
        dist.destroy_process_group()
    assert windows.idle_rate[0] < 1000 and windows.idle_rate[1] < 1000, windows.idle_rate
