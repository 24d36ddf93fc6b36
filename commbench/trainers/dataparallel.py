"""Single-process data parallelism over the local GPUs: ``dp`` (nn.DataParallel) and ``vanilla-dp``.

``VanillaDataParallel`` is DataParallel made by hand from its four parts, so each can be timed:
replicate the module to every GPU (parameter broadcast), scatter the batch, run the replicas in
parallel, gather the outputs on the first GPU. Backward sums the replicas' gradients back onto
the first GPU through the autograd graph of ``replicate``. Both strategies need CUDA.

What is timed as communication: for ``vanilla-dp``, scatter with replicate and gather, in
forward; the gradients' reduction inside backward is not (it is backward time). For ``dp``
nothing: its copies run inside nn.DataParallel, so its comm time is reported as not measured.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import gather, parallel_apply, replicate, scatter

from commbench.trainers.sync import GradSync
from commbench.trainers.timing import Clock


class VanillaDataParallel(nn.Module):
    """DataParallel from replicate, scatter, parallel_apply and gather, with its copies timed."""

    def __init__(self, module: nn.Module, device_ids: list[int], clock: Clock) -> None:
        super().__init__()
        self.module, self.device_ids, self.clock = module, device_ids, clock
        self.intervals: list[tuple[Any, Any]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.device_ids) == 1:
            return self.module(x)
        t0 = self.clock.stamp()
        inputs = scatter(x, self.device_ids)
        replicas = replicate(self.module, self.device_ids[: len(inputs)])
        t1 = self.clock.stamp()
        outputs = parallel_apply(replicas, [(i,) for i in inputs])
        # Each replica ran on its device's current stream: the first device's waits for them all,
        # so the gather's interval starts once the slowest replica is done (a replica slower than
        # the first was counted as gather time: forward imbalance taken for communication).
        first = torch.cuda.current_stream(self.device_ids[0])
        for d in self.device_ids[1 : len(inputs)]:
            first.wait_stream(torch.cuda.current_stream(d))
        t2 = self.clock.stamp()
        out = gather(outputs, self.device_ids[0])
        self.intervals += [(t0, t1), (t2, self.clock.stamp())]
        return out


class DataParallelSync(GradSync):
    """``dp`` and ``vanilla-dp``: gradients end up summed on the first GPU by autograd itself."""

    def __init__(self, clock: Clock, strategy: str) -> None:
        super().__init__(clock)
        if not torch.cuda.is_available():
            raise ValueError(f"strategy {strategy} needs CUDA devices; none is available")
        self.name = strategy
        self.measures_comm = strategy == "vanilla-dp"
        self.module: VanillaDataParallel | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        ids = list(range(torch.cuda.device_count()))
        if self.name == "dp":
            return nn.DataParallel(model, device_ids=ids)
        self.module = VanillaDataParallel(model, ids, self.clock)
        return self.module

    def take_intervals(self) -> list[tuple[Any, Any]]:
        if self.module is not None:
            self._intervals, self.module.intervals = self.module.intervals, []
        return super().take_intervals()
