"""Measured wire bytes per host, beside the cost model's: counted around a sweep point or training steps.

Each rank reads its own host's interface counters (the interface toward the master, or toward the
other hosts on the master's own; or ``$COMMBENCH_NIC``) around a pass of work, then around two idle
intervals of the same length; the quieter one is the baseline (heartbeats, the launcher's store).
Ranks that share a host (same hostname and network namespace) share the interface, so the host's
counter is compared with the sum over its ranks: on one machine over loopback that is every rank's
traffic, counted once; in the emulated cluster each host is one rank with its own interface. Where
ranks run on several hosts, a host with more than one rank, or one counting loopback, leaves the
counts recorded but not judged: what ranks of one host send each other never crosses the interface.

The probe only watches: a host whose counters went backwards (a reset, a link flap) or counted more
than its link can carry does not end the run. Each rank's reading travels in the all-gather, and the
point's ``wire_check`` is judged from the gathered readings, so every rank records the same verdict.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psutil
import torch
import torch.distributed as dist

from commbench.comm import p2p
from commbench.probes import host, links, wirecheck

T = TypeVar("T")


def opened(read: Callable[[], T]) -> T:
    """Open a counting window on every rank: ``read()`` once all ranks have finished what came
    before (a barrier), and nothing after it starts before every rank has read (a second one).

    With one barrier before the reading, a peer's first message could pass before a slow rank's
    reading; with one after it, the tail of earlier traffic could land in the window. The window
    holds the second barrier's few bytes, as the idle baseline's holds those of its own.
    """
    dist.barrier()
    first = read()
    dist.barrier()
    return first


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostBytes:
    """One host's bytes per iteration (measured less baseline) beside the computed ones."""

    rank: int
    ranks: list[int]
    address: str
    nic: str
    tx_bytes: int
    rx_bytes: int
    computed_tx_bytes: int
    computed_rx_bytes: int
    cpu_user: float
    cpu_system: float
    # How long the counted work took, in all (None in rows without it): CPU time moves in clock
    # ticks, so a share per call over less than wirecheck.CPU_COUNTED_MIN_S is ticks over calls.
    counted_s: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class WireCount:
    """All hosts of one counting pass, and the check of their total."""

    hosts: list[HostBytes]
    computed_wire_bytes: int
    measured_wire_bytes: int | None  # None: not measured (a host's counters went backwards)
    wire_bytes_ratio: float | None
    wire_expected_ratio: float
    wire_check: str | None  # None: within tolerance; else why not (or why not checked)

    def fields(self) -> dict[str, Any]:
        """The keys a sweep or epoch record carries for this count."""
        return {
            "computed_wire_bytes": self.computed_wire_bytes,
            "measured_wire_bytes": self.measured_wire_bytes,
            "wire_bytes_ratio": self.wire_bytes_ratio,
            "wire_expected_ratio": self.wire_expected_ratio,
            "wire_check": self.wire_check,
            "hosts": [dataclasses.asdict(h) for h in self.hosts],
        }


def _node_id() -> str:
    """Hostname plus network namespace: ranks with the same id see the same interfaces."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()}:{netns}"


def _address(nic: str) -> str:
    explicit = os.environ.get("COMMBENCH_HOST_ADDRESS")
    if explicit:
        return explicit
    for a in psutil.net_if_addrs().get(nic, []):
        if a.family == socket.AF_INET:
            return a.address
    return "?"


# Shorter passes are not judged: a shaped link lets its token bucket through at once, and the check
# allows for it beside the rate (``$COMMBENCH_LINK_BURST``), but not for timing noise in a short pass.
CHECKED_PASS_S = 0.5

# What each rank puts in the all-gather, in this order. Tests pass rows of the first 6 (no packets)
# or 8 (no pass length, link maximum or reset flag) columns too.
ROW = (
    "tx_bytes",
    "rx_bytes",
    "idle_tx_bytes",
    "idle_rx_bytes",
    "cpu_user_s",
    "cpu_system_s",
    "tx_packets",
    "idle_tx_packets",
    "seconds",  # how long the counted work took
    "link_gbps",  # the interface's maximum each way; NaN where none is known
    "reset",  # 1 where the counters went backwards during the count or its idle baseline
)
_NO_COUNT = host.NicCounters(tx_bytes=0, rx_bytes=0, tx_packets=0, rx_packets=0)


def _delta(before: host.NicCounters, after: host.NicCounters) -> host.NicCounters | None:
    """What the interface counted between two readings; None where a counter went backwards."""
    try:
        return host.nic_delta(before, after)
    except ValueError:
        return None


def link_problem(
    what: str, tx_bytes: float, rx_bytes: float, seconds: float, link_gbps: float | None
) -> str | None:
    """Why a host's counted bytes cannot be right (more than its link carries in ``seconds``), or
    None. Passes shorter than :data:`CHECKED_PASS_S` are not judged."""
    if link_gbps is None or not seconds > 0 or seconds < CHECKED_PASS_S:
        return None
    burst = shaped_burst_bytes()
    for direction, value in (("sent", tx_bytes), ("received", rx_bytes)):
        try:
            links.check_rate(value, seconds, link_gbps, what=f"{what} {direction}", burst_bytes=burst)
        except links.ImpossibleReading as exc:
            return f"impossible reading: {exc}"
    return None


LINK_ENV = "COMMBENCH_LINK_GBPS"


def shaped_link_gbps() -> float | None:
    """``$COMMBENCH_LINK_GBPS`` (Gbit/s each way, set by the emulated cluster for its shaped links),
    None where unset; ValueError (one line) for what is not a positive finite number."""
    shaped = os.environ.get(LINK_ENV, "").strip()
    if not shaped:
        return None
    try:
        gbit = float(shaped)
    except ValueError:
        gbit = math.nan
    if not (math.isfinite(gbit) and gbit > 0):
        raise ValueError(
            f"${LINK_ENV}={shaped!r} is not a link rate: give Gbit/s, a number > 0 (e.g. 1 or 2.5)"
        )
    return gbit


BURST_ENV = "COMMBENCH_LINK_BURST"


def shaped_burst_bytes() -> int:
    """``$COMMBENCH_LINK_BURST``: the bytes a shaped link's token bucket lets through at once (set
    by the emulated cluster beside :data:`LINK_ENV`), 0 where unset; ValueError (one line) for
    what is not a whole number >= 0. Below about 130 Mbit/s the cluster's least bucket (128 KiB)
    is more than 5% of what a half-second pass carries, and such passes were said impossible."""
    given = os.environ.get(BURST_ENV, "").strip()
    if not given:
        return 0
    if not given.isdigit():
        raise ValueError(f"${BURST_ENV}={given!r} is not a number of bytes: give a whole number >= 0")
    return int(given)


def link_gbps(nic: str, loopback: bool) -> float | None:
    """The interface's maximum in GB/s (10^9 bytes) each way: ``$COMMBENCH_LINK_GBPS`` (Gbit/s, set
    by the emulated cluster for its shaped links), else the speed the driver reports; None for
    loopback and where no speed is known."""
    shaped = shaped_link_gbps()
    if shaped is not None:
        return shaped / 8
    if loopback:
        return None
    stats = psutil.net_if_stats().get(nic)
    return stats.speed / 8e3 if stats is not None and stats.speed > 0 else None


def _is_loopback(nic: str, address: str) -> bool:
    return nic == "lo" or address.startswith("127.")


def agreed_nic() -> str:
    """The interface this rank counts, chosen knowing where the others are; every rank calls this
    (one all-gather).

    It is :func:`host.selected_nic`'s, except on a host that chose loopback while ranks turn out to
    run on other hosts too: under torchrun, the master's host, whose ``$MASTER_ADDR`` is its own
    address, which Linux delivers through loopback. Its traffic with the others leaves on the
    interface toward them, and that one is counted. ``$COMMBENCH_NIC`` is kept as given.

    A ``$COMMBENCH_NIC`` that names no interface of one host is every rank's ValueError, said after
    the all-gather: raised before it, on that host alone, it left the others waiting in it.
    """
    try:
        nic, problem = host.selected_nic(), None
    except ValueError as exc:
        nic, problem = "?", str(exc)
    if dist.get_world_size() == 1:
        if problem is not None:
            raise ValueError(problem)
        return nic
    node, address = _node_id(), _address(nic)
    looped = problem is None and _is_loopback(nic, address)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (node, address, looped, problem))
    failed = [(other, said) for other, _, _, said in everyone if said is not None]
    if failed:
        other, said = failed[0]
        several = len({n for n, *_ in everyone}) > 1
        raise ValueError(f"on host {other.split(':')[0]}: {said}" if several else said)
    if os.environ.get(host.NIC_ENV, "").strip() or not looped:
        return nic
    peers = [a for other, a, peer_looped, _ in everyone if other != node and not peer_looped and a != "?"]
    return host.nic_for_address(peers[0]) if peers else nic


class WireCounter:
    """Counts interface bytes around passes of a collective; one per sweep or training run."""

    def __init__(self, device: torch.device, nic: str | None = None) -> None:
        """``nic``: the interface :func:`agreed_nic` gave (found here where None)."""
        self.device = device if not p2p.moves_host_tensors(None) else torch.device("cpu")
        self.nic = agreed_nic() if nic is None else nic
        self.mtu = psutil.net_if_stats()[self.nic].mtu
        self.loopback = _is_loopback(self.nic, _address(self.nic))
        self.link_gbps = link_gbps(self.nic, self.loopback)
        me = (_node_id(), self.nic, _address(self.nic), self.mtu, self.loopback)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, me)
        # Every rank judges with the same framing: rank 0's interface's, not each its own.
        self.mtu, loopback = everyone[0][3:]
        self.interconnect = "loopback" if loopback else "ethernet"
        self.hosts: list[list[int]] = []
        self.info: list[tuple[str, str]] = []
        seen: dict[tuple[str, str], int] = {}
        for r, (node, nic, address, *_) in enumerate(everyone):
            if (node, nic) not in seen:
                seen[(node, nic)] = len(self.hosts)
                self.hosts.append([])
                self.info.append((nic, address))
            self.hosts[seen[(node, nic)]].append(r)

    def read(self) -> tuple[host.NicCounters, host.CpuTimes]:
        return host.read_nic(self.nic), host.cpu_times()

    def _idle(self, seconds: float) -> host.NicCounters | None:
        """What the interface counted over ``seconds`` of nothing; None where its counters went back."""
        before = opened(lambda: host.read_nic(self.nic))
        time.sleep(seconds)
        dist.barrier()
        return _delta(before, host.read_nic(self.nic))

    def _gather(self, local: list[float]) -> list[list[float]]:
        """Every rank's row (see :data:`ROW`), in rank order."""
        mine = torch.tensor(local, dtype=torch.float64, device=self.device)
        table = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(table, mine)
        return [t.cpu().tolist() for t in table]

    def count(
        self,
        run: Callable[[], None],
        iters: int,
        sent: Sequence[int],
        recv: Sequence[int],
        size_bytes: int,
        message_bytes: int | None = None,
    ) -> WireCount:
        """Run ``run`` ``iters`` times between two readings, then idle as long; every rank calls this.

        Args:
            sent, recv: the cost model's bytes per rank for one call.
            size_bytes: the message size; below 1 MiB the check is reported, not judged.
            message_bytes: the bytes of each message on the wire where a call cuts its data into
                segments; below :data:`~commbench.probes.wirecheck.MIN_CHECKED_MESSAGE_BYTES`
                the check is reported, not judged.
        """
        nic0, cpu0 = opened(self.read)
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        nic1, cpu1 = self.read()
        elapsed = time.perf_counter() - t0
        work = _delta(nic0, nic1)
        # Two idle intervals as long as the pass; the quieter one is the baseline, so a burst of
        # someone else's traffic during one of them is not taken away from the measurement. Every
        # rank idles twice (barriers inside); an interval whose counters went back is left out.
        idles = [d for d in [self._idle(elapsed) for _ in range(2)] if d is not None]
        idle = min(idles, key=lambda d: d.tx_bytes) if idles else None
        reset = work is None or idle is None
        work, idle = work or _NO_COUNT, idle or _NO_COUNT
        rows = self._gather(
            [
                work.tx_bytes,
                work.rx_bytes,
                idle.tx_bytes,
                idle.rx_bytes,
                cpu1.user_s - cpu0.user_s,
                cpu1.system_s - cpu0.system_s,
                work.tx_packets,
                idle.tx_packets,
                elapsed,
                math.nan if self.link_gbps is None else self.link_gbps,
                float(reset),
            ]
        )
        return self.summarise(rows, iters, sent, recv, size_bytes, message_bytes)

    def summarise(
        self,
        rows: list[list[float]],
        iters: int,
        sent: Sequence[int],
        recv: Sequence[int],
        size_bytes: int,
        message_bytes: int | None = None,
    ) -> WireCount:
        """Group the ranks' readings (see :data:`ROW`) by host and judge them; every rank gets the
        same rows and so the same verdict. A host whose counters went backwards leaves the point
        not measured; one that counted more than its link can carry flags it."""
        hosts, raw_total, base_total = [], 0, 0
        packets: int | None = None
        problems: list[str] = []
        reset: list[str] = []
        for ranks, (nic, address) in zip(self.hosts, self.info, strict=True):
            first = rows[ranks[0]]  # ranks of one host read the same counter: take the first's
            counted_s = first[8] if len(first) >= 9 else None
            if len(first) >= len(ROW):
                seconds, link, went_back = first[8:11]
                if went_back:
                    reset.append(f"{nic} ({address})")
                    continue
                problem = link_problem(
                    f"{nic} ({address})", first[0], first[1], seconds, None if math.isnan(link) else link
                )
                if problem is not None:
                    problems.append(problem)
            tx_raw, rx_raw, tx_base, rx_base = (int(v) for v in first[:4])
            raw_total += tx_raw
            base_total += tx_base
            if len(first) >= 8:  # packets counted: framing per packet, not assumed from the MTU
                packets = (packets or 0) + max(0, int(first[6]) - int(first[7]))
            hosts.append(
                HostBytes(
                    rank=ranks[0],
                    ranks=list(ranks),
                    address=address,
                    nic=nic,
                    tx_bytes=max(0, tx_raw - tx_base) // iters,
                    rx_bytes=max(0, rx_raw - rx_base) // iters,
                    computed_tx_bytes=sum(sent[r] for r in ranks),
                    computed_rx_bytes=sum(recv[r] for r in ranks),
                    cpu_user=sum(rows[r][4] for r in ranks) / iters,
                    cpu_system=sum(rows[r][5] for r in ranks) / iters,
                    counted_s=counted_s,
                )
            )
        computed = sum(sent)
        if reset:
            return WireCount(
                hosts=[],
                computed_wire_bytes=computed,
                measured_wire_bytes=None,
                wire_bytes_ratio=None,
                wire_expected_ratio=wirecheck.expected_ratio(self.interconnect, self.mtu),
                wire_check="; ".join(
                    [
                        "not judged: the interface counters went backwards (a reset or a link flap) "
                        f"during the count, on {', '.join(reset)}",
                        *problems,  # another host's broken reading is still said
                    ]
                ),
            )
        check = wirecheck.compare(
            computed * iters, raw_total, base_total, self.interconnect, self.mtu, packets=packets
        )
        flag = check.flag
        if size_bytes < wirecheck.MIN_CHECKED_BYTES:
            flag = "not judged: messages under 1 MiB, where per-message overhead dominates"
        elif message_bytes is not None and message_bytes < wirecheck.MIN_CHECKED_MESSAGE_BYTES:
            flag = (
                f"not judged: segments of {message_bytes} bytes, each with the transport's own bytes "
                f"(about {wirecheck.GLOO_MESSAGE_BYTES} on gloo), which the cost model leaves out"
            )
        elif computed == 0:
            flag = None if check.measured_bytes <= 0 else check.flag
        flag = self._across_hosts() or flag
        if problems:  # a broken reading, whatever the size
            flag = "; ".join(problems)
        return WireCount(
            hosts=hosts,
            computed_wire_bytes=computed,
            measured_wire_bytes=check.measured_bytes // iters,
            wire_bytes_ratio=check.ratio,
            wire_expected_ratio=check.expected_ratio,
            wire_check=flag,
        )

    def _across_hosts(self) -> str | None:
        """Why counts from several hosts cannot be set against the cost model's bytes (None where
        they can): its bytes are everything a rank sends, and an interface between hosts carries
        neither what ranks of one host send each other nor anything at all if it is loopback."""
        if len(self.hosts) < 2:
            return None
        looped = [f"{nic} ({address})" for nic, address in self.info if _is_loopback(nic, address)]
        if looped:
            return (
                f"not judged: ranks run on {len(self.hosts)} hosts, and {', '.join(looped)} is loopback, "
                f"which carries none of the traffic between them (name the interface in ${host.NIC_ENV})"
            )
        if any(len(ranks) > 1 for ranks in self.hosts):
            return (
                f"not judged: ranks run on {len(self.hosts)} hosts, several to a host, and what ranks of "
                "one host send each other does not cross its interface"
            )
        return None


class StepWindows:
    """Interface bytes of training steps, per strategy. Every rank reads its counters around each
    step, the window opened and closed by barriers (:func:`opened`; outside the step's timed
    region), so that no bytes of a step land in another strategy's count. The baseline is an idle
    rate taken at the start, scaled by the time spent inside the windows: the quietest of a few
    idle intervals, as in :meth:`WireCounter.count`, so that a burst of someone else's traffic in
    one of them is not taken away from every step after (one interval of 0.5 s, caught by such a
    burst, once put a strategy's epoch at 0.97 of the cost model's bytes)."""

    def __init__(self, counter: WireCounter, idle_s: float = 0.25, intervals: int = 3) -> None:
        self.counter = counter
        rates = []
        for _ in range(intervals):
            t0 = time.perf_counter()
            idle = counter._idle(idle_s)
            elapsed = time.perf_counter() - t0
            if idle is not None:  # counters that went backwards: that interval is left out
                rates.append((idle.tx_bytes / elapsed, idle.rx_bytes / elapsed, idle.tx_packets / elapsed))
        # None: no interval was counted, so no step is judged (each says so).
        self.idle_rate: tuple[float, float, float] | None = min(rates) if rates else None
        self.acc: dict[str, list[float]] = {}

    def around(self, key: str, run: Callable[[], None]) -> None:
        """Run ``run`` and add what the interface counted meanwhile to ``key``'s total (a step
        whose counters went backwards adds none, and marks the total not measured)."""
        nic0, cpu0 = opened(self.counter.read)
        t0 = time.perf_counter()
        run()
        dist.barrier()
        elapsed = time.perf_counter() - t0
        nic1, cpu1 = self.counter.read()
        d = _delta(nic0, nic1)
        got = d or _NO_COUNT
        row = self.acc.setdefault(key, [0.0] * 7)
        for i, v in enumerate(
            (
                got.tx_bytes,
                got.rx_bytes,
                elapsed,
                cpu1.user_s - cpu0.user_s,
                cpu1.system_s - cpu0.system_s,
                got.tx_packets,
                d is None,
            )
        ):
            row[i] += v

    def take(
        self, key: str, steps: int, sent: Sequence[int], recv: Sequence[int], size_bytes: int
    ) -> WireCount:
        """``key``'s bytes per step since the last ``take``, grouped by host; every rank calls this."""
        tx, rx, seconds, user, system, packets, resets = self.acc.pop(key, [0.0] * 7)
        idle = self.idle_rate or (0.0, 0.0, 0.0)
        link = self.counter.link_gbps
        rows = self.counter._gather(
            [
                tx,
                rx,
                idle[0] * seconds,
                idle[1] * seconds,
                user,
                system,
                packets,
                idle[2] * seconds,
                seconds,
                math.nan if link is None else link,
                float(resets > 0 or self.idle_rate is None),
            ]
        )
        return self.counter.summarise(rows, max(steps, 1), sent, recv, size_bytes)
