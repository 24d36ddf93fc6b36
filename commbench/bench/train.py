"""``commbench train`` and ``commbench compare``: run gradient-sync strategies and report them.

The loop lives in ``commbench.trainers.loop``; this module turns arguments into a ``TrainConfig``,
starts the ranks, and on rank 0 writes records, prints the table and draws the plots.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from commbench.bench.records import exposed_comm_ms, output_path
from commbench.trainers.sync import BUCKETED, SINGLE_PROCESS, STRATEGIES, TRANSPORTS
from commbench.units import rank_count


def _add_common(p: argparse.ArgumentParser) -> None:
    from commbench.trainers.data import DATASETS
    from commbench.trainers.models import MODELS

    p.add_argument("--model", default="mlp", help=f"one of {', '.join(MODELS)} (default mlp)")
    p.add_argument(
        "--model-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="option for the model, repeatable (e.g. widths=2048,2048; hidden=1024; image_size=64)",
    )
    p.add_argument("--dataset", default="synthetic", help=f"one of {', '.join(DATASETS)} (default synthetic)")
    p.add_argument("--data-dir", default=None, help="directory holding mnist/cifar10 in torchvision's layout")
    p.add_argument(
        "--replicate",
        type=int,
        default=1,
        help="repeat the training set this many times, 1 or more (4x, 8x MNIST: 4, 8; default 1)",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=None,
        help="size of the training set: the first N of mnist/cifar10 (default all), or synthetic's "
        "(default 60000, 50000 for colour)",
    )
    p.add_argument("--epochs", type=int, default=1, help="epochs (default 1)")
    p.add_argument(
        "--steps-per-epoch",
        type=int,
        default=None,
        help="bound each epoch to this many steps, and its held-out evaluation to as many batches a rank",
    )
    p.add_argument(
        "--batch-size", type=int, default=64, help="per-rank batch (default 64; 0 = largest that fits, CUDA)"
    )
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="batch over all ranks, split between them (each takes its floor share); overrides --batch-size",
    )
    p.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    p.add_argument(
        "--lr-scaling",
        choices=("none", "linear"),
        default="none",
        help="linear: lr x global batch / --reference-batch (default: --global-batch, else per-rank batch)",
    )
    p.add_argument(
        "--reference-batch",
        type=int,
        default=None,
        help="batch the given --lr was tuned for (read by --lr-scaling linear; none leaves --lr as given)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of model and data (default 0)")
    p.add_argument(
        "--loss-threshold",
        type=float,
        default=None,
        help="say in which epoch the mean training loss first fell below this, and after how long",
    )
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="backend",
        help="bucketed: the backend's async allreduce (default) or the hand-written ring on its own thread",
    )
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="bucket cap in MiB, up to 2^20, for bucketed and ddp (default 25, as DDP)",
    )
    p.add_argument(
        "--first-bucket-mb",
        type=float,
        default=None,
        help="first bucket's cap in MiB (default 1); ddp takes any where torch has bucket_cap_mb_list, "
        "else 1 under the default cap or the cap itself",
    )
    p.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation after each epoch")
    from commbench.bench.probing import add_probe_args

    add_probe_args(p, "each step")
    p.add_argument(
        "--json", type=output_path, default=None, help="write JSON Lines here (header, epochs, summaries)"
    )
    p.add_argument(
        "--plot",
        type=output_path,
        default=None,
        help="write the time-breakdown PNG here (loss curves beside it)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no table and no progress bar")


def add_parsers(sub: Any, add_launch_args: Any) -> None:
    """Register ``train`` and ``compare`` on the CLI's subparsers."""
    train = sub.add_parser(
        "train",
        help="train with one gradient-sync strategy, timed phase by phase",
        description="Train a model with one gradient-sync strategy; per step it times data, forward, "
        "backward, exposed communication and the optimizer, and per epoch loss and accuracy.",
    )
    train.add_argument("--strategy", default="ddp", help=f"one of {', '.join(STRATEGIES)} (default ddp)")
    _add_common(train)
    add_launch_args(train)
    compare = sub.add_parser(
        "compare",
        help="several gradient-sync strategies side by side, same seed, data and model",
        description="Train with several strategies in one run, their steps interleaved so each sees "
        "the same batches and machine conditions; prints the step-time breakdown, hidden communication, "
        "computed bytes and each strategy's step time relative to ddp.",
    )
    compare.add_argument(
        "--strategies",
        default="naive,ring,bucketed,ddp",
        help="comma-separated (default naive,ring,bucketed,ddp)",
    )
    _add_common(compare)
    add_launch_args(compare)


def train_config(args: argparse.Namespace) -> Any:
    from commbench.trainers.loop import TrainConfig
    from commbench.trainers.models import parse_model_options

    text = args.strategy if args.command == "train" else args.strategies
    names = [s.strip() for s in text.split(",") if s.strip()]
    several = list(dict.fromkeys(names))  # one named twice is the config's to refuse, as compare's
    if args.command == "train" and len(several) > 1:  # it ran them all, as compare does
        raise ValueError(
            f"--strategy takes one strategy, got {text!r}: commbench compare --strategies "
            f"{shlex.quote(','.join(several))} trains several side by side"
        )
    # given only: the config's defaults stand for the rest, and what is given must be read by a strategy
    caps = {n: v for n in ("bucket_cap_mb", "first_bucket_mb") if (v := getattr(args, n)) is not None}
    config = TrainConfig(
        strategies=tuple(names),
        model=args.model,
        model_options=tuple(parse_model_options(args.model_opt).items()),
        dataset=args.dataset,
        data_dir=args.data_dir,
        replicate=args.replicate,
        samples=args.samples,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        batch_size=args.batch_size,
        global_batch=args.global_batch,
        lr=args.lr,
        momentum=args.momentum,
        lr_scaling=args.lr_scaling,
        reference_batch=args.reference_batch,
        seed=args.seed,
        loss_threshold=args.loss_threshold,
        transport=args.transport,
        **caps,
        evaluate=not args.no_eval,
        probe=not args.no_probe,
        probe_interval_s=args.probe_interval,
        json_path=args.json,
        plot_path=args.plot,
        quiet=args.quiet,
    )
    if caps and not set(BUCKETED) & set(config.strategies):
        flag = "--" + next(iter(caps)).replace("_", "-")
        raise ValueError(
            f"{flag} is read by the {' and '.join(BUCKETED)} strategies, neither of which is among "
            f"{','.join(config.strategies)}"
        )
    return config


def _fmt(x: float | None, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}{spec}}"


def _pct(x: float | None, width: int, digits: int = 0) -> str:
    return f"{'-':>{width}}" if x is None else f"{100 * x:{width - 1}.{digits}f}%"


def summary_table(summaries: list[dict[str, Any]]) -> str:
    """The compare table: one row per strategy."""
    head = (
        f"{'strategy':>10} {'step ms':>8} {'data':>6} {'fwd':>7} {'bwd':>7} {'exp.comm':>8} {'opt':>6} "
        f"{'comm ms':>8} {'hidden':>6} {'img/s':>8} {'loss':>7} {'acc':>6} {'grad MB/ep':>10} "
        f"{'wire MB/rank/ep':>15} {'x ddp':>6}"
    )
    lines = [head]
    for s in summaries:
        wire = s["wire_bytes_per_rank_per_epoch"]
        hidden = s["hidden_comm_fraction"]
        lines.append(
            f"{s['strategy']:>10} {s['step_time_ms']:8.2f} {s['data_ms']:6.2f} {s['forward_ms']:7.2f} "
            f"{s['backward_ms']:7.2f} {_fmt(exposed_comm_ms(s), '.2f', 8)} {s['optimizer_ms']:6.2f} "
            f"{_fmt(s['comm_ms'], '.2f', 8)} {_pct(hidden, 6)} "
            f"{s['images_per_s']:8.0f} {s['final_loss']:7.3f} "
            f"{_pct(s['final_accuracy'], 6, 1)} "
            f"{s['grad_bytes_per_epoch'] / 1e6:10.1f} "
            f"{_fmt(None if wire is None else max(wire) / 1e6, '.1f', 15)} "
            f"{_fmt(s['step_time_ratio_to_ddp'], '.2f', 6)}"
        )
    return "\n".join(lines)


def finished_epochs_table(epochs: list[dict[str, Any]]) -> str:
    """What a train or compare that was stopped or failed before its summary prints: a line saying
    so, then its finished epochs (the report's columns), one row each."""
    from commbench.bench.reporting import EPOCH_COLUMNS

    rows = [[c[0] for c in EPOCH_COLUMNS]] + [[c[1](e) for c in EPOCH_COLUMNS] for e in epochs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(EPOCH_COLUMNS))]
    lines = [" ".join(f"{cell:>{w}}" for cell, w in zip(row, widths, strict=True)) for row in rows]
    return (
        "# ended before its summary, so there is no step-time table; the epochs it finished:\n"
        + "\n".join(lines)
    )


def _title(config: Any, first: dict[str, Any], name: str = "train", places: Any = None) -> str:
    """The table's title: what trained, on what (each rank's place where ``places`` gives them),
    and how the columns were measured."""
    from commbench.bench.machine import place_lines

    return (
        f"# commbench {name}: {config.model} ({first['trainable_params']:,} trainable parameters) on "
        f"{config.dataset}, {rank_count(first['world_size'])}, backend {first['backend']}, "
        f"device {first['device']}, "
        f"batch {first['batch_size']}/rank\n{place_lines(places)}"
        "# ms = median over timed steps (later epochs; with one epoch all but the first step, unless it is "
        "the only one) of the ranks' "
        "mean;\n# bwd = backward until the last gradient; exp.comm = from then until gradients are synced; "
        "hidden = share of comm time overlapping backward; MB = 1e6 B; wire MB/rank/ep = the busiest "
        "rank's"
    )


def _train_rank(config: Any, device: str, command: str | None = None, name: str = "train") -> list[dict]:
    """One rank of ``commbench train`` or ``compare`` (``name``, the table's heading); rank 0 writes
    the records, whose header records ``command`` (see :func:`~commbench.bench.machine.command_line`)."""
    import torch.distributed as dist

    from commbench.bench.machine import machine_info, rank_device, rank_places
    from commbench.bench.records import RecordWriter
    from commbench.trainers.loop import run_rank

    rank0 = dist.get_rank() == 0
    writer = RecordWriter(config.json_path if rank0 else None, None)
    bar = None
    probe = None
    probe_record = None
    epochs: list[Any] = []
    finished = False
    try:
        nic = None
        if config.probe:  # every rank: the interface is chosen knowing where the others run
            from commbench.probes.wirecount import agreed_nic

            nic = agreed_nic()
        dev = rank_device(device)
        places = rank_places(dev)  # every rank: where each runs, for rank 0's header and title
        if rank0:
            info = machine_info(dist.get_backend(), command)
            writer.header({**info, "ranks": places, "config": dataclasses.asdict(config)})
            if config.probe:
                from commbench.bench.probing import RunProbe

                probe = RunProbe(config.probe_interval_s, nic)
            if not config.quiet:
                from tqdm import tqdm

                bar = tqdm(
                    file=sys.stderr, unit="step", leave=False, delay=2.0, disable=not sys.stderr.isatty()
                )

        def emit(record: Any) -> None:
            if rank0:
                writer.write(record)
                epochs.append(dataclasses.asdict(record))
                if probe is not None:
                    probe.mark(f"{record.strategy} epoch {record.epoch}")

        summaries = run_rank(config, dev, emit, bar, nic=nic)
        finished = True
        for s in summaries:
            writer.write(s)
    finally:
        if bar is not None:
            bar.close()
        try:
            if probe is not None:
                probe_record = probe.finish()
                if probe_record is not None:
                    writer.write(probe_record)
        finally:
            writer.close()
            if not finished and epochs and not config.quiet:
                # stopped or failed mid-run: without --json the finished epochs were nowhere else
                from commbench.bench.records import say

                with contextlib.suppress(OSError):  # the exception under way is the one to report
                    say(finished_epochs_table(epochs))
    rows = [dataclasses.asdict(s) for s in summaries]
    if rank0 and not config.quiet:
        from commbench.bench.probing import overhead_line
        from commbench.bench.records import say

        say(_title(config, rows[0], name, places))
        if probe is not None:
            say(probe.describe())
        say(summary_table(rows))
        say(wire_flag_lines(epochs), end="")
        say(diverged_lines(epochs), end="")
        from commbench.bench.report import threshold_lines

        for line in threshold_lines(rows):
            say(f"# {line}")
        if probe_record is not None:
            say(overhead_line(probe_record))
    if rank0 and config.plot_path:
        from commbench.bench.records import plot_or_note
        from commbench.bench.report import plot_training

        plot_or_note(lambda: plot_training(epochs, rows, *plot_paths(config.plot_path)), config.plot_path)
        if probe_record is not None:
            from commbench.bench.report import plot_probe_timeline, timeline_path

            timeline = timeline_path(config.plot_path)
            plot_or_note(lambda: plot_probe_timeline(probe_record, timeline, config.model), timeline)
    return rows


def runs_alone(args: argparse.Namespace, config: Any) -> bool:
    """Whether the command runs as one process: no --world-size and only none, dp or vanilla-dp,
    and no outside launcher (torchrun, SLURM), whose world is the one there is."""
    from commbench.bench.starter import launched_externally

    return (
        args.world_size is None
        and set(config.strategies) <= set(SINGLE_PROCESS)
        and not launched_externally()
    )


def check_launch(config: Any, world_size: int, device: str) -> None:
    """ValueError for strategies the launch cannot run: one-process ones on several ranks, CUDA-only
    ones or the batch search off CUDA (also what a study checks of each run before it starts)."""
    from commbench.bench.starter import launched_externally
    from commbench.trainers.sync import CUDA_ONLY

    for s in config.strategies:
        if s in SINGLE_PROCESS and world_size > 1:
            raise ValueError(
                f"strategy {s} runs in one process, not on {world_size} ranks: "
                + (
                    "start one process"
                    if launched_externally()
                    else "give --world-size 1, or run it apart"  # the others take the default of 2
                    if not set(config.strategies) <= set(SINGLE_PROCESS)
                    else "leave out --world-size, or give 1"
                )
            )
        if s in CUDA_ONLY and device != "cuda":
            raise ValueError(f"strategy {s} needs --device cuda")
    from commbench.trainers.loop import MAX_LR, per_rank_batch

    batch = config.batch_size
    if config.global_batch is not None:
        if config.batch_size == 0:
            raise ValueError("--global-batch sets the batch; it cannot go with --batch-size 0 (the search)")
        batch = per_rank_batch(config.global_batch, world_size)
    elif config.batch_size == 0 and device != "cuda":
        raise ValueError("searching the largest batch (--batch-size 0) needs --device cuda")
    scaled = config.effective_lr(batch, world_size) if batch > 0 else 0.0
    if scaled > MAX_LR:
        raise ValueError(
            f"--lr {config.lr:g} scaled linearly to the batch is {scaled:.4g}, "
            f"past {MAX_LR:.4g} (float32's largest, the gradients' type)"
        )


def cmd_train(config: Any, spec: Any, command: str | None = None, name: str = "train") -> int:
    from commbench.bench import launch
    from commbench.bench.records import check_outputs, plots_beside
    from commbench.bench.starter import launched_externally

    check_launch(config, spec.world_size, spec.device)
    external = launched_externally()
    with launch.node_checks():  # rank 0's files and this node's data and memory: see node_checks
        check_outputs(
            json=config.json_path,
            plot=config.plot_path,
            beside=plots_beside("train", config.plot_path, config.probe),
            writes=launch.writes_outputs(),
        )
        check_data(
            config,
            launch.local_ranks() if external else spec.world_size,
            spec.device,
            world=launch.external_world_size() if external else spec.world_size,
        )
    launch.run(_train_rank, (config, spec.device, command, name), spec)
    return 0


def check_data(config: Any, ranks_here: int, device: str = "cpu", world: int | None = None) -> None:
    """What every rank would refuse on its own, said once before any starts (ValueError): a model's
    weights file that is not there, a real dataset's missing or malformed files, a training set
    that ``ranks_here`` ranks on this machine could not index, synthetic images they could not
    hold, a model they could not hold training on ``device``, and on the CPU a batch of a
    backbone's resized input they could not hold (on CUDA each rank checks its GPU; see
    :func:`~commbench.trainers.loop.index_memory_refusal`, ``synthetic_memory_refusal``,
    ``model_memory_refusal`` and ``input_memory_refusal``)."""
    import psutil

    from commbench.trainers.data import DatasetConfig, build_dataset, split_size
    from commbench.trainers.loop import (
        index_memory_refusal,
        input_memory_refusal,
        model_memory_refusal,
        no_batch_refusal,
        parameter_bytes,
        per_rank_batch,
        synthetic_memory_refusal,
    )

    weights = dict(config.model_options).get("weights")
    # Each rank found it missing ("rank 0 failed: ..."); under torchrun or SLURM, launch.node_checks
    # holds the refusal until the ranks have joined, then every rank says it
    if weights is not None and not Path(weights).is_file():
        raise ValueError(f"{config.model} weights: no file at {weights}")
    if config.dataset != "synthetic":
        # as the ranks build them: the training set at its --samples, and the held-out set they evaluate on
        samples = len(
            build_dataset(config.dataset, train=True, data_dir=config.data_dir, num_samples=config.samples)
        )
        if config.evaluate:
            build_dataset(config.dataset, train=False, data_dir=config.data_dir)
    else:
        shape = config.input_shape()
        samples = split_size(
            DatasetConfig(name="synthetic", train=True, input_shape=shape, num_samples=config.samples)
        )
    world = world or ranks_here
    batch = config.batch_size if config.global_batch is None else per_rank_batch(config.global_batch, world)
    # as every rank says once it has built its data (in a cluster, after the hosts were made);
    # batch 0 is the search's, on the GPU
    if batch > 0 and (refusal := no_batch_refusal(samples * config.replicate, batch, world)):
        raise ValueError(refusal)
    memory = psutil.virtual_memory().total
    refusal = index_memory_refusal(samples * config.replicate, ranks_here, memory)
    param_bytes = parameter_bytes(config)
    if refusal is None and param_bytes is not None:
        refusal = model_memory_refusal(param_bytes, ranks_here, memory, device)
    if refusal is None:  # held on the host, whatever the device
        refusal = synthetic_memory_refusal(config, ranks_here, memory, world)
    if refusal is None and device == "cpu":
        refusal = input_memory_refusal(config, ranks_here, memory, world)
    if refusal is not None:
        raise ValueError(refusal)


def plot_paths(plot_path: str) -> tuple[Path, Path]:
    """The breakdown PNG and, beside it, the loss-curve PNG."""
    p = Path(plot_path)
    return p, p.with_name(f"{p.stem}-loss{p.suffix or '.png'}")


def diverged_lines(epochs: Sequence[dict[str, Any]]) -> str:
    """A line under a training table for each strategy whose loss stopped being a finite number,
    at its first such epoch: the table's 'nan' read as a result (with an accuracy beside it)."""
    lines, seen = [], set()
    for e in epochs:
        loss = e.get("loss")
        if e["strategy"] in seen or not isinstance(loss, float) or math.isfinite(loss):
            continue
        seen.add(e["strategy"])
        lines.append(
            f"# diverged: {e['strategy']} epoch {e['epoch']}: the loss is {loss} (try a smaller --lr)\n"
        )
    return "".join(lines)


def wire_flag_lines(epochs: Sequence[dict[str, Any]]) -> str:
    """The lines under a training table naming each epoch whose wire bytes are off; an epoch whose
    count was recorded but not judged (messages under 1 MiB) is not among them, as under a sweep's."""
    from commbench.probes.wirecheck import says_off

    return "".join(
        f"# wire bytes off: {e['strategy']} epoch {e['epoch']}: {e['wire_check']}\n"
        for e in epochs
        if says_off(e.get("wire_check"))
    )
