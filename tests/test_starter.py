"""The fork server that starts local ranks, and the launcher's side of it (commbench.bench.starter)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

import psutil
import pytest

from commbench.bench import starter

ROOT = Path(__file__).resolve().parents[1]

SERVER_READY = """
import sys
from commbench.bench import starter

starter.ready()
print(starter._server_pid(), flush=True)
sys.stdin.read()  # the server lives until this process ends
"""


@contextlib.contextmanager
def _launcher(code: str, *args: str, **popen: Any) -> Iterator[str]:
    """``code`` run by a fresh interpreter until the block ends (it should read its standard input
    to the end); yields the first line it prints. Its children (the fork server, multiprocessing's
    resource tracker) must have ended with it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **popen
    )
    started = []
    try:
        line = proc.stdout.readline()
        if line:
            started = psutil.Process(proc.pid).children(recursive=True)
        yield line
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
        proc.stdout.close()
    _, alive = psutil.wait_procs(started, timeout=60)
    assert alive == []


def _signal_sets(pid: int) -> dict[str, set[int]]:
    """SigIgn, SigBlk and the other signal sets of ``pid``'s main thread, from /proc (psutil has none)."""
    sets = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name.startswith("Sig") and name != "SigQ":
            bits = int(value, 16)
            sets[name] = {s for s in range(1, 65) if bits >> (s - 1) & 1}
    return sets


def test_the_ready_fork_server_holds_the_stops_blocked_and_a_closed_terminal_not_ignored():
    """The server starts with SIGHUP ignored (for the resource tracker started beside it): left so,
    a rank it forks would ignore a closed terminal too. Once its imports are done it holds SIGINT,
    SIGHUP and SIGTERM blocked, so that a stop sent to the whole group does not end it before its
    ranks (the launcher then took the server's closed pipes for its ranks' ends)."""
    with _launcher(SERVER_READY, cwd=ROOT) as line:
        assert line.strip().isdigit(), "no server"
        sets = _signal_sets(int(line))
    assert signal.SIGHUP not in sets["SigIgn"]
    assert {signal.SIGINT, signal.SIGHUP, signal.SIGTERM} <= sets["SigBlk"]


CTRL_C_WHILE_IMPORTING = """
import os, signal, sys, time
from pathlib import Path
from commbench.bench import starter

mark = Path(sys.argv[1])
starter.PRELOAD = ("commbench.bench.rankhost", "stuck_import")
starter.start()
pid = starter._server_pid()
deadline = time.monotonic() + 60
while not mark.exists() and time.monotonic() < deadline:
    time.sleep(0.01)
os.kill(pid, signal.SIGINT)
deadline = time.monotonic() + 10
while not starter.server_gone() and time.monotonic() < deadline:
    time.sleep(0.01)
gone = starter.server_gone()
os.kill(pid, signal.SIGKILL)  # where the Ctrl-C did not end it
os.waitpid(pid, 0)
print(mark.exists(), gone, flush=True)
sys.stdin.read()
"""


def test_a_ctrl_c_while_the_fork_server_imports_ends_it(tmp_path):
    """The server starts with Ctrl-C ignored and ignores it again once its imports are done; in
    between (torch loading, seconds) a Ctrl-C must end it, or it went on importing for nothing."""
    mark = tmp_path / "importing"
    (tmp_path / "stuck_import.py").write_text(
        f"import pathlib, time\npathlib.Path({str(mark)!r}).write_text('')\ntime.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(tmp_path)))}
    with _launcher(CTRL_C_WHILE_IMPORTING, str(mark), cwd=tmp_path, env=env) as line:
        assert line == "True True\n"


def test_ranks_are_forked_up_to_what_one_request_to_the_server_can_carry_and_spawned_above():
    """The request for each rank carries two descriptors per local rank: from 125 local ranks on, a
    launch from the fork server failed with "too many fds" (Python's MAXFDS_TO_SEND is 256)."""
    assert starter.FORKSERVER_MAX_RANKS == (forkserver.MAXFDS_TO_SEND - 4) // 2 - 4
    assert starter.start_method(1) == starter.start_method(starter.FORKSERVER_MAX_RANKS) == "forkserver"
    assert starter.start_method(starter.FORKSERVER_MAX_RANKS + 1) == "spawn"
    assert starter.start_method(125) == "spawn"


@pytest.mark.parametrize(
    "variables, external",
    [
        ({"RANK": "0", "WORLD_SIZE": "4"}, True),
        ({"RANK": "0"}, False),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, False),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "MASTER_ADDR": "node1"}, True),
    ],
    ids=["torchrun", "rank-alone", "sbatch-shell", "slurm-task"],
)
def test_a_process_is_a_rank_of_a_job_only_where_its_launcher_said_so(monkeypatch, variables, external):
    """An sbatch script's own shell has SLURM_PROCID and SLURM_NTASKS too: without MASTER_ADDR it
    is no rank, and commbench launches its own; a RANK left set alone makes no world either."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert starter.launched_externally() is external


def _pretend_server(monkeypatch, server: subprocess.Popen, probe) -> list[tuple[int, int]]:
    """``ready`` aimed at ``server`` as a fork server not yet known ready, with ``probe`` as its
    readiness probe and a floor of 1 s; returns the list of the kills it asks for (none is sent)."""
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(starter, "_ready", set())
    monkeypatch.setattr(starter, "READY_MIN_S", 1.0)
    monkeypatch.setattr(starter, "start", lambda: None)
    monkeypatch.setattr(starter, "_server_pid", lambda: server.pid)
    monkeypatch.setattr(starter, "_probe", probe)
    monkeypatch.setattr(starter.os, "kill", lambda pid, signum: killed.append((pid, signum)))
    return killed


def test_a_short_timeout_still_waits_the_floor_for_the_servers_imports():
    """A server importing torch for longer than a short --timeout was killed and the launch failed:
    the wait is at least READY_MIN_S whatever the timeout."""
    server = subprocess.Popen(["sleep", "600"])
    try:
        with pytest.MonkeyPatch.context() as m:
            killed = _pretend_server(m, server, lambda failed: time.sleep(0.3))
            starter.ready(0.05)
            assert killed == []
            assert server.pid in starter._ready
    finally:
        server.kill()
        server.wait()


def test_a_server_that_cannot_start_a_process_is_named_and_not_taken_for_ready():
    """The probe's error is the launch's one line; a server taken for ready would be sent every
    later launch's ranks."""
    server = subprocess.Popen(["sleep", "600"])
    try:
        with pytest.MonkeyPatch.context() as m:
            killed = _pretend_server(m, server, lambda failed: failed.append(OSError("boom")))
            message = (
                f"the fork server that starts the ranks \\(pid {server.pid}\\) could not start a process: "
            )
            with pytest.raises(starter.ServerNotReady, match=message + "OSError: boom$"):
                starter.ready(0.05)
            assert killed == []
            assert server.pid not in starter._ready
    finally:
        server.kill()
        server.wait()


def test_a_server_that_has_ended_or_is_a_zombie_is_gone_and_none_started_is_not(monkeypatch):
    """A reaped server has no /proc entry left to read: taken for alive, the next launch sent its
    request to it instead of starting a new server."""
    ended = subprocess.Popen(["true"])
    monkeypatch.setattr(starter, "_server_pid", lambda: ended.pid)
    os.waitid(os.P_PID, ended.pid, os.WEXITED | os.WNOWAIT)  # ended, not yet reaped
    assert starter.server_gone()
    ended.wait()
    assert starter.server_gone()
    monkeypatch.setattr(starter, "_server_pid", lambda: None)  # this process started no server
    assert not starter.server_gone()


def test_a_rank_keeps_what_the_agent_added_and_its_own_variables_over_the_launchers_environment(monkeypatch):
    """A rank's environment starts as the server's with the agent's additions; it becomes the
    launcher's at launch plus those additions: the agent's own variables even where the server
    started with the same value, and any other variable the server did not start with."""
    monkeypatch.setattr(
        os,
        "environ",
        {"A": "1", "RANK": "0", "TORCHELASTIC_RUN_ID": "r", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"},
    )
    starter.take_environment(({"A": "1", "RANK": "0"}, {"A": "2", "B": "b"}))
    assert os.environ == {
        "A": "2",
        "B": "b",
        "RANK": "0",
        "TORCHELASTIC_RUN_ID": "r",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    }


def test_a_socket_path_of_the_most_bytes_linux_binds_is_taken_and_one_more_refused(monkeypatch):
    """The limit is in bytes of the encoded path, not characters."""
    longest = "/" + "a" * (starter.SOCKET_PATH_MAX - 1)
    paths = {longest: True, longest + "a": False, "/a" + "é" * (starter.SOCKET_PATH_MAX // 2): False}
    for path, taken in paths.items():
        monkeypatch.setattr(starter.connection, "arbitrary_address", lambda family, path=path: path)
        if taken:
            starter._check_socket_path()
            continue
        with pytest.raises(starter.TempDirTooLong, match=r"\(108 of at most 107 bytes\); set TMPDIR"):
            starter._check_socket_path()
