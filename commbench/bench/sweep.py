"""The sweep driver: one loop for every collective and algorithm (see ``collectives.SPECS``).

At each size the algorithms are interleaved iteration by iteration, so they all see the same
machine conditions, in an order that rotates from one iteration to the next and carries on
from size to size (:func:`rotated`), so no series is always first after the barrier;
with ``block`` above 1 each series runs that many iterations back to back before the next one
takes over (:func:`schedule`), up to one series at a time, as nccl-tests times a collective;
the transport's limit (a segmented bidirectional send/recv between ring neighbours) is measured
in the same loop. Every iteration starts from the same input, after a barrier, outside the timed
region; an iteration's time is the slowest rank's.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from commbench import comm
from commbench.bench.collectives import (
    CHECK_CHUNK,
    ONE_BUFFER,
    SPECS,
    TWO_FORMS,
    algorithms_for,
    ready_for_check,
    segmented_for,
    series_parts,
)
from commbench.bench.machine import rank_device
from commbench.bench.records import RecordWriter, SweepRecord, check_distinct, say
from commbench.comm.chunking import num_segments
from commbench.comm.costmodel import cost, scratch_bytes
from commbench.comm.ops import OPS, check_op, parse_dtype
from commbench.comm.ring import SEGMENT_BYTES
from commbench.probes.wirecheck import says_off
from commbench.units import amount

LIMIT = "limit"  # name of the sendrecv series measured beside the algorithms
MAX_SIZES = 1000
MAX_ITERS = 1_000_000  # per size and series; each timed one keeps its time until the size ends
MAX_BYTES = 1 << 50  # 1 PiB: no machine holds a message of more, and counts stay far inside int64


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """Everything a sweep needs; validated on construction (ValueError names the bad value)."""

    collective: str = "all_reduce"
    algorithms: tuple[str, ...] = ("builtin", "naive", "ring")
    min_bytes: int = 1 << 10
    max_bytes: int = 64 << 20
    step_factor: float = 2.0
    step_bytes: int | None = None
    iters: int = 20
    warmup: int = 5
    block: int = 1
    check: bool = True
    dtype: str = "float32"
    op: str = "sum"
    root: int = 0
    in_place: bool = False  # reduce_scatter and all_gather in their in-place form
    limit: bool = True
    probe: bool = True
    probe_iters: int = 3
    probe_interval_s: float = 0.1
    json_path: str | None = None
    csv_path: str | None = None
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.collective not in SPECS:
            raise ValueError(f"unknown collective {self.collective!r}; choose from {', '.join(SPECS)}")
        if not self.algorithms:
            raise ValueError("no algorithms given")
        accepted, segmented = algorithms_for(self.collective), segmented_for(self.collective)
        seen: dict[tuple[str, int | None], str] = {}
        for a in self.algorithms:
            algorithm, segment = series_parts(a)
            if algorithm not in accepted:
                choices = ", ".join(accepted)
                raise ValueError(
                    f"unknown algorithm {algorithm!r} for {self.collective}; choose from {choices}"
                )
            if segment is not None and algorithm not in segmented:
                raise ValueError(
                    f"{a!r}: a segment size (@SIZE) applies to {', '.join(segmented)}, not {algorithm}"
                )
            # one series however written: ring@2M and ring@2048K, ring and ring@16M (its default)
            same = (algorithm, SEGMENT_BYTES if segment is None and algorithm in comm.SEGMENTED else segment)
            if same in seen:
                listed = ",".join(self.algorithms)
                if seen[same] == a:
                    raise ValueError(f"algorithm listed twice in {listed}")
                raise ValueError(f"{seen[same]} and {a} are one series (the same segment) in {listed}")
            seen[same] = a
        if self.min_bytes <= 0 or self.max_bytes <= 0:
            raise ValueError(f"sizes must be > 0 bytes, got {self.min_bytes} and {self.max_bytes}")
        if self.min_bytes > self.max_bytes:
            raise ValueError(f"minimum size {self.min_bytes} is above maximum size {self.max_bytes}")
        if self.max_bytes > MAX_BYTES:
            raise ValueError(f"maximum size must be <= {MAX_BYTES} bytes (1 PiB), got {self.max_bytes}")
        if self.step_bytes is not None and self.step_bytes <= 0:
            raise ValueError(f"step bytes must be > 0, got {self.step_bytes}")
        if self.step_bytes is None and not (self.step_factor > 1 and math.isfinite(self.step_factor)):
            raise ValueError(f"step factor must be a finite number > 1, got {self.step_factor}")
        check_distinct(json=self.json_path, csv=self.csv_path)
        for name, value, least in (
            ("iters", self.iters, 1),
            ("warmup", self.warmup, 0),
            ("block", self.block, 1),
            ("probe iterations", self.probe_iters, 1),
        ):
            if value < least:
                raise ValueError(f"{name} must be >= {least}, got {value}")
            if value > MAX_ITERS:
                raise ValueError(f"{name} must be <= {MAX_ITERS}, got {value}")
        if not (0.001 <= self.probe_interval_s <= 60):
            raise ValueError(f"probe interval must be between 0.001 and 60 s, got {self.probe_interval_s}")
        dtype = parse_dtype(self.dtype)
        if SPECS[self.collective].needs_op:
            check_op(self.op, dtype)
        elif self.op not in OPS:  # not used, but a mistyped op ran the whole sweep without a word
            raise ValueError(f"unknown op {self.op!r}; choose from {', '.join(OPS)}")
        if self.root < 0 and SPECS[self.collective].has_root:  # the others take any, as nccl-tests does
            raise ValueError(f"root must be >= 0, got {self.root}")
        if self.in_place and self.collective not in TWO_FORMS:
            form = (
                "always runs in place (one buffer, as in torch.distributed)"
                if self.collective in ONE_BUFFER
                else "has no in-place form"
            )
            raise ValueError(f"--in-place applies to {' and '.join(TWO_FORMS)}; {self.collective} {form}")
        if len(sizes(self)) > MAX_SIZES:
            raise ValueError(f"more than {MAX_SIZES} sizes between minimum and maximum; use a larger step")

    @property
    def series(self) -> tuple[str, ...]:
        """The algorithms plus the transport-limit series when it is measured."""
        extra = (LIMIT,) if self.limit and self.collective != "sendrecv" else ()
        return self.algorithms + extra


def _ratio(value: float, reference: float | None) -> float | None:
    """value / reference; None without a reference or where it is 0 (busbw at one rank, whose bus
    factor is 0 for all_reduce, reduce_scatter and all_gather)."""
    return value / reference if reference else None


def sizes(config: SweepConfig) -> list[int]:
    """Message sizes from min to max by step factor or step bytes (nccl-tests' -f / -i)."""
    out = []
    size = config.min_bytes
    while size <= config.max_bytes and len(out) <= MAX_SIZES:
        out.append(size)
        if config.step_bytes is not None:
            size += config.step_bytes
        else:
            grown = size * config.step_factor  # a float: a huge factor gives inf, never an int of it
            if grown >= config.max_bytes + 1:
                break
            nxt = int(grown)
            size = nxt if nxt > size else size + 1
    return out


# The check's temporaries at their peak, a float32 element: expected (4), and in float64 got, expected,
# |difference| and the bound as it is built (8 each, 44 in all), rounded up.
CHECK_BYTES_PER_ELEMENT = 48


def buffer_bytes(config: SweepConfig, world: int) -> int:
    """Bytes one rank holds at the sweep's largest size: every series' input, output and pristine
    copy, as :func:`run_rank` makes them (here on the meta device, so nothing is allocated), and
    with ``check`` the check's float64 temporaries for one chunk (it compares :data:`CHECK_CHUNK`
    elements at a time). Algorithms' scratch comes on top."""
    spec, dtype = SPECS[config.collective], parse_dtype(config.dtype)
    meta = torch.device("meta")
    count = max(spec.count(size, dtype.itemsize, world) for size in sizes(config))
    total = 0
    for s in config.series:
        b = (SPECS["sendrecv"] if s == LIMIT else spec).make_for(
            count, dtype, meta, 0, world, config.op, config.root, config.in_place
        )
        # a view of another (the in-place forms' output or input) holds no memory of its own
        made = (b.input, b.output, b.reference)
        distinct = {id(t): t for t in made if not any(t._base is other for other in made)}
        total += sum(t.numel() * t.element_size() for t in distinct.values())
    return total + (CHECK_BYTES_PER_ELEMENT * min(count, CHECK_CHUNK) if config.check else 0)


def scratch_per_rank(config: SweepConfig, world: int, backend: str = "gloo") -> list[int]:
    """Bytes of algorithms' scratch each rank holds at its most over the sweep's sizes over
    ``backend`` (the cost model's :func:`~commbench.comm.costmodel.scratch_bytes`, summed over the
    series; series that run the same algorithm share it). The workspace is made afresh for each
    size. Not only the largest size: below its crossover ``auto`` picks naive or the tree, which
    keep whole messages at the root (at 4 ranks, a 2 MiB all_reduce holds 6 MiB there, the 4 MiB
    ring 3 MiB)."""
    if config.collective == "sendrecv":
        return [0] * world
    most = [0] * world
    for size in sizes(config):
        most = [max(a, b) for a, b in zip(most, _scratch_at(config, size, world, backend), strict=True)]
    return most


def _scratch_at(config: SweepConfig, size: int, world: int, backend: str) -> list[int]:
    """:func:`scratch_per_rank` at one size."""
    spec, dtype = SPECS[config.collective], parse_dtype(config.dtype)
    count = spec.count(size, dtype.itemsize, world)
    # Per algorithm, the most any of its series holds: series of one algorithm with different
    # segments name the same buffers, which grow to the largest.
    held: dict[str, list[int]] = {}
    for s in config.series:
        if s == LIMIT:
            continue
        resolved, segment = _resolve(config, s, count * dtype.itemsize, world)
        mine = scratch_bytes(
            config.collective,
            resolved,
            world,
            count,
            dtype.itemsize,
            root=_root(config),
            segment_bytes=segment,
            backend=backend,
            in_place=config.in_place,
        )
        held[resolved] = [max(a, b) for a, b in zip(held.get(resolved, mine), mine, strict=True)]
    return [sum(col) for col in zip(*held.values(), strict=True)] if held else [0] * world


def gpu_memory_refusal(found: list) -> str | None:
    """Why a CUDA sweep cannot hold its sizes, from every rank's ((host, GPU UUID), (GPU index,
    bytes it needs at its worst size, that size, bytes it saw free)); None where each GPU holds
    its ranks' needs. The ranks on one GPU need the sum of their bytes and have the least any of
    them saw."""
    gpus: dict[tuple[str, str], list[tuple[int, int, int, int]]] = {}
    for key, row in found:
        gpus.setdefault(key, []).append(row)
    for (host, _), rows in gpus.items():
        need, have = sum(r[1] for r in rows), min(r[3] for r in rows)
        if need > have:
            return (
                f"at {max(r[2] for r in rows)} bytes the sweep's buffers and scratch take at least "
                f"{amount(need)} on GPU {rows[0][0]} of {host} ({len(rows)} rank(s) on it), more than "
                f"its {amount(have)} free; lower --maxbytes or run fewer algorithms"
            )
    return None


def gpu_bytes(config: SweepConfig, world: int, rank: int, device: torch.device) -> tuple[int, int]:
    """(bytes, size): the most GPU memory this rank's buffers and scratch take at one size of the
    sweep, and that size. Scratch counts where it lives: a hand-written gloo call on CUDA tensors
    from $COMMBENCH_GLOO_CUDA_HOST_FROM's size on runs on host copies, scratch and all. Buffers grow
    with the size, and the scratch is taken at its most up to it, so the worst is the largest size
    or, where that moves the scratch to the host, the largest below it."""
    backend = comm.p2p.backend_for(None, device)
    every = sizes(config)
    # "ring" stands for every hand-written algorithm: builtin has no scratch
    kept = [s for s in every if not comm.staged_whole(device, "ring", backend, s)]
    worst = []
    for size in {max(every), *kept[-1:]}:
        upto = dataclasses.replace(config, max_bytes=size)
        on_gpu = size in kept
        scratch = scratch_per_rank(upto, world, backend)[rank] if on_gpu else 0
        worst.append((buffer_bytes(upto, world) + scratch, size))
    return max(worst)


def check_gpu_memory(config: SweepConfig, world: int, rank: int, device: torch.device) -> None:
    """Refuse (ValueError, on every rank alike) a CUDA sweep whose buffers and scratch at some
    size, summed over the ranks on each GPU, exceed what that GPU has free: CUDA would run out of
    memory at that size, after the smaller sizes had run. Each rank measures before it allocates
    anything of the sweep, then the ranks share what they found (one all_gather), so all refuse
    together or none does. Checked in the ranks, where CUDA is up: the launcher must not start
    CUDA before it forks them. Host memory, where gloo's calls keep their copies, is not checked."""
    need, size = gpu_bytes(config, world, rank, device)
    free, _ = torch.cuda.mem_get_info(device)
    have = free + torch.cuda.memory_reserved(device)
    refusal = gpu_memory_refusal(comm.p2p.gather_by_gpu(device, (device.index, need, size, have)))
    if refusal is not None:
        raise ValueError(refusal)


def _resolve(config: SweepConfig, series: str, size_bytes: int, world: int) -> tuple[str, int]:
    """The algorithm series ``series`` runs at this size, and the segment it runs with: the one the
    series names where that algorithm is segmented, else the default (which the others ignore)."""
    algorithm, segment = series_parts(series)
    resolved = comm.resolve(config.collective, algorithm, size_bytes, world)
    return resolved, segment if segment is not None and resolved in comm.SEGMENTED else SEGMENT_BYTES


def stats_us(times_s: list[float]) -> dict[str, float]:
    """p50 (the headline), min, mean, p90 and max of per-iteration times, in microseconds."""
    us = sorted(t * 1e6 for t in times_s)
    rank90 = 0.9 * (len(us) - 1)
    lo, hi = math.floor(rank90), math.ceil(rank90)
    p90 = us[lo] + (us[hi] - us[lo]) * (rank90 - lo)
    return {
        "time_us": statistics.median(us),
        "time_us_min": us[0],
        "time_us_mean": statistics.fmean(us),
        "time_us_p90": p90,
        "time_us_max": us[-1],
    }


def rotated(series: tuple[str, ...], it: int) -> tuple[str, ...]:
    """The order of the series in iteration ``it``: each starts it in turn, so that none always
    runs first after the barrier, or always right after the same other series."""
    k = it % len(series) if series else 0
    return series[k:] + series[:k]


def schedule(
    series: tuple[str, ...], iterations: int, block: int, turn: int = 0
) -> Iterator[tuple[str, int]]:
    """(series, iteration) in the order they run at one size: blocks of ``block`` iterations of one
    series, the series taking turns block by block in :func:`rotated` order, starting at ``turn``.

    A block of 1 interleaves iteration by iteration; a block of ``iterations`` or more runs each
    series' iterations back to back, one series after another.

    Given one at a time: made whole, the order of ``-n 10000000`` with three series took a rank
    29 s and 3.5 GB before its first call, and each rank's Python loop held the interpreter all
    that time, so a stop signal that landed on one of gloo's threads waited for it to end.
    """
    for first in range(0, iterations, block):
        for s in rotated(series, turn + first // block):
            for it in range(first, min(first + block, iterations)):
                yield s, it


class _Timer:
    """Wall clock on CPU; CUDA events on GPU (the host waits for the end event)."""

    def __init__(self, device: torch.device) -> None:
        from commbench.kernels.events import timing_events

        self.cuda = device.type == "cuda"
        self.events = timing_events(2) if self.cuda else []  # made once: each call reads its time

    def time(self, fn) -> float:
        if self.cuda:
            start, end = self.events
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def run_rank(config: SweepConfig, device_kind: str, emit, nic: str | None = None) -> list[SweepRecord]:
    """Body of one rank: run the whole sweep; rank 0 hands each finished point to ``emit``.

    Args:
        config: what to sweep.
        device_kind: "cpu" or "cuda".
        emit: called on rank 0 as emit(kind, payload) with kind "start" (sizes), "record"
            (SweepRecord) or "step" (one call of one series done, for progress).
        nic: the interface the wire count reads (``wirecount.agreed_nic``'s; agreed here if None).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if SPECS[config.collective].has_root and config.root >= world:
        raise ValueError(f"root {config.root} is not a rank of a world of {world}")
    backend = dist.get_backend()
    device = rank_device(device_kind)
    if device.type == "cuda":
        check_gpu_memory(config, world, rank, device)
    moved_by = comm.p2p.backend_for(None, device)  # the one builtin runs on: its price depends on it
    dtype = parse_dtype(config.dtype)
    spec = SPECS[config.collective]
    limit_spec = SPECS["sendrecv"]
    timer = _Timer(device)
    op = config.op if spec.needs_op else None
    # Sizes are whole elements (a whole count per rank for reduce_scatter and all_gather): two asked
    # for sizes that round to one count are measured once, and sizes under one element not at all.
    counts = {}
    for size in sizes(config):
        counts.setdefault(spec.count(size, dtype.itemsize, world), size)
    all_sizes = [size for count, size in counts.items() if count > 0]
    out: list[SweepRecord] = []
    counter = None
    # NIC counters see gloo's TCP, whether its tensors are on the host or on a GPU (it sends host
    # copies of those); NCCL's paths (NVLink, PCIe, InfiniBand's RDMA) are NVML's, or no counter's.
    if config.probe and moved_by == "gloo":
        from commbench.probes.wirecount import WireCounter

        counter = WireCounter(device, nic)  # the interface the caller agreed on, else agreed here
    if rank == 0:
        emit(
            "start",
            {
                "sizes": all_sizes,
                "iterations": config.warmup + config.iters,
                "series": len(config.series),
                "world_size": world,
                "backend": backend,
                "device": device.type,
            },
        )
    for turn, size in enumerate(all_sizes):
        count = spec.count(size, dtype.itemsize, world)
        if count == 0:
            continue
        size_bytes = count * dtype.itemsize
        # A fresh one per size, before the buffers: the schedules a Workspace keeps view the tensors
        # they were made for, so one kept for the whole sweep held earlier sizes' buffers (at 1 GiB
        # the 512, 256 and 128 MiB ones).
        workspace = comm.Workspace()
        bufs = {
            s: (limit_spec if s == LIMIT else spec).make_for(
                count, dtype, device, rank, world, config.op, config.root, config.in_place
            )
            for s in config.series
        }
        times: dict[str, list[float]] = {s: [] for s in config.series}
        # The turns go on from size to size, so that with one block per series (a block of
        # -w + -n) the same series is not the first to run at every size.
        for s, it in schedule(config.series, config.warmup + config.iters, config.block, turn):
            sp, b = (limit_spec, bufs[s]) if s == LIMIT else (spec, bufs[s])
            algo = "p2p" if s == LIMIT else s
            b.input.copy_(b.reference)
            dist.barrier()
            t = timer.time(lambda: sp.run(b, algo, config.op, config.root, None, workspace))  # noqa: B023
            if it >= config.warmup:
                times[s].append(t)
            if rank == 0:
                emit("step", None)
        # The time of an iteration is the slowest rank's.
        mat = torch.tensor([times[s] for s in config.series], dtype=torch.float64)
        if backend == "nccl":
            mat = mat.to(device)
        dist.all_reduce(mat, op=dist.ReduceOp.MAX)
        mat = mat.cpu()
        wrong: dict[str, int | None] = {s: None for s in config.series}
        if config.check:
            local = []
            for s in config.series:
                sp, b = (limit_spec, bufs[s]) if s == LIMIT else (spec, bufs[s])
                ready_for_check(b)
                sp.run(b, "p2p" if s == LIMIT else s, config.op, config.root, None, workspace)
                local.append(sp.wrong(b, config.op, rank, world, config.root))
            w = torch.tensor(local, dtype=torch.int64, device=device if backend == "nccl" else "cpu")
            dist.all_reduce(w)
            wrong = dict(zip(config.series, w.cpu().tolist(), strict=True))
        model = {s: _model_bytes(config, s, size_bytes, count, world, moved_by) for s in config.series}
        counted = (
            {
                s: _count_wire(
                    counter, config, s, bufs[s], spec, limit_spec, workspace, size_bytes, model[s], world
                )
                for s in config.series
            }
            if counter is not None
            else {}
        )
        # A CUDA-event pair around no GPU work can read 0: floor at 1 ns to keep bandwidths finite.
        st = {s: stats_us([max(t, 1e-9) for t in mat[i].tolist()]) for i, s in enumerate(config.series)}
        busbw = {
            s: size_bytes
            / (st[s]["time_us"] / 1e6)
            / 1e9
            * (limit_spec if s == LIMIT else spec).bus_factor(world)
            for s in config.series
        }
        for s in config.series:
            name = "sendrecv" if s == LIMIT else config.collective
            resolved, sent, recv = model[s]
            algbw = size_bytes / (st[s]["time_us"] / 1e6) / 1e9
            record = SweepRecord(
                collective=name,
                algorithm="p2p" if s == LIMIT else s,
                resolved_algorithm=resolved,
                backend=backend,
                device=device.type,
                world_size=world,
                dtype=config.dtype,
                op=op if s != LIMIT else None,
                root=config.root if spec.has_root and s != LIMIT else None,
                size_bytes=size_bytes,
                count=count,
                iters=config.iters,
                warmup=config.warmup,
                block=config.block,
                in_place=False if s == LIMIT else spec.runs_in_place(config.in_place),
                **st[s],
                algbw_gbps=algbw,
                busbw_gbps=busbw[s],
                wrong=wrong[s],
                busbw_ratio_to_builtin=_ratio(busbw[s], busbw.get("builtin")) if s != LIMIT else None,
                limit_busbw_gbps=busbw.get(LIMIT),
                # None where the bus factor makes busbw 0 (one rank), as the ratio to builtin
                frac_of_limit=_ratio(busbw[s], busbw.get(LIMIT)) if busbw[s] else None,
                computed_sent_bytes_per_rank=sent,
                computed_recv_bytes_per_rank=recv,
                **(counted[s].fields() if s in counted else {}),
            )
            out.append(record)
            if rank == 0:
                emit("record", record)
        # Before the next size's are made: one size's buffers at a time (``b`` is the last series').
        del bufs
        b = None
    return out


def _root(config: SweepConfig) -> int:
    """The root the cost model prices: ``--root`` for broadcast and reduce; the other collectives
    have none, and their sweeps take any ``--root`` and record root null."""
    return config.root if SPECS[config.collective].has_root else 0


def _model_bytes(
    config: SweepConfig, s: str, size_bytes: int, count: int, world: int, backend: str | None = None
) -> tuple[str, list[int], list[int]]:
    """What series ``s`` resolves to at this size, and the bytes each rank sends and receives per
    call (``builtin`` as ``backend`` runs it)."""
    if s == LIMIT or config.collective == "sendrecv":
        sent = [size_bytes if world > 1 else 0] * world
        return "p2p", sent, list(sent)
    resolved, segment = _resolve(config, s, size_bytes, world)
    c = cost(
        config.collective,
        resolved,
        world,
        count,
        size_bytes // count,
        root=_root(config),
        segment_bytes=segment,
        backend=backend,
    )
    return resolved, list(c.sent_bytes), list(c.recv_bytes)


def _count_wire(
    counter,
    config: SweepConfig,
    s: str,
    b,
    spec,
    limit_spec,
    workspace,
    size_bytes: int,
    model: tuple,
    world: int,
):
    """The counting pass of one series at one size: interface bytes per call beside the model's."""
    sp = limit_spec if s == LIMIT else spec
    algo = "p2p" if s == LIMIT else s
    _, sent, recv = model

    def once() -> None:
        b.input.copy_(b.reference)
        sp.run(b, algo, config.op, config.root, None, workspace)

    segments = _segment_bytes_on_wire(config, s, size_bytes, b.input.element_size(), world)
    counted = counter.count(once, config.probe_iters, sent, recv, size_bytes, segments)
    if says_off(counted.wire_check):
        # Loopback is shared with everything else on the machine: a count disturbed by someone
        # else's traffic is taken once more, and the second count stands. A real disagreement with
        # the cost model repeats itself and stays flagged.
        counted = counter.count(once, config.probe_iters, sent, recv, size_bytes, segments)
    return counted


def _segment_bytes_on_wire(
    config: SweepConfig, s: str, size_bytes: int, itemsize: int, world: int
) -> int | None:
    """About the bytes of each message series ``s`` sends where it cuts its data into segments (a
    ring's chunk, or send/recv's whole message, the limit's too), else None."""
    count = max(1, size_bytes // itemsize)
    if s == LIMIT or config.collective == "sendrecv":
        chunk, segment = count, series_parts("p2p" if s == LIMIT else s)[1] or SEGMENT_BYTES
    else:
        resolved, segment = _resolve(config, s, size_bytes, world)
        if resolved not in comm.SEGMENTED:
            return None
        chunk = -(-count // world)
    return -(-chunk // num_segments(chunk, itemsize, segment)) * itemsize


class Rank0Output:
    """What rank 0 does with a sweep's progress: records to files, table rows and a progress bar."""

    def __init__(self, config: SweepConfig, info: dict, nic: str | None = None) -> None:
        """``nic``: the interface the probe samples (see :class:`~commbench.bench.probing.RunProbe`)."""
        from commbench.bench import report

        self.config = config
        self.writer = RecordWriter(config.json_path, config.csv_path)
        self.writer.header(info)
        self.ranks = info.get("ranks")  # where each rank runs (machine.rank_places), for the table
        self.report = report
        self.bar = None
        self.pending: list[SweepRecord] = []
        self.probe = None
        self.probe_record: dict | None = None
        if config.probe:
            from commbench.bench.probing import RunProbe

            try:
                self.probe = RunProbe(config.probe_interval_s, nic)
            except BaseException:  # the caller never gets this object to close
                self.writer.close()
                raise

    def __call__(self, kind: str, payload) -> None:
        if kind == "start":
            if not self.config.quiet:
                from tqdm import tqdm

                self.bar = tqdm(
                    total=len(payload["sizes"]) * payload["iterations"] * payload["series"],
                    file=sys.stderr,
                    delay=2.0,
                    unit="iter",
                    leave=False,
                    dynamic_ncols=True,
                    disable=not sys.stderr.isatty(),
                )
                header = self.report.table_header(self.config, payload, self.ranks)
                if self.probe is not None:  # with the header's other notes, above the columns' names
                    notes, _, columns = header.rpartition("\n")
                    header = "\n".join(line for line in (notes, self.probe.describe(), columns) if line)
                say(header)
        elif kind == "step":
            if self.bar is not None:
                self.bar.update(1)
        elif kind == "record":
            self.writer.write(payload)
            self.pending.append(payload)
            if len(self.pending) == len(self.config.series):
                if self.probe is not None:
                    self.probe.mark(f"{payload.size_bytes} B")
                flags = [f"{r.algorithm}: {r.wire_check}" for r in self.pending if says_off(r.wire_check)]
                if not self.config.quiet:
                    line = self.report.table_rows(self.pending)
                    line += "".join(f"\n# wire bytes off: {f}" for f in flags)
                    if self.bar is not None:
                        with self.bar.external_write_mode():
                            say(line)
                    else:
                        say(line)
                self.pending = []

    def finished(self, records: list[SweepRecord]) -> None:
        """After the last point (not where the run stopped early): the table's closing lines, of
        the run's ``records``."""
        if records and not self.config.quiet:
            if self.bar is not None:
                self.bar.close()
                self.bar = None
            say(self.report.table_footer(records))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        try:
            if self.probe is not None:
                from commbench.bench.probing import overhead_line

                record = self.probe_record = self.probe.finish()
                if record is not None:
                    self.writer.write(record)
                    if not self.config.quiet:
                        say(overhead_line(record))
        finally:
            self.writer.close()
