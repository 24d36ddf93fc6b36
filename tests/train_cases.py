"""What the ranks of a training test world run (see tests/world.py). Each case returns plain data."""

from __future__ import annotations

from typing import Any

import torch

from commbench.trainers.loop import TrainConfig, Trainer, run_rank
from commbench.trainers.models import build_model


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
    tensors (a large model's would not fit through the store)."""
    config = TrainConfig(**case["config"])
    final: dict[str, list[torch.Tensor]] = {}
    buffers: dict[str, list[torch.Tensor]] = {}
    epochs: list[dict[str, Any]] = []

    def keep(trainers: list[Trainer]) -> None:
        for tr in trainers:
            final[tr.strategy] = [p.detach().clone() for p in tr.base.parameters()]
            buffers[tr.strategy] = [b.detach().clone() for b in tr.base.buffers()]

    summaries = run_rank(config, torch.device("cpu"), lambda r: epochs.append(r.__dict__), None, keep)
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
