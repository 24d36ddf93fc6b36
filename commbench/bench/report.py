"""Turning sweep records into a table and a plot. Nothing here measures anything."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_COLS = (
    f"{'size(B)':>12} {'count':>10} {'type':>8} {'redop':>5} {'algorithm':>9} {'time(us)':>10} "
    f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6} {'vs builtin':>10} {'of limit':>8}"
)


def table_header(config: Any, run: dict[str, Any]) -> str:
    """Title lines: what was swept, on what, and how times were taken."""
    return (
        f"# commbench sweep: {config.collective}, {run['world_size']} ranks, backend {run['backend']}, "
        f"device {run['device']}\n"
        f"# time = median of {config.iters} iterations (after {config.warmup} warm-up) of the slowest "
        f"rank; GB/s = 1e9 B/s\n"
        f"# busbw = algbw x bus factor (nccl-tests); 'limit' = bidirectional send/recv between ring "
        f"neighbours at the same size\n#{_COLS[1:]}"
    )


def _fmt(x: float | None, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}{spec}}"


def table_rows(records: Sequence[Any]) -> str:
    """One row per algorithm for one size; the size columns are printed on the first row only."""
    lines = []
    for i, r in enumerate(records):
        r = r if isinstance(r, dict) else r.__dict__
        lead = (
            f"{r['size_bytes']:>12} {r['count']:>10} {r['dtype']:>8} {r['op'] or '-':>5}"
            if i == 0
            else " " * 38
        )
        name = "limit" if r["collective"] == "sendrecv" and len(records) > 1 else r["algorithm"]
        if r["algorithm"] == "auto":
            name = f"auto:{r['resolved_algorithm']}"[:9]
        lines.append(
            f"{lead} {name:>9} {r['time_us']:>10.1f} {r['algbw_gbps']:>11.3f} {r['busbw_gbps']:>11.3f} "
            f"{'-' if r['wrong'] is None else r['wrong']:>6} "
            f"{_fmt(r['busbw_ratio_to_builtin'], '.2f', 10)} {_fmt(r['frac_of_limit'], '.2f', 8)}"
        )
    return "\n".join(lines)


def plot_busbw(records: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """busbw against size (log2 x axis), one line per algorithm, the limit dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if r.get("type") != "sweep":
            continue
        name = "limit (send/recv)" if r["collective"] == "sendrecv" else r["algorithm"]
        series.setdefault(name, []).append((r["size_bytes"], r["busbw_gbps"]))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, points in series.items():
        points.sort()
        xs, ys = zip(*points, strict=True)
        style = {"linestyle": "--", "color": "black"} if name.startswith("limit") else {"marker": "o"}
        ax.plot(xs, ys, label=name, **style)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s, 1e9 B/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ratio_table(records: Sequence[dict[str, Any]]) -> str:
    """Markdown table per size: each algorithm's busbw ratio to builtin, and to the limit."""
    rows = [r for r in records if r.get("type") == "sweep" and r["collective"] != "sendrecv"]
    if not rows:
        return "(no sweep records)"
    algos = list(dict.fromkeys(r["algorithm"] for r in rows))
    by_size: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_size.setdefault(r["size_bytes"], {})[r["algorithm"]] = r
    head = ["size (B)", "builtin busbw (GB/s)"]
    head += [f"{a} / builtin" for a in algos if a != "builtin"] + [f"{a} / limit" for a in algos]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size in sorted(by_size):
        row = by_size[size]
        cells = [str(size), _cell(row.get("builtin", {}).get("busbw_gbps"), ".3f")]
        cells += [_cell(row.get(a, {}).get("busbw_ratio_to_builtin"), ".2f") for a in algos if a != "builtin"]
        cells += [_cell(row.get(a, {}).get("frac_of_limit"), ".2f") for a in algos]
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = [s["strategy"] for s in summaries]
    bottom = [0.0] * len(summaries)
    for key, label in BREAKDOWN:
        values = [s[key] for s in summaries]
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    hidden = [s["comm_ms"] - s["exposed_comm_ms"] for s in summaries]
    ax.scatter(
        names,
        [max(h, 0.0) for h in hidden],
        marker="_",
        s=400,
        color="k",
        zorder=3,
        label="comm hidden behind backward",
    )
    first = summaries[0]
    ax.set_ylabel("median time per step (ms)")
    ax.set_title(
        f"{first['model']}, {first['world_size']} ranks, {first['backend']}, batch {first['batch_size']}/rank"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(breakdown_path, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in names:
        losses = [v for e in epochs if e["strategy"] == name for v in e["step_losses"]]
        ax.plot(range(1, len(losses) + 1), losses, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(loss_path, dpi=120)
    plt.close(fig)
