"""The command line: bad input is one line and exit code 2; a sweep writes what it promises and
keeps finished points when interrupted."""

from __future__ import annotations

import configparser
import contextlib
import csv
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from commbench import comm
from commbench.bench import cli, report
from commbench.bench.cli import main
from commbench.comm import p2p, tcp
from tests import recorded

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--world-size", "2", "-n", "2", "-w", "1"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        ([], "required"),
        (["bogus"], "invalid choice"),
        (["sweep", "-b", "64M", "-e", "1K"], "above maximum"),
        (["sweep", "-b", "0"], "> 0"),
        (["sweep", "-b", "-5"], "not a size"),
        (["sweep", "-e", "12T"], "not a size"),
        # the memory check's meta tensors printed torch's C++ stack for a count past int64
        (["sweep", "-e", "99999999999999999999999G"], "maximum size must be <= 1125899906842624 bytes"),
        (["sweep", "-f", "1"], "step factor"),
        (["sweep", "--collective", "alltoall"], "unknown collective"),
        (["sweep", "-a", "ring,bogus"], "unknown algorithm 'bogus'"),
        (
            ["sweep", "-a", "builtin,naive@1M"],
            "'naive@1M': a segment size (@SIZE) applies to ring, auto, not naive",
        ),
        (["sweep", "-a", "ring@1X"], "'ring@1X': the segment after @ must be a size"),
        (["sweep", "-d", "complex64"], "unknown dtype"),
        (["sweep", "-o", "xor"], "unknown op"),
        (["sweep", "-d", "int32", "-o", "avg"], "floating-point"),
        (["sweep", "--world-size", "0"], "world size"),
        (["sweep", "-n", "0"], "iters"),
        (["sweep", "--block", "0"], "block must be >= 1"),
        (["sweep", "-n", "99999999999999999999999"], "iters must be <= 1000000"),
        (["sweep", "-w", "2000000"], "warmup must be <= 1000000"),
        (["sweep", "--collective", "reduce", "-r", "2", "--world-size", "2"], "root 2"),
        (["sweep", "--json", "/nonexistent-dir/x.jsonl"], "cannot write"),
        (["sweep", "--plot", "/nonexistent-dir/x.png"], "cannot write"),
        (["sweep", "--plot", "busbw.txt"], "must end in one of .avif, .eps"),
        (
            ["sweep", "-b", "1", "-e", "3"],
            "hold no whole float32 element for all_reduce on 2 ranks: the smallest size that does is 4 bytes",
        ),
        (
            ["sweep", "--collective", "all_gather", "-b", "4", "-e", "7"],
            "the smallest size that does is 8 bytes",
        ),
        (["sweep", "--timeout", "0.001"], "seconds >= 1"),
        (["sweep", "--backend", "nccl"], "needs --device cuda"),
        (["sweep", "--timeout", "inf"], "finite"),
        (["sweep", "-f", "inf"], "finite"),
        (["sweep", "-b", "1", "-e", "1G", "-i", "1"], "more than 1000 sizes"),
        (["sweep", "--json", "same.out", "--csv", "same.out"], "same file"),
        (["sweep", "--json", "r.jsonl", "--plot", "./r.jsonl"], "--json and --plot name the same file"),
        (["compare", "--json", "t.png", "--plot", "t.png"], "--json and --plot name the same file"),
        # the plots drawn beside --plot replaced the records, quietly
        (
            ["sweep", "--json", "a-timeline.png", "--plot", "a.png"],
            "--json a-timeline.png is where the plot a-timeline.png beside --plot a.png is drawn",
        ),
        (["sweep", "--csv", "a-timeline.png", "--plot", "a.png"], "--csv a-timeline.png is where the plot"),
        (["train", "--json", "c-loss.png", "--plot", "c.png"], "--json c-loss.png is where the plot c-loss"),
        (["compare", "--json", "c-timeline.png", "--plot", "c.png"], "--json c-timeline.png is where"),
        (
            ["cluster", "--hosts", "2", "--", "train", "--json", "c-loss.png", "--plot", "c.png"],
            "--json c-loss.png is where",
        ),
        (["sweep", "--json", "a" * 300 + ".jsonl"], "File name too long"),
        (["sweep", "--timeout", "1e12"], "<= 1e+07"),
        (["summary", "/nonexistent.jsonl"], "cannot read"),
        (["sweep", "--probe-interval", "0"], "must be between 0.001 and 60 s, got 0"),
        (["train", "--probe-interval", "1e6"], "must be between 0.001 and 60 s, got 1e6"),
        (["compare", "--probe-interval", "nan"], "must be between"),
        (["train", "--probe-interval", "often"], "'often' is not a number of seconds"),
        (["sweep", "--json", ""], "--json: needs a file name, got an empty one"),
        (["sweep", "--csv", " "], "--csv: needs a file name"),
        (["compare", "--plot", ""], "--plot: needs a file name"),
        (["report", "-o", ""], "--output: needs a file name"),
        (["profile", "-o", "", "--", "sweep"], "--output: needs a file name"),
        (["bandwidth", "--json", ""], "--json: needs a file name"),
        (["train", "--data-dir", "/tmp"], "--data-dir is read for a dataset on disk"),
        (
            ["train", "--strategy", "ddp", "--transport", "ring"],
            "--transport ring is the bucketed strategy's",
        ),
        (["compare", "--strategies", "ring,ddp", "--transport", "ring"], "not among ring,ddp"),
        # a name with a line break is told with the break escaped, in one line
        (["summary", "/nonexistent/a\nb.jsonl"], "cannot read /nonexistent/a\\nb.jsonl"),
        (["summary", "/nonexistent/a\vb.jsonl"], "cannot read /nonexistent/a\\x0bb.jsonl"),  # a break too
        (["sweep", "--json", "/nonexistent/a\nb.jsonl"], "cannot write /nonexistent/a\\nb.jsonl"),
        (["sweep", "--no-such\noption"], "unrecognized arguments: --no-such\\noption"),
        (["sweep", "-c", "2"], "argument -c/--check: invalid choice"),
        # a usage error names the subcommand whose option it is
        (["sweep", "--backend", "mpi"], "commbench sweep: argument --backend: invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_sweep_without_options_runs_the_documented_defaults(monkeypatch):
    """What sweep --help says each option defaults to is what the sweep's config and launch get."""
    import dataclasses

    from commbench.bench import launch

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    args = cli.build_parser().parse_args(["sweep"])
    assert dataclasses.asdict(cli.sweep_config(args)) == {
        "collective": "all_reduce",
        "algorithms": ("builtin", "naive", "ring"),
        "min_bytes": 1024,
        "max_bytes": 64 << 20,
        "step_factor": 2.0,
        "step_bytes": None,
        "iters": 20,
        "warmup": 5,
        "block": 1,
        "check": True,
        "dtype": "float32",
        "op": "sum",
        "root": 0,
        "in_place": False,
        "limit": True,
        "probe": True,
        "probe_iters": 3,
        "probe_interval_s": 0.1,
        "json_path": None,
        "csv_path": None,
        "quiet": False,
    }
    assert cli.launch_spec(args) == launch.LaunchSpec(
        world_size=2, device="cpu", backend=None, timeout_s=120.0
    )


def test_a_sweep_s_switches_turn_off_the_check_and_the_limit():
    config = cli.sweep_config(cli.build_parser().parse_args(["sweep", "-c", "0", "--no-limit"]))
    assert (config.check, config.limit) == (False, False)


def test_empty_names_in_an_algorithm_list_are_dropped():
    """A stray comma or space (``-a "builtin, ring,"``) names no algorithm of its own."""
    args = cli.build_parser().parse_args(["sweep", "-a", "builtin, ring,"])
    assert cli.sweep_config(args).algorithms == ("builtin", "ring")


def test_version_is_said_as_argparse_says_it(capsys):
    import commbench

    with pytest.raises(SystemExit) as ended:
        cli.build_parser().parse_args(["--version", "sweep", "--no-such-option"])
    assert ended.value.code == 0
    said = capsys.readouterr().out
    assert said == f"commbench {commbench.__version__}\n"
    for words in (["--version"], ["--version", "sweep", "--no-such-option"]):
        assert main(words) == 0
        assert capsys.readouterr().out == said, words


def test_version_says_its_line_without_importing_torch():
    """``commbench --version`` took five seconds on this VM: the launcher and the parser's choices
    import torch, and it needs neither."""
    probe = (
        "import sys; from commbench.bench.cli import main; code = main(['--version']); "
        "print(code, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[-1] == "0 False", done.stdout + done.stderr


def test_version_before_a_launching_command_starts_no_rank_server(monkeypatch):
    """``commbench --version sweep`` says the version and exits: the server (a torch import in a
    process of its own) was started for nothing, as it is not for --help."""
    from commbench.bench import cli, starter

    started = []
    monkeypatch.setattr(starter, "start", lambda: started.append(True))
    for words in (["--version", "sweep"], ["sweep", "--help"], ["--help", "demo"]):
        assert cli._start_rank_server(words) is None and started == [], words
    assert cli._start_rank_server(["sweep", "-b", "1K"]) is None and started == [True]


@pytest.mark.parametrize(
    "name, value",
    [
        (tcp.CC_ENV, "no-such-control"),
        (tcp.NOTSENT_ENV, "lots"),
        (comm.HOST_FROM_ENV, "big"),
        (p2p.DUPLEX_ENV, "off"),  # was taken for 1 without a word
    ],
)
@pytest.mark.parametrize(
    "argv",
    [
        ["sweep", "--world-size", "2"],
        ["train", "--world-size", "2"],
        ["cluster", "--hosts", "2", "--", "sweep"],  # before a namespace is made
        ["study", "000_backbones", "--tiny", "-q"],  # before any run starts
    ],
    ids=["sweep", "train", "cluster", "study"],
)
def test_a_bad_setting_in_the_environment_is_one_line_and_exit_2(
    capsys, monkeypatch, tmp_path, name, value, argv
):
    monkeypatch.setenv(name, value)
    if argv[0] == "study":
        argv = [*argv, "-o", str(tmp_path / "st")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"${name}={value!r}" in err and err.count("\n") == 1 and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # the study made nothing


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message where CUDA is absent")
def test_cuda_without_cuda_is_bad_input(capsys):
    assert main(["sweep", "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_more_nccl_ranks_than_gpus_is_bad_input(monkeypatch, capsys):
    """Two NCCL ranks on one GPU failed inside the ranks (NCCL refuses a GPU shared by two), exit 1;
    gloo may share one GPU between ranks."""
    import torch

    from commbench.bench import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["sweep", "--device", "cuda", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "commbench: error: NCCL needs a GPU for each rank: 2 ranks on this host, 1 GPU(s); "
        "use --world-size 1 or --backend gloo\n"
    )
    args = cli.build_parser().parse_args(
        ["sweep", "--device", "cuda", "--world-size", "2", "--backend", "gloo"]
    )
    assert cli.launch_spec(args).world_size == 2
    args = cli.build_parser().parse_args(["sweep", "--device", "cuda", "--world-size", "1"])
    assert cli.launch_spec(args).resolved_backend == "nccl"
    # under torchrun, the ranks on this host count: two of a world of four on one GPU
    for key, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(
        ValueError, match="2 ranks on this host, 1 GPU.s.; start at most that many ranks a host"
    ):
        cli.launch_spec(cli.build_parser().parse_args(["sweep", "--device", "cuda"]))
    # where the launcher gives each rank a GPU of its own (srun --gpus-per-task), each sees one
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert cli.launch_spec(cli.build_parser().parse_args(["sweep", "--device", "cuda"])).world_size == 4


def _mean_busbw_line(records: list[dict]) -> str:
    """The closing line a sweep of one collective beside send/recv ends with, worked out here."""
    series: dict[str, list[float]] = {}
    for r in records:
        series.setdefault("limit" if r["collective"] == "sendrecv" else r["algorithm"], []).append(
            r["busbw_gbps"]
        )
    sizes = {r["size_bytes"] for r in records}
    means = "  ".join(f"{name} {sum(v) / len(v):.3f}" for name, v in series.items())
    return f"avg busbw (GB/s, mean over {len(sizes)} sizes): {means}"


def test_sweep_writes_table_json_csv_and_plot(recorded_sweep, monkeypatch):
    from commbench.bench import launch

    out = recorded_sweep
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(recorded.SWEEP_WORLD))  # as in each of its ranks
    assert "busbw(GB/s)" in out.stdout
    names = [line.split()[-7] for line in out.stdout.splitlines() if line.strip() and line[0] != "#"]
    # send/recv beside the collective is the limit; auto's rows say what it ran ("auto:rd")
    assert {n.split(":")[0] for n in names} == {*recorded.SWEEP_ALGORITHMS, "limit"}
    lines = out.records()
    header, records = lines[0], [r for r in lines[1:] if r["type"] == "sweep"]
    (probe,) = [r for r in lines if r["type"] == "probe"]  # the rank-0 sampler's timeline, written last
    assert lines[-1] is probe and probe["samples"] and probe["nic"] == "lo"
    # the table ends as nccl-tests' does (wrong elements, mean busbw), before the probe's own line
    footer = report.table_footer(records).splitlines()
    printed = out.stdout.splitlines()
    at = printed.index(footer[0])
    assert printed[at : at + 2] == footer and printed[at + 2].startswith("# probe:"), printed[at:]
    assert footer[0] == "# wrong elements: 0 OK"
    assert footer[1] == "# " + _mean_busbw_line(records)
    assert header["type"] == "header" and header["torch"] and "sweep" in header["command"]
    # where each rank ran, as nccl-tests lists them: in the header, and under the table's title
    places = header["ranks"]
    assert [p["host"] for p in places] == [socket.gethostname()] * recorded.SWEEP_WORLD
    assert {p["device"] for p in places} == {"cpu"} and len(
        {p["pid"] for p in places}
    ) == recorded.SWEEP_WORLD
    listed = [line for line in printed if line.startswith("#  rank ")]
    assert listed == [f"#  rank {i}: host {p['host']}, pid {p['pid']}, cpu" for i, p in enumerate(places)]
    assert printed.index(listed[0]) == 1  # just under the title
    assert header["tcp_congestion_control"]["local_connections"] == tcp.summary()["local_connections"]
    assert header["tcp_notsent_lowat"] == tcp.notsent_summary()
    assert header["gloo_cuda_host_copies_from"] == comm.stage_whole_from()
    assert header["gloo_duplex"] is p2p.duplex_setting()
    assert header["torch_threads"] == launch._threads()  # what the rank applied (the rule: test_launch)
    assert len(records) == len(recorded.SWEEP_SIZES) * (len(recorded.SWEEP_ALGORITHMS) + 1)  # + limit
    assert {r["algorithm"] for r in records} == {*recorded.SWEEP_ALGORITHMS, "p2p"}
    assert sorted({r["size_bytes"] for r in records}) == list(recorded.SWEEP_SIZES)
    assert all(r["resolved_algorithm"] in ("rd", "ring") for r in records if r["algorithm"] == "auto")
    for r in records:
        for key in (
            "collective",
            "algorithm",
            "backend",
            "device",
            "world_size",
            "dtype",
            "op",
            "size_bytes",
            "count",
            "iters",
            "warmup",
            "time_us",
            "time_us_min",
            "time_us_mean",
            "time_us_p90",
            "time_us_max",
            "algbw_gbps",
            "busbw_gbps",
            "wrong",
        ):
            assert key in r
        assert r["wrong"] == 0
        assert r["time_us_min"] <= r["time_us"] <= r["time_us_max"]
    n = recorded.SWEEP_WORLD
    for r in records:
        factor = 2 * (n - 1) / n if r["algorithm"] != "p2p" else 1.0  # nccl-tests' all_reduce factor
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor, rel=1e-3), r["algorithm"]
    rows = list(csv.DictReader(out.csv.open()))
    assert len(rows) == len(records)
    assert out.plot.read_bytes()[:4] == b"\x89PNG"
    timeline = out.plot.with_name(out.plot.stem + "-timeline.png")  # the probe timeline
    assert timeline.read_bytes()[:4] == b"\x89PNG"


# SIGHUP takes Ctrl-C's path through the launcher (the SIGHUP variants of test_launch stay in
# `make test`): under `make test-slow`, to keep `make test` within ten minutes
@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, pytest.param(signal.SIGHUP, marks=pytest.mark.slow)],
    ids=["ctrl-c", "closed-terminal"],
)
def test_interrupted_sweep_keeps_finished_points_and_leaves_nothing_running(tmp_path, sig):
    """What Ctrl-C or a closed terminal sends to the terminal's process group (the sweep would run
    for minutes; 256 MiB keeps it within the memory check on a 24 GB machine): one line, every
    finished point kept, no process left (multiprocessing's resource tracker, in the group too,
    must outlive a SIGHUP, or it is relaunched and prints a traceback for each semaphore)."""
    path = tmp_path / "r.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "commbench",
            "sweep",
            "-b",
            "1K",
            "-e",
            "256M",
            "-n",
            "5",
            "-w",
            "1",
            "--world-size",
            "2",
            "-a",
            "naive",
            "--json",
            str(path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not path.exists() or len(path.read_text().splitlines()) < 3):
        time.sleep(0.2)
    children = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert err.strip().startswith("commbench: interrupted") and "\n" not in err.strip(), err
    assert "# avg busbw" not in out  # the closing lines are for a sweep that ran every size
    kept = [json.loads(x) for x in path.read_text().splitlines()]
    assert kept[0]["type"] == "header" and len(kept) >= 3
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert alive == []


@pytest.mark.parametrize(
    "content,needle",
    [
        ("3\n", "not a JSON object"),
        # the file's line, not the record's
        ('{"type": "header"}\n\n\n[1, 2]\n', "line 4 is not a JSON object"),
        ('{"type": "sweep"}\n', "without 'collective'"),
        ("{oops\n", "not JSON Lines: line 1, column 2: Expecting property name"),
        ('{"type": "header"}\n\n{"type": "sweep"}\n{oops\n', "not JSON Lines: line 4, column 2"),
        # the cut last line is left out (a run killed mid-write), and nothing finished is before it
        ('{"type": "header"}\n{"type": "sw', "holds no sweep records"),
        ('{"type": "header"}\n{"type": "sw\n', "line 2, column 10: Unterminated string starting at\n"),
        ("", "holds no sweep records"),
        ('{"type": "header", "command": "commbench sweep"}\n', "holds no sweep records"),
        ('{"type": "epoch", "strategy": "ring"}\n', "holds no sweep records"),
        # a value of the wrong type: "'<' not supported between instances of 'int' and 'str'"
        (
            "".join(
                json.dumps(
                    {
                        "type": "sweep",
                        "collective": "all_reduce",
                        "algorithm": "ring",
                        "size_bytes": size,
                        "busbw_gbps": 1.0,
                        "busbw_ratio_to_builtin": 1.0,
                        "frac_of_limit": None,
                    }
                )
                + "\n"
                for size in (1024, "2K")
            ),
            "line 2: the sweep record's 'size_bytes' is \"2K\", not a whole number",
        ),
        *(
            (
                json.dumps(
                    {
                        "type": "sweep",
                        "collective": "all_reduce",
                        "algorithm": "ring",
                        "world_size": 2,
                        "size_bytes": 1024,
                        "busbw_gbps": 1.0,
                        field: value,
                    }
                )
                + "\n",
                needle,
            )
            for field, value, needle in (
                ("size_bytes", 0, "'size_bytes' is 0, not a whole number >= 1"),
                ("world_size", -1, "'world_size' is -1, not a whole number >= 1"),
                ("busbw_gbps", -2.5, "'busbw_gbps' is -2.5, not a finite number >= 0"),
                ("time_us", float("inf"), "'time_us' is Infinity, not a finite number >= 0"),
                ("algbw_gbps", float("nan"), "'algbw_gbps' is NaN, not a finite number >= 0"),
                # past a float's range: "OverflowError: int too large to convert to float", a traceback
                (
                    "wire_bytes_ratio",
                    10**400,
                    "is 1000000000000000000000000000000000000..., not a number within a float's range",
                ),  # fmt: skip
                ("wire_expected_ratio", -(10**400), "not a number within a float's range"),
                # ratios of two bandwidths, which are never below 0 (-1 was printed as -1.00)
                (
                    "busbw_ratio_to_builtin",
                    -1.2,
                    "'busbw_ratio_to_builtin' is -1.2, not a finite number >= 0",
                ),
                ("frac_of_limit", float("inf"), "'frac_of_limit' is Infinity, not a finite number >= 0"),
                ("wrong", -5, "'wrong' is -5, not a whole number >= 0"),  # was "-5 FAILED"
                ("block", 0, "'block' is 0, not a whole number >= 1"),
                ("root", -1, "'root' is -1, not a whole number >= 0"),
                # shown as auto:['ring']
                ("resolved_algorithm", ["ring"], "'resolved_algorithm' is [\"ring\"], not text"),
            )
        ),
        # the machine table's memory, past a float's range (report's traceback too)
        (
            '{"type": "header", "memory_bytes": 1' + "0" * 400 + "}\n",
            "line 1: the header record's 'memory_bytes' is 1000000000000000000000000000000000000..., not a "
            "finite number >= 0 within a float's range",
        ),  # fmt: skip
        # Python's own "Exceeds the limit (4300 digits) for integer string conversion", no file or line
        (
            '{"type": "header"}\n{"type": "sweep", "size_bytes": 1' + "0" * 5000 + "}\n",
            "r.jsonl is not JSON Lines: line 2, column 1: a number with too many digits to read",
        ),  # fmt: skip
    ],
)
def test_summary_rejects_files_it_did_not_write(tmp_path, capsys, content, needle):
    path = tmp_path / "r.jsonl"
    path.write_text(content)
    assert main(["summary", str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_summary_prints_ratio_tables(recorded_sweep, capsys):
    assert main(["summary", str(recorded_sweep.json)]) == 0
    table = capsys.readouterr().out
    assert "| 2048 |" in table and "| 2097152 |" in table and "ring / builtin" in table
    records = [r for r in recorded_sweep.records() if r["type"] == "sweep"]
    closing = [f"- {line}" for line in report.closing_lines(records)]  # as the sweep's table ended
    assert "\n".join(closing) in table and closing[0] == "- wrong elements: 0 OK"
    assert closing[1] == "- " + _mean_busbw_line(records)


def test_the_summaries_pasted_in_the_performance_notes_are_what_summary_prints(capsys, monkeypatch):
    """docs/PERFORMANCE.md quotes summary's output for its recorded sweeps; headings and closing
    lines that summary had since gained were missing there."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "docs" / "perf").is_dir():
        pytest.skip("the measured records (docs/perf) are in the repository, not in an sdist")
    notes = (root / "docs" / "PERFORMANCE.md").read_text()
    pasted = re.findall(r"^### (docs/perf/[\w./-]+\.jsonl):", notes, flags=re.M)
    assert len(pasted) >= 6
    monkeypatch.chdir(root)
    for path in pasted:
        assert main(["summary", path]) == 0
        printed = capsys.readouterr().out.rstrip("\n")
        assert printed in notes, path


def test_a_reader_that_leaves_early_ends_the_output_without_a_traceback(recorded_sweep):
    # Enough tables to overflow the pipe after the reader has gone, as in `... | head -1`.
    files = [str(recorded_sweep.json)] * 300
    proc = subprocess.Popen(
        [sys.executable, "-m", "commbench", "summary", *files],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    with _kill_after(proc, 120):  # the reads below have no timeout of their own
        assert proc.stdout.readline().startswith(b"### ")
        proc.stdout.close()
        err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 128 + signal.SIGPIPE
    assert err == ""


@contextlib.contextmanager
def _kill_after(proc: subprocess.Popen, seconds: float):
    """Kill ``proc`` if the block is still running after ``seconds``: a blocked read then returns."""
    timer = threading.Timer(seconds, proc.kill)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _run_file(path: Path, world: int, ratios: dict[int, float], block: int | None = None) -> Path:
    """A sweep file as commbench writes it, with ring's ratio to builtin per size (and no block
    field when ``block`` is None, as files written before --block existed)."""
    rows = [{"type": "header", "command": f"commbench sweep --world-size {world}"}]
    for size, ratio in ratios.items():
        for algo, r in (("builtin", 1.0), ("ring", ratio)):
            rows.append(
                {
                    "type": "sweep",
                    "collective": "all_reduce",
                    "algorithm": algo,
                    "world_size": world,
                    "backend": "gloo",
                    "dtype": "float32",
                    "size_bytes": size,
                    "busbw_gbps": r,
                    "busbw_ratio_to_builtin": r,
                    "frac_of_limit": None,
                }
            )
            if block is not None:
                rows[-1]["block"] = block
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_summary_across_one_rank_sweeps_says_why_there_are_no_ratios(tmp_path, capsys):
    """At one rank builtin was swept, yet --across asked for builtin among the algorithms: its bus
    bandwidth is 0 there (all_reduce's factor 2(n-1)/n), so no ratio is taken."""
    runs = [str(tmp_path / f"{name}.jsonl") for name in "ab"]
    sweep = ["sweep", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0", "-a", "builtin,ring", "--world-size", "1"]
    for path in runs:
        assert main([*sweep, "--json", path]) == 0
    capsys.readouterr()
    assert main(["summary", "--across", *runs]) == 0
    out = capsys.readouterr().out
    assert "no ratios to builtin: its bus bandwidth is 0" in out and "among the algorithms" not in out
    alone = [str(tmp_path / f"{name}.jsonl") for name in "cd"]  # two ranks, builtin alone
    for path in alone:
        assert main([*sweep[:-4], "-a", "builtin", "--world-size", "2", "--no-limit", "--json", path]) == 0
    capsys.readouterr()
    assert main(["summary", "--across", *alone]) == 0
    assert "(no ratios to builtin: no other algorithm was swept)" in capsys.readouterr().out


def test_summary_across_runs_gives_mean_range_and_counts_under(tmp_path, capsys):
    runs = [
        _run_file(tmp_path / "a.jsonl", 4, {1024: 1.2, 2048: 0.85}),
        _run_file(tmp_path / "b.jsonl", 4, {1024: 0.8, 2048: 0.95}),
        _run_file(tmp_path / "c.jsonl", 4, {1024: 1.3, 2048: 1.05}),
    ]
    assert main(["summary", "--across", *map(str, runs)]) == 0
    out = capsys.readouterr().out
    assert "3 runs: all_reduce, 4 ranks, gloo, float32" in out
    rows = [line for line in out.splitlines() if line[:3] in ("| 1", "| 2")]
    assert rows == ["| 1024 | 1.10 [0.80, 1.30] (1, 1 of 3) |", "| 2048 | 0.95 [0.85, 1.05] (1, 2 of 3) |"]


def test_summary_refuses_a_file_holding_several_runs(tmp_path, capsys):
    """Two runs joined with cat: the table was titled with the first run's ranks and command and
    held the second run's ratios (a point both hold was taken from the last)."""
    a = _run_file(tmp_path / "a.jsonl", 2, {1024: 1.5})
    b = _run_file(tmp_path / "b.jsonl", 4, {1024: 0.5})
    joined = tmp_path / "joined.jsonl"
    joined.write_text(a.read_text() + b.read_text())
    for argv in (["summary", str(joined)], ["summary", "--across", str(joined), str(a)]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1
        assert f"{joined} holds 2 runs (header records at lines 1, 4)" in err


def test_summary_across_refuses_one_file_given_twice(tmp_path, capsys, monkeypatch):
    """It was taken for two runs that agreed exactly: each cell "(2, 2 of 2)" from one run."""
    a = _run_file(tmp_path / "a.jsonl", 2, {1024: 0.5})
    _run_file(tmp_path / "b.jsonl", 2, {1024: 1.5})
    (tmp_path / "c.jsonl").symlink_to(a)
    monkeypatch.chdir(tmp_path)
    for names, said in (
        (["a.jsonl", "b.jsonl", "a.jsonl"], "a.jsonl is given twice"),
        (["a.jsonl", "b.jsonl", "./a.jsonl"], "a.jsonl and ./a.jsonl are one file"),
        (["c.jsonl", "a.jsonl"], "c.jsonl and a.jsonl are one file"),
    ):
        assert main(["summary", "--across", *names]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == f"commbench: error: --across takes each run once, but {said}\n"
    assert main(["summary", "--across", "a.jsonl", "b.jsonl"]) == 0
    assert "| 1024 | 1.00 [0.50, 1.50] (1, 1 of 2) |" in capsys.readouterr().out


def _points(*changes: dict) -> str:
    """A two-rank all_reduce sweep's JSON Lines (builtin and ring at 1 KiB, and the send/recv
    limit), then one more point for each of ``changes``: ring's 1 KiB point with those fields."""
    point = {"type": "sweep", "collective": "all_reduce", "world_size": 2, "backend": "gloo",
             "dtype": "float32", "op": "sum", "size_bytes": 1024, "busbw_gbps": 1.0,
             "busbw_ratio_to_builtin": 1.0, "frac_of_limit": 1.0}  # fmt: skip
    rows = [{"type": "header", "command": "commbench sweep"}]
    rows += [{**point, "algorithm": a} for a in ("builtin", "ring")]
    rows.append({**point, "collective": "sendrecv", "algorithm": "p2p", "op": None})
    rows += [{**point, "algorithm": "ring", **c} for c in changes]
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        # the table showed the last of the two, and the mean counted both
        ({}, "line 5: all_reduce ring at 1024 B is there already (line 3)"),
        ({"busbw_gbps": 5.0}, "line 5: all_reduce ring at 1024 B is there already (line 3)"),
        # headed "all_reduce, 2 ranks", the table held broadcast's and four ranks' bandwidths
        (
            {"collective": "broadcast", "size_bytes": 2048},
            "line 5: a point of broadcast, 2 ranks, gloo, "
            "float32, sum, where line 2 has all_reduce, 2 ranks, gloo, float32, sum",
        ),  # fmt: skip
        ({"world_size": 4, "size_bytes": 2048}, "line 5: a point of all_reduce, 4 ranks"),
        ({"op": "max", "size_bytes": 2048}, "line 5: a point of all_reduce, 2 ranks, gloo, float32, max"),
        (
            {"block": 4, "size_bytes": 2048},
            "line 5: a point of all_reduce, 2 ranks, gloo, float32, sum, --block 4, where",
        ),
        (
            {"dtype": "float16", "size_bytes": 2048},
            "line 5: a point of all_reduce, 2 ranks, gloo, float16, sum, where",
        ),
        # the limit shares the sweep's ranks, backend, dtype, block and device (not its collective)
        (
            {"collective": "sendrecv", "algorithm": "p2p", "world_size": 3, "size_bytes": 2048},
            "line 5: a point of sendrecv, 3 ranks",
        ),
        # a name with a line break, told in one line
        ({"dtype": "f\nx"}, "line 5: a point of all_reduce, 2 ranks, gloo, f x, sum, where"),
    ],
)
def test_summary_refuses_a_file_that_is_not_one_sweep(tmp_path, capsys, changes, said):
    path = tmp_path / "r.jsonl"
    path.write_text(_points(changes))
    assert main(["summary", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"commbench: error: {path} {said}") and err.count("\n") == 1, err


def test_report_refuses_a_point_given_twice_and_takes_other_collectives(tmp_path, capsys):
    """Its table showed both points of one size as two rows. A file of several collectives (a
    cluster's, a study's) is fine for report, which heads each with its own."""
    path, out = tmp_path / "r.jsonl", str(tmp_path / "rep")
    path.write_text(_points({"busbw_gbps": 5.0}))
    assert main(["report", str(path), "-o", out]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"commbench: error: {path} line 5: all_reduce ring at 1024 B is there already (line 3); "
        "commbench writes each point once: give each run a file\n"
    )
    path.write_text(_points({"collective": "broadcast"}, {"world_size": 4}))
    assert main(["report", str(path), "-o", out]) == 0, capsys.readouterr().err


_ON_CPU = "all_reduce, 2 ranks, gloo on cpu, float32"


@pytest.mark.parametrize(
    ("changes", "headings"),
    [
        ({"op": "max", "size_bytes": 2048}, [f"{_ON_CPU}, sum", f"{_ON_CPU}, max"]),
        ({"block": 4, "size_bytes": 2048}, [f"{_ON_CPU}, sum", f"{_ON_CPU}, sum, --block 4"]),
        (
            {"collective": "broadcast", "size_bytes": 2048},
            [_ON_CPU, "broadcast, 2 ranks, gloo on cpu, float32"],
        ),
    ],
)
def test_report_gives_each_sweep_of_a_file_its_own_table(tmp_path, capsys, changes, headings):
    """A point of another op, block or collective was a row of the first sweep's table (a
    broadcast's 1 KiB builtin hid all_reduce's), headed "all_reduce, broadcast"."""
    path, out = tmp_path / "r.jsonl", tmp_path / "rep"
    path.write_text(_points(changes).replace('"backend": "gloo"', '"backend": "gloo", "device": "cpu"'))
    assert main(["report", str(path), "-o", str(out)]) == 0, capsys.readouterr().err
    text = (out / "report.md").read_text()
    assert re.findall(r"^### Sweep: (.*)$", text, re.M) == headings
    tables = text.split("### Sweep: ")[1:]
    # the first sweep's builtin and ring, the other's point, and the limit beside each (except
    # where the limit's block is not the other sweep's)
    rows = [len(re.findall(r"^\| 1K |^\| 2K ", t, re.M)) for t in tables]
    assert rows == ([3, 1] if "block" in changes else [3, 2])


def test_a_name_too_long_for_a_file_name_still_makes_its_plot(tmp_path, capsys):
    path, out = tmp_path / "r.jsonl", tmp_path / "rep"
    path.write_text(_points({"collective": "A" * 5000, "size_bytes": 2048}))
    assert main(["report", str(path), "-o", str(out)]) == 0, capsys.readouterr().err
    assert max(len(p.name) for p in out.glob("*.png")) <= 100


def test_summary_refuses_a_limit_of_other_ranks_than_its_sweep(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    lines = _points().splitlines()
    limit = json.loads(lines[3]) | {"world_size": 3}
    path.write_text("\n".join([*lines[:3], json.dumps(limit)]) + "\n")
    assert main(["summary", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"commbench: error: {path} line 4: a send/recv limit of sendrecv, 3 ranks, gloo, float32, where the "
        "sweep is all_reduce, 2 ranks, gloo, float32, sum; commbench writes one sweep a file\n"
    )


def test_a_point_given_twice_under_a_name_with_a_line_break_is_told_in_one_line(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    path.write_text(_points({"algorithm": "ri\nng"}, {"algorithm": "ri\nng"}))
    for argv in (["summary", str(path)], ["report", str(path), "-o", str(tmp_path / "rep")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "line 6: all_reduce ri ng at 1024 B is there already (line 5)" in err


def test_one_sweeps_points_at_other_sizes_and_forms_pass(tmp_path, capsys):
    """The same point at another size, the limit at another size, or a record of no type."""
    path = tmp_path / "r.jsonl"
    more = (
        {"size_bytes": 2048},
        {"collective": "sendrecv", "algorithm": "p2p", "op": None, "size_bytes": 2048},
    )
    path.write_text(_points(*more) + '{"x": 1}\n')  # no type: once a KeyError in the closing lines
    assert main(["summary", str(path)]) == 0
    out = capsys.readouterr().out
    assert (
        "| 2048 |" in out
        and "avg busbw (GB/s, mean over 2 sizes): builtin 1.000 (1 size)  ring 1.000  limit 1.000" in out
    )


def _cells(line: str) -> int:
    return len(re.findall(r"(?<!\\)\|", line))


def test_names_and_commands_written_by_hand_keep_the_tables_whole(tmp_path, capsys):
    """A '|' or a line break in an algorithm's name split summary's and report's tables, and a
    backtick or line break in the command broke its code span."""
    path = tmp_path / "r.jsonl"
    odd = {"algorithm": "ri|ng\nfast"}
    command = "`commbench` sweep -a ```x```\n--json 'p|q.jsonl'"
    path.write_text(_points(odd).replace('"commbench sweep"', json.dumps(command)))
    assert main(["summary", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\n```` `commbench` sweep -a ```x``` --json 'p|q.jsonl' ````\n" in out  # longer than ```, padded
    copy = tmp_path / "copy.jsonl"
    shutil.copyfile(path, copy)
    assert main(["summary", "--across", str(path), str(copy)]) == 0
    across = capsys.readouterr().out  # a fence longer than the command's ```, and its '|' as written
    assert "\n````\n`commbench` sweep -a ```x``` --json 'p|q.jsonl'\n````\n" in across, across
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert "ri\\|ng fast / builtin" in table[0] and len({_cells(line) for line in table}) == 1, table
    assert not any(line.startswith("fast") for line in out.splitlines())
    assert main(["report", str(path), "-o", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| ri\\|ng fast |" in md and not any(line.startswith("fast") for line in md.splitlines())
    assert "\n````\n`commbench` sweep -a ```x```\n--json 'p|q.jsonl'\n````\n" in md  # the run's command
    assert all(len({_cells(x) for x in t.splitlines()}) == 1 for t in re.findall(r"(?m)(?:^\|.*\n)+", md))


def test_a_file_named_by_an_empty_word_is_refused_as_such(capsys):
    """It was read as the current directory: "cannot read : Is a directory"."""
    for argv in (["summary", ""], ["report", ""], ["report", "r.jsonl", "--baseline", ""]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.endswith("needs a file name, got an empty one\n") and err.count("\n") == 1, err


def _send_recv_lines(busbw: dict[int, float]) -> str:
    """A send/recv sweep's JSON Lines as commbench writes them: busbw by size."""
    rows = [{"type": "header", "command": "commbench sweep --collective sendrecv"}]
    for size, bw in busbw.items():
        rows.append(
            {
                "type": "sweep",
                "collective": "sendrecv",
                "algorithm": "p2p",
                "world_size": 2,
                "backend": "gloo",
                "dtype": "float32",
                "size_bytes": size,
                "busbw_gbps": bw,
                "busbw_ratio_to_builtin": None,
                "frac_of_limit": 1.0,
            }
        )
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_summary_of_a_send_recv_sweep_shows_its_bandwidth(tmp_path, capsys):
    path = tmp_path / "p2p.jsonl"
    path.write_text(_send_recv_lines({1024: 0.5, 2048: 0.75}))
    assert main(["summary", str(path)]) == 0
    out = capsys.readouterr().out
    assert "sendrecv, 2 ranks" in out and "no sweep records" not in out
    assert "| 1024 | p2p | 0.500 |" in out and "| 2048 | p2p | 0.750 |" in out


def test_summary_across_refuses_runs_of_different_sweeps(tmp_path, capsys):
    a = _run_file(tmp_path / "a.jsonl", 2, {1024: 1.0})
    b = _run_file(tmp_path / "b.jsonl", 4, {1024: 1.0})
    assert main(["summary", "--across", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert "runs of one sweep" in err and err.count("\n") == 1


def test_summary_across_refuses_runs_of_different_ops(tmp_path, capsys):
    runs = []
    for name, op in (("sum", "sum"), ("max", "max")):
        path = _run_file(tmp_path / f"{name}.jsonl", 4, {1024: 1.0})
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text(
            "".join(json.dumps({**r, "op": op} if r["type"] == "sweep" else r) + "\n" for r in rows)
        )
        runs.append(str(path))
    assert main(["summary", "--across", *runs]) == 2
    err = capsys.readouterr().err
    assert "runs of one sweep" in err and "float32, sum" in err and "float32, max" in err


def test_summary_across_takes_runs_whose_root_does_nothing(tmp_path, capsys):
    runs = []
    for root in (0, 1):
        path = _run_file(tmp_path / f"root{root}.jsonl", 4, {1024: 1.0})
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text(
            "".join(json.dumps({**r, "root": root} if r["type"] == "sweep" else r) + "\n" for r in rows)
        )
        runs.append(str(path))
    assert main(["summary", "--across", *runs]) == 0  # all_reduce has no root


def test_summary_across_refuses_runs_timed_in_different_blocks(tmp_path, capsys):
    a = _run_file(tmp_path / "a.jsonl", 4, {1024: 1.0})  # no block field: interleaved call by call
    b = _run_file(tmp_path / "b.jsonl", 4, {1024: 1.0}, block=25)
    assert main(["summary", "--across", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert "runs of one sweep" in err and "--block 25" in err and err.count("\n") == 1


def test_summary_across_runs_of_one_block_says_it(tmp_path, capsys):
    a = _run_file(tmp_path / "a.jsonl", 4, {1024: 1.0}, block=1)
    b = _run_file(tmp_path / "b.jsonl", 4, {1024: 1.0})  # the same timing, recorded before --block
    c = _run_file(tmp_path / "c.jsonl", 4, {1024: 1.0}, block=4)
    d = _run_file(tmp_path / "d.jsonl", 4, {1024: 1.0}, block=4)
    assert main(["summary", "--across", str(a), str(b)]) == 0
    assert "2 runs: all_reduce, 4 ranks, gloo, float32\n" in capsys.readouterr().out
    assert main(["summary", "--across", str(c), str(d)]) == 0
    assert "2 runs: all_reduce, 4 ranks, gloo, float32, --block 4\n" in capsys.readouterr().out


def test_summary_across_one_real_sweep_twice(recorded_sweep, tmp_path, capsys):
    path, copy = str(recorded_sweep.json), tmp_path / "copy.jsonl"
    shutil.copyfile(path, copy)  # two files, as two runs that agreed exactly
    assert main(["summary", "--across", path, str(copy)]) == 0
    out = capsys.readouterr().out
    assert "| 2097152 |" in out and "ring / builtin" in out and " of 2) |" in out


def test_sendrecv_defaults_to_its_only_algorithm(tmp_path, capsys):
    argv = ["sweep", "--collective", "sendrecv", "-b", "4K", "-e", "4K", *SMALL, "--no-probe", "-q"]
    assert main([*argv, "--json", str(tmp_path / "r.jsonl")]) == 0, capsys.readouterr().err
    lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()[1:]]
    records = [r for r in lines if r["type"] == "sweep"]
    assert records == lines  # --no-probe: no timeline record, and no counted bytes
    assert all(r["measured_wire_bytes"] is None and r["hosts"] is None for r in records)
    assert [(r["collective"], r["algorithm"], r["wrong"]) for r in records] == [("sendrecv", "p2p", 0)]


def test_an_in_place_sweep_runs_every_algorithm_in_place_and_checks_it(tmp_path, capsys):
    """--in-place: reduce_scatter's output is its rank's chunk of the input for builtin, naive and
    the ring; the records say so (the limit's send/recv is out of place), and the check passes."""
    path = tmp_path / "r.jsonl"
    argv = ["sweep", "--collective", "reduce_scatter", "--in-place", "-a", "builtin,naive,ring",
            "-b", "4K", "-e", "4K", *SMALL, "--no-probe", "-q", "--json", str(path)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    records = [r for r in map(json.loads, path.read_text().splitlines()) if r["type"] == "sweep"]
    assert [(r["algorithm"], r["in_place"], r["wrong"]) for r in records] == [
        ("builtin", True, 0),
        ("naive", True, 0),
        ("ring", True, 0),
        ("p2p", False, 0),
    ]
    assert main(["summary", str(path)]) == 0
    assert "reduce_scatter in place, 2 ranks" in capsys.readouterr().out
    assert main(["sweep", "--in-place", "-b", "1K", "-e", "1K"]) == 2
    assert capsys.readouterr().err == (
        "commbench: error: --in-place applies to reduce_scatter and all_gather; all_reduce always runs in "
        "place (one buffer, as in torch.distributed)\n"
    )


def test_summary_names_a_file_that_is_not_text(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\xff\xfe\x00")
    assert main(["summary", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path} is not JSON Lines: not UTF-8 text" in err and err.count("\n") == 1


def test_only_broadcast_and_reduce_record_a_root(tmp_path, capsys):
    """-o and -r are taken by every collective, as nccl-tests takes them; a record says the root
    only where there is one (all_gather's said root 1), and its op only where one is applied."""
    one = ["-b", "4K", "-e", "4K", "--world-size", "1", "-n", "1", "-w", "0", "--no-probe", "-q"]
    got = {}
    for collective, root in (("all_gather", 5), ("all_reduce", -1), ("broadcast", 0), ("reduce", 0)):
        path = tmp_path / f"{collective}.jsonl"
        argv = ["sweep", "--collective", collective, "-r", str(root), "-o", "max", *one, "--json", str(path)]
        assert main(argv) == 0, capsys.readouterr().err
        records = [r for r in map(json.loads, path.read_text().splitlines()) if r["type"] == "sweep"]
        got[collective] = {(r["algorithm"] == "p2p", r["op"], r["root"], r["wrong"]) for r in records}
    assert got == {
        "all_gather": {(False, None, None, 0), (True, None, None, 0)},
        "all_reduce": {(False, "max", None, 0), (True, None, None, 0)},
        "broadcast": {(False, None, 0, 0), (True, None, None, 0)},
        "reduce": {(False, "max", 0, 0), (True, None, None, 0)},
    }


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "broadcast"])
def test_one_rank_sweep_has_no_ratio_to_a_busbw_of_zero(tmp_path, capsys, collective):
    """At one rank the bus factor of all_reduce and all_gather is 0, so every busbw is 0: no ratio,
    no crash (the ratio to the limit, a copy here, was 0.00 beside '-'). Broadcast's factor is 1:
    its ratios stay."""
    path = tmp_path / "r.jsonl"
    argv = ["sweep", "-b", "4K", "-e", "4K", "--world-size", "1", "-n", "1", "-w", "0", "--no-probe"]
    assert main([*argv, "--collective", collective, "--json", str(path)]) == 0, capsys.readouterr().err
    records = [r for r in map(json.loads, path.read_text().splitlines()) if r["type"] == "sweep"]
    assert {r["algorithm"] for r in records} >= {"builtin", "naive", "ring", "p2p"}
    for r in records:
        if r["algorithm"] == "p2p":
            assert r["frac_of_limit"] == 1.0, r
        elif collective == "broadcast":
            assert r["busbw_gbps"] > 0 and r["busbw_ratio_to_builtin"] > 0 and r["frac_of_limit"] > 0, r
        else:
            assert r["busbw_gbps"] == 0 and r["busbw_ratio_to_builtin"] is None and r["wrong"] == 0, r
            assert r["frac_of_limit"] is None, r


@pytest.mark.parametrize(
    "ignored",
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["ctrl-c", "ctrl-c-ignored-by-the-caller"],
)
def test_ctrl_c_while_torch_loads_is_one_line_and_exit_130(ignored):
    """The signal waits for the import (a KeyboardInterrupt inside it can abort in C++); a caller
    that started us with Ctrl-C ignored (``cmd &`` in a script) keeps it ignored."""
    code = (
        "import signal, sys; from commbench.bench import cli; "
        + ("signal.signal(signal.SIGINT, signal.SIG_IGN); " if ignored else "")
        + "print('ready', flush=True); sys.exit(cli.main(['summary', '/nonexistent.jsonl']))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    with _kill_after(proc, 120):
        assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)  # importing torch takes seconds; the signal lands in it
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if ignored:
        assert (proc.returncode, err) == (
            2,
            "commbench: error: cannot read /nonexistent.jsonl: No such file or directory\n",
        )
    else:
        assert (proc.returncode, err) == (130, "commbench: interrupted\n")


# A real SIGINT, raised by an import hook at the named moment of the command's start.
_SIGINT_AT = """
import os, signal, sys
class Hook:
    def find_spec(self, name, path=None, target=None):
        if name == sys.argv[1]:
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, Hook())
from commbench.__main__ import run
sys.exit(run(['summary', '/nonexistent.jsonl']))
"""


@pytest.mark.parametrize("module", ["commbench.bench.records", "commbench.bench.starter"])
def test_ctrl_c_before_the_cli_handles_signals_is_one_line_and_exit_130(module):
    """While the command imports its CLI (records) or starts the rank server (starter), before the
    CLI's own handling is in place, Ctrl-C used to end in a KeyboardInterrupt traceback."""
    argv = [sys.executable, "-c", _SIGINT_AT, module]
    if module == "commbench.bench.starter":  # summary starts no ranks: ask for a sweep's server
        argv = [
            sys.executable,
            "-c",
            _SIGINT_AT.replace("'summary', '/nonexistent.jsonl'", "'sweep', '-q'"),
            module,
        ]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (130, "commbench: interrupted\n")


@pytest.mark.parametrize(
    "sig",
    [signal.SIGHUP, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],
    ids=["closed-terminal", "term"],
)
def test_a_stop_while_the_cli_imports_torch_is_one_line_and_its_exit_code(sig):
    """A closed terminal's SIGHUP while the launcher's module (and torch) loaded ended the command
    silently (exit 129, no line); it now waits for the import, as Ctrl-C and SIGTERM do."""
    hook = _SIGINT_AT.replace("signal.SIGINT", f"signal.{sig.name}")
    done = subprocess.run(
        [sys.executable, "-c", hook, "commbench.bench.launch"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stderr) == (128 + sig, "commbench: interrupted\n")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM], ids=["closed-terminal", "term"])
def test_a_stop_between_the_launchers_import_and_the_launch_is_one_line_and_its_exit_code(sig, tmp_path):
    """--plot's check imports matplotlib after the launcher's module and before the launch: a
    SIGTERM or SIGHUP there took its default action, exit 143 or 129 with no line."""
    hook = _SIGINT_AT.replace("signal.SIGINT", f"signal.{sig.name}").replace(
        "'summary', '/nonexistent.jsonl'", f"'sweep', '-q', '--plot', '{tmp_path / 'r.png'}'"
    )
    done = subprocess.run(
        [sys.executable, "-c", hook, "matplotlib"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stderr) == (128 + sig, "commbench: interrupted\n")
    assert list(tmp_path.iterdir()) == []


def test_the_command_and_python_m_commbench_go_through_the_guarded_entry():
    """setup.cfg's console script and ``python -m commbench`` both start at ``commbench.__main__:run``."""
    scripts = configparser.ConfigParser()
    scripts.read(ROOT / "setup.cfg")
    assert scripts["options.entry_points"]["console_scripts"].split() == [
        "commbench",
        "=",
        "commbench.__main__:run",
    ]
    done = recorded.commbench(["summary", "/nonexistent.jsonl"])
    assert (done.returncode, done.stderr) == (
        2,
        "commbench: error: cannot read /nonexistent.jsonl: No such file or directory\n",
    )
    # The guard shows where a Ctrl-C lands in the CLI's import: run as `python -m` runs the package
    # (runpy, as __main__), it ends in the one line and 130; an unguarded entry gave a traceback.
    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_IN_THE_IMPORT], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert (done.returncode, done.stderr) == (130, "commbench: interrupted\n")


CTRL_C_IN_THE_IMPORT = """
import runpy, sys

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == "commbench.bench.cli":
            raise KeyboardInterrupt

sys.meta_path.insert(0, CtrlC())
sys.argv = ["commbench", "summary", "/nonexistent.jsonl"]
runpy.run_module("commbench", run_name="__main__", alter_sys=True)
"""


@contextlib.contextmanager
def _endless(argv: list[str], **kwargs):
    """A run that only a signal ends, in a session of its own; whatever it started is killed at the
    end of the block, so a test that fails does not leave ranks running for the rest of the suite."""
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kwargs,
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _endless_sweep(tmp_path: Path):
    argv = ["sweep", "-b", "4K", "-e", "4K", "-n", "1000000", "-w", "1", "-q", "--no-probe"]
    return _endless([sys.executable, "-m", "commbench", *argv, "--json", str(tmp_path / "r.jsonl")])


def _wait_for(find, count: int, timeout: float = 120) -> list[psutil.Process]:
    """Poll ``find()`` until it returns ``count`` processes."""
    deadline = time.monotonic() + timeout
    found = find()
    while len(found) < count and time.monotonic() < deadline:
        time.sleep(0.02)
        found = find()
    assert len(found) == count, found
    return found


def _fork_servers(top: psutil.Process) -> list[psutil.Process]:
    return [p for p in top.children() if "multiprocessing.forkserver" in " ".join(_cmdline(p))]


def _ranks(top: psutil.Process) -> list[psutil.Process]:
    """The launcher's local ranks: its fork server's children."""
    return [rank for server in _fork_servers(top) for rank in _children(server)]


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children()
    except psutil.Error:
        return []


@pytest.mark.parametrize(
    "argv,env,starts",
    [
        (["sweep", "-b", "1M"], {}, True),
        (["compare", "--world-size", "2"], {}, True),
        (["study", "000_backbones"], {}, True),
        (["summary", "r.jsonl"], {}, False),
        (["sweep", "--help"], {}, False),
        (["-h"], {}, False),
        (["profile", "--", "sweep"], {}, False),  # its inner commbench starts its own
        (["sweep"], {"RANK": "0", "WORLD_SIZE": "2"}, False),  # under torchrun: no local ranks
    ],
)
def test_the_rank_server_starts_early_only_for_commands_that_start_ranks(monkeypatch, argv, env, starts):
    from commbench.bench import cli, starter

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    calls = []
    monkeypatch.setattr(starter, "start", lambda: calls.append(1))
    cli._start_rank_server(argv)
    assert calls == ([1] if starts else [])


@pytest.mark.slow
def test_ctrl_c_while_the_rank_server_loads_torch_is_one_line(tmp_path):
    """The fork server that starts the ranks imports torch beside the CLI; a Ctrl-C then ends
    both, with the CLI's one line and no traceback from the server."""
    with _endless_sweep(tmp_path) as proc:
        top = psutil.Process(proc.pid)
        (server,) = _wait_for(lambda: _fork_servers(top), 1)
        time.sleep(0.3)  # past the server's interpreter start, inside its import of torch
        assert _children(server) == []  # no rank started yet: the signal lands in the server's import
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.count("\n") == 1 and err.startswith("commbench: interrupted"), err
    assert psutil.wait_procs([server], timeout=30)[1] == []


@pytest.mark.slow
def test_ctrl_c_while_the_ranks_start_ends_them_at_once(tmp_path):
    """Ranks still starting (joining the group) leave quietly at Ctrl-C, and at once: the
    launcher does not wait out its grace period for them."""
    with _endless_sweep(tmp_path) as proc:
        top = psutil.Process(proc.pid)
        ranks = _wait_for(lambda: _ranks(top), 2)
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C at the terminal
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - start
    assert proc.returncode == 130 and err.count("\n") == 1 and err.startswith("commbench: interrupted"), err
    assert took < 20, took  # the launcher's grace period for ranks that do not stop is 30 s
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert alive == []


SLOW_FORK = """
import sys
from commbench.bench import cli, starter

if __name__ == "__main__":
    starter.PRELOAD = (*starter.PRELOAD, "tests.slow_fork")
    argv = ["sweep", "-b", "4K", "-e", "4K", "-n", "1000000", "-w", "1", "-q", "--no-probe"]
    sys.exit(cli.main([*argv, "--json", sys.argv[1]]))
"""


@pytest.mark.slow
def test_ctrl_c_the_moment_a_rank_is_forked_is_not_lost(tmp_path):
    """A Ctrl-C (and the launcher's SIGINT after it) reaching a rank before it has restored the
    signal dispositions its fork server changed still ends it, at once (tests/slow_fork.py makes
    that moment a second long)."""
    from multiprocessing import forkserver

    assert callable(getattr(forkserver, "_serve_one", None)), "the moment to widen is gone"
    script = tmp_path / "slow_fork.py"
    script.write_text(SLOW_FORK)
    argv = [sys.executable, str(script), str(tmp_path / "r.jsonl")]
    with _endless(argv, env={**os.environ, "PYTHONPATH": str(ROOT)}) as proc:
        top = psutil.Process(proc.pid)
        ranks = _wait_for(lambda: _ranks(top), 2)
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - start
    assert proc.returncode == 130 and err.count("\n") == 1 and err.startswith("commbench: interrupted"), err
    assert took < 20, took  # a lost signal: the launcher's 30 s grace, then SIGKILL
    assert psutil.wait_procs(ranks, timeout=30)[1] == []


STOP_IN_A_FINALISER = """
import os, signal, sys, time
from torch.distributed.elastic.agent.server import local_elastic_agent
from commbench.bench import cli

class CtrlC:
    def __del__(self):
        os.killpg(0, signal.SIGINT)  # Ctrl-C at the terminal, taken by the launcher in a finaliser
        time.sleep(0.5)

monitor = local_elastic_agent.LocalElasticAgent._monitor_workers
rounds = []

def monitor_then_drop(self, group):
    rounds.append(1)
    if len(rounds) == 30:  # 3 s in: the ranks are sweeping
        CtrlC()
    return monitor(self, group)

if __name__ == "__main__":
    local_elastic_agent.LocalElasticAgent._monitor_workers = monitor_then_drop
    argv = ["sweep", "-b", "4K", "-e", "4K", "-n", "1000000", "-w", "1", "-q", "--no-probe"]
    sys.exit(cli.main([*argv, "--json", sys.argv[1]]))
"""


@pytest.mark.slow
def test_ctrl_c_that_the_launcher_takes_in_a_finaliser_is_not_lost(tmp_path):
    """The agent's handler turns a Ctrl-C into an exception, and one raised while a finaliser
    (``__del__``) runs is printed and dropped: the launcher went on, found its ranks ended by the
    same Ctrl-C and reported "rank 0 failed: killed by SIGINT" under the dropped exception's
    traceback, exit 1 (seen once in make test, in a temporary file's finaliser)."""
    script = tmp_path / "finaliser.py"
    script.write_text(STOP_IN_A_FINALISER)
    path = tmp_path / "r.jsonl"
    with _endless(
        [sys.executable, str(script), str(path)], env={**os.environ, "PYTHONPATH": str(ROOT)}
    ) as proc:
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.count("\n") == 1 and err.startswith("commbench: interrupted"), err
    header = json.loads(path.read_text().splitlines()[0])
    assert header["type"] == "header"
    # main's words, not the script's: a study runs its commands through main so, in its own process
    words = ["sweep", "-b", "4K", "-e", "4K", "-n", "1000000", "-w", "1", "-q", "--no-probe"]
    assert header["command"] == shlex.join(["commbench", *words, "--json", str(path)])


HELD_CTRL_C = """
import os, signal, subprocess, sys
from commbench import __main__ as command
from commbench.bench import starter

ready = starter.ready

def ready_then_stop(timeout_s):
    ready(timeout_s)
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C once the fork server is up

if __name__ == "__main__":
    if sys.argv[1] == "stopped":
        starter.ready = ready_then_stop
    argv = ["sweep", "--world-size", "2", "-b", "4K", "-e", "4K", "-n", "1", "-w", "0", "-q", "--no-probe"]
    code = command.run(argv)  # what the commbench command runs
    # Ctrl-C held down from here until this process has gone: its exit handlers, then the
    # interpreter's and torch's teardown (about a second).
    loop = "while kill -INT $0 2>/dev/null; do sleep 0.01; done"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}  # the test reads ours to the end
    subprocess.Popen(["sh", "-c", loop, str(os.getpid())], **quiet)
    sys.exit(code)
"""


@pytest.mark.parametrize(
    "run, code, said",
    [pytest.param("stopped", 130, "commbench: interrupted\n", marks=pytest.mark.slow), ("finished", 0, "")],
)
def test_ctrl_c_after_the_command_lets_it_exit_with_its_code(tmp_path, run, code, said):
    """Once a run is interrupted, further Ctrl-C do nothing: one landing in an exit handler printed
    "Exception ignored in atexit callback ... KeyboardInterrupt" (and left multiprocessing's
    pymp-* directory), and one landing in the interpreter's teardown, where Python has put the
    default action back in place of its handlers, ended the process killed by SIGINT instead of
    with exit code 130. A run that finished printed that traceback too (seen after a cluster's
    report)."""
    script = tmp_path / "held.py"
    script.write_text(HELD_CTRL_C)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), run], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert (done.returncode, done.stderr) == (code, said), done.stderr[-2000:]


def test_an_interrupted_command_run_in_process_leaves_the_stop_handlers_as_it_found_them(monkeypatch):
    """cli.main set the stop signals to SIG_IGN once a run was interrupted, for the exit of its own
    process; a study, which runs each command through it, and the tests went on ignoring them."""
    from commbench.bench import cli, starter

    def stopped(timeout_s):
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(starter, "ready", stopped)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    argv = ["sweep", "--world-size", "2", "-b", "4K", "-e", "4K", "-n", "1", "-w", "0", "-q", "--no-probe"]
    assert cli.main(argv) == 130
    assert {s: signal.getsignal(s) for s in before} == before


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def test_output_checks_leave_no_files(tmp_path):
    from commbench.bench.records import check_outputs, check_writable

    check_writable(tmp_path / "r.jsonl")
    check_outputs(
        json=str(tmp_path / "r2.jsonl"), csv=str(tmp_path / "r.csv"), plot=str(tmp_path / "busbw.png")
    )
    assert list(tmp_path.iterdir()) == []


def test_a_rank_that_writes_nothing_checks_only_what_needs_no_file_system(tmp_path):
    from commbench.bench.records import check_outputs

    missing = str(tmp_path / "missing" / "r.jsonl")
    with pytest.raises(ValueError, match="directory .*missing does not exist"):
        check_outputs(json=missing, plot=None)
    check_outputs(json=missing, csv=str(tmp_path / "missing" / "r.csv"), plot="missing/r.png", writes=False)
    with pytest.raises(ValueError, match="--json and --plot name the same file"):
        check_outputs(json="r.png", plot="r.png", writes=False)
    with pytest.raises(ValueError, match="cannot plot to missing/r.txt: the name must end in one of"):
        check_outputs(json=missing, plot="missing/r.txt", writes=False)
    assert list(tmp_path.iterdir()) == []


def test_an_output_that_is_a_loop_of_links_is_one_line(tmp_path, capsys):
    """Path.resolve raised RuntimeError for it, where two outputs are compared: a traceback."""
    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(loop.name)
    assert main(["sweep", "--json", str(loop), "--plot", str(tmp_path / "p.png")]) == 2
    assert (
        capsys.readouterr().err
        == f"commbench: error: cannot write {loop}: Too many levels of symbolic links\n"
    )


def test_a_file_named_as_a_plot_that_is_not_drawn_is_taken():
    """Only training draws NAME-loss.png beside its plot, and only a probed run NAME-timeline.png:
    the records may take a name that no plot of the run takes."""
    from commbench.bench.records import check_outputs, plots_beside

    check_outputs(json="a-loss.png", plot="a.png", beside=plots_beside("sweep", "a.png", True), writes=False)
    with pytest.raises(
        ValueError, match="--json a-loss.png is where the plot a-loss.png beside --plot a.png"
    ):
        check_outputs(
            json="a-loss.png", plot="a.png", beside=plots_beside("train", "a.png", False), writes=False
        )
    for command in ("sweep", "train"):  # no timeline where nothing is probed
        check_outputs(
            json="a-timeline.png", plot="a.png", beside=plots_beside(command, "a.png", False), writes=False
        )
        with pytest.raises(ValueError, match="--json a-timeline.png is where the plot a-timeline.png"):
            check_outputs(
                json="a-timeline.png", plot="a.png", beside=plots_beside(command, "a.png", True), writes=False
            )


def test_a_link_to_a_file_in_no_directory_is_refused_before_the_run(tmp_path):
    """A link whose target's directory is missing passed the check, as a file removed meanwhile
    by another rank's check does, and rank 0 failed on it once the run had started (exit 1)."""
    from commbench.bench.records import check_writable

    link = tmp_path / "r.jsonl"
    link.symlink_to(tmp_path / "missing" / "r.jsonl")
    assert main(["sweep", "--json", str(link)]) == 2
    (tmp_path / "self.jsonl").symlink_to(tmp_path / "self.jsonl")
    with pytest.raises(ValueError, match="cannot write .*self.jsonl: Too many levels of symbolic links"):
        check_writable(tmp_path / "self.jsonl")
    link.unlink()
    link.symlink_to(tmp_path / "made.jsonl")  # a link to a file the run makes passes, and leaves nothing
    check_writable(link)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl", "self.jsonl"]


def _check_in_step(path, start, rounds, failures) -> None:
    from commbench.bench.records import check_writable

    for _ in range(rounds):
        start.wait()
        try:
            check_writable(path)
        except ValueError as exc:
            failures.put(str(exc))


def test_output_checks_of_one_path_at_once_neither_fail_nor_leave_files(tmp_path):
    """Under torchrun every rank checks the output paths before joining the group. Checked by
    seeing whether the file existed, then creating and removing it, one rank's removal could fail
    on another's ("cannot write ...: No such file or directory", exit 2; once in make test a rank
    of test_sweep_under_torchrun exited 2), and a rank that saw another's file left it behind."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    path, processes, rounds = tmp_path / "r.jsonl", 3, 300
    start, failures = ctx.Barrier(processes), ctx.Queue()
    checkers = [
        ctx.Process(target=_check_in_step, args=(path, start, rounds, failures)) for _ in range(processes)
    ]
    for checker in checkers:
        checker.start()
    for checker in checkers:
        checker.join(120)
    assert [c.exitcode for c in checkers] == [0] * processes
    assert failures.empty()
    assert list(tmp_path.iterdir()) == []
    path.write_text("kept\n")  # an existing file is checked, not removed
    _check_in_step(path, ctx.Barrier(1), 1, failures)
    assert path.read_text() == "kept\n"


def test_the_interrupted_message_counts_points_past_a_line_cut_short(tmp_path):
    from commbench.bench.cli import _kept

    path = tmp_path / "r.jsonl"
    path.write_text('{"type": "header"}\n')
    assert _kept(str(path)).startswith("; nothing had finished")
    path.write_text('{"type": "header"}\n{"type": "sweep"}\n{"type": "swe')
    assert _kept(str(path)) == f"; finished points are in {path}"


def test_the_interrupted_message_reads_a_csv_and_a_file_never_written(tmp_path):
    """A sweep with --csv alone kept its finished rows and said nothing of them, and a stop before
    the run opened its records said a file that was not there 'holds no points'."""
    from commbench.bench.cli import _kept, _records_path, build_parser

    rows = tmp_path / "r.csv"
    args = build_parser().parse_args(["sweep", "--csv", str(rows)])
    assert _records_path(args) == str(rows)
    assert _kept(str(rows), None, csv=True) == f"; nothing had finished, {rows} was not written"
    rows.write_text("")  # opened, no point yet: the header line comes with the first
    assert _kept(str(rows), None, csv=True) == f"; nothing had finished, {rows} holds no points"
    rows.write_text("size_bytes,time_us\n1024,5.0\n2048,6")  # the second cut short by the stop
    assert _kept(str(rows), None, csv=True) == f"; finished points are in {rows}"
    rows.write_text("size_bytes,time_us\n1024,5")
    assert _kept(str(rows), None, csv=True) == f"; nothing had finished, {rows} holds no points"
    both = build_parser().parse_args(["sweep", "--csv", str(rows), "--json", str(tmp_path / "r.jsonl")])
    assert _records_path(both) == str(tmp_path / "r.jsonl")


def test_a_descriptor_the_command_was_not_given_is_refused_as_an_output():
    """/dev/fd/N where N is a descriptor commbench opened itself (the rank server's pipes, the
    resource tracker's) passed, and the records went into that pipe, exit 0."""
    import argparse

    from commbench.bench import records

    given_r, given_w = os.pipe()
    records.note_given_descriptors()
    own_r, own_w = os.pipe()
    try:
        assert records.output_path(f"/dev/fd/{given_w}") == f"/proc/{os.getpid()}/fd/{given_w}"
        with pytest.raises(argparse.ArgumentTypeError, match=f"names descriptor {own_w}, which this"):
            records.output_path(f"/dev/fd/{own_w}")
        assert records.output_path("/dev/fd/\u0663") == "/dev/fd/\u0663"  # no descriptor: a name
    finally:
        for fd in (given_r, given_w, own_r, own_w):
            os.close(fd)
        records.note_given_descriptors()


def test_messages_name_a_descriptor_as_it_was_given():
    """--json /dev/stdout --csv /dev/stdout was refused as naming 'the same file /proc/4817/fd/1',
    and a stopped run's records 'went to /proc/4817/fd/5': names the user never typed."""
    from commbench.bench import records
    from commbench.bench.cli import _kept

    r, w = os.pipe()
    records.note_given_descriptors()
    try:
        path = records.output_path(f"/dev/fd/{w}")
        assert path == f"/proc/{os.getpid()}/fd/{w}"
        assert _kept(path, records.file_stamp(path)) == f"; each point went to /dev/fd/{w} as it finished"
        with pytest.raises(ValueError, match=f"^--json and --csv name the same file /dev/fd/{w}$"):
            records.check_distinct(json=path, csv=path)
        records.check_distinct(json=os.devnull, csv=os.devnull, plot=path)  # it keeps nothing to mix
        with pytest.raises(
            ValueError, match=f"^cannot plot to /dev/fd/{w}: it names a descriptor, not a file"
        ):
            records.check_outputs(plot=path)
    finally:
        os.close(r)
        os.close(w)
        records.note_given_descriptors()


def test_a_plot_through_a_link_to_a_descriptor_is_refused_in_the_words_given(tmp_path):
    """out.png linked to /dev/stdout was refused as 'cannot plot to out.png: ... (got no suffix)':
    the suffix was read off the /proc/PID/fd/1 it had become."""
    from commbench.bench import records

    link = tmp_path / "out.png"
    link.symlink_to("/dev/stdout")
    records.note_given_descriptors()
    try:
        path = records.output_path(str(link))
        with pytest.raises(
            ValueError, match=f"^cannot plot to {re.escape(str(link))}: it names a descriptor"
        ):
            records.check_outputs(plot=path)
        directory = os.open(tmp_path, os.O_RDONLY)
        try:  # a file in a directory this process holds open is a file
            assert not records.names_descriptor(f"/proc/{os.getpid()}/fd/{directory}/x.png")
        finally:
            os.close(directory)
    finally:
        records.note_given_descriptors()  # the link's name is not kept for later tests


def test_a_named_pipe_is_checked_without_ending_its_readers_input(tmp_path, monkeypatch):
    """Opened to write, a named pipe with no reader held the check for ever; with one, closing it
    gave the reader an end of file before the run had written anything. Now the check waits a
    while for a reader, then refuses; one that has a reader keeps it open until the process ends
    (no reader: rank 0 waited in its open, the others timed out in their first collective)."""
    from commbench.bench import records

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr(records, "FIFO_READER_WAIT_S", 0.2)
    with pytest.raises(ValueError, match="a named pipe that nothing opened to read in 0.2 s"):
        records.check_writable(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    held = list(records._HELD_FIFOS)
    try:
        records.check_writable(fifo)
        with pytest.raises(BlockingIOError):  # no data yet, and no end of file: a writer is held
            os.read(reader, 1)
    finally:
        for fd in set(records._HELD_FIFOS) - set(held):
            records._HELD_FIFOS.remove(fd)
            os.close(fd)
        assert os.read(reader, 1) == b""  # the end of file once the check's end is closed
        os.close(reader)


def test_the_interrupted_message_of_records_sent_to_a_pipe_claims_no_file():
    """--json /dev/stdout or >(jq .): a pipe's stamp does not move as points go through it, so a
    stopped run said "nothing had finished, ... is as it was before this run" (and without a
    stamp, reading the pipe back would wait for ever on the writer this process holds)."""
    from commbench.bench.cli import _kept
    from commbench.bench.records import file_stamp

    r, w = os.pipe()
    try:
        path = f"/proc/{os.getpid()}/fd/{w}"
        before = file_stamp(path)
        os.write(w, b'{"type": "sweep"}\n')
        assert _kept(path, before) == f"; each point went to {path} as it finished"
    finally:
        os.close(r)
        os.close(w)


def test_a_records_file_s_stamp_moves_with_its_modification_time_or_its_size_alone(tmp_path):
    """The stamp tells whether a run wrote its records file: a write that kept the size (a record
    rewritten) moved only the modification time, and a write within one clock tick only the size."""
    from commbench.bench.records import file_stamp

    path = tmp_path / "r.jsonl"
    path.write_text('{"type": "header"}\n')
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    before = file_stamp(path)
    os.utime(path, ns=(1_000_000_000, 1_000_000_001))  # one nanosecond later, the same bytes
    assert file_stamp(path) != before
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    assert file_stamp(path) == before
    with path.open("a") as f:
        f.write('{"type": "sweep"}\n')
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))  # more bytes, the same time
    assert file_stamp(path) != before and os.stat(path).st_ino == before[0]
    assert file_stamp(tmp_path / "missing.jsonl") is None and file_stamp(None) is None


def test_the_note_on_a_last_line_cut_short_counts_the_records_before_it_not_blank_lines():
    """The note says how many records were read: the blank line between them is no record, and
    the blank is kept in the lines, so that a message can name the line an editor shows."""
    from commbench.bench.records import complete_lines

    lines, note = complete_lines('{"a": 1}\n\n{"b": 2}\n{"c', "f.jsonl")
    assert lines == ['{"a": 1}', "", '{"b": 2}']
    assert note == (
        "commbench: f.jsonl: the last line is cut short (a write that did not finish); "
        "the 2 lines before it are read"
    )
    assert complete_lines('{"a": 1}\n\n{"b": 2}\n', "f.jsonl") == (['{"a": 1}', "", '{"b": 2}'], None)


def test_a_stop_before_the_run_writes_its_records_does_not_claim_an_earlier_runs_points(
    tmp_path, monkeypatch, capsys
):
    """The records file named by --json still holds an earlier run's points when the stop comes
    before rank 0 opens it: those are not this run's finished points."""
    from commbench.bench import cli

    old = tmp_path / "r.jsonl"
    old.write_text('{"type": "header"}\n{"type": "sweep"}\n')

    def stopped(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_sweep", stopped)
    assert main(["sweep", "--json", str(old)]) == 130
    err = capsys.readouterr().err
    assert err == f"commbench: interrupted; nothing had finished, {old} is as it was before this run\n"
    assert old.read_text() == '{"type": "header"}\n{"type": "sweep"}\n'


def test_a_stopped_cluster_does_not_claim_an_earlier_runs_points(tmp_path, monkeypatch, capsys):
    """The same for the cluster, whose records file its inner command names: the hosts are built
    (seconds) before any rank writes it."""
    from commbench.bench import cluster, netns

    old = tmp_path / "c.jsonl"
    old.write_text('{"type": "header"}\n{"type": "sweep"}\n')

    def stopped(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(netns, "check_privileges", lambda: None)
    monkeypatch.setattr(cluster, "run_hosts", stopped)
    assert main(["cluster", "--hosts", "2", "--", "sweep", "-e", "4K", "--json", str(old)]) == 130
    err = capsys.readouterr().err
    assert err == f"commbench: interrupted; nothing had finished, {old} is as it was before this run\n"


def test_a_path_behind_a_directory_without_access_is_one_line(monkeypatch, capsys):
    """As a user other than root, ``Path.is_dir`` itself raises on a directory that user cannot
    enter (root passes every permission check, so the error is put in its place here)."""
    from pathlib import PosixPath

    def refuse(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(PosixPath, "is_dir", refuse)
    assert main(["sweep", "--json", "/root/out.jsonl"]) == 2
    err = capsys.readouterr().err
    assert err == "commbench: error: cannot write /root/out.jsonl: Permission denied\n"


def test_a_file_system_error_no_check_foresaw_fails_the_run_in_one_line(monkeypatch, capsys):
    """Not the input's fault (the checks passed): exit 1, not 2."""
    from commbench.bench import starter

    def refused(*args):
        raise PermissionError(13, "Permission denied", "x")

    monkeypatch.setattr(starter, "start", lambda: None)
    monkeypatch.setattr(cli, "cmd_sweep", refused)
    assert main(["sweep", "-b", "1K", "-e", "1K"]) == 1
    assert capsys.readouterr().err == "commbench: error: [Errno 13] Permission denied: 'x'\n"


@pytest.mark.parametrize(
    "detail, bad_input, code",
    [
        ("ValueError: root 3 is not a rank", False, 2),
        ("TypeError: an integer is required", False, 2),
        ("RuntimeError: Connection closed by peer", False, 1),
        ("killed by signal 9", False, 1),
        ("refused its input", True, 2),
    ],
)
def test_a_failed_rank_exits_2_for_bad_input_and_1_otherwise(monkeypatch, capsys, detail, bad_input, code):
    """A rank that refused its input (its ValueError or TypeError, or one it marked so) is bad input,
    as the same refusal before the launch is; any other failure is a failed run."""
    from commbench.bench import launch, starter

    def failed(*args):
        raise launch.RankFailed(1, detail, bad_input=bad_input)

    monkeypatch.setattr(starter, "start", lambda: None)
    monkeypatch.setattr(launch, "run", failed)
    assert main(["sweep", "-b", "1K", "-e", "1K", "--world-size", "2", "--no-probe", "-q"]) == code
    assert capsys.readouterr().err == f"commbench: rank 1 failed: {detail}\n"


@pytest.mark.slow
def test_a_sweep_whose_reader_leaves_early_runs_to_the_end(tmp_path):
    """``commbench sweep ... | head -1``: the table stops, the run and its records do not."""
    path = tmp_path / "r.jsonl"
    argv = ["sweep", "-b", "1K", "-e", "64K", "-n", "2", "-w", "1", "--no-probe", "--json", str(path)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "commbench", *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with _kill_after(proc, 120):
        assert proc.stdout.readline().startswith("# commbench sweep: all_reduce, 2 ranks")
        proc.stdout.close()  # the reader leaves
        err = proc.stderr.read()
        assert proc.wait() == 0, err
    assert err == ""
    records = [json.loads(x) for x in path.read_text().splitlines()]
    assert sorted({r["size_bytes"] for r in records if r["type"] == "sweep"}) == [1024 << i for i in range(7)]


def test_a_rank_whose_launcher_is_gone_says_so_in_one_line(tmp_path):
    """RANK and WORLD_SIZE left in the environment (another job's launcher) make commbench one rank
    of a job that never comes: after --timeout, one line naming the variables, no traceback."""
    from tests.world import free_port

    port = free_port()
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    argv = ["sweep", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0", "-q", "--no-probe", "--timeout", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "commbench", *argv],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert done.stderr.startswith("commbench: rank 0 failed: could not join the group of WORLD_SIZE=2 at ")


def test_a_sweep_whose_buffers_exceed_the_memory_is_refused_before_any_rank(tmp_path, monkeypatch, capsys):
    """It ran the smaller sizes and then lost its ranks to a failed allocation or the OOM killer."""
    from commbench.bench import cli, launch

    class Memory:
        available = 16 << 30

    monkeypatch.setattr("psutil.virtual_memory", lambda: Memory())
    path = tmp_path / "r.jsonl"
    assert main(["sweep", "-b", "1M", "-e", "64G", "--world-size", "2", "--json", str(path)]) == 2
    # per rank at 64 GiB: builtin, naive, ring 2 x 64 GiB each, the limit 3 x 64, the check 48 MiB;
    # scratch: naive's 64 GiB at rank 0, the ring's 64 slots of 2 MiB at each rank
    assert capsys.readouterr().err == (
        "commbench: error: at 68719476736 bytes the sweep's buffers and scratch take at least "
        "1216.3 GiB over 2 rank(s) on this host, more than the 16.0 GiB of memory available; lower "
        "--maxbytes or run fewer algorithms\n"
    )
    assert not path.exists()
    # at 1 MiB with builtin and ring: 7 MiB of buffers, 12 MiB for the check and the ring's slots
    # (one of 512 KiB at 2 ranks, three of 256 KiB at 4) a rank
    Memory.available = 40 << 20
    config = cli.sweep_config(cli.build_parser().parse_args(["sweep", "-e", "1M", "-a", "builtin,ring"]))
    cli.check_sweep_memory(config, launch.LaunchSpec(world_size=2))
    with pytest.raises(
        ValueError, match=r"take at least 79\.0 MiB over 4 rank\(s\) on this host, more than the 40\.0 MiB"
    ):
        cli.check_sweep_memory(config, launch.LaunchSpec(world_size=4))
    # every emulated host of a cluster is a rank in this machine's memory (refused before it is built)
    assert main(["cluster", "--hosts", "4", "--", "sweep", "-e", "1M", "-a", "builtin,ring"]) == 2
    assert "over 4 rank(s) on this host" in capsys.readouterr().err
    # under torchrun the host's refusal waits for the join, where every rank says it
    monkeypatch.setattr(launch, "launched_externally", lambda: True)
    monkeypatch.setattr(launch, "local_ranks", lambda: 4)
    monkeypatch.setattr(launch, "_node_refusal", None)  # put back after the test
    held = []

    def join(*args):
        held.append(launch._node_refusal)
        raise ValueError("joined")

    monkeypatch.setattr(launch, "run", join)
    with pytest.raises(ValueError, match="joined"):
        cli.cmd_sweep(config, launch.LaunchSpec(world_size=4), None)
    assert "take at least 79.0 MiB over 4 rank(s) on this host" in held[0]
    # a cluster under an outer launcher still refuses before it is built: it joins no group
    monkeypatch.setattr(launch, "_node_refusal", None)
    assert main(["cluster", "--hosts", "4", "--", "sweep", "-e", "1M", "-a", "builtin,ring"]) == 2
    assert "over 4 rank(s) on this host" in capsys.readouterr().err and launch._node_refusal is None


@pytest.mark.parametrize(
    "env, local",
    [
        ({"LOCAL_WORLD_SIZE": "8"}, 8),
        ({"SLURM_NTASKS_PER_NODE": "4"}, 4),
        ({"SLURM_NTASKS_PER_NODE": "2(x3)"}, 2),
        ({"SLURM_NTASKS_PER_NODE": "?"}, 1),
        ({}, 1),
        # srun without --ntasks-per-node sets no SLURM_NTASKS_PER_NODE: each node's count is in the lists
        ({"SLURM_TASKS_PER_NODE": "2", "SLURM_NODEID": "0"}, 2),
        ({"SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "2"}, 2),
        ({"SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"}, 1),
        ({"SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "0"}, 3),
        ({"SLURM_TASKS_PER_NODE": "2(x3)", "SLURM_NODEID": "3", "SLURM_NTASKS_PER_NODE": "5"}, 5),
        ({"SLURM_TASKS_PER_NODE": "2(x", "SLURM_NODEID": "0"}, 1),
        ({"SLURM_TASKS_PER_NODE": "4"}, 1),  # no node id: not read
        ({"LOCAL_WORLD_SIZE": "8", "SLURM_TASKS_PER_NODE": "4", "SLURM_NODEID": "0"}, 8),
    ],
)
def test_the_ranks_sharing_a_host_under_torchrun_or_slurm(env, local, monkeypatch):
    from commbench.bench import launch

    for name in (
        "LOCAL_WORLD_SIZE",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_TASKS_PER_NODE",
        "SLURM_STEP_TASKS_PER_NODE",
        "SLURM_NODEID",
    ):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launch.local_ranks() == local


def test_no_fork_server_is_started_for_ranks_that_will_be_spawned(monkeypatch):
    from commbench.bench import cli, starter

    started = []
    monkeypatch.setattr(starter, "start", lambda: started.append(True))
    monkeypatch.setattr(starter, "launched_externally", lambda: False)
    many = str(starter.FORKSERVER_MAX_RANKS + 1)
    for argv in (["sweep", "--world-size", many], ["train", f"--world-size={many}"]):
        cli._start_rank_server(argv)
    assert started == []
    for argv in (["sweep"], ["sweep", "--world-size", "4"], ["sweep", "--world-size", "x"]):
        cli._start_rank_server(argv)
    assert started == [True] * 3


@pytest.mark.parametrize("command", ["summary", "report"])
def test_a_last_line_cut_short_leaves_the_records_before_it_readable(command, tmp_path, capsys):
    """A run killed, or a disk filled, in the middle of writing a record leaves half a line at the
    end: the finished points before it are still read, and a line says what was left out."""
    whole = _send_recv_lines({1024: 0.5, 2048: 0.5})
    cut = tmp_path / "cut\nshort.jsonl"  # a name with a line break: the note stays one line
    cut.write_text(whole + whole.splitlines()[1][:40])
    extra = ["-o", str(tmp_path / "out")] if command == "report" else []
    assert main([command, *extra, str(cut)]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "cut\\nshort.jsonl: the last line is cut short" in captured.err
    if command == "summary":
        assert "| 1024 | p2p | 0.500 |" in captured.out and "| 2048 | p2p | 0.500 |" in captured.out
    broken = tmp_path / "broken.jsonl"  # a bad line with finished lines after it is an error
    broken.write_text(whole.splitlines()[1][:40] + "\n" + whole)
    assert main([command, *extra, str(broken)]) == 2
    assert "not JSON Lines" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["summary", "report"])
@pytest.mark.parametrize("where", ["last", "before the last"])
def test_a_value_nested_too_deeply_to_parse_is_one_line_and_exit_2(command, where, tmp_path, capsys):
    """Python's parser raised RecursionError on it: a traceback, exit 1."""
    whole = _send_recv_lines({1024: 0.5})
    deep = "[" * 100_000 + "]" * 100_000
    path = tmp_path / "deep.jsonl"
    path.write_text(whole + deep + "\n" if where == "last" else deep + "\n" + whole)
    extra = ["-o", str(tmp_path / "out")] if command == "report" else []
    assert main([command, *extra, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nested too deeply to read" in err and "Traceback" not in err


def test_a_local_world_too_big_to_start_is_refused_before_the_sweep_is_sized(monkeypatch, capsys):
    """The sweep's memory check made lists of one entry per rank first: 11 GB in 20 s for 10**11."""
    from commbench.bench import cli, starter

    monkeypatch.setattr(starter, "launched_externally", lambda: False)
    monkeypatch.setattr(cli, "check_sweep_memory", lambda *a, **k: pytest.fail("sized the sweep first"))
    for command in ("sweep", "train"):
        assert main([command, "--world-size", "99999999999"]) == 2
        err = capsys.readouterr().err
        assert (
            "99999999999 local ranks are more than the fork server can start" in err and err.count("\n") == 1
        )


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "5", "WORLD_SIZE": "2"}, "$RANK=5 from the launcher is not a rank of $WORLD_SIZE=2"),
        ({"RANK": "-1", "WORLD_SIZE": "1"}, "$RANK=-1 from the launcher is not a rank of $WORLD_SIZE=1"),
        ({"RANK": "abc", "WORLD_SIZE": "2"}, "$RANK='abc' from the launcher is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, "$WORLD_SIZE='two' from the launcher is not an integer"),
        (
            {"RANK": "0", "WORLD_SIZE": "0"},
            "$WORLD_SIZE=0 from the launcher: a world needs at least one rank",
        ),
        (
            {"SLURM_PROCID": "3", "SLURM_NTASKS": "2", "MASTER_ADDR": "127.0.0.1"},
            "$SLURM_PROCID=3 from the launcher is not a rank of $SLURM_NTASKS=2",
        ),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "$RANK=2 from the launcher is not a rank of $WORLD_SIZE=2"),
        (
            {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "abc"},
            "$MASTER_PORT='abc' from the launcher is not a TCP port (1 to 65535)",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"},
            "$MASTER_PORT='70000' from the launcher is not a TCP port (1 to 65535)",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "0"},
            "$MASTER_PORT='0' from the launcher is not a TCP port (1 to 65535)",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "65536"},
            "$MASTER_PORT='65536' from the launcher is not a TCP port (1 to 65535)",
        ),
    ],
)
def test_a_launcher_s_rank_outside_its_world_is_one_line_and_exit_2(monkeypatch, capsys, env, message):
    """RANK=5 of 2 failed inside gloo with a traceback, and its peers waited out the timeout;
    MASTER_PORT=abc failed in torch with "invalid literal for int()", naming no variable."""
    from commbench.bench import launch

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch, "run", lambda *a: pytest.fail("joined a group"))
    assert main(["sweep", "-b", "1K", "-e", "1K"]) == 2
    assert capsys.readouterr().err == f"commbench: error: {message}\n"


@pytest.mark.parametrize("port", ["1", "65535"])
def test_a_launcher_s_port_at_either_end_of_the_range_is_taken(monkeypatch, port):
    for name in ("SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": port}.items():
        monkeypatch.setenv(name, value)
    assert cli.external_rank_and_world() == (1, 2)


def test_the_demo_under_a_launcher_is_refused(monkeypatch, capsys, tmp_path):
    """Each torchrun rank started a demo of its own, and all wrote results/demo.jsonl at once."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["demo", "-q"]) == 2
    assert "commbench demo starts its own two ranks" in capsys.readouterr().err
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize(
    "argv, said",
    [
        (["bandwidth", "--size", "4K", "--iters", "1", "--json", "bw.jsonl"], "runs in one process"),
        (["profile", "-o", "prof", "--", "sweep", "-b", "1K", "-e", "1K"], "starts the command it profiles"),
    ],
    ids=["bandwidth", "profile"],
)
def test_one_process_commands_under_a_launcher_are_refused(monkeypatch, capsys, tmp_path, argv, said):
    """Under torchrun, bandwidth measured in every rank, each writing the one --json file; profile
    saw no rank and every rank wrote the one directory's summary."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err and "run it without the launcher" in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_plot_format_that_needs_latex_is_refused_before_the_run():
    """--plot out.pgf ran the whole sweep, then failed without xelatex (exit 1)."""
    from commbench.bench.records import check_outputs

    with pytest.raises(ValueError, match=r"cannot plot to r\.pgf: the name must end in one of"):
        check_outputs(plot="r.pgf", writes=False)


def test_a_plot_that_fails_after_the_sweep_is_a_note_not_a_failed_run(tmp_path, monkeypatch, capsys):
    """The measurements are written before the plot is drawn: a plot that fails costs the plot only."""
    import torch.distributed as dist

    from commbench.bench import cli, report
    from commbench.bench.sweep import SweepConfig

    def fails(*args, **kwargs):
        raise RuntimeError("latex was not able to process the following string:\nb'lp'")

    monkeypatch.setattr(report, "plot_busbw", fails)
    out = tmp_path / "r.jsonl"
    config = SweepConfig(
        algorithms=("builtin",), min_bytes=1024, max_bytes=1024, iters=1, warmup=1, probe=False, limit=False,
        json_path=str(out), quiet=True,
    )  # fmt: skip
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        rows = cli._sweep_rank(config, "cpu", str(tmp_path / "busbw.png"))
    finally:
        dist.destroy_process_group()
    assert [r["algorithm"] for r in rows] == ["builtin"]
    assert [json.loads(line)["type"] for line in out.read_text().splitlines()] == ["header", "sweep"]
    plot = tmp_path / "busbw.png"
    assert capsys.readouterr().err == (
        f"commbench: plot {plot} not written: latex was not able to process the following string:\n"
    )


@pytest.mark.slow
def test_records_named_by_one_of_the_commands_file_descriptors_reach_it(tmp_path):
    """``--json /dev/fd/N`` (what a shell's ``>(jq .)`` passes): rank 0 writes the records, and it
    holds none of the command's descriptors past 0-2, so it opened its own fd N; a missing one or a
    socket failed the run once it had started, another took the records and the file stayed empty."""
    paths = tmp_path / "r.jsonl", tmp_path / "r.csv"
    with open(paths[0], "w") as records, open(paths[1], "w") as table:
        fds = records.fileno(), table.fileno()
        argv = [sys.executable, "-m", "commbench", "sweep", "-b", "4K", "-e", "4K", *SMALL, "--no-probe",
                "-q", "--json", f"/dev/fd/{fds[0]}", "--csv", f"/dev/fd/{fds[1]}"]  # fmt: skip
        done = subprocess.run(
            argv, cwd=recorded.ROOT, pass_fds=fds, capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 0, done.stderr
    kinds = [json.loads(line)["type"] for line in paths[0].read_text().splitlines()]
    assert kinds == ["header"] + ["sweep"] * 4
    assert paths[1].read_text().startswith("collective,") and len(paths[1].read_text().splitlines()) == 5


@pytest.mark.parametrize("host, code", [(False, 1), (True, 0)], ids=["alone", "a-cluster-s-host"])
def test_a_sweep_whose_check_finds_wrong_elements_fails_as_nccl_tests_does(
    tmp_path, monkeypatch, capsys, host, code
):
    """#wrong was a column and no more: the sweep exited 0, so a script, or a study's report, took a
    broken collective for a measured one (nccl-tests exits with a failure on any wrong value). A
    cluster's host says so and exits 0: the cluster reads the wrong points and fails the run."""
    import torch.distributed as dist

    from commbench.bench import cluster, launch
    from commbench.bench.collectives import AllReduce

    monkeypatch.delenv(cluster.COMMAND_ENV, raising=False)
    if host:
        monkeypatch.setenv(cluster.HOST_ENV, "1")
    else:
        monkeypatch.delenv(cluster.HOST_ENV, raising=False)

    monkeypatch.setattr(AllReduce, "wrong", lambda self, b, op, rank, world, root: 3)

    def in_this_process(fn, args, spec):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        try:
            return {0: fn(*args)}
        finally:
            dist.destroy_process_group()

    monkeypatch.setattr(launch, "run", in_this_process)
    out = tmp_path / "r.jsonl"
    argv = ["sweep", "-b", "1K", "-e", "2K", "-n", "1", "-w", "0", "-a", "builtin,ring", "--no-probe", "-q",
            "--world-size", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == code
    assert capsys.readouterr().err == (
        "commbench: wrong results in 4 of 6 points (elements over all ranks that differ from the closed "
        "form): all_reduce builtin at 1024 B (3), all_reduce ring at 1024 B (3), all_reduce builtin at "
        "2048 B (3) and 1 more\n"
    )
    records = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    assert [r["wrong"] for r in records] == [3, 3, 0] * 2  # every point is kept, the limit's right


def _point(size_bytes: int, wrong: int) -> dict:
    return {"collective": "all_reduce", "algorithm": "ring", "size_bytes": size_bytes, "wrong": wrong}


@pytest.mark.parametrize(
    "wrong, ends",
    [
        ([0, 0], None),
        ([1, 2, 3, 0], "in 3 of 4 points (elements over all ranks that differ from the closed form): "
         "all_reduce ring at 1 B (1), all_reduce ring at 2 B (2), all_reduce ring at 3 B (3)"),
        ([1, 2, 3, 4], "in 4 of 4 points (elements over all ranks that differ from the closed form): "
         "all_reduce ring at 1 B (1), all_reduce ring at 2 B (2), all_reduce ring at 3 B (3) and 1 more"),
    ],
    ids=["none", "three", "four"],
)  # fmt: skip
def test_the_wrong_results_line_names_three_points_and_counts_the_rest(wrong, ends):
    said = cli.wrong_results([_point(size, w) for size, w in enumerate(wrong, start=1)])
    assert said == (None if ends is None else f"wrong results {ends}")


def test_every_option_with_a_default_names_it_in_its_help():
    """-b, -e, -f, -r, -d, -o, --collective and --device gave no default in sweep --help (nccl-tests
    prints its own); a new option would slip the same way."""
    import argparse

    from commbench.bench.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    silent = [
        f"{name} {action.option_strings[0]}"
        for name, command in commands.items()
        for action in command._actions
        if action.option_strings
        # by identity: 0 == False, and "not in (None, False, ...)" passed over every default of 0
        and not any(action.default is empty for empty in (None, False, argparse.SUPPRESS))
        and action.default != []
        and "default" not in (action.help or "")
    ]
    assert silent == []


def test_a_working_directory_deleted_before_the_start_is_one_line(tmp_path):
    """A sweep printed a traceback from the fork server's os.getcwd(), and --help torch's
    'oneMKL FATAL ERROR: Cannot load libtorch_cpu.so'."""
    gone = tmp_path / "gone"
    for argv in (["sweep", "--world-size", "2", "-e", "8K", "-q"], ["--help"]):
        gone.mkdir()
        script = (
            f'cd {shlex.quote(str(gone))} && rmdir {shlex.quote(str(gone))} && exec "$0" -m commbench "$@"'
        )
        out = subprocess.run(
            ["sh", "-c", script, sys.executable, *argv],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=60,
        )
        assert (out.returncode, out.stdout) == (2, ""), out.stderr
        assert out.stderr == "commbench: error: the working directory no longer exists; cd to one that does\n"


def test_a_broadcast_sweeps_root_is_part_of_what_it_is(tmp_path, capsys):
    """A broadcast from root 1 is another sweep than one from root 0: --across refuses to pool them
    and says which holds root 1, and a summary's heading names the root."""
    runs = []
    for root in (0, 1):
        path = _run_file(tmp_path / f"root{root}.jsonl", 4, {1024: 1.0})
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text(
            "".join(
                json.dumps({**r, "collective": "broadcast", "root": root} if r["type"] == "sweep" else r)
                + "\n"
                for r in rows
            )
        )
        runs.append(str(path))
    assert main(["summary", "--across", *runs]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert "runs of one sweep" in err and "broadcast, 4 ranks, gloo, float32, root 1" in err, err
    assert err.count("root") == 1, err  # root 0 is not said
    assert main(["summary", runs[1]]) == 0
    heading = capsys.readouterr().out.splitlines()[0]
    assert heading == f"### {runs[1]}: broadcast, 4 ranks, gloo, float32, root 1", heading
