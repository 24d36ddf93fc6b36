"""Copy and compute kernels: on CPU here; the CUDA copies where a GPU is present."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch

from commbench.kernels import copy as copies
from commbench.kernels import reduce_into
from commbench.kernels.compute import MAX_DIM, MIN_DIM, burn_flops, matmul_plan


def test_host_copy_reports_consistent_units():
    r = copies.host_copy(1 << 20, iters=3, warmup=1)
    assert r.name == copies.HOST_TO_HOST and r.size_bytes == 1 << 20 and r.limit_gbps is None
    assert r.time_s > 0 and r.gbps == pytest.approx(r.size_bytes / r.time_s / 1e9)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.gbps = 1.0  # type: ignore[misc]


def test_a_copys_time_is_the_median_of_its_rounds():
    """Of rounds of 1, 2 and 6 s (in any order) the time is 2 s, not the mean, the fastest or the
    slowest, and 10^9 bytes in it are 0.5 GB/s."""
    r = copies._result(copies.HOST_TO_HOST, 10**9, [6.0, 1.0, 2.0], 12.5)
    assert (r.name, r.size_bytes, r.limit_gbps) == (copies.HOST_TO_HOST, 10**9, 12.5)
    assert r.time_s == 2.0 and r.gbps == pytest.approx(0.5)


def test_copy_bandwidth_on_cpu_is_one_host_copy():
    (r,) = copies.copy_bandwidth(4096, "cpu", iters=2, warmup=0)
    assert r.name == copies.HOST_TO_HOST


def test_cuda_copies_come_one_at_a_time():
    """``commbench bandwidth`` writes each kind as it comes: the CUDA kinds must not arrive as one batch."""
    assert inspect.isgeneratorfunction(copies.iter_cuda_copies)
    assert [r.name for r in copies.each_copy(4096, "cpu", iters=2, warmup=0)] == [copies.HOST_TO_HOST]


def test_each_cuda_copy_is_measured_when_it_is_asked_for(monkeypatch):
    """``each_copy`` hands out the CUDA kinds lazily: nothing is measured (here: nothing refused)
    until the first is asked for. One that measured them all before returning would raise at once."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    kinds = copies.each_copy(4096, "cuda", iters=1, warmup=0)
    with pytest.raises(ValueError, match="CUDA is not available"):
        next(kinds)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"size_bytes": 0}, "size_bytes"),
        ({"size_bytes": 8, "iters": 0}, "iters"),
        ({"size_bytes": 8, "warmup": -1}, "warmup"),
    ],
)
def test_copy_bad_input(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        copies.host_copy(**kwargs)


def test_copy_sizes_may_be_numpy_integers_and_a_bool_is_not_one():
    """host_copy(np.int64(1024)) was refused as not a whole number, where the collectives take
    NumPy's integers (segment_bytes)."""
    np = pytest.importorskip("numpy", reason="numpy is not installed here")
    r = copies.host_copy(np.int64(4096), iters=np.int32(2), warmup=np.uint8(0))
    assert r.size_bytes == 4096 and type(r.size_bytes) is int
    for bad in (True, 8.0, "8", np.float64(8)):
        with pytest.raises(ValueError, match="size_bytes must be a whole number"):
            copies.host_copy(bad)


def test_copy_on_an_unknown_device_type():
    with pytest.raises(ValueError, match="meta"):
        copies.copy_bandwidth(8, "meta")


@pytest.mark.parametrize(
    "out,a,b,needle",
    [
        (torch.zeros(4), torch.ones(4), torch.ones(1), "one shape, got out \\(4,\\), a \\(4,\\), b \\(1,\\)"),
        (torch.zeros(4), torch.ones(4), torch.ones(2, 2), "one shape"),
        (torch.zeros(4), torch.ones(4), torch.ones(4, dtype=torch.float64), "one dtype"),
        (torch.zeros(4), torch.ones(4), torch.ones(4, device="meta"), "one device"),
    ],
    ids=["broadcast", "2-D", "dtype", "device"],
)
def test_reduce_into_refuses_what_torch_would_broadcast_or_convert(out, a, b, needle):
    with pytest.raises(ValueError, match=needle):
        reduce_into(out, a, b, "sum")
    assert torch.equal(out, torch.zeros(4))


@pytest.mark.parametrize(
    "op,expected",
    [
        ("sum", torch.add),
        ("avg", torch.add),  # a sum here; the collective divides once at the end
        ("prod", torch.mul),
        ("max", torch.maximum),
        ("min", torch.minimum),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_reduce_into_matches_torch(op, expected, dtype):
    a = torch.tensor([1, 5, -2, 0, 7], dtype=dtype)
    b = torch.tensor([2, 1, 3, -4, 7], dtype=dtype)
    out = torch.empty_like(a)
    assert reduce_into(out, a, b, op) is out
    assert torch.equal(out, expected(a, b)), (op, out)


def test_reduce_into_an_unknown_op_names_the_choices():
    """It was a bare KeyError: 'mean'."""
    with pytest.raises(ValueError, match="unknown op 'mean'; choose from sum, avg, prod, max, min"):
        reduce_into(torch.zeros(2), torch.ones(2), torch.ones(2), "mean")


def test_reduce_into_refuses_what_is_not_an_op_name_or_a_tensor_in_one_line():
    """An op given as a list raised "unhashable type: 'list'"; a list for a tensor, AttributeError."""
    with pytest.raises(ValueError, match="unknown op \\['sum'\\]; choose from sum"):
        reduce_into(torch.zeros(2), torch.ones(2), torch.ones(2), ["sum"])
    with pytest.raises(TypeError, match="reduce_into needs tensors, got out list"):
        reduce_into([0.0, 0.0], torch.ones(2), torch.ones(2), "sum")
    with pytest.raises(TypeError, match="got b float"):
        reduce_into(torch.zeros(2), torch.ones(2), 1.0, "sum")


def test_reduce_into_may_write_into_an_operand():
    a = torch.tensor([1.0, 5.0, -2.0])
    assert reduce_into(a, a, torch.tensor([2.0, 1.0, 3.0]), "max") is a
    assert a.tolist() == [2.0, 5.0, 3.0]


def test_matmul_plan_matches_the_request():
    n, reps = matmul_plan(2 * 64**3, "cpu")
    assert (n, reps) == (64, 1)
    n, reps = matmul_plan(1e11, "cpu")
    assert n == 512 and reps * 2 * n**3 == pytest.approx(1e11, rel=0.01)
    n, reps = matmul_plan(10, "cpu")
    assert (n, reps) == (8, 1)
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="flops"):
            matmul_plan(bad, "cpu")


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("multiple", [1.49, 1.5, 2.51, 7.9, 1000.3])
def test_matmul_plan_past_the_cap_is_within_a_percent(device_type, multiple):
    """Past the cap the count of matmuls is rounded up: 1.49 caps' worth is two smaller matmuls,
    not one of the cap (a third short)."""
    cap = MAX_DIM[device_type]
    flops = multiple * 2 * cap**3
    n, reps = matmul_plan(flops, device_type)
    assert reps == math.ceil(multiple) and n <= cap
    assert abs(reps * 2 * n**3 - flops) / flops < 0.01


def test_matmul_plan_for_small_requests_is_the_closest_single_matmul():
    """Below one matmul of the cap, the n whose 2 n^3 is nearest (the nearest cube root is not
    always it), and never less than MIN_DIM."""
    for flops in [*range(1, 2 * 40**3, 97), 2 * 8.51**3, 2 * 20.5**3, 2 * 20.51**3]:
        n, reps = matmul_plan(flops, "cpu")
        best = min(abs(2 * k**3 - flops) for k in range(MIN_DIM, 41))
        assert reps == 1 and abs(2 * n**3 - flops) == best, flops


def test_burn_flops_on_cpu(monkeypatch):
    shapes = []
    mm = torch.mm

    def counted(a, b, **kwargs):
        shapes.append((tuple(a.shape), tuple(b.shape)))
        return mm(a, b, **kwargs)

    monkeypatch.setattr(torch, "mm", counted)
    seconds, rate = burn_flops(5e8, "cpu")
    n, reps = matmul_plan(5e8, "cpu")
    assert reps >= 1 and shapes == [((n, n), (n, n))] * (1 + reps)  # one untimed, then the timed ones
    assert seconds > 0 and rate == pytest.approx(reps * 2 * n**3 / seconds)
    with pytest.raises(ValueError, match="meta"):
        burn_flops(1e6, "meta")


@pytest.mark.gpu
def test_cuda_copies_and_flops():
    results = copies.copy_bandwidth(16 << 20, "cuda", iters=3, warmup=1, pcie_limit_gbps=1000.0)
    names = [r.name for r in results]
    assert names == [*copies.OVER_PCIE, copies.DEVICE_TO_DEVICE]
    for r in results:
        assert r.time_s > 0 and r.gbps > 0
        assert (r.limit_gbps == 1000.0) == (r.name in copies.OVER_PCIE)
    seconds, rate = burn_flops(1e10, torch.device("cuda"))
    n, reps = matmul_plan(1e10, "cuda")
    assert seconds > 0 and rate == pytest.approx(reps * 2 * n**3 / seconds)


@pytest.mark.gpu
def test_timing_events_are_made_before_they_are_handed_out():
    """torch makes an event on its first record: one made there, after the timed work, put its
    host call between the work and the stamp that ends it."""
    from commbench.kernels.events import timing_events

    fresh = torch.cuda.Event(enable_timing=True)
    assert fresh.cuda_event == 0  # torch's lazy making, which timing_events works around
    events = timing_events(3)
    assert len(events) == 3 and all(e.cuda_event != 0 and e.query() for e in events)


@pytest.mark.gpu
def test_copies_the_host_returns_from_early_are_queued_behind_a_spin(monkeypatch):
    """Each timed copy of a few KiB counted the host's launch of it, several times the device's
    copy: pinned and device copies are queued behind a spin; pageable ones wait for the device."""
    held = []
    hold = copies._hold_stream
    monkeypatch.setattr(copies, "_hold_stream", lambda seconds: (held.append(seconds), hold(seconds)))
    results = copies.cuda_copies(4 << 10, iters=5, warmup=1)
    assert [r.name for r in results] == [*copies.OVER_PCIE, copies.DEVICE_TO_DEVICE]
    assert len(held) == 3 and all(1e-3 < s < 1.0 for s in held), held
    assert all(r.time_s > 0 for r in results) and copies._cycles_per_s is not None


@pytest.mark.parametrize("queued", [True, False])
def test_queued_copies_go_behind_a_spin_a_batch_at_a_time(monkeypatch, queued):
    """Queued past what a stream holds, the host fed the copies one launch at a time and each was
    timed with its launch again: each spin holds at most QUEUED_CALLS timed copies, and the stream
    is drained before the next spin (stand-in events and spin; the real ones are gpu-marked above)."""
    log = []

    class Event:
        def record(self):
            log.append("event")

        def elapsed_time(self, other):
            return 2.0

    monkeypatch.setattr(copies, "timing_events", lambda n: [Event() for _ in range(n)])
    monkeypatch.setattr(copies, "_hold_stream", lambda seconds: log.append("spin"))
    monkeypatch.setattr(copies.torch.cuda, "synchronize", lambda: log.append("sync"))
    iters = 2 * copies.QUEUED_CALLS + 5
    times = copies._cuda_time(lambda: log.append("copy"), iters, 1, queued=queued)
    assert times == [2e-3] * iters
    assert log[:2] == ["copy", "sync"]  # the warm-up, drained
    batches = " ".join(log[2:]).split("sync")[:-1]
    assert "".join(log[2:]).endswith("sync")
    sizes = []
    for batch in batches:
        words = batch.split()
        assert (words[0] == "spin") == queued and "spin" not in words[1:]
        body = words[1:] if queued else words
        assert body == ["event", "copy", "event"] * (len(body) // 3)
        sizes.append(len(body) // 3)
    assert sum(sizes) == iters and max(sizes) <= copies.QUEUED_CALLS
