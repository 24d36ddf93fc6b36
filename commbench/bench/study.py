"""``commbench study NAME``: re-run a reference study as a list of commbench runs, then report it.

A study is a plain TOML file in ``commbench/studies/`` (its stem is its name). It holds shared ``defaults``
and ``[[group]]`` tables; each group is one commbench command (sweep, train or compare) with
``options`` (command-line flags without the dashes) and a ``grid`` (flag -> list of values) whose
product gives the group's runs. ``[group.full]`` / ``[group.tiny]`` change options and grid at
``--full`` (the study's original sizes, for GPU clusters) and ``--tiny`` (a smoke test) scale.
At ``--full`` a group's own options and grid outrank the study's ``[defaults.full]`` and its own
``[group.full]`` outranks both; at ``--tiny`` the study's ``[defaults.tiny]`` shrinks every
group's options, and ``[group.tiny]`` comes last.
Groups with ``cluster = true`` run under ``commbench cluster`` (one host per rank) where it can be
built, and on local ranks otherwise; the report says which. ``metrics`` are the table's columns and
``plot`` the charts drawn per group, one metric each or several joined by ``+`` (``"compute_ms+comm_ms"``:
side by side in one chart, on one axis, so best of one unit).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import hashlib
import io
import ipaddress
import itertools
import json
import math
import os
import re
import shlex
import signal
import statistics
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from commbench.bench import reporting as rp
from commbench.bench import signals
from commbench.bench.cluster import NOT_BUILT
from commbench.bench.records import directory_held, exposed_comm_ms, file_stamp, loads, output_path
from commbench.probes.wirecheck import CPU_COUNTED_MIN_S, NOT_JUDGED, says_off
from commbench.units import rank_count

SCALES = ("tiny", "default", "full")
COMMANDS = ("sweep", "train", "compare")
SCALE_ENV = "COMMBENCH_STUDY_SCALE"
INTERRUPTED = tuple(128 + s for s in signals.STOPS)  # a run's exit code when a signal stopped it
STUDY_KEYS = {"title", "reference", "about", "metrics", "plot", "defaults", "group", "cluster_rate"}
GROUP_KEYS = {
    "label",
    "command",
    "options",
    "grid",
    "full",
    "tiny",
    "cluster",
    "scales",
    "timelines",
    "note",
    "inherit",
}
DEFAULTS_KEYS = {"command", "options", "full", "tiny"}
SCALE_KEYS = {"options", "grid"}
UNSET = "unset"  # a model-opt value that removes the option
TINY_TRAIN = {"steps-per-epoch": 2, "no-eval": True, "replicate": 1}
TINY_SWEEP = {"minbytes": "64K", "maxbytes": "256K", "stepfactor": 4, "iters": 2, "warmup": 1}
TINY_CAPS = {"epochs": 2, "batch-size": 16, "samples": 256}  # a training run's, at most


def studies_dir() -> Path:
    """``commbench/studies/``, shipped inside the package so that an installed commbench (not only a
    checkout) finds its presets."""
    return Path(__file__).resolve().parents[1] / "studies"


def known_studies(directory: Path | None = None) -> list[str]:
    return sorted(p.stem for p in (directory or studies_dir()).glob("*.toml"))


# ---- the preset -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Group:
    """One command and its grid, as written in the TOML file."""

    label: str
    command: str
    options: dict[str, Any]
    grid: dict[str, list[Any]]
    full: dict[str, Any]
    tiny: dict[str, Any]
    cluster: bool = False
    scales: tuple[str, ...] = SCALES
    timelines: bool = False
    note: str = ""

    def __post_init__(self) -> None:
        if self.command not in COMMANDS:
            raise ValueError(
                f"group {self.label!r}: command must be one of {', '.join(COMMANDS)}, got {self.command!r}"
            )
        _grid(self.grid, f"group {self.label!r}: grid")
        for scale in self.scales:
            if scale not in SCALES:
                raise ValueError(
                    f"group {self.label!r}: unknown scale {scale!r}; choose from {', '.join(SCALES)}"
                )
        for name, table_ in (("full", self.full), ("tiny", self.tiny)):
            _scale_table(table_, f"group {self.label!r}: [{name}]")  # as load_study checks a file's


@dataclasses.dataclass(frozen=True, kw_only=True)
class Study:
    """A parsed preset."""

    name: str
    title: str
    reference: str
    about: str
    metrics: tuple[str, ...]
    plot: tuple[str, ...]
    groups: tuple[Group, ...]
    cluster_rate: str = "1gbit"

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError(f"study {self.name}: no [[group]]")
        for entry in self.plot:  # "a+b": both in one chart
            parts = entry.split("+")
            if "" in parts or len(set(parts)) < len(parts):
                raise ValueError(
                    f"study {self.name}: plot entry {entry!r} needs metrics joined by '+', each once"
                )
        drawn = [m for entry in self.plot for m in entry.split("+")]
        for m in (*self.metrics, *drawn):
            if m not in METRICS:
                raise ValueError(f"study {self.name}: unknown metric {m!r}; choose from {', '.join(METRICS)}")
        for m in drawn:
            if m not in self.metrics:
                raise ValueError(
                    f"study {self.name}: plot {m!r} is not in metrics (a plot draws a metric's column)"
                )
        labels = [g.label for g in self.groups]
        for label in labels:
            if labels.count(label) > 1:
                raise ValueError(
                    f"study {self.name}: two groups are labelled {label!r} "
                    "(the report gives each group its own table)"
                )


def load_study(name: str, directory: Path | None = None) -> Study:
    """Parse ``commbench/studies/NAME.toml``; ValueError names the unknown study or the bad entry. A
    name is a stem in ``commbench/studies/``, not a path: "/tmp/x" once read /tmp/x.toml and named its
    output study-/tmp/x."""
    directory = directory or studies_dir()
    path, known = directory / f"{name}.toml", known_studies(directory)
    if name not in known or not path.is_file():
        raise ValueError(
            f"unknown study {name!r} (a file stem in commbench/studies/); known: {', '.join(known) or 'none'}"
        )
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: {exc}") from None
    extra = set(data) - STUDY_KEYS
    if extra:
        raise ValueError(f"{path}: unknown keys {sorted(extra)}")
    for key in ("title", "reference", "about"):
        if key not in data:
            raise ValueError(f"{path}: {key} (a string) is missing")
    for key in ("title", "reference", "about", "cluster_rate"):
        _check(data.get(key, ""), str, f"{path}: {key}")
    for key in ("metrics", "plot"):
        _strings(data.get(key, []), f"{path}: {key}")
    shared = _check(data.get("defaults", {}), dict, f"{path}: [defaults]")
    _keys(shared, DEFAULTS_KEYS, f"{path}: [defaults]")
    _check(shared.get("command", ""), str, f"{path}: [defaults] command")
    _check(shared.get("options", {}), dict, f"{path}: [defaults] options")
    for scale in ("full", "tiny"):
        _scale_table(shared.get(scale, {}), f"{path}: [defaults.{scale}]")
    groups = []
    for i, g in enumerate(_check(data.get("group", []), list, f"{path}: group"), 1):
        _check(g, dict, f"{path}: group {i}")
        extra = set(g) - GROUP_KEYS
        if extra:
            raise ValueError(f"{path}: group {i} has unknown keys {sorted(extra)}")
        for key in ("label", "command", "note"):
            _check(g.get(key, ""), str, f"{path}: group {i}: {key}")
        for key in ("cluster", "timelines", "inherit"):
            _check(g.get(key, False), bool, f"{path}: group {i}: {key}")
        _strings(g.get("scales", []), f"{path}: group {i}: scales")
        _check(g.get("options", {}), dict, f"{path}: group {i}: options")
        _check(g.get("grid", {}), dict, f"{path}: group {i}: grid")
        for scale in ("full", "tiny"):
            _scale_table(g.get(scale, {}), f"{path}: group {i}: [{scale}]")
        defaults = shared if g.get("inherit", True) else {}
        groups.append(
            Group(
                label=g.get("label", f"group {i}"),
                command=g.get("command", defaults.get("command", "compare")),
                options=_apply(_apply({}, defaults.get("options", {})), g.get("options", {})),
                grid=g.get("grid", {}),
                # A group's own options and grid outrank the study's full-scale defaults;
                # its [full] outranks both.
                full=_merge_scale(defaults.get("full", {}), g.get("full", {}), g),
                tiny=_merge_scale(defaults.get("tiny", {}), g.get("tiny", {})),
                cluster=g.get("cluster", False),
                scales=tuple(g.get("scales", SCALES)),
                timelines=g.get("timelines", False),
                note=g.get("note", ""),
            )
        )
    return Study(
        name=name,
        title=data["title"],
        reference=data["reference"],
        about=data["about"].strip(),
        metrics=tuple(data.get("metrics", ())),
        plot=tuple(data.get("plot", ())),
        groups=tuple(groups),
        cluster_rate=data.get("cluster_rate", "1gbit"),
    )


_KINDS = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "a table",
}


def _check(value: Any, kind: type, what: str) -> Any:
    """``value``, where it is a ``kind`` (str, bool, list or dict); ValueError naming ``what``
    and what it is instead otherwise."""
    if isinstance(value, kind):
        return value
    got = next((name for t, name in _KINDS.items() if isinstance(value, t)), type(value).__name__)
    shown = f" ({value!r})" if isinstance(value, str | int | float) else ""
    raise ValueError(f"{what} must be {_KINDS[kind]}, got {got}{shown}")


def _strings(value: Any, what: str) -> list[str]:
    for item in _check(value, list, what):
        if not isinstance(item, str):
            raise ValueError(f"{what} must be a list of strings, got {item!r} in it")
    return value


def _keys(table: dict[str, Any], known: set[str], what: str) -> None:
    extra = set(table) - known
    if extra:
        raise ValueError(f"{what} has unknown keys {sorted(extra)}; it takes {', '.join(sorted(known))}")


def _grid(grid: dict[str, Any], what: str) -> dict[str, list[Any]]:
    """``grid``, where every axis is a non-empty list (a string's letters, or nothing, otherwise)."""
    for name, axis in _check(grid, dict, what).items():
        if not isinstance(axis, list) or not axis:
            raise ValueError(f"{what} {name!r} must be a non-empty list")
    return grid


def _scale_table(table: Any, what: str) -> None:
    """A ``full`` or ``tiny`` table, the study's or a group's: options and a grid."""
    _keys(_check(table, dict, what), SCALE_KEYS, what)
    _check(table.get("options", {}), dict, f"{what} options")
    _grid(table.get("grid", {}), f"{what} grid")


def _merge_scale(
    base: dict[str, Any], own: dict[str, Any], group: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A scale's table: the study's defaults for it, then the ``group``'s own options and grid
    (where those outrank the defaults: a defaults' grid axis that the group sets itself is left
    out), then the group's own table for it."""
    between = (group or {}).get("options", {})
    mine = {*between, *(group or {}).get("grid", {})}
    return {
        "options": _apply(_apply(_apply({}, base.get("options", {})), between), own.get("options", {})),
        "grid": {
            **{k: v for k, v in base.get("grid", {}).items() if k not in mine},
            **own.get("grid", {}),
        },
        **{k: v for k, v in own.items() if k not in ("options", "grid")},
    }


# ---- planning -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Planned:
    """One commbench run of a study: its group, grid point and command line."""

    group: str
    index: int
    point: tuple[tuple[str, Any], ...]
    argv: tuple[str, ...]
    json_path: str
    local_argv: tuple[str, ...] | None = None  # the same run on local ranks, for a cluster group
    note: str = ""
    # The grid point as the study designed it, where the scale ran it otherwise (tiny: batch size 64
    # runs as 16); None where ``point`` is the design's.
    designed: tuple[tuple[str, Any], ...] | None = None


def _flags(options: dict[str, Any]) -> list[str]:
    """Flags from an options table: true -> bare flag, false -> left out, lists joined by commas;
    ``model-opt`` (a table or KEY=VALUE strings) -> one flag per entry."""
    argv: list[str] = []
    for key, value in options.items():
        if key == "model-opt":
            for k, v in value.items():
                if v != UNSET:
                    argv += ["--model-opt", f"{k}={_text(v)}"]
        elif value is True:
            argv.append(f"--{key}")
        elif value is False or value is None:
            continue
        else:
            argv += [f"--{key}", _text(value)]
    return argv


def _text(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _model_opts(value: Any) -> dict[str, Any]:
    """model-opt as a dict, from a table, one KEY=VALUE string or a list of them."""
    if isinstance(value, dict):
        return dict(value)
    if value is None:
        return {}
    if not isinstance(value, str | list):
        raise ValueError(f"model-opt must be a table, KEY=VALUE or a list of those, got {value!r}")
    items = [value] if isinstance(value, str) else value
    out = {}
    for item in items:
        key, sep, v = str(item).partition("=")
        if not sep:
            raise ValueError(f"model-opt {item!r} is not KEY=VALUE")
        out[key.strip()] = v.strip()
    return out


def _apply(options: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(options)
    for key, value in changes.items():
        if key == "model-opt" and value is False:
            out.pop("model-opt", None)
        elif key == "model-opt":  # merged key by key; UNSET drops a key (back to the model's default)
            merged = {**_model_opts(out.get("model-opt")), **_model_opts(value)}
            out["model-opt"] = merged
        else:
            out[key] = value
    return out


def _shrink(command: str, options: dict[str, Any]) -> dict[str, Any]:
    """The tiny scale: every run as short as it can be while still running the same code."""
    out = dict(options)
    if command == "sweep":
        out.update(TINY_SWEEP)
        return out
    out.update(TINY_TRAIN)
    out["epochs"] = min(int(out.get("epochs", 1)), TINY_CAPS["epochs"])
    out["batch-size"] = min(int(out.get("batch-size", 64)), TINY_CAPS["batch-size"])
    if out.get("samples"):
        out["samples"] = min(int(out["samples"]), TINY_CAPS["samples"])
    return out


def _shortened(commands: Iterable[str]) -> str:
    """How the tiny scale shortens runs of ``commands``, in words (from _shrink's settings)."""
    said = []
    if any(c != "sweep" for c in commands):
        said.append(
            f"at most {TINY_CAPS['epochs']} epochs of {TINY_TRAIN['steps-per-epoch']} steps, a batch of "
            f"at most {TINY_CAPS['batch-size']} a rank and {TINY_CAPS['samples']} samples, no held-out "
            "pass"
        )
    if "sweep" in commands:
        said.append(
            f"sizes {TINY_SWEEP['minbytes']} to {TINY_SWEEP['maxbytes']}, {TINY_SWEEP['iters']} timed "
            f"iterations after {TINY_SWEEP['warmup']} warm-up"
        )
    return "; ".join(said)


def _as_run(key: str, value: Any, options: dict[str, Any]) -> Any:
    """A grid point's ``value`` for ``key`` as the run's ``options`` have it; for model-opt, the
    point's own keys."""
    if key not in options:
        return value
    if key == "model-opt":
        return {k: options[key].get(k, UNSET) for k in _model_opts(value)}
    return options[key]


MAX_RUNS = 10_000  # of one study at one scale


def plan(study: Study, scale: str, out_dir: str | Path, cluster_ok: bool = True) -> list[Planned]:
    """Every run of ``study`` at ``scale`` with the command line that makes it; ValueError where
    no group runs at ``scale``."""
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose from {', '.join(SCALES)}")
    runs_dir = Path(out_dir) / "runs"
    planned: list[Planned] = []
    for group in study.groups:
        if scale not in group.scales:
            continue
        options = _apply({}, group.options)
        grid = dict(group.grid)
        if scale == "full":
            options = _apply(options, group.full.get("options", {}))
            grid.update(group.full.get("grid", {}))
        if scale == "tiny":  # one run per study: the first point of the first group, shrunk
            if planned:
                break
            grid = {k: v[:1] for k, v in {**grid, **group.tiny.get("grid", {})}.items()}
        keys = list(grid)
        points = math.prod(len(grid[k]) for k in keys)
        if len(planned) + points > MAX_RUNS:  # counted first: a grid of 10^8 points planned for ever
            # the group that crossed the limit, alone or after the groups before it
            why = f"group {group.label!r}'s grid " + (
                f"adds {points} to the {len(planned)} before it" if planned else f"alone has {points}"
            )
            raise ValueError(
                f"study {study.name} plans more than {MAX_RUNS} runs ({why}); a study is run by run, "
                "and that many would not end"
            )
        for values in itertools.product(*(grid[k] for k in keys)):
            point = tuple(zip(keys, values, strict=True))
            run_options = _apply(options, dict(point))
            designed = None
            if scale == "tiny":  # shrunk: the point says what runs (grid batch size 64 runs as 16)
                run_options = _apply(_shrink(group.command, run_options), group.tiny.get("options", {}))
                designed = point
                point = tuple((k, _as_run(k, v, run_options)) for k, v in point)
                designed = None if designed == point else designed
            index = len(planned) + 1
            # Another scale's runs in the same directory keep their records (a tiny run overwrote
            # the default scale's first run, which its --resume then ran again).
            prefix = "" if scale == "default" else f"{scale}-"
            json_path = str(runs_dir / f"{prefix}{index:02d}-{rp._slug(group.label)}.jsonl")
            local = [group.command, *_flags(run_options), "--json", json_path]
            argv, local_argv, note = local, None, ""
            if group.cluster and scale != "tiny" and cluster_ok:
                hosts = str(run_options.get("world-size", 2))
                inner = {k: v for k, v in run_options.items() if k != "world-size"}
                argv = ["cluster", "--hosts", hosts, "--rate", study.cluster_rate, "--", group.command]
                argv += [*_flags(inner), "--json", json_path]
                local_argv = tuple(local)
            elif group.cluster:
                note = "local ranks: " + (
                    "the tiny scale skips the emulated cluster"
                    if scale == "tiny"
                    else "no emulated cluster here"
                )
            planned.append(
                Planned(
                    group=group.label,
                    index=index,
                    point=point,
                    argv=tuple(argv),
                    json_path=json_path,
                    local_argv=local_argv,
                    note=note,
                    designed=designed,
                )
            )
    if not planned:  # an empty report, and exit 0, would read as a study that ran
        at = {"full": "--full", "tiny": "--tiny"}.get(scale, "the default scale")
        scales = [s for s in SCALES if any(s in g.scales for g in study.groups)]
        raise ValueError(f"study {study.name} has no runs at {at} (its groups' scales: {', '.join(scales)})")
    return planned


def validate(planned: Sequence[Planned]) -> list[Planned]:
    """Parse every planned command line as the CLI would, and build its config (ValueError if
    bad); returns the runs that ask for ``--device cuda``."""
    from commbench.bench import cli, starter

    cli.check_environment()  # every run would refuse it on its own
    parser = cli.build_parser()
    on_cuda = []
    for p in planned:
        for argv in filter(None, (p.argv, p.local_argv)):
            try:
                args = _parsed(parser, argv)
                world = 2 if getattr(args, "world_size", None) is None else args.world_size
                if args.command == "cluster":
                    from commbench.bench import cluster

                    hosts = cluster.config_from_args(args)
                    world = hosts.hosts
                    args = _parsed(parser, [*hosts.inner, "--world-size", "1"])
                outer = starter.launched_externally() and args.command != "cluster"
                if outer and getattr(args, "world_size", None) is not None:
                    world = cli.external_rank_and_world()[1]  # the runs join the outer launcher's world
                    if args.world_size != world:  # as the run itself refuses it, after the others
                        raise ValueError(
                            f"--world-size {args.world_size} disagrees with the launcher's world of {world}"
                        )
                if args.command in ("train", "compare"):
                    from commbench.bench import train

                    config = train.train_config(args)
                    if train.runs_alone(args, config):
                        world = 1  # as the CLI runs none, dp and vanilla-dp alone
                    elif getattr(args, "world_size", None) is None and starter.launched_externally():
                        world = cli.external_rank_and_world()[1]  # the runs join the outer launcher's world
                    train.check_launch(config, world, args.device)
                elif args.command == "sweep":
                    cli.sweep_config(args)
            except (cli.UsageError, ValueError, TypeError) as exc:
                raise ValueError(f"run {p.index} ({p.group}): {exc}: {shlex.join(argv)}") from None
        if getattr(args, "device", None) == "cuda":
            on_cuda.append(p)
    return on_cuda


def _parsed(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed as the CLI would, for a run of a study; ValueError for options that are the
    study's own to set (its records go to runs/, its report draws the plots: a study file's plot or
    csv wrote every run to one file outside the study's directory) or that run nothing (help
    printed its text and the study ended with exit 0)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = parser.parse_args(list(argv))
    except SystemExit:
        raise ValueError("it prints the command's help (or version) and runs nothing") from None
    for name in ("csv", "plot"):
        if getattr(args, name, None) is not None:
            raise ValueError(
                f"--{name} is the study's to set: its runs' records go to runs/, its report draws"
            )
    return args


def check_cuda(on_cuda: Sequence[Planned], total: int, scale: str) -> None:
    """Refuse, before any run starts, a study whose runs ask for CUDA where torch sees none: each
    run would otherwise fail on its own with the same message."""
    import torch

    if on_cuda and not torch.cuda.is_available():
        flag = {"full": " at --full", "tiny": " at --tiny"}.get(scale, "")
        raise ValueError(
            f"{len(on_cuda)} of the {total} runs of this study{flag} use --device cuda, and CUDA is "
            "not available here (--dry-run lists the runs)"
        )


def cluster_available() -> str | None:
    """None when ``commbench cluster`` can run here; otherwise why not."""
    try:
        from commbench.bench import netns
    except ImportError:
        return "commbench cluster is not installed"
    try:
        netns.check_privileges()
    except (ValueError, OSError) as exc:
        return str(exc)
    return None


def _why_no_cluster(study: Study, scale: str) -> str | None:
    """Why the study's cluster groups run on local ranks at ``scale`` here; None where they run on
    an emulated cluster, or where it has none (and at --tiny, which never builds one)."""
    return cluster_available() if any(g.cluster for g in study.groups) and scale != "tiny" else None


# ---- running --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outcome:
    """A finished run: the command that ran, its exit code and wall time, and for a failed run the
    last line it wrote to stderr (its one-line error). ``resumed``: finished by an earlier start."""

    planned: Planned
    argv: tuple[str, ...]
    returncode: int
    seconds: float
    note: str = ""
    error: str = ""
    resumed: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudyResult:
    """What ``run_study`` did: every planned run, the outcomes of those that ran (in order), the
    report's Markdown path (None if even a partial one could not be written) and, for a study that a
    signal stopped, the exit code that says which (130, 143 or 129)."""

    planned: list[Planned]
    outcomes: list[Outcome]
    report: Path | None
    stopped: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudyConfig:
    """``commbench study``: which preset, at what scale, written where."""

    name: str
    scale: str = "default"
    out_dir: str | None = None
    quiet: bool = False
    resume: bool = False

    def __post_init__(self) -> None:
        if self.scale not in SCALES:
            raise ValueError(f"unknown scale {self.scale!r}; choose from {', '.join(SCALES)}")

    @property
    def directory(self) -> Path:
        return Path(self.out_dir or f"study-{self.name}")


PROGRESS = "progress.jsonl"  # in DIR/runs: one line per finished run, what --resume reads


def run_study(
    config: StudyConfig,
    execute: Callable[[list[str]], int] | None = None,
    on_run: Callable[[Planned, int], None] | None = None,
    on_kept: Callable[[Planned, int], None] | None = None,
) -> StudyResult:
    """Run every planned command (``execute`` defaults to the CLI in this process), then write the
    report; ``on_run`` and ``on_kept`` hear of each run as it starts or is kept. Each finished run is
    added to ``DIR/runs/progress.jsonl`` at once; with ``config.resume`` the runs an earlier start
    finished (exit 0, the same command line, its records as it left them) are kept and not run again.

    A run that exits with 130, 143 or 129 was interrupted (and said so), and SIGINT, SIGTERM or SIGHUP
    between runs does the same: the study stops there and writes a partial report of the runs that
    finished, which lists those not run; ``stopped`` gives the code.

    Raises:
        ValueError: a bad preset or command line, or an output directory that cannot be made.
    """
    from commbench.bench.cli import main as cli_main
    from commbench.bench.launch import Interrupted

    execute = execute or cli_main
    study = load_study(config.name)
    out = config.directory
    why_not = _why_no_cluster(study, config.scale)
    planned = plan(study, config.scale, out, cluster_ok=why_not is None)
    clustered = {g.label for g in study.groups if g.cluster}
    check_cuda(validate(planned), len(planned), config.scale)
    from commbench.bench import starter
    from commbench.bench.launch import writes_outputs

    writes = writes_outputs()  # under torchrun or SLURM rank 0 alone, as for each run's records
    if config.resume and starter.launched_externally():
        raise ValueError(
            "--resume under torchrun or SLURM: each rank would keep the runs its own node's DIR "
            "holds, and the ranks would then run different runs; start the study over, or run it "
            "without the launcher"
        )
    if writes:
        try:
            (out / "runs").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot create {out / 'runs'}: {exc.strerror}") from None
        for name in ("report.md", "report.html"):  # written once every run is done: refused before any
            rp.check_target(out / name, "the study's report")
    outcomes: list[Outcome] = []
    stopped = None

    def keep(o: Outcome) -> None:
        """Its progress line first, and then the report's list: a stop that arrives once the run has
        returned waits for both (``arm.release``)."""
        try:
            progress.write(json.dumps(_progress_line(o, out)) + "\n")
            progress.flush()
        except OSError as exc:  # a full disk: said with the file, not as a bare errno
            with contextlib.suppress(OSError):  # closed now: its close would fail again, over this
                progress.close()
            raise OSError(exc.errno, f"{exc.strerror} (the runs' records are kept)", progress.name) from None
        outcomes.append(o)

    # The handlers first: progress.jsonl is replaced under them, so a stop while it is rewritten
    # is a stop like one between runs, and leaves the earlier start's file as it was.
    with _signals_interrupt() as arm, contextlib.ExitStack() as files:
        done: dict[int, Outcome] = {}
        others: list[str] = []
        if writes:
            # before its progress file is read: another study may be writing it
            files.enter_context(directory_held(out))
            try:
                done, others = _finished(out, planned)
            except ValueError:
                if config.resume:
                    raise  # else a start over: an unreadable progress file is replaced
        if not config.resume:  # its own runs all run again; other scales' are kept for their --resume
            done = {}
        try:
            progress = files.enter_context(
                _restart_progress(out, done.values(), others) if writes else open(os.devnull, "w")
            )
            for p in planned:
                if p.index in done:
                    if on_kept is not None:
                        on_kept(p, len(planned))
                    outcomes.append(done[p.index])
                    continue
                if on_run is not None:
                    on_run(p, len(planned))
                argv = list(p.argv) + (["-q"] if config.quiet else [])  # a cluster's: its command's, last
                note = f"local ranks: {why_not}" if why_not and p.group in clustered else p.note
                start = time.perf_counter()
                earlier = file_stamp(p.json_path)
                code, error = _run_one(arm, execute, argv)
                if code == NOT_BUILT and p.local_argv is not None:  # nothing ran: local ranks instead
                    note = "local ranks: the emulated cluster could not be built" + (
                        f" ({error})" if error else ""
                    )
                    if file_stamp(p.json_path) != earlier:  # not an earlier start's, which the run replaces
                        note += _set_aside(Path(p.json_path))
                    argv = list(p.local_argv) + (["-q"] if config.quiet else [])
                    code, error = _run_one(arm, execute, argv)
                seconds = time.perf_counter() - start
                if code in INTERRUPTED:  # as a stop between runs does: a second must not cut the report
                    stopped = code
                    signals.ignore_further()
                    break
                keep(
                    Outcome(
                        planned=p, argv=tuple(argv), returncode=code, seconds=seconds, note=note, error=error
                    )
                )
                arm.release()  # type: ignore[attr-defined]
        except Interrupted as exc:  # between runs, or in a run whose CLI let it through
            stopped = 128 + exc.signum
        ran = {o.planned.index for o in outcomes}
        outcomes += [o for i, o in done.items() if i not in ran]  # kept, though the loop stopped first
        outcomes.sort(key=lambda o: o.planned.index)
        if not writes:  # another rank of the launcher's: rank 0 writes the report
            return StudyResult(planned=planned, outcomes=outcomes, report=None, stopped=stopped)
        try:
            md, _ = write_study_report(study, config.scale, outcomes, out, planned=planned, stopped=stopped)
        except Interrupted as exc:  # a signal while the report was written: the records stay
            stopped = stopped or 128 + exc.signum
            return StudyResult(planned=planned, outcomes=outcomes, report=None, stopped=stopped)
    return StudyResult(planned=planned, outcomes=outcomes, report=md, stopped=stopped)


def _set_aside(records: Path) -> str:
    """Move what a failed cluster run wrote out of the way of the same run on local ranks, which
    would overwrite it; returns the note's words on where it went ("" when it wrote nothing)."""
    if not records.exists():
        return ""
    aside = records.with_name(records.name.removesuffix(".jsonl") + ".cluster-failed.jsonl")
    try:
        records.replace(aside)
    except OSError as exc:
        return f"; its records could not be kept ({exc.strerror})"
    return f"; its records are in runs/{aside.name}"


def _restart_progress(out: Path, kept: Iterable[Outcome], others: Iterable[str] = ()) -> TextIO:
    """``DIR/runs/progress.jsonl`` anew, opened for appending, holding the lines of other plans' runs
    and of the ``kept`` runs first (a resumed start that is stopped again still holds them). Written
    beside it and moved into place: emptied first, a stop or a full disk before they were back lost
    every finished run.

    Raises:
        ValueError: the file cannot be written.
    """
    path = out / "runs" / PROGRESS
    part = path.with_name(path.name + ".part")
    try:
        with open(part, "w") as f:
            f.writelines(line + "\n" for line in others)
            f.writelines(json.dumps(_progress_line(o, out)) + "\n" for o in kept)
        os.replace(part, path)
        return open(path, "a")  # noqa: SIM115 (the caller closes it, after every run)
    except OSError as exc:
        raise ValueError(f"cannot write {path}: {exc.strerror}") from None
    finally:
        part.unlink(missing_ok=True)


def _progress_line(o: Outcome, out: Path) -> dict[str, Any]:
    return {
        "index": o.planned.index,
        "planned": _shown(o.planned.argv, out),  # however -o spelled the directory
        "argv": list(o.argv),
        "returncode": o.returncode,
        "seconds": o.seconds,
        "note": o.note,
        "error": o.error,
        "records_sha256": _digest(o.planned.json_path),  # what --resume keeps, byte for byte
    }


def _digest(path: str | Path) -> str | None:
    """SHA-256 of the file at ``path``; None where it cannot be read."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


def _finished(out: Path, planned: Sequence[Planned]) -> tuple[dict[int, Outcome], list[str]]:
    """(the runs an earlier start of this study finished, by index; the progress lines of runs this
    plan does not hold). A run is kept where its progress line has exit 0 and the command line
    planned now, and its records are the very bytes the run left (a file cut short, or another
    run's copied over it, was kept, and the report read it). Anything else runs again. The other
    lines are another scale's or plan's, kept for a later --resume of that one: they were dropped,
    and every run of it ran again."""
    path = out / "runs" / PROGRESS
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return {}, []
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path} to resume: {getattr(exc, 'strerror', None) or exc}") from None
    by_index = {p.index: p for p in planned}
    ours = [_shown(p.argv, out) for p in planned]
    done: dict[int, Outcome] = {}
    others: list[str] = []
    for line in lines:
        try:
            entry = loads(line)
            if entry["planned"] not in ours:
                others.append(line)
                continue
            p = by_index[entry["index"]]
            if entry["planned"] != _shown(p.argv, out) or entry["returncode"] != 0:
                continue
            if entry["records_sha256"] is None or entry["records_sha256"] != _digest(p.json_path):
                continue
            rp.load_run(p.json_path)
            done[p.index] = Outcome(
                planned=p,
                argv=tuple(str(a) for a in entry["argv"]),
                returncode=0,
                seconds=float(entry["seconds"]),
                note=str(entry.get("note") or ""),
                resumed=True,
            )
        except (ValueError, TypeError, KeyError):  # a cut line, another plan, records gone or broken
            continue
    return done, others


class _LastLine:
    """Stands in for sys.stderr during a run: writes through, and keeps the run's last line that
    starts with "commbench" (the CLI's one-line errors all do), or else its last non-empty line."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._partial = ""
        self.last = ""
        self.last_own = ""

    def write(self, text: str) -> int:
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            line = line.rsplit("\r", 1)[-1].strip()  # a progress bar's redraws: the last one
            if line:
                self.last = line
                if line.startswith("commbench"):
                    self.last_own = line
        return self._stream.write(text)

    def line(self) -> str:
        rest = self._partial.rsplit("\r", 1)[-1].strip()
        return self.last_own or self.last or rest

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _run_one(
    arm: Callable[[Callable[[list[str]], int], list[str]], int],
    execute: Callable[[list[str]], int],
    argv: list[str],
) -> tuple[int, str]:
    """One run's exit code, and for a failed one its error line (empty if it wrote none)."""
    tee = _LastLine(sys.stderr)
    with contextlib.redirect_stderr(tee):  # type: ignore[type-var]
        code = arm(execute, argv)
    return code, ("" if code == 0 else tee.line())


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[Callable[[Callable[[list[str]], int], list[str]], int]]:
    """SIGINT, SIGTERM and SIGHUP raise Interrupted while the study runs, whether they land in a run
    (whose CLI turns that into exit code 130, 143 or 129) or between runs; the old handlers come back
    after. Without SIGHUP here, a closed terminal ended a study at once between runs, and inside a
    run ended that run alone (exit 129, taken for a failure) while the study went on to the next.

    Yields ``arm(execute, argv)``: ``execute(argv)`` with the handlers set again first, since a run's
    elastic launcher replaces them with its own, which raise SignalException (turned into Interrupted
    here where it escapes a run). A stop after the run has returned is held until
    ``arm.release()``, which the caller calls once it has kept the run."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from commbench.bench.launch import Interrupted

    main_thread = threading.current_thread() is threading.main_thread()
    old = {s: signal.getsignal(s) for s in signals.STOPS} if main_thread else {}
    watched = [s for s, h in old.items() if h != signal.SIG_IGN]  # an inherited "ignore" stays
    stopped: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        stopped.append(signum)
        for s in watched:  # one is enough; a second must not cut the cleanup
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    held: list[int] = []

    def install() -> None:
        if not stopped:
            for s in watched:
                signal.signal(s, on_signal)

    def release() -> None:
        """The stop handlers again, and a stop held since the last run returned acts now."""
        install()
        if held and not stopped:
            on_signal(held[0], None)

    def arm(execute: Callable[[list[str]], int], argv: list[str]) -> int:
        release()
        try:
            return execute(argv)
        except SignalException as exc:
            raise Interrupted(int(exc.sigval)) from None
        finally:
            # Held until the caller has kept what the run did (release): a stop right after a run
            # that finished lost it from progress.jsonl, and --resume ran it again.
            if not stopped:
                for s in watched:
                    signal.signal(s, lambda signum, frame: held.append(signum))

    arm.release = release  # type: ignore[attr-defined]
    install()  # a resumed study with nothing left to run calls arm never, and writes its report here
    try:
        yield arm
    finally:
        signals.restore(old)


# ---- the report -----------------------------------------------------------------------------


def _later(run: rp.Run, strategy: str, epoch: int) -> dict[str, Any] | None:
    return next((e for e in run.epochs if e["strategy"] == strategy and e["epoch"] == epoch), None)


def _probe_stat(run: rp.Run, key: str, stat: str, scale: float = 1.0) -> float | None:
    st = (run.probes[0].get("summary") or {}).get(key) if run.probes else None
    return None if not st else st[stat] * scale


# Fewer samples than this between the first epoch's end and the last's give no training mean.
MIN_TRAINING_SAMPLES = 3


def _epoch_marks(run: rp.Run) -> dict[int, float]:
    """When each epoch ended, by its number, from the rank-0 sampler's markers ("3: ring epoch 1"):
    the last strategy's end where a compare marks each one's (they step together)."""
    ends: dict[int, float] = {}
    for m in (run.probes[0].get("markers") or []) if run.probes else []:
        label, t = m.get("label"), m.get("t_s")
        found = re.search(r"epoch (\d+)$", label) if isinstance(label, str) else None
        if found and isinstance(t, int | float):
            epoch = int(found.group(1))
            ends[epoch] = max(ends.get(epoch, t), t)
    return ends


def _training_samples(run: rp.Run) -> list[dict[str, Any]] | None:
    """The rank-0 sampler's samples from the first epoch's end to the last's: training after its
    first epoch. Over the whole run, the means were mostly imports, model building and the wait for
    the other ranks (a tiny run's two epochs took its last 50 ms of 2 s). None where the run marked
    fewer than two epochs, or fewer than MIN_TRAINING_SAMPLES samples fall there."""
    ends = _epoch_marks(run)
    if len(ends) < 2:
        return None
    start, end = ends[min(ends)], ends[max(ends)]
    inside = [
        x
        for x in run.probes[0].get("samples") or []
        if isinstance(t := x.get("t_s"), int | float) and start <= t <= end
    ]
    return inside if len(inside) >= MIN_TRAINING_SAMPLES else None


def _training_mean(run: rp.Run, key: str, gpu: bool = False) -> float | None:
    """The mean of ``key`` over :func:`_training_samples` (for ``gpu``, the busiest GPU's)."""
    samples = _training_samples(run)
    if samples is None:
        return None
    if not gpu:
        values = [v for x in samples if isinstance(v := x.get(key), int | float)]
        return statistics.fmean(values) if values else None
    per_gpu: dict[Any, list[float]] = {}
    for x in samples:
        for g in x.get("gpus") or []:
            if isinstance(v := g.get(key), int | float):
                per_gpu.setdefault(g.get("index"), []).append(v)
    return max((statistics.fmean(v) for v in per_gpu.values()), default=None)


def _gpu_stat(run: rp.Run, key: str, stat: str, scale: float = 1.0) -> float | None:
    gpus = (run.probes[0].get("summary") or {}).get("gpus") if run.probes else None
    values = [g[key][stat] * scale for g in gpus or [] if g.get(key)]
    return max(values) if values else None


def _last_counted(run: rp.Run, strategy: str) -> dict[str, Any] | None:
    """The strategy's last epoch whose steps were counted host by host."""
    last = [e for e in run.epochs if e["strategy"] == strategy and e.get("hosts")]
    return last[-1] if last else None


def _hosts(run: rp.Run, strategy: str) -> list[dict[str, Any]]:
    epoch = _last_counted(run, strategy)
    return epoch["hosts"] if epoch else []


# CPU time moves in 10 ms clock ticks: over a few short steps, a tick or two more or less is most of
# a step (0.015 s a step over 7.7 ms steps read as 261% of one core, on a machine of two). Below this
# much stepping in the counted epoch, a host's CPU share is not given (the report's per-host table
# keeps to the same floor).
MIN_CPU_WINDOW_S = CPU_COUNTED_MIN_S


def _counted_s(run: rp.Run, s: dict[str, Any]) -> float | None:
    """How long the counted epoch's steps took in all: the hosts' own count of it (the report's
    per-host table reads the same), else the epoch's ``time_s`` (records from before the hosts kept
    it; every step, the first too, where the summary's step time is a median that may leave it out)."""
    epoch = _last_counted(run, s["strategy"])
    if not epoch:
        return None
    counted = [
        h["counted_s"] for h in epoch.get("hosts") or [] if isinstance(h.get("counted_s"), int | float)
    ]
    took = min(counted) if counted else epoch.get("time_s")
    return took if isinstance(took, int | float) else None


def _cpu_countable(run: rp.Run, s: dict[str, Any]) -> bool:
    """Whether the counted epoch's steps took MIN_CPU_WINDOW_S or more in all (:func:`_counted_s`)."""
    took = _counted_s(run, s)
    return took is not None and took >= MIN_CPU_WINDOW_S


def _host_rate(run: rp.Run, s: dict[str, Any], key: str, scale: float) -> float | None:
    """A per-step host quantity over the step time (bytes/s or CPU share), the busiest host; a CPU
    share over too short a stretch of steps is None (see MIN_CPU_WINDOW_S)."""
    hosts = _hosts(run, s["strategy"])
    if not hosts or not s["step_time_ms"]:
        return None
    if key.startswith("cpu_") and not _cpu_countable(run, s):
        return None
    return max(h[key] for h in hosts) / (s["step_time_ms"] / 1e3) * scale


def _loopback(host: dict[str, Any]) -> bool:
    """Whether a counted host is this machine's loopback interface (by name, or by its address)."""
    try:
        return host.get("nic") == "lo" or ipaddress.ip_address(str(host.get("address"))).is_loopback
    except ValueError:  # no address recorded, or a name
        return False


def _on_loopback(run: rp.Run, strategy: str) -> bool:
    """Whether the strategy's bytes were counted on this machine's loopback: its ranks shared one
    machine (no emulated cluster), whose one "host" sends every rank's traffic at memory speed."""
    hosts = _hosts(run, strategy)
    return bool(hosts) and all(_loopback(h) for h in hosts)


def _epoch_time(s: dict[str, Any]) -> float | None:
    return s["later_epoch_time_s"] if s.get("later_epoch_time_s") is not None else s.get("first_epoch_time_s")


def _whole_pass(summary: dict[str, Any], per_epoch: int | None) -> float | None:
    """MB of ``per_epoch`` bytes (over the epoch's syncs) for a whole pass over the training set:
    samples // global batch syncs, the steps the loader runs (the partial last batch is dropped;
    files written before ``samples`` was recorded: as run)."""
    syncs, samples = summary.get("syncs_per_epoch"), summary.get("samples")
    if per_epoch is None:
        return None
    if not samples or not syncs or not summary.get("global_batch"):
        return per_epoch / 1e6
    return per_epoch / syncs * (samples // summary["global_batch"]) / 1e6


def _grad_gbps(s: dict[str, Any]) -> float | None:
    wire = s.get("wire_bytes_per_rank_per_epoch")
    if not wire or not max(wire) or not s.get("comm_ms") or not s.get("syncs_per_epoch"):
        return None  # one rank moves nothing: no rate to show
    return max(wire) / s["syncs_per_epoch"] / (s["comm_ms"] / 1e3) / 1e9


def _wire_ratio(run: rp.Run, strategy: str) -> float | None:
    last = [e for e in run.epochs if e["strategy"] == strategy and e.get("wire_bytes_ratio") is not None]
    return last[-1]["wire_bytes_ratio"] if last else None


Metric = tuple[str, str, Callable[[rp.Run, dict[str, Any]], Any]]
METRICS: dict[str, tuple[str, str, Callable[[rp.Run, dict[str, Any]], Any]]] = {
    # key: (column header, number format, value from (run, train_summary))
    "trainable_params": ("trainable params", ",d", lambda r, s: s.get("trainable_params")),
    "step_time_ms": ("step ms", ".2f", lambda r, s: s.get("step_time_ms")),
    "forward_ms": ("forward ms", ".2f", lambda r, s: s.get("forward_ms")),
    "backward_ms": ("backward ms", ".2f", lambda r, s: s.get("backward_ms")),
    "compute_ms": ("compute ms", ".2f", lambda r, s: s.get("compute_ms")),
    "comm_ms": ("comm ms", ".2f", lambda r, s: s.get("comm_ms")),
    "exposed_comm_ms": ("exposed comm ms", ".2f", lambda r, s: exposed_comm_ms(s)),
    "hidden_comm_fraction": ("hidden comm", ".2f", lambda r, s: s.get("hidden_comm_fraction")),
    "images_per_s": ("images/s", ".0f", lambda r, s: s.get("images_per_s")),
    "epoch_time_s": ("epoch s", ".4g", lambda r, s: _epoch_time(s)),
    "speedup": ("speedup vs 1 rank", ".2f", lambda r, s: None),  # filled in per group
    "first_epoch_time_s": ("1st epoch s", ".4g", lambda r, s: s.get("first_epoch_time_s")),
    "later_epoch_time_s": ("2nd+ epoch s", ".4g", lambda r, s: s.get("later_epoch_time_s")),
    "first_epoch_images_per_s": (
        "1st epoch images/s",
        ".0f",
        lambda r, s: (_later(r, s["strategy"], 1) or {}).get("images_per_s"),
    ),
    "second_epoch_images_per_s": (
        "2nd epoch images/s",
        ".0f",
        lambda r, s: (_later(r, s["strategy"], 2) or {}).get("images_per_s"),
    ),
    "final_loss": ("final loss", ".3f", lambda r, s: s.get("final_loss")),
    "final_accuracy": ("accuracy", ".3f", lambda r, s: s.get("final_accuracy")),
    "lr": ("lr", ".4g", lambda r, s: s.get("lr")),
    "epochs_to_threshold": ("epochs to loss threshold", "d", lambda r, s: s.get("epochs_to_threshold")),
    # Per whole pass over the training set, as the studies count them: runs capped at a few steps
    # an epoch (--steps-per-epoch) would otherwise show the same bytes at every batch size and rank count.
    "grad_mb_per_epoch": (
        "gradient MB/pass over the data",
        ".2f",
        lambda r, s: _whole_pass(s, s.get("grad_bytes_per_epoch")),
    ),
    "wire_mb_per_rank_per_epoch": (  # the busiest rank's: naive's rank 0, or the buffers' broadcaster
        "busiest rank's wire MB/pass over the data",
        ".2f",
        lambda r, s: (
            _whole_pass(s, max(s["wire_bytes_per_rank_per_epoch"]))
            if s.get("wire_bytes_per_rank_per_epoch")
            else None
        ),
    ),
    "grad_gbps": ("gradient GB/s", ".3f", lambda r, s: _grad_gbps(s)),
    "wire_ratio": ("measured/computed bytes, last epoch", ".3f", lambda r, s: _wire_ratio(r, s["strategy"])),
    "rss_max_mb": ("rank-0 RSS max MB", ".0f", lambda r, s: _probe_stat(r, "rss_bytes", "max", 1e-6)),
    # The means are training's after its first epoch (_training_samples); the maxima the whole run's
    "process_cpu_mean": (
        "rank-0 CPU % of a core, epochs 2+",
        ".0f",
        lambda r, s: _training_mean(r, "process_cpu_pct"),
    ),
    "cpu_user_mean": ("machine CPU user %, epochs 2+", ".0f", lambda r, s: _training_mean(r, "cpu_user_pct")),
    "cpu_system_mean": (
        "machine CPU sys %, epochs 2+",
        ".0f",
        lambda r, s: _training_mean(r, "cpu_system_pct"),
    ),
    "gpu_mem_max_mb": (
        "GPU memory max MB",
        ".0f",
        lambda r, s: _gpu_stat(r, "memory_used_bytes", "max", 1e-6),
    ),
    "gpu_util_mean": (
        "GPU util %, epochs 2+",
        ".0f",
        lambda r, s: _training_mean(r, "gpu_util_pct", gpu=True),
    ),
    "host_tx_mbps": ("busiest host send MB/s", ".1f", lambda r, s: _host_rate(r, s, "tx_bytes", 1e-6)),
    "host_cpu_user_pct": ("busiest host CPU user %", ".0f", lambda r, s: _host_rate(r, s, "cpu_user", 100)),
    "host_cpu_sys_pct": ("busiest host CPU sys %", ".0f", lambda r, s: _host_rate(r, s, "cpu_system", 100)),
}
HOST_METRICS = ("host_tx_mbps", "host_cpu_user_pct", "host_cpu_sys_pct")


def _not_reached(summaries: Sequence[dict[str, Any]]) -> str:
    given = [s for s in summaries if s.get("loss_threshold") is not None]
    if not given:
        return "no --loss-threshold was given"
    thresholds = ", ".join(dict.fromkeys(f"{s['loss_threshold']:.10g}" for s in given))
    epochs = ", ".join(dict.fromkeys(str(s.get("epochs", "?")) for s in given))
    return f"the mean training loss did not fall below {thresholds} within the run's {epochs} epoch(s)"


def _nothing_sent(summaries: Sequence[dict[str, Any]]) -> str:
    if all(s.get("world_size") == 1 for s in summaries):
        return "at 1 rank nothing is sent"
    return (
        "the records hold no counted bytes for that row (at 1 rank nothing is sent; NCCL's traffic, "
        "which passes the interface's counters, and --no-probe runs are not counted)"
    )


# Why a column's cell is '-', from the summaries whose value is None (None: no line for it).
DASHES: dict[str, Callable[[Sequence[dict[str, Any]]], str | None]] = {
    "epochs_to_threshold": _not_reached,
    "final_accuracy": lambda ss: (
        "the run made no held-out pass (--no-eval)"
        + ("" if all("final_accuracy" in s for s in ss) else ", or its records hold no accuracy")
    ),
    "grad_gbps": _nothing_sent,
    "wire_ratio": _nothing_sent,
}
TRAINING_MEANS = ("process_cpu_mean", "cpu_user_mean", "cpu_system_mean", "gpu_util_mean")
# Where every rank ran on this machine, its one "host" is the machine: what it sends is every rank's
# traffic over loopback (325 MB/s read as a host beating its 1 Gbit/s link), its CPU every rank's.
ON_LOOPBACK = {
    "host_tx_mbps": "loopback send MB/s, all ranks",
    "host_cpu_user_pct": "CPU user %, all ranks",
    "host_cpu_sys_pct": "CPU sys %, all ranks",
}


def _point_text(value: Any) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def _speedups(rows: list[dict[str, Any]]) -> None:
    """Epoch time at one rank over epoch time here, for rows that differ only in world-size."""
    for row in rows:
        key = tuple((k, str(v)) for k, v in row["point"] if k != "world-size")
        base = next(
            (
                b
                for b in rows
                if b["summary"]["world_size"] == 1
                and b["summary"]["strategy"] == row["summary"]["strategy"]
                and tuple((k, str(v)) for k, v in b["point"] if k != "world-size") == key
            ),
            None,
        )
        if base is None:
            continue
        here, one = _epoch_time(row["summary"]), _epoch_time(base["summary"])
        if here is not None and here > 0 and one is not None:
            row["values"]["speedup"] = one / here


def _group_blocks(
    study: Study,
    group: str,
    outcomes: Sequence[Outcome],
    runs: dict[int, rp.Run],
    plots: rp._Plots,
    scale: str = "default",
    changed: Sequence[str] = (),
) -> list[rp.Block]:
    """One group's section. Its note is the group as designed; where this scale or this machine ran it
    otherwise, ``changed`` (:func:`_group_changes`) says how."""
    from commbench.bench.report import plot_busbw, plot_grouped, plot_probe_timeline

    blocks: list[rp.Block] = [rp.Heading(text=group, level=3)]
    spec = next(g for g in study.groups if g.label == group)
    if spec.note:
        blocks.append(rp.Para(text=f"As designed: {spec.note}" if changed else spec.note))
    if changed:
        at = " at the tiny scale" if scale == "tiny" else " here"
        blocks.append(rp.Para(text=f"As run{at}: {'; '.join(changed)}."))
    shown = ("strategy", "strategies", "world-size")  # the table has its own strategy and ranks columns
    axes = list(dict.fromkeys(k for o in outcomes for k, _ in o.planned.point if k not in shown))
    rows: list[dict[str, Any]] = []
    sweeps: list[dict[str, Any]] = []
    for o in outcomes:
        run = runs.get(o.planned.index)
        if run is None:
            continue
        sweeps += [{**r, "_point": o.planned.point} for r in run.sweeps]
        for s in run.summaries:
            values = {m: METRICS[m][2](run, s) for m in study.metrics if m != "speedup"}
            rows.append(
                {
                    "point": o.planned.point,
                    "summary": s,
                    "run": run,
                    "values": values,
                    "index": o.planned.index,
                    "loopback": _on_loopback(run, s["strategy"]),
                }
            )
    if "speedup" in study.metrics:
        _speedups(rows)
    if rows:
        metrics = list(study.metrics)
        counted = [row for row in rows if _hosts(row["run"], row["summary"]["strategy"])]
        looped = bool(counted) and all(row["loopback"] for row in counted)

        def heading(m: str) -> str:
            return ON_LOOPBACK[m] if looped and m in ON_LOOPBACK else METRICS[m][0]

        header = [*axes, "strategy", "ranks", *(heading(m) for m in metrics)]
        body = []
        for row in rows:
            point = dict(row["point"])
            body.append(
                [_point_text(point.get(a, "-")) for a in axes]
                + [row["summary"]["strategy"], str(row["summary"]["world_size"])]
                + [_metric_text(row["values"].get(m), METRICS[m][1]) for m in metrics]
            )
        blocks.append(rp.table(header, body))
        link = study.cluster_rate if spec.cluster else None
        blocks += [rp.Para(text=n) for n in _column_notes(rows, metrics, link)]
        # "naive x2" read as "twice": the ranks are named as such
        labels = [
            ", ".join(
                [
                    *(f"{k}={_point_text(v)}" for k, v in row["point"] if k not in shown),
                    row["summary"]["strategy"],
                    rank_count(row["summary"]["world_size"]),
                ]
            )
            for row in rows
        ]
        models = list(dict.fromkeys(str(r["summary"]["model"]) for r in rows if r["summary"].get("model")))
        model = ", ".join(models) if len(models) <= 3 else f"{len(models)} models"
        title = f"{group} ({model + ', ' if model else ''}{scale} scale)"
        for entry in study.plot:
            drawn = entry.split("+")  # several metrics of one unit, side by side in one chart
            # not where no run had more than one rank: one bar of 1.00, the baseline against itself
            speedups = [row for row in rows if row["values"].get("speedup") is not None]
            if drawn == ["speedup"] and not any(row["summary"]["world_size"] > 1 for row in speedups):
                continue
            named = " and ".join(heading(m) for m in drawn)
            blocks += plots.add(
                f"{group}-{entry}",
                lambda p, drawn=drawn, named=named: plot_grouped(
                    labels, {heading(m): [r["values"].get(m) for r in rows] for m in drawn}, p, named, title
                ),
                f"{named} ({group})",
            )
        blocks += _host_blocks(rows)
    if sweeps:
        body = [
            [
                " ".join(_point_text(v) for _, v in r["_point"]) or "-",
                rp._size(r["size_bytes"]),
                "limit (send/recv)" if r["collective"] == "sendrecv" else r["algorithm"],
                rp.fmt(r["busbw_gbps"], ".3f"),
                rp.fmt(r.get("frac_of_limit"), ".2f"),
                rp.fmt(r.get("wire_bytes_ratio"), ".3f"),
            ]
            for r in sweeps
        ]
        blocks.append(
            rp.table(["point", "size", "algorithm", "busbw (GB/s)", "of limit", "measured/computed"], body)
        )
        blocks += plots.add(
            f"{group}-busbw",
            lambda p: plot_busbw(sweeps, str(p), _sweep_title(group, sweeps)),
            f"busbw against size ({group}); dashed: the send/recv limit",
        )
    if spec.timelines:
        for o in outcomes:
            run = runs.get(o.planned.index)
            if run is not None and run.probes:
                label = " ".join(f"{k}={_point_text(v)}" for k, v in o.planned.point)
                blocks += plots.add(
                    f"{group}-timeline-{o.planned.index}",
                    lambda p, run=run, label=label: plot_probe_timeline(run.probes[0], p, label),
                    f"probe timeline: {label}",
                )
    return blocks


def _metric_text(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if spec == "d" or spec == ",d":
        return format(int(value), spec)
    if spec.endswith("g") and abs(value) >= 1e4:  # four figures, not 1.235e+04 s
        return rp.fmt(value, ".0f")
    return rp.fmt(value, spec)


def _sweep_title(group: str, sweeps: Sequence[dict[str, Any]]) -> str:
    """A group's busbw plot's title: the group, and the backend, device and dtype its sweeps share."""
    shared = [
        ", ".join(values)
        for key in ("backend", "device", "dtype")
        if len(values := list(dict.fromkeys(str(r.get(key)) for r in sweeps))) == 1
    ]
    return ", ".join([group, *shared])


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _column_notes(rows: list[dict[str, Any]], metrics: Sequence[str], link: str | None) -> list[str]:
    """One line for each host column of a group's table that does not read as its heading says:
    counted on loopback (every rank on this machine), or '-' where the records give no figure; and
    one for the training means' '-'. ``link``: the rate of the group's emulated links as designed
    (None where it has none)."""
    notes = []
    for m in metrics:
        dashed = [row for row in rows if row["values"].get(m) is None]
        why = DASHES.get(m)
        if dashed and why is not None and (said := why([row["summary"] for row in dashed])):
            notes.append(f"{METRICS[m][0]} '-': {said}.")
    probed = [row for row in rows if row["run"].probes]
    sampled_gpu = [row for row in probed if (row["run"].probes[0].get("summary") or {}).get("gpus")]
    means = [m for m in metrics if m in TRAINING_MEANS and m != "gpu_util_mean"]
    short = [row for row in probed if any(row["values"].get(m) is None for m in means)]
    if "gpu_util_mean" in metrics:
        short += [
            row for row in sampled_gpu if row["values"].get("gpu_util_mean") is None and row not in short
        ]
    if short:
        one = [row for row in short if len(_epoch_marks(row["run"])) < 2]
        said = []
        if one:
            said.append("the run had fewer than two epochs, so none after the first")
        if len(one) < len(short):
            said.append(
                f"fewer than {MIN_TRAINING_SAMPLES} probe samples fell between the first epoch's end and the "
                "last's (more steps, or a shorter --probe-interval, gives them)"
            )
        notes.append(f"Means over epochs 2+ '-': {'; or '.join(said)}.")
    if {"gpu_mem_max_mb", "gpu_util_mean"} & set(metrics) and len(sampled_gpu) < len(probed):
        notes.append("GPU columns '-': the run sampled no GPU (it ran on CPU, or NVML is not available).")
    if not any(m in HOST_METRICS for m in metrics):
        return notes
    counted = [row for row in rows if _hosts(row["run"], row["summary"]["strategy"])]
    looped = [row for row in counted if row["loopback"]]
    beside = f" (not to be set beside the {link} links of the study as designed)" if link else ""
    if looped and len(looped) == len(counted):
        notes.append(
            "The all-ranks columns: every rank ran on this machine, so its one host is the machine; the send "
            f"rate is every rank's traffic over loopback together, which no network link carries{beside}, "
            "and the CPU is every rank's together, as % of one core."
        )
    elif looped:
        which = list(dict.fromkeys(str(row["index"]) for row in looped))
        notes.append(
            f"In {'run' if len(which) == 1 else 'runs'} {', '.join(which)} every rank ran on this machine: "
            f"the busiest host columns are every rank's sends over loopback and CPU together{beside}."
        )
    if any(m.startswith("host_cpu") for m in metrics):
        short = [row for row in counted if not _cpu_countable(row["run"], row["summary"])]
        took = [t for row in short if (t := _counted_s(row["run"], row["summary"])) is not None]
        if took:
            notes.append(
                f"CPU '-': the counted epoch's steps took {max(took):.3f} s or less in all, under the "
                f"{MIN_CPU_WINDOW_S:g} s that the CPU's 10 ms clock ticks need to give a share (a longer run "
                "gives one)."
            )
        elif short:
            notes.append("CPU '-': the records do not say how long the counted epoch's steps took.")
    if len(counted) < len(rows):
        notes.append("Host columns '-': the records hold no per-host counts for that row.")
    return notes


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def _design(study: Study, scale: str, out_dir: str | Path) -> list[Planned] | None:
    """The runs of the study as designed, which the tiny scale shrinks: the default scale's plan.
    None at the other scales (they run the design at a size) or where the default scale has no runs."""
    if scale != "tiny":
        return None
    try:
        return plan(study, "default", out_dir)
    except ValueError:
        return None


def _swapped(ran: Iterable[rp.Run], designed: Sequence[Planned]) -> list[str]:
    """The model and dataset the runs' records name, where the designed runs' command lines name
    others ("model mlp in place of vgg11")."""
    summaries = [s for r in ran for s in r.summaries]
    out = []
    for field in ("model", "dataset"):
        got = list(dict.fromkeys(str(s[field]) for s in summaries if s.get(field)))
        meant = list(dict.fromkeys(v for p in designed if (v := _flag_value(p.argv, f"--{field}"))))
        if got and meant and not set(got) <= set(meant):
            out.append(f"{field} {', '.join(got)} in place of {', '.join(meant)}")
    return out


def _group_changes(
    study: Study,
    spec: Group,
    scale: str,
    outcomes: Sequence[Outcome],
    runs: dict[int, rp.Run],
    planned: Sequence[Planned],
    design: Sequence[Planned] | None,
) -> list[str]:
    """What a group's runs did that its note and the study's text do not say: local ranks for a group
    designed for emulated hosts, and at the tiny scale the model, data and grid points it changed."""
    changes = []
    local = [o for o in outcomes if o.note.startswith("local ranks")]
    if spec.cluster and local:
        looped = any(
            _on_loopback(run, s["strategy"])
            for o in local
            if (run := runs.get(o.planned.index))
            for s in run.summaries
        )
        which = ", ".join(str(o.planned.index) for o in local)
        which = "" if len(local) == len(outcomes) else f" in {'run' if len(local) == 1 else 'runs'} {which}"
        where = "every rank on this machine, over loopback" if looped else "local ranks"
        changes.append(f"{where}{which} (no emulated hosts, no {study.cluster_rate} links)")
    designed = [p for p in design or () if p.group == spec.label]
    if not designed:
        return changes
    changes += _swapped((runs[o.planned.index] for o in outcomes if o.planned.index in runs), designed)
    mine = [p for p in planned if p.group == spec.label] or [o.planned for o in outcomes]
    for key in dict.fromkeys(k for p in designed for k, _ in p.point):
        meant = _values((p.point for p in designed), key)
        # each design value the runs took, with what it ran as (a value from neither the design nor
        # this list was "left out" when it had only been shrunk: batch-size 32 ran as 16)
        took: list[tuple[Any, Any]] = []
        for p in mine:
            for (k, d), (_, ran) in zip(p.designed or p.point, p.point, strict=True):
                if k == key and (d, ran) not in took:
                    took.append((d, ran))
        left = [v for v in meant if v not in [d for d, _ in took]]
        shrunk = any(d != ran for d, ran in took)
        if left or shrunk:
            shown = ", ".join(
                _point_text(d) + ("" if d == ran else f" run as {_point_text(ran)}") for d, ran in took
            )
            said = f" only ({', '.join(map(_point_text, left))} left out)" if left else ""
            changes.append(f"{key} {shown or '-'}{said}")
    # options the scale set that are neither grid keys nor its shortening (a tiny image size)
    grid_keys = {k for p in designed for k, _ in p.point}
    said_already = {*grid_keys, *TINY_TRAIN, *TINY_SWEEP, *TINY_CAPS, "json", "model", "dataset"}
    for p in mine:
        twin = next((d for d in designed if d.point == (p.designed or p.point)), None)
        if twin is None:
            continue
        # a cluster run's design starts its command after the cluster's own flags, without
        # --world-size (the hosts carry it): the same run on local ranks is what to set beside it
        got, meant = _options_of(p.argv), _options_of(twin.local_argv or twin.argv)
        for key in dict.fromkeys([*meant, *got]):
            if key in said_already or got.get(key) == meant.get(key):
                continue
            if key not in meant:
                text = f"--{key} added" + (f" ({', '.join(got[key])})" if any(got[key]) else "")
            elif key not in got:
                text = f"--{key} left out" + (f" ({', '.join(meant[key])})" if any(meant[key]) else "")
            else:
                ran = [v for v in got[key] if v not in meant[key]]
                gone = [v for v in meant[key] if v not in got[key]]
                text = f"--{key} {', '.join(ran) or '-'} in place of {', '.join(gone) or '-'}"
            if text not in changes:
                changes.append(text)
    return changes


def _options_of(argv: Sequence[str]) -> dict[str, list[str]]:
    """A run's command line as its options: each flag's values in order (a bare flag's is ""), of
    the command itself where the cluster starts it (after the cluster's ``--``)."""
    words = list(argv[len(argv) - argv[::-1].index("--") :] if "--" in argv else argv)
    out: dict[str, list[str]] = {}
    for i, w in enumerate(words):
        if w.startswith("--"):
            value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else ""
            out.setdefault(w[2:], []).append(value)
    return out


def _values(points: Iterable[tuple[tuple[str, Any], ...]], key: str) -> list[Any]:
    """The values ``key`` takes in the grid ``points``, in order, once each (model-opt's are dicts,
    so no set holds them)."""
    out: list[Any] = []
    for point in points:
        for k, v in point:
            if k == key and v not in out:
                out.append(v)
    return out


def _study_changes(
    study: Study,
    scale: str,
    outcomes: Sequence[Outcome],
    runs: dict[int, rp.Run],
    planned: Sequence[Planned],
    design: Sequence[Planned] | None,
    groups_changed: bool,
) -> str | None:
    """A line under the study's text (its design) on what the tiny scale ran instead; None where the
    runs are the design's. ``groups_changed``: whether a group's section says more."""
    if not design:
        return None
    mine = list(planned) or [o.planned for o in outcomes]
    groups = {p.group for p in mine}
    swapped = _swapped(runs.values(), [p for p in design if p.group in groups])
    left = [g for g in dict.fromkeys(p.group for p in design) if g not in groups]
    of = f"{len(mine)} of the default scale's" if len(mine) != len(design) else "the default scale's"
    commands = {g.command for g in study.groups if g.label in groups}
    return (
        f"The text above is the study as designed. The {scale} scale runs {of} {_count(len(design), 'run')}"
        + (f" ({'; '.join(swapped)})" if swapped else "")
        + (f"; groups left out: {', '.join(json.dumps(g, ensure_ascii=False) for g in left)}" if left else "")
        + f". Each run it ran is shortened: {_shortened(commands)}."
        + (" Each group below says what else it changed." if groups_changed else "")
    )


def _host_blocks(rows: list[dict[str, Any]]) -> list[rp.Block]:
    """Per-node CPU and network, where the runs recorded more than one host."""
    body = []
    for row in rows:
        s, run = row["summary"], row["run"]
        hosts = _hosts(run, s["strategy"])
        if len(hosts) < 2:
            continue
        step_s = s["step_time_ms"] / 1e3 if s["step_time_ms"] else None
        cpu_s = step_s if _cpu_countable(run, s) else None
        for h in hosts:
            body.append(
                [
                    " ".join(_point_text(v) for _, v in row["point"]),
                    s["strategy"],
                    str(h["rank"]),
                    h.get("address", "-"),
                    rp.mb(h["tx_bytes"]),
                    rp.mb(h.get("computed_tx_bytes")),
                    rp.fmt(h["tx_bytes"] / step_s / 1e6 if step_s else None, ".1f"),
                    rp.fmt(100 * h["cpu_user"] / cpu_s if cpu_s else None, ".0f"),
                    rp.fmt(100 * h["cpu_system"] / cpu_s if cpu_s else None, ".0f"),
                ]
            )
    if not body:
        return []
    return [
        rp.Para(
            text="Per node (last epoch, per step): bytes sent at the host's interface beside the cost "
            "model, send rate over the step time, and CPU as % of one core (user, system; '-' where the "
            f"epoch's steps took under {MIN_CPU_WINDOW_S:g} s in all, a stretch the CPU's 10 ms clock ticks "
            "cannot divide)."
        ),
        rp.table(
            [
                "point",
                "strategy",
                "host",
                "address",
                "tx MB/step",
                "computed MB/step",
                "send MB/s",
                "CPU user %",
                "CPU sys %",
            ],
            body,
        ),
    ]


def write_study_report(
    study: Study,
    scale: str,
    outcomes: Sequence[Outcome],
    out_dir: str | Path,
    planned: Sequence[Planned] = (),
    stopped: int | None = None,
) -> tuple[Path, Path]:
    """The study's report: what it reproduces, how each run was made, one table (and plot) per group,
    and the computed-versus-measured bytes of every run. A study that a signal ``stopped`` gets a
    partial report: the runs that finished, then those of ``planned`` that did not run."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = rp._Plots(out)
    runs: dict[int, rp.Run] = {}
    failures = []
    for o in outcomes:
        if o.returncode != 0:
            why = f" ({o.error})" if o.error else ""
            failures.append(f"run {o.planned.index} exited with {o.returncode}{why}: {shlex.join(o.argv)}")
            continue
        try:
            runs[o.planned.index] = rp.load_run(o.planned.json_path, f"run {o.planned.index}")
        except ValueError as exc:
            failures.append(f"run {o.planned.index}: {exc}")
    ran = {o.planned.index for o in outcomes}
    unrun = [p for p in planned if p.index not in ran]
    title = f"Study {study.name}: {study.title}" + (" (partial)" if stopped is not None else "")
    total = sum(o.seconds for o in outcomes)
    again = f"commbench study {study.name}" + {"full": " --full", "tiny": " --tiny"}.get(scale, "")
    if Path(out_dir) != Path(f"study-{study.name}"):
        again += f" -o {shlex.quote(str(out_dir))}"
    design = _design(study, scale, out)
    blocks: list[rp.Block] = [rp.Heading(text=title, level=1), rp.Para(text=study.about)]
    by_group = {
        g: [o for o in outcomes if o.planned.group == g]
        for g in dict.fromkeys(o.planned.group for o in outcomes)
    }
    group_changes = {
        g: _group_changes(
            study, next(x for x in study.groups if x.label == g), scale, mine, runs, planned, design
        )
        for g, mine in by_group.items()
    }
    changed = _study_changes(study, scale, outcomes, runs, planned, design, any(group_changes.values()))
    if changed:
        blocks.append(rp.Para(text=changed))
    blocks.append(
        rp.Para(
            text=f"Reference: {study.reference}. Scale: {scale}. {_count(len(outcomes), 'run')}, "
            f"{total:.0f} s in all. Re-run with: {again}"
        )
    )
    if stopped is not None:
        name = signal.Signals(stopped - 128).name if stopped - 128 in signals.STOPS else f"exit {stopped}"
        done = sum(o.returncode == 0 for o in outcomes)  # --resume keeps these alone
        failed = len(outcomes) - done
        rerun = {0: "", 1: " (the failed one again)"}.get(failed, f" (the {failed} failed again)")
        blocks.append(
            rp.Para(
                text=f"PARTIAL: the study was stopped ({name}) with {done} of {len(outcomes) + len(unrun)} "
                "runs done" + (f" and {failed} failed" if failed else "") + f". `{again} --resume` runs "
                f"the other {failed + len(unrun)}{rerun} and keeps the {done} done."
            )
        )
    resumed = sum(o.resumed for o in outcomes)
    if resumed:
        blocks.append(rp.Para(text=f"Resumed: {resumed} of these runs were finished by an earlier start."))
    notes = sorted({o.note for o in outcomes if o.note})
    blocks += [rp.Para(text=f"Note: {n}.") for n in notes]
    blocks += [rp.Para(text=f"FAILED: {f}") for f in failures]
    if runs:
        blocks += rp.machine_section([runs[min(runs)]])
    blocks.append(rp.Heading(text="Results"))
    for group, mine in by_group.items():
        blocks += _group_blocks(study, group, mine, runs, plots, scale, group_changes[group])
    checks = []
    for o in outcomes:
        run = runs.get(o.planned.index)
        if run is None:
            continue
        ratios = [
            r["wire_bytes_ratio"] for r in (*run.sweeps, *run.epochs) if r.get("wire_bytes_ratio") is not None
        ]
        flags = [r["wire_check"] for r in (*run.sweeps, *run.epochs) if says_off(r.get("wire_check"))]
        judged = sum(
            1
            for r in (*run.sweeps, *run.epochs)
            if r.get("wire_bytes_ratio") is not None
            and not (r.get("wire_check") or "").startswith(NOT_JUDGED)
        )
        checks.append(
            [
                str(o.planned.index),
                o.planned.group,
                str(len(ratios)),
                rp.fmt(statistics.median(ratios), ".4f") if ratios else "-",
                str(judged),
                str(len(flags)) + (f" ({flags[0]})" if flags else ""),
            ]
        )
    if checks:
        blocks += [
            rp.Heading(text="Computed against measured bytes"),
            rp.Para(
                text="Per run: how many sweep points or epochs had their wire bytes counted at the "
                "interface, the median of measured / computed, how many were large enough to judge (1 MiB "
                "and more), and how many of those were flagged as outside tolerance."
            ),
            rp.table(["run", "group", "counted", "median ratio", "judged", "flagged"], checks),
        ]
    blocks += [
        rp.Heading(text="Runs"),
        rp.table(
            ["run", "group", "seconds", "exit", "command"],
            [
                [
                    str(o.planned.index),
                    o.planned.group,
                    f"{o.seconds:.1f}",
                    str(o.returncode),
                    "commbench " + shlex.join(_shown(o.argv, out)),
                ]
                for o in outcomes
            ]
            + [
                [str(p.index), p.group, "-", "not run", "commbench " + shlex.join(_shown(p.argv, out))]
                for p in unrun
            ],
        ),
        rp.Para(
            text="Each run's records are in runs/ beside this report; `commbench report runs/*.jsonl` "
            "shows every detail (per-run tables, timelines, per-host bytes)."
        ),
    ]
    return rp.write_report(blocks, out, title)


def _shown(argv: Sequence[str], out: Path) -> list[str]:
    """The command as the report shows it: paths relative to the report."""
    prefix = str(out) + "/"
    return [a[len(prefix) :] if a.startswith(prefix) else a for a in argv]


# ---- the command ----------------------------------------------------------------------------


def add_parser(sub: Any) -> None:
    """Register ``commbench study`` on the CLI's subparsers."""
    p = sub.add_parser(
        "study",
        help="re-run a reference study (a preset in commbench/studies/) and write its report",
        description="Run the commbench runs a preset in commbench/studies/ lists (sweeps, train, compare "
        "over grids of model, dataset, batch size and ranks), then write DIR/report.md and DIR/report.html. "
        "Default sizes finish in minutes on a small CPU machine; --full uses the study's original sizes "
        "(GPU clusters).",
    )
    p.add_argument("name", nargs="?", default=None, help="the study (a file stem in commbench/studies/)")
    p.add_argument(
        "-o",
        "--output",
        type=output_path,
        default=None,
        help="directory for runs and report (default ./study-NAME)",
    )
    scale = p.add_mutually_exclusive_group()
    scale.add_argument("--full", action="store_true", help="the study's original sizes (for GPU clusters)")
    scale.add_argument(
        "--tiny", action="store_true", help=f"a smoke test: every run shrunk to seconds (or {SCALE_ENV}=tiny)"
    )
    p.add_argument("--list", action="store_true", help="list the studies and exit")
    p.add_argument(
        "--dry-run", action="store_true", help="print the commands the study would run here, and exit"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no tables from the runs")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs an earlier start of this study in DIR finished (same command line, "
        "records intact) and run only the others",
    )


def _check_creatable(folder: Path) -> None:
    """ValueError where ``folder`` could not be made: the nearest existing path above it is a file,
    or a directory this process may not write in (the message the run's own mkdir gives)."""
    above = folder
    while not above.exists() and above.parent != above:
        above = above.parent
    if above == folder and above.is_dir():
        return
    if not above.is_dir():
        raise ValueError(f"cannot create {folder}: {os.strerror(errno.ENOTDIR)}")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ValueError(f"cannot create {folder}: {os.strerror(errno.EACCES)}")


def run(args: argparse.Namespace) -> int:
    """``commbench study``: list, plan or run a preset; prints one line per run and where the report is."""
    if args.list:  # every study that loads; one line on stderr for each that does not
        if args.name:
            raise ValueError(f"--list lists every study; it takes no name (got {args.name!r})")
        bad = 0
        for name in known_studies():
            try:
                print(f"{name:<24} {load_study(name).title}")
            except ValueError as exc:
                print(f"commbench: error: {exc}", file=sys.stderr)
                bad += 1
        return 2 if bad else 0
    if not args.name:
        raise ValueError(f"give a study name; known: {', '.join(known_studies())}")
    # as the other COMMBENCH_ variables: spaces stripped, empty taken for unset
    scale = (
        "full" if args.full else "tiny" if args.tiny else os.environ.get(SCALE_ENV, "").strip() or "default"
    )
    config = StudyConfig(
        name=args.name, scale=scale, out_dir=args.output, quiet=args.quiet, resume=args.resume
    )
    if args.dry_run:
        study = load_study(config.name)
        why_not = _why_no_cluster(study, config.scale)  # as the run would decide
        planned = plan(study, config.scale, config.directory, cluster_ok=why_not is None)
        validate(planned)
        _check_creatable(config.directory / "runs")  # as the run would refuse it
        if why_not:
            print(f"# cluster groups run on local ranks here: {why_not}")
        for p in planned:
            print("commbench " + shlex.join(p.argv))
        return 0

    def announce(p: Planned, total: int) -> None:
        print(
            f"== study {config.name} [{p.index}/{total}] {p.group}: commbench {shlex.join(p.argv)}",
            flush=True,
        )

    def kept(p: Planned, total: int) -> None:
        print(f"== study {config.name} [{p.index}/{total}] {p.group}: kept from an earlier start", flush=True)

    result = run_study(config, on_run=announce, on_kept=kept)
    md, outcomes = result.report, result.outcomes
    if result.stopped is not None:  # a run was interrupted and said so in one line, or the study was
        done = sum(o.returncode == 0 for o in outcomes)
        where = f"partial report: {md}" if md is not None else f"records: {Path(config.directory) / 'runs'}"
        print(
            f"commbench study: stopped with {done} of {len(result.planned)} run(s) finished; {where}; "
            f"--resume runs the rest",
            file=sys.stderr,
        )
        return result.stopped
    failed = [o for o in outcomes if o.returncode != 0]
    if md is None:  # another rank of torchrun's or SLURM's (a signal stopped the study above)
        from commbench.bench import cli

        print(f"rank 0 writes the report (this is rank {cli.external_rank_and_world()[0]})")
        return 1 if failed else 0
    print(f"report: {md}  {md.with_suffix('.html')}" + (f"  ({len(failed)} run(s) failed)" if failed else ""))
    return 1 if failed else 0
