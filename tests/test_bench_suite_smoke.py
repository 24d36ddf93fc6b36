"""The pytest-benchmark suite runs (one size, one round), so it cannot rot between `make bench` runs.

It runs with a launcher's variables set, and with profiling on, in loops of two: pytest-benchmark
then calls each collective once more after its rounds and once with no setup before it, which the
other ranks must follow too."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# As pytest run by torchrun sees; the benchmark world's ranks are its own, not that job's (before,
# they waited 120 s for a group at MASTER_ADDR, then failed).
LAUNCHED = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}
SUITE = ["tests/bench_suite", "-m", "benchmark_suite"]


def _pytest(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """pytest on ``args`` in a process of its own, quiet, with ``env`` added to ours."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
    )


def test_benchmark_suite_smoke(tmp_path):
    """Also what a saved run says: the world's size in each name, group and extra_info, the rounds
    run, and a machine_info that two runs on one machine share (the command line and the commit
    in it made every --benchmark-compare warn that the machine differed), with the threads each
    rank of the world runs (the pytest process's own count was recorded)."""
    profiled = ["--benchmark-cprofile=cumtime", "--benchmark-cprofile-loops=2", "--benchmark-cprofile-top=1"]
    saved = tmp_path / "saved.json"
    out = _pytest(
        [*SUITE, "--benchmark-columns=median,rounds", *profiled, f"--benchmark-json={saved}"],
        {**LAUNCHED, "COMMBENCH_BENCH_SMOKE": "1"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "failed" not in out.stdout.splitlines()[-1]
    assert "passed" in out.stdout.splitlines()[-1]
    run = json.loads(saved.read_text())
    info = run["machine_info"]["commbench"]
    assert info["world_size"] == 2 and info["torch_threads"] == 1
    assert not {"command", "commbench", "commit", "commit_modified"} & set(info), sorted(info)
    benchmarks = run["benchmarks"]
    assert len(benchmarks) > 40
    for b in benchmarks:
        assert b["name"].endswith("-64K-2ranks]") and b["group"].endswith(" 64K, 2 ranks"), b["name"]
        assert b["extra_info"]["world_size"] == 2, b["name"]
        assert (b["extra_info"]["rounds"], b["extra_info"]["warmup_rounds"]) == (1, 0)
        assert b["stats"]["rounds"] == 1


@pytest.mark.slow  # a launch of its own (12 s); make test keeps the two-rank smoke (CI's ten minutes)
def test_the_suite_at_three_ranks_tells_the_neighbours_apart():
    """At two ranks the left and the right neighbour are one rank: a send/recv that went the wrong
    way round would pass there. At three it is wrong on every rank."""
    out = _pytest([*SUITE, "-k", "sendrecv"], {"COMMBENCH_BENCH_SMOKE": "1", "COMMBENCH_BENCH_WORLD": "3"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = out.stdout.splitlines()[-1]
    assert "failed" not in last and re.match(r"1 passed\b", last), last


@pytest.mark.slow
def test_a_failed_benchmark_leaves_the_next_one_running(tmp_path):
    """Rank 0 failing between calls once left the other ranks repeating that benchmark, and the next
    one met its calls (a hang, then "Connection closed by peer"; in gloo, an abort of the pytest
    process). A failure inside a call, where the others may be in it still, ends the world: the
    benchmarks after it are skipped, saying why. Each file starts its own world."""
    report, saved = tmp_path / "report.xml", tmp_path / "saved.json"
    scenarios = ["tests/bench_suite/failing_scenarios.py", "tests/bench_suite/failing_out_of_step.py"]
    out = _pytest(
        [*scenarios, f"--junitxml={report}", f"--benchmark-json={saved}"], {"COMMBENCH_BENCH_SMOKE": "1"}
    )
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]  # tests failed; nothing aborted
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        found = [child for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name")] = (
            (found[0].tag, found[0].get("message") + (found[0].text or "")) if found else ("passed", None)
        )
    assert outcomes["test_wrong_result"][0] == "failure"
    assert "wrong elements on each rank: {0: 0, 1: 7}" in outcomes["test_wrong_result"][1]
    assert outcomes["test_fails_between_calls"][0] == "failure"
    assert outcomes["test_runs_after_a_failure_between_calls"] == ("passed", None), out.stdout[-3000:]
    assert outcomes["test_fails_inside_a_call"][0] == "failure"
    kind, message = outcomes["test_skipped_after_a_failure_inside_a_call"]
    assert kind == "skipped", out.stdout[-3000:]
    assert "failed inside a call: RuntimeError: injected" in message, message
    # "done" lost: rank 0 asks for the next benchmark while the others repeat the last; they stop
    assert outcomes["test_done_is_lost"] == ("passed", None)
    kind, message = outcomes["test_the_next_benchmark_fails"]
    assert kind == "failure" and "repeats benchmark 1, but rank 0 asks for benchmark 2" in message, message
    assert outcomes["test_skipped_after_it"][0] == "skipped"
    # only what passed is saved: pytest-benchmark's own has_error covers only a timed call that raised
    names = {b["name"] for b in json.loads(saved.read_text())["benchmarks"]}
    assert names == {"test_runs_after_a_failure_between_calls"}, names


@pytest.mark.slow
@pytest.mark.parametrize("world", ["1", "two"])
def test_a_world_below_two_ranks_is_refused_in_one_line(world):
    """Before, every benchmark errored with the launcher's 'world size must be >= 1, got 0'."""
    out = _pytest(SUITE, {"COMMBENCH_BENCH_WORLD": world}, timeout=120)
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert "COMMBENCH_BENCH_WORLD must be a whole number of ranks >= 2" in out.stdout
    assert f"got {world!r}" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr


@pytest.mark.slow  # a launch of its own and a stop (about 15 s)
def test_a_ctrl_c_sent_to_pytest_alone_ends_the_suite_in_seconds():
    """A Ctrl-C sent to the pytest process alone (an IDE's stop button, `timeout -s INT`) broke rank
    0's group while the other rank waited in a collective on rank 0, which the traceback kept
    open: pytest, its forkserver and the rank stayed 132 s, until the group's timeout."""
    import signal
    import time

    import psutil

    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", *SUITE, "-q", "-p", "no:cacheprovider", "-k", "all_reduce-ring"]
        + ["--benchmark-min-rounds=1000000", "--benchmark-disable-gc"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        top, deadline = psutil.Process(proc.pid), time.monotonic() + 120
        while not [c for c in top.children(recursive=True) if c.name().startswith("commbench-r")]:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        time.sleep(3)  # the rounds under way
        children = top.children(recursive=True)
        stopped = time.monotonic()
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=60)[0]
        took = time.monotonic() - stopped
        assert took < 40, (took, output[-3000:])
        assert "KeyboardInterrupt" in output, output[-3000:]
        _, alive = psutil.wait_procs(children, timeout=20)
        assert alive == [], [p.name() for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
