"""Point-to-point primitives every hand-written algorithm is built on.

Peers are given as ranks within ``group``; translation to global ranks happens here. NCCL needs
matching sends and receives grouped into one call or a ring deadlocks, so on NCCL the pair goes
through ``batch_isend_irecv``; gloo takes plain ``isend``/``irecv``, which cost less per call. gloo moves
host memory only, so CUDA tensors on gloo are staged through host copies.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Work = dist.Work


def group_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world size) of this process within ``group``."""
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    if group is None or group is dist.GroupMember.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def _needs_batching(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "nccl"


def exchange(
    send: torch.Tensor | None,
    dst: int | None,
    recv: torch.Tensor | None,
    src: int | None,
    group: dist.ProcessGroup | None,
) -> tuple[Work | None, Work | None]:
    """Start sending ``send`` to ``dst`` and receiving into ``recv`` from ``src``; either may be None.

    Empty tensors are not sent: both ends derive sizes from the same schedule, so they agree.
    Returns (send work, receive work), None where nothing was started.
    """
    do_send = send is not None and send.numel() > 0
    do_recv = recv is not None and recv.numel() > 0
    if not (do_send or do_recv):
        return None, None
    if _needs_batching(group):
        ops = []
        if do_send:
            ops.append(dist.P2POp(dist.isend, send, global_rank(group, dst), group))
        if do_recv:
            ops.append(dist.P2POp(dist.irecv, recv, global_rank(group, src), group))
        works = dist.batch_isend_irecv(ops)
        send_work = works[0] if do_send else None
        recv_work = works[-1] if do_recv else None
        return send_work, recv_work
    if (do_send and send.is_cuda) or (do_recv and recv.is_cuda):
        return _staged(send if do_send else None, dst, recv if do_recv else None, src, group)
    send_work = dist.isend(send, global_rank(group, dst), group) if do_send else None
    recv_work = dist.irecv(recv, global_rank(group, src), group) if do_recv else None
    return send_work, recv_work


class _Staged:
    """A receive into host memory that lands in the device tensor when waited for."""

    def __init__(self, work: Work, host: torch.Tensor, device_tensor: torch.Tensor) -> None:
        self.work, self.host, self.device_tensor = work, host, device_tensor

    def wait(self) -> bool:
        self.work.wait()
        self.device_tensor.copy_(self.host)
        return True


def _staged(send, dst, recv, src, group) -> tuple[Work | None, Work | None]:
    """gloo moves host memory only: CUDA tensors go through host copies."""
    send_work = recv_work = None
    if send is not None:
        host = send.cpu() if send.is_cuda else send
        send_work = dist.isend(host, global_rank(group, dst), group)
    if recv is not None:
        host = torch.empty(recv.shape, dtype=recv.dtype, pin_memory=recv.is_cuda)
        recv_work = _Staged(dist.irecv(host, global_rank(group, src), group), host, recv)
    return send_work, recv_work


def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None) -> Work | None:
    """Start sending ``tensor`` to ``dst``."""
    return exchange(tensor, dst, None, None, group)[0]


def recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> Work | None:
    """Start receiving into ``tensor`` from ``src``."""
    return exchange(None, None, tensor, src, group)[1]


def wait_all(works: list[Work | None]) -> None:
    """Wait for every started work in ``works``."""
    for work in works:
        if work is not None:
            work.wait()
