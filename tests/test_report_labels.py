"""How sweep tables name their series: send/recv is "limit" only beside other collectives."""

from __future__ import annotations

import json

import pytest

from commbench.bench import report
from commbench.bench.cli import main


def _record(collective: str, algorithm: str, size: int, busbw: float, wrong: int = 0) -> dict:
    return {
        "type": "sweep",
        "collective": collective,
        "algorithm": algorithm,
        "resolved_algorithm": algorithm,
        "backend": "gloo",
        "device": "cpu",
        "world_size": 2,
        "dtype": "float32",
        "op": None if collective == "sendrecv" else "sum",
        "root": 0,
        "size_bytes": size,
        "count": size // 4,
        "time_us": 100.0,
        "algbw_gbps": busbw,
        "busbw_gbps": busbw,
        "wrong": wrong,
        "busbw_ratio_to_builtin": None,
        "frac_of_limit": None,
    }


SENDRECV = [_record("sendrecv", "p2p", 4096, 0.5), _record("sendrecv", "p2p@1K", 4096, 0.25)]
BESIDE = [
    _record("all_reduce", "builtin", 4096, 1.0),
    _record("all_reduce", "ring", 4096, 1.1, wrong=786431),
    _record("sendrecv", "p2p", 4096, 2.0),  # as a sweep records the limit beside a collective
]


def test_a_sweep_of_send_recv_alone_names_each_series():
    names = [line.split()[-7] for line in report.table_rows(SENDRECV).splitlines()]
    assert names == ["p2p", "p2p@1K"]
    table = report.ratio_table(SENDRECV)
    assert "| 4096 | p2p | 0.500 |" in table and "| 4096 | p2p@1K | 0.250 |" in table


def test_send_recv_beside_a_collective_is_the_limit():
    names = [line.split()[-7] for line in report.table_rows(BESIDE).splitlines()]
    assert names == ["builtin", "ring", "limit"]


def test_the_table_ends_with_the_wrong_elements_and_each_series_mean_busbw():
    two_sizes = BESIDE + [
        _record("all_reduce", "builtin", 8192, 3.0),
        _record("all_reduce", "ring", 8192, 2.9, wrong=1),
        _record("sendrecv", "p2p", 8192, 4.0),
    ]
    assert report.table_footer(two_sizes).splitlines() == [
        "# wrong elements: 786432 FAILED",
        "# avg busbw (GB/s, mean over 2 sizes): builtin 2.000  ring 2.000  limit 3.000",
    ]
    # a series measured at fewer sizes (the file's last line cut short) says how many
    assert report.table_footer(two_sizes[:-1]).splitlines()[-1] == (
        "# avg busbw (GB/s, mean over 2 sizes): builtin 2.000  ring 2.000  limit 2.000 (1 size)"
    )
    assert report.table_footer(SENDRECV).splitlines() == [
        "# wrong elements: 0 OK",
        "# avg busbw (GB/s, mean over 1 size): p2p 0.500  p2p@1K 0.250",
    ]
    unchecked = [{**r, "wrong": None} for r in BESIDE]
    assert report.table_footer(unchecked).startswith("# wrong elements: not checked (-c 0)\n")
    # auto is one series, whatever it picked at each size
    picked = [
        {**_record("all_reduce", "auto", 4096, 1.0), "resolved_algorithm": "rd"},
        {**_record("all_reduce", "auto", 8192, 2.0), "resolved_algorithm": "ring"},
    ]
    assert report.table_footer(picked).endswith(": auto 1.500")
    # summary's files may lack fields, and hold other records
    bare = [{k: v for k, v in r.items() if k not in ("wrong", "busbw_gbps")} for r in SENDRECV]
    assert report.closing_lines([{"type": "header"}, *bare]) == [
        "wrong elements: not recorded",
        "avg busbw (GB/s, mean over 1 size): p2p -  p2p@1K -",
    ]


def test_the_report_names_series_and_counts_wrong_elements_in_full(tmp_path):
    for name, records in (("alone", SENDRECV), ("beside", BESIDE)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        out = tmp_path / name
        assert main(["report", "-o", str(out), str(path)]) == 0
        md = (out / "report.md").read_text()
        if name == "alone":
            assert "| p2p@1K |" in md and "limit (send/recv)" not in md
        else:
            assert "| limit (send/recv) |" in md and "| 786431 |" in md and "e+05" not in md


def test_the_baseline_compares_points_of_one_dtype_only(tmp_path):
    now, base = tmp_path / "now.jsonl", tmp_path / "base.jsonl"
    now.write_text("".join(json.dumps(r) + "\n" for r in BESIDE))
    other = [{**r, "dtype": "float64", "busbw_gbps": r["busbw_gbps"] / 2} for r in BESIDE]
    same = [{**r, "busbw_gbps": r["busbw_gbps"] / 4} for r in BESIDE]
    # float64 last: keyed without the dtype, its points would have overwritten float32's
    base.write_text("".join(json.dumps(r) + "\n" for r in same + other))
    assert main(["report", "-o", str(tmp_path / "out"), str(now), "--baseline", str(base)]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    rows = [
        line
        for line in md[md.index("## Against the baseline") :].splitlines()
        if line.startswith("| all_reduce |")
    ]
    assert len(rows) == 2 and all(r.rstrip(" |").endswith("4.00") for r in rows), rows  # not 2.00
    assert all("| float32 | sum |" in r for r in rows), rows


def test_the_baseline_plot_names_dtypes_where_there_are_several(tmp_path, monkeypatch):
    from commbench.bench import reporting

    labels = []
    monkeypatch.setattr(reporting, "_ratio_plot", lambda names, *a, **k: labels.append(list(names)))
    both = BESIDE + [{**r, "dtype": "float64"} for r in BESIDE]
    for name in ("now", "base"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in both))
    argv = ["report", "-o", str(tmp_path / "out"), str(tmp_path / "now.jsonl"), "--baseline"]
    assert main([*argv, str(tmp_path / "base.jsonl")]) == 0
    assert "builtin 4K float32 sum" in labels[0] and "builtin 4K float64 sum" in labels[0], labels


def test_several_files_holding_one_point_get_a_row_each(tmp_path):
    """Keyed by the point (or strategy) alone, the last run and the last baseline hid the others'."""
    for name, scale in (("a", 1.0), ("b", 3.0), ("base1", 1.0), ("base2", 0.5)):
        summary = {"type": "train_summary", "strategy": "ring", "world_size": 2}
        summary |= {"step_time_ms": 10.0 / scale, "images_per_s": 100.0 * scale}
        records = [{**r, "busbw_gbps": r["busbw_gbps"] * scale} for r in BESIDE] + [summary]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    a, b, base1, base2 = (str(tmp_path / f"{n}.jsonl") for n in ("a", "b", "base1", "base2"))
    assert main(["report", "-o", str(tmp_path / "out"), a, b, "--baseline", base1, base2]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    section = md[md.index("## Against the baseline") :].splitlines()
    expected = {
        ("a", "baseline base1"): "1.00",
        ("a", "baseline base2"): "2.00",
        ("b", "baseline base1"): "3.00",
        ("b", "baseline base2"): "6.00",
    }
    for needle in ("| builtin |", "| ring | 2 |"):  # busbw ratio, images/s ratio: in the last column
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in section if needle in line]
        assert {(r[0], r[1]): r[-1] for r in rows} == expected and len(rows) == 4, rows


def test_a_cluster_run_without_probed_points_keeps_its_per_host_table(tmp_path):
    """A cluster sweep run with --no-probe (or on CUDA) has no point with computed wire bytes; the
    section ended there, before the cluster's own per-host switch-port counts."""
    host = {"rank": 0, "address": "10.0.0.1", "nic": "eth0", "tx_bytes": 1000, "rx_bytes": 900}
    host |= {"computed_tx_bytes": 950, "computed_rx_bytes": 950}
    cluster = {"type": "cluster", "hosts": [host], "link_rate_gbps": 1.0, "tc": {}, "command": "sweep"}
    path = tmp_path / "cl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*BESIDE, cluster]))
    assert main(["report", "-o", str(tmp_path / "out"), str(path)]) == 0
    md = (tmp_path / "out" / "report.md").read_text()
    assert "#### Per host" in md and "| whole run (cluster) | 0 | 10.0.0.1 | eth0 | 1,000 | 950 |" in md
    assert "outside tolerance" not in md  # no byte-check table without checked points


def test_a_hosts_ratio_is_measured_over_computed_each_way():
    """The per-host ratio is measured / computed: above 1 where the NIC counted more bytes than
    the cost model, below 1 where it counted fewer."""
    from commbench.bench import reporting

    host = {"rank": 0, "address": "10.0.0.1", "nic": "eth0", "tx_bytes": 110, "rx_bytes": 90}
    host |= {"computed_tx_bytes": 100, "computed_rx_bytes": 100}
    row = reporting._host_row("whole run", host, ["12.5"])
    assert row == ["whole run", "0", "10.0.0.1", "eth0", "110", "100", "1.100", "90", "100", "0.900", "12.5"]


def test_auto_is_named_by_what_it_picked_in_full():
    """The name was cut to the column's 9 characters: auto picking naive read "auto:naiv", and a
    segmented auto ("auto@2M") did not say what it picked at all, and auto and auto@2M picking rd
    were two rows of one name."""
    picked = [
        {**_record("all_reduce", "auto", 4096, 1.0), "resolved_algorithm": "naive"},
        {**_record("all_reduce", "auto@2M", 4096, 1.0), "resolved_algorithm": "ring"},
        {**_record("all_reduce", "auto", 4096, 1.0), "resolved_algorithm": "rd"},
        {**_record("all_reduce", "auto@2M", 4096, 1.0), "resolved_algorithm": "rd"},
    ]
    names = [line.split()[-7] for line in report.table_rows(picked).splitlines()]
    # rd picked by auto@2M runs unsegmented: the 2M is the series', before the pick (both read auto:rd)
    assert names == ["auto:naive", "auto:ring@2M", "auto:rd", "auto@2M:rd"]


def test_headings_count_one_rank_as_one_rank():
    from commbench.bench import cli
    from commbench.units import rank_count

    assert [rank_count(n) for n in (1, 2, "?")] == ["1 rank", "2 ranks", "? ranks"]
    what = ("all_reduce", 1, "nccl", "float32", 1, "sum", "cuda", 0, False)
    assert cli._describe(what) == "all_reduce, 1 rank, nccl on cuda, float32, sum"


def test_a_name_that_is_not_utf8_is_written_escaped_and_a_failed_write_keeps_the_last_report(
    tmp_path, monkeypatch
):
    """A file name with a byte that is not UTF-8 failed the write after report.md was emptied."""
    import os

    from commbench.bench import reporting

    path = tmp_path / os.fsdecode(b"run\xff.jsonl")
    header = {"type": "header", "command": f"commbench sweep --json {path}"}
    path.write_text("".join(json.dumps(r) + "\n" for r in [header, *BESIDE]))
    out = tmp_path / "out"
    assert main(["report", "-o", str(out), str(path)]) == 0
    md = (out / "report.md").read_text()
    assert "run\\udcff.jsonl" in md

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(reporting.os, "replace", full_disk)
    assert main(["report", "-o", str(out), str(path)]) == 1  # the file system refused: exit 1, one line
    assert (out / "report.md").read_text() == md  # the last report stands
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no scratch left


def test_a_report_keeps_its_files_mode_and_follows_a_link(tmp_path):
    """Put in place through a new file, a private report became world-readable, and a report.md
    that linked elsewhere became a plain file while its target kept the old report."""
    import os

    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in BESIDE))
    out = tmp_path / "out"
    assert main(["report", "-o", str(out), str(path)]) == 0
    (out / "report.html").chmod(0o600)
    kept = tmp_path / "kept.md"
    kept.write_text("old")
    (out / "report.md").unlink()
    (out / "report.md").symlink_to(kept)
    assert main(["report", "-o", str(out), str(path)]) == 0
    assert (out / "report.html").stat().st_mode & 0o777 == 0o600
    assert (out / "report.md").is_symlink() and kept.read_text().startswith("#")
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
    os.chmod(out / "report.html", 0o644)


def test_the_in_place_form_is_named_and_kept_apart_from_the_other():
    """summary --across refuses to pool an in-place run with an out-of-place one, and a baseline
    compares only points of one form."""
    from commbench.bench import cli, reporting
    from commbench.bench.reporting import Run

    placed = {**_record("all_gather", "ring", 4096, 1.0), "in_place": True}
    other = {**_record("all_gather", "ring", 4096, 2.0), "in_place": False}
    old = _record("all_gather", "ring", 4096, 3.0)  # written before in_place existed: out of place
    assert cli._describe(cli._what([placed])).startswith("all_gather in place, ")
    assert cli._what([other]) == cli._what([old]) != cli._what([placed])
    assert not cli._what([{**_record("all_reduce", "ring", 4096, 1.0), "in_place": True}])[-1]
    runs = [Run(path="r", label="r", header={}, sweeps=(r,), epochs=(), summaries=(), probes=(), clusters=())
            for r in (placed, other)]  # fmt: skip
    keys = [next(iter(reporting._busbw_map([run]))) for run in runs]
    assert keys[0][0] == "all_gather in place" and keys[1][0] == "all_gather"


def test_a_rank_s_place_names_its_gpu_and_its_pci_address_where_it_has_them():
    from commbench.bench.machine import describe_place

    gpu = {"host": "h", "pid": 42, "device": "cuda:1", "gpu": "NVIDIA H100", "pci": "0000:1b:00.0"}
    assert describe_place(1, gpu) == "rank 1: host h, pid 42, cuda:1 NVIDIA H100 [0000:1b:00.0]"
    assert describe_place(0, {**gpu, "pci": None}) == "rank 0: host h, pid 42, cuda:1 NVIDIA H100"
    assert describe_place(2, {"host": "h", "pid": 7, "device": "cpu"}) == "rank 2: host h, pid 7, cpu"
    # the emulated cluster's hosts share a hostname: each says its address
    cluster = {"host": "h", "address": "10.0.0.2", "pid": 7, "device": "cpu"}
    assert describe_place(1, cluster) == "rank 1: host h (10.0.0.2), pid 7, cpu"


def test_a_plot_stopped_while_it_is_written_leaves_the_last_one_whole(tmp_path, monkeypatch):
    """A report (or `--plot`) stopped while matplotlib wrote a PNG left the last run's PNG cut
    short, an image that no longer opened, under report.md's link to it."""
    from matplotlib.figure import Figure

    records = [_record("all_reduce", "ring", 1 << k, 0.1 * k) for k in range(10, 14)]
    png = tmp_path / "busbw.png"
    report.plot_busbw(records, str(png))
    whole = png.read_bytes()
    assert whole.startswith(b"\x89PNG")
    drawn = Figure.savefig

    def stopped_halfway(fig, fname, **kwargs):
        drawn(fig, fname, **kwargs)
        data = open(fname, "rb").read()
        open(fname, "wb").write(data[: len(data) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", stopped_halfway)
    try:
        report.plot_busbw(records[:2], str(png))
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the stop did not reach the caller")
    assert png.read_bytes() == whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busbw.png"]  # no scratch left


def test_a_plot_follows_a_link_keeps_an_upper_case_format_and_writes_a_device_in_place(tmp_path):
    """The plot is written under a scratch name first; its format still comes from the name given."""
    import os

    records = [_record("all_reduce", "ring", 1 << k, 0.1 * k) for k in range(10, 12)]
    target = tmp_path / "kept.PNG"
    target.write_bytes(b"old")
    (tmp_path / "link.PNG").symlink_to(target)
    report.plot_busbw(records, str(tmp_path / "link.PNG"))
    assert (tmp_path / "link.PNG").is_symlink() and target.read_bytes().startswith(b"\x89PNG")
    report.plot_busbw(records, str(tmp_path / "plot.svg"))
    assert b"<svg" in (tmp_path / "plot.svg").read_bytes()[:400]
    report.plot_busbw(records, os.devnull)  # not a regular file: written where it is, and kept
    assert os.path.exists(os.devnull) and not os.path.isfile(os.devnull)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.PNG", "link.PNG", "plot.svg"]


def test_a_plot_in_a_directory_closed_to_new_files_is_written_in_place(tmp_path, monkeypatch):
    """Written beside its name first, a plot whose file may be written, in a directory this user
    may not add to, failed where it had been written before."""
    import os

    from commbench.bench import records

    records_ = [_record("all_reduce", "ring", 1 << k, 0.1 * k) for k in range(10, 12)]
    png = tmp_path / "kept.png"
    png.write_bytes(b"old")
    real_access = os.access
    monkeypatch.setattr(
        records.os, "access", lambda p, m: False if str(p) == str(tmp_path) else real_access(p, m)
    )
    from matplotlib.figure import Figure

    drawn = Figure.savefig

    def refused_beside(fig, fname, **kwargs):
        if str(fname).endswith(".partial"):
            raise PermissionError(13, "Permission denied", str(fname))
        drawn(fig, fname, **kwargs)

    monkeypatch.setattr(Figure, "savefig", refused_beside)
    report.plot_busbw(records_, str(png))
    assert png.read_bytes().startswith(b"\x89PNG")
    monkeypatch.setattr(records.os, "access", real_access)  # a directory it may add to: the refusal stands
    with pytest.raises(PermissionError):
        report.plot_busbw(records_, str(png))


def test_a_csv_cell_of_nested_records_is_json():
    """The hosts column read "{'rank': 0, 'address': '127.0.0.1', ...}", Python's repr, which no
    JSON or CSV reader could take apart; lists of numbers stay space-separated."""
    import csv
    import dataclasses
    import tempfile
    from pathlib import Path

    from commbench.bench.records import RecordWriter

    @dataclasses.dataclass
    class Point:
        sent: list
        hosts: list
        ok: bool

    with tempfile.TemporaryDirectory() as d:
        path = Path(d, "r.csv")
        writer = RecordWriter(None, str(path))
        writer.write(Point(sent=[1, 2], hosts=[{"rank": 0, "address": "127.0.0.1", "up": True}], ok=True))
        writer.close()
        (row,) = csv.DictReader(path.open())
    assert row["sent"] == "1 2" and row["ok"] == "True"
    assert json.loads(row["hosts"]) == [{"rank": 0, "address": "127.0.0.1", "up": True}]


def test_the_spread_counts_runs_strictly_under_each_mark():
    """summary --across counts a run in "< 0.9" and "< 1.0" only below the mark: a ratio of
    exactly 0.9 is not under 0.9, and exactly 1.0 not under 1.0."""
    runs = [
        [
            {**_record("all_reduce", "builtin", 4096, 1.0), "busbw_ratio_to_builtin": 1.0},
            {**_record("all_reduce", "ring", 4096, ratio), "busbw_ratio_to_builtin": ratio},
        ]
        for ratio in (0.9, 1.0, 1.1)
    ]
    lines = report.spread_table(runs).splitlines()
    assert lines[0] == "| size (B) | ring / builtin: mean [low, high] (< 0.9, < 1.0 of runs) |"
    assert lines[2:] == ["| 4096 | 1.00 [0.90, 1.10] (0, 1 of 3) |"]


def _drawn(monkeypatch, records: list[dict]) -> tuple[dict[str, dict], list[str]]:
    """Each line plot_busbw draws, by its legend label (colour, line style, marker), and the size
    axis's tick labels."""
    from matplotlib.axes import Axes

    lines: dict[str, dict] = {}
    ticks: list[str] = []
    plot = Axes.plot

    def kept(self, xs, ys, **style):
        lines[style["label"]] = {k: style.get(k) for k in ("color", "linestyle", "marker")}
        return plot(self, xs, ys, **style)

    def saved(fig, path, dpi):
        fig.canvas.draw()
        ticks.extend(t.get_text() for t in fig.axes[0].get_xticklabels() if t.get_text())

    monkeypatch.setattr(Axes, "plot", kept)
    monkeypatch.setattr(report, "_save", saved)
    report.plot_busbw(records, "unused.png", "t")
    return lines, ticks


def test_an_algorithm_keeps_its_colour_whatever_else_a_run_swept(monkeypatch):
    """Colours came from matplotlib's cycle in the run's order: ring was green beside builtin and
    naive, and blue in a run of ring, naive and auto, so two runs' plots read differently."""
    sizes = (1 << 12, 1 << 14)
    first, _ = _drawn(
        monkeypatch, [_record("all_reduce", a, n, 1.0) for a in ("builtin", "naive", "ring") for n in sizes]
    )
    second, _ = _drawn(
        monkeypatch, [_record("all_reduce", a, n, 1.0) for a in ("ring", "naive") for n in sizes]
    )
    assert first["ring"] == second["ring"] and first["naive"] == second["naive"]
    assert len({first[a]["color"] for a in first}) == 3
    # a segmented ring keeps the ring's colour with a line and marker of its own
    both, _ = _drawn(
        monkeypatch, [_record("all_reduce", a, n, 1.0) for a in ("ring", "ring@64K") for n in sizes]
    )
    assert both["ring@64K"]["color"] == both["ring"]["color"]
    assert (both["ring@64K"]["linestyle"], both["ring@64K"]["marker"]) != (
        both["ring"]["linestyle"],
        both["ring"]["marker"],
    )


def test_auto_says_in_the_legend_what_it_picked_at_which_sizes_and_sizes_read_as_k_and_m(monkeypatch):
    """The table said auto:rd and auto:ring size by size; the plot's legend said auto."""
    picks = {1 << 12: "rd", 1 << 16: "rd", 1 << 20: "ring", 1 << 22: "ring"}
    records = [_record("all_reduce", "auto", n, 1.0) | {"resolved_algorithm": p} for n, p in picks.items()]
    lines, ticks = _drawn(monkeypatch, records + [_record("sendrecv", "p2p", n, 2.0) for n in picks])
    assert set(lines) == {"auto (rd to 64K, ring from 1M)", "limit (send/recv)"}
    assert {"4K", "64K", "1M", "4M"} <= set(ticks) and not any("^" in t for t in ticks)
    one, _ = _drawn(monkeypatch, [r | {"resolved_algorithm": "rd"} for r in records])
    assert set(one) == {"auto (rd)"}
    three = [
        r | {"resolved_algorithm": p} for r, p in zip(records, ("rd", "ring", "ring", "hd"), strict=True)
    ]
    assert set(_drawn(monkeypatch, three)[0]) == {"auto (rd to 4K, ring 64K-1M, hd from 4M)"}
    # a study's plot pours several runs into one: an older record without the pick beside a newer one
    older = [_record("all_reduce", "auto", 1 << 12, 1.0) | {"resolved_algorithm": None}]
    assert set(_drawn(monkeypatch, older + records[:1])[0]) == {"auto (rd)"}


def test_every_algorithm_has_a_colour_of_its_own():
    """A new algorithm without one took matplotlib's cycle, whose first colour is builtin's."""
    from commbench.comm import ALGORITHMS

    names = {a for algorithms in ALGORITHMS.values() for a in algorithms} | {"p2p"}
    assert names <= set(report.ALGORITHM_COLOURS)
    assert len(set(report.ALGORITHM_COLOURS.values())) == len(report.ALGORITHM_COLOURS)
