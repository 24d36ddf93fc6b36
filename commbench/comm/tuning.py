"""Crossover points for ``algorithm="auto"``, measured with ``commbench sweep`` (docs/PERFORMANCE.md).

Per collective and world size: (largest message in bytes, algorithm) in increasing order; the
last entry has no limit. World sizes without their own row use the "default" row. The choice
depends only on size and world size, so every rank makes the same one.

Why the rows look as they do (measured on the 2-core CI-class machine, gloo over loopback, where
one message costs a round trip of about 0.3 ms): on two ranks recursive doubling moves exactly
the bytes a ring moves in one step instead of two, so it wins until the ring's pipelining pays
(about 2 MiB, with one connection per direction: ``p2p.enable_duplex``). On four ranks the
root's concurrent sends of ``naive`` take two steps against the ring's six and win up to about
2 MiB for all_reduce and 1 MiB for broadcast, reduce_scatter and all_gather; reduce takes the
binomial tree up to 16 MiB, on any number of ranks. On eight ranks (eight processes sharing the
2 cores) ``naive`` still wins up to about 4 MiB, and above it recursive halving-doubling beats
the ring at every size measured, with 6 steps against 14. The "default" all_reduce row
(other world sizes, not measured) uses recursive doubling up to 1 MiB, because naive's load on
the root grows with the world.

The rows are measured, and for ``naive`` they go against the cost model: it prices each of the
root's n - 1 messages a way as a step of its own (``costmodel.cost``: 2 (n - 1) for all_reduce),
an upper bound where they are posted together and their round trips overlap. On that count naive
never beats rd, hd or the ring; on loopback, where a message costs a round trip and the root's
copies are cheap, it does, below the sizes above.
"""

from __future__ import annotations

KiB, MiB = 1 << 10, 1 << 20
Row = tuple[tuple[int | None, str], ...]

AUTO: dict[str, dict[int | str, Row]] = {
    "all_reduce": {
        2: ((2 * MiB, "rd"), (None, "ring")),
        4: ((2 * MiB, "naive"), (None, "ring")),
        8: ((4 * MiB, "naive"), (None, "hd")),
        "default": ((1 * MiB, "rd"), (None, "ring")),
    },
    "reduce_scatter": {"default": ((1 * MiB, "naive"), (None, "ring"))},
    "all_gather": {"default": ((1 * MiB, "naive"), (None, "ring"))},
    "broadcast": {"default": ((1 * MiB, "naive"), (None, "ring"))},
    "reduce": {"default": ((16 * MiB, "tree"), (None, "ring"))},
}


def choose(collective: str, size_bytes: int, world_size: int) -> str:
    """The algorithm ``auto`` runs for a message of ``size_bytes`` on ``world_size`` ranks."""
    if world_size <= 1:
        return "builtin"
    rows = AUTO[collective]
    for limit, algorithm in rows.get(world_size, rows["default"]):
        if limit is None or size_bytes <= limit:
            return algorithm
    raise AssertionError(f"no open-ended entry for {collective}")  # the table is malformed
