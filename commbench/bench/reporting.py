"""``commbench report``: turn JSON Lines from sweep, train, compare (and cluster) into a report.

A report is a list of blocks (headings, paragraphs, tables, images) built from the records, then
rendered twice: Markdown (``report.md``) and an HTML page (``report.html``, inline CSS, nothing
fetched) with the PNGs as files beside both. Nothing here measures anything; ``commbench study`` reuses it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import html
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from commbench.bench.records import (
    check_one_run,
    check_writable,
    complete_lines,
    directory_held,
    exposed_comm_ms,
    first_line,
    input_path,
    loads,
    output_path,
    resolved,
    shown,
    write_whole,
)
from commbench.bench.report import md_code_block, md_text, one_line, threshold_lines
from commbench.bench.signals import Interrupted
from commbench.probes.wirecheck import CPU_COUNTED_MIN_S, says_off
from commbench.units import rank_count

MACHINE_FIELDS = (
    ("hostname", "host"),
    ("cpu_model", "CPU"),
    ("cpu_logical_cores", "logical cores"),
    ("memory_bytes", "memory"),
    ("python", "Python"),
    ("torch", "torch"),
    ("backend", "backend"),
    ("nccl", "NCCL"),
    ("cuda", "CUDA"),
    ("gpus", "GPUs"),
    ("commbench", "commbench"),
    ("commit", "commit"),
    ("link_rate_gbps", "link rate (Gbit/s)"),
)


# ---- blocks ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Heading:
    text: str
    level: int = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class Para:
    text: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Code:
    text: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Image:
    file: str  # a PNG beside the report
    caption: str


Block = Heading | Para | Code | Table | Image


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Table:
    """A Table with every cell turned into text."""
    return Table(header=tuple(header), rows=tuple(tuple(str(c) for c in r) for r in rows))


def render_markdown(blocks: Sequence[Block]) -> str:
    """The blocks as GitHub-flavoured Markdown."""
    out: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append("#" * b.level + " " + md_text(b.text))
        elif isinstance(b, Para):
            out.append(b.text)
        elif isinstance(b, Code):
            out.append(md_code_block(b.text))
        elif isinstance(b, Table):
            cells = [[md_text(c) for c in r] for r in (b.header, *b.rows)]
            lines = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(b.header)]
            lines += ["| " + " | ".join(r) + " |" for r in cells[1:]]
            out.append("\n".join(lines))
        elif isinstance(b, Image):
            out.append(f"![{b.caption}]({b.file})")
    return "\n\n".join(out) + "\n"


_CSS = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em;
       color: #222; line-height: 1.45; }
h1 { border-bottom: 2px solid #444; } h2 { border-bottom: 1px solid #bbb; margin-top: 2em; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.55em; text-align: right; }
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
tr:nth-child(even) td { background: #fafafa; }
pre { background: #f6f6f6; padding: 0.6em; overflow-x: auto; font-size: 0.85em; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-size: 0.85em; color: #555; }
"""


def render_html(blocks: Sequence[Block], title: str) -> str:
    """The blocks as one HTML page with inline CSS; images are referenced, not embedded."""
    esc = html.escape
    body: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            body.append(f"<h{b.level}>{esc(b.text)}</h{b.level}>")
        elif isinstance(b, Para):
            body.append(f"<p>{esc(b.text)}</p>")
        elif isinstance(b, Code):
            body.append(f"<pre>{esc(b.text)}</pre>")
        elif isinstance(b, Table):
            head = "".join(f"<th>{esc(c)}</th>" for c in b.header)
            rows = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in b.rows)
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif isinstance(b, Image):
            body.append(
                f'<figure><img src="{esc(b.file)}" alt="{esc(b.caption)}">'
                f"<figcaption>{esc(b.caption)}</figcaption></figure>"
            )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
        f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def write_report(blocks: Sequence[Block], out_dir: str | Path, title: str) -> tuple[Path, Path]:
    """Write report.md and report.html into ``out_dir``; returns both paths."""
    out = Path(out_dir)
    md, page = out / "report.md", out / "report.html"
    _replace_text(md, render_markdown(blocks))
    _replace_text(page, render_html(blocks, title))
    return md, page


def check_target(path: Path, what: str) -> None:
    """Raise ValueError where ``what`` cannot be written at ``path``: a directory there, a link into
    no directory, or a named pipe that nothing opens to read (the write waited for one for ever;
    one with a reader is written in place, as the outputs of a run are)."""
    target = resolved(path)
    if target.is_dir():
        raise ValueError(f"{path} is a directory, where {what} would be written")
    if target.is_fifo():
        check_writable(target)  # a while for its reader, then refused
        return
    if not target.parent.is_dir():
        raise ValueError(f"{path} links to {target}, in a directory that does not exist")


def _replace_text(path: Path, text: str) -> None:
    """Write ``path`` whole (:func:`write_whole`), so that a failed write leaves the last report
    as it was; a name that is not UTF-8 (a run's file, a command line) is written escaped. Such a
    name failed the write after it had emptied the earlier report.md."""
    write_whole(path, lambda p: p.write_text(text, encoding="utf-8", errors="backslashreplace"))


# ---- runs -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """One results file, its records sorted by type."""

    path: str
    label: str
    header: dict[str, Any]
    sweeps: tuple[dict[str, Any], ...]
    epochs: tuple[dict[str, Any], ...]
    summaries: tuple[dict[str, Any], ...]
    probes: tuple[dict[str, Any], ...]
    clusters: tuple[dict[str, Any], ...]
    bandwidths: tuple[dict[str, Any], ...] = ()


def load_run(path: str | Path, label: str | None = None) -> Run:
    """Read one JSON Lines file written by commbench; ValueError (one line) when it is not one."""
    p = Path(path)
    try:
        lines, note = complete_lines(p.read_text(), p)
    except OSError as exc:
        raise ValueError(f"cannot read {p}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{p} is not a text file") from None
    numbered = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p} is not JSON Lines: {exc.msg} at line {n}") from None
        if not isinstance(r, dict):
            raise ValueError(f"{p} line {n} is not a JSON object")
        numbered.append((n, r))
    check_one_run(p, numbered)
    records = [r for _, r in numbered]
    by: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by.setdefault(str(r.get("type")), []).append(r)
    known = ("sweep", "epoch", "train_summary", "probe", "cluster", "bandwidth")
    if not any(by.get(k) for k in known):
        raise ValueError(f"{p} holds no commbench records (sweep, epoch, train_summary, probe or bandwidth)")
    for kind, keys in REQUIRED.items():
        for r in by.get(kind, []):
            missing = next((k for k in keys if k not in r), None)
            if missing:
                raise ValueError(f"{p} has a {kind} record without {missing!r}: not written by commbench")
    for n, r in numbered:
        check_record(p, n, r)
    check_points_once(p, numbered)
    headers = by.get("header", [])
    if note:
        print(note, file=sys.stderr)
    return Run(
        path=str(p),
        label=label or p.stem,
        header=headers[0] if headers else {},
        sweeps=tuple(by.get("sweep", [])),
        epochs=tuple(by.get("epoch", [])),
        summaries=tuple(by.get("train_summary", [])),
        probes=tuple(by.get("probe", [])),
        clusters=tuple(by.get("cluster", [])),
        bandwidths=tuple(by.get("bandwidth", [])),
    )


NUMBER, WHOLE, TEXT, LIST, NUMBERS = "a number", "a whole number", "text", "a list", "a list of numbers"
# A time, a rate or a bandwidth commbench measured; a count of ranks or bytes. Plotted on log axes
# or as bars, a size of 0 or less, or an infinite time, made a report of warnings from matplotlib
# (a loss may be infinite or NaN: a run that diverged writes it so).
AMOUNT, COUNT, TALLY = "a finite number >= 0", "a whole number >= 1", "a whole number >= 0"


def _is(v: Any, what: str) -> bool:
    """Whether ``v`` is ``what`` (NUMBER, WHOLE, AMOUNT, COUNT, TALLY, TEXT, LIST, NUMBERS); a bool is
    no number."""
    if what == AMOUNT:  # NaN compares false; an integer past a float's range is refused too
        return _is(v, NUMBER) and 0 <= v <= sys.float_info.max
    if what in (COUNT, TALLY):  # plotted or averaged, so within a float's range
        return _is(v, WHOLE) and (1 if what == COUNT else 0) <= v <= sys.float_info.max
    if what in (NUMBER, WHOLE):
        # an integer past a float's range failed where it was formatted or divided (OverflowError)
        return (
            isinstance(v, int if what == WHOLE else int | float)
            and not isinstance(v, bool)
            and (isinstance(v, float) or abs(v) <= sys.float_info.max)
        )
    if what == NUMBERS:
        return isinstance(v, list) and all(_is(x, NUMBER) for x in v)
    return isinstance(v, str if what == TEXT else list)


_WIRE = {
    "computed_wire_bytes": WHOLE,
    "measured_wire_bytes": WHOLE,
    "wire_bytes_ratio": NUMBER,
    "wire_expected_ratio": NUMBER,
    "wire_check": TEXT,
}
_HOST = {
    "tx_bytes": WHOLE,
    "rx_bytes": WHOLE,
    "computed_tx_bytes": WHOLE,
    "computed_rx_bytes": WHOLE,
    "cpu_user": NUMBER,
    "cpu_system": NUMBER,
    "counted_s": NUMBER,
}
# What each field the report and summary compute with, format or group by must be where it is not
# null (null: not measured); a record's own fields (REQUIRED) may not be null.
VALUES: dict[str, dict[str, str]] = {
    "header": {"command": TEXT, "memory_bytes": AMOUNT},
    "sweep": {
        "collective": TEXT,
        "algorithm": TEXT,
        "resolved_algorithm": TEXT,
        "world_size": COUNT,
        "size_bytes": COUNT,
        "busbw_gbps": AMOUNT,
        "backend": TEXT,
        "device": TEXT,
        "dtype": TEXT,
        "op": TEXT,
        "block": COUNT,
        "root": TALLY,
        "time_us": AMOUNT,
        "time_us_min": AMOUNT,
        "time_us_p90": AMOUNT,
        "iters": COUNT,
        "warmup": TALLY,
        "algbw_gbps": AMOUNT,
        "busbw_ratio_to_builtin": AMOUNT,
        "frac_of_limit": AMOUNT,
        "wrong": TALLY,
        **_WIRE,
    },
    "epoch": {
        "strategy": TEXT,
        "epoch": WHOLE,
        "step_losses": NUMBERS,
        "time_s": AMOUNT,
        "images_per_s": AMOUNT,
        "loss": NUMBER,
        "eval_loss": NUMBER,
        "accuracy": NUMBER,
        **_WIRE,
    },
    "train_summary": {
        "strategy": TEXT,
        "world_size": COUNT,
        "loss_threshold": AMOUNT,
        "epochs": COUNT,
        "step_time_ms": AMOUNT,
        "images_per_s": AMOUNT,
        "model": TEXT,
        "batch_size": WHOLE,
        "data_ms": AMOUNT,
        "forward_ms": AMOUNT,
        "backward_ms": AMOUNT,
        "exposed_comm_ms": AMOUNT,
        "optimizer_ms": AMOUNT,
        "comm_ms": AMOUNT,
        "hidden_comm_fraction": NUMBER,
        "first_epoch_time_s": AMOUNT,
        "later_epoch_time_s": AMOUNT,
        "final_loss": NUMBER,
        "final_accuracy": NUMBER,
        "trainable_params": NUMBER,
        "grad_bytes_per_epoch": NUMBER,
        "wire_bytes_per_rank_per_epoch": NUMBERS,
        "wire_recv_bytes_per_rank_per_epoch": NUMBERS,
        "step_time_ratio_to_ddp": NUMBER,
    },
    "bandwidth": {
        "name": TEXT,
        "size_bytes": COUNT,
        "time_s": AMOUNT,
        "gbps": AMOUNT,
        "expected_gbps": AMOUNT,
        "limit_gbps": AMOUNT,
        "limit_source": TEXT,
    },
    "probe": {
        "samples": LIST,
        "markers": LIST,
        "nvml": TEXT,
        "wall_s": AMOUNT,
        "overhead_core_fraction": NUMBER,
    },
}
REQUIRED: dict[str, tuple[str, ...]] = {
    "sweep": ("collective", "algorithm", "world_size", "size_bytes", "busbw_gbps"),
    "train_summary": ("strategy", "world_size", "step_time_ms", "images_per_s"),
    "epoch": ("strategy", "epoch", "step_losses"),
    "bandwidth": ("name", "size_bytes", "time_s", "gbps"),
}


def check_record(path: str | Path, line: int, r: dict[str, Any]) -> None:
    """ValueError (one line, naming the file, line and field) where a field the report or summary
    reads has the wrong type or shape: hosts a list of objects, a probe's summary an object,
    numbers numbers. Formatted as found, such a value made a traceback or an error naming no field."""
    kind = r.get("type")

    def refuse(where: str, field: str, value: Any, what: str) -> None:
        shown = json.dumps(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        if isinstance(value, int) and abs(value) > sys.float_info.max:
            what = f"{what} within a float's range"
        raise ValueError(
            f"{path} line {line}: {where} {field!r} is {shown}, not {what}: not written by commbench"
        )

    for field, what in VALUES.get(str(kind), {}).items():
        value = r.get(field)
        if value is None and field in REQUIRED.get(str(kind), ()) and field in r:
            refuse(f"the {kind} record's", field, value, what)
        if value is not None and not _is(value, what):
            refuse(f"the {kind} record's", field, value, what)
    hosts = r.get("hosts")
    if kind in ("sweep", "epoch", "cluster") and hosts is not None:
        if not isinstance(hosts, list) or not all(isinstance(h, dict) for h in hosts):
            raise ValueError(f"{path} has a {kind} record whose hosts are not a list of objects")
        for h in hosts:
            for field, what in _HOST.items():
                if h.get(field) is not None and not _is(h[field], what):
                    refuse(f"the {kind} record's host", field, h[field], what)
    summary = r.get("summary")
    if kind == "probe" and summary is not None:
        if not isinstance(summary, dict):
            raise ValueError(f"{path} has a probe record whose summary is not an object")
        gpus = summary.get("gpus")
        if gpus is not None and not (isinstance(gpus, list) and all(isinstance(g, dict) for g in gpus)):
            raise ValueError(f"{path} has a probe record whose summary's gpus are not a list of objects")
    if kind == "probe":  # a study's means read them sample by sample, between the markers
        for field in ("samples", "markers"):
            items = r.get(field)
            if isinstance(items, list) and not all(isinstance(x, dict) for x in items):
                raise ValueError(f"{path} has a probe record whose {field} are not a list of objects")
        for x in r.get("samples") or []:
            gpus = x.get("gpus")
            if gpus is not None and not (isinstance(gpus, list) and all(isinstance(g, dict) for g in gpus)):
                raise ValueError(f"{path} has a probe record whose samples' gpus are not a list of objects")


def check_points_once(path: str | Path, numbered: Sequence[tuple[int, dict[str, Any]]]) -> None:
    """ValueError where a file's sweep records (with their lines) hold one point twice: one run
    writes each point once, and a table showed one of the two (summary's mean counted both)."""
    from commbench.bench.collectives import in_place_form

    seen: dict[tuple, int] = {}
    for line, r in numbered:
        if r.get("type") != "sweep":
            continue
        setting = tuple(
            str(r.get(k)) for k in ("world_size", "backend", "device", "dtype", "op", "block", "root")
        )
        point = (r["collective"], r["algorithm"], r["size_bytes"], in_place_form(r), setting)
        if point in seen:
            raise ValueError(
                f"{path} line {line}: {one_line(r['collective'])} {one_line(r['algorithm'])} at "
                f"{r['size_bytes']} B is there already (line {seen[point]}); commbench writes each point "
                "once: give each run a file"
            )
        seen[point] = line


def _mean_max(st: Any, scale: float) -> list[str]:
    """A probe summary's mean and max of one quantity, scaled; '-' for what is not there."""
    if not isinstance(st, dict):
        return ["-", "-"]
    return [
        fmt(v * scale if isinstance(v, int | float) else None, ".1f") for v in (st.get("mean"), st.get("max"))
    ]


# ---- formatting -----------------------------------------------------------------------------


def fmt(x: Any, spec: str = ".3g") -> str:
    """A number in ``spec``, '-' for None or NaN."""
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    if isinstance(x, bool) or not isinstance(x, int | float):
        return str(x)
    return format(x, spec)


def _host_row(label: str, h: dict[str, Any], cpu: list[str]) -> list[str]:
    """One row of the per-host table: measured and computed bytes each way, their ratio, CPU."""
    cells = [label, str(h.get("rank")), h.get("address", "-"), h.get("nic", "-")]
    for way in ("tx", "rx"):
        measured, computed = h.get(f"{way}_bytes"), h.get(f"computed_{way}_bytes")
        ratio = measured / computed if computed and measured is not None else None
        cells += [fmt(measured, ",d"), fmt(computed, ",d"), fmt(ratio, ".3f")]
    return cells + cpu


def pct(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.3f}"


def _size(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _slug(text: str) -> str:
    """A file name's part for ``text``: letters and digits, the rest as '-', at most 80 characters
    (a name in a record written by hand made a plot's name too long for the file system)."""
    return "".join(c if c.isalnum() else "-" for c in text).strip("-").lower()[:80].rstrip("-") or "run"


# ---- sections -------------------------------------------------------------------------------


class _Plots:
    """Names and draws the PNGs of one report; a failed plot becomes a note, not a failed report."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.files: list[str] = []

    def name(self, name: str) -> str:
        """A file name not yet used in this report."""
        file = f"{_slug(name)}.png"
        i = 2
        while file in self.files:
            file = f"{_slug(name)}-{i}.png"
            i += 1
        self.files.append(file)
        return file

    def add(self, name: str, draw: Callable[[Path], None], caption: str) -> list[Block]:
        file = self.name(name)
        check_target(self.out_dir / file, "a plot")
        try:
            draw(self.out_dir / file)
        except (OSError, Interrupted):  # the report's directory refused a file, or a signal: no report
            raise
        except Exception as exc:  # whatever the records or the plotting library raise
            return [Para(text=f"(plot {file} not drawn: {first_line(exc)})")]
        return [Image(file=file, caption=caption)]


def machine_section(runs: Sequence[Run]) -> list[Block]:
    """One column per run: where and with what each ran."""

    def value(run: Run, key: str) -> str:
        v = run.header.get(key)
        if key == "link_rate_gbps" and v is None and run.clusters:
            v = run.clusters[0].get("link_rate_gbps")
        if key == "memory_bytes" and isinstance(v, int | float):
            return f"{v / 1e9:.1f} GB"
        if key == "gpus" and isinstance(v, list):
            return "; ".join(str(g.get("name", g)) if isinstance(g, dict) else str(g) for g in v) or "-"
        if key == "commit" and isinstance(v, str):
            return v[:12] + (" (modified)" if run.header.get("commit_modified") else "")
        return "-" if v is None else str(v)

    rows = [[label] + [value(r, key) for r in runs] for key, label in MACHINE_FIELDS]
    rows = [r for r in rows if any(c != "-" for c in r[1:])]
    return [Heading(text="Machine"), table(["", *[r.label for r in runs]], rows)]


def _table_of(r: dict[str, Any]) -> tuple:
    """What a sweep record shares with the others of its table (collective, form and op aside): ranks,
    backend, device, dtype and block; send/recv of the same is that table's limit."""
    return (r.get("world_size"), r.get("backend"), r.get("device"), r.get("dtype"), r.get("block"))


def sweep_section(run: Run, plots: _Plots) -> list[Block]:
    """Per collective and world size: the nccl-tests-style table and busbw against size (the
    heading names the in-place form of reduce_scatter and all_gather)."""
    from commbench.bench.collectives import form_name, in_place_form
    from commbench.bench.report import series_name

    blocks: list[Block] = []
    # One table per sweep: its collective's form, op and block as well as ranks, backend, device
    # and dtype (points of another op or collective were rows of one table, the heading naming
    # both collectives); the send/recv limit goes with every sweep of its ranks and block.
    groups: dict[tuple, list[dict[str, Any]]] = {}
    limits: dict[tuple, list[dict[str, Any]]] = {}
    for r in run.sweeps:
        where = _table_of(r)
        if r["collective"] == "sendrecv":
            limits.setdefault(where, []).append(r)
        else:
            groups.setdefault((*where, form_name(r["collective"], in_place_form(r)), r.get("op")), []).append(
                r
            )
    for where, rows in limits.items():
        matched = [key for key in groups if key[:5] == where]
        for key in matched:
            groups[key] = groups[key] + rows
        if not matched:
            groups[(*where, "sendrecv", None)] = rows
    headed = collections.Counter((*key[:4], key[5]) for key in groups)
    for (world, backend, device, dtype, block, name, op), rows in groups.items():
        # The op where it is not the default sum (or another table shares the rest); --block where
        # it is not 1: a lone `-o max` or `--block 7` sweep was headed as a default one.
        shared = headed[(world, backend, device, dtype, name)] > 1
        said = (
            op if op not in (None, "sum") or shared else None,
            f"--block {block}" if block not in (None, 1) else None,
        )
        extra = "".join(f", {x}" for x in said if x)
        blocks.append(
            Heading(
                text=f"Sweep: {name}, {rank_count(world)}, {backend} on {device}, {dtype}{extra}", level=3
            )
        )
        body = []
        beside = name != "sendrecv"  # send/recv measured as the limit of other collectives
        for r in sorted(rows, key=lambda r: (r["size_bytes"], r["collective"] == "sendrecv")):
            algo = "limit (send/recv)" if r["collective"] == "sendrecv" and beside else series_name(r)
            body.append(
                [
                    _size(r["size_bytes"]),
                    algo,
                    fmt(r.get("time_us"), ".1f"),
                    fmt(_spread(r), ".2f"),
                    fmt(r.get("algbw_gbps"), ".3f"),
                    fmt(r["busbw_gbps"], ".3f"),
                    fmt(r.get("busbw_ratio_to_builtin"), ".2f"),
                    fmt(r.get("frac_of_limit"), ".2f"),
                    fmt(r.get("wrong"), "d"),
                ]
            )
        iters = sorted(
            {(r["iters"], r["warmup"]) for r in rows if r.get("iters") and r.get("warmup") is not None}
        )
        timed = (
            f"median of {iters[0][0]} timed iteration{'s' * (iters[0][0] != 1)} (after {iters[0][1]} "
            "warm-up) of the slowest rank"
            if len(iters) == 1
            else "median over the timed iterations of the slowest rank"
        )
        blocks.append(
            table(
                [
                    "size",
                    "algorithm",
                    "time (us)",
                    "p90/min",
                    "algbw (GB/s)",
                    "busbw (GB/s)",
                    "vs builtin",
                    "of limit",
                    "wrong",
                ],
                body,
            )
        )
        blocks.append(
            Para(
                text=f"time = {timed}; p90/min = the 90th percentile's time over the fastest "
                "iteration's (1.00: steady; a ratio that stands out where p90/min is high is noise, "
                "re-run with more -n); busbw = algbw x bus factor (nccl-tests); the limit is "
                "bidirectional send/recv between ring neighbours at the same size, measured in the same "
                "run; of limit above 1: the point beat the send/recv measured beside it, at small sizes "
                "most often noise in one or the other (see p90/min), elsewhere a path the backend's own "
                "collective takes and send/recv does not; GB = 1e9 B."
            )
        )
        from commbench.bench.report import plot_busbw

        title = f"{name}, {rank_count(world)}, {backend} on {device}, {dtype}{extra}"
        blocks += plots.add(
            f"{run.label}-busbw-{name}-ws{world}{extra}",
            lambda p, rows=rows, title=title: plot_busbw(rows, str(p), title),
            f"busbw against message size ({title}); dashed: the send/recv limit",
        )
    return blocks


def _spread(r: dict[str, Any]) -> float | None:
    """A point's p90 time over its fastest (None where the record lacks either, or the fastest is 0)."""
    low, p90 = r.get("time_us_min"), r.get("time_us_p90")
    if not isinstance(low, int | float) or not isinstance(p90, int | float) or low <= 0:
        return None
    spread = p90 / low
    return spread if math.isfinite(spread) else None


def _check_row(label: str, r: dict[str, Any]) -> list[str]:
    flag = r.get("wire_check")
    return [
        label,
        fmt(r.get("computed_wire_bytes"), ",d") if r.get("computed_wire_bytes") is not None else "-",
        fmt(r.get("measured_wire_bytes"), ",d") if r.get("measured_wire_bytes") is not None else "-",
        fmt(r.get("wire_bytes_ratio"), ".4f"),
        fmt(r.get("wire_expected_ratio"), ".4f"),
        "ok" if flag is None else ("FLAG: " + flag if says_off(flag) else "note: " + flag),
    ]


def wire_section(run: Run) -> list[Block]:
    """Computed against measured bytes, per sweep point and per epoch, flagged when out of tolerance."""
    from commbench.bench.collectives import form_name, in_place_form
    from commbench.bench.report import series_name

    measured = {_table_of(x) for x in run.sweeps if x["collective"] != "sendrecv"}
    worlds = len({x.get("world_size") for x in run.sweeps}) > 1
    dtypes = len({x.get("dtype") for x in run.sweeps}) > 1
    ops = len({x.get("op") for x in run.sweeps if x.get("op") is not None}) > 1

    def point(r: dict[str, Any]) -> str:
        """A point as the sweep's table names it: send/recv is the limit beside a collective of the
        same table, and the collective's form says in-place; ranks and dtype where the run has several."""
        size = _size(r["size_bytes"])
        if r["collective"] == "sendrecv" and _table_of(r) in measured:
            name = f"limit (send/recv) {size}"
        else:
            name = f"{form_name(r['collective'], in_place_form(r))} {series_name(r)} {size}"
        more = [rank_count(r.get("world_size"))] * worlds + [str(r.get("dtype"))] * dtypes
        more += [str(r.get("op"))] * (ops and r.get("op") is not None)
        return name + (f" ({', '.join(more)})" if more else "")

    def cpu(h: dict[str, Any]) -> list[str]:
        counted = h.get("counted_s")
        if isinstance(counted, int | float) and counted < CPU_COUNTED_MIN_S:
            return ["-", "-"]
        return [fmt(h.get("cpu_user"), ".4f"), fmt(h.get("cpu_system"), ".4f")]

    rows = []
    for r in run.sweeps:
        if r.get("computed_wire_bytes") is not None:
            rows.append(_check_row(point(r), r))
    for r in run.epochs:
        if r.get("computed_wire_bytes") is not None:
            rows.append(_check_row(f"{r['strategy']} epoch {r['epoch']} (per step)", r))
    host_rows = []
    sweep_last: dict[tuple, dict[str, Any]] = {}
    for r in run.sweeps:  # per host: the largest size of each series is enough to read the split
        key = (*_table_of(r), r["collective"], in_place_form(r), r.get("op"), r["algorithm"])
        if r.get("hosts") and r["size_bytes"] >= sweep_last.get(key, {}).get("size_bytes", -1):
            sweep_last[key] = r
    epoch_last: dict[str, dict[str, Any]] = {}
    for r in run.epochs:
        if r.get("hosts"):
            epoch_last[r["strategy"]] = r
    points = [(point(r), r) for r in sweep_last.values()]
    points += [(f"{s} epoch {r['epoch']} (per step)", r) for s, r in epoch_last.items()]
    for label, r in points:
        for h in r["hosts"]:
            host_rows.append(_host_row(label, h, cpu(h)))
    for c in run.clusters:
        for h in c.get("hosts") or []:
            host_rows.append(_host_row("whole run (cluster)", h, ["-", "-"]))
    if not rows and not host_rows:
        return []
    blocks: list[Block] = [Heading(text="Computed against measured bytes", level=3)]
    if rows:  # none where no point was probed (--no-probe; the cluster still counts each host's port)
        flagged = sum(1 for r in rows if r[-1].startswith("FLAG"))
        blocks += [
            Para(
                text="computed = the cost model's bytes on the wire per call (or per training step); "
                "measured = the interface counters' delta less an idle baseline; ratio = measured / "
                "computed, expected = the protocol-overhead ratio for this interconnect. "
                + (f"{flagged} point(s) outside tolerance." if flagged else "No point outside tolerance.")
            ),
            table(["point", "computed (B)", "measured (B)", "ratio", "expected", "check"], rows),
        ]
    if host_rows:
        blocks += [
            Heading(text="Per host", level=4),
            Para(
                text="bytes per call (sweeps, at each series' largest size) or per step (training, its "
                "last epoch) at each host's interface beside the cost model; CPU in seconds per call or "
                "step, summed over the host's ranks, '-' where the counted work took under "
                f"{CPU_COUNTED_MIN_S:g} s (CPU time moves in clock ticks of 10 ms; records "
                "without that time, from an older commbench, show what they hold) and in the cluster's "
                "whole-run rows (its ports' bytes, no CPU). A shared interface such as loopback carries "
                "every rank's traffic once."
            ),
            table(
                [
                    "point",
                    "host rank",
                    "address",
                    "nic",
                    "tx (B)",
                    "computed tx",
                    "tx ratio",
                    "rx (B)",
                    "computed rx",
                    "rx ratio",
                    "cpu user (s)",
                    "cpu sys (s)",
                ],
                host_rows,
            ),
        ]
    return blocks


SUMMARY_COLUMNS: tuple[tuple[str, str, Callable[[dict[str, Any]], str]], ...] = (
    ("strategy", "strategy", lambda s: s["strategy"]),
    ("ranks", "ranks", lambda s: str(s["world_size"])),
    ("batch", "batch/rank", lambda s: str(s.get("batch_size", "-"))),
    ("step", "step ms", lambda s: fmt(s["step_time_ms"], ".2f")),
    ("data", "data", lambda s: fmt(s.get("data_ms"), ".2f")),
    ("fwd", "forward", lambda s: fmt(s.get("forward_ms"), ".2f")),
    ("bwd", "backward", lambda s: fmt(s.get("backward_ms"), ".2f")),
    ("exp", "exposed comm", lambda s: fmt(exposed_comm_ms(s), ".2f")),
    ("opt", "optimizer", lambda s: fmt(s.get("optimizer_ms"), ".2f")),
    ("comm", "comm ms", lambda s: fmt(s.get("comm_ms"), ".2f")),
    ("hidden", "hidden", lambda s: pct(s.get("hidden_comm_fraction"))),
    ("ips", "images/s", lambda s: fmt(s["images_per_s"], ".0f")),
    ("first", "1st epoch s", lambda s: fmt(s.get("first_epoch_time_s"), ".3f")),
    ("later", "later epochs s", lambda s: fmt(s.get("later_epoch_time_s"), ".3f")),
    ("loss", "final loss", lambda s: fmt(s.get("final_loss"), ".3f")),
    ("acc", "accuracy", lambda s: pct(s.get("final_accuracy"), 1)),
    ("grad", "grad MB/epoch", lambda s: mb(s.get("grad_bytes_per_epoch"))),
    (
        "wire",
        "wire MB/rank/epoch",
        lambda s: (
            mb(max(s["wire_bytes_per_rank_per_epoch"])) if s.get("wire_bytes_per_rank_per_epoch") else "-"
        ),
    ),
    ("ddp", "x ddp", lambda s: fmt(s.get("step_time_ratio_to_ddp"), ".2f")),
)


# An epoch record's columns, in the report and in the table a stopped train or compare prints.
EPOCH_COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("strategy", lambda e: str(e["strategy"])),
    ("epoch", lambda e: str(e["epoch"])),
    ("steps", lambda e: str(e.get("steps", "-"))),
    ("time (s)", lambda e: fmt(e.get("time_s"), ".3f")),
    ("images/s", lambda e: fmt(e.get("images_per_s"), ".0f")),
    ("loss", lambda e: fmt(e.get("loss"), ".4f")),
    ("eval loss", lambda e: fmt(e.get("eval_loss"), ".4f")),
    ("accuracy", lambda e: pct(e.get("accuracy"), 1)),
)


def training_section(run: Run, plots: _Plots) -> list[Block]:
    """The compare table, per-epoch times, and the breakdown, loss and throughput plots. A run
    stopped before its end has epochs but no summary (written last): its epochs and loss curve."""
    if not run.summaries and not run.epochs:
        return []
    from commbench.bench.report import plot_loss, plot_throughput, plot_training

    if run.summaries:
        s0 = run.summaries[0]
        what = (
            f"{s0.get('model', '?')} on {s0.get('dataset', '?')}, {rank_count(s0['world_size'])}, "
            f"{s0.get('backend', '?')} on {s0.get('device', '?')}"
        )
        blocks: list[Block] = [
            Heading(text=f"Training: {what}", level=3),
            Para(
                text=f"{s0.get('trainable_params', 0):,} trainable parameters, "
                f"{s0.get('syncs_per_epoch', '-')} gradient syncs per epoch. ms = median per step over the "
                "timed steps (later epochs) of the ranks' mean; exposed comm = from the last gradient until "
                "gradients are synced; hidden = share of communication overlapping backward; MB = 1e6 B."
                + (
                    " data = loading the step's batch, once for every strategy (they run step by step on "
                    "the same batches), so each row is charged the same."
                    if len(run.summaries) > 1
                    else ""
                )
            ),
            table(
                [c[1] for c in SUMMARY_COLUMNS], [[c[2](s) for c in SUMMARY_COLUMNS] for s in run.summaries]
            ),
            *([Para(text="; ".join(lines) + ".")] if (lines := threshold_lines(run.summaries)) else []),
        ]
    else:
        config = run.header.get("config")
        config = config if isinstance(config, dict) else {}
        e0 = run.epochs[0]
        what = (
            f"{config.get('model', '?')} on {config.get('dataset', '?')}, "
            f"{rank_count(e0.get('world_size', '?'))}, "
            f"{run.header.get('backend', '?')}"
        )
        blocks = [
            Heading(text=f"Training: {what}", level=3),
            Para(
                text="The run stopped before its summary (the train_summary records, written once every "
                "strategy has finished): below are the epochs it finished; there is no comparison of step "
                "times."
            ),
        ]
    if run.epochs:
        blocks.append(
            table([c[0] for c in EPOCH_COLUMNS], [[c[1](e) for c in EPOCH_COLUMNS] for e in run.epochs])
        )
    epochs, summaries = list(run.epochs), list(run.summaries)
    if not summaries:
        return blocks + plots.add(
            f"{run.label}-loss", lambda p: plot_loss(epochs, p), "training loss per step (finished epochs)"
        )
    bfile, lfile = plots.name(f"{run.label}-breakdown"), plots.name(f"{run.label}-loss")
    for file in (bfile, lfile):
        check_target(plots.out_dir / file, "a plot")
    try:
        plot_training(epochs, summaries, plots.out_dir / bfile, plots.out_dir / lfile)
        blocks.append(Image(file=bfile, caption=f"median step time by phase per strategy ({what})"))
        if epochs:
            blocks.append(Image(file=lfile, caption="training loss per step"))
    except (OSError, Interrupted):
        raise
    except Exception as exc:  # as in _Plots.add
        blocks.append(Para(text=f"(training plots not drawn: {first_line(exc)})"))
    blocks += plots.add(
        f"{run.label}-throughput",
        lambda p: plot_throughput(summaries, p, what),
        "images per second per strategy",
    )
    return blocks


def probe_section(run: Run, plots: _Plots) -> list[Block]:
    """The sampler's summary and its timeline (utilisation, memory, bytes per second)."""
    from commbench.bench.report import plot_probe_timeline

    blocks: list[Block] = []
    for i, probe in enumerate(run.probes, 1):
        s = probe.get("summary") or {}
        rows = []
        for key, label, scale, unit in (
            ("cpu_user_pct", "machine CPU user", 1, "% of all cores"),
            ("cpu_system_pct", "machine CPU system", 1, "% of all cores"),
            ("process_cpu_pct", "rank-0 process CPU", 1, "% of one core"),
            ("rss_bytes", "rank-0 resident memory", 1e-6, "MB"),
            ("nic_tx_bytes_per_s", f"{probe.get('nic') or 'interface'} sent", 1e-6, "MB/s"),
            ("nic_rx_bytes_per_s", f"{probe.get('nic') or 'interface'} received", 1e-6, "MB/s"),
        ):
            rows.append([label, unit, *_mean_max(s.get(key), scale)])
        for g in s.get("gpus") or []:
            for key, label, scale, unit in (
                ("gpu_util_pct", "utilisation", 1, "%"),
                ("memory_used_bytes", "memory used", 1e-6, "MB"),
                ("power_w", "power", 1, "W"),
            ):
                rows.append([f"GPU {g.get('index')} {label}", unit, *_mean_max(g.get(key), scale)])
        blocks += [
            Heading(text="Probe timeline" + (f" {i}" if len(run.probes) > 1 else ""), level=3),
            Para(
                text=f"{s.get('samples', len(probe.get('samples') or []))} samples every "
                f"{probe.get('interval_s', '?')} s over {fmt(probe.get('wall_s'), '.1f')} s on rank 0; the "
                f"sampler used {pct(probe.get('overhead_core_fraction'), 2)} of one core. "
                + (probe.get("nvml") or "")
            ),
            table(["quantity", "unit", "mean", "max"], rows),
        ]
        blocks += plots.add(
            f"{run.label}-timeline-{i}",
            lambda p, probe=probe: plot_probe_timeline(probe, p, run.label),
            "utilisation, memory and bytes per second over the run; grey lines are phase markers",
        )
    return blocks


def bandwidth_section(run: Run) -> list[Block]:
    """``commbench bandwidth``'s copies: measured against expected and the link's limit."""
    if not run.bandwidths:
        return []
    rows = [
        [
            r["name"],
            _size(r["size_bytes"]),
            fmt(r["time_s"] * 1e6, ".1f"),
            fmt(r["gbps"], ".2f"),
            *("n/a" if r.get(k) is None else fmt(r[k], ".2f") for k in ("expected_gbps", "limit_gbps")),
            pct(r["gbps"] / r["limit_gbps"]) if r.get("limit_gbps") else "-",
        ]
        for r in run.bandwidths
    ]
    sources = sorted({r["limit_source"] for r in run.bandwidths if r.get("limit_source")})
    devices = sorted({str(r.get("device", "?")) for r in run.bandwidths})
    return [
        Heading(text=f"Copy bandwidth ({', '.join(devices)})", level=3),
        table(["copy", "size", "time (us)", "GB/s", "expected GB/s", "limit GB/s", "of limit"], rows),
        *([Para(text="; ".join(sources))] if sources else []),
    ]


def run_sections(run: Run, plots: _Plots) -> list[Block]:
    """Everything one results file holds."""
    command = run.header.get("command")
    blocks: list[Block] = [Heading(text=f"{run.label}")]
    blocks.append(Para(text=f"file: {run.path}"))
    if command:
        blocks.append(Code(text=command))
    blocks += sweep_section(run, plots)
    blocks += bandwidth_section(run)
    blocks += training_section(run, plots)
    blocks += wire_section(run)
    blocks += probe_section(run, plots)
    return blocks


# ---- baseline -------------------------------------------------------------------------------


def _busbw_map(runs: Sequence[Run]) -> dict[tuple, list[tuple[str, float]]]:
    """(run label, busbw) by (collective, ranks, algorithm, size, dtype, op): points of a float64
    run are not compared with a float32 baseline's, nor an in-place form's with the other's, and
    a point several files hold is kept once per file (keyed by the point alone, the last file's
    hid the others')."""
    from commbench.bench.collectives import form_name, in_place_form

    points: dict[tuple, list[tuple[str, float]]] = {}
    for run in runs:
        for r in run.sweeps:
            key = (
                form_name(r["collective"], in_place_form(r)),
                r["world_size"],
                r["algorithm"],
                r["size_bytes"],
                str(r.get("dtype", "?")),
                str(r.get("op") or "-"),
            )
            points.setdefault(key, []).append((run.label, r["busbw_gbps"]))
    return points


def _step_map(runs: Sequence[Run]) -> dict[tuple, list[tuple[str, dict[str, Any]]]]:
    """(run label, summary) by (strategy, ranks, model, batch), once per file as :func:`_busbw_map`."""
    points: dict[tuple, list[tuple[str, dict[str, Any]]]] = {}
    for run in runs:
        for s in run.summaries:
            points.setdefault(
                (s["strategy"], s["world_size"], s.get("model"), s.get("batch_size")), []
            ).append((run.label, s))
    return points


def _pairs(now: dict[tuple, list], base: dict[tuple, list], keys: Sequence[tuple]) -> tuple[list, bool]:
    """([(key, (run, value), (baseline, value))] for every run and baseline holding each key, whether
    some key is held more than once on a side (then the rows name their run and baseline)."""
    named = any(len(now[k]) > 1 or len(base[k]) > 1 for k in keys)
    return [(k, a, b) for k in keys for a in now[k] for b in base[k]], named


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if b else None


def baseline_section(runs: Sequence[Run], baselines: Sequence[Run], plots: _Plots) -> list[Block]:
    """Ratios of this run to the baseline: busbw per size and algorithm, step time per strategy.
    Where several files (of the runs or of the baselines) hold one point, one row per pair of them."""
    blocks: list[Block] = [
        Heading(text="Against the baseline"),
        Para(text="baseline: " + ", ".join(b.path for b in baselines)),
    ]
    several = "Several files hold the same point: one row for each file of this run and of the baseline."
    now, base = _busbw_map(runs), _busbw_map(baselines)
    common = sorted(k for k in now if k in base)
    mixed = len({k[4:] for k in common}) > 1  # several dtypes or ops: the plot's labels name them
    if common:
        pairs, named = _pairs(now, base, common)
        who = ["run", "baseline"] if named else []
        rows = [
            [
                *([a[0], b[0]] if named else []),
                k[0],
                str(k[1]),
                k[2],
                _size(k[3]),
                k[4],
                k[5],
                fmt(b[1], ".3f"),
                fmt(a[1], ".3f"),
                fmt(_ratio(a[1], b[1]), ".2f"),
            ]
            for k, a, b in pairs
        ]
        blocks += [
            Heading(text="busbw", level=3),
            Para(
                text="ratio = this run's busbw / the baseline's (above 1: faster)."
                + (" " + several if named else "")
            ),
            table(
                [
                    *who,
                    "collective",
                    "ranks",
                    "algorithm",
                    "size",
                    "type",
                    "op",
                    "baseline (GB/s)",
                    "this run (GB/s)",
                    "ratio",
                ],
                rows,
            ),
        ]
        blocks += plots.add(
            "baseline-busbw",
            lambda p: _ratio_plot(
                [
                    (f"{a[0]}/{b[0]} " if named else "")
                    + f"{k[2]} {_size(k[3])}"
                    + ("".join(f" {x}" for x in (k[4], k[5]) if x not in (None, "-")) if mixed else "")
                    for k, a, b in pairs
                ],
                [_ratio(a[1], b[1]) for _, a, b in pairs],
                p,
                "busbw / baseline",
            ),
            "busbw relative to the baseline, per algorithm and size",
        )
    now_s, base_s = _step_map(runs), _step_map(baselines)
    common_s = [k for k in now_s if k in base_s]
    if common_s:
        pairs_s, named_s = _pairs(now_s, base_s, common_s)
        rows = [
            [
                *([a[0], b[0]] if named_s else []),
                k[0],
                str(k[1]),
                str(k[2]),
                str(k[3]),
                fmt(b[1]["step_time_ms"], ".2f"),
                fmt(a[1]["step_time_ms"], ".2f"),
                fmt(_ratio(a[1]["step_time_ms"], b[1]["step_time_ms"]), ".2f"),
                fmt(_ratio(a[1]["images_per_s"], b[1]["images_per_s"]), ".2f"),
            ]
            for k, a, b in pairs_s
        ]
        blocks += [
            Heading(text="Step time", level=3),
            Para(
                text="step-time ratio = this run / the baseline (below 1: faster); throughput ratio the "
                "other way round." + (" " + several if named_s else "")
            ),
            table(
                [
                    *(["run", "baseline"] if named_s else []),
                    "strategy",
                    "ranks",
                    "model",
                    "batch",
                    "baseline ms",
                    "this run ms",
                    "step-time ratio",
                    "images/s ratio",
                ],
                rows,
            ),
        ]
        blocks += plots.add(
            "baseline-step-time",
            lambda p: _ratio_plot(
                [(f"{a[0]}/{b[0]} " if named_s else "") + f"{k[0]} x{k[1]}" for k, a, b in pairs_s],
                [_ratio(a[1]["step_time_ms"], b[1]["step_time_ms"]) for _, a, b in pairs_s],
                p,
                "step time / baseline",
            ),
            "step time relative to the baseline, per strategy",
        )
    if not common and not common_s:
        blocks.append(Para(text="No sweep point or strategy appears in both: nothing to compare."))
    return blocks


def _ratio_plot(labels: list[str], ratios: list[float | None], path: Path, ylabel: str) -> None:
    from commbench.bench.report import plot_ratio_bars

    plot_ratio_bars(labels, ratios, path, ylabel)


# ---- the command ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReportConfig:
    """``commbench report``: results files, where to write, and optional baseline files."""

    inputs: tuple[str, ...]
    out_dir: str
    baselines: tuple[str, ...] = ()
    title: str = "commbench report"

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("no results files given")
        out = Path(self.out_dir)
        if out.exists() and not out.is_dir():
            raise ValueError(f"cannot write the report into {shown(out)}: it is not a directory")


def report_blocks(
    runs: Sequence[Run], out_dir: Path, baselines: Sequence[Run] = (), title: str = "commbench report"
) -> list[Block]:
    """All blocks of a report on ``runs`` (PNGs are drawn into ``out_dir`` as a side effect)."""
    plots = _Plots(out_dir)
    blocks: list[Block] = [Heading(text=title, level=1)]
    blocks += machine_section([*runs, *baselines])
    for run in runs:
        blocks += run_sections(run, plots)
    if baselines:
        blocks += baseline_section(runs, baselines, plots)
    return blocks


def build(config: ReportConfig) -> tuple[Path, Path]:
    """Read the files, draw the plots, write report.md and report.html; returns their paths."""
    runs = _load_all(config.inputs)
    baselines = _load_all(config.baselines, prefix="baseline ")
    out = Path(config.out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create {out}: {exc.strerror}") from None
    with directory_held(out):
        for name in ("report.md", "report.html"):  # before the plots: a refused report draws nothing
            check_target(out / name, "the report")
            for given in (*config.inputs, *config.baselines):  # it was replaced by the report, without a word
                with contextlib.suppress(OSError):
                    if os.path.samefile(given, out / name):
                        raise ValueError(
                            f"{given} is read, and {out / name} would replace it: give another -o"
                        )
        return write_report(report_blocks(runs, out, baselines, config.title), out, config.title)


def _load_all(paths: Sequence[str], prefix: str = "") -> list[Run]:
    """The runs of ``paths``, each labelled by its file's stem; stems that several files share get
    a number, one not already another file's label (x/a, y/a and a-2 were a-1, a-2 and a-2)."""
    stems = [Path(p).stem for p in paths]
    labels: list[str] = []
    for i, stem in enumerate(stems):
        label, n = stem, i + 1
        if stems.count(stem) > 1:
            label = f"{stem}-{n}"
            while label in stems or label in labels:
                n += 1
                label = f"{stem}-{n}"
        labels.append(label)
    return [load_run(p, prefix + label) for p, label in zip(paths, labels, strict=True)]


def add_parser(sub: Any) -> None:
    """Register ``commbench report`` on the CLI's subparsers."""
    p = sub.add_parser(
        "report",
        help="Markdown and HTML report from sweep/train/compare/bandwidth JSON Lines",
        description="Write DIR/report.md and DIR/report.html (one page, with its PNGs as files beside "
        "it): machine information, sweep tables and busbw plots with the limit, training comparisons, "
        "probe timelines, computed-versus-measured bytes (per host where recorded), copy bandwidths; "
        "--baseline adds ratios to other runs.",
    )
    p.add_argument(
        "files",
        nargs="+",
        type=input_path,
        help="JSON Lines written by commbench sweep, train, compare or bandwidth --json",
    )
    p.add_argument(
        "-o",
        "--output",
        type=output_path,
        default="report",
        help="directory to write into (default ./report)",
    )
    p.add_argument(
        "--baseline", nargs="+", type=input_path, default=[], help="JSON Lines of the run to compare against"
    )
    p.add_argument(
        "--title", default="commbench report", help="the report's title (default: commbench report)"
    )


def run(args: argparse.Namespace) -> int:
    """``commbench report``; prints where the report went."""
    config = ReportConfig(
        inputs=tuple(args.files), out_dir=args.output, baselines=tuple(args.baseline), title=args.title
    )
    md, page = build(config)
    print(f"report: {md}  {page}")
    return 0
