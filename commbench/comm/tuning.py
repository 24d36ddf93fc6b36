"""Crossover points for ``algorithm="auto"``, measured with ``commbench sweep`` (docs/PERFORMANCE.md).

Per collective: (largest message in bytes, algorithm) in increasing order; the last entry has no
limit. The choice depends only on size and world size, so every rank makes the same one.
"""

from __future__ import annotations

KiB = 1 << 10

AUTO: dict[str, tuple[tuple[int | None, str], ...]] = {
    "all_reduce": ((64 * KiB, "rd"), (None, "ring")),
    "reduce_scatter": ((None, "ring"),),
    "all_gather": ((None, "ring"),),
    "broadcast": ((64 * KiB, "tree"), (None, "ring")),
    "reduce": ((64 * KiB, "tree"), (None, "ring")),
}


def choose(collective: str, size_bytes: int, world_size: int) -> str:
    """The algorithm ``auto`` runs for a message of ``size_bytes`` on ``world_size`` ranks."""
    if world_size <= 1:
        return "builtin"
    for limit, algorithm in AUTO[collective]:
        if limit is None or size_bytes <= limit:
            return algorithm
    raise AssertionError(f"no open-ended entry for {collective}")  # table is malformed
