"""Hand-written collectives over torch.distributed send/recv, beside the backend's own.

The API mirrors torch.distributed's tensor forms with an ``algorithm`` keyword. Every call
validates its arguments locally; with ``check=True`` (the default) the ranks also compare their
calls (collective, size, dtype, op, algorithm, root, segment and backend) in one small metadata
all-gather, so a mismatch raises on every rank instead of hanging. Benchmarks pass
``check=False``. Callers that repeat collectives pass a :class:`Workspace` so scratch memory is
allocated once, not on every call. ``segment_bytes`` sets the pipeline segment of the algorithms
in :data:`SEGMENTED` (default ``ring.SEGMENT_BYTES``); other algorithms refuse it, and ``auto``
passes it on where it picks one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from commbench.comm import builtin, naive, p2p, recursive, ring, tree, tuning
from commbench.comm.ops import DTYPES, OPS, check_op, dtype_name
from commbench.comm.workspace import Workspace, scratch
from commbench.units import AmbiguousSize, parse_size, whole_number

# The registry: adding an algorithm is one module and one line here.
_IMPLS: dict[str, dict[str, Callable[..., None]]] = {
    "all_reduce": {
        "builtin": builtin.all_reduce,
        "naive": naive.all_reduce,
        "ring": ring.all_reduce,
        "rd": recursive.all_reduce,
        "hd": recursive.halving_doubling_all_reduce,
    },
    "reduce_scatter": {
        "builtin": builtin.reduce_scatter,
        "naive": naive.reduce_scatter,
        "ring": ring.reduce_scatter,
    },
    "all_gather": {
        "builtin": builtin.all_gather,
        "naive": naive.all_gather,
        "ring": ring.all_gather,
    },
    "broadcast": {
        "builtin": builtin.broadcast,
        "naive": naive.broadcast,
        "ring": ring.broadcast,
        "tree": tree.broadcast,
    },
    "reduce": {
        "builtin": builtin.reduce,
        "naive": naive.reduce,
        "ring": ring.reduce,
        "tree": tree.reduce,
    },
}

ALGORITHMS: dict[str, tuple[str, ...]] = {c: (*impls, "auto") for c, impls in _IMPLS.items()}
SEGMENTED: tuple[str, ...] = ("ring",)  # algorithms that take ``segment_bytes`` (their pipeline's segment)
COLLECTIVES: tuple[str, ...] = tuple(_IMPLS)

__all__ = [
    "ALGORITHMS",
    "COLLECTIVES",
    "DTYPES",
    "OPS",
    "SEGMENTED",
    "all_gather",
    "all_reduce",
    "broadcast",
    "Workspace",
    "check_algorithm",
    "reduce",
    "reduce_scatter",
    "resolve",
]


def check_algorithm(collective: str, algorithm: str) -> str:
    """Validate an algorithm name for a collective and return it."""
    if collective not in ALGORITHMS:
        raise ValueError(f"unknown collective {collective!r}; choose from {', '.join(COLLECTIVES)}")
    if algorithm not in ALGORITHMS[collective]:
        raise ValueError(
            f"unknown algorithm {algorithm!r} for {collective}; "
            f"choose from {', '.join(ALGORITHMS[collective])}"
        )
    return algorithm


def resolve(collective: str, algorithm: str, size_bytes: int, world_size: int) -> str:
    """The concrete algorithm that runs (``auto`` resolved by message size)."""
    check_algorithm(collective, algorithm)
    if algorithm == "auto":
        return tuning.choose(collective, size_bytes, world_size)
    return algorithm


def _check_tensor(name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:  # .contiguous(), which the next refusal suggests, keeps it sparse
        raise ValueError(f"{name} must be a dense tensor, got {tensor.layout} (call .to_dense() first)")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    dtype_name(tensor.dtype)


def _check_pair(output: torch.Tensor, input: torch.Tensor, factor: int, what: str) -> None:
    _check_tensor("output", output)
    _check_tensor("input", input)
    if output.dtype != input.dtype or output.device != input.device:
        raise ValueError(
            f"output ({output.dtype}, {output.device}) and input ({input.dtype}, "
            f"{input.device}) must share dtype and device"
        )
    (big_name, big), small = (
        (("output", output), input) if what == "all_gather" else (("input", input), output)
    )
    if big.numel() != factor * small.numel():
        raise ValueError(
            f"{what}: {big_name} must have world_size x "
            f"{small.numel()} = {factor * small.numel()} elements, got {big.numel()}"
        )


def _check_root(name: str, root: int, world: int) -> int:
    """``root`` as a plain int rank of the group; raises on anything else (a bool, a float)."""
    rank = whole_number(root)
    if rank is None:
        kind = "" if isinstance(root, bool) else f"{type(root).__name__} "
        raise TypeError(f"{name} must be an integer rank, got {kind}{root!r}")
    if not 0 <= rank < world:
        raise ValueError(f"{name} must be a rank in [0, {world}), got {rank}")
    return rank


def _check_device(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """NCCL moves CUDA tensors only (gloo takes both: CUDA tensors are staged through the host), and
    a group with a backend per device may have none for this tensor's."""
    backend = p2p.backend_for(group, tensor.device)
    if backend == "nccl" and tensor.device.type != "cuda":
        raise ValueError(f"the nccl backend moves CUDA tensors only; this one is on {tensor.device}")
    if not backend:
        raise ValueError(
            f"the process group has no backend for {tensor.device.type} tensors "
            f"(it has {dist.get_backend_config(group)})"
        )
    if tensor.device.type == "meta":  # gloo's own collective took it too, and moved nothing
        raise ValueError("a meta tensor holds no data to move; give a cpu or cuda tensor")


def _agree(
    group: dist.ProcessGroup | None,
    device: torch.device | None,
    fields: tuple[int, ...],
    describe: Callable[[list[int]], str] = str,
) -> None:
    """All-gather a few integers and raise on every rank if any rank disagrees, each rank's shown
    by ``describe``. They travel in host memory wherever the group moves it, and otherwise (NCCL
    alone) on ``device``, the tensor's, or this rank's CUDA device for a rank without a valid
    tensor: every rank picks the same."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    if p2p.moves_host_tensors(group):
        dev = p2p.HOST
    else:
        dev = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(fields, dtype=torch.int64, device=dev)
    every = torch.empty(world * len(fields), dtype=torch.int64, device=dev)
    builtin.all_gather(every, mine, group)
    rows = every.view(world, len(fields)).cpu().tolist()
    bad = [r for r, row in enumerate(rows) if row != rows[0]]
    if bad:
        raise ValueError(
            f"ranks disagree: rank 0 has {describe(rows[0])}; "
            + "; ".join(f"rank {r} has {describe(rows[r])}" for r in bad)
        )


_DTYPE_CODES = {d: i for i, d in enumerate(DTYPES.values())}
_OP_CODES = {o: i for i, o in enumerate(OPS)}
_INVALID = (-1,) * 8
# the backends a rank's tensor may travel by; one named by none of these has the code len(_BACKENDS)
_BACKENDS = ("gloo", "nccl", "mpi", "ucc")


def _backend_code(group: dist.ProcessGroup | None, device: torch.device) -> int:
    """The agreement's code for the backend that moves ``group``'s tensors on ``device``. Ranks of a
    group with a backend per device ("cpu:gloo,cuda:nccl") whose tensors are on different devices
    would each wait in a backend the other never uses."""
    name = p2p.backend_for(group, device)
    return _BACKENDS.index(name) if name in _BACKENDS else len(_BACKENDS)


def _describe(row: list[int]) -> str:
    """What one rank's agreement fields say, in words: its call's collective, elements, dtype, op,
    algorithm, root, segment and backend (the codes alone, "[10, 0, 1, 2, 0, 0]", named none of
    them; and a code read in another rank's collective's table named the wrong algorithm, or none)."""
    if tuple(row) == _INVALID:
        return "arguments it refused"
    collective, count, dtype, op, algorithm, root, segment, backend = row
    name = COLLECTIVES[collective]
    return (
        f"{name}, {count} elements of {list(DTYPES)[dtype]}, op {OPS[op]}, algorithm "
        f"{ALGORITHMS[name][algorithm]}, root {root}, segment bytes {segment or 'default'}, "
        f"backend {(*_BACKENDS, 'another')[backend]}"
    )


MAX_SEGMENT_BYTES = 1 << 62


def _check_segment_bytes(segment_bytes: int | None, algorithm: str) -> int | None:
    """``segment_bytes`` is None, or a positive integer for an algorithm that segments (or ``auto``);
    returned as a Python int."""
    if segment_bytes is None:
        return None
    whole = whole_number(segment_bytes)  # NumPy's too
    if whole is None or whole < 1:
        raise ValueError(f"segment_bytes must be a positive integer, got {segment_bytes!r}")
    if whole > MAX_SEGMENT_BYTES:  # ranks agree on it as an int64
        raise ValueError(f"segment_bytes must be at most 2**62, got {segment_bytes}")
    if algorithm not in (*SEGMENTED, "auto"):
        raise ValueError(
            f"segment_bytes applies to {', '.join(SEGMENTED)} (or auto where it picks one), not {algorithm!r}"
        )
    return whole


_RUNNING: dict[int, int] = {}  # id of a group -> the thread running a collective on it
_RUNNING_LOCK = threading.Lock()


def _claim(group: dist.ProcessGroup | None) -> Callable[[], None]:
    """Mark ``group`` as running a collective in this thread; returns the release. Calls from two
    threads on one group cannot be matched across ranks (every message of a group shares one tag
    on one connection): they were cross-matched, and gloo aborted the process on a size mismatch."""
    key, me = id(group if group is not None else dist.group.WORLD), threading.get_ident()
    with _RUNNING_LOCK:
        other = _RUNNING.get(key)
        if other is not None and other != me:
            raise RuntimeError(
                "another thread is running a collective on this group: calls on one group run one at "
                "a time, in the same order on every rank; give each thread its own group (dist.new_group)"
            )
        _RUNNING[key] = me
    if other == me:  # a collective inside one (the host staging of a CUDA call): the outer releases
        return lambda: None

    def release() -> None:
        with _RUNNING_LOCK:
            _RUNNING.pop(key, None)

    return release


def _prepare(
    collective: str,
    algorithm: str,
    group: dist.ProcessGroup | None,
    check: bool,
    validate: Callable[[], tuple[torch.Tensor, int, str, int]],
    segment_bytes: int | None = None,
    workspace: object = None,
) -> Callable[..., None]:
    """Validate locally and (with ``check``) across ranks; return the implementation to call.

    ``validate`` raises on bad local arguments, else returns (the tensor whose shape and dtype
    every rank must share, message size in bytes, op, root). A rank whose arguments are bad
    still takes part in the agreement, so the others raise too instead of waiting for it.
    The implementation runs without autograd, like the backend's own collectives: a tensor that
    requires grad is reduced in place, not refused half way through by one rank's kernel.
    """
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError("this rank is not a member of the group it was given")
    release = _claim(group)
    try:
        run = _prepared(collective, algorithm, group, check, validate, segment_bytes, workspace)
    except BaseException:
        release()
        raise

    def claimed(*args, **kwargs) -> None:
        try:
            run(*args, **kwargs)
        finally:
            release()

    return claimed


def _prepared(
    collective: str,
    algorithm: str,
    group: dist.ProcessGroup | None,
    check: bool,
    validate: Callable[[], tuple[torch.Tensor, int, str, int]],
    segment_bytes: int | None,
    workspace: object,
) -> Callable[..., None]:
    """:func:`_prepare`'s work, in the thread that holds the group."""
    world = dist.get_world_size(group)
    p2p.prepare(group)  # every rank reaches this line, whatever its arguments
    error: Exception | None = None
    try:
        tensor, size_bytes, op, root = validate()
        _check_device(tensor, group)
        check_algorithm(collective, algorithm)  # a mistyped name is said as such, not as a segment misuse
        segment_bytes = _check_segment_bytes(segment_bytes, algorithm)
        if workspace is not None and not isinstance(workspace, Workspace):  # it failed mid-algorithm
            raise TypeError(
                f"workspace must be a commbench.comm.Workspace or None, got {type(workspace).__name__}"
            )
        resolved = resolve(collective, algorithm, size_bytes, world)
        impl = _IMPLS[collective][resolved]
        algo_code = list(ALGORITHMS[collective]).index(algorithm)
        fields = (
            COLLECTIVES.index(collective),
            tensor.numel(),
            _DTYPE_CODES[tensor.dtype],
            _OP_CODES[op],
            algo_code,
            root,
            segment_bytes or 0,
            _backend_code(group, tensor.device),
        )
        device = tensor.device
        staged = staged_whole(device, resolved, p2p.backend_for(group, device), size_bytes)
    except (ValueError, TypeError) as exc:
        error, fields, device = exc, _INVALID, None
    if check and world > 1:
        try:
            _agree(group, device, fields, _describe)
        except ValueError:
            if error is None:
                raise
    if error is not None:
        raise error

    def run(*args, **kwargs) -> None:
        if segment_bytes is not None and resolved in SEGMENTED:
            kwargs["segment_bytes"] = segment_bytes
        # Inference mode, not no_grad: it writes into tensors made in inference mode (as the backend's
        # own collective does), and a Workspace's scratch made here is written in here alone.
        with torch.inference_mode():
            if staged:
                _on_host(collective, impl, args, kwargs)
            else:
                impl(*args, **kwargs)

    return run


WRITE_ONLY_OUTPUT = ("reduce_scatter", "all_gather")  # their first tensor is written, never read
# From this message size on, a hand-written algorithm on gloo with CUDA tensors runs wholly on host
# copies (:func:`_on_host`); below it, p2p stages each message and the reductions stay on the GPU.
# With one torch thread per rank (the launcher's default and torchrun's), on an H100 host, whole
# host copies were the faster way at every size from 1 to 64 MiB on 4 ranks and from 32 MiB on 2,
# and level with staging each message below that on 2, hence 0; staging won clearly only where
# each rank ran many threads (docs/PERFORMANCE.md, "Threads per rank on a GPU host").
# $COMMBENCH_GLOO_CUDA_HOST_FROM moves the line.
STAGE_WHOLE_FROM_BYTES = 0
HOST_FROM_ENV = "COMMBENCH_GLOO_CUDA_HOST_FROM"
NEVER = "never"


def stage_whole_from(environ: Mapping[str, str] | None = None) -> int | None:
    """The message size from which a hand-written gloo call on CUDA tensors runs on host copies:
    ``$COMMBENCH_GLOO_CUDA_HOST_FROM`` as a size (``0``: always), ``never`` (None: always staged per
    message), or :data:`STAGE_WHOLE_FROM_BYTES` when unset or ``auto``.

    Raises:
        ValueError: neither ``auto``, ``never`` nor a size (one line).
    """
    value = (os.environ if environ is None else environ).get(HOST_FROM_ENV, "").strip() or "auto"
    if value == "auto":
        return STAGE_WHOLE_FROM_BYTES
    if value == NEVER:
        return None
    try:
        return parse_size(value)
    except AmbiguousSize as error:
        raise ValueError(f"${HOST_FROM_ENV}={value!r} is {error}") from None
    except ValueError:
        raise ValueError(f"${HOST_FROM_ENV}={value!r} is not auto, {NEVER} or a size (e.g. 0, 16M)") from None


def staged_whole(device: torch.device, resolved: str, backend: str, size_bytes: int) -> bool:
    """Whether a call runs on page-locked host copies of its tensors (:func:`stage_whole_from`)."""
    if device.type != "cuda" or backend != "gloo" or resolved == "builtin":
        return False
    start = stage_whole_from()
    return start is not None and size_bytes >= start


def _on_host(collective: str, impl: Callable[..., None], args: tuple, kwargs: dict) -> None:
    """Run ``impl`` on page-locked host copies of its CUDA tensors, then copy the result (the first
    tensor) back: gloo moves host memory only, so this is what its own collectives do with CUDA
    tensors. Staging each message instead (a host copy per segment sent, a page-locked buffer per
    segment received) cost half of gloo's speed at 32 and 64 MiB on two ranks of an H100 host
    (docs/PERFORMANCE.md, "On a GPU").
    """
    workspace = kwargs.get("workspace")
    host = list(args)
    where = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    for n, i in enumerate(where):
        host[i] = scratch(workspace, f"staged{n}", tuple(args[i].shape), args[i], pinned=True)
        if n > 0 or collective not in WRITE_ONLY_OUTPUT:
            host[i].copy_(args[i])
    impl(*host, **kwargs)
    args[where[0]].copy_(host[where[0]])


def all_reduce(
    tensor: torch.Tensor,
    op: str = "sum",
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
    *,
    check: bool = True,
    workspace: Workspace | None = None,
    segment_bytes: int | None = None,
) -> None:
    """Reduce ``tensor`` across ranks in place (like ``torch.distributed.all_reduce``)."""

    def validate() -> tuple[torch.Tensor, int, str, int]:
        _check_tensor("tensor", tensor)
        check_op(op, tensor.dtype)
        return tensor, tensor.numel() * tensor.element_size(), op, 0

    _prepare("all_reduce", algorithm, group, check, validate, segment_bytes, workspace)(
        tensor, op, group, workspace=workspace
    )


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: str = "sum",
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
    *,
    check: bool = True,
    workspace: Workspace | None = None,
    segment_bytes: int | None = None,
) -> None:
    """Reduce ``input`` across ranks; rank r's ``output`` gets chunk r (``reduce_scatter_tensor``).

    ``output`` may be a view of ``input`` (the in-place form)."""

    def validate() -> tuple[torch.Tensor, int, str, int]:
        _check_pair(output, input, dist.get_world_size(group), "reduce_scatter")
        check_op(op, input.dtype)
        return input, input.numel() * input.element_size(), op, 0

    impl = _prepare("reduce_scatter", algorithm, group, check, validate, segment_bytes, workspace)
    impl(output, input, op, group, workspace=workspace)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
    *,
    check: bool = True,
    workspace: Workspace | None = None,
    segment_bytes: int | None = None,
) -> None:
    """Concatenate every rank's ``input`` into ``output`` in rank order (``all_gather_into_tensor``)."""

    def validate() -> tuple[torch.Tensor, int, str, int]:
        _check_pair(output, input, dist.get_world_size(group), "all_gather")
        return input, output.numel() * output.element_size(), "sum", 0

    _prepare("all_gather", algorithm, group, check, validate, segment_bytes, workspace)(
        output, input, group, workspace=workspace
    )


def broadcast(
    tensor: torch.Tensor,
    src: int,
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
    *,
    check: bool = True,
    workspace: Workspace | None = None,
    segment_bytes: int | None = None,
) -> None:
    """Copy ``tensor`` from rank ``src`` (within ``group``) to every rank."""

    def validate() -> tuple[torch.Tensor, int, str, int]:
        nonlocal src
        _check_tensor("tensor", tensor)
        src = _check_root("src", src, dist.get_world_size(group))
        return tensor, tensor.numel() * tensor.element_size(), "sum", src

    _prepare("broadcast", algorithm, group, check, validate, segment_bytes, workspace)(
        tensor, src, group, workspace=workspace
    )


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: str = "sum",
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
    *,
    check: bool = True,
    workspace: Workspace | None = None,
    segment_bytes: int | None = None,
) -> None:
    """Reduce ``tensor`` across ranks into rank ``dst``; hand-written algorithms leave the other
    ranks' tensors unchanged."""

    def validate() -> tuple[torch.Tensor, int, str, int]:
        nonlocal dst
        _check_tensor("tensor", tensor)
        check_op(op, tensor.dtype)
        dst = _check_root("dst", dst, dist.get_world_size(group))
        return tensor, tensor.numel() * tensor.element_size(), op, dst

    _prepare("reduce", algorithm, group, check, validate, segment_bytes, workspace)(
        tensor, dst, op, group, workspace=workspace
    )
