"""``commbench bandwidth`` through the CLI's main: a table on CPU with the limit explained,
JSON Lines out (each kind as it is measured, so a stopped run keeps the finished ones), one-line
errors with exit 2 for bad input; on CUDA the five copies."""

from __future__ import annotations

import os
import shlex
import signal
from collections.abc import Callable

import pytest

from commbench.bench import bandwidth
from commbench.bench.bandwidth import BandwidthRecord, expected_gbps, format_table
from commbench.bench.cli import build_parser, main
from commbench.bench.records import read_jsonl
from commbench.kernels.copy import D2H_PAGEABLE, D2H_PINNED, H2D_PAGEABLE, H2D_PINNED, CopyResult


def test_cpu_table_and_json(tmp_path, capsys):
    out = tmp_path / "bw.jsonl"
    assert main(["bandwidth", "--size", "256K", "--iters", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "host->host" in text and "measured_GB/s" in text and "limit_GB/s" in text
    assert "n/a" in text and "limit n/a on CPU" in text
    header, record = read_jsonl(out)
    assert header["type"] == "header" and "hostname" in header
    assert record["type"] == "bandwidth" and record["size_bytes"] == 256 << 10 and record["iters"] == 2
    assert record["limit_gbps"] is None and record["gbps"] > 0


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["bandwidth", "--size", "12T"], "not a size"),
        (["bandwidth", "--size", "0"], "at least 1 byte"),
        (["bandwidth", "--iters", "0"], "--iters"),
        (["bandwidth", "--size", "1", "--iters", "99999999999999999999999"], "--iters must be in 1..1000000"),
        (["bandwidth", "--device", "tpu"], "invalid choice"),
        (["bandwidth", "--json", "/nonexistent-dir/bw.jsonl"], "cannot write"),
        (["bandwidth", "--size", "1000000G"], "do not fit"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message where CUDA is absent")
def test_cuda_without_cuda_is_bad_input(capsys):
    assert main(["bandwidth", "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_expected_is_for_pinned_pcie_copies_only():
    """Pinned copies either way are expected at 85% of the link (README); pageable ones, and a
    pinned one whose link is unknown, have no expectation."""
    for name in (H2D_PINNED, D2H_PINNED):
        pinned = CopyResult(name=name, size_bytes=1, time_s=1.0, gbps=1.0, limit_gbps=31.5)
        assert expected_gbps(pinned) == pytest.approx(31.5 * 0.85), name
        unknown = CopyResult(name=name, size_bytes=1, time_s=1.0, gbps=1.0, limit_gbps=None)
        assert expected_gbps(unknown) is None, name
    for name in (H2D_PAGEABLE, D2H_PAGEABLE):
        pageable = CopyResult(name=name, size_bytes=1, time_s=1.0, gbps=1.0, limit_gbps=31.5)
        assert expected_gbps(pageable) is None, name


def test_table_says_na_for_unknowns():
    rec = BandwidthRecord(
        device="cpu",
        name="host->host",
        size_bytes=1 << 20,
        iters=1,
        time_s=1e-3,
        gbps=1.048576,
        expected_gbps=None,
        limit_gbps=None,
        limit_source=None,
    )
    lines = format_table([rec]).splitlines()
    assert lines[1].split()[-2:] == ["n/a", "n/a"] and "1.05" in lines[1] and "1M" in lines[1]
    # the time column is in microseconds: 1 ms is 1000.0
    assert lines[0].split()[2] == "time_us" and lines[1].split()[2] == "1000.0"


@pytest.mark.gpu
def test_cuda_bandwidth_end_to_end(tmp_path, capsys):
    out = tmp_path / "bw.jsonl"
    code = main(["bandwidth", "--device", "cuda", "--size", "32M", "--iters", "3", "--json", str(out)])
    text = capsys.readouterr()
    assert code == 0, text.err
    records = [r for r in read_jsonl(out) if r["type"] == "bandwidth"]
    assert len(records) == 5
    pinned = next(r for r in records if r["name"] == H2D_PINNED)
    if pinned["limit_gbps"] is not None:  # NVML present: PCIe gen x width
        assert "PCIe gen" in pinned["limit_source"] and pinned["gbps"] <= pinned["limit_gbps"] * 1.05


def _kinds_then(stop: Callable[[], None], kinds: int):
    """An each_copy that measures ``kinds`` kinds, then calls ``stop`` (a signal, an error)."""

    def measure(size_bytes, device, **kwargs):
        for i in range(kinds):
            yield CopyResult(name=f"kind{i}", size_bytes=size_bytes, time_s=1e-3, gbps=1.0, limit_gbps=None)
        stop()

    return measure


def _ctrl_c() -> None:
    raise KeyboardInterrupt


def _sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def _sighup() -> None:  # a closed terminal
    os.kill(os.getpid(), signal.SIGHUP)


@pytest.mark.parametrize("kinds", [0, 1, 2])
@pytest.mark.parametrize(
    "stop, code", [(_ctrl_c, 130), (_sigterm, 143), (_sighup, 129)], ids=["sigint", "sigterm", "sighup"]
)
def test_a_stopped_run_keeps_the_header_and_the_finished_kinds(
    tmp_path, capsys, monkeypatch, stop, code, kinds
):
    def fail(signum, frame):
        raise AssertionError(f"signal {signum} reached the test's own handler")

    monkeypatch.setattr(bandwidth, "each_copy", _kinds_then(stop, kinds))
    out = tmp_path / "bw.jsonl"
    before = {s: signal.signal(s, fail) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        assert main(["bandwidth", "--size", "4K", "--json", str(out)]) == code
        for s in before:
            assert signal.getsignal(s) is fail  # the old handlers are back
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    printed = capsys.readouterr()
    err = printed.err
    assert err.count("\n") == 1 and err.startswith("commbench: interrupted") and str(out) in err
    # the finished kinds are shown too (without --json, only there)
    assert [f"kind{i}" in printed.out for i in range(kinds + 1)] == [True] * kinds + [False]
    header, *records = read_jsonl(out)
    assert header["type"] == "header" and [r["name"] for r in records] == [f"kind{i}" for i in range(kinds)]
    # the command main was handed, not pytest's own
    assert header["command"] == f"commbench bandwidth --size 4K --json {shlex.quote(str(out))}"


def test_an_error_after_the_first_kind_leaves_it_in_the_file(tmp_path, monkeypatch):
    def broken() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(bandwidth, "each_copy", _kinds_then(broken, 1))
    out = tmp_path / "bw.jsonl"
    with pytest.raises(RuntimeError, match="illegal memory access"):
        bandwidth.run(build_parser().parse_args(["bandwidth", "--size", "4K", "--json", str(out)]))
    header, record = read_jsonl(out)
    assert header["type"] == "header" and record["name"] == "kind0" and record["size_bytes"] == 4096


def test_an_impossible_reading_after_a_kind_still_shows_that_kind(capsys, monkeypatch):
    """A kind faster than its link ended the run before the table: the kinds measured before it,
    with no --json, were lost."""

    def measure(size_bytes, device, **kwargs):
        yield CopyResult(name="sound", size_bytes=size_bytes, time_s=1e-3, gbps=0.001, limit_gbps=None)
        yield CopyResult(name="too fast", size_bytes=size_bytes, time_s=1e-9, gbps=1e3, limit_gbps=1.0)

    monkeypatch.setattr(bandwidth, "each_copy", measure)
    assert main(["bandwidth", "--size", "1K"]) == 1
    printed = capsys.readouterr()
    assert "sound" in printed.out and "too fast" not in printed.out
    assert printed.err.count("\n") == 1 and printed.err.startswith("commbench: impossible reading")


def test_help_names_the_copies_each_device_measures(capsys):
    """The command list said "host, and host<->device on CUDA": a CUDA run has no host->host copy, and
    its device->device copy went unmentioned."""
    with pytest.raises(SystemExit):
        main(["--help"])
    summary = " ".join(capsys.readouterr().out.split())
    assert "host memory on CPU; host<->device (pinned, pageable) and device->device on CUDA" in summary
    with pytest.raises(SystemExit):
        main(["bandwidth", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "On CPU: host->host" in text and "and device->device" in text and "counted once" in text
