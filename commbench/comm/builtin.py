"""The backend's own collectives: the reference every hand-written algorithm is checked against.

They take (and ignore) the ``workspace`` keyword the hand-written ones use."""

from __future__ import annotations

import torch
import torch.distributed as dist

from commbench.comm import p2p
from commbench.comm.ops import torch_reduce_op

# torch 2.14 renamed the tensor forms; older releases only have the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _native_avg(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    return p2p.backend_for(group, device) == "nccl"


def _op(op: str, group: dist.ProcessGroup | None, device: torch.device) -> dist.ReduceOp:
    # gloo has no AVG on every version commbench supports: sum, then divide. (NCCL averages itself;
    # its PreMulSum scales before it sums, so a float16 sum that overflows here need not there.)
    return torch_reduce_op("sum" if op == "avg" and not _native_avg(group, device) else op)


def _finish_avg(tensor: torch.Tensor, op: str, group: dist.ProcessGroup | None) -> None:
    if op == "avg" and not _native_avg(group, tensor.device):
        tensor.div_(dist.get_world_size(group))


def all_reduce(tensor: torch.Tensor, op: str, group: dist.ProcessGroup | None, **_: object) -> None:
    dist.all_reduce(tensor, op=_op(op, group, tensor.device), group=group)
    _finish_avg(tensor, op, group)


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: str, group: dist.ProcessGroup | None, **_: object
) -> None:
    # Flat views: commbench takes any shapes of the right sizes (as NCCL does); gloo checks the
    # first dimension, and refused a (2, 3) input beside an output of 3 that the others take.
    _reduce_scatter_tensor(output.view(-1), input.view(-1), op=_op(op, group, input.device), group=group)
    _finish_avg(output, op, group)


def all_gather(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None, **_: object
) -> None:
    _all_gather_tensor(output.view(-1), input.view(-1), group=group)  # flat: see reduce_scatter


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None, **_: object) -> None:
    dist.broadcast(tensor, src=p2p.global_rank(group, src), group=group)


def reduce(tensor: torch.Tensor, dst: int, op: str, group: dist.ProcessGroup | None, **_: object) -> None:
    # AVG is not a reduce op on every backend: sum, then divide at the destination.
    dist.reduce(
        tensor, dst=p2p.global_rank(group, dst), op=torch_reduce_op("sum" if op == "avg" else op), group=group
    )
    if op == "avg" and dist.get_rank(group) == dst:
        tensor.div_(dist.get_world_size(group))
