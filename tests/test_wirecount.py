"""Grouping ranks' interface readings by host, and the link-maximum check, without a process group."""

from __future__ import annotations

import pytest

from commbench.probes import host
from commbench.probes.links import ImpossibleReading
from commbench.probes.wirecount import WireCounter, link_gbps


def _counter(hosts: list[list[int]], nics: list[str], interconnect: str, mtu: int, link: float | None):
    c = WireCounter.__new__(WireCounter)  # the grouping a live group would have gathered
    c.hosts = hosts
    c.info = [(n, f"198.18.0.{i + 1}") for i, n in enumerate(nics)]
    c.interconnect, c.mtu, c.nic, c.link_gbps = interconnect, mtu, nics[0], link
    return c


def test_shared_loopback_is_compared_with_the_sum_over_ranks() -> None:
    c = _counter([[0, 1, 2]], ["lo"], "loopback", 65536, None)
    sent = [2_000_000, 1_000_000, 1_000_000]
    # Every rank read the same counter; rank 0's reading is used: 3 iterations, 12 MB + framing.
    rows = [[12_012_000, 12_012_000, 1000, 1000, 0.3, 0.03]] + [[1, 1, 0, 0, 0.3, 0.03]] * 2
    wc = c.summarise(rows, 3, sent, sent, 2 << 20)
    (h,) = wc.hosts
    assert h.ranks == [0, 1, 2] and h.computed_tx_bytes == 4_000_000
    assert h.tx_bytes == (12_012_000 - 1000) // 3
    assert wc.wire_bytes_ratio == pytest.approx(12_011_000 / 12_000_000)
    assert wc.wire_check is None
    assert h.cpu_user == pytest.approx(0.3)  # CPU seconds summed over the host's ranks, per iteration


def test_one_rank_per_host_each_with_its_own_counter() -> None:
    c = _counter([[0], [1], [2]], ["eth0", "eth0", "eth0"], "ethernet", 1500, None)
    sent = [2_000_000, 1_000_000, 1_000_000]  # naive: rank 0 sends (n-1) x S
    rows = [[int(s * 1.046), int(s * 1.046), 0, 0, 0.1, 0.0] for s in sent]
    wc = c.summarise(rows, 1, sent, sent, 1 << 20)
    assert [h.computed_tx_bytes for h in wc.hosts] == sent
    assert [h.address for h in wc.hosts] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
    assert wc.wire_check is None


def test_a_short_count_is_flagged_and_small_messages_are_not_judged() -> None:
    c = _counter([[0, 1]], ["lo"], "loopback", 65536, None)
    rows = [[900_000, 900_000, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    assert "measured/computed" in c.summarise(rows, 1, [500_000, 500_000], [500_000] * 2, 2 << 20).wire_check
    assert c.summarise(rows, 1, [500_000, 500_000], [500_000] * 2, 4096).wire_check.startswith("not judged")


def test_link_check_refuses_an_impossible_rate(monkeypatch) -> None:
    c = _counter([[0]], ["eth0"], "ethernet", 1500, 0.125)  # 1 Gbit/s
    ok = host.NicCounters(tx_bytes=120_000_000, rx_bytes=0, tx_packets=0, rx_packets=0)
    c.check_link(ok, 1.0)
    with pytest.raises(ImpossibleReading, match="eth0 sent"):
        c.check_link(host.NicCounters(tx_bytes=200_000_000, rx_bytes=0, tx_packets=0, rx_packets=0), 1.0)
    c.check_link(
        host.NicCounters(tx_bytes=200_000_000, rx_bytes=0, tx_packets=0, rx_packets=0), 0.05
    )  # burst
    monkeypatch.setenv("COMMBENCH_LINK_GBPS", "2.5")
    assert link_gbps("eth0", False) == pytest.approx(2.5 / 8)
    monkeypatch.delenv("COMMBENCH_LINK_GBPS")
    assert link_gbps("lo", True) is None


def test_framing_is_counted_per_packet_where_packets_are_known() -> None:
    # veth with offload: 64 KiB segments, so 1 MB of payload is ~16 packets, not ~700 frames.
    c = _counter([[0], [1]], ["eth0", "eth0"], "ethernet", 1500, None)
    sent = [1_000_000, 1_000_000]
    rows = [[s + 16 * 66, s + 16 * 66, 0, 0, 0.0, 0.0, 16, 0] for s in sent]
    wc = c.summarise(rows, 1, sent, sent, 1 << 20)
    assert wc.wire_expected_ratio == pytest.approx(1 + 32 * 66 / 2_000_000)
    assert wc.wire_check is None  # the MTU-based 1.046 would have flagged this
    assert c.summarise([r[:6] for r in rows], 1, sent, sent, 1 << 20).wire_check is not None


def test_a_window_opens_between_two_barriers(monkeypatch):
    """All ranks done with what came before, then the reading, then nobody starts until all read."""
    from commbench.probes import wirecount

    calls = []
    monkeypatch.setattr(wirecount.dist, "barrier", lambda: calls.append("barrier"))
    assert wirecount.opened(lambda: calls.append("read") or 7) == 7
    assert calls == ["barrier", "read", "barrier"]
