"""What the ranks of a training test world run (see tests/world.py). Each case returns plain data."""

from __future__ import annotations

from typing import Any

import torch

from commbench.trainers.loop import TrainConfig, Trainer, run_rank
from commbench.trainers.models import build_model

# A short run of a model with BatchNorm (vgg11 has eight BatchNorm2d) for the train tests'
# configurations: three steps of 8 images of 8x8, several buckets.
BATCHNORM_RUN: dict[str, Any] = dict(
    model="vgg11",
    model_options=(("input_shape", (3, 8, 8)),),
    samples=64,
    batch_size=8,
    steps_per_epoch=3,
    epochs=1,
    bucket_cap_mb=8.0,
    first_bucket_mb=1.0,
)


def initial_parameters(config: TrainConfig) -> list[torch.Tensor]:
    """The parameters every trainer starts from: the model built after seeding, as Trainer does."""
    torch.manual_seed(config.seed)
    model = build_model(config.model, **{**dict(config.model_options), "input_shape": config.input_shape()})
    return [p.detach().clone() for p in model.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((float((x.double() - y.double()).abs().max()) for x, y in zip(a, b, strict=True)), default=0.0)


def run_train_case(case: dict[str, Any]) -> Any:
    """Train ``case['config']``; return the initial parameters, each strategy's final parameters
    and buffers, the epoch records and the summaries. With ``case['diff_against']`` naming a
    strategy, each strategy's largest parameter and buffer difference from it replaces the
    tensors (a large model's would not fit through the store). ``case['device']`` ("cpu" unless
    given) is where each rank trains; tensors come back on the host."""
    if "sync" in case:
        return run_sync_case(case)
    if "buffers_of" in case:
        return run_subgroup_buffers_case(case)
    config = TrainConfig(**case["config"])
    device = torch.device(case.get("device", "cpu"))
    final: dict[str, list[torch.Tensor]] = {}
    buffers: dict[str, list[torch.Tensor]] = {}
    epochs: list[dict[str, Any]] = []

    def keep(trainers: list[Trainer]) -> None:
        for tr in trainers:
            final[tr.strategy] = [p.detach().to("cpu", copy=True) for p in tr.base.parameters()]
            buffers[tr.strategy] = [b.detach().to("cpu", copy=True) for b in tr.base.buffers()]

    summaries = run_rank(config, device, lambda r: epochs.append(r.__dict__), None, keep)
    summaries = [s.__dict__ for s in summaries]
    ref = case.get("diff_against")
    if ref is not None:
        return {
            "param_diff": {s: _max_diff(final[s], final[ref]) for s in final},
            "buffer_diff": {s: _max_diff(buffers[s], buffers[ref]) for s in buffers},
            "buffer_count": len(buffers[ref]),
            "epochs": epochs,
            "summaries": summaries,
        }
    start = initial_parameters(config)
    return {
        "initial": start,
        "params": final,
        "buffers": buffers,
        "epochs": epochs,
        "summaries": summaries,
    }


def _net(width: int = 5) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.ReLU(), torch.nn.Linear(width, 3))


class _Shaped(torch.nn.Module):
    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _Kept(torch.nn.Module):
    """A parameter, and five zeros kept as another or as a buffer: the same shape and dtype either way."""

    def __init__(self, as_buffer: bool) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(3))
        if as_buffer:
            self.register_buffer("weight", torch.zeros(5))
        else:
            self.weight = torch.nn.Parameter(torch.zeros(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def run_subgroup_buffers_case(case: dict[str, Any]) -> list[float]:
    """:func:`commbench.trainers.sync.broadcast_buffers` within the group of the global ranks
    ``case['buffers_of']``, every rank's buffer its own rank; returns each rank's buffer after."""
    import torch.distributed as dist

    from commbench.trainers.sync import broadcast_buffers

    rank, ranks = dist.get_rank(), case["buffers_of"]
    group = dist.new_group(ranks)  # every rank takes part in making it
    model = torch.nn.Module()
    model.register_buffer("stat", torch.full((3,), float(rank)))
    try:
        if rank in ranks:
            broadcast_buffers(model, group)
    finally:
        dist.destroy_process_group(group)
    return model.stat.tolist()


def run_sync_case(case: dict[str, Any]) -> Any:
    """A gradient sync used as a library (commbench.trainers.sync), beside DDP in the same world.

    ``case['sync']`` names the strategy; ``case['kind']``:
    - "accumulate": two backwards before one after_backward, ``before_backward`` before each
      (``case['each']``) or only the first; returns the largest difference of the gradients from
      DDP's after the same two backwards, or the error's text.
    - "start": each rank builds its model from a seed of its own; returns its parameters after wrap.
    - "mismatch": rank 1's model differs from rank 0's (``case['how']``: "wider", "transposed"
      (as many elements, another shape), "dtype", "buffer" (rank 0's parameter is rank 1's buffer));
      returns the error's text.
    The models, batches and the sync's clock are on ``case['device']`` ("cpu" unless given).
    """
    import torch.distributed as dist

    from commbench.trainers.sync import make_sync
    from commbench.trainers.timing import Clock

    rank = dist.get_rank()
    device = torch.device(case.get("device", "cpu"))
    sync = make_sync(case["sync"], Clock(device), cap_bytes=64, first_cap_bytes=32)
    try:
        if case["kind"] == "start":
            torch.manual_seed(100 + rank)
            model = _net().to(device)
            sync.wrap(model)
            return [p.detach().to("cpu", copy=True) for p in model.parameters()]
        if case["kind"] == "mismatch":
            model = {
                "wider": lambda: _net(5 + rank),  # sizes differ
                "transposed": lambda: _Shaped((6, 6) if rank == 0 else (4, 9)),  # 36 elements either way
                "dtype": lambda: _net().to(torch.float64 if rank == 1 else torch.float32),
                "buffer": lambda: _Kept(as_buffer=rank == 1),
            }[case["how"]]().to(device)
            try:
                sync.wrap(model)
            except ValueError as exc:
                return str(exc)
            return "wrapped"
        torch.manual_seed(0)
        model, reference = _net().to(device), _net().to(device)
        reference.load_state_dict(model.state_dict())
        ddp = torch.nn.parallel.DistributedDataParallel(reference)
        module = sync.wrap(model)
        batches = [
            torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * rank + m)).to(device)
            for m in range(2)
        ]
        for x in batches:
            ddp(x).square().sum().backward()
        try:
            for micro, x in enumerate(batches):
                sync.before_forward()
                loss = module(x).square().sum()
                if case["each"] or micro == 0:
                    sync.before_backward()
                loss.backward()
            sync.after_backward()
        except RuntimeError as exc:
            return str(exc)
        return _max_diff([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()])
    finally:
        sync.close()
