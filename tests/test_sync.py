"""Gradient-sync strategies on one process, with torch.distributed's calls replaced by stand-ins
that say what a real backend may do: what they check is the order of the sync's own steps."""

from __future__ import annotations

import contextlib
import copy
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from commbench.trainers import sync
from commbench.trainers.timing import Clock

CPU = Clock(torch.device("cpu"))


@pytest.fixture(autouse=True)
def _no_start_broadcast(monkeypatch):
    """The worlds faked here have no process group for wrap's one broadcast of rank 0's model
    (start_alike); tests/test_trainers_distributed.py runs it with real ranks."""
    monkeypatch.setattr(sync, "start_alike", lambda model: None)


class _LateWork:
    """An allreduce over two ranks holding the same tensor whose result lands only when waited on,
    as with NCCL: its future completes once the work is queued, not once it has run."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.future: torch.futures.Future = torch.futures.Future()
        self.future.set_result([tensor])

    def get_future(self) -> torch.futures.Future:
        return self.future

    def wait(self) -> bool:
        self.tensor.mul_(2)
        return True


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))


def _backward(model: nn.Module) -> None:
    torch.manual_seed(1)
    model(torch.randn(8, 6)).square().sum().backward()


def test_bucketed_unpacks_a_bucket_only_after_waiting_on_its_allreduce(monkeypatch) -> None:
    """The bucket's allreduce is waited on through its Work before its buffer is unpacked: the
    future of a timing callback completed with the work's queueing and carried no CUDA event, so
    the gradients could be read before the allreduce ended (not verified on a GPU here)."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, async_op=False, **k: _LateWork(tensor))
    model = _model()
    reference = copy.deepcopy(model)
    _backward(reference)
    bucketed = sync.Bucketed(CPU, cap_bytes=40, first_cap_bytes=20)
    module = bucketed.wrap(model)
    assert len(bucketed.buckets) > 2
    bucketed.before_backward()
    _backward(module)
    bucketed.after_backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)  # the two ranks' mean of equal gradients
    assert len(bucketed.take_intervals()) == len(bucketed.buckets)  # every bucket's comm is timed


def test_ring_thread_selects_the_buffers_cuda_device(monkeypatch) -> None:
    """The ring transport's thread runs on the device of the buffer it is given: the current CUDA
    device is per thread, and this one's was cuda:0 whatever the rank's device (a stand-in
    device selector stands for CUDA here; not run on a GPU)."""
    selected: list[object] = [None]
    seen: list[tuple[str, object]] = []

    @contextlib.contextmanager
    def device(d: object) -> Iterator[None]:
        before, selected[0] = selected[0], d
        try:
            yield
        finally:
            selected[0] = before

    class _Clock:
        def stamp(self) -> float:
            seen.append(("stamp", selected[0]))
            return 0.0

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(sync.comm, "all_reduce", lambda *a, **k: seen.append(("all_reduce", selected[0])))
    ring = sync._RingThread(_Clock(), group=None)
    try:
        buffer = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1))
        assert ring.submit(buffer, lambda start, end: None).wait(timeout=30)
    finally:
        ring.close()
    assert ring.error is None
    cuda1 = torch.device("cuda", 1)
    assert seen == [("stamp", cuda1), ("all_reduce", cuda1), ("stamp", cuda1)]


def test_bucketed_takes_its_hooks_off_the_model_when_closed(monkeypatch) -> None:
    """close() left bucketed's gradient hooks on the model: a later backward of it (another
    strategy's, a test's) counted down buckets and launched allreduces no other rank matched."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    launched: list[int] = []

    def all_reduce(tensor: torch.Tensor, *a: Any, async_op: bool = False, **k: Any) -> _LateWork:
        launched.append(tensor.numel())
        return _LateWork(tensor)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    model = _model()
    bucketed = sync.Bucketed(CPU, cap_bytes=40, first_cap_bytes=20)
    bucketed.wrap(model)
    _backward(model)
    bucketed.after_backward()
    assert len(launched) == len(bucketed.buckets)
    bucketed.close()
    launched.clear()
    model.zero_grad(set_to_none=True)
    _backward(model)
    assert launched == []
    assert all(p.grad is not None for p in model.parameters())  # plain backward, as without a sync


@pytest.mark.parametrize("strategy", ["naive", "ring"])
def test_after_backward_times_the_allreduce_alone(monkeypatch, strategy) -> None:
    """naive's and ring's communication interval began before the gradients were packed and ended
    after they were divided and unpacked, local copies that bucketed and ddp leave outside theirs
    (an mlp of 5.8M parameters here: about 100 ms of them a step on this 2-core machine, counted
    as comm ms). The interval is the allreduce's now; the gradients are the mean as before."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    seen: list[str] = []

    class _Clock:
        def stamp(self) -> int:
            seen.append("stamp")
            return len(seen)

    def logged(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.append(name)
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(sync, "pack", logged("pack", sync.pack))
    monkeypatch.setattr(sync, "unpack", logged("unpack", sync.unpack))
    monkeypatch.setattr(sync.comm, "all_reduce", logged("all_reduce", lambda t, *a, **k: t.mul_(2)))
    model = _model()
    reference = copy.deepcopy(model)
    _backward(reference)
    grad_sync = sync.make_sync(strategy, _Clock())
    grad_sync.wrap(model)
    _backward(model)
    grad_sync.after_backward()
    assert seen == ["pack", "stamp", "all_reduce", "stamp", "unpack"]
    ((start, end),) = grad_sync.take_intervals()
    assert seen[start - 1 : end] == ["stamp", "all_reduce", "stamp"]
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)  # the two ranks' mean of equal gradients


@pytest.mark.parametrize("strategy", ["naive", "bucketed"])
def test_hand_written_strategies_broadcast_buffers_before_forward_as_comm(monkeypatch, strategy) -> None:
    """Rank 0's BatchNorm statistics replace this rank's before forward, in one broadcast per dtype,
    and the broadcast is a communication interval of the step, as ddp's is."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    sent: list[torch.dtype] = []

    def broadcast(tensor: torch.Tensor, src: int, group: object = None) -> None:
        assert src == 0
        sent.append(tensor.dtype)
        tensor.fill_(7)  # what rank 0 holds

    monkeypatch.setattr(dist, "broadcast", broadcast)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2), nn.BatchNorm1d(2))
    grad_sync = sync.make_sync(strategy, CPU)
    grad_sync.wrap(model)
    grad_sync.before_forward()
    assert sorted(map(str, sent)) == ["torch.float32", "torch.int64"]
    assert all(bool((b == 7).all()) for b in model.buffers())
    assert len(grad_sync.take_intervals()) == 1
    grad_sync.close()


class _Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + (self.b(x) if self.use_b else 0)


def _fake_allreduce(monkeypatch, strategy: str, other_rank: str) -> None:
    """Two ranks; the other holds what this one holds ("same"), or ones everywhere ("ones")."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def combine(t: torch.Tensor) -> None:
        # bucketed divides by the world size before its allreduce, naive after
        t.mul_(2) if other_rank == "same" else t.add_(0.5 if strategy == "bucketed" else 1.0)

    class Work(_LateWork):
        def wait(self) -> bool:
            combine(self.tensor)
            return True

    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *a, async_op=False, **k: Work(tensor))
    monkeypatch.setattr(sync.comm, "all_reduce", lambda tensor, *a, **k: combine(tensor))


def _steps(strategy: str | None, uses: list[bool]) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = _Branch()
    grad_sync = sync.make_sync(strategy, CPU) if strategy else None
    module = grad_sync.wrap(model) if grad_sync else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 4)
    weights = []
    for use in uses:
        optimizer.zero_grad(set_to_none=True)
        model.use_b = use
        if grad_sync:
            grad_sync.before_backward()
        module(x).sum().backward()
        if grad_sync:
            grad_sync.after_backward()
        optimizer.step()
        weights.append(model.b.weight.detach().clone())
    return model, weights


@pytest.mark.parametrize("strategy", ["naive", "bucketed"])
def test_a_parameter_no_rank_used_keeps_no_gradient(monkeypatch, strategy) -> None:
    """Unused on every rank, a parameter's gradient stays None, so SGD skips it as plain torch does:
    given zeros, momentum went on moving it (0.48 then 0.43 in the review's run)."""
    _fake_allreduce(monkeypatch, strategy, "same")
    uses = [True, False, False]
    _, plain = _steps(None, uses)
    model, synced = _steps(strategy, uses)
    assert model.b.weight.grad is None and model.a.weight.grad is not None
    for step, (w, v) in enumerate(zip(synced, plain, strict=True)):
        torch.testing.assert_close(w, v, msg=lambda m, step=step: f"step {step}: {m}")


@pytest.mark.parametrize("strategy", ["naive", "bucketed"])
def test_a_parameter_another_rank_used_gets_the_mean_gradient(monkeypatch, strategy) -> None:
    """Unused here but used by the other rank: this rank's zeros enter the mean, as in DDP."""
    _fake_allreduce(monkeypatch, strategy, "ones")
    model, _ = _steps(strategy, [False])
    assert model.b.weight.grad is not None
    torch.testing.assert_close(model.b.weight.grad, torch.full_like(model.b.weight, 0.5))


def test_dp_comm_is_not_measured_rather_than_zero(monkeypatch, tmp_path) -> None:
    """nn.DataParallel's copies run inside torch, where no stamp reaches: its comm time was 0 ms,
    as if it moved nothing; it is now None and shown as '-'. vanilla-dp times its copies."""
    from commbench.bench.report import plot_training
    from commbench.bench.train import summary_table
    from commbench.trainers.dataparallel import DataParallelSync
    from commbench.trainers.loop import PHASES, epoch_record

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not DataParallelSync(CPU, "dp").measures_comm
    assert DataParallelSync(CPU, "vanilla-dp").measures_comm
    assert sync.make_sync("none", CPU).measures_comm  # nothing to sync: 0 ms is measured

    times = torch.full((3, len(PHASES)), 0.001, dtype=torch.float64)
    times[:, PHASES.index("comm")] = 0.0
    losses = torch.ones(3, dtype=torch.float64)
    dp = epoch_record("dp", 1, 1, 8, times, losses, 0.0, (None, None), comm_measured=False)
    assert dp.comm_ms is None and dp.hidden_comm_fraction is None
    assert epoch_record("none", 1, 1, 8, times, losses, 0.0, (None, None)).comm_ms == 0.0

    summary = {
        "strategy": "dp",
        "model": "mlp",
        "world_size": 1,
        "backend": "none",
        "batch_size": 8,
        "step_time_ms": 5.0,
        "data_ms": 0.1,
        "forward_ms": 1.0,
        "backward_ms": 2.0,
        "exposed_comm_ms": 0.0,
        "optimizer_ms": 0.5,
        "comm_ms": None,
        "hidden_comm_fraction": None,
        "images_per_s": 1600.0,
        "final_loss": 2.0,
        "final_accuracy": None,
        "grad_bytes_per_epoch": 4000,
        "wire_bytes_per_rank_per_epoch": None,
        "step_time_ratio_to_ddp": None,
    }
    row = summary_table([summary]).splitlines()[1].split()
    assert row[0] == "dp" and row[7] == "-"  # the comm ms column
    assert row[5] == "-"  # exposed comm: nothing measured to expose, not 0.00
    plot_training([], [summary], tmp_path / "b.png", tmp_path / "l.png")
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_an_epoch_record_counts_every_ranks_samples_and_takes_the_median_step() -> None:
    """An epoch's samples are steps x batch x ranks, its throughput those samples over the summed
    step time, its step time the median step's, and its cumulative time the earlier epochs' plus
    its own."""
    from commbench.trainers.loop import PHASES, epoch_record

    times = torch.zeros((3, len(PHASES)), dtype=torch.float64)
    times[:, PHASES.index("step")] = torch.tensor([0.001, 0.002, 0.010], dtype=torch.float64)
    losses = torch.ones(3, dtype=torch.float64)
    record = epoch_record("ring", 2, 2, 8, times, losses, 5.0, (None, None))
    assert record.steps == 3 and record.samples == 3 * 8 * 2 == 48
    assert record.time_s == pytest.approx(0.013)
    assert record.images_per_s == pytest.approx(48 / 0.013)
    assert record.step_time_ms == pytest.approx(2.0)  # the median, not the mean (4.33)
    assert record.cumulative_time_s == pytest.approx(5.013)
    assert not record.first_epoch


def test_the_compare_table_gives_megabytes_and_the_busiest_ranks_wire() -> None:
    """The grad column is in MB of 10^6 bytes, and the wire column the rank that sent the most."""
    from commbench.bench.train import summary_table

    summary = {
        "strategy": "ring",
        "step_time_ms": 5.0,
        "data_ms": 0.1,
        "forward_ms": 1.0,
        "backward_ms": 2.0,
        "exposed_comm_ms": 0.5,
        "optimizer_ms": 0.5,
        "comm_ms": 1.0,
        "hidden_comm_fraction": 0.5,
        "images_per_s": 1600.0,
        "final_loss": 2.0,
        "final_accuracy": 0.5,
        "grad_bytes_per_epoch": 10_000_000,
        "wire_bytes_per_rank_per_epoch": [1_000_000, 3_000_000, 2_000_000],
        "step_time_ratio_to_ddp": None,
    }
    head, row = summary_table([summary]).splitlines()
    assert head.split()[-6:] == ["grad", "MB/ep", "wire", "MB/rank/ep", "x", "ddp"]
    assert row.split()[0] == "ring" and row.split()[12:] == ["10.0", "3.0", "-"]  # grad, wire, x ddp


class _DDPCapFirst:
    """DistributedDataParallel's signature where ``bucket_cap_mb`` defaults to None and there is
    no ``bucket_cap_mb_list``: a cap given is the first bucket's too (torch 2.14 does the same with
    ``bucket_cap_mb=2`` alone: its first rebuilt bucket held two 1 MiB weights, not one)."""

    def __init__(
        self, module: nn.Module, device_ids: object = None, bucket_cap_mb: float | None = None
    ) -> None:
        pass


class _DDPFirst1MiB:
    """An older signature: ``bucket_cap_mb`` defaults to 25, the first bucket is 1 MiB whatever."""

    def __init__(self, module: nn.Module, device_ids: object = None, bucket_cap_mb: float = 25) -> None:
        pass


def test_ddp_refuses_caps_its_torch_cannot_take(monkeypatch) -> None:
    """Where DDP lacks bucket_cap_mb_list, --bucket-cap-mb 4 was passed as bucket_cap_mb alone in the
    belief that its first bucket stays 1 MiB; where bucket_cap_mb defaults to None, DDP makes the
    cap the first bucket's too, so ddp's buckets were not those of bucketed and of the computed
    bytes. Each DDP gets what it can take; the rest is refused before any rank starts."""
    import torch.nn.parallel

    from commbench.trainers.loop import TrainConfig

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", _DDPCapFirst)
    assert not sync.ddp_takes_bucket_list()
    with pytest.raises(
        ValueError, match=r"^--bucket-cap-mb 4 with --first-bucket-mb 1 needs .*bucket_cap_mb_list"
    ):
        TrainConfig(strategies=("ddp",), bucket_cap_mb=4.0)
    with pytest.raises(ValueError, match=r"give --first-bucket-mb 4\)$"):
        sync.DDPSync(CPU, cap_bytes=4 << 20)._bucket_args()
    with pytest.raises(ValueError, match="bucket_cap_mb_list"):
        TrainConfig(strategies=("ddp",), first_bucket_mb=0.5)
    TrainConfig(strategies=("ddp",), bucket_cap_mb=4.0, first_bucket_mb=4.0)
    assert sync.DDPSync(CPU, cap_bytes=4 << 20, first_cap_bytes=4 << 20)._bucket_args() == {
        "bucket_cap_mb": 4.0
    }
    assert sync.DDPSync(CPU)._bucket_args() == {}  # DDP's own 25 MiB and 1 MiB
    assert sync.ddp_first_bucket_is_cap()
    TrainConfig(strategies=("bucketed",), bucket_cap_mb=4.0)  # the hand-written buckets take any

    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", _DDPFirst1MiB)
    assert not sync.ddp_first_bucket_is_cap()
    with pytest.raises(ValueError, match=r"^--first-bucket-mb 0\.5 needs DistributedDataParallel's"):
        TrainConfig(strategies=("ddp",), first_bucket_mb=0.5)
    with pytest.raises(ValueError, match="bucket_cap_mb_list"):
        sync.DDPSync(CPU, cap_bytes=4 << 20, first_cap_bytes=1 << 19)._bucket_args()
    TrainConfig(strategies=("bucketed",), first_bucket_mb=0.5)
    TrainConfig(strategies=("ddp",), bucket_cap_mb=4.0)  # this DDP's first bucket is the default
    assert sync.DDPSync(CPU, cap_bytes=4 << 20)._bucket_args() == {"bucket_cap_mb": 4.0}


def test_ddp_times_its_buffer_broadcast_as_communication(tmp_path) -> None:
    """ddp's broadcast of rank 0's buffers before forward is timed by replacing DDP's private
    _sync_buffers; a torch that renamed it would leave the broadcast untimed without a word."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        grad_sync = sync.make_sync("ddp", CPU)
        module = grad_sync.wrap(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
        module(torch.randn(5, 3)).sum().backward()
        intervals = grad_sync.take_intervals()
        # the broadcast before forward, then the one bucket's allreduce in backward
        assert len(intervals) == 2
        plain = sync.make_sync("ddp", CPU)
        without = plain.wrap(nn.Sequential(nn.Linear(3, 4)))  # no buffers: no broadcast
        without(torch.randn(5, 3)).sum().backward()
        assert len(plain.take_intervals()) == 1
    finally:
        dist.destroy_process_group()


def test_buffers_over_the_same_memory_are_broadcast_once(monkeypatch) -> None:
    """A buffer registered twice, as two views of one tensor, is sent once: unpack refuses tensors
    over one another, which failed every forward."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    sent: list[int] = []

    def broadcast(tensor: torch.Tensor, src: int, group: object = None) -> None:
        sent.append(tensor.numel())
        tensor.fill_(7)

    monkeypatch.setattr(dist, "broadcast", broadcast)
    model = nn.Linear(3, 2)
    shared = torch.zeros(4)
    model.register_buffer("counts", shared)
    model.register_buffer("alias", shared[:])
    grad_sync = sync.make_sync("naive", CPU)
    grad_sync.wrap(model)
    grad_sync.before_forward()
    assert sent == [4] and shared.tolist() == [7.0] * 4
    model.register_buffer("part", shared[1:3])  # over part of it: refused, not written twice
    with pytest.raises(ValueError, match="has elements over one another or over an earlier"):
        grad_sync.before_forward()


class _TimedStub(sync.GradSync):
    """A sync with communication at set places: 20 ms before forward (as ddp's buffer broadcast),
    and 50 ms in the hook of the step's last gradient, after the trainer's own hook has stamped
    that gradient (as a sync that waits at the end of backward)."""

    def __init__(self, clock: Clock, params: list[nn.Parameter]) -> None:
        super().__init__(clock)
        self.left = 0
        self.count = len(params)
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad)

    def _timed(self, seconds: float) -> None:
        start = self.clock.stamp()
        time.sleep(seconds)
        self._record(start, self.clock.stamp())

    def before_forward(self) -> None:
        self._timed(0.02)

    def before_backward(self) -> None:
        self.left = self.count

    def _grad(self, param: torch.Tensor) -> None:
        self.left -= 1
        if self.left == 0:
            self._timed(0.05)


def test_a_steps_communication_is_hidden_only_within_backward_and_exposed_from_the_last_gradient():
    """Communication before forward is not hidden by backward (the window once began at the
    step's start), and what follows the last gradient's stamp is exposed, though backward has not
    returned yet (exposed time was once counted from backward's return)."""
    from commbench.trainers.loop import PHASES, TrainConfig, Trainer

    trainer = Trainer(
        TrainConfig(strategies=("none",), evaluate=False, probe=False),
        "none",
        (1, 8, 8),
        torch.device("cpu"),
        4,
    )
    trainer.sync = _TimedStub(trainer.clock, trainer.params)
    trainer.step(torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,)), 0.0)
    row = dict(zip(PHASES, trainer.times[-1], strict=True))
    assert row["comm"] >= 0.07
    assert row["hidden_comm"] == 0.0
    assert row["exposed_comm"] >= 0.05
    assert row["forward"] >= 0.02
