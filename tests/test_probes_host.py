"""Host probes for real on this machine: loopback counters rise with bytes sent through a local
socket, loopback and own addresses route to lo, CPU and memory readings are sane."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import threading
import time

import psutil
import pytest

from commbench.probes import host

PAYLOAD = 4 << 20


def _send_through_loopback(nbytes: int) -> None:
    """Send ``nbytes`` over a TCP connection to ourselves on 127.0.0.1 and receive them all."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        got = []

        def receive() -> None:
            conn, _ = server.accept()
            with conn:
                n = 0
                while n < nbytes:
                    chunk = conn.recv(1 << 20)
                    if not chunk:
                        break
                    n += len(chunk)
                got.append(n)

        t = threading.Thread(target=receive, daemon=True)
        t.start()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(b"x" * nbytes)
        t.join(timeout=10)
        assert got == [nbytes]


def test_loopback_counters_rise_by_at_least_what_was_sent():
    lo = host.nic_for_address("127.0.0.1")
    before = host.read_nic(lo)
    _send_through_loopback(PAYLOAD)
    delta = host.nic_delta(before, host.read_nic(lo))
    assert delta.tx_bytes >= PAYLOAD and delta.rx_bytes >= PAYLOAD
    assert delta.tx_packets >= PAYLOAD // 65536


def test_read_nic_ignores_psutil_wrap_cache():
    """psutil's nowrap cache, left as a race between two reading threads leaves it (a reading above
    the next one, taken for a wrap), must not reach our counters."""
    from psutil._common import wrap_numbers

    raw = psutil.net_io_counters(pernic=True, nowrap=False)
    inflated = {nic: type(c)(*(2 * v + (1 << 40) for v in c)) for nic, c in raw.items()}
    wrap_numbers(inflated, "psutil.net_io_counters")  # the late, larger reading
    try:
        assert psutil.net_io_counters(pernic=True)["lo"].bytes_sent > 1 << 40  # psutil now adds it
        ours = host.read_nic("lo")
        after = psutil.net_io_counters(pernic=True, nowrap=False)["lo"]
        assert raw["lo"].bytes_sent <= ours.tx_bytes <= after.bytes_sent
        assert raw["lo"].packets_recv <= ours.rx_packets <= after.packets_recv
    finally:
        psutil.net_io_counters.cache_clear()


def test_read_nic_from_two_threads_under_traffic():
    """A sampler thread and a wire count read the same counters at once: no reading may run ahead
    of the kernel's counter read just after it."""
    stop = threading.Event()
    ahead: list[tuple[int, int]] = []

    def reader() -> None:
        while not stop.is_set():
            mine = host.read_nic("lo").tx_bytes
            kernel = psutil.net_io_counters(pernic=True, nowrap=False)["lo"].bytes_sent
            if mine > kernel:
                ahead.append((mine, kernel))

    threads = [threading.Thread(target=reader, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(8):
            _send_through_loopback(PAYLOAD)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    assert not ahead, ahead[:3]


def test_loopback_addresses_route_to_lo():
    assert host.nic_for_address("127.0.0.1") == "lo"
    assert host.nic_for_address("127.3.2.1") == "lo"
    assert host.nic_for_address("localhost") == "lo"


def test_own_address_routes_to_lo():
    """Linux delivers traffic to this machine's own addresses over loopback."""
    own = [
        a.address
        for nic, addrs in psutil.net_if_addrs().items()
        if nic != "lo"
        for a in addrs
        if a.family == socket.AF_INET
    ]
    if not own:
        pytest.skip("no IPv4 address besides loopback on this machine")
    assert host.nic_for_address(own[0]) == "lo"


def test_unresolvable_address_falls_back_to_an_existing_interface():
    nic = host.nic_for_address("no-such-host.invalid")
    assert nic in psutil.net_io_counters(pernic=True)


def test_the_fallback_is_the_busiest_interface_that_is_up(monkeypatch):
    """An address that names no route or subnet here gets the busiest non-loopback interface that
    is up: not loopback however busy, not one that is down however much it once carried."""
    from types import SimpleNamespace

    def v4(address: str, netmask: str = "255.255.255.0") -> SimpleNamespace:
        return SimpleNamespace(family=socket.AF_INET, address=address, netmask=netmask)

    addrs = {"lo": [v4("127.0.0.1", "255.0.0.0")], "eth0": [v4("10.1.0.2")], "eth1": [v4("10.2.0.2")]}
    addrs["eth2"] = [v4("10.3.0.2")]
    up = {"lo": True, "eth0": True, "eth1": True, "eth2": False}
    carried = {"lo": 10**12, "eth0": 10_000, "eth1": 30_000, "eth2": 10**11}
    monkeypatch.setattr(psutil, "net_if_addrs", lambda: addrs)
    monkeypatch.setattr(psutil, "net_if_stats", lambda: {n: SimpleNamespace(isup=u) for n, u in up.items()})
    monkeypatch.setattr(
        psutil,
        "net_io_counters",
        lambda pernic, nowrap: {n: SimpleNamespace(bytes_sent=b, bytes_recv=0) for n, b in carried.items()},
    )
    monkeypatch.setattr(host, "_source_ip", lambda ip: None)  # no route: past the subnets, the fallback
    assert host.nic_for_address("no-such-host.invalid") == "eth1"
    assert host.nic_for_address("192.0.2.1") == "eth1"  # in no subnet here
    assert host.nic_for_address("10.1.0.9") == "eth0"  # in eth0's subnet, however quiet
    carried["eth0"] = 40_000
    assert host.nic_for_address("192.0.2.1") == "eth0"
    up["eth0"] = up["eth1"] = False
    assert host.nic_for_address("192.0.2.1") == "lo"  # nothing else is up


def test_a_subnet_given_by_an_ipv6_netmask_is_matched(monkeypatch):
    """psutil gives IPv6 netmasks as addresses ('ffff:ffff:ffff:ffff::'), which ipaddress does
    not take after a slash: the interface was read as a /128 and no IPv6 subnet ever matched."""
    from types import SimpleNamespace

    def addrs() -> dict:
        v6 = SimpleNamespace(family=socket.AF_INET6, address="fd00::5%eth9", netmask="ffff:ffff:ffff:ffff::")
        v4 = SimpleNamespace(family=socket.AF_INET, address="198.18.7.5", netmask="255.255.255.0")
        lo = SimpleNamespace(family=socket.AF_INET, address="127.0.0.1", netmask="255.0.0.0")
        return {"lo": [lo], "eth9": [v6], "eth8": [v4]}

    monkeypatch.setattr(psutil, "net_if_addrs", addrs)
    monkeypatch.setattr(host, "_source_ip", lambda ip: None)  # no route: the subnet decides
    monkeypatch.setattr(host, "_busiest", lambda ifaces, lo: "busiest")
    assert host.nic_for_address("fd00::7") == "eth9"
    assert host.nic_for_address("198.18.7.9") == "eth8"
    assert host.nic_for_address("fd00:1::7") == "busiest"  # outside the /64
    assert host._prefix_length("ffff:ffff:ffff:ff00::") == 56
    assert host._prefix_length("ffff::ffff") is None  # not contiguous


def test_this_hosts_address_in_another_spelling_routes_to_lo(monkeypatch):
    """A zoned link-local address and an IPv4-mapped one are this host's too: they went out to the
    route's interface, whose counter sees none of the traffic, where the plain forms gave lo."""
    from types import SimpleNamespace

    def addrs() -> dict:
        v4 = SimpleNamespace(family=socket.AF_INET, address="198.18.7.5", netmask="255.255.255.0")
        v6 = SimpleNamespace(family=socket.AF_INET6, address="fe80::5%eth9", netmask="ffff:ffff:ffff:ffff::")
        lo = SimpleNamespace(family=socket.AF_INET, address="127.0.0.1", netmask="255.0.0.0")
        return {"lo": [lo], "eth9": [v4, v6]}

    monkeypatch.setattr(psutil, "net_if_addrs", addrs)
    monkeypatch.setattr(host, "_source_ip", lambda ip: ipaddress.ip_address("198.18.7.5"))
    assert host.nic_for_address("fe80::5%eth9") == "lo"
    assert host.nic_for_address("fe80::5") == "lo"
    assert host.nic_for_address("::ffff:198.18.7.5") == "lo"
    assert host.nic_for_address("::ffff:127.0.0.1") == "lo"
    assert host.nic_for_address("198.18.7.9") == "eth9"  # a peer: the route's interface


def test_selected_nic_env_override(monkeypatch):
    monkeypatch.setenv(host.NIC_ENV, "lo")
    assert host.selected_nic("10.1.2.3") == "lo"
    monkeypatch.setenv(host.NIC_ENV, "nope0")
    with pytest.raises(ValueError, match="nope0"):
        host.selected_nic()
    monkeypatch.delenv(host.NIC_ENV)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert host.selected_nic() == "lo"


def test_unknown_interface_and_backwards_counters_raise():
    with pytest.raises(ValueError, match="no network interface"):
        host.read_nic("nope0")
    a = host.NicCounters(tx_bytes=10, rx_bytes=10, tx_packets=1, rx_packets=1)
    b = host.NicCounters(tx_bytes=5, rx_bytes=10, tx_packets=1, rx_packets=1)
    with pytest.raises(ValueError, match="backwards"):
        host.nic_delta(a, b)


def test_read_nic_takes_sent_as_tx_and_received_as_rx(monkeypatch):
    """On loopback sent and received are equal, which would hide a swap: here each differs."""
    from types import SimpleNamespace

    eth = SimpleNamespace(bytes_sent=1000, bytes_recv=2000, packets_sent=3, packets_recv=4)
    monkeypatch.setattr(psutil, "net_io_counters", lambda pernic, nowrap: {"eth9": eth})
    assert host.read_nic("eth9") == host.NicCounters(tx_bytes=1000, rx_bytes=2000, tx_packets=3, rx_packets=4)


def test_nic_delta_subtracts_each_counter_and_refuses_any_that_went_backwards():
    """Each counter's delta is its own (after less before); a packet counter that went backwards
    is refused as a byte counter is."""
    before = host.NicCounters(tx_bytes=10, rx_bytes=20, tx_packets=1, rx_packets=2)
    after = host.NicCounters(tx_bytes=15, rx_bytes=40, tx_packets=4, rx_packets=10)
    assert host.nic_delta(before, after) == host.NicCounters(
        tx_bytes=5, rx_bytes=20, tx_packets=3, rx_packets=8
    )
    for field in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"):
        back = dataclasses.replace(after, **{field: getattr(before, field) - 1})
        with pytest.raises(ValueError, match="backwards"):
            host.nic_delta(before, back)


def test_machine_cpu_counts_guest_time_once(monkeypatch):
    """Linux counts guest time inside user (and guest_nice inside nice): the total is every field
    but those two, and user is user plus nice."""
    import collections

    fields = "user nice system idle iowait irq softirq steal guest guest_nice"
    scputimes = collections.namedtuple("scputimes", fields)
    times = scputimes(user=10.0, nice=2.0, system=3.0, idle=80.0, iowait=1.0, irq=0.0, softirq=0.0,
                      steal=0.0, guest=4.0, guest_nice=1.0)  # fmt: skip
    monkeypatch.setattr(psutil, "cpu_times", lambda: times)
    m = host.machine_cpu()
    assert (m.user_s, m.system_s) == (10.0 + 2.0, 3.0)
    assert m.total_s == pytest.approx(10.0 + 2.0 + 3.0 + 80.0 + 1.0)  # 96, not 101


def test_cpu_percentages_from_two_readings():
    before, after = host.CpuTimes(user_s=1.0, system_s=0.5), host.CpuTimes(user_s=1.5, system_s=0.75)
    assert host.process_cpu_percent(before, after, 0.5) == pytest.approx(150.0)  # of one core
    assert host.process_cpu_percent(before, after, 0.0) is None
    m0 = host.MachineCpu(user_s=10.0, system_s=5.0, total_s=100.0)
    m1 = host.MachineCpu(user_s=13.0, system_s=6.0, total_s=110.0)
    assert host.machine_cpu_percent(m0, m1) == (pytest.approx(30.0), pytest.approx(10.0))
    assert host.machine_cpu_percent(m0, m0) == (None, None)


def test_cpu_and_memory_readings():
    before, m0, t0 = host.cpu_times(), host.machine_cpu(), time.perf_counter()
    spent = time.process_time()
    x = 0
    while time.process_time() - spent < 0.3:  # a busy loop: CPU time in this process
        x += 1
    after, m1, wall = host.cpu_times(), host.machine_cpu(), time.perf_counter() - t0
    used = (after.user_s + after.system_s) - (before.user_s + before.system_s)
    assert used >= 0.2  # the loop's 0.3 s, as the kernel counts it (in ticks)
    assert 5.0 <= host.process_cpu_percent(before, after, wall) <= 100.0 * (os.cpu_count() or 1) + 1e-6
    user, system = host.machine_cpu_percent(m0, m1)
    assert user is not None and user > 0 and 0 <= user + system <= 100.0 + 1e-6
    assert m1.total_s - m0.total_s >= used - 0.05  # the machine's CPU time includes this process's
    assert host.rss_bytes() > 1 << 20
