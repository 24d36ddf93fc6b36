"""The alpha-beta model fitted from a sweep: time = steps x alpha + critical_bytes x beta.

Each sweep record is priced by the cost model (latency steps, bytes on the busiest link in
sequence); one alpha (per-step latency) and one beta (seconds per byte, 1/link speed) are fitted
by least squares of relative error over every record, so small and large messages weigh alike.
Then each algorithm's predicted time is set beside the measured one. Pure functions, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from commbench.bench.collectives import series_parts
from commbench.comm.chunking import num_segments
from commbench.comm.costmodel import cost
from commbench.comm.ring import SEGMENT_BYTES


@dataclass(frozen=True, kw_only=True)
class Point:
    """One measured (algorithm, size) with its cost-model price."""

    collective: str
    algorithm: str
    size_bytes: int
    steps: int
    critical_bytes: int
    time_s: float

    def __post_init__(self) -> None:
        if self.steps < 0 or self.critical_bytes < 0:
            raise ValueError(f"steps and bytes must be >= 0, got {self.steps}, {self.critical_bytes}")
        if not (self.time_s > 0 and math.isfinite(self.time_s)):
            raise ValueError(f"time must be a finite number > 0, got {self.time_s}")


@dataclass(frozen=True, kw_only=True)
class AlphaBeta:
    """A fitted model: ``alpha_s`` per latency step, ``beta_s_per_byte`` per byte in sequence."""

    alpha_s: float
    beta_s_per_byte: float
    points: int

    def __post_init__(self) -> None:
        for name in ("alpha_s", "beta_s_per_byte"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        if self.points < 1:
            raise ValueError(f"a fit needs points, got {self.points}")

    @property
    def gbps(self) -> float | None:
        """The bandwidth 1/beta in GB/s (10^9 bytes/s); None when beta is 0."""
        return 1 / self.beta_s_per_byte / 1e9 if self.beta_s_per_byte else None

    def predict_s(self, steps: int, critical_bytes: int) -> float:
        return steps * self.alpha_s + critical_bytes * self.beta_s_per_byte


@dataclass(frozen=True, kw_only=True)
class Row:
    """Predicted beside measured for one point; ``error`` = predicted / measured - 1."""

    algorithm: str
    size_bytes: int
    measured_us: float
    predicted_us: float

    @property
    def error(self) -> float:
        return self.predicted_us / self.measured_us - 1


def points(records: Iterable[dict[str, Any]]) -> list[Point]:
    """Priced points from sweep records (``type == "sweep"``); records the model cannot price are left
    out, and so are those of one rank, where nothing crosses a link (the limit is a local copy
    there). The send/recv limit series carries the whole message, one step per segment, as it sends
    it (the ring algorithms' segment unless the series names its own: "p2p@64K")."""
    out = []
    for r in records:
        time_us = r.get("time_us")
        timed = isinstance(time_us, int | float) and math.isfinite(time_us) and time_us > 0
        world = r.get("world_size")
        if (
            r.get("type") != "sweep"
            or not r.get("count")
            or not timed
            or not isinstance(world, int)
            or world < 2
        ):
            continue
        try:
            algorithm, segment = series_parts(r["algorithm"])  # "ring@64K": priced with its segments
        except ValueError:
            continue
        if r["collective"] == "sendrecv":
            itemsize = r["size_bytes"] // r["count"]
            steps, critical = num_segments(r["count"], itemsize, segment or SEGMENT_BYTES), r["size_bytes"]
        else:
            try:
                c = cost(
                    r["collective"],
                    r.get("resolved_algorithm") or algorithm,  # a record without it: "ring@64K" is the ring
                    r["world_size"],
                    r["count"],
                    r["size_bytes"] // r["count"],
                    root=r.get("root") or 0,
                    backend=r.get("backend"),  # builtin is priced as the record's backend runs it
                    **({} if segment is None else {"segment_bytes": segment}),
                )
            except ValueError:
                continue
            steps, critical = c.steps, c.critical_bytes
        name = "limit" if r["collective"] == "sendrecv" else r["algorithm"]
        out.append(
            Point(
                collective=r["collective"],
                algorithm=name,
                size_bytes=r["size_bytes"],
                steps=steps,
                critical_bytes=critical,
                time_s=r["time_us"] / 1e6,
            )
        )
    return out


def _solve(rows: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """Least squares of y against a*x1 + b*x2 (rows of x1, x2, y); None when singular."""
    s11 = sum(x1 * x1 for x1, _, _ in rows)
    s12 = sum(x1 * x2 for x1, x2, _ in rows)
    s22 = sum(x2 * x2 for _, x2, _ in rows)
    t1 = sum(x1 * y for x1, _, y in rows)
    t2 = sum(x2 * y for _, x2, y in rows)
    det = s11 * s22 - s12 * s12
    if abs(det) <= 1e-12 * max(s11 * s22, 1e-300):
        return None
    return (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det


def _one(rows: list[tuple[float, float]]) -> float:
    """Least squares of y against a*x through the origin, a >= 0."""
    sxx = sum(x * x for x, _ in rows)
    return max(0.0, sum(x * y for x, y in rows) / sxx) if sxx else 0.0


def fit(pts: Sequence[Point]) -> AlphaBeta:
    """Fit alpha and beta (both >= 0) minimising the squared relative error of predicted times.

    Raises:
        ValueError: fewer than two points, nothing to fit (no steps and no bytes), or points that
            cannot tell alpha from beta (each moves the same bytes a step: ring and limit from
            64 MiB at 4 ranks, in 16 MiB segments), where any split of the time fits as well.
    """
    if len(pts) < 2:
        raise ValueError(f"an alpha-beta fit needs at least 2 points, got {len(pts)}")
    # Divide each equation by the measured time: residuals become relative errors.
    rows = [(p.steps / p.time_s, p.critical_bytes / p.time_s, 1.0) for p in pts]
    solved = _solve(rows)
    if solved is None and all(any(row[i] for row in rows) for i in (0, 1)):
        stepped = next(p for p in pts if p.steps)
        per_step = stepped.critical_bytes / stepped.steps
        raise ValueError(
            f"alpha and beta cannot be told apart: every point moves {per_step:.0f} B a step "
            "(add sizes below the segment, or an algorithm whose steps carry other amounts)"
        )
    if solved is not None and solved[0] >= 0 and solved[1] >= 0:
        alpha, beta = solved
    else:  # the best non-negative fit lies on an axis: try each one alone, keep the better
        a_only = (_one([(x1, y) for x1, _, y in rows]), 0.0)
        b_only = (0.0, _one([(x2, y) for _, x2, y in rows]))

        def loss(ab: tuple[float, float]) -> float:
            return sum((ab[0] * x1 + ab[1] * x2 - y) ** 2 for x1, x2, y in rows)

        alpha, beta = min((a_only, b_only), key=loss)
    if alpha == 0 and beta == 0:
        raise ValueError("nothing to fit: every point has zero steps and zero bytes")
    return AlphaBeta(alpha_s=alpha, beta_s_per_byte=beta, points=len(pts))


def compare(pts: Sequence[Point], model: AlphaBeta, *, min_bytes: int = 1 << 20) -> list[Row]:
    """Predicted and measured time of each point of at least ``min_bytes``, by algorithm then size."""
    rows = [
        Row(
            algorithm=p.algorithm,
            size_bytes=p.size_bytes,
            measured_us=p.time_s * 1e6,
            predicted_us=model.predict_s(p.steps, p.critical_bytes) * 1e6,
        )
        for p in pts
        if p.size_bytes >= min_bytes
    ]
    return sorted(rows, key=lambda r: (r.algorithm, r.size_bytes))


def table(model: AlphaBeta, rows: Sequence[Row]) -> str:
    """The fitted parameters and, per algorithm, predicted beside measured time."""
    bw = f"{model.gbps:.4f} GB/s" if model.gbps else "inf"
    # Under 1 MiB the time is mostly the steps': a beta fitted there (0 ns/B, or 0.01 GB/s on a
    # 1 Gbit/s link) was printed as if measured.
    beta = (
        f"beta = {model.beta_s_per_byte * 1e9:.4f} ns/B (1/beta = {bw})"
        if rows
        else "beta not measured (no point of 1 MiB or more, where bytes set the time: give -e 1M or more)"
    )
    lines = [
        f"# alpha-beta fit over {model.points} points: alpha = {model.alpha_s * 1e6:.1f} us per step, {beta}",
        f"#{'algorithm':>10} {'size(B)':>12} {'measured(us)':>13} {'predicted(us)':>14} {'error':>7}",
    ]
    for r in rows:
        lines.append(
            f"{r.algorithm:>11} {r.size_bytes:>12} {r.measured_us:>13.1f} {r.predicted_us:>14.1f} "
            f"{r.error:>+7.1%}"
        )
    if (unlisted := model.points - len(rows)) > 0:  # the count above named more points than the rows
        lines.append(f"# {unlisted} fitted point(s) under 1 MiB, where the steps set the time, not listed")
    return "\n".join(lines)
