"""Hand-written collectives over torch.distributed send/recv, beside the backend's own.

The API mirrors torch.distributed's tensor forms with an ``algorithm`` keyword. Every call
validates its arguments locally; with ``check=True`` (the default) the ranks also compare sizes,
dtype, op and algorithm in one small metadata all-gather, so a mismatch raises on every rank
instead of hanging. Benchmarks pass ``check=False``. Callers that repeat collectives pass a
:class:`Workspace` so scratch memory is allocated once, not on every call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from commbench.comm import builtin, naive, recursive, ring, tree, tuning
from commbench.comm.ops import DTYPES, OPS, check_op, dtype_name
from commbench.comm.workspace import Workspace

# The registry: adding an algorithm is one module and one line here.
_IMPLS: dict[str, dict[str, Callable[..., None]]] = {
    "all_reduce": {
        "builtin": builtin.all_reduce,
        "naive": naive.all_reduce,
        "ring": ring.all_reduce,
        "rd": recursive.all_reduce,
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
COLLECTIVES: tuple[str, ...] = tuple(_IMPLS)

__all__ = [
    "ALGORITHMS",
    "COLLECTIVES",
    "DTYPES",
    "OPS",
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
    big, small = (output, input) if what == "all_gather" else (input, output)
    if big.numel() != factor * small.numel():
        raise ValueError(
            f"{what}: {'output' if big is output else 'input'} must have world_size x "
            f"{small.numel()} = {factor * small.numel()} elements, got {big.numel()}"
        )


def _check_root(name: str, root: int, world: int) -> None:
    if not 0 <= root < world:
        raise ValueError(f"{name} must be a rank in [0, {world}), got {root}")


def _agree(group: dist.ProcessGroup | None, device: torch.device, *fields: int) -> None:
    """All-gather a few integers and raise on every rank if any rank disagrees."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    dev = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor(fields, dtype=torch.int64, device=dev)
    every = torch.empty(world * len(fields), dtype=torch.int64, device=dev)
    builtin.all_gather(every, mine, group)
    rows = every.view(world, len(fields)).cpu().tolist()
    bad = [r for r, row in enumerate(rows) if row != rows[0]]
    if bad:
        raise ValueError(
            f"ranks disagree on (elements, dtype, op, algorithm, root): rank 0 has {rows[0]}, "
            + ", ".join(f"rank {r} has {rows[r]}" for r in bad)
        )


_DTYPE_CODES = {d: i for i, d in enumerate(DTYPES.values())}
_OP_CODES = {o: i for i, o in enumerate(OPS)}


def _run(
    collective: str,
    algorithm: str,
    tensor: torch.Tensor,
    op: str,
    group: dist.ProcessGroup | None,
    check: bool,
    root: int,
    size_bytes: int,
) -> Callable[..., None]:
    """Validate what every collective shares and return the implementation to call."""
    world = dist.get_world_size(group)
    algo = resolve(collective, algorithm, size_bytes, world)
    if check:
        algo_code = list(ALGORITHMS[collective]).index(algorithm)
        _agree(
            group, tensor.device, tensor.numel(), _DTYPE_CODES[tensor.dtype], _OP_CODES[op], algo_code, root
        )
    return _IMPLS[collective][algo]


def all_reduce(
    tensor: torch.Tensor,
    op: str = "sum",
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
    *,
    check: bool = True,
    workspace: Workspace | None = None,
) -> None:
    """Reduce ``tensor`` across ranks in place (like ``torch.distributed.all_reduce``)."""
    _check_tensor("tensor", tensor)
    check_op(op, tensor.dtype)
    size = tensor.numel() * tensor.element_size()
    _run("all_reduce", algorithm, tensor, op, group, check, 0, size)(tensor, op, group, workspace=workspace)


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    op: str = "sum",
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
    *,
    check: bool = True,
    workspace: Workspace | None = None,
) -> None:
    """Reduce ``input`` across ranks; rank r's ``output`` gets chunk r (``reduce_scatter_tensor``)."""
    _check_pair(output, input, dist.get_world_size(group), "reduce_scatter")
    check_op(op, input.dtype)
    size = input.numel() * input.element_size()
    _run("reduce_scatter", algorithm, input, op, group, check, 0, size)(
        output, input, op, group, workspace=workspace
    )


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    algorithm: str = "auto",
    group: dist.ProcessGroup | None = None,
    *,
    check: bool = True,
    workspace: Workspace | None = None,
) -> None:
    """Concatenate every rank's ``input`` into ``output`` in rank order (``all_gather_into_tensor``)."""
    _check_pair(output, input, dist.get_world_size(group), "all_gather")
    size = output.numel() * output.element_size()
    _run("all_gather", algorithm, input, "sum", group, check, 0, size)(
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
) -> None:
    """Copy ``tensor`` from rank ``src`` (within ``group``) to every rank."""
    _check_tensor("tensor", tensor)
    _check_root("src", src, dist.get_world_size(group))
    size = tensor.numel() * tensor.element_size()
    _run("broadcast", algorithm, tensor, "sum", group, check, src, size)(
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
) -> None:
    """Reduce ``tensor`` across ranks into rank ``dst``; hand-written algorithms leave the other
    ranks' tensors unchanged."""
    _check_tensor("tensor", tensor)
    check_op(op, tensor.dtype)
    _check_root("dst", dst, dist.get_world_size(group))
    size = tensor.numel() * tensor.element_size()
    _run("reduce", algorithm, tensor, op, group, check, dst, size)(
        tensor, dst, op, group, workspace=workspace
    )
