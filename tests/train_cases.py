"""What the ranks of a training test world run (see tests/world.py). Each case returns plain data."""

from __future__ import annotations

from typing import Any

import torch

from commbench.trainers.loop import TrainConfig, Trainer, run_rank


def run_train_case(case: dict[str, Any]) -> Any:
    """Train ``case['config']``; return each strategy's final parameters and the summaries."""
    config = TrainConfig(**case["config"])
    final: dict[str, list[torch.Tensor]] = {}

    def keep(trainers: list[Trainer]) -> None:
        for tr in trainers:
            final[tr.strategy] = [p.detach().clone() for p in tr.base.parameters()]

    summaries = run_rank(config, torch.device("cpu"), lambda r: None, None, keep)
    return {"params": final, "summaries": [s.__dict__ for s in summaries]}
