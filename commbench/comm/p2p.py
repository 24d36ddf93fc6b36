"""Point-to-point primitives every hand-written algorithm is built on.

Peers are given as ranks within ``group``; translation to global ranks happens here. NCCL needs
matching sends and receives grouped into one call or a ring deadlocks, so on NCCL the pair goes
through ``batch_isend_irecv``; gloo takes plain ``isend``/``irecv``, which cost less per call. gloo moves
host memory only, so CUDA tensors on gloo are staged through host copies. Which backend moves a
tensor is asked per device (:func:`backend_for`): a group made without a backend, as
``init_process_group()`` makes by default, has gloo for host tensors and NCCL for CUDA ones.

A job of two ranks on gloo gets one connection per direction (:func:`enable_duplex`). gloo joins each
pair of ranks in a group by one connection, and two ranks exchanging through it were measured
to move data closer to half duplex than full. In a ring of more than two ranks each connection
carries one direction anyway (a rank sends right and receives from the left), but with two
ranks left and right are the same peer. With the companion, messages from the lower rank
to the higher go through the group's own connection and the others through the companion's, a
rule both ends derive from the two ranks alone. The companion is a gloo connection joined under
the group's name, not a group of torch's (:func:`_companion_of`). On the 2-core
CI-class machine the 2-rank ring went from 0.45-1.28 of gloo's own allreduce at 1-64 MiB to
1.01-1.43 (docs/PERFORMANCE.md, "one connection per direction"; ``$COMMBENCH_GLOO_DUPLEX=0``
turns it off for that comparison).

:func:`prepare` readies a group once, before its first hand-written collective: the companion
above, and the congestion control of local connections (:mod:`commbench.comm.tcp`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import weakref
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from commbench.comm import tcp

Work = dist.Work
Post = Callable[["torch.Tensor | None"], "Work | None"]  # starts one transfer; None if nothing moves


def group_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world size) of this process within ``group``."""
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    if group is None or group is dist.GroupMember.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


HOST = torch.device("cpu")


def backend_for(group: dist.ProcessGroup | None, device: torch.device) -> str:
    """The backend that moves ``group``'s tensors on ``device``: "gloo", "nccl", ...

    A group made with one backend gives its name whatever the device. One made with a backend per
    device ("cpu:gloo,cuda:nccl") or with none (torch's default, whose name is "undefined": gloo
    for host tensors, and NCCL for CUDA ones where CUDA is seen) gives the one for ``device``'s
    type, or "" where it has none for it.
    """
    name = str(dist.get_backend(group))
    if ":" not in name and name != dist.Backend.UNDEFINED:
        return name
    key = _resolved(group)  # None before any group is made
    per_device = _PER_DEVICE.get(key) if key is not None else None
    if per_device is None:  # read once per group: exchange asks for every message
        pairs = (pair.partition(":") for pair in dist.get_backend_config(group).split(","))
        per_device = {kind.strip(): backend.strip() for kind, _, backend in pairs}
        if key is not None:
            _PER_DEVICE[key] = per_device
    return per_device.get(device.type, "")


# group -> {device type: backend}, for groups with a backend per device (see backend_for)
_PER_DEVICE: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[str, str]] = weakref.WeakKeyDictionary()


def gpu_key(device: torch.device) -> tuple[str, str]:
    """This host and the UUID of its GPU ``device``: equal for the ranks that share one GPU,
    whatever index each sees it by (a rank shown one GPU sees it as GPU 0)."""
    import socket

    return socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid)


def gather_by_gpu(device: torch.device, value: object) -> list[tuple[tuple[str, str], object]]:
    """Every rank's (:func:`gpu_key`, ``value``), in rank order, on every rank (one all_gather;
    the rank's own alone without a group of several)."""
    mine = (gpu_key(device), value)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    return found


def moves_host_tensors(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` moves tensors in host memory (all but a group of NCCL alone)."""
    return backend_for(group, HOST) not in ("nccl", "")


def _needs_batching(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    return backend_for(group, device) == "nccl"


DUPLEX_ENV = "COMMBENCH_GLOO_DUPLEX"


def duplex_setting(environ: Mapping[str, str] | None = None) -> bool:
    """``$COMMBENCH_GLOO_DUPLEX``, checked: whether a job of two gloo ranks gets one connection per
    direction (1, the default when unset) or keeps one for both (0, for comparison).

    Raises:
        ValueError: neither 0 nor 1 (one line): any other value was taken for 1 without a word.
    """
    value = (os.environ if environ is None else environ).get(DUPLEX_ENV, "").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(
            f"${DUPLEX_ENV}={value!r} is not 0 (one connection for both directions) or 1 (one per direction)"
        )
    return value == "1"


# group -> its reverse-direction companion (ranks 0 and 1 in it as in the group). Weak, as is
# _PREPARED, and shut down once torch has destroyed the group (_close_destroyed) or at the exit:
# one kept alive past destroy_process_group was freed at the interpreter's exit, where its gloo
# threads could end the rank with SIGABRT ("terminate called without an active exception").
_COMPANIONS: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroupGloo] = weakref.WeakKeyDictionary()


def _resolved(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return dist.group.WORLD if group is None else group


def group_timeout(group: dist.ProcessGroup | None) -> timedelta | None:
    """The timeout ``group`` was made with, for groups made beside it (None where unreadable;
    ``new_group`` then takes torch's default of 30 minutes, not the launch's ``--timeout``)."""
    device = HOST if moves_host_tensors(group) else torch.device("cuda")
    try:
        return _resolved(group)._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def enable_duplex(group: dist.ProcessGroup | None) -> None:
    """Give a 2-rank gloo group a second connection, one per direction (see the module's notes).

    Only where the group holds every rank of the job (two in all), as measured; a subgroup of two
    in a larger job keeps one connection. Both ranks of ``group`` must call this before their
    first message on it; later calls, other backends and every call where
    ``$COMMBENCH_GLOO_DUPLEX`` is 0 (one connection for both directions, for comparison) return
    at once; a value other than 0 or 1 raises (:func:`duplex_setting`).
    """
    key = _resolved(group)
    if key in _COMPANIONS or dist.get_world_size(group) != 2 or backend_for(group, HOST) != "gloo":
        return
    if dist.get_world_size() != 2:
        return
    if not duplex_setting():
        return
    _COMPANIONS[key] = _companion_of(key)


def _close(group: dist.ProcessGroup) -> None:
    """Shut ``group``'s companion down and forget it."""
    companion = _COMPANIONS.pop(group, None)
    if companion is not None:
        with contextlib.suppress(RuntimeError):
            companion.shutdown()


def _close_destroyed() -> None:
    """Shut down the companions of groups torch has destroyed. ``destroy_process_group`` shuts its
    own groups down; a companion is none of them, and kept its sockets and threads while anything
    still held its group."""
    if _COMPANIONS:
        live = dist.distributed_c10d._world.pg_map
        for group in [g for g in list(_COMPANIONS.keys()) if g not in live]:
            _close(group)


def _close_all() -> None:
    """At the exit: before the interpreter's end, where gloo's threads could abort the process."""
    for group in list(_COMPANIONS.keys()):
        _close(group)


atexit.register(_close_all)


def _companion_of(group: dist.ProcessGroup) -> dist.ProcessGroupGloo:
    """A gloo connection of its own between ``group``'s two ranks (ranks 0 and 1 in it as in
    ``group``), joined through the job's store under a key named after ``group``.

    Named after the group, not numbered: ``dist.new_group`` names a group by how many were made
    before it, so where two threads each made the first hand-written call on a group of their
    own, the ranks made the two companions in different orders and joined one group's on one
    rank to the other group's on the other; the sums came back mixed, without an error. Not a
    group of torch's either, so torch's count of groups stays the same on every rank of the job.
    A job that makes its groups anew reuses their names ("0" for the world) and may keep its
    store: the two ranks count their joins under the name in the store, so each companion has
    a key of its own, the same on both, whatever either process made before.
    """
    name = group.group_name
    store = dist.distributed_c10d._get_default_store()
    try:
        # A connection of its own: a store's client answers one call at a time, and two threads'
        # companions each waited there for its peer behind the other's call until the timeout.
        store = store.clone()
    except (AttributeError, RuntimeError):  # a store that cannot: one call at a time
        pass
    joined = store.add(f"commbench/duplex/{name}/joins", 1)  # 1 and 2 for the first pair, ...
    store = dist.PrefixStore(f"commbench/duplex/{name}/{(joined - 1) // 2}/", store)
    timeout = group_timeout(group) or timedelta(minutes=30)
    return dist.ProcessGroupGloo(store, dist.get_rank(group), 2, timeout=timeout)


_PREPARED: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()


def prepare(group: dist.ProcessGroup | None) -> None:
    """Ready ``group``'s connections for the hand-written algorithms, once per group: a second
    connection for two gloo ranks (:func:`enable_duplex`) and, on gloo, unpaced congestion
    control on connections within this host (:mod:`commbench.comm.tcp`).

    Every rank of ``group`` must call this at the same point the first time (it may join a
    second connection); later calls return at once, having shut down the companions of groups
    destroyed since.
    """
    _close_destroyed()
    key = _resolved(group)
    if key in _PREPARED:
        return
    enable_duplex(group)
    if backend_for(group, HOST) == "gloo":
        tcp.tune_local_connections()
    _PREPARED.add(key)


def _companion(group: dist.ProcessGroup | None) -> dist.ProcessGroupGloo | None:
    """``group``'s companion (see :func:`enable_duplex`), or None."""
    return _COMPANIONS.get(_resolved(group)) if _COMPANIONS else None


def _carrier(group: dist.ProcessGroup | None, src: int, dst: int, peer: int) -> tuple[dist.ProcessGroup, int]:
    """(what carries ``src`` -> ``dst``: ``group`` or its companion, ``peer``'s rank in it)."""
    return route(group, src, dst) or _resolved(group), peer


def route(group: dist.ProcessGroup | None, src: int, dst: int) -> dist.ProcessGroup | None:
    """What carries messages from ``src`` to ``dst`` (ranks in ``group``): ``group`` itself, or its
    companion (whose ranks are the group's) for the higher rank's messages to the lower."""
    companion = _companion(group)
    return companion if companion is not None and src > dst else group


def isend_on(pg: dist.ProcessGroup, tensor: torch.Tensor, peer: int) -> Work:
    """Start sending ``tensor`` to ``peer`` (a rank of ``pg``) over ``pg``'s connection.

    This is the call ``dist.isend`` ends in, without its per-call argument handling: on the
    2-core CI-class VM that handling doubled the CPU time of posting a message (about 30 us
    against 15 us, the write to the socket included).
    """
    return pg.send([tensor], peer, 0)


def irecv_on(pg: dist.ProcessGroup, tensor: torch.Tensor, peer: int) -> Work:
    """Start receiving into ``tensor`` from ``peer`` (a rank of ``pg``)."""
    return pg.recv([tensor], peer, 0)


def _moves(tensor: torch.Tensor | None) -> bool:
    """Whether ``tensor`` has anything to transfer: empty tensors are not sent, since both ends
    derive sizes from the same schedule and agree on it."""
    return tensor is not None and tensor.numel() > 0


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
    do_send, do_recv = _moves(send), _moves(recv)
    if not (do_send or do_recv):
        return None, None
    if _needs_batching(group, (send if do_send else recv).device):
        ops = []
        if do_send:
            ops.append(dist.P2POp(dist.isend, send, global_rank(group, dst), group))
        if do_recv:
            ops.append(dist.P2POp(dist.irecv, recv, global_rank(group, src), group))
        works = dist.batch_isend_irecv(ops)
        send_work = works[0] if do_send else None
        recv_work = works[-1] if do_recv else None
        return send_work, recv_work
    me = dist.get_rank(group)
    # (process group whose connection carries it, tensor, peer's rank there); None: nothing moved
    out = _on(_carrier(group, me, dst, dst), send) if do_send else None
    into = _on(_carrier(group, src, me, src), recv) if do_recv else None
    if (do_send and send.is_cuda) or (do_recv and recv.is_cuda):
        return _staged(out, into)
    send_work = isend_on(*out) if out else None
    recv_work = irecv_on(*into) if into else None
    return send_work, recv_work


def link(group: dist.ProcessGroup | None, dst: int, src: int, device: torch.device) -> tuple[Post, Post]:
    """(start sending a tensor to ``dst``, start receiving one from ``src``), for tensors on
    ``device``: what :func:`exchange` does one way, with its routing done once, here. Every
    tensor given to the two functions must be on ``device`` (exchange looks at each one).

    On gloo with host tensors each function goes straight to the connection that carries its
    direction. A pipeline posts a dozen messages a call or more, and the routing that
    :func:`exchange` repeats for each (the backend's name, this rank, the carrier) took about 40%
    of the CPU time of posting one (docs/PERFORMANCE.md, "What a message costs"). Elsewhere
    (NCCL, CUDA tensors staged through the host) each call goes through exchange.
    """
    if _needs_batching(group, device) or device.type != "cpu":
        return (lambda tensor: send(tensor, dst, group)), (lambda tensor: recv(tensor, src, group))
    me = dist.get_rank(group)
    out_pg, out_peer = _carrier(group, me, dst, dst)
    in_pg, in_peer = _carrier(group, src, me, src)

    def post_send(tensor: torch.Tensor | None) -> Work | None:
        return isend_on(out_pg, tensor, out_peer) if _moves(tensor) else None

    def post_recv(tensor: torch.Tensor | None) -> Work | None:
        return irecv_on(in_pg, tensor, in_peer) if _moves(tensor) else None

    return post_send, post_recv


def _on(carrier: tuple[dist.ProcessGroup, int], tensor: torch.Tensor) -> tuple:
    pg, peer = carrier
    return pg, tensor, peer


class _Staged:
    """A receive into host memory that lands in the device tensor when waited for."""

    def __init__(self, work: Work, host: torch.Tensor, device_tensor: torch.Tensor) -> None:
        self.work, self.host, self.device_tensor = work, host, device_tensor

    def wait(self) -> bool:
        self.work.wait()
        self.device_tensor.copy_(self.host)
        return True


def _staged(out, into) -> tuple[Work | None, Work | None]:
    """gloo moves host memory only: CUDA tensors go through host copies."""
    send_work = recv_work = None
    if out is not None:
        pg, send, peer = out
        send_work = isend_on(pg, send.cpu() if send.is_cuda else send, peer)
    if into is not None:
        pg, recv, peer = into
        host = torch.empty(recv.shape, dtype=recv.dtype, pin_memory=recv.is_cuda)
        recv_work = _Staged(irecv_on(pg, host, peer), host, recv)
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
