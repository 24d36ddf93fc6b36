"""Turning sweep records into a table and a plot. Nothing here measures anything."""

from __future__ import annotations

import contextlib
import math
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from commbench.bench.records import write_whole
from commbench.units import rank_count

_COLS = (
    f"{'size(B)':>12} {'count':>10} {'type':>8} {'redop':>5} {'algorithm':>9} {'time(us)':>10} "
    f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6} {'vs builtin':>10} {'of limit':>8}"
)


def table_header(config: Any, run: dict[str, Any], ranks: Sequence[dict[str, Any]] | None = None) -> str:
    """Title lines: what was swept, on what (each rank's host, process and device where ``ranks``
    gives them, as nccl-tests lists them), and how times were taken."""
    from commbench.bench.collectives import SPECS, form_name
    from commbench.bench.machine import place_lines

    places = place_lines(ranks)
    root = f", root {config.root}" if SPECS[config.collective].has_root else ""  # as nccl-tests' column
    iterations = "iteration" if config.iters == 1 else "iterations"
    return (
        f"# commbench sweep: {form_name(config.collective, config.in_place)}{root}, "
        f"{rank_count(run['world_size'])}, backend {run['backend']}, "
        f"device {run['device']}\n{places}"
        f"# time = median of {config.iters} {iterations} (after {config.warmup} warm-up) of the slowest "
        f"rank; {_order(config)}; GB/s = 1e9 B/s\n"
        f"# busbw = algbw x bus factor (nccl-tests)"
        + (
            "; 'limit' = bidirectional send/recv between ring neighbours at the same size"
            if getattr(config, "limit", True) and config.collective != "sendrecv"
            else ""  # --no-limit, or send/recv itself: no limit row
        )
        + f"\n#{_COLS[1:]}"
    )


def _order(config: Any) -> str:
    block = config.block
    if block == 1:
        return "series interleaved call by call"
    if block >= config.warmup + config.iters:
        return "each series' calls back to back"
    return f"series in turns of {block} calls"


def _fmt(x: float | None, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}{spec}}"


def _fields(r: Any) -> dict[str, Any]:
    return r if isinstance(r, dict) else r.__dict__


def series_name(r: dict[str, Any]) -> str:
    """A sweep record's algorithm as tables name it: auto with what it picked, auto:NAME, and the
    segment where the pick is segmented (auto@64K picking the ring: auto:ring@64K). A pick that
    runs unsegmented keeps the series' segment before it (auto@64K picking rd: auto@64K:rd), so
    that auto and auto@64K picking rd are told apart (both read auto:rd). A record without the
    pick: its algorithm as given."""
    from commbench.comm import SEGMENTED

    algorithm, at, segment = r["algorithm"].partition("@")
    picked = r.get("resolved_algorithm")
    if algorithm != "auto" or not picked:
        return r["algorithm"]
    return f"auto:{picked}{at}{segment}" if picked in SEGMENTED else f"auto{at}{segment}:{picked}"


def _labelled_limit(r: dict[str, Any], rows: Sequence[dict[str, Any]]) -> bool:
    """Whether a record is shown as "limit": send/recv beside other collectives (alone, its series
    are named as given)."""
    return r["collective"] == "sendrecv" and any(x["collective"] != "sendrecv" for x in rows)


PER_RANK_COUNT = ("all_gather", "reduce_scatter")  # nccl-tests' count is a rank's part of size(B)


def table_count(r: dict[str, Any]) -> int:
    """The count column as nccl-tests prints it: for all_gather a rank's input and for
    reduce_scatter a rank's output, where size(B) is the whole array; a record's ``count`` holds
    the elements of size(B), which the cost model and the alpha-beta fit read."""
    return r["count"] // r["world_size"] if r["collective"] in PER_RANK_COUNT else r["count"]


def table_rows(records: Sequence[Any]) -> str:
    """One row per algorithm for one size; the size columns are printed on the first row only. A
    series name longer than its column is printed whole, and moves the rest of its row right."""
    lines = []
    rows = [_fields(r) for r in records]
    for i, r in enumerate(rows):
        lead = (
            f"{r['size_bytes']:>12} {table_count(r):>10} {r['dtype']:>8} {r['op'] or '-':>5}"
            if i == 0
            else " " * 38
        )
        # what auto picked, in full: a name cut to the column read "auto:naiv"
        name = "limit" if _labelled_limit(r, rows) else series_name(r)
        lines.append(
            f"{lead} {name:>9} {r['time_us']:>10.1f} {r['algbw_gbps']:>11.3f} {r['busbw_gbps']:>11.3f} "
            f"{'-' if r['wrong'] is None else r['wrong']:>6} "
            f"{_fmt(r['busbw_ratio_to_builtin'], '.2f', 10)} {_fmt(r['frac_of_limit'], '.2f', 8)}"
        )
    return "\n".join(lines)


def closing_lines(records: Sequence[Any]) -> list[str]:
    """What ends a sweep's table, after nccl-tests' closing lines: the wrong elements over every
    point and rank (nccl-tests counts failed checks), and each series' busbw averaged over the
    sizes (the plain mean, as nccl-tests' "Avg bus bandwidth", which is one figure over every
    series and both forms; a collective's is 0 at one rank, where nothing crosses a bus, while the
    limit's is a copy's). The count of sizes says where a file holds fewer than its sweep planned
    (one cut short by a stop); a series measured at fewer of them says how many. Records of other
    types are left out."""
    rows = [r for r in map(_fields, records) if r.get("type") == "sweep"]
    busbw: dict[str, list[float]] = {}
    for r in rows:  # a file's record may lack a field (summary reads files written by hand too)
        name = "limit" if _labelled_limit(r, rows) else r["algorithm"]
        values = busbw.setdefault(name, [])
        if r.get("busbw_gbps") is not None:
            values.append(r["busbw_gbps"])
    checked = [r["wrong"] for r in rows if r.get("wrong") is not None]
    if not checked:
        wrong = "not checked (-c 0)" if any("wrong" in r for r in rows) else "not recorded"
    else:
        total = sum(checked)
        wrong = f"{total} {'OK' if total == 0 else 'FAILED'}"
    sizes = len({r.get("size_bytes") for r in rows})

    def mean(v: list[float]) -> str:  # over fewer sizes, said so (a file whose last line was cut short)
        return f"{sum(v) / len(v):.3f}" + (
            f" ({len(v)} size{'s' * (len(v) != 1)})" if len(v) != sizes else ""
        )

    means = "  ".join(f"{name} {mean(v)}" if v else f"{name} -" for name, v in busbw.items())
    return [
        f"wrong elements: {wrong}",
        f"avg busbw (GB/s, mean over {sizes} size{'s' * (sizes != 1)}): {means}",
    ]


def threshold_lines(summaries: Sequence[dict[str, Any]]) -> list[str]:
    """Where a run was given --loss-threshold, one line for each strategy: the epoch in which its
    mean training loss first fell below it and the training time until then, or that it did not
    (it was in the records alone, which neither the table nor the report showed)."""
    lines = []
    for s in summaries:
        threshold = s.get("loss_threshold")
        if threshold is None:
            continue
        epoch, took = s.get("epochs_to_threshold"), s.get("time_to_threshold_s")
        reached = (
            f"in epoch {epoch}, after {took:.4g} s of training"
            if epoch is not None and took is not None
            else f"not within its {s.get('epochs', '?')} epoch(s)"
        )
        lines.append(f"loss below {threshold:.10g}: {s['strategy']} {reached}")  # as given, not to 6 digits
    return lines


def table_footer(records: Sequence[Any]) -> str:
    """:func:`closing_lines` as the sweep's table prints them."""
    return "\n".join(f"# {line}" for line in closing_lines(records))


@contextlib.contextmanager
def _figure(*args: Any, **kwargs: Any) -> Iterator[tuple[Any, Any]]:
    """``plt.subplots(*args, **kwargs)`` (Agg, no display), closed however the drawing ends: a plot
    that failed halfway kept its figure open in pyplot for the rest of the process. What matplotlib
    warns of odd values (a legend of no labels, a range past a float's) is not said: records
    written by hand reached stderr as two lines of its source."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fig, ax = plt.subplots(*args, **kwargs)
        try:
            yield fig, ax
        finally:
            plt.close(fig)


def _save(fig: Any, path: Any, dpi: int) -> None:
    """Save ``fig`` to ``path`` whole (:func:`write_whole`): a run stopped while its plot was being
    written left the last run's plot cut short, an image that no longer opened. The format is the
    name's suffix (PNG where it has none), as the file written first is named ``.NAME.PID.partial``."""
    fmt = Path(path).suffix.lower().lstrip(".") or "png"
    write_whole(path, lambda p: fig.savefig(p, dpi=dpi, format=fmt))


# One colour per algorithm in every busbw plot, whatever the series' order in a run: two runs'
# plots side by side read alike. A segmented form (ring@64K) keeps its algorithm's colour with a
# line and marker of its own.
ALGORITHM_COLOURS = {
    "builtin": "tab:blue",
    "naive": "tab:orange",
    "ring": "tab:green",
    "auto": "tab:red",
    "rd": "tab:purple",
    "hd": "tab:brown",
    "tree": "tab:pink",
    "p2p": "tab:gray",
}
_VARIANTS = (("-", "o"), (":", "s"), ("-.", "^"), ((0, (5, 1)), "D"), ((0, (1, 3)), "v"))


def _picks(points: Sequence[tuple[int, str | None]]) -> str:
    """What auto picked, size by size, in runs: "rd to 1M, ring from 4M" ("rd" for one pick
    throughout, "" where the records hold none)."""
    runs: list[list[Any]] = []
    for size, pick in sorted(points, key=lambda p: p[0]):  # a size may come with and without a pick
        if pick is None:
            continue
        if runs and runs[-1][0] == pick:
            runs[-1][2] = size
        else:
            runs.append([pick, size, size])
    if len(runs) <= 1:
        return runs[0][0] if runs else ""
    from commbench.units import format_size

    said = []
    for i, (pick, lo, hi) in enumerate(runs):
        if i == 0:
            said.append(f"{pick} to {format_size(hi)}")
        elif i == len(runs) - 1:
            said.append(f"{pick} from {format_size(lo)}")
        else:
            said.append(f"{pick} {format_size(lo)}" + ("" if lo == hi else f"-{format_size(hi)}"))
    return ", ".join(said)


def plot_busbw(records: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """busbw against size (log2 x axis, sizes as K/M/G), one line per algorithm in its own colour
    (:data:`ALGORITHM_COLOURS`), the limit dashed; auto's legend says what it picked where."""
    from matplotlib.ticker import FuncFormatter

    from commbench.units import format_size

    series: dict[str, list[tuple[int, float]]] = {}
    picked: dict[str, list[tuple[int, str | None]]] = {}
    sweep = [r for r in records if r.get("type") == "sweep"]
    beside = any(r["collective"] != "sendrecv" for r in sweep)
    for r in sweep:
        name = "limit (send/recv)" if r["collective"] == "sendrecv" and beside else r["algorithm"]
        series.setdefault(name, []).append((r["size_bytes"], r["busbw_gbps"]))
        if r["algorithm"].partition("@")[0] == "auto":
            picked.setdefault(name, []).append((r["size_bytes"], r.get("resolved_algorithm")))
    with _figure(figsize=(8, 4.5)) as (fig, ax):
        seen: dict[str, int] = {}
        for name, points in series.items():
            points.sort()
            xs, ys = zip(*points, strict=True)
            label = name + (f" ({_picks(picked[name])})" if _picks(picked.get(name, ())) else "")
            if name.startswith("limit"):
                style: dict[str, Any] = {"linestyle": "--", "color": "black"}
            else:
                base = name.partition("@")[0]
                line, marker = _VARIANTS[seen.get(base, 0) % len(_VARIANTS)]
                seen[base] = seen.get(base, 0) + 1
                style = {"color": ALGORITHM_COLOURS.get(base), "linestyle": line, "marker": marker}
            ax.plot(xs, ys, label=label, **style)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_size(round(x)) if x >= 1 else ""))
        ax.set_xlabel("message size (bytes; K, M, G: 2^10, 2^20, 2^30)")
        ax.set_ylabel("bus bandwidth (GB/s, 1e9 B/s)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        _save(fig, path, 110)


def one_line(text: Any) -> str:
    """``text`` with its line breaks as spaces, for a message or a cell: names from a file written
    by hand may hold them."""
    return " ".join(str(text).splitlines())


def md_text(text: Any) -> str:
    """``text`` for a Markdown table cell or heading: line breaks as spaces (one split the table or
    heading) and '|' escaped (one ended the cell). Records written by hand may hold either."""
    return one_line(text).replace("|", "\\|")


def _longest_backticks(text: str) -> int:
    run = longest = 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    return longest


def md_code_span(text: str) -> str:
    """``text`` as one Markdown code span, on one line, whatever backticks it holds."""
    text = one_line(text)
    ticks = "`" * (_longest_backticks(text) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def md_code_block(text: str) -> str:
    """``text`` as a fenced Markdown block, the fence longer than any run of backticks in it."""
    fence = "`" * max(3, _longest_backticks(text) + 1)
    return f"{fence}\n{text}\n{fence}"


def ratio_table(records: Sequence[dict[str, Any]]) -> str:
    """Markdown table per size: each algorithm's busbw ratio to builtin, and to the limit."""
    sweep = [r for r in records if r.get("type") == "sweep"]
    rows = [r for r in sweep if r["collective"] != "sendrecv"]
    if not rows and sweep:  # a sweep of send/recv alone: its bandwidth is all there is to show
        lines = ["| size (B) | series | busbw (GB/s) |", "|---|---|---|"]
        lines += [
            f"| {r['size_bytes']} | {md_text(r['algorithm'])} | {_cell(r.get('busbw_gbps'), '.3f')} |"
            for r in sweep
        ]
        return "\n".join(lines)
    if not rows:
        return "(no sweep records)"
    algos = list(dict.fromkeys(r["algorithm"] for r in rows))
    by_size: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_size.setdefault(r["size_bytes"], {})[r["algorithm"]] = r
    head = ["size (B)", "builtin busbw (GB/s)"]
    head += [f"{md_text(a)} / builtin" for a in algos if a != "builtin"] + [
        f"{md_text(a)} / limit" for a in algos
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size in sorted(by_size):
        row = by_size[size]
        cells = [str(size), _cell(row.get("builtin", {}).get("busbw_gbps"), ".3f")]
        cells += [_cell(row.get(a, {}).get("busbw_ratio_to_builtin"), ".2f") for a in algos if a != "builtin"]
        cells += [_cell(row.get(a, {}).get("frac_of_limit"), ".2f") for a in algos]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spread_table(runs: Sequence[Sequence[dict[str, Any]]]) -> str:
    """Markdown table per size over repeated runs of one sweep: each algorithm's busbw ratio to
    builtin as mean [lowest, highest], and in how many runs it fell under 0.9 and under 1.0."""
    ratios: dict[int, dict[str, list[float]]] = {}
    algos: list[str] = []
    builtin_busbw: list[float] = []  # why there may be no ratio: builtin absent, or at 0 GB/s
    for records in runs:
        for r in records:
            if r.get("type") != "sweep" or r["collective"] == "sendrecv":
                continue
            if r["algorithm"] == "builtin":
                builtin_busbw.append(r.get("busbw_gbps") or 0.0)
                continue
            if r.get("busbw_ratio_to_builtin") is None:
                continue
            if r["algorithm"] not in algos:
                algos.append(r["algorithm"])
            ratios.setdefault(r["size_bytes"], {}).setdefault(r["algorithm"], []).append(
                r["busbw_ratio_to_builtin"]
            )
    if not ratios and builtin_busbw:
        if min(builtin_busbw) == 0:  # every collective's bus factor but broadcast's and reduce's, at one rank
            return "(no ratios to builtin: its bus bandwidth is 0, as on one rank)"
        return "(no ratios to builtin: no other algorithm was swept)"
    if not ratios:
        return "(no ratios to builtin: sweep with builtin among the algorithms)"
    head = ["size (B)"] + [f"{md_text(a)} / builtin: mean [low, high] (< 0.9, < 1.0 of runs)" for a in algos]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size in sorted(ratios):
        cells = [str(size)]
        for a in algos:
            xs = ratios[size].get(a)
            if not xs:
                cells.append("-")
                continue
            mean, low, high = sum(xs) / len(xs), min(xs), max(xs)
            under = sum(x < 0.9 for x in xs), sum(x < 1.0 for x in xs)
            cells.append(f"{mean:.2f} [{low:.2f}, {high:.2f}] ({under[0]}, {under[1]} of {len(xs)})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


BREAKDOWN = (
    ("data_ms", "data"),
    ("forward_ms", "forward"),
    ("backward_ms", "backward"),
    ("exposed_comm_ms", "exposed comm"),
    ("optimizer_ms", "optimizer"),
)


def plot_training(
    epochs: Sequence[dict[str, Any]], summaries: Sequence[dict[str, Any]], breakdown_path: Any, loss_path: Any
) -> None:
    """Two PNGs: the stacked step-time breakdown per strategy, and the loss curve of each strategy."""
    with _figure(figsize=(8.5, 4)) as (fig, ax):
        names = [s["strategy"] for s in summaries]
        bottom = [0.0] * len(summaries)
        tops = {}
        for key, label in BREAKDOWN:
            values = [s[key] for s in summaries]
            ax.bar(names, values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
            tops[key] = bottom
        # The comm that ran during backward, hatched over the top of the backward part it hid in (a
        # mark at its height from zero read as a boundary inside the stack). Comm less exposed comm
        # also held the buffer broadcast before forward, which is neither: at most backward is shown.
        # None where comm is not measured.
        hidden = [
            min(max((s["comm_ms"] or 0.0) * (s.get("hidden_comm_fraction") or 0.0), 0.0), s["backward_ms"])
            for s in summaries
        ]
        ax.bar(
            names,
            hidden,
            bottom=[t - h for t, h in zip(tops["backward_ms"], hidden, strict=True)],
            fill=False,
            hatch="//",
            edgecolor="black",
            linewidth=0.6,
            label="of backward: comm hidden in it",
        )
        # The parts are medians each, so their sum is not the median step (the table's step time)
        ax.scatter(
            names,
            [s["step_time_ms"] for s in summaries],
            marker="_",
            s=500,
            color="black",
            zorder=3,
            label="median step time",
        )
        first = summaries[0]
        ax.set_ylabel("median time per step (ms)")
        ax.set_title(
            f"{first['model']}, {rank_count(first['world_size'])}, {first['backend']}, "
            f"batch {first['batch_size']}/rank"
        )
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        _save(fig, breakdown_path, 120)
    plot_loss(epochs, loss_path, names)


def plot_loss(epochs: Sequence[dict[str, Any]], path: Any, names: Sequence[str] | None = None) -> None:
    """The training loss per step of each strategy (``names``; default: those of ``epochs``). Syncs
    that agree give the same curve, drawn one over another: each has a line style of its own, the
    first the widest, so every one shows; grey lines mark where epochs end."""
    if names is None:
        names = list(dict.fromkeys(e["strategy"] for e in epochs))
    styles = ("-", "--", "-.", ":")
    with _figure(figsize=(7, 4)) as (fig, ax):
        for i, name in enumerate(names):
            losses = [v for e in epochs if e["strategy"] == name for v in e["step_losses"]]
            width = max(3.0 - 0.6 * i, 1.0)
            ax.plot(range(1, len(losses) + 1), losses, label=name, linestyle=styles[i % 4], linewidth=width)
        steps = 0
        ends = [e for e in epochs if names and e["strategy"] == names[0]][:-1]
        for e in ends:
            steps += len(e["step_losses"])
            ax.axvline(steps + 0.5, color="grey", linewidth=0.6, alpha=0.6)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (mean over ranks)")
        ax.set_title("training loss per step" + ("; grey: an epoch's end" if ends else ""))
        ax.legend(fontsize=8)
        fig.tight_layout()
        _save(fig, path, 120)


def plot_throughput(summaries: Sequence[dict[str, Any]], path: Any, title: str = "") -> None:
    """Images per second of each strategy (bars), labelled with the step time behind it."""
    with _figure(figsize=(7, 3.5)) as (fig, ax):
        names = [f"{s['strategy']}\n{rank_count(s['world_size'])}" for s in summaries]
        values = [s["images_per_s"] for s in summaries]
        bars = ax.bar(names, values, color="tab:green")
        for bar, s in zip(bars, summaries, strict=True):
            ax.annotate(
                f"{s['step_time_ms']:.1f} ms/step",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_ylabel("images per second (all ranks)")
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        _save(fig, path, 110)


def plot_probe_timeline(probe: dict[str, Any], path: Any, title: str = "") -> None:
    """Three panels from a ``probe`` record: utilisation (CPU, GPU), memory, interface bytes/s;
    phase markers as vertical lines. Quantities that were not measured are left out."""
    samples = probe.get("samples") or []
    t = [s["t_s"] for s in samples]

    def series(key: str) -> list[float] | None:
        values = [s.get(key) for s in samples]
        return None if all(v is None for v in values) else [float("nan") if v is None else v for v in values]

    def gpu_series(index: int, key: str) -> list[float] | None:
        values = [
            next((g.get(key) for g in s.get("gpus", []) if g.get("index") == index), None) for s in samples
        ]
        return None if all(v is None for v in values) else [float("nan") if v is None else v for v in values]

    gpu_ids = sorted({g["index"] for s in samples for g in s.get("gpus", [])})
    with _figure(3, 1, figsize=(8, 7), sharex=True) as (fig, axes):
        util, mem, net = axes
        for key, label in (
            ("cpu_user_pct", "machine CPU user (% of all cores)"),
            ("cpu_system_pct", "machine CPU system"),
            ("process_cpu_pct", "rank-0 process (% of one core)"),
        ):
            values = series(key)
            if values is not None:
                util.plot(t, values, label=label)
        for i in gpu_ids:
            values = gpu_series(i, "gpu_util_pct")
            if values is not None:
                util.plot(t, values, label=f"GPU {i} utilisation", linestyle="--")
        util.set_ylabel("% (as each line says)")
        rss = series("rss_bytes")
        if rss is not None:
            mem.plot(t, [v / 1e6 for v in rss], label="rank-0 resident memory")
        for i in gpu_ids:
            values = gpu_series(i, "memory_used_bytes")
            if values is not None:
                mem.plot(t, [v / 1e6 for v in values], label=f"GPU {i} memory used", linestyle="--")
        mem.set_ylabel("MB (1e6 B)")
        # received dashed and thinner: on loopback it is sent, and the one line hid the other
        for key, label, style in (
            ("nic_tx_bytes_per_s", "sent", {"linewidth": 2.2}),
            ("nic_rx_bytes_per_s", "received", {"linestyle": "--", "linewidth": 1.0}),
        ):
            values = series(key)
            if values is not None:
                name = f"{probe.get('nic') or 'interface'} {label}"
                net.plot(t, [v / 1e6 for v in values], label=name, **style)
        for i in gpu_ids:
            for key, label in (("pcie_tx_bytes_per_s", "PCIe tx"), ("nvlink_tx_bytes_per_s", "NVLink tx")):
                values = gpu_series(i, key)
                if values is not None:
                    net.plot(t, [v / 1e6 for v in values], label=f"GPU {i} {label}", linestyle="--")
        net.set_ylabel("MB/s (1e6 B/s)")
        net.set_xlabel("seconds since the sampler started")
        for ax in axes:
            for i, m in enumerate(probe.get("markers") or []):
                # named once, in the top panel's legend: they were grey lines no legend explained
                said = ax is util and i == 0
                label = "a mark: a size (sweep) or epoch (training) done" if said else None
                ax.axvline(m["t_s"], color="grey", alpha=0.25, linewidth=0.8, label=label)
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7, loc="upper right")
        util.set_title(title)
        fig.tight_layout()
        _save(fig, path, 100)


def plot_ratio_bars(labels: Sequence[str], ratios: Sequence[float | None], path: Any, ylabel: str) -> None:
    """One bar per label with a line at 1.0: a run against its baseline. The axis is log 2 where every
    ratio is above 0, so that half as fast and twice as fast stand as far from the line (on a linear
    axis, 0.46 was a sliver beside 5.8); each bar stands on the line at 1."""
    # None, or a ratio that is no number (over a baseline of 0), is a missing bar
    values = [float("nan") if r is None or not math.isfinite(r) else r for r in ratios]
    with _figure(figsize=(max(5.0, 0.45 * len(labels) + 2), 3.5)) as (fig, ax):
        # from the line at 1, up for above and down for below it
        ax.bar(range(len(labels)), [v - 1.0 for v in values], bottom=1.0, color="tab:purple")
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        finite = [v for v in values if math.isfinite(v)]
        if finite and min(finite) > 0:
            from matplotlib.ticker import FuncFormatter

            ax.set_yscale("log", base=2)
            ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
            ax.set_ylim(min(min(finite), 1.0) / 1.5, max(max(finite), 1.0) * 1.5)
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel}: dashed at 1 (the same)")
        ax.grid(True, axis="y", alpha=0.3)
        fig.tight_layout()
        _save(fig, path, 100)


def plot_grouped(
    groups: Sequence[str], series: dict[str, Sequence[float | None]], path: Any, ylabel: str, title: str = ""
) -> None:
    """Grouped bars: one group per x label, one bar per series (studies' metric-by-setting plots)."""
    inches = max(5.0, 0.6 * len(groups) * max(1, len(series)) + 2)
    with _figure(figsize=(inches, 3.8)) as (fig, ax):
        width = 0.8 / max(1, len(series))
        for i, (name, values) in enumerate(series.items()):
            xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(xs, [float("nan") if v is None else v for v in values], width=width, label=name)
        ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(textwrap.fill(title, int(inches * 9)))  # a long title ran past a narrow figure
        ax.grid(True, axis="y", alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=8)
        fig.tight_layout()
        _save(fig, path, 100)


def timeline_path(plot_path: Any) -> Any:
    """Where a run's probe timeline goes: beside its main plot, ``NAME-timeline.png``."""
    from pathlib import Path

    p = Path(plot_path)
    return p.with_name(f"{p.stem}-timeline{p.suffix or '.png'}")
