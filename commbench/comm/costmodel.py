"""The cost model: bytes each rank sends and receives, and the alpha-beta time of each algorithm;
also the scratch memory each rank's Workspace holds for a call (:func:`scratch_bytes`).

Sizes follow nccl-tests: for reduce_scatter and all_gather ``count`` is the whole (gathered)
array, n times the per-rank part. ``builtin`` is priced as what the backend runs (see
:func:`cost`): a ring, but for gloo's reduce_scatter (an allreduce of the whole array) and gloo's
broadcast (a binomial tree). Time = steps x alpha + critical_bytes x beta, where critical_bytes
is what the busiest link carries in sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from commbench.comm import tuning
from commbench.comm.chunking import (
    binomial_children,
    binomial_parent,
    halving_schedule,
    num_segments,
    recursive_doubling_layout,
    recursive_doubling_rank,
    recursive_doubling_real,
    ring_all_gather_order,
    ring_reduce_scatter_order,
    segment_bytes_cut,
    split,
    tree_depth,
)
from commbench.comm.pipeline import look_ahead
from commbench.comm.ring import SEGMENT_BYTES, receive_slots
from commbench.units import whole_number


@dataclass(frozen=True, kw_only=True)
class Cost:
    """What one collective call costs: per-rank bytes, latency steps, busiest-link bytes."""

    collective: str
    algorithm: str
    world_size: int
    size_bytes: int
    sent_bytes: tuple[int, ...]
    recv_bytes: tuple[int, ...]
    steps: int
    critical_bytes: int

    def time_s(self, alpha_s: float, beta_s_per_byte: float) -> float:
        """Predicted time under the alpha-beta model."""
        return self.steps * alpha_s + self.critical_bytes * beta_s_per_byte


def _segments(elems: int, itemsize: int, segment_bytes: int | None) -> int:
    """Segments a ring cuts a chunk of ``elems`` into (as ``ring._plan``); None: one a chunk."""
    return 1 if segment_bytes is None else num_segments(elems, itemsize, segment_bytes)


def _ring_all_reduce(
    count: int, n: int, item: int, segment_bytes: int | None
) -> tuple[list[int], list[int], int, int]:
    """Steps: the messages the busiest rank sends one after another (each chunk in ``nseg``
    segments, empty ones not sent), and at least the 2 (n - 1) hops a segment travels."""
    elems = [b - a for a, b in split(count, n)]
    nseg = _segments(max(elems), item, segment_bytes)
    sent, recv, messages = [], [], []
    for r in range(n):
        rs, ag = ring_reduce_scatter_order(r, n), ring_all_gather_order(r, n)
        sent.append(item * (sum(elems[s] for s, _ in rs) + sum(elems[s] for s, _ in ag)))
        recv.append(item * (sum(elems[x] for _, x in rs) + sum(elems[x] for _, x in ag)))
        messages.append(sum(min(elems[s], nseg) for s, _ in rs + ag))
    return sent, recv, max(*messages, 2 * (n - 1)), max(max(sent), max(recv))


def _fold_bytes(r: int, folded: int, size: int) -> int:
    """What folding adds to rank ``r`` each way: in the first 2 x ``folded`` ranks, the even one
    sends its data and gets the result back, the odd one takes the data and returns the result."""
    return size if r < 2 * folded else 0


def _rounds(core: int) -> list[int]:
    """The partner bit of each round of recursive doubling over ``core`` ranks, highest first."""
    return [1 << b for b in reversed(range(core.bit_length() - 1))]


def _rd_all_reduce(size: int, n: int) -> tuple[list[int], list[int], int, int]:
    """Each core rank sends its whole vector to its partner every round; what a rank receives is
    counted from the other side, its partners' sends (each core rank is a partner once a round)."""
    core, folded = recursive_doubling_layout(n)
    bits = _rounds(core)
    sent = [_fold_bytes(r, folded, size) for r in range(n)]
    recv = list(sent)  # the pair of a fold swap one message each way
    for r in range(n):
        me = recursive_doubling_rank(r, n)
        if me is not None:
            sent[r] += len(bits) * size
            for bit in bits:  # the partner sends to me ^ bit's partner, which is me
                recv[recursive_doubling_real(me ^ bit, n)] += size
    steps = len(bits) + (2 if folded else 0)
    return sent, recv, steps, steps * size


def _hd_all_reduce(count: int, n: int, item: int) -> tuple[list[int], list[int], int, int]:
    """Recursive halving then doubling: each core rank sends, per round, the span it gives
    (halving) and the span it keeps (doubling, rounds reversed). What it receives is counted from
    its partner's schedule: the partner's given span, then the partner's kept one. Folds as in
    ``rd``."""
    core, folded = recursive_doubling_layout(n)
    size = count * item
    sent = [_fold_bytes(r, folded, size) for r in range(n)]
    recv = list(sent)  # the pair of a fold swap one message each way
    widest = [0] * (core.bit_length() - 1)  # widest message per round
    schedules = [halving_schedule(me, core, count) for me in range(core)]
    for r in range(n):
        me = recursive_doubling_rank(r, n)
        if me is None:
            continue
        for i, (partner, (k0, k1), (g0, g1)) in enumerate(schedules[me]):
            sent[r] += item * (g1 - g0 + k1 - k0)
            _, (pk0, pk1), (pg0, pg1) = schedules[partner][i]
            recv[r] += item * (pg1 - pg0 + pk1 - pk0)
            widest[i] = max(widest[i], k1 - k0, g1 - g0)
    fold = 2 if folded else 0
    steps = 2 * len(widest) + fold
    return sent, recv, steps, 2 * item * sum(widest) + fold * size


def _gloo_broadcast_children(rel: int, n: int) -> list[int]:
    """Whom relative rank ``rel`` sends to in gloo's broadcast, a binomial tree: in round k every
    rank holding the data (rel < 2^k) sends to rel + 2^k. Not :func:`binomial_children`'s
    numbering: measured per rank with TCP_INFO, at 4 ranks the root sends twice and relative
    rank 1 once ([2, 1, 0, 0]), at 8 [3, 2, 1, 1, 0, 0, 0, 0], with root 0 and root n - 1 alike."""
    return [rel + (1 << k) for k in range(tree_depth(n)) if (1 << k) > rel and rel + (1 << k) < n]


def _ring_reduce(
    count: int, n: int, item: int, dst: int, segment_bytes: int | None
) -> tuple[list[int], list[int], int, int]:
    """Equal-chunk reduce-scatter of the first n*m elements, chunks gathered at ``dst``, and the
    count mod n leftover elements up a binomial tree (see ``ring.reduce``). Steps: the messages
    ``dst`` receives, (n - 1) x nseg of the reduce-scatter, n - 1 chunks, one per tree round."""
    m, tail = divmod(count, n)
    part = m * item
    sent = [(n - 1) * part + (part if r != dst else 0) for r in range(n)] if m else [0] * n
    recv = [(n - 1) * part + ((n - 1) * part if r == dst else 0) for r in range(n)] if m else [0] * n
    if tail:
        rel = [(r - dst) % n for r in range(n)]
        for r in range(n):
            sent[r] += 0 if binomial_parent(rel[r]) is None else tail * item
            recv[r] += len(binomial_children(rel[r], n)) * tail * item
    steps = ((n - 1) * _segments(m, item, segment_bytes) + n - 1 if m else 0) + (tree_depth(n) if tail else 0)
    critical = (2 * (n - 1) * part if m else 0) + (tree_depth(n) * tail * item if tail else 0)
    return sent, recv, steps, critical


def _whole(name: str, value: object) -> None:
    """TypeError unless ``value`` is an integer (NumPy's too), not a bool."""
    if whole_number(value) is None:
        kind = "" if isinstance(value, bool) else f"{type(value).__name__} "
        raise TypeError(f"{name} must be an integer, got {kind}{value!r}")


def _check_call(
    collective: str, algorithm: str, world_size: int, count: int, itemsize: int, root: int, segment_bytes: int
) -> None:
    """ValueError for a call that cannot be priced, at any size (one rank and zero elements too);
    TypeError for a number that is no whole number (a float world size failed deep inside)."""
    from commbench.comm import ALGORITHMS

    for name, value in (
        ("world_size", world_size),
        ("count", count),
        ("itemsize", itemsize),
        ("root", root),
        ("segment_bytes", segment_bytes),
    ):
        _whole(name, value)

    if collective not in ALGORITHMS:
        raise ValueError(f"unknown collective {collective!r}; choose from {', '.join(ALGORITHMS)}")
    if algorithm not in ALGORITHMS[collective]:
        raise ValueError(f"no cost for {collective}/{algorithm}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if count < 0 or itemsize < 1:
        raise ValueError(f"count must be >= 0 and itemsize >= 1, got {count} and {itemsize}")
    if not 0 <= root < world_size:
        raise ValueError(f"root must be a rank in [0, {world_size}), got {root}")
    if segment_bytes < 1:  # refused by num_segments too, but only where a ring has a chunk to cut
        raise ValueError(f"segment_bytes must be >= 1, got {segment_bytes}")
    if collective in ("reduce_scatter", "all_gather") and count % world_size:
        raise ValueError(
            f"{collective}: count {count} is the whole (gathered) array and must be a multiple of "
            f"world_size {world_size}"
        )


def cost(
    collective: str,
    algorithm: str,
    world_size: int,
    count: int,
    itemsize: int,
    *,
    root: int = 0,
    segment_bytes: int = SEGMENT_BYTES,
    backend: str | None = None,
) -> Cost:
    """Price one call. ``algorithm="auto"`` is priced as what it resolves to.

    ``builtin`` is priced as ``backend`` runs it. NCCL (and None: a backend not said) as a ring,
    the ring or chain NCCL uses for large messages. gloo as a ring, as measured per rank with
    TCP_INFO for its allreduce, reduce and allgather, but for two: its reduce_scatter runs an
    allreduce of the whole array, so it is priced as the ring all_reduce of ``count`` elements
    (twice the bytes of a ring reduce-scatter), and its broadcast is a binomial tree (see
    :func:`_gloo_broadcast_children`), ceil(log2 n) steps with the root's sends in sequence.

    Args:
        collective: all_reduce, reduce_scatter, all_gather, broadcast or reduce.
        algorithm: a name from ``commbench.comm.ALGORITHMS``.
        world_size: ranks taking part.
        count: elements (the whole gathered array for reduce_scatter and all_gather).
        itemsize: bytes per element.
        root: source of broadcast, destination of reduce.
        backend: the backend that moves the tensors ("gloo", "nccl"), for ``builtin``.
        segment_bytes: the ring's pipeline segment. Steps count the messages on the critical
            path, so a ring's grow with its segments. ``builtin``'s own segmenting is the
            backend's: its ring steps are one message a step (a broadcast's chain is pipelined
            in segments of the default size).
    """
    _check_call(collective, algorithm, world_size, count, itemsize, root, segment_bytes)
    n, size = world_size, count * itemsize
    if algorithm == "auto":
        algorithm = tuning.choose(collective, size, n)
    priced = "ring" if algorithm == "builtin" else algorithm
    if algorithm == "builtin" and backend == "gloo":
        priced = {"reduce_scatter": "gloo_allreduce", "broadcast": "gloo_tree"}.get(collective, priced)
    segment = None if algorithm == "builtin" else segment_bytes
    zero = [0] * n
    if n == 1 or count == 0:
        sent, recv, steps, critical = zero, zero, 0, 0
    elif collective == "all_reduce":
        if priced == "ring":
            sent, recv, steps, critical = _ring_all_reduce(count, n, itemsize, segment)
        elif priced == "naive":
            sent = [(n - 1) * size] + [size] * (n - 1)  # the result to each peer; each peer's input
            recv = [size * (n - 1)] + [sent[0] // (n - 1)] * (n - 1)  # the peers' inputs; a result
            # Each of the root's messages a step: an upper bound, as they are posted together
            # (tuning's rows, measured, pick naive where this count would not).
            steps, critical = 2 * (n - 1), 2 * (n - 1) * size
        elif priced == "rd":
            sent, recv, steps, critical = _rd_all_reduce(size, n)
        elif priced == "hd":
            sent, recv, steps, critical = _hd_all_reduce(count, n, itemsize)
        else:
            raise ValueError(f"no cost for {collective}/{algorithm}")
    elif collective in ("reduce_scatter", "all_gather"):
        part = size // n
        if priced == "ring":
            sent = [(n - 1) * part] * n
            recv = [sent[(r - 1) % n] for r in range(n)]  # what the left neighbour sends
            steps, critical = (n - 1) * _segments(count // n, itemsize, segment), (n - 1) * part
        elif priced == "gloo_allreduce":
            sent, recv, steps, critical = _ring_all_reduce(count, n, itemsize, None)
        elif priced == "naive":
            if collective == "reduce_scatter":  # whole inputs in, one part back out
                sent = [(n - 1) * part] + [size] * (n - 1)
                recv = [(n - 1) * size] + [part] * (n - 1)
            else:  # parts in, the whole array back out
                sent = [(n - 1) * size] + [part] * (n - 1)
                recv = [(n - 1) * part] + [size] * (n - 1)
            steps, critical = 2 * (n - 1), sent[0] + recv[0]
        else:
            raise ValueError(f"no cost for {collective}/{algorithm}")
    elif collective == "broadcast":
        rel = [(r - root) % n for r in range(n)]
        if priced == "naive":
            sent = [(n - 1) * size if x == 0 else 0 for x in rel]
            recv = [0 if x == 0 else size for x in rel]
            steps, critical = n - 1, (n - 1) * size
        elif priced == "tree":
            sent = [len(binomial_children(x, n)) * size for x in rel]
            recv = [0 if binomial_parent(x) is None else size for x in rel]
            steps, critical = tree_depth(n), tree_depth(n) * size
        elif priced == "gloo_tree":
            sent = [len(_gloo_broadcast_children(x, n)) * size for x in rel]
            recv = [0 if x == 0 else size for x in rel]
            steps, critical = tree_depth(n), tree_depth(n) * size
        elif priced == "ring":
            nseg = num_segments(count, itemsize, segment or SEGMENT_BYTES)
            seg = -(-size // nseg)
            sent = [size if x < n - 1 else 0 for x in rel]
            recv = [0 if x == 0 else size for x in rel]
            steps, critical = n - 2 + nseg, size + (n - 2) * seg
        else:
            raise ValueError(f"no cost for {collective}/{algorithm}")
    elif collective == "reduce":
        rel = [(r - root) % n for r in range(n)]
        if priced == "naive":
            sent = [0 if x == 0 else size for x in rel]
            recv = [(n - 1) * size if x == 0 else 0 for x in rel]
            steps, critical = n - 1, (n - 1) * size
        elif priced == "tree":
            sent = [0 if binomial_parent(x) is None else size for x in rel]
            recv = [len(binomial_children(x, n)) * size for x in rel]
            steps, critical = tree_depth(n), tree_depth(n) * size
        elif priced == "ring":
            sent, recv, steps, critical = _ring_reduce(count, n, itemsize, root, segment)
        else:
            raise ValueError(f"no cost for {collective}/{algorithm}")
    else:
        raise ValueError(f"unknown collective {collective!r}")
    return Cost(
        collective=collective,
        algorithm=algorithm,
        world_size=n,
        size_bytes=size,
        sent_bytes=tuple(sent),
        recv_bytes=tuple(recv),
        steps=steps,
        critical_bytes=critical,
    )


def _ring_reduce_scatter_scratch(
    chunk: int, n: int, itemsize: int, segment_bytes: int, in_place: bool, backend: str
) -> int:
    """Elements of a ring reduce-scatter's scratch over chunks of at most ``chunk`` elements: the
    slots arriving segments land in (as many as receives are posted ahead on gloo; on NCCL, which
    posts none ahead, one per segment of a chunk), and out of place (n > 2) a spare chunk for
    partial sums."""
    nseg = num_segments(chunk, itemsize, segment_bytes)
    ahead = 0 if backend == "nccl" else look_ahead(segment_bytes_cut(chunk, itemsize, segment_bytes))
    return receive_slots(nseg, ahead, n) * -(-chunk // nseg) + (0 if in_place or n <= 2 else chunk)


def _tree_reduce_scratch(count: int, rel: int, n: int) -> int:
    """Elements a binomial-tree reduce keeps at relative rank ``rel``: one message per child, and
    off the destination a copy for the partial result."""
    children = len(binomial_children(rel, n))
    return children * count + (count if children and rel != 0 else 0)


def scratch_bytes(
    collective: str,
    algorithm: str,
    world_size: int,
    count: int,
    itemsize: int,
    *,
    root: int = 0,
    segment_bytes: int = SEGMENT_BYTES,
    backend: str = "gloo",
    in_place: bool = False,
) -> tuple[int, ...]:
    """Bytes of scratch each rank's :class:`~commbench.comm.Workspace` holds after one call over
    ``backend`` (the ring's receive slots differ: gloo posts receives ahead, NCCL none), input and
    output distinct (as a sweep calls them), or with ``in_place`` a reduce_scatter's output its
    rank's chunk of the input and an all_gather's input its part of the output. ``builtin``'s
    memory is the backend's own and not counted. Other arguments as for :func:`cost`."""
    _check_call(collective, algorithm, world_size, count, itemsize, root, segment_bytes)
    n = world_size
    if algorithm == "auto":
        algorithm = tuning.choose(collective, count * itemsize, n)
    rel = [(r - root) % n for r in range(n)]
    elems = [0] * n
    if n > 1 and count > 0 and algorithm != "builtin":
        part = count // n
        # naive gathers at rank 0, or at the root of a reduce: one message per peer
        if (collective, algorithm) == ("reduce", "naive"):
            elems = [(n - 1) * count if x == 0 else 0 for x in rel]
        elif (collective, algorithm) == ("all_reduce", "naive"):
            elems = [(n - 1) * count] + [0] * (n - 1)
        elif (collective, algorithm) == ("reduce_scatter", "naive"):
            elems = [n * count] + [0] * (n - 1)  # and the reduced whole
        elif (collective, algorithm) in (("all_reduce", "rd"), ("all_reduce", "hd")):
            # a rank folded into its neighbour receives nothing; one that takes a fold, the whole
            core = (count + 1) // 2 if algorithm == "hd" else count
            folded = recursive_doubling_layout(n)[1]
            elems = [(0 if r % 2 == 0 else count) if r < 2 * folded else core for r in range(n)]
        elif (collective, algorithm) == ("all_reduce", "ring"):
            chunk = -(-count // n)
            elems = [_ring_reduce_scatter_scratch(chunk, n, itemsize, segment_bytes, True, backend)] * n
        elif (collective, algorithm) == ("reduce_scatter", "ring") and part > 0:
            ring = _ring_reduce_scatter_scratch(part, n, itemsize, segment_bytes, False, backend)
            elems = [ring + (part if in_place else 0)] * n  # in place: the result, kept aside till the end
        elif (collective, algorithm) == ("reduce", "tree"):
            elems = [_tree_reduce_scratch(count, x, n) for x in rel]
        elif (collective, algorithm) == ("reduce", "ring"):
            ring = _ring_reduce_scatter_scratch(part, n, itemsize, segment_bytes, False, backend)
            body = part + ring if part else 0
            elems = [body + _tree_reduce_scratch(count - part * n, x, n) for x in rel]
    return tuple(e * itemsize for e in elems)


def bus_factor(collective: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: busbw = algbw x factor."""
    _whole("world_size", world_size)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    n = world_size
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    if collective in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown collective {collective!r}")
