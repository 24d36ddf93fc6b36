"""Gradient-sync strategies: how the ranks' gradients become one average before the optimizer.

Every strategy has the same small interface, used by ``trainers.loop``:
``wrap(model)`` returns the module the loop calls forward on (with several ranks, each starts
from rank 0's parameters and buffers, as DDP's constructor makes them), ``before_forward()``
syncs the model's buffers where DDP would, ``before_backward()`` comes before each backward (a
sync still open from a backward before is finished first, so accumulated gradients are the sum
of each backward's average, as with DDP), ``after_backward()`` returns once every gradient is
the average over ranks, and ``take_intervals()`` hands over this step's communication as
(start, end) clock stamps, so the loop can say how much was hidden behind backward.

- ``none``: one rank, nothing to sync.
- ``naive`` / ``ring``: after backward, pack every gradient into one buffer, allreduce it with the
  hand-written algorithm, unpack.
- ``bucketed``: gradient hooks pack gradients into buckets (DDP's rule, see ``bucketing``); each
  bucket's allreduce starts as soon as it is full and runs while backward goes on. Transport:
  the backend's async allreduce, or the hand-written ring on a thread of its own.
- ``ddp``: torch DistributedDataParallel, the reference, with a comm hook that only adds timing.
"""

from __future__ import annotations

import contextlib
import hashlib
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from commbench import comm
from commbench.comm import p2p
from commbench.kernels import pack, unpack
from commbench.trainers.bucketing import DEFAULT_CAP_BYTES, DEFAULT_FIRST_CAP_BYTES, assign_buckets
from commbench.trainers.timing import Clock

STRATEGIES = ("none", "naive", "ring", "bucketed", "ddp", "dp", "vanilla-dp")
TRANSPORTS = ("backend", "ring")
BUCKETED = ("bucketed", "ddp")  # the strategies that read the bucket caps
SINGLE_PROCESS = ("none", "dp", "vanilla-dp")  # one process; dp and vanilla-dp drive every local GPU
CUDA_ONLY = ("dp", "vanilla-dp")


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def packable(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters, whose gradients go into flat buffers of the first one's dtype and
    device: ValueError, before the first step, where they do not all share them."""
    params = trainable(model)
    if not params:
        raise ValueError("the model has no trainable parameters to synchronise")
    kinds = sorted({(str(p.dtype).removeprefix("torch."), str(p.device)) for p in params})
    if len(kinds) > 1:
        raise ValueError(
            "the hand-written strategies pack every gradient into one dtype on one device; this model's "
            f"trainable parameters are {', '.join(f'{d} on {dev}' for d, dev in kinds)} (ddp takes them)"
        )
    return params


class GradSync:
    """No communication: the ``none`` strategy, and the base of the others."""

    name = "none"
    # False where the communication happens inside torch where no stamp reaches it (dp): its
    # comm time is then reported as not measured (None), not as 0.
    measures_comm = True

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._intervals: list[tuple[Any, Any]] = []
        self._lock = threading.Lock()  # intervals may be recorded off the main thread

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def before_forward(self) -> None:
        """Called before forward, inside the forward phase's time (where ddp syncs buffers)."""

    def before_backward(self) -> None:
        """Called after forward, before ``loss.backward()``."""

    def after_backward(self) -> None:
        """Return once every trainable gradient is the average over ranks."""

    def _record(self, start: Any, end: Any) -> None:
        with self._lock:
            self._intervals.append((start, end))

    def take_intervals(self) -> list[tuple[Any, Any]]:
        with self._lock:
            out, self._intervals = self._intervals, []
        return out

    def close(self) -> None:
        """Release threads and groups."""


def _broadcast_from_first(tensors: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Copy rank 0's ``tensors`` to every rank of ``group``: one builtin broadcast per dtype and
    device, of the tensors packed into one flat tensor."""
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    seen: set[tuple[Any, ...]] = set()
    for t in tensors:
        # Two tensors over the same memory in the same layout (a buffer registered twice under
        # two names as views) are sent once: unpack refuses tensors over one another.
        same = (t.data_ptr(), t.dtype, t.device, tuple(t.shape), t.stride())
        if t.device.type != "meta" and t.numel() and same in seen:
            continue
        seen.add(same)
        kinds.setdefault((t.dtype, t.device), []).append(t)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for (dtype, device), same in kinds.items():
            flat = pack(same, torch.empty(sum(t.numel() for t in same), dtype=dtype, device=device))
            dist.broadcast(flat, src=src, group=group)
            unpack(flat, same)


def broadcast_buffers(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Copy rank 0's buffers (BatchNorm statistics) to every rank of ``group``, as
    DistributedDataParallel does before each forward by default."""
    _broadcast_from_first(list(model.buffers()), group)  # read each time, as DDP does


def start_alike(model: nn.Module) -> None:
    """Give every rank rank 0's parameters and buffers, as DistributedDataParallel's constructor
    does: ranks that built their models from different seeds, or where only rank 0 loaded
    weights, averaged their gradients and each kept weights of its own. Models whose parameters
    and buffers differ in number, shape or dtype are refused on every rank (ValueError) first,
    where a broadcast of unequal sizes would fail or hang: each rank's list of them, hashed, is
    compared through its least and greatest over the ranks."""
    params, buffers = list(model.parameters()), list(model.buffers())
    layout = repr(
        [(tuple(t.shape), str(t.dtype)) for t in params]
        + ["buffers"]
        + [(tuple(t.shape), str(t.dtype)) for t in buffers]
    )
    digest = int.from_bytes(hashlib.sha256(layout.encode()).digest()[:8], "big") >> 2  # an int64's range
    mine = torch.tensor([digest], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        mine = mine.to(params[0].device if params else torch.device("cuda", torch.cuda.current_device()))
    low, high = mine.clone(), mine.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if not torch.equal(low, high):
        raise ValueError(
            f"the ranks' models differ (this rank's has {len(params)} parameters and {len(buffers)} "
            "buffers; their number, shapes or dtypes differ between ranks): "
            "build the same model on every rank"
        )
    _broadcast_from_first(params + buffers)


class _HandWritten(GradSync):
    """The strategies made here: like DDP, they start every rank from rank 0's parameters and
    buffers, and broadcast rank 0's buffers before each forward, timed as communication (it
    cannot overlap backward)."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.world = dist.get_world_size()
        self.model: nn.Module | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        self.model = model
        if self.world > 1:
            start_alike(model)  # untimed, once, as DDP's constructor
        return model

    def before_forward(self) -> None:
        if self.world == 1 or self.model is None or next(self.model.buffers(), None) is None:
            return
        start = self.clock.stamp()
        broadcast_buffers(self.model)
        self._record(start, self.clock.stamp())


def _pack_with_flags(params: list[nn.Parameter], buffer: torch.Tensor) -> list[int]:
    """Pack the gradients of ``params`` into ``buffer``, then one flag each: 1 where the parameter
    got a gradient, 0 where not, its gradient taken as zeros meanwhile. Returns the indices of the
    latter: after the allreduce, :func:`_unused_to_none` gives back None where no rank had one."""
    missing = [i for i, p in enumerate(params) if p.grad is None]
    for i in missing:
        params[i].grad = torch.zeros_like(params[i])
    n = buffer.numel() - len(params)
    pack([p.grad for p in params], buffer[:n])
    flags = buffer[n:]
    flags.fill_(1)
    if missing:
        flags[missing] = 0
    return missing


def _unused_to_none(params: list[nn.Parameter], buffer: torch.Tensor, missing: list[int]) -> None:
    """Unpack the summed gradients; a parameter no rank had a gradient for gets None back, as
    without a sync (SGD with momentum would otherwise go on moving it), and as DDP leaves it."""
    n = buffer.numel() - len(params)
    unpack(buffer[:n], [p.grad for p in params])
    if missing:  # only then is the flags' sum worth a read (on CUDA, a wait for the device)
        used = buffer[n:][missing].tolist()
        for i, u in zip(missing, used, strict=True):
            if u == 0:
                params[i].grad = None


class AfterBackward(_HandWritten):
    """Hand-written allreduce of all gradients, in one flat buffer, after backward (and one flag a
    parameter: whether it got a gradient, see _pack_with_flags)."""

    def __init__(self, clock: Clock, algorithm: str) -> None:
        super().__init__(clock)
        self.name = algorithm
        self.algorithm = algorithm
        self.params: list[nn.Parameter] = []
        self.flat: torch.Tensor | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        self.params = packable(model)
        p0 = self.params[0]
        size = sum(p.numel() for p in self.params) + len(self.params)
        self.flat = torch.empty(size, dtype=p0.dtype, device=p0.device)
        return super().wrap(model)

    def after_backward(self) -> None:
        assert self.flat is not None
        missing = _pack_with_flags(self.params, self.flat)
        # Only the allreduce is communication: packing, the division and unpacking are local
        # copies, outside the interval as bucketed's and ddp's are (they are exposed time all the same).
        start = self.clock.stamp()
        comm.all_reduce(self.flat, op="sum", algorithm=self.algorithm, check=False)
        self._record(start, self.clock.stamp())
        self.flat.div_(self.world)
        _unused_to_none(self.params, self.flat, missing)


class _RingThread:
    """Runs the hand-written ring allreduce on buffers handed to it, in order, off the main thread."""

    def __init__(self, clock: Clock, group: dist.ProcessGroup) -> None:
        self.clock, self.group = clock, group
        self.jobs: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, name="commbench-ring", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            buffer, done, record = job
            try:
                if self.error is None:
                    # The current CUDA device is per thread, cuda:0 on this one until set: select
                    # the buffer's, so the ring's work and the clock's events go to its device.
                    with torch.cuda.device(buffer.device) if buffer.is_cuda else contextlib.nullcontext():
                        start = self.clock.stamp()
                        comm.all_reduce(buffer, op="sum", algorithm="ring", group=self.group, check=False)
                        record(start, self.clock.stamp())
            except BaseException as exc:  # re-raised on the main thread by wait()
                self.error = exc
            finally:
                done.set()

    def submit(self, buffer: torch.Tensor, record: Callable[[Any, Any], None]) -> threading.Event:
        done = threading.Event()
        self.jobs.put((buffer, done, record))
        return done

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=30)


class Bucketed(_HandWritten):
    """Gradient hooks fill buckets; each full bucket's allreduce overlaps the rest of backward."""

    name = "bucketed"

    def __init__(
        self,
        clock: Clock,
        transport: str = "backend",
        cap_bytes: int = DEFAULT_CAP_BYTES,
        first_cap_bytes: int = DEFAULT_FIRST_CAP_BYTES,
    ) -> None:
        super().__init__(clock)
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown transport {transport!r}; choose from {', '.join(TRANSPORTS)}")
        self.transport, self.cap_bytes, self.first_cap_bytes = transport, cap_bytes, first_cap_bytes
        self.ring: _RingThread | None = None
        self.hooks: list[Any] = []

    def wrap(self, model: nn.Module) -> nn.Module:
        self.params = packable(model)
        module = super().wrap(model)  # rank 0's model on every rank, or refused before any hook
        p0 = self.params[0]
        self.buckets = assign_buckets(
            [p.numel() for p in self.params], p0.element_size(), self.cap_bytes, self.first_cap_bytes
        )
        # Each bucket's gradients, then one flag a parameter (see _pack_with_flags).
        self.buffers = [
            torch.empty(b.numel + len(b.params), dtype=p0.dtype, device=p0.device) for b in self.buckets
        ]
        self.bucket_of = {i: b.index for b in self.buckets for i in b.params}
        self.hooks = [
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(i))
            for i, p in enumerate(self.params)
        ]
        if self.transport == "ring":
            # A group of its own: the ring thread never shares a channel with the main thread.
            group = dist.new_group(backend=dist.get_backend(), timeout=p2p.group_timeout(None))
            p2p.prepare(group)  # here on the main thread, where every rank creates groups
            self.ring = _RingThread(self.clock, group)
        self._reset()
        return module

    def before_backward(self) -> None:
        """Before each backward. A sync still open from a backward before (gradient accumulation:
        backward, before_backward, backward) is finished first, as DDP syncs every backward: the
        buffers it had launched were packed again and divided while their allreduce ran."""
        if any(h is not None for h in getattr(self, "handles", ())):
            self._finish()
        self._reset()

    def _reset(self) -> None:
        self.waiting = [len(b.params) for b in self.buckets]
        self.ready = [False] * len(self.params)
        self.next_launch = 0
        self.handles: list[Any] = [None] * len(self.buckets)
        self.missing: list[list[int]] = [[] for _ in self.buckets]

    def _grad_ready(self, i: int) -> None:
        if self.ready[i]:
            # Its bucket may be on the wire with the last backward's gradient: unpacked over this
            # one, the average of the first would stand for both.
            raise RuntimeError(
                f"bucketed: parameter {i} got a second gradient before after_backward (two backwards, "
                "as in gradient accumulation): call before_backward before each backward"
            )
        self.ready[i] = True
        b = self.bucket_of[i]
        self.waiting[b] -= 1
        # Buckets start strictly in order, as DDP does, so every rank issues the same sequence.
        while self.next_launch < len(self.buckets) and self.waiting[self.next_launch] == 0:
            self._launch(self.next_launch)
            self.next_launch += 1

    def _launch(self, b: int) -> None:
        bucket, buffer = self.buckets[b], self.buffers[b]
        self.missing[b] = _pack_with_flags([self.params[i] for i in bucket.params], buffer)
        buffer.div_(self.world)
        if self.ring is not None:
            self.handles[b] = self.ring.submit(buffer, self._record)
            return
        start = self.clock.stamp()
        work = dist.all_reduce(buffer, async_op=True)
        # The callback only stamps the end: on CUDA it runs on a stream that waits for the
        # allreduce, so its event marks the end on the device. It returns None, so waiting on its
        # future orders nothing on the device; the Work's wait() does (see after_backward).
        timed = work.get_future().then(lambda f, start=start: self._record(start, self.clock.stamp()))
        self.handles[b] = (work, timed)

    def after_backward(self) -> None:
        self._finish()
        self._reset()

    def _finish(self) -> None:
        """Launch the buckets not launched yet, wait for every one and unpack it."""
        # Buckets holding a parameter that got no gradient this step: launched only now, and the
        # buckets after them too, since buckets start in order (the price of not knowing in advance
        # which parameters backward will skip; DDP without find_unused_parameters refuses them).
        while self.next_launch < len(self.buckets):
            self._launch(self.next_launch)
            self.next_launch += 1
        for bucket, buffer, handle, missing in zip(
            self.buckets, self.buffers, self.handles, self.missing, strict=True
        ):
            if self.ring is not None:
                if not handle.wait(timeout=dist.default_pg_timeout.total_seconds()):
                    raise TimeoutError("the ring thread did not finish a bucket in time")
                if self.ring.error is not None:
                    raise RuntimeError(f"ring allreduce failed: {self.ring.error}") from self.ring.error
            else:
                work, timed = handle
                work.wait()  # CUDA: the current stream waits for the allreduce before unpack reads it
                timed.wait()  # and its interval is recorded before take_intervals
            _unused_to_none([self.params[i] for i in bucket.params], buffer, missing)

    def close(self) -> None:
        # The hooks go with the sync: left on the model, its next backward would launch allreduces.
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        if self.ring is not None:
            self.ring.close()


def ddp_takes_bucket_list() -> bool:
    """Whether this torch's DistributedDataParallel takes ``bucket_cap_mb_list``, the only way to
    give it a first bucket other than its own 1 MiB and other than the cap (older ones take
    ``bucket_cap_mb`` alone)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    return "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel).parameters


def ddp_first_bucket_is_cap() -> bool:
    """Whether this torch's DistributedDataParallel, given ``bucket_cap_mb``, makes its first bucket
    that cap too: where ``bucket_cap_mb`` defaults to None, DDP tells the default (25 MiB, first
    bucket 1 MiB) from a cap given, and a cap given is the first bucket's as well; where it
    defaults to 25, the first bucket is 1 MiB whatever the cap."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    return inspect.signature(DistributedDataParallel).parameters["bucket_cap_mb"].default is None


def ddp_bucket_refusal(cap_bytes: int, first_cap_bytes: int) -> str | None:
    """Why ddp cannot take these bucket caps on this torch, or None where it can."""
    defaults = (cap_bytes, first_cap_bytes) == (DEFAULT_CAP_BYTES, DEFAULT_FIRST_CAP_BYTES)
    if defaults or ddp_takes_bucket_list():
        return None
    cap_mb, first_mb = cap_bytes / (1 << 20), first_cap_bytes / (1 << 20)
    if ddp_first_bucket_is_cap():
        if first_cap_bytes == cap_bytes:
            return None
        return (
            f"--bucket-cap-mb {cap_mb:g} with --first-bucket-mb {first_mb:g} needs DistributedDataParallel's "
            f"bucket_cap_mb_list, which torch {torch.__version__} lacks: there ddp's first bucket is 1 MiB "
            f"under the default 25 MiB cap, else the cap itself (give --first-bucket-mb {cap_mb:g})"
        )
    if first_cap_bytes == DEFAULT_FIRST_CAP_BYTES:
        return None
    return (
        f"--first-bucket-mb {first_mb:g} needs DistributedDataParallel's bucket_cap_mb_list, which "
        f"torch {torch.__version__} lacks (its first bucket is 1 MiB): leave it at 1 for ddp"
    )


class DDPSync(GradSync):
    """torch DistributedDataParallel; its comm hook is the default allreduce plus timestamps."""

    name = "ddp"

    def __init__(
        self, clock: Clock, cap_bytes: int = DEFAULT_CAP_BYTES, first_cap_bytes: int = DEFAULT_FIRST_CAP_BYTES
    ) -> None:
        super().__init__(clock)
        self.cap_bytes, self.first_cap_bytes = cap_bytes, first_cap_bytes

    def _bucket_args(self) -> dict[str, Any]:
        """DDP's own defaults (25 MiB, first bucket 1 MiB) when asked for; else both caps, per
        bucket, or the cap alone where this torch makes it the first bucket's too. ValueError for
        caps this torch's DDP cannot take (see ``ddp_bucket_refusal``)."""
        if (self.cap_bytes, self.first_cap_bytes) == (DEFAULT_CAP_BYTES, DEFAULT_FIRST_CAP_BYTES):
            return {}
        cap_mb, first_mb = self.cap_bytes / (1 << 20), self.first_cap_bytes / (1 << 20)
        if ddp_takes_bucket_list():
            return {"bucket_cap_mb_list": [first_mb, cap_mb]}
        refusal = ddp_bucket_refusal(self.cap_bytes, self.first_cap_bytes)
        if refusal is not None:
            raise ValueError(refusal)
        return {"bucket_cap_mb": cap_mb}

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        device = next(model.parameters()).device
        ddp = DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None, **self._bucket_args()
        )
        ddp.register_comm_hook(None, self._hook)
        sync_buffers = getattr(ddp, "_sync_buffers", None)
        if callable(sync_buffers):  # DDP's buffer broadcast before forward, timed as the others' is
            # (a private method: where a torch lacks it, the broadcast goes untimed, not undone)

            def timed() -> None:
                start = self.clock.stamp()
                sync_buffers()
                self._record(start, self.clock.stamp())

            ddp._sync_buffers = timed
        return ddp

    def _hook(self, state, bucket):  # noqa: ANN001 - DDP rejects any annotation but a real GradBucket
        buffer = bucket.buffer()
        buffer.div_(dist.get_world_size())
        start = self.clock.stamp()
        fut = dist.all_reduce(buffer, async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            self._record(start, self.clock.stamp())
            return f.value()[0]

        return fut.then(done)


def make_sync(
    strategy: str,
    clock: Clock,
    *,
    transport: str = "backend",
    cap_bytes: int = DEFAULT_CAP_BYTES,
    first_cap_bytes: int = DEFAULT_FIRST_CAP_BYTES,
) -> GradSync:
    """The sync object of one strategy (see module docstring)."""
    if strategy == "none":
        return GradSync(clock)
    if strategy in ("naive", "ring"):
        return AfterBackward(clock, strategy)
    if strategy == "bucketed":
        return Bucketed(clock, transport, cap_bytes, first_cap_bytes)
    if strategy == "ddp":
        return DDPSync(clock, cap_bytes, first_cap_bytes)
    if strategy in CUDA_ONLY:
        from commbench.trainers.dataparallel import DataParallelSync

        return DataParallelSync(clock, strategy)
    raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
