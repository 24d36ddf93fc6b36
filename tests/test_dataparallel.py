"""Single-process data parallelism (commbench.trainers.dataparallel) on CPU: torch's replicate,
scatter, parallel_apply, gather and CUDA streams replaced by stand-ins that record what they are
asked, so what is checked is which devices each step uses and what is timed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from commbench.trainers import dataparallel
from commbench.trainers.dataparallel import DataParallelSync, VanillaDataParallel
from commbench.trainers.timing import Clock

CPU = Clock(torch.device("cpu"))


class _Stream:
    def __init__(self, device: int, seen: list[Any]) -> None:
        self.device, self.seen = device, seen

    def wait_stream(self, other: _Stream) -> None:
        self.seen.append(("wait", self.device, other.device))


def _fake_parts(monkeypatch, seen: list[Any]) -> None:
    """Stand-ins for torch's four parts and current_stream, recording their calls in ``seen``."""

    def scatter(x: torch.Tensor, ids: list[int]) -> tuple[torch.Tensor, ...]:
        seen.append(("scatter", list(ids)))
        return x.chunk(len(ids))  # as torch: no more chunks than rows

    def replicate(module: nn.Module, ids: list[int]) -> list[nn.Module]:
        seen.append(("replicate", list(ids)))
        return [module] * len(ids)

    def parallel_apply(replicas: list[nn.Module], inputs: list[tuple]) -> list[torch.Tensor]:
        seen.append(("parallel_apply", len(replicas)))
        assert len(replicas) == len(inputs)  # as torch's
        return [m(*i) for m, i in zip(replicas, inputs, strict=True)]

    def gather(outputs: list[torch.Tensor], target: int) -> torch.Tensor:
        seen.append(("gather", target))
        return torch.cat(outputs)

    for name, fn in [
        ("scatter", scatter),
        ("replicate", replicate),
        ("parallel_apply", parallel_apply),
        ("gather", gather),
    ]:
        monkeypatch.setattr(dataparallel, name, fn)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(device, seen))


class _Clock:
    def __init__(self, seen: list[Any]) -> None:
        self.seen = seen

    def stamp(self) -> int:
        self.seen.append("stamp")
        return len(self.seen)


def test_vanilla_dp_uses_only_as_many_devices_as_the_batch_fills_and_gathers_on_the_first(monkeypatch):
    """A batch of 2 over devices [0, 1, 2] is scattered in two: the module is replicated to 0 and
    1 only, the first device's stream waits for the second's (not the idle third's) before the
    outputs are gathered on device 0, and two intervals are timed: scatter with replicate, and
    gather."""
    seen: list[Any] = []
    _fake_parts(monkeypatch, seen)
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    x = torch.randn(2, 3)
    vanilla = VanillaDataParallel(module, [0, 1, 2], _Clock(seen))
    torch.testing.assert_close(vanilla(x), module(x))
    assert seen == [
        "stamp",
        ("scatter", [0, 1, 2]),
        ("replicate", [0, 1]),
        "stamp",
        ("parallel_apply", 2),
        ("wait", 0, 1),
        "stamp",
        ("gather", 0),
        "stamp",
    ]
    stamps = [i + 1 for i, step in enumerate(seen) if step == "stamp"]
    assert vanilla.intervals == [(stamps[0], stamps[1]), (stamps[2], stamps[3])]


def test_vanilla_dp_on_one_device_runs_the_module_with_no_copies(monkeypatch):
    seen: list[Any] = []
    _fake_parts(monkeypatch, seen)
    module = nn.Linear(3, 2)
    x = torch.randn(2, 3)
    vanilla = VanillaDataParallel(module, [0], _Clock(seen))
    torch.testing.assert_close(vanilla(x), module(x))
    assert seen == [] and vanilla.intervals == []


def test_vanilla_dp_wraps_the_model_over_every_gpu_and_hands_its_intervals_over_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    grad_sync = DataParallelSync(CPU, "vanilla-dp")
    model = nn.Linear(2, 2)
    wrapped = grad_sync.wrap(model)
    assert isinstance(wrapped, VanillaDataParallel) and wrapped is grad_sync.module
    assert wrapped.module is model and wrapped.device_ids == [0, 1]
    wrapped.intervals += [(1.0, 2.0), (3.0, 4.0)]
    assert grad_sync.take_intervals() == [(1.0, 2.0), (3.0, 4.0)]
    assert grad_sync.take_intervals() == []  # each step's intervals are handed over once


@pytest.mark.parametrize("strategy", ["dp", "vanilla-dp"])
def test_data_parallel_without_cuda_is_refused(monkeypatch, strategy):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=rf"strategy {strategy} needs CUDA devices; none is available"):
        DataParallelSync(CPU, strategy)
