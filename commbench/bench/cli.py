"""The ``commbench`` command. Library code raises; only this module turns an exception into a
one-line message and an exit code (2 for bad input, 1 for a failed run, 128 + the signal when
interrupted: 130 for Ctrl-C)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import commbench
from commbench.bench.records import escape_breaks, file_stamp, input_path, output_path
from commbench.units import amount, rank_count
from commbench.units import size_argument as _size

SUMMARY_KEYS = (
    "collective",
    "algorithm",
    "size_bytes",
    "busbw_gbps",
    "busbw_ratio_to_builtin",
    "frac_of_limit",
)
SIZE_HELP = "bytes, or with a K/M/G suffix (2^10, 2^20, 2^30 bytes)"


class UsageError(Exception):
    """Bad command-line input: reported in one line with exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        raise UsageError(f"{self.prog}: {message}")


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launch")
    g.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="local ranks to start with the elastic launcher (default 2, or 1 for train and compare "
        "whose strategies are all none, dp or vanilla-dp; under torchrun or SLURM the launcher's world "
        "is used)",
    )
    g.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="process-group backend (default: nccl on cuda, gloo on cpu)",
    )
    g.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where tensors live (default cpu)"
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds any rank waits for another before the run fails (default 120)",
    )


def _add_sweep_args(p: argparse.ArgumentParser) -> None:
    from commbench.bench.collectives import SPECS
    from commbench.comm import ALGORITHMS, DTYPES, OPS

    p.add_argument(
        "--collective", default="all_reduce", help=f"one of {', '.join(SPECS)} (default all_reduce)"
    )
    p.add_argument(
        "-a",
        "--algorithms",
        default=None,
        help="comma-separated, interleaved at each size (default builtin,naive,ring; p2p for sendrecv); "
        + "; ".join(f"{c}: {','.join(a)}" for c, a in ALGORITHMS.items())
        + "; sendrecv: p2p. ALGORITHM@SIZE runs a segmented algorithm (ring, auto, p2p) with pipeline "
        + "segments of SIZE, e.g. -a builtin,ring,ring@2M to compare segment sizes side by side",
    )
    p.add_argument(
        "-b", "--minbytes", type=_size, default=_size("1K"), help=f"smallest size (default 1K), {SIZE_HELP}"
    )
    p.add_argument(
        "-e", "--maxbytes", type=_size, default=_size("64M"), help=f"largest size (default 64M), {SIZE_HELP}"
    )
    step = p.add_mutually_exclusive_group()
    step.add_argument(
        "-f", "--stepfactor", type=float, default=2.0, help="multiply the size by this (default 2)"
    )
    step.add_argument("-i", "--stepbytes", type=_size, default=None, help=f"or add this, {SIZE_HELP}")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size (default 20)")
    p.add_argument("-w", "--warmup", type=int, default=5, help="untimed iterations first (default 5)")
    p.add_argument(
        "--block",
        type=int,
        default=1,
        help="iterations each series runs back to back before the next takes over (default 1: "
        "interleaved call by call; -w + -n or more: one series at a time, as nccl-tests times)",
    )
    p.add_argument(
        "-c",
        "--check",
        type=int,
        choices=(0, 1),
        default=1,
        help="check results against the closed form (default 1); any wrong element fails the run, exit 1",
    )
    p.add_argument("-d", "--dtype", default="float32", help=f"one of {', '.join(DTYPES)} (default float32)")
    p.add_argument(
        "-o",
        "--op",
        default="sum",
        help=f"one of {', '.join(OPS)} (default sum); all_gather, broadcast and sendrecv take none",
    )
    p.add_argument(
        "-r",
        "--root",
        type=int,
        default=0,
        help="root of broadcast and reduce (default 0); the others have none and record root null",
    )
    p.add_argument(
        "--in-place",
        action="store_true",
        help="reduce_scatter and all_gather in place, as nccl-tests' second column: the output is the "
        "rank's chunk of the input, or the input its part of the output (all_reduce, broadcast and "
        "reduce always run in place)",
    )
    p.add_argument("--no-limit", action="store_true", help="skip the send/recv transport-limit series")
    from commbench.bench.probing import add_probe_args

    add_probe_args(p, "each point's extra calls")
    p.add_argument(
        "--probe-iters",
        type=int,
        default=3,
        help="calls per algorithm in each point's counting pass (default 3)",
    )
    p.add_argument(
        "--json",
        type=output_path,
        default=None,
        help="write JSON Lines here (header, then one record per point)",
    )
    p.add_argument("--csv", type=output_path, default=None, help="write the records as CSV here")
    p.add_argument("--plot", type=output_path, default=None, help="write a busbw-versus-size PNG here")
    p.add_argument("-q", "--quiet", action="store_true", help="no table and no progress bar")
    _add_launch_args(p)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="commbench",
        description="Measure the communication of distributed deep learning, from the wire up.",
    )
    parser.add_argument("--version", action="version", version=f"commbench {commbench.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    sweep = sub.add_parser(
        "sweep",
        help="per-collective sweep over message sizes (nccl-tests style)",
        description="Time collectives over a range of message sizes, several algorithms side by side, "
        "checked, with the transport's own send/recv limit measured in the same run.",
    )
    _add_sweep_args(sweep)
    summary = sub.add_parser(
        "summary",
        help="ratio tables (to builtin and to the limit) from sweep JSON Lines",
        description="Print, per size, each algorithm's busbw relative to builtin and to the send/recv "
        "limit, as a Markdown table, from files written by `commbench sweep --json`.",
    )
    summary.add_argument("files", nargs="+", type=input_path, help="JSON Lines files from commbench sweep")
    summary.add_argument(
        "--across",
        action="store_true",
        help="the files are repeated runs of one sweep: print one table of each algorithm's ratio "
        "to builtin over them (mean, lowest, highest, runs under 0.9 and under 1.0)",
    )
    demo = sub.add_parser(
        "demo",
        help="the default job: all_reduce with builtin, naive and ring on 2 local CPU ranks",
        description="A short all_reduce sweep (4K to 16M) on 2 local CPU ranks; writes "
        "results/demo.jsonl, results/demo.png and results/demo-timeline.png (the probes).",
    )
    demo.add_argument("-q", "--quiet", action="store_true", help="no table and no progress bar")
    from commbench.bench import bandwidth

    bandwidth.add_parser(sub)
    from commbench.bench import train

    train.add_parsers(sub, _add_launch_args)
    from commbench.bench import cluster

    cluster.add_parser(sub)
    from commbench.bench import profile, reporting, study

    reporting.add_parser(sub)
    study.add_parser(sub)
    profile.add_parser(sub)
    return parser


def _algorithms(args: argparse.Namespace) -> str:
    if args.algorithms is not None:
        return args.algorithms
    return "p2p" if args.collective == "sendrecv" else "builtin,naive,ring"


def sweep_config(args: argparse.Namespace) -> Any:
    from commbench.bench.sweep import SweepConfig

    return SweepConfig(
        collective=args.collective,
        algorithms=tuple(a.strip() for a in _algorithms(args).split(",") if a.strip()),
        min_bytes=args.minbytes,
        max_bytes=args.maxbytes,
        step_factor=args.stepfactor,
        step_bytes=args.stepbytes,
        iters=args.iters,
        warmup=args.warmup,
        block=args.block,
        check=bool(args.check),
        dtype=args.dtype,
        op=args.op,
        root=args.root,
        in_place=args.in_place,
        limit=not args.no_limit,
        probe=not args.no_probe,
        probe_interval_s=args.probe_interval,
        probe_iters=args.probe_iters,
        json_path=args.json,
        csv_path=args.csv,
        quiet=args.quiet,
    )


def check_environment() -> None:
    """Refuse a bad $COMMBENCH_LOOPBACK_CC, $COMMBENCH_LOOPBACK_NOTSENT, $COMMBENCH_GLOO_CUDA_HOST_FROM,
    $COMMBENCH_GLOO_DUPLEX, $COMMBENCH_LINK_GBPS, $COMMBENCH_LINK_BURST or $OMP_NUM_THREADS
    (ValueError, one line) before anything starts."""
    from commbench import comm
    from commbench.bench import openmp
    from commbench.comm import p2p, tcp
    from commbench.probes import wirecount

    tcp.setting()
    tcp.notsent_setting()
    comm.stage_whole_from()
    p2p.duplex_setting()
    wirecount.shaped_link_gbps()
    wirecount.shaped_burst_bytes()
    openmp.omp_threads()


def launch_spec(args: argparse.Namespace) -> Any:
    from commbench.bench import launch

    check_environment()

    if launch.launched_externally():
        world = external_rank_and_world()[1]
        if args.world_size is not None and args.world_size != world:
            raise ValueError(f"--world-size {args.world_size} disagrees with the launcher's world of {world}")
    else:
        world = 2 if args.world_size is None else args.world_size
        launch.check_local_ranks(world)  # before the checks that size a list by the world
    spec = launch.LaunchSpec(
        world_size=world, device=args.device, backend=args.backend, timeout_s=args.timeout
    )
    check_device(spec.device)
    if spec.resolved_backend == "nccl":
        check_gpus_for_nccl(launch.local_ranks() if launch.launched_externally() else world)
    return spec


def check_gpus_for_nccl(local: int) -> None:
    """Refuse more NCCL ranks on this host than it has GPUs: ranks take the GPU of their local rank
    modulo the count, and NCCL refuses two ranks on one GPU, inside the ranks (exit 1). Not where
    ``$CUDA_VISIBLE_DEVICES`` is set under torchrun or SLURM: the launcher may give each rank a GPU
    of its own, which it then sees as the only one."""
    import os

    import torch

    from commbench.bench import launch

    outside = launch.launched_externally()
    if outside and os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return
    gpus = torch.cuda.device_count()
    if local > gpus:
        fewer = (
            "start at most that many ranks a host (torchrun --nproc-per-node, srun --ntasks-per-node)"
            if outside
            else f"use --world-size {gpus}"
        )
        raise ValueError(
            f"NCCL needs a GPU for each rank: {local} ranks on this host, {gpus} GPU(s); "
            f"{fewer} or --backend gloo"
        )


def external_rank_and_world() -> tuple[int, int]:
    """(rank, world size) that torchrun (RANK, WORLD_SIZE) or SLURM (SLURM_PROCID, SLURM_NTASKS)
    gave this process; ValueError naming the variable where one is not a rank of the world (a rank
    out of range failed deep in gloo with a traceback, or waited out the timeout), or where
    $MASTER_PORT is not a port (torch's "invalid literal for int()" named no variable)."""
    import os

    env = os.environ
    names = (
        ("RANK", "WORLD_SIZE") if "RANK" in env and "WORLD_SIZE" in env else ("SLURM_PROCID", "SLURM_NTASKS")
    )
    values = []
    for name in names:
        try:
            values.append(int(env[name]))
        except (KeyError, ValueError):
            raise ValueError(f"${name}={env.get(name, '')!r} from the launcher is not an integer") from None
    rank, world = values
    if world < 1:
        raise ValueError(f"${names[1]}={world} from the launcher: a world needs at least one rank")
    if not 0 <= rank < world:
        raise ValueError(f"${names[0]}={rank} from the launcher is not a rank of ${names[1]}={world}")
    port = env.get("MASTER_PORT")  # SLURM's jobs may leave it unset: the launch then picks one
    if port is not None and not (port.strip().isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"$MASTER_PORT={port!r} from the launcher is not a TCP port (1 to 65535)")
    return rank, world


def check_device(device: str) -> None:
    """Refuse --device cuda where CUDA is not available (ValueError, one line)."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda asked for, but CUDA is not available here")


def _sweep_rank(config: Any, device: str, plot_path: str | None, command: str | None = None) -> list[dict]:
    """One rank of ``commbench sweep``; rank 0 writes, prints and plots (``command``: the command
    line its header records, see :func:`~commbench.bench.machine.command_line`)."""
    import dataclasses

    import torch.distributed as dist

    from commbench.bench.machine import machine_info, rank_device, rank_places
    from commbench.bench.sweep import Rank0Output, run_rank

    nic = None
    if config.probe:  # every rank: the interface is chosen knowing where the others run
        from commbench.probes.wirecount import agreed_nic

        nic = agreed_nic()
    places = rank_places(rank_device(device))  # every rank: where each runs, for rank 0's header
    sink = None
    if dist.get_rank() == 0:
        sink = Rank0Output(config, {**machine_info(dist.get_backend(), command), "ranks": places}, nic)
    try:
        records = run_rank(config, device, sink if sink is not None else (lambda kind, payload: None), nic)
        if sink is not None:
            sink.finished(records)
    finally:
        if sink is not None:
            sink.close()
    rows = [dataclasses.asdict(r) for r in records]
    if sink is not None and plot_path:
        from commbench.bench.records import plot_or_note
        from commbench.bench.report import plot_busbw

        title = (
            f"{config.collective}, {rank_count(dist.get_world_size())}, {dist.get_backend()} on {device}, "
            f"{config.dtype}"
        )
        plot_or_note(lambda: plot_busbw(rows, plot_path, title), plot_path)
        if sink.probe_record is not None:
            from commbench.bench.report import plot_probe_timeline, timeline_path

            timeline = timeline_path(plot_path)
            plot_or_note(lambda: plot_probe_timeline(sink.probe_record, timeline, title), timeline)
    return rows


def check_sweep(config: Any, spec: Any) -> None:
    """What a sweep's ranks would refuse after they started, the same on every host: a root outside
    the world, sizes that hold no element (this host's memory is :func:`check_sweep_memory`'s)."""
    from commbench.bench.collectives import SPECS

    if SPECS[config.collective].has_root and config.root >= spec.world_size:
        raise ValueError(f"root {config.root} is not a rank of a world of {spec.world_size}")
    _check_some_size_fits(config, spec.world_size)


def _check_some_size_fits(config: Any, world: int) -> None:
    """Raise unless at least one size of the sweep holds an element (per rank where it is split)."""
    from commbench.bench.collectives import SPECS
    from commbench.bench.sweep import sizes
    from commbench.comm.ops import DTYPES

    itemsize = DTYPES[config.dtype].itemsize
    spec = SPECS[config.collective]
    if not any(spec.count(size, itemsize, world) for size in sizes(config)):
        least = itemsize * world if spec.count(itemsize, itemsize, world) == 0 else itemsize
        raise ValueError(
            f"sizes {config.min_bytes} to {config.max_bytes} bytes hold no whole {config.dtype} element "
            f"for {config.collective} on {world} ranks: the smallest size that does is {least} bytes"
        )


def check_sweep_memory(config: Any, spec: Any, local: int | None = None) -> None:
    """Refuse a CPU sweep whose buffers exceed the memory available on this host: its ranks would
    be killed (or fail to allocate) at the largest size, after the smaller ones had run.

    ``local`` is how many of the ranks share this host's memory (default: the local ranks)."""
    import psutil

    from commbench.bench import launch
    from commbench.bench.sweep import buffer_bytes, scratch_per_rank, sizes

    if spec.device != "cpu":
        return
    if local is None:
        local = launch.local_ranks() if launch.launched_externally() else spec.world_size
    # Which ranks share this host is not known before they start: count the ones with most scratch.
    scratch = sorted(scratch_per_rank(config, spec.world_size), reverse=True)[:local]
    need = local * buffer_bytes(config, spec.world_size) + sum(scratch)
    available = psutil.virtual_memory().available
    if need > available:
        raise ValueError(
            f"at {max(sizes(config))} bytes the sweep's buffers and scratch take at least {amount(need)} "
            f"over {local} rank(s) on this host, more than the {amount(available)} of memory available; "
            "lower --maxbytes or run fewer algorithms"
        )


def cmd_sweep(config: Any, spec: Any, plot_path: str | None, command: str | None = None) -> int:
    from commbench.bench import launch
    from commbench.bench.records import check_outputs, plots_beside

    check_sweep(config, spec)
    with launch.node_checks():  # this host's memory and rank 0's files: see node_checks
        check_sweep_memory(config, spec)
        check_outputs(
            json=config.json_path,
            csv=config.csv_path,
            plot=plot_path,
            beside=plots_beside("sweep", plot_path, config.probe),
            writes=launch.writes_outputs(),
        )
    results = launch.run(_sweep_rank, (config, spec.device, plot_path, command), spec)
    # Each rank's points carry the wrong elements of every rank (summed): any rank's tell.
    wrong = wrong_results(next(iter(results.values()), []))
    if wrong is not None:
        print(f"commbench: {wrong}", file=sys.stderr)
        from commbench.bench.cluster import HOST_ENV

        return 0 if os.environ.get(HOST_ENV) == "1" else 1  # a cluster's host: the cluster fails the run
    return 0


def wrong_results(rows: list[dict]) -> str | None:
    """The line that fails a sweep whose check found wrong elements, as nccl-tests exits with a
    failure on any "out of bounds value"; None where every checked point was right. The points
    stay in the records, their #wrong beside them."""
    bad = [r for r in rows if r.get("wrong")]
    if not bad:
        return None
    shown = ", ".join(
        f"{r['collective']} {r['algorithm']} at {r['size_bytes']} B ({r['wrong']})" for r in bad[:3]
    )
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return (
        f"wrong results in {len(bad)} of {len(rows)} points (elements over all ranks that differ from "
        f"the closed form): {shown}{more}"
    )


def _sweep_file(path: str) -> tuple[dict, list[dict]]:
    """(header, records) of a file written by ``commbench sweep --json``; ValueError otherwise."""
    import json

    from commbench.bench.records import check_one_run, numbered_records
    from commbench.bench.reporting import check_record

    try:
        numbered, note = numbered_records(path)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}"
        raise ValueError(f"{path} is not JSON Lines: {where}: {exc.msg}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not JSON Lines: not UTF-8 text") from None
    bad = next((line for line, r in numbered if not isinstance(r, dict)), None)
    if bad is not None:
        raise ValueError(f"{path} line {bad} is not a JSON object")
    check_one_run(path, numbered)
    for line, r in numbered:
        check_record(path, line, r)
    records = [r for _, r in numbered]
    sweep = [r for r in records if r.get("type") == "sweep"]
    missing = next((k for r in sweep for k in SUMMARY_KEYS if k not in r), None)
    if missing:
        raise ValueError(f"{path} has a sweep record without {missing!r}: not written by commbench sweep")
    if not sweep:
        raise ValueError(
            f"{path} holds no sweep records: they come from commbench sweep --json, once a size is done"
        )
    _check_one_sweep(path, [(line, r) for line, r in numbered if r.get("type") == "sweep"])
    if note:
        print(note, file=sys.stderr)
    return next((r for r in records if r.get("type") == "header"), {}), records


def _check_one_sweep(path: str, numbered: list[tuple[int, dict]]) -> None:
    """ValueError where a file's sweep records (with their lines) are not one sweep's: a point given
    twice (the table showed the last, the mean counted both), or points of another collective, world
    size or setting (the table showed them under the first one's heading). commbench writes one sweep
    a file; such files were edited or joined by hand."""
    from commbench.bench.reporting import check_points_once

    def shared(what: tuple) -> tuple:  # what the limit (send/recv) series shares with its sweep
        return tuple(what[i] for i in (1, 2, 3, 4, 6))  # ranks, backend, dtype, block, device

    check_points_once(path, numbered)
    alone = all(r["collective"] == "sendrecv" for _, r in numbered)
    first: dict[bool, tuple[int, tuple]] = {}  # limit or not: its first point's line and setting
    for line, r in numbered:
        limit = r["collective"] == "sendrecv" and not alone
        what = _what([r])
        at, expected = first.setdefault(limit, (line, what))
        if (shared(what) != shared(expected)) if limit else (what != expected):
            raise ValueError(
                f"{path} line {line}: a point of {_describe(what)}, where line {at} has "
                f"{_describe(expected)}; commbench writes one sweep a file"
            )
    if True in first and False in first and shared(first[True][1]) != shared(first[False][1]):
        raise ValueError(
            f"{path} line {first[True][0]}: a send/recv limit of {_describe(first[True][1])}, where the "
            f"sweep is {_describe(first[False][1])}; commbench writes one sweep a file"
        )


def _what(records: list[dict]) -> tuple:
    """(collective, world size, backend, dtype, block, op, device, root, in place) of a sweep
    file's records (its first point's); records written before ``--block`` existed interleaved
    call by call (block 1)."""
    from commbench.bench.collectives import in_place_form

    first = next((r for r in records if r.get("type") == "sweep"), {})
    what = tuple(first.get(k, "?") for k in ("collective", "world_size", "backend", "dtype"))
    root = (
        first.get("root", 0) if first.get("collective") in ("broadcast", "reduce") else 0
    )  # others have none
    return (
        *what,
        first.get("block", 1),
        first.get("op"),
        first.get("device", "cpu"),
        root,
        in_place_form(first),
    )


def _describe(what: tuple) -> str:
    collective, world, backend, dtype, block, op, device, root, in_place = what
    timed = "" if block == 1 else f", --block {block}"
    where = "" if device == "cpu" else f" on {device}"
    how = (f", {op}" if op else "") + (f", root {root}" if root else "")
    from commbench.bench.collectives import form_name
    from commbench.bench.report import one_line

    said = f"{form_name(collective, in_place)}, {rank_count(world)}, {backend}{where}, {dtype}{how}{timed}"
    return one_line(said)  # names from a file written by hand may hold line breaks


def _check_distinct(files: list[str]) -> None:
    """ValueError where two of ``files`` are one file (given twice, or by two names): --across took it
    for two runs, which agreed exactly."""
    seen: dict[tuple[int, int], str] = {}
    for path in files:
        st = os.stat(path)
        if (st.st_dev, st.st_ino) in seen:
            other = seen[st.st_dev, st.st_ino]
            again = f"{path} is given twice" if other == path else f"{other} and {path} are one file"
            raise ValueError(f"--across takes each run once, but {again}")
        seen[st.st_dev, st.st_ino] = path


def cmd_summary(files: list[str], across: bool = False) -> int:
    from commbench.bench.report import (
        closing_lines,
        md_code_block,
        md_code_span,
        md_text,
        one_line,
        ratio_table,
        spread_table,
    )

    loaded = [(path, *_sweep_file(path)) for path in files]
    if across:
        _check_distinct(files)
        whats = {_what(records) for _, _, records in loaded}
        if len(whats) > 1:
            kinds = "; ".join(_describe(w) for w in sorted(whats, key=str))
            raise ValueError(f"--across needs runs of one sweep; these files hold several: {kinds}")
        print(f"### {len(files)} runs: {md_text(_describe(whats.pop()))}\n")
        commands = dict.fromkeys(header.get("command", "?") for _, header, _ in loaded)
        print(md_code_block("\n".join(one_line(c) for c in commands)) + "\n")
        print(spread_table([records for _, _, records in loaded]))
        print()
        return 0
    for path, header, records in loaded:
        print(f"### {md_text(path)}: {md_text(_describe(_what(records)))}")
        print(f"\n{md_code_span(str(header.get('command', '?')))}\n")
        print(ratio_table(records))
        print()
        closing = closing_lines(records)  # as the sweep's table ended
        print("\n".join(f"- {md_text(line)}" for line in closing))
        print()
    return 0


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP outside a launch, raised where Ctrl-C raises KeyboardInterrupt."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


def _raise_stopped(signum: int, frame: Any) -> None:
    raise _Stopped(signum)


def _stops_raise_outside_launches(launch: Any) -> None:
    """SIGTERM and SIGHUP that would take their default action raise :class:`_Stopped` from now
    on, as SIGINT raises KeyboardInterrupt: between the import of the launcher and the launch
    (parsing, checks, matplotlib's import for --plot: about a second) they ended the command
    without its one line. A launch sets its own and puts these back; a handler that the caller
    set (a study running its commands) or an inherited ignore is left as it is.

    Not in a rank that torchrun, SLURM or the cluster started: it is this process, and it joins
    its group in C++ waits (the rendezvous) that a Python handler sits out, so a stop from its
    launcher waited for the whole --timeout; the default action ends it at once."""
    if threading.current_thread() is not threading.main_thread() or launch.launched_externally():
        return
    for s in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(s) == signal.SIG_DFL:
            signal.signal(s, _raise_stopped)


class _SignalWhileLoading(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def _import_launch() -> Any:
    """The launcher module, imported (with torch, seconds) while the stop signals wait.

    A KeyboardInterrupt raised inside torch's import can end in a C++ abort; held back, the
    signal is reported once the import is done (:class:`_SignalWhileLoading`). SIGHUP (a closed
    terminal) waits too: it ended the command silently, with exit code 129 and its multiprocessing
    directory left behind.
    """
    from commbench.bench import signals

    with signals.noted(signals.STOPS) as held:
        from commbench.bench import launch
    if held:
        raise _SignalWhileLoading(held[0])
    return launch


def _rank_here() -> str:
    """This process's rank as its launcher (torchrun or SLURM) numbers it (one that cannot be
    read is taken for rank 0 by ``launch.writes_outputs``, and never asked here)."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "?"))


def _kept(path: str | None, before: tuple[int, int, int] | None = None, *, csv: bool = False) -> str:
    """What an interrupted run left in ``path`` (JSON Lines, or with ``csv`` a CSV file), for its
    one-line message; ``before`` is the file's :func:`~commbench.bench.records.file_stamp` when the
    run began: a file this run never wrote holds an earlier run's points, not its own."""
    if not path:
        return ""
    from commbench.bench.records import is_stream, loads, shown

    if is_stream(path):  # a pipe or a terminal (/dev/stdout, >(jq .)): no stamp, nothing to read back
        return f"; each point went to {shown(path)} as it finished"
    now = file_stamp(path)
    if now is None and before is None:  # stopped before the run opened it
        return f"; nothing had finished, {shown(path)} was not written"
    if before is not None and now == before:
        return f"; nothing had finished, {shown(path)} is as it was before this run"

    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        text = ""
    if csv:  # a header line with the first point, then a line each; one cut short is no point
        points = max(text.count("\n") - 1, 0)
    else:
        points = 0
        for line in text.splitlines():  # a line cut short by the stop does not hide the ones before
            try:
                points += loads(line).get("type") not in ("header", "probe")
            except (ValueError, AttributeError):
                pass
    if points:
        return f"; finished points are in {shown(path)}"
    return f"; nothing had finished, {shown(path)} holds no points"


def _records_path(args: argparse.Namespace) -> str | None:
    """The file the command writes its finished points to, if any: JSON Lines, else a sweep's CSV."""
    json_path = getattr(args, "json", None) or ("results/demo.jsonl" if args.command == "demo" else None)
    return json_path or getattr(args, "csv", None)


# Commands that start local ranks in this process (profile and cluster start commbench processes).
LAUNCHING = ("sweep", "demo", "train", "compare", "study")


def _start_rank_server(argv: list[str] | None) -> str | None:
    """Start the fork server for local ranks now when this command will start some, so that its
    import of torch runs beside this process's own (:mod:`commbench.bench.starter`). Returns why
    it cannot start where the cause is the user's to fix (a $TMPDIR too long), else None."""
    from commbench.bench import starter

    words = sys.argv[1:] if argv is None else argv
    command = next((w for w in words if not w.startswith("-")), None)
    if (
        command in LAUNCHING
        and not {"-h", "--help", "--version"} & set(words)
        and not starter.launched_externally()
    ):
        if _world_size_asked(words) <= starter.FORKSERVER_MAX_RANKS:  # more are spawned: no server
            try:
                starter.start()
            except starter.TempDirTooLong as exc:
                return str(exc)
    return None


def _world_size_asked(words: list[str]) -> int:
    """The ``--world-size`` on a command line (0 where none, or none readable, is given)."""
    for i, w in enumerate(words):
        text = w.partition("=")[2] if w.startswith("--world-size=") else None
        if w == "--world-size" and i + 1 < len(words):
            text = words[i + 1]
        if text is not None:
            try:
                return int(text)
            except ValueError:
                return 0
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``commbench`` command; returns the exit code.

    The stop signals' handlers are as before when it returns: an interrupted run makes further
    stops do nothing while it reports and cleans up, and that stayed in a process that called
    this (a study runs every command through it, tests do too) and went on. The command's own
    process keeps them ignored for its exit (``commbench.__main__``)."""
    from commbench.bench import signals

    before = (
        {s: signal.getsignal(s) for s in signals.STOPS}
        if threading.current_thread() is threading.main_thread()
        else {}
    )
    try:
        return _main(argv)
    finally:
        signals.restore(before)


def _main(argv: list[str] | None) -> int:
    from commbench.bench.records import note_given_descriptors

    note_given_descriptors()  # before the rank server's pipes: what --json /dev/fd/N may name
    if (sys.argv[1:] if argv is None else argv)[:1] == ["--version"]:
        # as argparse's version action says it (it acts before any word after it is read), without
        # the parser's import of torch: seconds for one line
        print(f"commbench {commbench.__version__}")
        return 0
    try:
        refused = _start_rank_server(argv)
        if refused is not None:
            _error_line(f"commbench: error: {refused}")
            return 2
        launch = _import_launch()
        _stops_raise_outside_launches(launch)
    except (_SignalWhileLoading, KeyboardInterrupt) as exc:  # KeyboardInterrupt: while the rank server starts
        from commbench.bench import signals

        signals.ignore_further(exiting=True)
        print("commbench: interrupted", file=sys.stderr)
        return 128 + getattr(exc, "signum", signal.SIGINT)
    Interrupted, RankFailed = launch.Interrupted, launch.RankFailed
    NotStarted = launch.starter.ServerNotReady

    args = None
    try:
        args = build_parser().parse_args(argv)
        from commbench.bench.machine import command_line

        args.command_line = command_line(argv)  # the records' header: this command's, not its caller's
        from commbench.bench.cluster import COMMAND_ENV, HOST_ENV

        if os.environ.get(HOST_ENV) == "1" and os.environ.get(COMMAND_ENV):
            args.command_line = os.environ[COMMAND_ENV]  # a cluster's host: the cluster's command
        # The records file as it is before the run (a cluster's, named by its inner command, is
        # stamped by commbench.bench.cluster.run once it has parsed that).
        args.records_before = file_stamp(_records_path(args))
        if args.command == "sweep":
            return cmd_sweep(sweep_config(args), launch_spec(args), args.plot, args.command_line)
        if args.command == "summary":
            return cmd_summary(args.files, args.across)
        if args.command in ("bandwidth", "profile") and launch.launched_externally():
            what, into = (
                ("runs in one process", "one --json file")
                if args.command == "bandwidth"
                else ("starts the command it profiles, and its ranks", "one directory")
            )
            raise ValueError(
                f"commbench {args.command} {what}, but RANK and WORLD_SIZE (or SLURM's variables) are "
                f"set, as torchrun and srun set them: each rank would run it on its own, into {into}; "
                "run it without the launcher"
            )
        if args.command in ("report", "study", "profile"):
            from commbench.bench import profile, reporting, study

            return {"report": reporting.run, "study": study.run, "profile": profile.run}[args.command](args)
        if args.command == "cluster":
            from commbench.bench import cluster, netns

            try:
                return cluster.run(args)
            except netns.ClusterError as exc:
                _error_line(f"commbench: cluster: {exc}")
                return cluster.NOT_BUILT
        if args.command == "bandwidth":
            from commbench.bench import bandwidth

            return bandwidth.run(args)
        if args.command in ("train", "compare"):
            from commbench.bench import train

            config = train.train_config(args)
            if train.runs_alone(args, config):
                args.world_size = 1  # none, dp and vanilla-dp run in one process
            return train.cmd_train(config, launch_spec(args), args.command_line, args.command)
        if args.command == "demo":
            if launch.launched_externally():  # every rank would start a demo of its own, into one file
                raise ValueError(
                    "commbench demo starts its own two ranks, but RANK and WORLD_SIZE (or SLURM's "
                    "variables) are set, as torchrun and srun set them: unset them, or run commbench "
                    "sweep under the launcher"
                )
            check_environment()  # before the directory: a refused run leaves nothing behind
            try:
                Path("results").mkdir(exist_ok=True)
            except OSError as exc:
                raise ValueError(f"cannot make the directory results here: {exc.strerror}") from None
            demo = build_parser().parse_args(
                [
                    "sweep",
                    "-b",
                    "4K",
                    "-e",
                    "16M",
                    "-f",
                    "4",
                    "-n",
                    "10",
                    "-w",
                    "3",
                    "--world-size",
                    "2",
                    "--json",
                    "results/demo.jsonl",
                    "--plot",
                    "results/demo.png",
                ]
                + (["-q"] if args.quiet else [])
            )
            code = cmd_sweep(sweep_config(demo), launch_spec(demo), demo.plot, args.command_line)
            if not args.quiet:
                print("\nrecords: results/demo.jsonl   plots: results/demo.png, results/demo-timeline.png")
            return code
    except UsageError as exc:
        _error_line(str(exc))
        return 2
    except (ValueError, TypeError) as exc:
        _error_line(f"commbench: error: {exc}")
        return 2
    except NotStarted as exc:
        _error_line(f"commbench: {exc}")
        return 1
    except RankFailed as exc:
        _error_line(f"commbench: {exc}")
        bad_input = exc.bad_input or exc.detail.startswith(("ValueError", "TypeError"))
        return 2 if bad_input else 1
    except (KeyboardInterrupt, Interrupted) as exc:
        from commbench.bench import signals  # loaded already, by the launcher's module

        signals.ignore_further(exiting=True)  # a second Ctrl-C would cut the exit's clean-up short
        kept = ""
        path = _records_path(args) if args else None
        if path and args.command in ("sweep", "train", "compare") and not launch.writes_outputs():
            # another rank of torchrun's or SLURM's, whose rank 0 alone writes: on another node the
            # path read here said "nothing had finished, ... was not written" of rank 0's records
            kept = f"; rank 0 writes the finished points (this is rank {_rank_here()})"
        elif path:
            kept = _kept(path, getattr(args, "records_before", None), csv=path == getattr(args, "csv", None))
        print("commbench: interrupted" + kept, file=sys.stderr)
        return 128 + getattr(exc, "signum", 2)
    except BrokenPipeError:
        # The reader of our output left (`commbench summary ... | head`): stop quietly, as a
        # shell tool does on SIGPIPE; stdout goes to /dev/null so exiting does not flush into it.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except OSError as exc:  # the file system refused what no check foresaw (a directory without access)
        _error_line(f"commbench: error: {exc}")
        return 1
    return 0


def _error_line(text: str) -> None:
    """Print an error on standard error in one line: a name given with a line break split it."""
    print(escape_breaks(text), file=sys.stderr)
