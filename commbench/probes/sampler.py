"""A background sampler: one daemon thread reads host and GPU state on a fixed interval, and
:meth:`Sampler.mark` records phase boundaries with the cumulative counters read at that instant, so
the bytes of a phase come from counters, not from integrated rates.

Cumulative GPU counters are read on every tick and every mark and accumulated wrap-aware, so a
32-bit counter that wraps within a phase is still right as long as it wraps at most once between two
readings; the notes say where the longest real gap between readings (a late tick, not the nominal
interval) was long enough for the link to wrap it twice.
The sampler's own CPU cost is measured in its thread and reported as a fraction of one core.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Any

import psutil

from commbench.probes import host
from commbench.probes.links import DEFAULT_MARGIN, pcie_max_gbps
from commbench.probes.nvml import COUNTER_NAMES, Counter, DeviceInfo, Nvml

COUNTER_SOURCE = "counter"
ESTIMATE_SOURCE = "estimate"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuSample:
    """One GPU at one tick; None where the device does not report it. PCIe rates come from the
    byte counters (``pcie_rate_source`` "counter") or the 20 ms NVML sample ("estimate")."""

    index: int
    gpu_util_pct: float | None
    mem_util_pct: float | None
    memory_used_bytes: int | None
    sm_clock_mhz: int | None
    mem_clock_mhz: int | None
    power_w: float | None
    pcie_generation: int | None
    pcie_width: int | None
    pcie_tx_bytes_per_s: float | None
    pcie_rx_bytes_per_s: float | None
    pcie_rate_source: str | None
    nvlink_tx_bytes_per_s: float | None
    nvlink_rx_bytes_per_s: float | None


# CPU times move in clock ticks (10 ms on Linux): over a tick of 1 ms a process's CPU read 0 or
# 1000% of one core (2019% at most on a 2-core VM) and the machine's often nothing. CPU shares are
# taken over the last CPU_WINDOW_S or more, which at the default interval (0.1 s) is the tick; a
# tick before the run is that old has none (null, not measured).
CPU_WINDOW_S = 0.05


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sample:
    """One tick: seconds since start, machine CPU split (% of all cores) and this process's CPU (% of
    one core) over the last :data:`CPU_WINDOW_S` or more, resident memory, interface rates over
    the last tick, and one row per GPU."""

    t_s: float
    cpu_user_pct: float | None
    cpu_system_pct: float | None
    process_cpu_pct: float | None
    rss_bytes: int
    nic_tx_bytes_per_s: float | None
    nic_rx_bytes_per_s: float | None
    gpus: tuple[GpuSample, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuTotals:
    """Bytes one GPU's counters have counted since the sampler first read them; None if unsupported."""

    index: int
    pcie_tx_bytes: int | None
    pcie_rx_bytes: int | None
    nvlink_tx_bytes: int | None
    nvlink_rx_bytes: int | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Marker:
    """A phase boundary: its time since start and the cumulative counters read at that instant
    (the interface's: bytes counted since the sampler started)."""

    label: str
    t_s: float
    nic_tx_bytes: int | None
    nic_rx_bytes: int | None
    gpus: tuple[GpuTotals, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuPhaseBytes:
    """Bytes one GPU moved in a phase. ``pcie_source`` is "counter", or "estimate" where PCIe bytes
    are the 20 ms rate samples times the phase length."""

    index: int
    pcie_tx_bytes: float | None
    pcie_rx_bytes: float | None
    pcie_source: str | None
    nvlink_tx_bytes: int | None
    nvlink_rx_bytes: int | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PhaseBytes:
    """Counter differences between two markers."""

    label_a: str
    label_b: str
    seconds: float
    nic_tx_bytes: int | None
    nic_rx_bytes: int | None
    gpus: tuple[GpuPhaseBytes, ...]


def _stats(values: list[float | int | None]) -> dict[str, float] | None:
    got = [v for v in values if v is not None]
    if not got:
        return None
    return {"mean": sum(got) / len(got), "max": max(got)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timeline:
    """What a :class:`Sampler` saw between start and stop."""

    interval_s: float
    nic: str | None
    wall_s: float
    sampler_cpu_s: float
    overhead_core_fraction: float
    devices: tuple[DeviceInfo, ...]
    samples: tuple[Sample, ...]
    markers: tuple[Marker, ...]
    notes: tuple[str, ...]

    def marker(self, label: str) -> Marker:
        """The marker called ``label``; KeyError naming the known ones if there is none."""
        for m in self.markers:
            if m.label == label:
                return m
        raise KeyError(f"no marker {label!r}; markers: {', '.join(m.label for m in self.markers) or 'none'}")

    def phase_bytes(self, label_a: str, label_b: str) -> PhaseBytes:
        """Counter deltas from marker ``label_a`` to marker ``label_b`` (None where not measured)."""
        a, b = self.marker(label_a), self.marker(label_b)
        if b.t_s < a.t_s:
            raise ValueError(f"marker {label_b!r} comes before {label_a!r}")

        def diff(x: int | None, y: int | None) -> int | None:
            return None if x is None or y is None else y - x

        gpus = []
        for ga, gb in zip(a.gpus, b.gpus, strict=True):
            tx, rx = diff(ga.pcie_tx_bytes, gb.pcie_tx_bytes), diff(ga.pcie_rx_bytes, gb.pcie_rx_bytes)
            source = COUNTER_SOURCE if tx is not None and rx is not None else None
            if source is None:
                tx, rx = self._estimate(ga.index, a.t_s, b.t_s)
                source = ESTIMATE_SOURCE if tx is not None or rx is not None else None
            gpus.append(
                GpuPhaseBytes(
                    index=ga.index,
                    pcie_tx_bytes=tx,
                    pcie_rx_bytes=rx,
                    pcie_source=source,
                    nvlink_tx_bytes=diff(ga.nvlink_tx_bytes, gb.nvlink_tx_bytes),
                    nvlink_rx_bytes=diff(ga.nvlink_rx_bytes, gb.nvlink_rx_bytes),
                )
            )
        return PhaseBytes(
            label_a=label_a,
            label_b=label_b,
            seconds=b.t_s - a.t_s,
            nic_tx_bytes=diff(a.nic_tx_bytes, b.nic_tx_bytes),
            nic_rx_bytes=diff(a.nic_rx_bytes, b.nic_rx_bytes),
            gpus=tuple(gpus),
        )

    def _estimate(self, index: int, t_a: float, t_b: float) -> tuple[float | None, float | None]:
        """PCIe bytes from estimated rates: their mean over the ticks inside the phase times its length."""
        rows = [
            g
            for s in self.samples
            if t_a < s.t_s <= t_b
            for g in s.gpus
            if g.index == index and g.pcie_rate_source == ESTIMATE_SOURCE
        ]
        out = []
        for attr in ("pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s"):
            rates = [getattr(g, attr) for g in rows if getattr(g, attr) is not None]
            out.append(sum(rates) / len(rates) * (t_b - t_a) if rates else None)
        return out[0], out[1]

    def summary(self) -> dict[str, Any]:
        """Means and maxima of every sampled quantity; None where it was not measured."""
        s = self.samples
        out: dict[str, Any] = {
            "samples": len(s),
            "wall_s": self.wall_s,
            "overhead_core_fraction": self.overhead_core_fraction,
        }
        for name in (
            "cpu_user_pct",
            "cpu_system_pct",
            "process_cpu_pct",
            "rss_bytes",
            "nic_tx_bytes_per_s",
            "nic_rx_bytes_per_s",
        ):
            out[name] = _stats([getattr(x, name) for x in s])
        gpu_fields = [
            f.name for f in dataclasses.fields(GpuSample) if f.name not in ("index", "pcie_rate_source")
        ]
        gpus = []
        for d in self.devices:
            rows = [g for x in s for g in x.gpus if g.index == d.index]
            entry: dict[str, Any] = {"index": d.index}
            entry.update({name: _stats([getattr(g, name) for g in rows]) for name in gpu_fields})
            sources = sorted({g.pcie_rate_source for g in rows if g.pcie_rate_source})
            entry["pcie_rate_source"] = ",".join(sources) or None
            gpus.append(entry)
        out["gpus"] = gpus
        return out

    def to_json(self) -> dict[str, Any]:
        """Everything as plain JSON types, for embedding in a record."""
        devices = []
        for d in self.devices:
            row = dataclasses.asdict(d)
            row["supported"] = sorted(d.supported)
            devices.append(row)
        return {
            "interval_s": self.interval_s,
            "nic": self.nic,
            "wall_s": self.wall_s,
            "sampler_cpu_s": self.sampler_cpu_s,
            "overhead_core_fraction": self.overhead_core_fraction,
            "devices": devices,
            "notes": list(self.notes),
            "markers": [dataclasses.asdict(m) for m in self.markers],
            "samples": [dataclasses.asdict(x) for x in self.samples],
            "summary": self.summary(),
        }


def _pcie_bytes_per_s(info: DeviceInfo) -> float | None:
    """The most a GPU's PCIe link carries a second, each way; None where its link is not known."""
    if not (info.pcie_max_generation and info.pcie_max_width):
        return None
    try:
        return pcie_max_gbps(info.pcie_max_generation, info.pcie_max_width) * 1e9
    except ValueError:
        return None


class _Accumulator:
    """Running byte total of one cumulative counter, unwrapped reading by reading, and the longest
    time between two good readings (what one unwrap has to span).

    A counter that went backwards wrapped, or was reset (a driver reload, a GPU reset), which reads
    the same; where the link's maximum is known (``max_bytes_per_s``), a wrap that would mean more
    bytes than the link carries in the gap is taken as a reset: a 32-bit counter reset from 5 MB to
    near 0 was otherwise 4.29 GB in one 0.1 s tick of a 7.9 GB/s link."""

    def __init__(self, max_bytes_per_s: float | None = None) -> None:
        self.max_bytes_per_s = max_bytes_per_s
        self.last: Counter | None = None
        self.last_t: float | None = None
        self.longest_gap_s = 0.0
        self.total: int | None = None
        self.resets = 0
        self.fresh = False  # the last update was a good reading that counted on from the one before

    def update(self, reading: Counter | None, t: float) -> None:
        self.fresh = False
        if reading is None:  # a failed read: keep the last good one
            return
        gap = None if self.last_t is None else t - self.last_t
        if gap is not None:
            self.longest_gap_s = max(self.longest_gap_s, gap)
        self.last_t = t
        if self.last is not None and self.total is not None:
            delta = reading.bytes_since(self.last)
            if delta is not None and reading.value < self.last.value and not self._carried(delta, gap):
                delta = None
            if delta is None:
                self.resets += 1
            else:
                self.total += delta
                self.fresh = True
        else:
            self.total = 0
            self.fresh = True
        self.last = reading

    def _carried(self, delta: int, gap: float | None) -> bool:
        """Whether the link could have moved ``delta`` bytes in ``gap`` seconds (True where unknown)."""
        if self.max_bytes_per_s is None or gap is None or gap <= 0:
            return True
        return delta <= self.max_bytes_per_s * (1 + DEFAULT_MARGIN) * gap

    def now(self) -> int | None:
        """The total as of this reading; None where this reading failed or went backwards, so that
        the ticks around it are not measured (a rate of 0, then the missed bytes in one tick)."""
        return self.total if self.fresh else None


class _NicTotals:
    """Bytes an interface counted since the sampler started, kept going through the counters
    going backwards (a driver reload, a link reset: those ticks are lost, and ``resets`` counts
    them). Once the interface is gone its readings are None (not measured), and a line in the
    notes says so."""

    def __init__(self, nic: str) -> None:
        self.nic = nic
        self.last: host.NicCounters | None = None
        self.total = host.NicCounters(tx_bytes=0, rx_bytes=0, tx_packets=0, rx_packets=0)
        self.resets = 0
        self.gone = False

    def read(self) -> host.NicCounters | None:
        if not self.gone:
            self._advance()
        return None if self.last is None or self.gone else self.total

    def _advance(self) -> None:
        try:
            now = host.read_nic(self.nic)
        except ValueError:
            self.gone = True
            return
        if self.last is not None:
            try:
                step = host.nic_delta(self.last, now)
            except ValueError:  # went backwards: this tick is lost
                self.resets += 1
            else:
                added = {
                    f.name: getattr(self.total, f.name) + getattr(step, f.name)
                    for f in dataclasses.fields(step)
                }
                self.total = host.NicCounters(**added)
        self.last = now

    def notes(self) -> list[str]:
        out = []
        if self.resets:
            out.append(
                f"interface {self.nic} counters went backwards {self.resets} time(s); those ticks are lost"
            )
        if self.gone:
            out.append(f"interface {self.nic} went away during the run; nothing is measured after that")
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Point:
    """Everything a tick needs of the previous one to turn totals into rates."""

    t: float
    machine: host.MachineCpu
    process: host.CpuTimes
    nic: host.NicCounters | None
    nic_resets: int
    gpus: tuple[GpuTotals, ...]
    gpu_resets: tuple[int, ...]  # each GPU counter's resets so far, in the order of Sampler._accum


class Sampler:
    """Samples host and GPU state every ``interval_s`` in one daemon thread, and once more at stop
    where at least half an interval has passed since the last tick.

    Use ``start()`` / ``mark(label)`` / ``stop() -> Timeline``, or ``with Sampler(...) as s:`` and
    read ``s.timeline`` afterwards. ``nvml`` is an open :class:`Nvml` (or None: no GPU columns);
    ``nic`` an interface name (or None: no interface columns).
    """

    def __init__(self, interval_s: float = 0.1, nvml: Nvml | None = None, nic: str | None = None) -> None:
        if not (isinstance(interval_s, int | float) and math.isfinite(interval_s) and interval_s >= 0.001):
            raise ValueError(f"interval_s must be a finite number of seconds >= 0.001, got {interval_s!r}")
        if nic is not None:
            host.read_nic(nic)  # an unknown interface fails here, not in the thread
        self.interval_s = float(interval_s)
        self.nvml = nvml
        self.nic = nic
        self.timeline: Timeline | None = None
        self._devices: tuple[DeviceInfo, ...] = nvml.devices if nvml is not None else ()
        self._process = psutil.Process()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._samples: list[Sample] = []
        self._markers: list[Marker] = []
        self._accum = {
            (d.index, n): _Accumulator(_pcie_bytes_per_s(d) if n.startswith("pcie") else None)
            for d in self._devices
            for n in COUNTER_NAMES
        }
        self._nic = _NicTotals(nic) if nic is not None else None
        self._thread_cpu_s = 0.0
        self._error: BaseException | None = None
        self._cpu_points: list[_Point] = []  # the recent ticks, oldest first, CPU_WINDOW_S back

    # -- public -----------------------------------------------------------------------------------

    def start(self) -> Sampler:
        """Start the sampling thread; returns self."""
        if self._thread is not None:
            raise RuntimeError("this sampler was already started; make a new one")
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="commbench-sampler", daemon=True)
        self._thread.start()
        return self

    def mark(self, label: str) -> Marker:
        """Record a phase boundary now: the time and the cumulative counters, read in this thread."""
        if self._thread is None or self._stop.is_set():
            raise RuntimeError("mark() needs a started, not yet stopped sampler")
        with self._lock:
            if any(m.label == label for m in self._markers):
                raise ValueError(f"marker {label!r} already recorded; labels must be unique")
            t, nic, gpus = self._read_counters()
            marker = Marker(
                label=label,
                t_s=t - self._t0,
                nic_tx_bytes=None if nic is None else nic.tx_bytes,
                nic_rx_bytes=None if nic is None else nic.rx_bytes,
                gpus=gpus,
            )
            self._markers.append(marker)
        return marker

    def stop(self) -> Timeline:
        """Stop the thread (waiting at most a few intervals) and return what it saw."""
        if self._thread is None:
            raise RuntimeError("stop() before start()")
        if self.timeline is not None:
            return self.timeline
        self._stop.set()
        self._thread.join(timeout=max(5.0, 10 * self.interval_s))
        if self._thread.is_alive():
            raise RuntimeError("the sampler thread did not stop within its timeout")
        wall = time.monotonic() - self._t0
        if self._error is not None:
            raise RuntimeError(f"the sampler thread failed: {self._error!r}") from self._error
        self.timeline = Timeline(
            interval_s=self.interval_s,
            nic=self.nic,
            wall_s=wall,
            sampler_cpu_s=self._thread_cpu_s,
            overhead_core_fraction=self._thread_cpu_s / wall if wall > 0 else 0.0,
            devices=self._devices,
            samples=tuple(self._samples),
            markers=tuple(self._markers),
            notes=self._notes(),
        )
        return self.timeline

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self.stop()
        except RuntimeError:
            if exc is None:  # never hide the body's own exception behind the sampler's
                raise

    # -- the thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        cpu0 = time.thread_time()
        try:
            prev = self._point()
            deadline = self._t0 + self.interval_s
            while not self._stop.wait(max(0.0, deadline - time.monotonic())):
                point, sample = self._tick(prev)
                self._samples.append(sample)
                prev = point
                deadline += self.interval_s
                now = time.monotonic()
                if deadline < now:  # fell behind (a slow read): skip the missed ticks
                    deadline = now + self.interval_s
            # The stretch since the last tick, up to an interval long, is the end of the run (where
            # it was stopped, if it was): one more tick at stop, unless it is under half an interval,
            # where rates are mostly the granularity of the clocks they come from.
            if time.monotonic() - prev.t >= self.interval_s / 2:
                self._samples.append(self._tick(prev)[1])
        except BaseException as exc:  # reported by stop(), in the caller's thread
            self._error = exc
        finally:
            self._thread_cpu_s = time.thread_time() - cpu0

    def _read_counters(self) -> tuple[float, host.NicCounters | None, tuple[GpuTotals, ...]]:
        """Interface counters and unwrapped GPU totals now; the caller holds the lock."""
        t = time.monotonic()
        nic = self._nic.read() if self._nic is not None else None
        totals = []
        for d in self._devices:
            c = self.nvml.counters(d.index)  # type: ignore[union-attr]
            for name in COUNTER_NAMES:
                self._accum[(d.index, name)].update(getattr(c, name), c.t_s)
            got = {f"{n}_bytes": self._accum[(d.index, n)].now() for n in COUNTER_NAMES}
            totals.append(GpuTotals(index=d.index, **got))
        return t, nic, tuple(totals)

    def _point(self) -> _Point:
        machine, process = host.machine_cpu(), host.cpu_times(self._process)
        with self._lock:
            t, nic, gpus = self._read_counters()
            resets = self._nic.resets if self._nic is not None else 0
            gpu_resets = tuple(acc.resets for acc in self._accum.values())
        return _Point(
            t=t,
            machine=machine,
            process=process,
            nic=nic,
            nic_resets=resets,
            gpus=gpus,
            gpu_resets=gpu_resets,
        )

    def _cpu_window(self, prev: _Point, point: _Point) -> _Point:
        """The latest tick at least :data:`CPU_WINDOW_S` before ``point`` (``prev`` where the
        interval is that long; the first tick while the run is younger), whence CPU shares are taken."""
        points = self._cpu_points
        if not points or points[-1] is not prev:
            points[:] = [prev]
        while len(points) > 1 and point.t - points[1].t >= CPU_WINDOW_S:
            points.pop(0)
        base = points[0]
        points.append(point)
        return base

    def _tick(self, prev: _Point) -> tuple[_Point, Sample]:
        # Gauges only: the counters are read once, under the lock, by _point.
        readings = {d.index: self.nvml.read(d.index, counters=False) for d in self._devices}  # type: ignore[union-attr]
        point = self._point()
        dt = point.t - prev.t
        cpu_from = self._cpu_window(prev, point)
        cpu_s = point.t - cpu_from.t
        cpu_measured = cpu_s >= CPU_WINDOW_S * 0.99  # not in the run's first ticks: a tick or two
        user, system = (
            host.machine_cpu_percent(cpu_from.machine, point.machine) if cpu_measured else (None, None)
        )

        def rate(a: int | None, b: int | None) -> float | None:
            return None if a is None or b is None or dt <= 0 else (b - a) / dt

        # A counter that went backwards in between (seen by a mark, or by this tick) lost bytes:
        # its rate is not measured, as the interface's is not, rather than short of them.
        went_back = {
            key for key, a, b in zip(self._accum, prev.gpu_resets, point.gpu_resets, strict=True) if a != b
        }
        gpus = []
        for d, before, now in zip(self._devices, prev.gpus, point.gpus, strict=True):
            lost = {f"{name}_bytes": None for index, name in went_back if index == d.index}
            before = dataclasses.replace(before, **lost)
            r = readings[d.index]
            tx, rx = (
                rate(before.pcie_tx_bytes, now.pcie_tx_bytes),
                rate(before.pcie_rx_bytes, now.pcie_rx_bytes),
            )
            source = COUNTER_SOURCE if tx is not None and rx is not None else None
            if source is None and "pcie_estimate" in d.supported:
                est = self.nvml.pcie_estimate(d.index)  # type: ignore[union-attr]
                tx, rx, source = est.tx_bytes_per_s, est.rx_bytes_per_s, ESTIMATE_SOURCE
            gpus.append(
                GpuSample(
                    index=d.index,
                    gpu_util_pct=r.gpu_util_pct,
                    mem_util_pct=r.mem_util_pct,
                    memory_used_bytes=r.memory_used_bytes,
                    sm_clock_mhz=r.sm_clock_mhz,
                    mem_clock_mhz=r.mem_clock_mhz,
                    power_w=r.power_w,
                    pcie_generation=r.pcie_generation,
                    pcie_width=r.pcie_width,
                    pcie_tx_bytes_per_s=tx,
                    pcie_rx_bytes_per_s=rx,
                    pcie_rate_source=source,
                    nvlink_tx_bytes_per_s=rate(before.nvlink_tx_bytes, now.nvlink_tx_bytes),
                    nvlink_rx_bytes_per_s=rate(before.nvlink_rx_bytes, now.nvlink_rx_bytes),
                )
            )
        nic_now, nic_prev = point.nic, prev.nic
        if point.nic_resets != prev.nic_resets:  # the counters went backwards in between: not measured
            nic_now = None
        sample = Sample(
            t_s=point.t - self._t0,
            cpu_user_pct=user,
            cpu_system_pct=system,
            process_cpu_pct=host.process_cpu_percent(cpu_from.process, point.process, cpu_s)
            if cpu_measured
            else None,
            rss_bytes=host.rss_bytes(self._process),
            nic_tx_bytes_per_s=None
            if nic_now is None or nic_prev is None
            else rate(nic_prev.tx_bytes, nic_now.tx_bytes),
            nic_rx_bytes_per_s=None
            if nic_now is None or nic_prev is None
            else rate(nic_prev.rx_bytes, nic_now.rx_bytes),
            gpus=tuple(gpus),
        )
        return point, sample

    def _notes(self) -> tuple[str, ...]:
        """Caveats worth carrying with the numbers: counter resets, and 32-bit counters read so far
        apart (a late tick, not the nominal interval) that they could have wrapped twice unseen."""
        notes = self._nic.notes() if self._nic is not None else []
        for (index, name), acc in self._accum.items():
            if acc.resets:
                notes.append(
                    f"GPU {index} {name} counter went backwards {acc.resets} time(s); those ticks are lost"
                )
            wrap = acc.last.wrap if acc.last is not None else None
            if acc.max_bytes_per_s is not None and wrap == 1 << 32:
                most = acc.max_bytes_per_s * acc.longest_gap_s
                if most >= wrap:
                    notes.append(
                        f"GPU {index} {name} is a 32-bit counter and {acc.longest_gap_s:.3g} s passed "
                        f"between two of its readings (interval {self.interval_s} s), in which the link "
                        f"can move {most:.3g} bytes: a second wrap in such a gap would go unseen, and "
                        "the bytes of phases around it may be short by multiples of 2^32"
                    )
        return tuple(notes)
