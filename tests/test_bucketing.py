"""Bucket assignment, byte accounting, interval arithmetic and pack/unpack, without a process group."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from commbench.comm.costmodel import cost
from commbench.kernels import pack, unpack
from commbench.trainers.bucketing import MiB, assign_buckets, grad_bytes_per_epoch, syncs_per_epoch
from commbench.trainers.timing import overlap_length, union_length

# the unpack checks on host and CUDA tensors (the addresses are compared on the host either way)
DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])


def test_buckets_follow_ddp_rule() -> None:
    # 4-byte elements: 1 MiB = 262144 elements. Registration order a, b, c, d; backward order d, c, b, a.
    numels = [100, 300_000, 5_000_000, 200_000]
    buckets = assign_buckets(numels, 4, cap_bytes=25 * MiB, first_cap_bytes=1 * MiB)
    assert [b.params for b in buckets] == [(3, 2), (1, 0)]
    assert buckets[0].size_bytes == (5_000_000 + 200_000) * 4
    assert [b.index for b in buckets] == [0, 1]


def test_first_bucket_smaller_and_big_parameter_alone() -> None:
    numels = [10] * 4 + [10_000_000]  # the last-registered parameter is 40 MB: alone, and first
    buckets = assign_buckets(numels, 4, cap_bytes=1000, first_cap_bytes=100)
    assert buckets[0].params == (4,)
    assert buckets[1].params == (3, 2, 1, 0)  # 160 bytes < 1000: one bucket, not closed at 100


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=40), st.integers(1, 20000), st.integers(1, 20000))
def test_buckets_cover_every_parameter_once(numels: list[int], cap: int, first: int) -> None:
    buckets = assign_buckets(numels, 2, cap_bytes=cap, first_cap_bytes=first)
    seen = [i for b in buckets for i in b.params]
    assert seen == list(reversed(range(len(numels))))
    for b in buckets:
        assert b.numel == sum(numels[i] for i in b.params)
        # A bucket closes as soon as it reaches its cap: without its last parameter it was below.
        limit = first if b.index == 0 else cap
        assert (b.numel - numels[b.params[-1]]) * 2 < limit
        if b.index < len(buckets) - 1:
            assert b.size_bytes >= limit


def test_a_bucket_closes_when_it_reaches_its_cap_exactly() -> None:
    """DDP closes a bucket once its size reaches the cap, not only once it passes it: four float32
    parameters of one element (4 bytes each) under caps of 8 bytes go two by two, the last
    registered first. A mutant closing a bucket only once it passed its cap went unnoticed: it
    put parameters 3, 2 and 1 together (12 bytes) and 0 alone."""
    buckets = assign_buckets([1, 1, 1, 1], 4, cap_bytes=8, first_cap_bytes=8)
    assert [b.params for b in buckets] == [(3, 2), (1, 0)]
    assert [b.size_bytes for b in buckets] == [8, 8]
    # the first bucket's own cap, reached exactly by one parameter: that one alone
    buckets = assign_buckets([1, 1, 1, 1], 4, cap_bytes=8, first_cap_bytes=4)
    assert [b.params for b in buckets] == [(3,), (2, 1), (0,)]


def test_bad_caps_rejected() -> None:
    with pytest.raises(ValueError, match="caps"):
        assign_buckets([1], 4, cap_bytes=0)
    with pytest.raises(ValueError, match="negative"):
        assign_buckets([-1], 4)


def test_syncs_and_grad_bytes_count_the_steps_the_loader_runs() -> None:
    # N = 60000, B = 1024, k = 4: 15000 samples a rank make 14 whole batches (ceil gave 15).
    assert syncs_per_epoch(60000, 1024, 4, None) == 14
    assert syncs_per_epoch(1000, 64, 2, None) == 7  # 8 counted, 7 run: grad bytes 14% over
    assert syncs_per_epoch(60000, 1024, 4, 10) == 10
    # a bound above the syncs changes nothing: 1000 // 2 = 500 samples a rank, 7 whole batches of 64
    assert syncs_per_epoch(1000, 64, 2, 100) == 7
    assert syncs_per_epoch(1000, 64, 2, 7) == 7
    assert grad_bytes_per_epoch(119586826, 4, 14) == 119586826 * 4 * 14
    with pytest.raises(ValueError):
        syncs_per_epoch(10, 0, 1, None)


@given(st.integers(0, 3000), st.integers(1, 300), st.integers(1, 8))
def test_syncs_per_epoch_is_the_loaders_length(samples: int, batch: int, world: int) -> None:
    """The training loop's loader: a DistributedSampler and a DataLoader, both dropping the rest."""
    from torch.utils.data import DataLoader, DistributedSampler

    data = range(samples)
    lengths = set()
    for rank in range(world):
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False, drop_last=True)
        lengths.add(len(DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True)))
    assert lengths == {syncs_per_epoch(samples, batch, world, None)}


def test_the_training_loops_loaders_drop_the_last_batch_and_share_the_test_split() -> None:
    """The loop's own loaders: 10 samples over 2 ranks are 5 a rank, one whole batch of 4 and a
    partial one dropped (a rank with one more step would wait forever); the held-out split is
    dealt out to the ranks, each sample to one rank and every sample to some rank."""
    from commbench.trainers.loop import TrainConfig, _dataset, _loaders

    config = TrainConfig(samples=10, batch_size=4, evaluate=True)
    train = _dataset(config, train=True)
    assert len(train) == 10
    shards = []
    for rank in range(2):
        train_loader, test_loader, sampler = _loaders(config, train, 4, 2, rank)
        assert len(sampler) == 5
        batches = list(train_loader)
        assert len(train_loader) == len(batches) == 1 and len(batches[0][1]) == 4
        assert test_loader is not None
        shards.append(list(test_loader.dataset.indices))
    held_out = _dataset(config, train=False)
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == list(range(len(held_out)))
    assert abs(len(shards[0]) - len(shards[1])) <= 1


def test_computed_wire_bytes_per_strategy() -> None:
    from commbench.trainers.loop import TrainConfig, computed_wire_bytes

    numels = [1000, 50_000, 300_000]
    config = TrainConfig(strategies=("bucketed",), bucket_cap_mb=1.0, first_bucket_mb=0.5)
    # The hand-written strategies send one flag a parameter beside the gradients (did it get one).
    ring = computed_wire_bytes("ring", 3, numels, 4, config)
    assert ring == list(cost("all_reduce", "ring", 3, sum(numels) + 3, 4).sent_bytes)
    naive = computed_wire_bytes("naive", 3, numels, 4, config)
    assert naive[0] == 2 * (sum(numels) + 3) * 4 and naive[1] == (sum(numels) + 3) * 4
    bucketed = computed_wire_bytes("bucketed", 3, numels, 4, config)
    ddp = computed_wire_bytes("ddp", 3, numels, 4, config)
    expected, expected_ddp = [0, 0, 0], [0, 0, 0]
    for b in assign_buckets(numels, 4, MiB, MiB // 2):
        for r, s in enumerate(cost("all_reduce", "builtin", 3, b.numel + len(b.params), 4).sent_bytes):
            expected[r] += s
        for r, s in enumerate(cost("all_reduce", "builtin", 3, b.numel, 4).sent_bytes):
            expected_ddp[r] += s
    assert bucketed == expected and ddp == expected_ddp
    # Ring priced per bucket moves about 2 (n-1)/n of the gradient bytes, like one big ring.
    assert sum(bucketed) == pytest.approx(sum(ring), rel=0.01)
    assert computed_wire_bytes("none", 1, numels, 4, config) == [0]
    assert computed_wire_bytes("dp", 1, numels, 4, config) is None
    # Every strategy that syncs over the network broadcasts the model's buffers from rank 0, as DDP does.
    broadcast = cost("broadcast", "builtin", 3, 4096, 1).sent_bytes
    for strategy in ("naive", "ring", "bucketed", "ddp"):
        plain = computed_wire_bytes(strategy, 3, numels, 4, config)
        with_buffers = computed_wire_bytes(strategy, 3, numels, 4, config, buffer_bytes=4096)
        assert with_buffers == [a + b for a, b in zip(plain, broadcast, strict=True)], strategy
        assert sum(with_buffers) - sum(plain) == 2 * 4096  # rank 0's buffers reach the other two


def test_union_and_overlap() -> None:
    intervals = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]
    assert union_length(intervals) == pytest.approx(4.0)
    assert union_length([]) == 0.0
    assert overlap_length(intervals, (1.5, 5.5)) == pytest.approx(2.0)
    assert overlap_length(intervals, (10.0, 11.0)) == 0.0


def test_pack_unpack_round_trip() -> None:
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2, 2)]
    flat = torch.empty(12 + 5 + 8)
    pack(tensors, flat)
    assert torch.equal(flat[:12], tensors[0].flatten())
    out = [torch.zeros_like(t) for t in tensors]
    unpack(flat, out)
    assert all(torch.equal(a, b) for a, b in zip(tensors, out, strict=True))
    with pytest.raises(ValueError, match="elements"):
        pack(tensors, torch.empty(3))


@pytest.mark.parametrize(
    "tensor,flat,needle",
    [
        (
            torch.ones(3, dtype=torch.float64),
            torch.empty(3),
            "tensor 0 is torch.float64 but the bucket is torch.float32",
        ),
        (torch.ones(3, dtype=torch.bfloat16), torch.empty(3), "convert it first"),
        (torch.ones(3, device="meta"), torch.empty(3), "tensor 0 is on meta but the bucket is on cpu"),
        (torch.ones(4), torch.empty(2, 2), "1-D, got shape \\(2, 2\\)"),
    ],
    ids=["float64", "bfloat16", "device", "2-D"],
)
def test_pack_and_unpack_neither_convert_nor_move(tensor, flat, needle) -> None:
    """A bucket of another dtype or device, or not flat, is refused before anything is copied."""
    before = tensor.clone()
    with pytest.raises(ValueError, match=needle):
        pack([tensor], flat)
    with pytest.raises(ValueError, match=needle):
        unpack(flat, [tensor])
    if tensor.device.type != "meta":
        assert torch.equal(tensor, before)


def test_a_sparse_tensor_is_refused_before_anything_is_copied() -> None:
    """The dense tensor before it was copied, then copy_ failed with a RuntimeError."""
    dense, sparse = torch.ones(3), torch.ones(4).to_sparse()
    flat = torch.zeros(7)
    with pytest.raises(ValueError, match="tensor 1 is torch.sparse_coo; only dense tensors"):
        pack([dense, sparse], flat)
    assert torch.equal(flat, torch.zeros(7))
    with pytest.raises(ValueError, match="tensor 1 is torch.sparse_coo"):
        unpack(torch.full((7,), 2.0), [dense, sparse])
    assert torch.equal(dense, torch.ones(3))
    with pytest.raises(ValueError, match="the bucket must be a dense tensor"):
        pack([dense], torch.zeros(3).to_sparse())


def test_views_of_the_bucket_only_as_their_own_slices() -> None:
    """Views of the bucket in another order were packed over one another without a word
    (out[2:4], out[0:2] into [0, 1, 2, 3] gave [2, 3, 2, 3])."""
    flat = torch.arange(4.0)
    pack([flat[0:2], flat[2:4]], flat)  # each its own slice: copied onto itself
    unpack(flat, [flat[0:2], flat[2:4]])
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0]
    for views in ([flat[2:4], flat[0:2]], [flat[1:3], torch.zeros(2)], [flat[0:4:2], flat[1:4:2]]):
        with pytest.raises(ValueError, match="shares memory with the bucket other than as its own slice"):
            pack(views, flat)
        with pytest.raises(ValueError, match="other than as its own slice"):
            unpack(flat, views)
        assert flat.tolist() == [0.0, 1.0, 2.0, 3.0]
    # a view that starts before the bucket in one allocation and reaches into it
    whole = torch.arange(8.0)
    with pytest.raises(ValueError, match="tensor 0 shares memory"):
        pack([whole[0:4].view(2, 2).t()], whole[3:7])
    # elsewhere in the bucket's allocation, not in the bucket: copied as any other tensor
    pack([whole[0:2], whole[6:8]], whole[2:6])
    assert whole.tolist() == [0.0, 1.0, 0.0, 1.0, 6.0, 7.0, 6.0, 7.0]
    # another storage over the same memory: two tensors over one buffer of 12 floats
    memory = bytearray(48)

    def floats(first: int, count: int) -> torch.Tensor:
        return torch.frombuffer(memory, dtype=torch.float32, count=count, offset=4 * first)

    floats(0, 12).copy_(torch.arange(12.0))
    flat = floats(4, 8)
    with pytest.raises(ValueError, match="tensor 0 shares memory"):
        pack([floats(0, 8)], flat)
    assert flat.tolist() == [float(i) for i in range(4, 12)]
    pack([floats(0, 4), floats(0, 4)], flat)  # beside it: copied as any other tensor
    assert floats(0, 12).tolist() == [float(i % 4) for i in range(12)]
    # meta tensors have no memory to share (every pointer is 0)
    pack([torch.empty(2, device="meta"), torch.empty(2, device="meta")], torch.empty(4, device="meta"))


def _inference(n: int) -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(n)


def test_any_iterable_is_packed_and_what_cannot_be_written_is_refused_before_a_copy() -> None:
    """A generator was used up by the check, so pack and unpack copied nothing without a word;
    unpack wrote the first tensor before a later one (expanded, or a leaf that requires grad)
    raised from inside copy_; a number in the list raised AttributeError."""
    out = torch.full((4,), -1.0)
    pack((t for t in [torch.ones(2), torch.full((2,), 2.0)]), out)
    assert out.tolist() == [1.0, 1.0, 2.0, 2.0]
    into = [torch.zeros(2), torch.zeros(2)]
    unpack(torch.arange(4.0), iter(into))
    assert [t.tolist() for t in into] == [[0.0, 1.0], [2.0, 3.0]]
    first = torch.zeros(2)
    for last, needle in (
        (torch.zeros(1).expand(2), "tensor 1 has elements over one another"),
        (torch.zeros(2, requires_grad=True), "tensor 1 is a leaf that requires grad"),
        (torch.zeros(4, requires_grad=True)[:2], "tensor 1 is a leaf that requires grad, or a view of one"),
        (_inference(2), "tensor 1 is an inference tensor"),
    ):
        with pytest.raises(ValueError, match=needle):
            unpack(torch.arange(4.0), [first, last])
        assert first.tolist() == [0.0, 0.0]
    with torch.no_grad():
        leaf = torch.zeros(2, requires_grad=True)
        unpack(torch.arange(4.0), [first, leaf])
    assert leaf.tolist() == [2.0, 3.0]
    with pytest.raises(TypeError, match="tensor 0 is a float, not a tensor"):
        pack([1.0], torch.empty(1))
    with pytest.raises(TypeError, match="the bucket must be a tensor, got list"):
        unpack([1.0], [torch.empty(1)])


@DEVICES
def test_tensors_unpacked_over_one_another_are_refused_before_a_copy(device) -> None:
    """Only expanded tensors were refused: two tensors over the same memory (z[0:2], z[1:3]; one
    tensor twice) or one whose strides put elements over each other (as_strided((2, 2), (1, 1)))
    took the later copy without a word ([0, 2, 3] for [0, 1] and [2, 3])."""
    flat = torch.arange(4.0, device=device)
    z = torch.zeros(4, device=device)
    for into, i in (
        ([z[0:2], z[1:3]], 1),
        ([z[2:4], z[:2], z[1:3]], 2),
        ([torch.zeros(2, device=device), z[:2], z[:2]], 2),
        ([z.as_strided((2, 2), (1, 1))], 0),
        ([torch.zeros(1, device=device), z[:3].as_strided((3,), (1,)), z[2:3]], 2),
        ([z[0::2], z[1:2], z[2:3]], 2),  # over the first, which the second lies inside of too
    ):
        with pytest.raises(ValueError, match=f"tensor {i} has elements over one another or over an earlier"):
            unpack(torch.arange(float(sum(t.numel() for t in into)), device=device), into)
        assert z.tolist() == [0.0, 0.0, 0.0, 0.0]
    # apart, though their address ranges cross or their strides interleave: copied
    for into, values in (
        ([z[0::2], z[1::2]], [0.0, 2.0, 1.0, 3.0]),
        ([z.as_strided((2, 2), (1, 2))], [0.0, 2.0, 1.0, 3.0]),
        ([z[:2], z[2:]], [0.0, 1.0, 2.0, 3.0]),
    ):
        unpack(flat, into)
        assert z.tolist() == values
    wide = torch.zeros(8, device=device)
    unpack(torch.arange(6.0, device=device), [wide.as_strided((3, 2), (2, 3))])  # offsets 0 3 2 5 4 7: apart
    assert wide.tolist() == [0.0, 0.0, 2.0, 1.0, 4.0, 3.0, 0.0, 5.0]


@DEVICES
def test_a_view_that_autograd_would_record_the_copy_in_is_refused_before_a_copy(device) -> None:
    """A view by unbind of a tensor that requires grad passed the checks and raised from inside
    copy_ after the tensors before it had been written; under no_grad it is written."""
    grown = torch.randn(4, device=device, requires_grad=True) * 1  # not a leaf
    first = torch.zeros(2, device=device)
    for last, needle in (
        (grown.unbind(0)[0].view(1), "tensor 1 is a tensor that requires grad, or a view of one"),
        (grown[:1], "tensor 1 is a tensor that requires grad, or a view of one"),
        (grown.detach().requires_grad_()[:1] * 1, "tensor 1 is a tensor that requires grad;"),
    ):
        with pytest.raises(ValueError, match=needle):
            unpack(torch.arange(3.0, device=device), [first, last])
        assert first.tolist() == [0.0, 0.0]
    with torch.no_grad():
        part = grown.unbind(0)[3].view(1)
        unpack(torch.arange(3.0, device=device), [first, part])
    assert first.tolist() == [0.0, 1.0] and grown[3].item() == 2.0


def test_a_strided_bucket_is_refused() -> None:
    """The overlap check counts a bucket's elements as adjacent: in big[::2] it missed big[4:5]
    (packed after big[4] was overwritten: [10, 11, 12, 12]) and refused each slice copied onto
    itself. Buckets are contiguous, as the collectives that carry them require."""
    big = torch.arange(8.0)
    for call in (
        lambda: pack([torch.tensor([10.0, 11.0, 12.0]), big[4:5]], big[::2]),
        lambda: unpack(big[::2], [torch.zeros(2), torch.zeros(2)]),
    ):
        with pytest.raises(ValueError, match="the bucket must be contiguous, got stride 2"):
            call()
    assert big.tolist() == [float(i) for i in range(8)]


def test_a_model_of_mixed_dtypes_is_refused_before_its_first_step():
    """Its gradients were packed into the first parameter's dtype (a float16 bucket rounded the
    float32 ones); the kernels now refuse that mid-backward, so the sync says so at wrap."""
    from torch import nn

    from commbench.trainers import sync

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    assert sync.packable(model) == list(model.parameters())
    model[1].half()
    with pytest.raises(
        ValueError, match=r"parameters are float16 on cpu, float32 on cpu \(ddp takes them\)$"
    ):
        sync.packable(model)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        sync.packable(model)


def test_a_bucket_of_another_size_is_refused_either_way() -> None:
    """pack and unpack refuse a bucket with more elements than the tensors as well as fewer,
    and say both counts."""
    with pytest.raises(ValueError, match="bucket holds 3 elements, tensors have 2"):
        pack([torch.ones(2)], torch.empty(3))
    with pytest.raises(ValueError, match="bucket holds 3 elements, tensors have 2"):
        unpack(torch.zeros(3), [torch.zeros(2)])
    with pytest.raises(ValueError, match="bucket holds 1 elements, tensors have 2"):
        unpack(torch.zeros(1), [torch.zeros(2)])
