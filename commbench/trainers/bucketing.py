"""Which gradients share a bucket, and what the gradient traffic of a run adds up to.

Pure logic, no process group: tested on its own. Buckets follow DistributedDataParallel's
rule: parameters in reverse registration order (roughly the order backward produces their
gradients), a bucket closes once it reaches its cap, the first bucket has a smaller cap so the
first allreduce starts early, and a parameter larger than the cap closes the bucket it joins
(it shares that bucket with the smaller ones before it, as in DDP).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MiB = 1 << 20
DEFAULT_CAP_BYTES = 25 * MiB
DEFAULT_FIRST_CAP_BYTES = 1 * MiB
MAX_CAP_MB = float(1 << 20)  # 1 TiB: far past any model, and its bytes still a C++ int64 for DDP


@dataclass(frozen=True, kw_only=True)
class Bucket:
    """Parameter indices (registration order) and the bucket's size."""

    index: int
    params: tuple[int, ...]
    numel: int
    size_bytes: int


def assign_buckets(
    numels: Sequence[int],
    itemsize: int,
    cap_bytes: int = DEFAULT_CAP_BYTES,
    first_cap_bytes: int = DEFAULT_FIRST_CAP_BYTES,
) -> list[Bucket]:
    """Group parameters (given by element count, in registration order) into buckets.

    Returns buckets in launch order; bucket 0 holds the last-registered parameters.
    """
    if cap_bytes <= 0 or first_cap_bytes <= 0:
        raise ValueError(f"bucket caps must be > 0 bytes, got {cap_bytes} and {first_cap_bytes}")
    if itemsize <= 0:
        raise ValueError(f"itemsize must be > 0, got {itemsize}")
    buckets: list[Bucket] = []
    current: list[int] = []
    numel = 0

    def close() -> None:
        nonlocal current, numel
        if current:
            buckets.append(
                Bucket(index=len(buckets), params=tuple(current), numel=numel, size_bytes=numel * itemsize)
            )
        current, numel = [], 0

    for i in reversed(range(len(numels))):
        if numels[i] < 0:
            raise ValueError(f"parameter {i} has a negative element count {numels[i]}")
        current.append(i)
        numel += numels[i]
        cap = first_cap_bytes if not buckets else cap_bytes
        if numel * itemsize >= cap:
            close()
    close()
    return buckets


def syncs_per_epoch(num_samples: int, batch_size: int, world_size: int, steps_per_epoch: int | None) -> int:
    """Gradient syncs in one epoch, the steps the loop's loader runs: floor(floor(N / k) / B), which
    is floor(N / (B x k)), bounded by ``steps_per_epoch``.

    Every rank takes the same number of steps, so the sampler drops the samples that do not
    divide among the ranks and the loader each rank's last partial batch (the studies' N / (B x k)
    rounded down, not up).
    """
    if batch_size < 1 or world_size < 1:
        raise ValueError(f"batch size and world size must be >= 1, got {batch_size} and {world_size}")
    syncs = num_samples // world_size // batch_size
    return syncs if steps_per_epoch is None else min(syncs, steps_per_epoch)


def grad_bytes_per_epoch(trainable: int, itemsize: int, syncs: int) -> int:
    """Gradient bytes each rank contributes per epoch: trainable parameters x element size x syncs."""
    return trainable * itemsize * syncs
