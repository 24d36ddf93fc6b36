"""Network-namespace plumbing of the emulated cluster: hosts, a switch, shaped links.

Each host is a namespace with one interface ``eth0``, the end of a veth pair whose other end is
a port of a bridge in a switch namespace. A host's uplink (what it sends) is shaped by a qdisc on
its ``eth0``; its downlink (what it receives) by a qdisc on its switch port, as a switch port
limits a real NIC's receive side. Nothing is created in the caller's namespace, so deleting the
namespaces removes every interface and qdisc; the switch ports' counters are each host's traffic
seen from the wire (port rx = host tx).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

PREFIX = "commbench"
NIC = "eth0"
BRIDGE = "br0"
NETWORK = "198.18.0.0/15"  # RFC 2544's range for network benchmarks
FIRST_HOST = 100  # host i is 198.18.0.(100+i): same-width strings, so sorted text is host order
MAX_HOSTS = 100
RDZV_PORT = 29400
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21
_NAME = re.compile(rf"^{PREFIX}-(\d+)-(sw|h\d+)$")
# Above about 1.07 Tbit/s tc's token bucket, kept as the time the burst takes at the rate, rounds
# to nothing ("rate 2Tbit burst 0b"): the link would be shaped to nothing like the rate asked for.
MAX_RATE_BIT = 10**12
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TIME_UNITS = {"s": 1e6, "ms": 1e3, "us": 1.0}


def parse_rate(text: str) -> int:
    """Bits per second from tc-style text: ``1gbit``, ``100mbit``, ``2.5gbit`` (SI multiples)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?bit)\s*", text.lower())
    if not m:
        raise ValueError(f"bad rate {text!r}; use a number with bit, kbit, mbit, gbit or tbit (e.g. 1gbit)")
    value = float(m.group(1)) * _RATE_UNITS[m.group(2)]
    if not math.isfinite(value) or value > MAX_RATE_BIT:
        raise ValueError(f"rate {text!r} is above 1tbit, beyond which tc's token bucket holds nothing")
    bits = round(value)
    if bits < 8000:
        raise ValueError(f"rate {text!r} is below 8kbit")
    return bits


def parse_time_us(text: str) -> float:
    """Microseconds from text such as ``100us``, ``2ms`` or ``0.5s``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us)\s*", text.lower())
    if not m:
        raise ValueError(f"bad time {text!r}; use a number with s, ms or us (e.g. 100us)")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


def parse_percent(text: str) -> float:
    """A percentage such as ``0.1%`` (the sign is optional)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*%?\s*", text)
    if not m or float(m.group(1)) > 100:
        raise ValueError(f"bad percentage {text!r}; use e.g. 0.1%")
    return float(m.group(1))


ETHERNET_HEADER = 14  # tbf measures a frame with its header: MTU 9000 is 9014 bytes to the bucket
MAX_BURST = (1 << 32) - 1  # tc takes the bucket as 32 bits
MAX_BURST_S = 274.0  # and its time at the rate as 2**32 ticks of 64 ns (274.9 s), shrinking a longer one


@dataclass(frozen=True, kw_only=True)
class Shaping:
    """How each host's link is shaped, the same in both directions.

    ``rate_bit`` is the token-bucket rate (bits/s of Ethernet frames); ``burst_bytes`` its bucket
    (None: 8 ms of the rate, at least 128 KiB, two 64 KiB offload segments). The bucket must
    hold the tokens that pile up while the shaper's timer is late: on a busy 2-core VM it fires
    milliseconds late, and with a 1 ms bucket the tokens of those milliseconds were lost, so a
    4-host ring at 1 Gbit/s ran at 69-96% of the link and the plain send/recv at 64-89%; with
    8 ms both ran at 95-98% (docs/PERFORMANCE.md). An idle link can run ahead of the rate by
    one bucket, 8 ms of traffic, which a warmed-up measurement of a second does not notice;
    ``queue_ms`` how long a packet may wait before it is dropped; ``mtu`` the links' MTU (9000 for
    jumbo frames, which carry 99.3% payload against 95.6% at 1500). Delay, jitter and loss
    need the netem qdisc and apply to each direction of each link, so host to host crosses two.
    """

    rate_bit: int = 10**9
    burst_bytes: int | None = None
    queue_ms: float = 10.0
    delay_us: float = 0.0
    jitter_us: float = 0.0
    loss_percent: float = 0.0
    mtu: int = 1500

    def __post_init__(self) -> None:
        if not 576 <= self.mtu <= 65535:
            raise ValueError(f"MTU must be between 576 and 65535 bytes, got {self.mtu}")
        if self.rate_bit < 8000:
            raise ValueError(f"rate must be >= 8000 bit/s, got {self.rate_bit}")
        if self.burst_bytes is not None:
            least = max(2048, self.mtu + ETHERNET_HEADER)  # a frame that cannot fit stalls the link
            if self.burst_bytes < least:
                raise ValueError(
                    f"burst must hold a whole frame of the MTU ({least} bytes or more), "
                    f"got {self.burst_bytes}"
                )
            if self.burst_bytes > MAX_BURST:
                raise ValueError(
                    f"burst must be at most {MAX_BURST} bytes (tc's limit), got {self.burst_bytes}"
                )
            if self.burst_bytes * 8 / self.rate_bit > MAX_BURST_S:  # tc would shrink it without a word
                raise ValueError(
                    f"burst must be at most {MAX_BURST_S:.0f} s of the rate "
                    f"({int(self.rate_bit * MAX_BURST_S // 8)} bytes at {self.rate_bit} bit/s), "
                    f"got {self.burst_bytes}"
                )
        if not 0.001 <= self.queue_ms <= 10_000:
            raise ValueError(f"queue must be from 1us to 10000 ms, got {self.queue_ms} ms")
        limit = self.rate_bit / 8 * self.queue_ms / 1e3 + self.burst  # what tc makes of it, in bytes
        if limit > MAX_BURST:  # tc would shorten the queue without a word
            raise ValueError(
                f"queue {self.queue_ms:g} ms at {self.rate_bit} bit/s, with the burst, comes to {limit:.0f} "
                f"bytes of queue, more than tc's {MAX_BURST}; give a shorter --queue"
            )
        for name in ("delay_us", "jitter_us", "loss_percent"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.loss_percent > 100:
            raise ValueError(f"loss must be <= 100%, got {self.loss_percent}")
        if self.jitter_us and not self.delay_us:
            raise ValueError("jitter needs a delay (netem varies the delay by the jitter)")

    @property
    def needs_netem(self) -> bool:
        return bool(self.delay_us or self.jitter_us or self.loss_percent)

    @property
    def link_gbps(self) -> float:
        """The rate in Gbit/s (10^9 bits)."""
        return self.rate_bit / 1e9

    @property
    def burst(self) -> int:
        if self.burst_bytes is not None:
            return self.burst_bytes
        return min(max(128 << 10, self.rate_bit // 1000), MAX_BURST)

    def qdisc_args(self) -> list[list[str]]:
        """``tc qdisc add dev X`` argument lists, root first: netem (if asked for) over tbf."""
        tbf = ["tbf", "rate", f"{self.rate_bit}bit", "burst", str(self.burst)]
        tbf += ["latency", f"{round(self.queue_ms * 1000)}us"]
        if not self.needs_netem:
            return [["root", "handle", "1:", *tbf]]
        netem = ["netem"]
        if self.delay_us:
            netem += ["delay", f"{self.delay_us}us"] + ([f"{self.jitter_us}us"] if self.jitter_us else [])
        if self.loss_percent:
            netem += ["loss", f"{self.loss_percent}%"]
        return [["root", "handle", "1:", *netem], ["parent", "1:1", "handle", "10:", *tbf]]

    def as_record(self) -> dict[str, float | int]:
        return {
            "rate_bit": self.rate_bit,
            "burst_bytes": self.burst,
            "queue_ms": self.queue_ms,
            "delay_us": self.delay_us,
            "jitter_us": self.jitter_us,
            "loss_percent": self.loss_percent,
            "mtu": self.mtu,
        }


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Names and addresses of one run's hosts; ``owner`` (a pid) makes them unique per run."""

    hosts: int
    owner: int

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be in 1..{MAX_HOSTS}, got {self.hosts}")
        if self.owner < 1:
            raise ValueError(f"owner must be a pid, got {self.owner}")

    @property
    def switch(self) -> str:
        return f"{PREFIX}-{self.owner}-sw"

    def namespace(self, i: int) -> str:
        return f"{PREFIX}-{self.owner}-h{i}"

    def address(self, i: int) -> str:
        return f"198.18.0.{FIRST_HOST + i}"

    def port(self, i: int) -> str:
        """The switch port of host ``i``."""
        return f"h{i}"

    @property
    def namespaces(self) -> list[str]:
        return [self.namespace(i) for i in range(self.hosts)] + [self.switch]


def missing_privilege(*, euid: int, cap_eff: int, which: Callable[[str], str | None]) -> str | None:
    """Why this process cannot build namespaces (None when it can); inputs injected for tests."""
    for tool in ("ip", "tc"):
        if which(tool) is None:
            return f"the cluster needs iproute2 ({tool} not found on PATH)"
    needed = (1 << CAP_NET_ADMIN) | (1 << CAP_SYS_ADMIN)
    if euid != 0 and cap_eff & needed != needed:
        return "the cluster needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces"
    return None


def _cap_eff() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def check_privileges() -> None:
    """Raise ValueError (one line) unless namespaces, veths and qdiscs can be made here."""
    reason = missing_privilege(euid=os.geteuid(), cap_eff=_cap_eff(), which=shutil.which)
    if reason:
        raise ValueError(reason)


class ClusterError(RuntimeError):
    """A command that builds or removes the emulated cluster failed (one line: the command, then
    the first line of what it said)."""


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{' '.join(cmd)}: no answer after 30 s") from None
    if check and out.returncode != 0:
        said = out.stderr.strip().splitlines()[0] if out.stderr.strip() else f"exit code {out.returncode}"
        raise ClusterError(f"{' '.join(cmd)}: {said}")
    return out


def namespaces() -> list[str]:
    """Names of the named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def stale(names: Iterable[str], alive: Callable[[int], bool]) -> list[str]:
    """Namespaces of earlier runs whose owner process is gone."""
    out = []
    for name in names:
        m = _NAME.match(name)
        if m and not alive(int(m.group(1))):
            out.append(name)
    return out


def owned(names: Iterable[str], owner: int) -> list[str]:
    """Namespaces that belong to the run of process ``owner``."""
    return [n for n in names if (m := _NAME.match(n)) and int(m.group(1)) == owner]


def pids_in(namespace: str) -> list[int]:
    """Processes whose network namespace is ``namespace``."""
    out = _run(["ip", "netns", "pids", namespace], check=False)
    return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []


def destroy(names: Iterable[str]) -> list[str]:
    """Kill every process inside ``names``, then delete them (with their interfaces and qdiscs).

    The kill is repeated until none is left (or 5 s have passed): a process forked after a listing
    was not killed, and lived on after its namespace was deleted. Returns the namespaces that could
    not be deleted (normally none)."""
    names = list(names)
    deadline = time.monotonic() + 5.0
    while (pids := [pid for name in names for pid in pids_in(name)]) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    failed = []
    for name in names:
        out = _run(["ip", "netns", "delete", name], check=False)
        if out.returncode != 0 and name in namespaces():
            failed.append(name)
    return failed


class NetemMissing(ValueError):
    """delay, jitter or loss asked for, but this kernel has no netem qdisc."""


def create(topo: Topology, shaping: Shaping) -> None:
    """Build the switch, the hosts and their shaped links. Leaves partial work for ``destroy``."""
    sw = topo.switch
    _run(["ip", "netns", "add", sw])
    _run(["ip", "-n", sw, "link", "set", "lo", "up"])
    if shaping.needs_netem:  # find out before anything else is built
        probe = _run(["tc", "-n", sw, "qdisc", "add", "dev", "lo", "root", "netem"], check=False)
        if probe.returncode != 0:
            raise NetemMissing(
                "--delay, --jitter and --loss need the netem qdisc, which this kernel does not have "
                f"({probe.stderr.strip().splitlines()[0] if probe.stderr.strip() else 'tc failed'})"
            )
        _run(["tc", "-n", sw, "qdisc", "del", "dev", "lo", "root"])
    _run(["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"])
    _run(["ip", "-n", sw, "link", "set", BRIDGE, "addrgenmode", "none"])
    _run(["ip", "-n", sw, "link", "set", BRIDGE, "up"])
    prefix = NETWORK.split("/")[1]
    for i in range(topo.hosts):
        ns, port = topo.namespace(i), topo.port(i)
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", NIC, "netns", ns, "type", "veth", "peer", "name", port, "netns", sw])
        # addrgenmode is an IPv6 setting, which an MTU under 1280 takes away: it goes first
        _run(["ip", "-n", sw, "link", "set", port, "addrgenmode", "none", "master", BRIDGE])
        _run(["ip", "-n", ns, "link", "set", NIC, "addrgenmode", "none"])
        _run(["ip", "-n", ns, "link", "set", NIC, "mtu", str(shaping.mtu)])
        _run(["ip", "-n", sw, "link", "set", port, "mtu", str(shaping.mtu)])
        _run(["ip", "-n", ns, "addr", "add", f"{topo.address(i)}/{prefix}", "dev", NIC])
        for dev_ns, dev in ((ns, NIC), (sw, port)):
            for args in shaping.qdisc_args():
                _run(["tc", "-n", dev_ns, "qdisc", "add", "dev", dev, *args])
            _run(["ip", "-n", dev_ns, "link", "set", dev, "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])


def port_counters(topo: Topology) -> dict[int, tuple[int, int]]:
    """{host: (tx_bytes, rx_bytes)} of each host, read at its switch port (port rx = host tx)."""
    links = json.loads(_run(["ip", "-n", topo.switch, "-s", "-j", "link", "show"]).stdout)
    by_name = {link["ifname"]: link["stats64"] for link in links}
    out = {}
    for i in range(topo.hosts):
        s = by_name[topo.port(i)]
        out[i] = (int(s["rx"]["bytes"]), int(s["tx"]["bytes"]))
    return out
