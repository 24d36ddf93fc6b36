"""Pure schedule logic: chunk boundaries, segments, ring and tree orders. No process group."""

from __future__ import annotations

import math

Span = tuple[int, int]  # [start, stop) in elements


def split(count: int, parts: int) -> list[Span]:
    """Split ``count`` elements into ``parts`` contiguous spans whose sizes differ by at most one.

    The first ``count % parts`` spans get the extra element, so every rank computes the same
    boundaries from the same two numbers.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    base, extra = divmod(count, parts)
    spans = []
    start = 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        spans.append((start, stop))
        start = stop
    return spans


# Each segment is a few Python objects and a message of its own: segment_bytes=4 cut a 1 MiB
# all_reduce of two ranks into 131072 segments a chunk, which took 92 s and 695 MiB of schedule.
MAX_SEGMENTS = 4096


def num_segments(max_chunk_elems: int, itemsize: int, segment_bytes: int) -> int:
    """How many pipeline segments a chunk is cut into so each is about ``segment_bytes``; never
    more than the chunk has elements, since an empty segment is not sent, nor than
    :data:`MAX_SEGMENTS` (segments of a smaller ``segment_bytes`` are then larger than asked)."""
    if segment_bytes < 1:
        raise ValueError(f"segment_bytes must be >= 1, got {segment_bytes}")
    wanted = math.ceil(max_chunk_elems * itemsize / segment_bytes)
    return max(1, min(max_chunk_elems, wanted, MAX_SEGMENTS))


def segment_bytes_cut(max_chunk_elems: int, itemsize: int, segment_bytes: int) -> int:
    """The segment size the read-ahead is sized by: ``segment_bytes``, or where :data:`MAX_SEGMENTS`
    made the segments larger than that, their size (its bytes were counted at the size asked for,
    and passed the cap on bytes read ahead)."""
    nseg = num_segments(max_chunk_elems, itemsize, segment_bytes)
    return max(segment_bytes, -(-max_chunk_elems // nseg) * itemsize)


def sub_span(span: Span, parts: int, index: int) -> Span:
    """Span ``index`` of ``span`` split into ``parts``: ``split(stop - start, parts)[index]``, worked
    out for that one span. A ring builds its schedule one segment at a time, and building the whole
    split for each made that quadratic in the segments (2.5 s of Python for 2048 of them)."""
    if not 0 <= index < parts:
        raise IndexError(f"span {index} of {parts}")
    start, stop = span
    base, extra = divmod(stop - start, parts)
    a = start + index * base + min(index, extra)
    return a, a + base + (1 if index < extra else 0)


def ring_reduce_scatter_order(rank: int, world: int) -> list[tuple[int, int]]:
    """(send chunk, receive chunk) per step of a ring reduce-scatter.

    Rank r sends to r+1 and receives from r-1; after ``world - 1`` steps rank r holds the fully
    reduced chunk r (the layout of ``reduce_scatter_tensor``).
    """
    return [((rank - s - 1) % world, (rank - s - 2) % world) for s in range(world - 1)]


def ring_all_gather_order(rank: int, world: int) -> list[tuple[int, int]]:
    """(send chunk, receive chunk) per step of a ring all-gather that starts from chunk ``rank``."""
    return [((rank - s) % world, (rank - s - 1) % world) for s in range(world - 1)]


def binomial_parent(rel: int) -> int | None:
    """Parent of relative rank ``rel`` in a binomial tree rooted at 0 (None for the root)."""
    if rel == 0:
        return None
    return rel - (rel & -rel)


def binomial_children(rel: int, world: int) -> list[int]:
    """Children of relative rank ``rel`` in a binomial tree over ``world`` ranks, farthest first."""
    low = (rel & -rel) if rel else 1 << max(0, (world - 1).bit_length())
    children = []
    mask = low >> 1
    while mask > 0:
        if rel + mask < world:
            children.append(rel + mask)
        mask >>= 1
    return children


def tree_depth(world: int) -> int:
    """Number of sequential rounds of a binomial tree over ``world`` ranks."""
    return (world - 1).bit_length()


def recursive_doubling_layout(world: int) -> tuple[int, int]:
    """(power-of-two core size p, number of folded pairs) for recursive doubling on ``world`` ranks.

    The first ``2 * folded`` ranks pair up (even rank folds into the odd one) so ``p`` ranks remain.
    """
    p = 1 << (world.bit_length() - 1)
    return p, world - p


def recursive_doubling_rank(rank: int, world: int) -> int | None:
    """Rank within the power-of-two core, or None for a rank folded into its neighbour."""
    _, folded = recursive_doubling_layout(world)
    if rank < 2 * folded:
        return None if rank % 2 == 0 else rank // 2
    return rank - folded


def recursive_doubling_real(core_rank: int, world: int) -> int:
    """The real rank of a core rank (inverse of :func:`recursive_doubling_rank`)."""
    _, folded = recursive_doubling_layout(world)
    return core_rank * 2 + 1 if core_rank < folded else core_rank + folded


def halving_schedule(core_rank: int, core: int, count: int) -> list[tuple[int, Span, Span]]:
    """(partner's core rank, span kept, span given) per round of a recursive-halving reduce-scatter
    over ``count`` elements among ``core`` (a power of two) ranks.

    Each round halves the span a rank is responsible for: partners share a span, the one whose
    bit for this round is clear keeps the lower half, the other the upper. Rounds go from the
    highest bit down, so after the last one core rank r holds the r-th of ``core`` spans. The
    recursive-doubling all-gather runs the rounds in reverse: a rank sends its span and receives
    the span it gave.
    """
    if core < 1 or core & (core - 1):
        raise ValueError(f"core must be a power of two, got {core}")
    rounds = []
    lo, hi = 0, count
    bit = core >> 1
    while bit:
        mid = (lo + hi) // 2
        lower, upper = (lo, mid), (mid, hi)
        keep, give = (upper, lower) if core_rank & bit else (lower, upper)
        rounds.append((core_rank ^ bit, keep, give))
        lo, hi = keep
        bit >>= 1
    return rounds
