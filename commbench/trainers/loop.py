"""The training loop: data, forward, loss, backward, gradient sync, optimizer step, timed.

``Trainer`` is one strategy's model, optimizer and sync; ``Trainer.step`` is the textbook step
with a stamp between phases. ``run_rank`` drives one or several trainers from the same batches:
with several (``commbench compare``) their steps are interleaved, step by step, so every
strategy sees the same data and the same machine conditions. Each trainer keeps its own random
state, so interleaving changes nothing in what it computes.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from commbench.comm import p2p
from commbench.comm.costmodel import cost
from commbench.trainers import sync as sync_mod
from commbench.trainers.bucketing import (
    MAX_CAP_MB,
    MiB,
    assign_buckets,
    grad_bytes_per_epoch,
    syncs_per_epoch,
)
from commbench.trainers.timing import Clock, overlap_length, union_length

LR_SCALINGS = ("none", "linear")
PHASES = ("data", "forward", "backward", "exposed_comm", "optimizer", "step", "comm", "hidden_comm")


SEED_LIMIT = 1 << 32
MAX_EPOCHS = 1_000_000  # as a sweep's iterations: past it a run is a typo, not a measurement
# The optimizer scales float32 gradients by the learning rate: past float32's largest it cannot
# (torch: "value cannot be converted to type float without overflow", from a rank).
MAX_LR = float(torch.finfo(torch.float32).max)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run (``train``) or several strategies side by side (``compare``)."""

    strategies: tuple[str, ...] = ("ddp",)
    model: str = "mlp"
    model_options: tuple[tuple[str, Any], ...] = ()
    dataset: str = "synthetic"
    data_dir: str | None = None
    replicate: int = 1
    samples: int | None = None
    epochs: int = 1
    steps_per_epoch: int | None = None
    batch_size: int = 64
    global_batch: int | None = None  # split over the ranks (each takes its floor share); overrides batch_size
    lr: float = 0.01
    momentum: float = 0.9
    lr_scaling: str = "none"
    reference_batch: int | None = None
    seed: int = 0
    loss_threshold: float | None = None
    transport: str = "backend"
    bucket_cap_mb: float = 25.0
    first_bucket_mb: float = 1.0
    evaluate: bool = True
    probe: bool = True
    probe_interval_s: float = 0.1
    json_path: str | None = None
    plot_path: str | None = None
    quiet: bool = False

    def __post_init__(self) -> None:
        from commbench.trainers.data import DATASETS, data_shape
        from commbench.trainers.models import MODELS, check_model_options

        if not self.strategies:
            raise ValueError("no strategies given")
        for s in self.strategies:
            if s not in sync_mod.STRATEGIES:
                raise ValueError(f"unknown strategy {s!r}; choose from {', '.join(sync_mod.STRATEGIES)}")
        if len(set(self.strategies)) != len(self.strategies):
            raise ValueError(f"strategy listed twice in {','.join(self.strategies)}")
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}; choose from {', '.join(MODELS)}")
        check_model_options(self.model, **dict(self.model_options))
        if self.dataset not in DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r}; choose from {', '.join(DATASETS)}")
        if self.dataset != "synthetic" and not self.data_dir:
            raise ValueError(f"dataset {self.dataset} is read from disk: give --data-dir")
        if self.dataset == "synthetic" and self.data_dir:
            on_disk = " or ".join(d for d in DATASETS if d != "synthetic")
            raise ValueError(
                f"--data-dir is read for a dataset on disk (--dataset {on_disk}); synthetic data is generated"
            )
        shape = dict(self.model_options).get("input_shape")
        if self.dataset != "synthetic" and shape is not None and tuple(shape) != data_shape(self.dataset):
            # the images keep their own shape: the option would go unused, though the header records it
            raise ValueError(
                f"model option input_shape={','.join(map(str, shape))} shapes synthetic images; "
                f"{self.dataset}'s are {'x'.join(map(str, data_shape(self.dataset)))}"
                " (a torchvision backbone resizes them with image_size=)"
            )
        for name in ("replicate", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.epochs > MAX_EPOCHS:
            raise ValueError(f"epochs must be <= {MAX_EPOCHS}, got {self.epochs}")
        if self.batch_size < 0:
            raise ValueError(f"batch size must be >= 1 (or 0 to search the largest), got {self.batch_size}")
        for name in ("steps_per_epoch", "samples", "reference_batch", "global_batch"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be >= 1, got {value}")
        for name in ("lr", "bucket_cap_mb", "first_bucket_mb"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name.replace('_', ' ')} must be a finite number > 0, got {value}")
        if self.lr > MAX_LR:
            raise ValueError(
                f"lr must be at most {MAX_LR:.4g} (float32's largest, the gradients' type), got {self.lr}"
            )
        for name in ("bucket_cap_mb", "first_bucket_mb"):  # used as whole bytes
            if int(getattr(self, name) * MiB) < 1:
                raise ValueError(
                    f"{name.replace('_', ' ')} must be at least 1 byte, got {getattr(self, name)} MiB"
                )
            if getattr(self, name) > MAX_CAP_MB:
                raise ValueError(
                    f"{name.replace('_', ' ')} must be at most {MAX_CAP_MB:.0f} MiB (1 TiB), "
                    f"got {getattr(self, name)} MiB"
                )
        if "ddp" in self.strategies:
            caps = int(self.bucket_cap_mb * MiB), int(self.first_bucket_mb * MiB)
            refusal = sync_mod.ddp_bucket_refusal(*caps)
            if refusal is not None:
                raise ValueError(refusal)
        if not (0 <= self.momentum < 1):
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.lr_scaling not in LR_SCALINGS:
            raise ValueError(f"unknown lr scaling {self.lr_scaling!r}; choose from {', '.join(LR_SCALINGS)}")
        if self.transport not in sync_mod.TRANSPORTS:
            raise ValueError(
                f"unknown transport {self.transport!r}; choose from {', '.join(sync_mod.TRANSPORTS)}"
            )
        if self.transport != "backend" and "bucketed" not in self.strategies:
            raise ValueError(
                f"--transport {self.transport} is the bucketed strategy's, which is not among "
                f"{','.join(self.strategies)}"
            )
        if self.loss_threshold is not None and not (
            math.isfinite(self.loss_threshold) and self.loss_threshold > 0
        ):
            # a cross-entropy loss is above 0: a threshold at or below it is never reached
            raise ValueError(f"loss threshold must be a finite number > 0, got {self.loss_threshold}")
        if not 0 <= self.seed < SEED_LIMIT:  # each rank seeds seed * 1000 + rank: it must stay an int64
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed}")

    def input_shape(self) -> tuple[int, ...]:
        """(C, H, W) of the images: the dataset's own, or for synthetic data the model's
        ``input_shape`` option or default."""
        from commbench.trainers.data import data_shape
        from commbench.trainers.models import default_input_shape

        requested = dict(self.model_options).get("input_shape", default_input_shape(self.model))
        return tuple(data_shape(self.dataset, requested))

    def effective_lr(self, batch_size: int, world_size: int) -> float:
        """The learning rate after scaling with the global batch (linear rule) if asked for."""
        if self.lr_scaling == "none":
            return self.lr
        # A global batch is the batch the lr goes with: it stays put as ranks are added.
        reference = self.reference_batch or self.global_batch or batch_size
        return self.lr * batch_size * world_size / reference


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpochRecord:
    """One strategy's epoch. Times are medians over the epoch's steps of the ranks' mean."""

    strategy: str
    world_size: int
    epoch: int
    first_epoch: bool
    steps: int
    samples: int
    time_s: float
    cumulative_time_s: float
    images_per_s: float
    loss: float
    eval_loss: float | None
    accuracy: float | None
    step_time_ms: float
    data_ms: float
    forward_ms: float
    backward_ms: float
    exposed_comm_ms: float
    optimizer_ms: float
    comm_ms: float | None  # None: the strategy's communication is not measured (dp)
    hidden_comm_fraction: float | None
    step_losses: list[float]
    # Interface bytes per step counted around this strategy's steps (``--probe``); None if not measured.
    computed_wire_bytes: int | None = None
    measured_wire_bytes: int | None = None
    wire_bytes_ratio: float | None = None
    wire_expected_ratio: float | None = None
    wire_check: str | None = None
    hosts: list[dict] | None = None
    type: str = "epoch"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainSummary:
    """One strategy over the whole run; the headline numbers of ``commbench compare``."""

    strategy: str
    world_size: int
    backend: str
    device: str
    model: str
    dataset: str
    batch_size: int
    global_batch: int
    lr: float
    transport: str | None
    epochs: int
    steps_timed: int
    step_time_ms: float
    data_ms: float
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    compute_ms: float
    comm_ms: float | None  # None: the strategy's communication is not measured (dp)
    exposed_comm_ms: float
    hidden_comm_fraction: float | None
    images_per_s: float
    first_epoch_time_s: float
    later_epoch_time_s: float | None
    final_loss: float
    final_accuracy: float | None
    loss_threshold: float | None
    epochs_to_threshold: int | None
    time_to_threshold_s: float | None
    trainable_params: int
    buckets: int | None
    syncs_per_epoch: int
    grad_bytes_per_epoch: int
    wire_bytes_per_rank_per_epoch: list[int] | None
    step_time_ratio_to_ddp: float | None
    samples: int | None = None  # the training set's size: a whole pass is samples // global batch syncs
    wire_recv_bytes_per_rank_per_epoch: list[int] | None = None  # as sent, but received
    type: str = "train_summary"


def wire_bytes_per_sync(
    strategy: str,
    world: int,
    numels: Sequence[int],
    itemsize: int,
    config: TrainConfig,
    buffer_bytes: int = 0,
    backend: str | None = None,
) -> tuple[list[int], list[int]] | None:
    """Each rank's (sent, received) bytes per sync for ``strategy``, from the cost model; None where
    the strategy's traffic is not modelled (dp and vanilla-dp move data over the local bus).

    ``buffer_bytes``: the model's buffers (BatchNorm statistics), which ddp and the hand-written
    strategies broadcast from rank 0 before every forward in training, as DistributedDataParallel
    does by default. The hand-written strategies' allreduces carry one element more a parameter
    (whether it got a gradient: ``sync._pack_with_flags``). ``backend``: the one that moves the
    gradients, whose own allreduce (ddp, bucketed over the backend) and broadcast (the buffers, by
    ``dist.broadcast`` here and DDP's ``_broadcast_coalesced``) are priced as it runs them."""
    total = sum(numels)
    if strategy in ("naive", "ring", "bucketed", "ddp"):
        flag = int(strategy != "ddp")
        if strategy in ("naive", "ring"):
            calls = [cost("all_reduce", strategy, world, total + flag * len(numels), itemsize)]
        else:
            algorithm = "ring" if strategy == "bucketed" and config.transport == "ring" else "builtin"
            buckets = assign_buckets(
                numels, itemsize, int(config.bucket_cap_mb * MiB), int(config.first_bucket_mb * MiB)
            )
            calls = [
                cost("all_reduce", algorithm, world, n, itemsize, backend=backend)
                for n in (b.numel + flag * len(b.params) for b in buckets)
            ]
        if buffer_bytes:
            calls.append(cost("broadcast", "builtin", world, buffer_bytes, 1, backend=backend))
        sent, recv = [0] * world, [0] * world
        for c in calls:
            sent = [x + y for x, y in zip(sent, c.sent_bytes, strict=True)]
            recv = [x + y for x, y in zip(recv, c.recv_bytes, strict=True)]
        return sent, recv
    if strategy == "none":
        return [0] * world, [0] * world
    return None


def computed_wire_bytes(*args: Any, **kwargs: Any) -> list[int] | None:
    """Each rank's bytes sent per sync: the first half of :func:`wire_bytes_per_sync` with the same
    arguments (None: not modelled)."""
    both = wire_bytes_per_sync(*args, **kwargs)
    return None if both is None else both[0]


class Trainer:
    """One strategy: model, optimizer, loss and gradient sync, stepping on batches it is given."""

    def __init__(
        self,
        config: TrainConfig,
        strategy: str,
        input_shape: tuple[int, ...],
        device: torch.device,
        batch_size: int,
    ) -> None:
        from commbench.trainers.models import build_model

        self.strategy, self.device, self.config = strategy, device, config
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # the backend that moves this trainer's tensors: the cost model prices its builtins by it
        self.backend = p2p.backend_for(None, device) if dist.is_initialized() else None
        torch.manual_seed(config.seed)  # the same initial model on every rank and for every strategy
        options = {**dict(config.model_options), "input_shape": input_shape}
        model = build_model(config.model, **options).to(device)
        self.base = model
        self.params = sync_mod.trainable(model)
        if not self.params:
            raise ValueError(f"model {config.model} has no trainable parameters")
        # a stamp per gradient, the step's five and the sync's (topped up after a step that took more)
        self.clock = Clock(device, stamps_per_step=len(self.params) + 16)
        self.numels = [p.numel() for p in self.params]
        self.itemsize = self.params[0].element_size()
        self.buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
        self.last_grad: Any = None
        for p in self.params:  # registered before the sync's hooks, so it runs first
            p.register_post_accumulate_grad_hook(self._grad_done)
        self.sync = sync_mod.make_sync(
            strategy,
            self.clock,
            transport=config.transport,
            cap_bytes=int(config.bucket_cap_mb * MiB),
            first_cap_bytes=int(config.first_bucket_mb * MiB),
        )
        self.module = self.sync.wrap(model)
        self.lr = config.effective_lr(batch_size, self.world)
        self.optimizer = torch.optim.SGD(self.params, lr=self.lr, momentum=config.momentum)
        self.loss_fn = nn.CrossEntropyLoss()
        rank = dist.get_rank() if dist.is_initialized() else 0
        # Dropout draws from this trainer's own random state, swapped in for its steps only.
        self.rng = torch.Generator().manual_seed(config.seed * 1000 + rank).get_state()
        self.cuda_rng = None
        if device.type == "cuda":
            with torch.random.fork_rng(devices=[device]):
                torch.cuda.manual_seed(config.seed * 1000 + rank)
                self.cuda_rng = torch.cuda.get_rng_state(device)
        self.times: list[list[float]] = []
        self.losses: list[torch.Tensor] = []

    def _swap_rng(
        self, cpu: torch.Tensor, cuda: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Install the given random states; return the ones they replace."""
        old = torch.get_rng_state(), (torch.cuda.get_rng_state(self.device) if cuda is not None else None)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)
        return old

    def _grad_done(self, param: torch.Tensor) -> None:
        self.last_grad = self.clock.stamp()

    def step(self, x: torch.Tensor, y: torch.Tensor, data_s: float) -> None:
        """One training step on the batch (x, y); its phase times are kept for the epoch's record."""
        saved = self._swap_rng(self.rng, self.cuda_rng)
        clock = self.clock
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        t0 = clock.stamp()
        self.sync.before_forward()
        loss = self.loss_fn(self.module(x), y)
        t1 = clock.stamp()
        self.last_grad = None
        self.sync.before_backward()
        loss.backward()
        t2 = clock.stamp()
        self.sync.after_backward()
        t3 = clock.stamp()
        self.optimizer.step()
        t4 = clock.stamp()
        clock.settle()
        self.rng, self.cuda_rng = self._swap_rng(*saved)
        last = self.last_grad if self.last_grad is not None else t2
        sec = clock.seconds
        intervals = [(sec(t0, a), sec(t0, b)) for a, b in self.sync.take_intervals()]
        backward_end = sec(t0, last)
        self.times.append(
            [
                data_s,
                sec(t0, t1),
                sec(t1, last),
                sec(last, t3),
                sec(t3, t4),
                data_s + sec(t0, t4),
                union_length(intervals),
                overlap_length(intervals, (sec(t0, t1), backward_end)),
            ]
        )
        self.losses.append(loss.detach())

    @torch.no_grad()
    def evaluate(
        self, loader: DataLoader | None, max_batches: int | None
    ) -> tuple[float | None, float | None]:
        """(mean loss, accuracy) on the held-out split, each rank's share of it summed over ranks, at
        most ``max_batches`` batches a rank (the epoch's step bound); (None, None) without one."""
        if loader is None:
            return None, None
        model = self.base
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        for i, (x, y) in enumerate(loader):
            if max_batches is not None and i >= max_batches:
                break
            x, y = x.to(self.device), y.to(self.device)
            out = model(x)
            sums[0] += self.loss_fn(out, y).item() * len(y)
            sums[1] += (out.argmax(1) == y).sum().item()
            sums[2] += len(y)
        if self.world > 1 and not self._single_process():
            dist.all_reduce(sums)
        if sums[2] == 0:
            return None, None
        return float(sums[0] / sums[2]), float(sums[1] / sums[2])

    def _single_process(self) -> bool:
        return self.strategy in sync_mod.SINGLE_PROCESS

    def epoch_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This epoch's per-step phase times and losses, averaged over ranks; resets both."""
        times = torch.tensor(self.times, dtype=torch.float64).reshape(-1, len(PHASES))
        losses = (
            torch.stack(self.losses).double().cpu() if self.losses else torch.zeros(0, dtype=torch.float64)
        )
        if self.world > 1 and not self._single_process():
            both = torch.cat([times.flatten(), losses]).to(self.device)  # NCCL takes CUDA tensors only
            dist.all_reduce(both)
            both = both.cpu() / self.world
            times, losses = both[: times.numel()].reshape(times.shape), both[times.numel() :]
        self.times, self.losses = [], []
        return times, losses

    def close(self) -> None:
        self.sync.close()


def median_ms(column: torch.Tensor) -> float:
    return statistics.median(column.tolist()) * 1e3 if column.numel() else 0.0


def hidden_fraction(times: torch.Tensor) -> float | None:
    comm = float(times[:, PHASES.index("comm")].sum()) if times.numel() else 0.0
    if comm <= 0:
        return None
    return float(times[:, PHASES.index("hidden_comm")].sum()) / comm


def epoch_record(
    strategy: str,
    world: int,
    epoch: int,
    batch_size: int,
    times: torch.Tensor,
    losses: torch.Tensor,
    cumulative_s: float,
    evaluation: tuple[float | None, float | None],
    wire: Any = None,
    comm_measured: bool = True,
) -> EpochRecord:
    col = {name: times[:, i] for i, name in enumerate(PHASES)}
    steps = times.shape[0]
    time_s = float(col["step"].sum())
    samples = steps * batch_size * world
    return EpochRecord(
        strategy=strategy,
        world_size=world,
        epoch=epoch,
        first_epoch=epoch == 1,
        steps=steps,
        samples=samples,
        time_s=time_s,
        cumulative_time_s=cumulative_s + time_s,
        images_per_s=samples / time_s if time_s > 0 else 0.0,
        loss=float(losses.mean()) if losses.numel() else float("nan"),
        eval_loss=evaluation[0],
        accuracy=evaluation[1],
        step_time_ms=median_ms(col["step"]),
        data_ms=median_ms(col["data"]),
        forward_ms=median_ms(col["forward"]),
        backward_ms=median_ms(col["backward"]),
        exposed_comm_ms=median_ms(col["exposed_comm"]),
        optimizer_ms=median_ms(col["optimizer"]),
        comm_ms=median_ms(col["comm"]) if comm_measured else None,
        hidden_comm_fraction=hidden_fraction(times) if comm_measured else None,
        step_losses=[float(v) for v in losses],
        **({} if wire is None else wire.fields()),
    )


def summarise(
    trainer: Trainer,
    epochs: list[EpochRecord],
    timed: torch.Tensor,
    world: int,
    batch_size: int,
    num_samples: int,
    backend: str,
) -> TrainSummary:
    """The strategy's summary: medians over the timed steps (later epochs, or all but the first step)."""
    config = trainer.config
    col = {name: timed[:, i] for i, name in enumerate(PHASES)}
    numels = [p.numel() for p in trainer.params]
    itemsize = trainer.params[0].element_size()
    syncs = syncs_per_epoch(num_samples, batch_size, world, config.steps_per_epoch)
    both = wire_bytes_per_sync(
        trainer.strategy, world, numels, itemsize, config, trainer.buffer_bytes, backend=trainer.backend
    )
    reached = next(
        (e for e in epochs if config.loss_threshold is not None and e.loss < config.loss_threshold), None
    )
    step_ms = median_ms(col["step"])
    bucketed = trainer.strategy in sync_mod.BUCKETED
    return TrainSummary(
        strategy=trainer.strategy,
        world_size=world,
        backend=backend,
        device=trainer.device.type,
        model=config.model,
        dataset=config.dataset,
        batch_size=batch_size,
        global_batch=batch_size * world,
        lr=trainer.lr,
        transport=config.transport if trainer.strategy == "bucketed" else None,
        epochs=len(epochs),
        steps_timed=int(timed.shape[0]),
        step_time_ms=step_ms,
        data_ms=median_ms(col["data"]),
        forward_ms=median_ms(col["forward"]),
        backward_ms=median_ms(col["backward"]),
        optimizer_ms=median_ms(col["optimizer"]),
        compute_ms=median_ms(col["forward"] + col["backward"] + col["optimizer"]),
        comm_ms=median_ms(col["comm"]) if trainer.sync.measures_comm else None,
        exposed_comm_ms=median_ms(col["exposed_comm"]),
        hidden_comm_fraction=hidden_fraction(timed) if trainer.sync.measures_comm else None,
        images_per_s=batch_size * world / (step_ms / 1e3) if step_ms > 0 else 0.0,
        first_epoch_time_s=epochs[0].time_s,
        later_epoch_time_s=statistics.mean(e.time_s for e in epochs[1:]) if len(epochs) > 1 else None,
        final_loss=epochs[-1].loss,
        final_accuracy=epochs[-1].accuracy,
        loss_threshold=config.loss_threshold,
        epochs_to_threshold=reached.epoch if reached else None,
        time_to_threshold_s=reached.cumulative_time_s if reached else None,
        trainable_params=sum(numels),
        buckets=(
            len(
                assign_buckets(
                    numels, itemsize, int(config.bucket_cap_mb * MiB), int(config.first_bucket_mb * MiB)
                )
            )
            if bucketed
            else None
        ),
        syncs_per_epoch=syncs,
        samples=num_samples,
        grad_bytes_per_epoch=grad_bytes_per_epoch(sum(numels), itemsize, syncs),
        wire_bytes_per_rank_per_epoch=[w * syncs for w in both[0]] if both is not None else None,
        wire_recv_bytes_per_rank_per_epoch=[w * syncs for w in both[1]] if both is not None else None,
        step_time_ratio_to_ddp=None,
    )


def _dataset(config: TrainConfig, train: bool) -> Dataset:
    """The training set (``config.samples``, replicated as configured) or the test set."""
    from commbench.trainers.data import build_dataset

    sized = dict(num_samples=config.samples, replicate=config.replicate) if train else {}
    return build_dataset(
        config.dataset,
        train=train,
        data_dir=config.data_dir,
        input_shape=config.input_shape(),
        seed=config.seed,
        **sized,
    )


# What a rank holds for each training sample, whatever the batch: its DistributedSampler lists
# every index once an epoch (randperm's 8-byte tensor, then a Python list: 40 bytes an index,
# measured), and a synthetic set keeps an 8-byte label.
INDEX_BYTES = 56


def index_memory_refusal(samples: int, ranks: int, memory_bytes: int) -> str | None:
    """Why ``ranks`` ranks on one host cannot index ``samples`` training samples in
    ``memory_bytes``, or None where they can (a trillion samples failed inside every rank)."""
    from commbench.units import amount, rank_count

    need = samples * INDEX_BYTES * ranks
    if need <= memory_bytes:
        return None
    return (
        f"{samples} training samples are more than this host can index: each rank lists every sample "
        f"each epoch, about {INDEX_BYTES} B a sample, {amount(need)} for {rank_count(ranks)} here, "
        f"where the host has {amount(memory_bytes)} of memory (lower --samples or --replicate)"
    )


def _least_batch(config: TrainConfig, world: int) -> tuple[int, str]:
    """The least batch a rank of ``world`` holds, known before it starts, and the option that sets
    it: a global batch's floor share (it overrides --batch-size), or --batch-size (0, searched
    for, is at least one)."""
    if config.global_batch:
        return per_rank_batch(config.global_batch, world), "--global-batch"
    return config.batch_size or 1, "--batch-size"


def synthetic_memory_refusal(config: TrainConfig, ranks: int, memory_bytes: int, world: int) -> str | None:
    """Why ``ranks`` ranks (of ``world``) on one host cannot hold synthetic images of
    ``config.input_shape()`` in ``memory_bytes``, or None where they can (or the data is real):
    each rank keeps a float32 prototype of every class for each split it builds and loads a batch
    on the host, whatever the device (input_shape=1,60000,60000 asked 144 GB in every rank)."""
    from commbench.trainers.data import DatasetConfig
    from commbench.units import amount, rank_count

    if config.dataset != "synthetic":
        return None
    shape = config.input_shape()
    image = math.prod(shape) * 4
    classes = DatasetConfig.num_classes
    splits = 2 if config.evaluate else 1
    batch, option = _least_batch(config, world)
    held = (classes * splits + batch) * image
    if held * ranks <= memory_bytes:
        return None
    return (
        f"option input_shape={','.join(map(str, shape))}: an image is {amount(image)}, and a rank holds "
        f"{classes * splits} class prototypes and a batch of {batch}, {amount(held)}, "
        f"{amount(held * ranks)} for {rank_count(ranks)} here, where the host has {amount(memory_bytes)} "
        f"of memory (lower input_shape or {option})"
    )


# Copies of the parameters a rank holds in host memory training on the CPU: the parameters, their
# gradients, SGD's momentum and the sync's flat buffers (one on a GPU: the model is built on the
# host before it moves).
MODEL_COPIES_ON_CPU = 4


def parameter_bytes(config: TrainConfig) -> int | None:
    """Bytes of the model's parameters, built on the meta device (nothing allocated); None where it
    cannot be built so (the ranks then say why, building it for real)."""
    from commbench.trainers.models import build_model

    options = {**dict(config.model_options), "input_shape": config.input_shape()}
    options.pop("weights", None)  # a file the meta device has no memory to load into
    try:
        with torch.device("meta"):
            model = build_model(config.model, **options)
    except (ValueError, TypeError, RuntimeError, NotImplementedError):
        return None
    return sum(p.numel() * p.element_size() for p in model.parameters())


def model_memory_refusal(param_bytes: int, ranks: int, memory_bytes: int, device: str) -> str | None:
    """Why ``ranks`` ranks on one host cannot hold a model of ``param_bytes`` in ``memory_bytes``
    (training on ``device``), or None where they can (a model of 40 GB failed in every rank)."""
    from commbench.units import amount, rank_count

    copies = MODEL_COPIES_ON_CPU if device == "cpu" else 1
    need = param_bytes * copies * ranks
    if need <= memory_bytes:
        return None
    held = "with their gradients, momentum and sync buffers, " if copies > 1 else "built on the host, "
    return (
        f"the model's parameters are {amount(param_bytes)}: {held}about {amount(need)} for "
        f"{rank_count(ranks)} here, where the host has {amount(memory_bytes)} of memory (choose a "
        "smaller model or --model-opt)"
    )


def input_memory_refusal(
    config: TrainConfig, ranks: int, memory_bytes: int, world: int, holder: str = "the host has"
) -> str | None:
    """Why ``ranks`` ranks (of ``world``) cannot hold a batch of a torchvision backbone's input,
    resized to its ``image_size``, in the ``memory_bytes`` that ``holder`` has (the host, where
    they train on the CPU, or a GPU, where they resize on it), or None where they can (or the model has
    no such size). Its activations need several times more, unknown here: this refuses what
    cannot fit whatever they are (image_size=100000 failed in every rank, 7.7 TB on the CPU and
    894 GiB asked of an 80 GB H100)."""
    from commbench.trainers.models import MIN_IMAGE_SIZE, BackboneOptions
    from commbench.units import amount, rank_count

    if config.model not in MIN_IMAGE_SIZE:
        return None
    side = dict(config.model_options).get("image_size", BackboneOptions.image_size)
    if type(side) is not int or side < 1:  # refused where the model is built, in its own words
        return None
    batch, option = _least_batch(config, world)
    per_rank = batch * 3 * side * side * 4  # three float32 channels
    need = per_rank * ranks
    if need <= memory_bytes:
        return None
    total = f", {amount(need)} for {rank_count(ranks)} here" if ranks > 1 else ""
    return (
        f"option image_size={side}: a batch of {batch} resized to {side}x{side} is {amount(per_rank)} "
        f"a rank before any activation{total}, where {holder} {amount(memory_bytes)} of memory "
        f"(lower image_size or {option})"
    )


def check_input_fits_gpu(config: TrainConfig, device: torch.device, world: int) -> None:
    """Refuse (ValueError) a backbone's resized input batch larger than the GPU memory it is
    resized in, in the rank, where CUDA is up (the launcher must not start CUDA before it forks
    the ranks): this rank's GPU, or where every strategy is dp or vanilla-dp, which split the
    batch over every local GPU, all of them. Ranks on like GPUs decide alike; ranks sharing one
    are each held to all of it, a bound that cannot refuse a run that fits. A searched batch
    (--batch-size 0) is held to a batch of one."""
    gpus = torch.cuda.device_count() if all(s in sync_mod.CUDA_ONLY for s in config.strategies) else 1
    total = torch.cuda.get_device_properties(device).total_memory * gpus
    holder = f"GPU {device.index} has" if gpus == 1 else f"the {gpus} GPUs have"
    refusal = input_memory_refusal(config, 1, total, world, holder=holder)
    if refusal is not None:
        raise ValueError(refusal)


def _loaders(
    config: TrainConfig, train: Dataset, batch_size: int, world: int, rank: int
) -> tuple[DataLoader, DataLoader | None, DistributedSampler]:
    sampler = DistributedSampler(
        train, num_replicas=world, rank=rank, shuffle=True, seed=config.seed, drop_last=True
    )
    # Every rank takes the same number of steps: a rank with one more would wait forever.
    train_loader = DataLoader(train, batch_size=batch_size, sampler=sampler, drop_last=True)
    test_loader = None
    if config.evaluate:
        test = _dataset(config, train=False)
        shard = Subset(test, range(rank, len(test), world))
        test_loader = DataLoader(shard, batch_size=batch_size)
    return train_loader, test_loader, sampler


def largest_fitting(fits: Callable[[int], bool], limit: int) -> int:
    """The largest batch in 1..``limit`` for which ``fits`` holds, assuming that every smaller batch
    fits too: doubling from 1, then bisection. 0 when not even batch 1 fits (or ``limit`` < 1)."""
    lo, hi = 0, 1
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    if lo == 0:
        return 0
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# The share of the GPU memory a batch search lets its trial step take. The rest is for what the
# trial does not hold: the other strategies' models in a compare, a sync's buffers, and the caching
# allocator's fragmentation over many steps (found at the very edge of memory, the batch of
# resnet18_cifar on an 80 GB H100 ran out of memory in training before it had taken a step).
SEARCH_HEADROOM = 0.9


def find_max_batch(
    config: TrainConfig, input_shape: tuple[int, ...], device: torch.device, limit: int = 1 << 16
) -> int:
    """The largest batch, at most ``limit``, whose training step fits in :data:`SEARCH_HEADROOM` of
    this rank's share of the GPU memory, found by trial steps (forward, backward and the
    optimizer's step, whose momentum is held as in training) until CUDA runs out of memory or a
    step's peak passes that share (:func:`largest_fitting`). Ranks on one GPU share it equally:
    each measures before any tries a step (one all_gather), and searches at once with the others."""
    from commbench.trainers.models import build_model

    if device.type != "cuda":
        raise ValueError("searching the largest batch (--batch-size 0) needs --device cuda")
    model = build_model(config.model, **{**dict(config.model_options), "input_shape": input_shape}).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    loss_fn = nn.CrossEntropyLoss()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    shares = p2p.gather_by_gpu(device, free + torch.cuda.memory_reserved(device))
    mine = p2p.gpu_key(device)
    peers = [have for key, have in shares if key == mine]  # this rank's among them
    budget = SEARCH_HEADROOM * min(peers) / len(peers)

    def fits(b: int) -> bool:
        torch.cuda.reset_peak_memory_stats(device)
        try:
            x = torch.randn(b, *input_shape, device=device)
            y = torch.zeros(b, dtype=torch.long, device=device)
            loss_fn(model(x), y).backward()
            optimizer.step()
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_reserved(device) <= budget
        except RuntimeError as exc:  # torch.OutOfMemoryError is one
            if gpu_out_of_memory(exc):
                return False
            raise
        finally:
            optimizer.zero_grad(set_to_none=True)
            optimizer.state.clear()
            torch.cuda.empty_cache()

    found = largest_fitting(fits, limit)
    if found == 0:
        raise ValueError(f"model {config.model} does not fit on the GPU even with batch 1")
    return found


# What a full GPU raises outside torch's caching allocator, as a RuntimeError: cuBLAS or cuDNN
# failing to allocate a handle or workspace, or the CUDA runtime's own allocation error.
GPU_LIBRARY_OOM = re.compile(
    r"CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED|CUDA error: out of memory"
)


def gpu_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a full GPU's: CUDA's out-of-memory error or a library's (GPU_LIBRARY_OOM)."""
    return isinstance(exc, torch.OutOfMemoryError) or GPU_LIBRARY_OOM.search(str(exc)) is not None


def refuse_out_of_memory(config: TrainConfig, batch: int | None, exc: BaseException) -> None:
    """An allocation that failed, raised as a refusal (ValueError) in one line that says what to
    change: of the batch, where it failed in training, or of the model (``batch`` None), where it
    failed as the trainers were built, before any batch. Any other error returns, for the caller
    to raise. CUDA's out-of-memory error (found in the error or what it was raised from, as the
    ring's thread and dp's replicas pass it on) gives the size torch could not have; cuBLAS's,
    cuDNN's or the CUDA runtime's (:data:`GPU_LIBRARY_OOM`), their status; the CPU
    allocator's, the bytes it could not have (a 257 GB vgg16 layer: exit 1, in the allocator's
    words). Where several strategies train side by side, each holds its own model."""
    from commbench.units import amount

    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__)
    cuda = next((e for e in chain if isinstance(e, torch.OutOfMemoryError)), None)
    text = " ".join(str(exc).split())
    cpu = re.search(r"DefaultCPUAllocator: can't allocate memory: you tried to allocate (\d+) bytes", text)
    library = next(filter(None, (GPU_LIBRARY_OOM.search(str(e)) for e in chain)), None)
    if cuda is not None:
        memory, what = "the GPU's memory", "CUDA out of memory"
        asked = re.search(r"Tried to allocate ([\d.]+ [KMGTP]?i?B)", " ".join(str(cuda).split()))
        what += f", tried to allocate {asked[1]}" if asked else ""
    elif library is not None:
        memory, what = "the GPU's memory", library[0]
    elif cpu is not None:
        memory, what = "the host's memory", f"{amount(int(cpu[1]))} could not be allocated"
    else:
        return
    n = len(config.strategies)
    copies = f", {n} strategies' copies side by side," if n > 1 else ""
    if batch is None:
        change = "choose a smaller model or --model-opt" + (", or fewer strategies" if n > 1 else "")
        raise ValueError(
            f"model {config.model}{copies} does not fit in {memory}: {what} ({change})"
        ) from None
    held, change = f"a batch of {batch}", "lower --batch-size"
    if config.global_batch:  # it overrides --batch-size, searched for or not
        held, change = f"{held} a rank (of --global-batch {config.global_batch})", "lower --global-batch"
    elif config.batch_size == 0:  # the search's batch fitted its trial step, not the training
        held, change = f"the batch of {batch} found", f"give a --batch-size below {batch}"
    elif cuda is not None:  # the search runs on CUDA alone
        change += ", or give --batch-size 0 to find the largest that fits"
    raise ValueError(
        f"{held} of {config.model}{copies} does not fit in {memory}: {what} ({change})"
    ) from None


def per_rank_batch(global_batch: int, world: int) -> int:
    """Each rank's share of ``global_batch``; ValueError where it is less than one sample."""
    if global_batch < world:
        raise ValueError(f"a global batch of {global_batch} gives no sample to each of {world} ranks")
    return global_batch // world


def no_batch_refusal(samples: int, batch: int, world: int) -> str | None:
    """Why ``samples`` make no whole batch of ``batch`` on each of ``world`` ranks (each rank takes
    its floor share, and drops a last batch short of ``batch``), or None where they do."""
    if samples // world >= batch:
        return None
    return f"{samples} samples do not make one batch of {batch} on each of {world} ranks"


def _batch_size(config: TrainConfig, samples: int, device: torch.device, world: int) -> int:
    """The configured per-rank batch; for 0, the largest that fits in memory and in this rank's
    share of the data, agreed on by every rank (the smallest of their findings). A global batch is
    split over the ranks, each taking its floor share (256 on 3 ranks: 85 each)."""
    if config.global_batch:
        return per_rank_batch(config.global_batch, world)
    if config.batch_size:
        return config.batch_size
    if samples // world == 0:
        raise ValueError(f"{samples} samples do not make one batch on each of {world} ranks")
    found = find_max_batch(config, config.input_shape(), device, limit=samples // world)
    if world > 1:
        agreed = torch.tensor([found], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        found = int(agreed.item())
    return found


def run_rank(
    config: TrainConfig,
    device: torch.device,
    emit: Callable[[Any], None],
    progress: Any = None,
    inspect: Callable[[list[Trainer]], None] | None = None,
    nic: str | None = None,
) -> list[TrainSummary]:
    """Train every strategy of ``config`` on this rank, steps interleaved; return their summaries.

    ``emit`` receives each epoch record as it is made (rank 0 writes them); ``progress`` (a tqdm
    bar or None) is advanced once per step of every strategy; ``inspect`` sees the trainers after
    the last epoch (tests compare their parameters); ``nic``: the interface the wire count reads
    (``wirecount.agreed_nic``'s, agreed here where None).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    for s in config.strategies:
        if s in sync_mod.SINGLE_PROCESS and world > 1:
            raise ValueError(f"strategy {s} runs in one process; it cannot run with {world} ranks")
    shape = config.input_shape()
    if device.type == "cuda":  # on the CPU the launcher refused it before any rank started
        check_input_fits_gpu(config, device, world)
    train = _dataset(config, train=True)
    try:  # the batch search builds the model too
        batch = _batch_size(config, len(train), device, world)
    except RuntimeError as exc:
        refuse_out_of_memory(config, None, exc)
        raise
    loader, test_loader, sampler = _loaders(config, train, batch, world, rank)
    steps = len(loader) if config.steps_per_epoch is None else min(len(loader), config.steps_per_epoch)
    if steps == 0:
        raise ValueError(no_batch_refusal(len(train), batch, world))
    try:  # a model's allocations, the batch's come later
        trainers = [Trainer(config, s, shape, device, batch) for s in config.strategies]
    except RuntimeError as exc:
        refuse_out_of_memory(config, None, exc)
        raise
    windows = None
    if config.probe and world > 1 and p2p.backend_for(None, device) == "gloo":  # NIC counters see its TCP
        from commbench.probes.wirecount import StepWindows, WireCounter

        windows = StepWindows(WireCounter(device, nic))
    try:
        history: dict[str, list[EpochRecord]] = {s: [] for s in config.strategies}
        timed: dict[str, list[torch.Tensor]] = {s: [] for s in config.strategies}
        for epoch in range(1, config.epochs + 1):
            sampler.set_epoch(epoch)
            batches = iter(loader)
            for _ in range(steps):
                t = time.perf_counter()
                x, y = next(batches)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                data_s = time.perf_counter() - t
                for tr in trainers:
                    if windows is not None:
                        windows.around(tr.strategy, lambda tr=tr: tr.step(x, y, data_s))  # noqa: B023
                    else:
                        tr.step(x, y, data_s)
                    if progress is not None:
                        progress.update(1)
            for tr in trainers:
                times, losses = tr.epoch_stats()
                prior = history[tr.strategy][-1].cumulative_time_s if history[tr.strategy] else 0.0
                wire = None
                per_sync = wire_bytes_per_sync(
                    tr.strategy, world, tr.numels, tr.itemsize, config, tr.buffer_bytes, backend=tr.backend
                )
                if windows is not None and per_sync is not None:
                    wire = windows.take(tr.strategy, steps, *per_sync, sum(tr.numels) * tr.itemsize)
                evaluation = tr.evaluate(test_loader, config.steps_per_epoch)
                record = epoch_record(
                    tr.strategy,
                    world,
                    epoch,
                    batch,
                    times,
                    losses,
                    prior,
                    evaluation,
                    wire,
                    comm_measured=tr.sync.measures_comm,
                )
                history[tr.strategy].append(record)
                emit(record)
                # The summary times later epochs; with one epoch, every step but the first.
                if config.epochs == 1:
                    timed[tr.strategy].append(times[1:] if times.shape[0] > 1 else times)
                elif epoch > 1:
                    timed[tr.strategy].append(times)
        backend = dist.get_backend() if dist.is_initialized() else "none"
        summaries = [
            summarise(
                tr, history[tr.strategy], torch.cat(timed[tr.strategy]), world, batch, len(train), backend
            )
            for tr in trainers
        ]
        if inspect is not None:
            inspect(trainers)
    except RuntimeError as exc:
        refuse_out_of_memory(config, batch, exc)
        raise
    finally:
        for tr in trainers:
            tr.close()
    ddp = next((s for s in summaries if s.strategy == "ddp"), None)
    if ddp is not None and ddp.step_time_ms > 0:
        summaries = [
            dataclasses.replace(s, step_time_ratio_to_ddp=s.step_time_ms / ddp.step_time_ms)
            for s in summaries
        ]
    return summaries
