"""Host probes through psutil: which interface carries traffic to the master, its byte and packet
counters, this process's CPU time and memory, and the whole machine's CPU split."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket

import psutil

NIC_ENV = "COMMBENCH_NIC"


@dataclasses.dataclass(frozen=True, kw_only=True)
class NicCounters:
    """Cumulative (or, from :func:`nic_delta`, differences of) interface counters."""

    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class CpuTimes:
    """CPU seconds this process has spent in user and kernel mode (children not included)."""

    user_s: float
    system_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class MachineCpu:
    """Cumulative CPU seconds of the whole machine, summed over cores."""

    user_s: float
    system_s: float
    total_s: float


_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``address`` as an IP, resolving a host name through the system resolver; None if it fails."""
    try:
        return ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.getaddrinfo(address, None)[0][4][0])
    except (OSError, ValueError, IndexError):
        return None


def _prefix_length(netmask: str) -> int | None:
    """The prefix length of a netmask written as an address ('255.255.255.0' -> 24,
    'ffff:ffff:ffff:ffff::' -> 64); None where it is not one, or its ones are not contiguous."""
    try:
        mask = ipaddress.ip_address(netmask.split("%")[0])
    except ValueError:
        return None
    bits = mask.max_prefixlen
    value = int(mask)
    ones = bits - (~value & ((1 << bits) - 1)).bit_length()
    return ones if value == ((1 << bits) - 1) ^ ((1 << (bits - ones)) - 1) else None


def _interface_ips() -> dict[str, list[ipaddress.IPv4Interface | ipaddress.IPv6Interface]]:
    out: dict[str, list] = {}
    for nic, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            ip = a.address.split("%")[0]  # drop an IPv6 zone
            # ipaddress takes an IPv4 netmask after the slash but not an IPv6 one: give it the length
            prefix = _prefix_length(a.netmask) if a.netmask else None
            try:
                net = ipaddress.ip_interface(ip if prefix is None else f"{ip}/{prefix}")
            except ValueError:
                net = ipaddress.ip_interface(ip)
            out.setdefault(nic, []).append(net)
    return out


def _loopback_nic(ifaces: dict[str, list]) -> str:
    for nic, nets in ifaces.items():
        if any(n.ip.is_loopback for n in nets):
            return nic
    return "lo"


def _source_ip(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address the kernel would send from to reach ``ip`` (a UDP connect sends nothing)."""
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((str(ip), 9))
            return ipaddress.ip_address(s.getsockname()[0].split("%")[0])
    except (OSError, ValueError):
        return None


def _plain(ip: _Address) -> _Address:
    """``ip`` without an IPv6 zone, and an IPv4-mapped IPv6 address as its IPv4 one: the forms in
    which two spellings of one address compare equal ("fe80::1%eth0" is "fe80::1")."""
    if ip.version == 6:
        return ip.ipv4_mapped or ipaddress.IPv6Address(int(ip))
    return ip


def nic_for_address(address: str) -> str:
    """The interface whose traffic reaches ``address`` (an IP or host name).

    Loopback addresses, and this machine's own addresses (Linux delivers those through loopback
    too), give the loopback interface. Otherwise the kernel's route choice decides (the interface
    holding the source address it picks), then a subnet that contains the address, and as a last
    resort the busiest non-loopback interface that is up.
    """
    ifaces = _interface_ips()
    lo = _loopback_nic(ifaces)
    ip = _ip(address)
    if ip is None:
        return _busiest(ifaces, lo)
    if _plain(ip).is_loopback or any(_plain(n.ip) == _plain(ip) for nets in ifaces.values() for n in nets):
        return lo
    src = _source_ip(ip)
    if src is not None:
        for nic, nets in ifaces.items():
            if any(n.ip == src for n in nets):
                return nic
    for nic, nets in ifaces.items():
        if any(n.version == ip.version and ip in n.network and n.network.prefixlen > 0 for n in nets):
            return nic
    return _busiest(ifaces, lo)


def _busiest(ifaces: dict[str, list], lo: str) -> str:
    stats = psutil.net_if_stats()
    counters = psutil.net_io_counters(pernic=True, nowrap=False)
    up = [n for n in ifaces if n != lo and n in stats and stats[n].isup and n in counters]
    if not up:
        return lo
    return max(up, key=lambda n: counters[n].bytes_sent + counters[n].bytes_recv)


def selected_nic(master_addr: str | None = None) -> str:
    """``$COMMBENCH_NIC`` where set, else the interface toward ``master_addr`` (default
    ``$MASTER_ADDR``, else 127.0.0.1). Raises ValueError for an override naming no interface."""
    override = os.environ.get(NIC_ENV, "").strip()
    if override:
        known = psutil.net_io_counters(pernic=True, nowrap=False)
        if override not in known:
            raise ValueError(
                f"{NIC_ENV}={override!r} is not an interface here; known: {', '.join(sorted(known))}"
            )
        return override
    return nic_for_address(master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1")


def read_nic(nic: str) -> NicCounters:
    """The cumulative counters of interface ``nic``, as the kernel gives them (64 bits on Linux).

    Not through psutil's ``nowrap``: it reads the counters first and takes its lock only to compare
    them with its last reading, so of two threads reading at once (a probe sampler beside a wire
    count), the older reading can arrive second, look like a wrap, and add the interface's whole
    cumulative count to every later reading in the process. A training epoch once measured 426,000
    times its computed bytes that way.
    """
    counters = psutil.net_io_counters(pernic=True, nowrap=False)
    if nic not in counters:
        raise ValueError(f"no network interface {nic!r}; known: {', '.join(sorted(counters))}")
    c = counters[nic]
    return NicCounters(
        tx_bytes=c.bytes_sent, rx_bytes=c.bytes_recv, tx_packets=c.packets_sent, rx_packets=c.packets_recv
    )


def nic_delta(before: NicCounters, after: NicCounters) -> NicCounters:
    """What the interface counted between two readings; ValueError if a counter went backwards."""
    delta = NicCounters(
        tx_bytes=after.tx_bytes - before.tx_bytes,
        rx_bytes=after.rx_bytes - before.rx_bytes,
        tx_packets=after.tx_packets - before.tx_packets,
        rx_packets=after.rx_packets - before.rx_packets,
    )
    if min(dataclasses.astuple(delta)) < 0:
        raise ValueError(f"interface counters went backwards (reset?): {delta}")
    return delta


def cpu_times(process: psutil.Process | None = None) -> CpuTimes:
    """User and system CPU seconds of ``process`` (default this one)."""
    t = (process or psutil.Process()).cpu_times()
    return CpuTimes(user_s=t.user, system_s=t.system)


def process_cpu_percent(before: CpuTimes, after: CpuTimes, wall_s: float) -> float | None:
    """CPU use between two readings in percent of one core (may exceed 100); None for no interval."""
    if wall_s <= 0:
        return None
    return 100.0 * ((after.user_s - before.user_s) + (after.system_s - before.system_s)) / wall_s


def machine_cpu() -> MachineCpu:
    """Cumulative CPU seconds of the whole machine (user includes nice; Linux already counts guest
    time in user, so it is not added to the total twice)."""
    t = psutil.cpu_times()
    total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
    return MachineCpu(user_s=t.user + getattr(t, "nice", 0.0), system_s=t.system, total_s=total)


def machine_cpu_percent(before: MachineCpu, after: MachineCpu) -> tuple[float | None, float | None]:
    """(user %, system %) of all cores between two readings; None where no CPU time passed."""
    total = after.total_s - before.total_s
    if total <= 0:
        return None, None
    return 100.0 * (after.user_s - before.user_s) / total, 100.0 * (after.system_s - before.system_s) / total


def rss_bytes(process: psutil.Process | None = None) -> int:
    """Resident memory of ``process`` (default this one) in bytes."""
    return (process or psutil.Process()).memory_info().rss
