"""The launcher: a rank that dies or raises ends the whole run with its rank named, quickly."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from commbench.bench import launch, signals, starter
from commbench.bench.launch import LaunchSpec, RankFailed, run
from tests import stops

ROOT = Path(__file__).resolve().parents[1]


def _rank_one_dies() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.recv(torch.empty(1), src=1)  # would wait for the full timeout without the launcher


def _rank_one_raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("bad value on purpose")
    dist.recv(torch.empty(1), src=1)


def _world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _rank_zero_ends_last() -> int:
    if dist.get_rank() == 0:
        time.sleep(1.0)
    return dist.get_rank()


def test_returns_every_local_rank_result():
    assert run(_world, (), LaunchSpec(world_size=3)) == {0: (0, 3), 1: (1, 3), 2: (2, 3)}
    # in rank order, not the order the ranks ended in (a test printing them failed once in make test)
    assert list(run(_rank_zero_ends_last, (), LaunchSpec(world_size=2)).items()) == [(0, 0), (1, 1)]


def _rank_zero_ends_the_fork_server() -> None:
    if dist.get_rank() == 0:
        os.kill(os.getppid(), signal.SIGKILL)  # the ranks' parent: the fork server
    time.sleep(0.5)
    os._exit(0)


@pytest.mark.slow
def test_a_fork_server_that_dies_is_named_and_the_next_launch_gets_a_new_one():
    with pytest.raises(RankFailed, match="the fork server that started the ranks had ended"):
        run(_rank_zero_ends_the_fork_server, (), LaunchSpec(world_size=2, timeout_s=60))
    assert run(_world, (), LaunchSpec(world_size=2)) == {0: (0, 2), 1: (1, 2)}


def _seen() -> tuple[str | None, str | None, str, str, int]:
    env = os.environ
    return env.get("CB_ADDED"), env.get("CB_REMOVED"), env["RANK"], env["MASTER_PORT"], os.getppid()


def test_ranks_see_the_launchers_environment_at_launch_and_come_from_one_server(monkeypatch):
    """Ranks are forked from a fork server that outlives one launch; they still see the launcher's
    environment as it is when they are launched, with the launcher's own variables on top."""
    monkeypatch.setenv("CB_REMOVED", "before")
    first = run(_seen, (), LaunchSpec(world_size=2))
    assert [v[:3] for _, v in sorted(first.items())] == [(None, "before", "0"), (None, "before", "1")]
    monkeypatch.setenv("CB_ADDED", "now")
    monkeypatch.delenv("CB_REMOVED")
    monkeypatch.setenv("RANK", "99")  # no effect on the ranks' own RANK: the launcher sets it (but
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # without WORLD_SIZE this is no torchrun rank)
    second = run(_seen, (), LaunchSpec(world_size=2))
    assert [v[:3] for _, v in sorted(second.items())] == [("now", None, "0"), ("now", None, "1")]
    assert len({v[3] for v in second.values()}) == 1  # the agent's MASTER_PORT, one per launch
    parents = {v[4] for v in [*first.values(), *second.values()]}
    assert len(parents) == 1 and os.getpid() not in parents  # one fork server, not this process


@pytest.mark.slow
def test_more_local_ranks_than_the_fork_server_takes_are_spawned(monkeypatch):
    """The fork server takes fewer than MAXFDS_TO_SEND - 4 descriptors per request, and the agent
    sends each rank two per local rank: 125 ranks failed with "too many fds". Above the limit
    (lowered here to 1 so that 2 ranks cross it) the ranks are spawned, children of this process."""
    assert starter.start_method(starter.FORKSERVER_MAX_RANKS) == "forkserver"
    assert starter.start_method(starter.FORKSERVER_MAX_RANKS + 1) == "spawn"
    monkeypatch.setattr(starter, "FORKSERVER_MAX_RANKS", 1)
    monkeypatch.setenv("CB_ADDED", "spawned")
    seen = run(_seen, (), LaunchSpec(world_size=2))
    assert [v[:3] for _, v in sorted(seen.items())] == [("spawned", None, "0"), ("spawned", None, "1")]
    assert {v[4] for v in seen.values()} == {os.getpid()}


def test_spawning_more_ranks_than_the_memory_holds_is_refused_before_any_starts(monkeypatch):
    class Memory:
        available = 1 << 20

    monkeypatch.setattr(starter, "FORKSERVER_MAX_RANKS", 1)
    monkeypatch.setattr("psutil.virtual_memory", lambda: Memory())
    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", lambda *a: pytest.fail("launched"))
    with pytest.raises(
        ValueError,
        match=r"^2 local ranks are more than the fork server can start \(1\), and "
        r"spawned, each would import torch itself: about .* GiB in all, more than the 0\.0 GiB",
    ):
        run(_seen, (), LaunchSpec(world_size=2))


@pytest.mark.parametrize(
    "fn,message",
    [(_rank_one_dies, "exited with code 3"), (_rank_one_raises, "ValueError: bad value on purpose")],
)
def test_a_failed_rank_ends_the_run_and_is_named(fn, message):
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run(fn, (), LaunchSpec(world_size=2, timeout_s=60))
    assert info.value.rank == 1
    assert message in str(info.value)
    assert time.monotonic() - t0 < 45  # well inside the 60 s process-group timeout


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"world_size": 0}, "world size"),
        ({"device": "tpu"}, "device"),
        ({"backend": "mpi"}, "backend"),
        ({"backend": "nccl"}, "needs --device cuda"),
        ({"timeout_s": 0}, "timeout"),
    ],
)
def test_spec_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LaunchSpec(**kwargs)


def test_backend_follows_device():
    assert LaunchSpec().resolved_backend == "gloo"
    assert LaunchSpec(device="cuda").resolved_backend == "nccl"
    assert LaunchSpec(device="cuda", backend="gloo").resolved_backend == "gloo"


def test_rendezvous_event_names_match_torchs_own_helper():
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from commbench.bench import launch

    def recording_method() -> tuple[str, str]:
        return launch._method_name(), inspect.stack()[1].function  # torch's depth 2, seen from here

    def caller() -> tuple[str, str]:
        return recording_method()

    ours, torchs = caller()
    assert ours == torchs == "caller"
    assert launch._method_name(10_000) == "no_method_name"
    launch._cheap_rendezvous_event_names()
    assert dynamic_rendezvous.get_method_name is launch._method_name


def _with_project_path(*more: Path) -> dict[str, str]:
    """This process's environment, with the repository (and ``more``) as PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (ROOT, *more))}


def _python(code: str) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter in the repository's root."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_fork_servers_imports_leave_cuda_alone():
    """Ranks are forked from the server after its imports; CUDA touched there (even a device
    count) could not be used in the ranks. Checked in a fresh interpreter, as the server is."""
    code = (
        "import torch, sys\n"
        "seen = []\n"
        "real = torch._C._cuda_getDeviceCount\n"
        "torch._C._cuda_getDeviceCount = lambda: seen.append('device count') or real()\n"
        "torch.cuda._lazy_init = lambda: seen.append('lazy init')\n"
        "from commbench.bench import starter\n"
        "for name in starter.PRELOAD: __import__(name)\n"
        "print(seen, torch.cuda.is_initialized())\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "[] False"


@pytest.mark.slow
def test_a_launch_from_a_process_with_sigchld_blocked_starts_its_ranks():
    """A blocked SIGCHLD, inherited from a parent, is not passed on to the fork server."""
    code = (
        "import signal\n"
        "from commbench.bench import launch, starter\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})\n"
        "print(sorted(launch.run(launch.external_world_size, (), launch.LaunchSpec(world_size=2))))\n"
        "print(signal.SIGCHLD in signal.pthread_sigmask(signal.SIG_BLOCK, []))\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["[0, 1]", "True"]  # and the caller's mask is as it was


LATE_ENVIRONMENT = """
import os, torch
from commbench.bench import launch, starter

def seen():
    return os.environ.get("RANK"), torch.get_num_threads()

if __name__ == "__main__":
    os.environ["RANK"] = "0"  # the server starts with RANK=0, the rank the agent gives rank 0 too
    os.environ.pop("WORLD_SIZE", None)
    os.environ.pop("OMP_NUM_THREADS", None)
    starter.ready()
    del os.environ["RANK"]
    os.environ["OMP_NUM_THREADS"] = "3"  # read by torch when it loads, in the server
    print(sorted(launch.run(seen, (), launch.LaunchSpec(world_size=2)).items()))
"""


@pytest.mark.slow  # a launch of its own (10 s), under make test-slow (CI's ten minutes)
def test_a_rank_keeps_what_the_agent_set_and_applies_threads_set_after_the_server_started(tmp_path):
    """The agent's RANK=0 equals the server's starting value that the launcher has since removed;
    rank 0 still gets it. OMP_NUM_THREADS set after the server loaded torch still counts."""
    script = tmp_path / "late.py"
    script.write_text(LATE_ENVIRONMENT)
    env = _with_project_path()
    done = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[(0, ('0', 3)), (1, ('1', 3))]"


@pytest.mark.parametrize(
    "omp, local_world, slurm_per_node, threads",
    [
        (None, "2", None, 1),
        (None, "4", None, 1),
        (None, "1", None, 16),
        (None, None, None, 16),
        (None, None, "4(x2)", 1),  # srun: SLURM's count of tasks on this node
        ("3", "4", None, 3),
        ("2,1", "2", None, 2),  # OpenMP's list: the first level's count
        (" +4 ", "2", None, 4),  # as libgomp reads it
    ],
)
def test_a_rank_gets_one_thread_where_a_host_runs_several_as_under_torchrun(
    monkeypatch, omp, local_world, slurm_per_node, threads
):
    monkeypatch.setattr(launch, "_cores", lambda: 16)
    for name, value in (
        ("OMP_NUM_THREADS", omp),
        ("LOCAL_WORLD_SIZE", local_world),
        ("SLURM_NTASKS_PER_NODE", slurm_per_node),
    ):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert launch._threads() == threads


@pytest.mark.parametrize("value", ["x", "0", "-1", "4,x", "2.5", "\u00b2", "4097", "2147483648", "9" * 20])
def test_a_bad_thread_count_is_one_line_and_exit_2_with_nothing_from_libgomp(value):
    """libgomp, loaded with torch, printed four lines of "Invalid value for environment variable
    OMP_NUM_THREADS" before anything, and the run went on with a count of commbench's choosing."""
    done = subprocess.run(
        [sys.executable, "-m", "commbench", "sweep", "-b", "1K", "-e", "1K", "-n", "1"],
        cwd=ROOT,
        env={**_with_project_path(), "OMP_NUM_THREADS": value},
        capture_output=True,
        text=True,
        timeout=120,
    )
    refusal = f"$OMP_NUM_THREADS={value!r} is not a thread count: give a whole number from 1 to 4096"
    assert (done.returncode, done.stderr, done.stdout) == (2, f"commbench: error: {refusal}\n", "")


def test_the_largest_thread_count_is_taken_and_one_more_is_refused(monkeypatch):
    """MAX_THREADS itself is a count OpenMP and torch take; only what lies past it is refused."""
    from commbench.bench import openmp

    assert openmp.MAX_THREADS == 4096
    monkeypatch.setenv("OMP_NUM_THREADS", "4096")
    assert openmp.omp_threads() == 4096
    monkeypatch.setenv("OMP_NUM_THREADS", "1,4096")
    assert openmp.omp_threads() == 1
    for value in ("4097", "1,4097"):
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        with pytest.raises(ValueError, match="give a whole number from 1 to 4096"):
            openmp.omp_threads()


def test_a_rank_alone_gets_the_cores_it_may_run_on(monkeypatch):
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert launch._cores() == expected >= 1
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 5}, raising=False)
    assert launch._cores() == 3  # taskset, a cgroup's cpuset: the cores it may run on, not the machine's
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set())
    assert launch._cores() == 1
    monkeypatch.delattr(os, "sched_getaffinity")  # a platform without it: every core
    assert launch._cores() == 64


STUCK_SERVER = """
import sys, time
from commbench.bench import cli, starter

if __name__ == "__main__":
    preload = starter.PRELOAD
    starter.READY_MIN_S = 1.0
    starter.PRELOAD = ("commbench.bench.rankhost", "stuck_import")
    argv = ["sweep", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0", "-q", "--no-probe", "--world-size", "2"]
    t0 = time.monotonic()
    code = cli.main([*argv, "--timeout", "1"])
    stuck = starter._server_pid()
    print(code, round(time.monotonic() - t0), starter.server_gone(), file=sys.stderr)
    starter.PRELOAD = preload
    print(cli.main(argv), starter._server_pid() != stuck, file=sys.stderr)
"""


@pytest.mark.slow
def test_a_fork_server_stuck_in_its_imports_ends_the_launch_and_the_next_gets_a_new_one(tmp_path):
    """A launch waits for the server's imports no longer than the timeout (here its floor cut to
    1 s), then kills the server and says so in one line; the next launch starts a fresh server."""
    (tmp_path / "stuck_import.py").write_text("import time\ntime.sleep(600)\n")
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_SERVER)
    env = _with_project_path(tmp_path)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-2000:]
    message, first, second = done.stderr.strip().split("\n")
    assert message.startswith("commbench: the fork server that starts the ranks (pid "), message
    assert "had not finished importing stuck_import after 1 s; it was stopped" in message
    code, seconds, gone = first.split()
    assert (code, gone) == ("1", "True") and int(seconds) < 30, first
    assert second == "0 True"


def test_a_stuck_server_has_ended_when_the_launch_gives_up_on_it(monkeypatch):
    """The probe's request ends as the killed server begins to exit, a moment before it has ended
    (here its SIGKILL lands 0.3 s after the probe gives up); ready() returns only once it has, so
    the next launch starts a new server rather than sending its request to the dying one."""
    import threading

    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    killed, real_kill = threading.Event(), os.kill

    def kill_later(pid: int, signum: int) -> None:
        killed.set()
        threading.Timer(0.3, real_kill, (pid, signum)).start()

    monkeypatch.setattr(starter, "READY_MIN_S", 0.1)
    monkeypatch.setattr(starter, "start", lambda: None)
    monkeypatch.setattr(starter, "_server_pid", lambda: server.pid)
    monkeypatch.setattr(starter, "_probe", lambda failed: killed.wait(10))
    monkeypatch.setattr(starter.os, "kill", kill_later)
    try:
        with pytest.raises(starter.ServerNotReady, match="it was stopped"):
            starter.ready(0.1)
        assert starter.server_gone()
    finally:
        server.kill()
        server.wait()


STOPPED_WHILE_CONNECTING = """
import os, sys, time
from pathlib import Path
from commbench.bench import launch
from commbench.comm import p2p

real = p2p.enable_duplex


def slow_duplex(group):
    if os.environ["RANK"] == "0":
        time.sleep(120)  # rank 1 meanwhile waits in the companion's C++ connect
    else:
        Path(sys.argv[1]).write_text(str(os.getpid()))
    real(group)


p2p.enable_duplex = slow_duplex  # in the ranks too: they import this file as their main module


def nothing():
    return 0


if __name__ == "__main__":
    try:
        launch.run(nothing, (), launch.LaunchSpec(world_size=2))
    except launch.Interrupted as exc:
        print("interrupted", exc.signum, file=sys.stderr)
"""


@pytest.mark.slow
def test_a_stop_while_a_rank_connects_its_second_group_ends_it_at_once(tmp_path):
    """Two ranks connect a companion after joining (p2p.enable_duplex), in a C++ wait on the
    launcher's store. A Python handler there would run only once that wait failed, when the
    launcher exited: the launcher waited out its 30 s grace, and the rank printed the store's C++
    error. The rank takes the default action until its connections are made."""
    script, mark = tmp_path / "stop.py", tmp_path / "rank1.pid"
    script.write_text(STOPPED_WHILE_CONNECTING)
    env = _with_project_path()
    proc = subprocess.Popen(
        [sys.executable, str(script), str(mark)], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists(), "rank 1 never reached its second group"
        time.sleep(1.0)  # into the C++ wait
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        err = proc.communicate(timeout=120)[1]
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert err.strip() == f"interrupted {int(signal.SIGTERM)}", err[-2000:]
    assert took < 15, took


SLOW_TO_LEAVE = """
import sys, time
from pathlib import Path

import torch.distributed as dist

from commbench.bench import launch

LEAVE_S = float(sys.argv[2]) if len(sys.argv) > 2 else 1.5


def stay():
    here = Path(sys.argv[1])
    rank = dist.get_rank()
    (here / f"rank{rank}.ready").write_text("")
    try:
        while True:
            time.sleep(0.02)  # in Python, so the rank's stop handler runs here
    except SystemExit:
        (here / f"rank{rank}.stopping").write_text("")
        time.sleep(LEAVE_S)  # a rank that takes a while to leave (flushing what it finished)
        (here / f"rank{rank}.left").write_text("")
        raise


if __name__ == "__main__":
    try:
        launch.run(stay, (), launch.LaunchSpec(world_size=2, timeout_s=60))
    except launch.Interrupted as exc:
        print("interrupted", exc.signum, file=sys.stderr)
"""


def _wait_for_ranks(proc: subprocess.Popen, folder: Path, ranks: int = 2) -> None:
    """Return once each of ``ranks`` ranks of the launch ``proc`` has written rankN.ready into
    ``folder``; fail where the launch ended first or two minutes passed."""
    ready = [folder / f"rank{r}.ready" for r in range(ranks)]
    deadline = time.monotonic() + 120
    while not all(p.exists() for p in ready) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(p.exists() for p in ready), "the ranks never started"


@pytest.mark.parametrize("sig", **stops.one_fast("hup"))
def test_a_stop_sent_to_the_whole_group_ends_the_launcher_after_its_ranks(tmp_path, sig):
    """A closed terminal (SIGHUP), or a SIGTERM to the process group, reaches the fork server as well.
    When it ended the server, the agent took each rank's lost status pipe for the rank's end: the
    launcher returned and removed its scratch directory while the ranks were still leaving and
    writing their records there (once "Directory not empty" in make test). The server holds these
    signals blocked, so the agent sees the ranks' real ends."""
    script = tmp_path / "slow_to_leave.py"
    script.write_text(SLOW_TO_LEAVE)
    env = _with_project_path()
    err_path = tmp_path / "stderr"
    # To a file, not a pipe: the ranks inherit the launcher's standard error, and reading a pipe
    # to its end would wait for them as well as for the launcher.
    with err_path.open("w") as err_file:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(tmp_path)],
            cwd=tmp_path,
            env=env,
            stderr=err_file,
            start_new_session=True,
        )
    try:
        _wait_for_ranks(proc, tmp_path)
        os.killpg(proc.pid, sig)
        proc.wait(timeout=60)
        left = sorted(p.name for p in tmp_path.glob("rank*.left"))  # read the moment the launcher is gone
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    err = err_path.read_text()
    assert err.strip() == f"interrupted {int(sig)}", err[-2000:]
    assert left == ["rank0.left", "rank1.left"]


IGNORING = """
import signal, sys, time
from pathlib import Path

import torch.distributed as dist

from commbench.bench import launch


def wait_for_go():
    here = Path(sys.argv[1])
    (here / f"rank{dist.get_rank()}.ready").write_text("")
    while not (here / "go").exists():
        time.sleep(0.02)  # in Python, where a handler of the rank's would act
    return dist.get_rank()


if __name__ == "__main__":
    signal.signal(int(sys.argv[2]), signal.SIG_IGN)  # as nohup (SIGHUP), or a background job (SIGINT)
    try:
        print("results", launch.run(wait_for_go, (), launch.LaunchSpec(world_size=2, timeout_s=60)))
    except launch.Interrupted as exc:
        print("interrupted", exc.signum)
"""


@pytest.mark.parametrize("sig", **stops.one_fast("hup"))
def test_a_stop_signal_inherited_as_ignored_stays_ignored_in_the_launcher_and_its_ranks(tmp_path, sig):
    """`nohup commbench ...` was stopped by the SIGHUP it was to ignore: the elastic agent sets its
    handler for every signal it takes over, and the ranks set theirs, whatever was inherited."""
    script = tmp_path / "ignoring.py"
    script.write_text(IGNORING)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), str(int(sig))],
        cwd=tmp_path,
        env=_with_project_path(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for_ranks(proc, tmp_path)
        os.killpg(proc.pid, sig)  # the launcher, its ranks and the fork server
        time.sleep(0.5)
        (tmp_path / "go").write_text("")
        out, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert (proc.returncode, out.strip()) == (0, "results {0: 0, 1: 1}"), err[-2000:]


@pytest.mark.slow
def test_stops_after_the_first_do_not_cut_the_launchers_stopping_short(tmp_path):
    """The first stop makes the launcher stop its ranks (the agent waits for them) and remove its
    scratch directory; a second Ctrl-C or SIGTERM raised the agent's exception again in the
    middle of that. The launcher now lets stops after the first do nothing, and waits for its
    ranks as after one."""
    script, here = tmp_path / "slow_to_leave.py", tmp_path / "here"
    script.write_text(SLOW_TO_LEAVE)
    here.mkdir()
    scratch = Path(tempfile.mkdtemp(prefix="cb-", dir="/tmp"))  # short: the server's socket goes in it
    env = {**_with_project_path(), "TMPDIR": str(scratch)}
    err_path = tmp_path / "stderr"
    with err_path.open("w") as err_file:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(here), "5"],
            cwd=tmp_path,
            env=env,
            stderr=err_file,
            start_new_session=True,
        )
    try:
        _wait_for_files(proc, here, "ready")
        started = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)  # to the launcher alone: the agent stops the ranks
        _wait_for_files(proc, here, "stopping")  # the ranks take 5 s to leave, and the agent waits
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            proc.send_signal(sig)
        proc.wait(timeout=120)
        left = sorted(p.name for p in here.glob("rank*.left"))  # read the moment the launcher is gone
        _, alive = psutil.wait_procs(started, timeout=120)
        kept = sorted(p.name for p in scratch.iterdir())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(scratch, ignore_errors=True)
    err = err_path.read_text()
    assert (proc.returncode, err) == (0, f"interrupted {int(signal.SIGTERM)}\n"), err[-2000:]
    assert left == ["rank0.left", "rank1.left"]
    assert (alive, kept) == ([], [])


ORPHANED = """
import sys, time
from pathlib import Path

import torch.distributed as dist

from commbench.bench import launch


def work(here, finish):
    here = Path(here)
    rank = dist.get_rank()
    (here / f"rank{rank}.ready").write_text("")
    try:
        while not (finish and (here / "go").exists()):
            time.sleep(0.02)  # in Python, so the rank's stop handler runs here
    except SystemExit:
        (here / f"rank{rank}.left").write_text("")  # what a sweep's rank 0 saves its records in
        raise
    (here / f"rank{rank}.returned").write_text("")


if __name__ == "__main__":
    launch.run(work, (sys.argv[1], sys.argv[2] == "finish"), launch.LaunchSpec(world_size=2, timeout_s=60))
"""


@pytest.mark.parametrize(
    "finish", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["working", "waiting-to-be-read"]
)
def test_ranks_of_a_launcher_killed_outright_leave_and_take_everything_with_them(tmp_path, finish):
    """A launcher killed with SIGKILL stops nothing: its ranks ran on, then waited for ever for it
    to read their results (in a semaphore's wait), its fork server stayed with them, and its
    scratch and multiprocessing directories stayed behind. Each rank now leaves through its stop
    handler once the launcher has ended, and the server, last to leave, removes what the launcher
    left."""
    script, here = tmp_path / "orphaned.py", tmp_path / "here"
    script.write_text(ORPHANED)
    here.mkdir()
    # Short: the fork server's socket goes in it, and a socket's path holds at most 107 bytes.
    scratch = Path(tempfile.mkdtemp(prefix="cb-", dir="/tmp"))
    env = {**_with_project_path(), "TMPDIR": str(scratch)}
    with (tmp_path / "stderr").open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(here), "finish" if finish else "work"],
            cwd=tmp_path,
            env=env,
            stderr=err,
            start_new_session=True,
        )
    mark = "returned" if finish else "ready"
    try:
        _wait_for_files(proc, here, "ready")
        launcher = psutil.Process(proc.pid)
        started = launcher.children(recursive=True)  # the fork server, its ranks, the resource tracker
        if finish:
            launcher.suspend()  # it reads no result from now on
            (here / "go").write_text("")
            _wait_for_files(proc, here, mark)
        proc.kill()
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(started, timeout=120)
        assert alive == [], (alive, (tmp_path / "stderr").read_text()[-2000:])
        left = sorted(p.name for p in scratch.iterdir())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(scratch, ignore_errors=True)
    assert sorted(p.name for p in here.glob("*.left")) == ([] if finish else ["rank0.left", "rank1.left"])
    assert left == []


def _wait_for_files(proc: subprocess.Popen, here: Path, mark: str) -> None:
    """Wait until both ranks have written ``rank<r>.<mark>`` in ``here``."""
    wanted = [here / f"rank{r}.{mark}" for r in range(2)]
    deadline = time.monotonic() + 120
    while not all(p.exists() for p in wanted) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(p.exists() for p in wanted), f"the ranks never wrote {mark}"


STOPPED_BEFORE_THE_AGENT = """
import os, signal, sys
from commbench.bench import cli, starter

ready = starter.ready

def ready_then_stop(timeout_s):
    ready(timeout_s)
    os.kill(os.getpid(), int(sys.argv[1]))  # the fork server is up; the agent has no handler yet

if __name__ == "__main__":
    starter.ready = ready_then_stop
    argv = ["sweep", "--world-size", "2", "-b", "4K", "-e", "4K", "-n", "1", "-w", "0", "-q", "--no-probe"]
    sys.exit(cli.main(argv))
"""


# SIGHUP takes SIGTERM's path here: under `make test-slow`, to keep `make test` within CI's ten minutes
@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, pytest.param(signal.SIGHUP, marks=pytest.mark.slow)], ids=["term", "hup"]
)
def test_a_stop_before_the_agent_starts_the_ranks_is_an_interruption(tmp_path, sig):
    """Until the agent installs its handlers, SIGTERM and SIGHUP took their default action: the
    launcher ended at once, without "interrupted", and left its scratch directory behind."""
    script, scratch = tmp_path / "early.py", tmp_path / "tmp"
    script.write_text(STOPPED_BEFORE_THE_AGENT)
    scratch.mkdir()
    env = {**_with_project_path(), "TMPDIR": str(scratch)}
    command = [sys.executable, str(script), str(int(sig))]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (128 + sig, "commbench: interrupted\n"), done.stderr[-2000:]
    assert sorted(p.name for p in scratch.glob("commbench-*")) == []


def test_a_launch_puts_back_the_stop_handlers_it_found():
    """The agent leaves its own handlers installed: a Ctrl-C after the launch then raised its
    exception, not KeyboardInterrupt, where nothing catches it; SIGQUIT, which the agent takes
    over too, did the same in place of its default action (``commbench study`` launches many
    times in one process)."""
    taken = (*signals.STOPS, signal.SIGQUIT)
    before = [signal.getsignal(s) for s in taken]
    assert run(_world, (), LaunchSpec(world_size=2)) == {0: (0, 2), 1: (1, 2)}
    assert [signal.getsignal(s) for s in taken] == before
    assert set(launch._agent_signals()) >= set(taken)


@pytest.mark.parametrize("named", ["SIGKILL", "SIGSTOP,SIGUSR1"])
def test_signals_no_handler_can_take_are_not_put_back(monkeypatch, named):
    """$TORCHELASTIC_SIGNALS_TO_HANDLE naming SIGKILL ended the launch with "[Errno 22] Invalid
    argument" as its handlers were put back."""
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", named)
    taken = launch._agent_signals()  # read before the launch: torch's sets the variable to its own list
    assert signal.SIGKILL not in taken and signal.SIGSTOP not in taken
    assert (signal.SIGUSR1 in taken) == ("SIGUSR1" in named)
    assert run(_world, (), LaunchSpec(world_size=2)) == {0: (0, 2), 1: (1, 2)}


def test_stop_signals_after_the_first_are_swallowed_by_a_python_handler():
    """timeout(1) signals the group and the launcher signals its ranks: a rank can get a second
    SIGTERM while its handler runs. With SIG_IGN installed there, one that had already reached
    the interpreter but not yet its Python handler was reported as OSError "Signal 15 ignored due
    to race condition" (seen in about one run in ten under timeout(1)); a Python no-op takes it."""
    code = (
        "import os, signal\n"
        "from commbench.bench import launch, signals\n"
        "try:\n"
        "    launch._exit_on_signal(signal.SIGTERM, None)\n"
        "except SystemExit as exc:\n"
        "    print('exit', exc.code)\n"
        "print(all(callable(signal.getsignal(s)) for s in signals.STOPS))\n"
        "for s in (*signals.STOPS, signal.SIGTERM):\n"
        "    os.kill(os.getpid(), s)\n"
        "print('alive')\n"
    )
    done = _python(code)
    expected = f"exit {128 + signal.SIGTERM}\nTrue\nalive\n"
    assert (done.returncode, done.stdout, done.stderr) == (0, expected, "")


FINALISERS = {
    # the signal reaches a method the finaliser calls, as tqdm's __del__ calls close()
    "del": (
        "class Bar:\n"
        "    def close(self):\n"
        "        wait()\n"
        "    def __del__(self):\n"
        "        self.close()\n"
        "Bar()\n"
    ),
    "weakref": "weakref.finalize(Thing(), wait)\n",
    "generator": "def gen():\n    try:\n        yield 1\n    finally:\n        wait()\n"
    "g = gen()\nnext(g)\ndel g\n",
}


@pytest.mark.parametrize(
    "finaliser, sig",
    [
        ("del", signal.SIGTERM),
        pytest.param("weakref", signal.SIGTERM, marks=pytest.mark.slow),  # del's path (CI's ten minutes)
        ("generator", signal.SIGINT),
    ],
    ids=["del", "weakref", "generator-SIGINT"],
)
def test_a_stop_signal_that_lands_in_a_finaliser_ends_the_rank_after_it(finaliser, sig):
    """Python drops an exception raised while a finaliser runs: a rank stopped while tqdm's bar was
    being freed printed "Exception ignored in: <function tqdm.__del__ ...>" and its traceback,
    and went on, deaf to further stops. The same signal now comes again once it is done."""
    code = (
        "import os, signal, time, weakref\n"
        "from commbench.bench import launch\n"
        f"signal.signal({int(sig)}, launch._exit_on_signal)\n"
        "class Thing:\n"
        "    pass\n"
        "def wait():\n"
        f"    os.kill(os.getpid(), {int(sig)})\n"
        "    start = time.monotonic()\n"
        "    while time.monotonic() - start < 0.2:  # the handler runs in here\n"
        "        pass\n"
        "with launch._stops_kept_from_finalisers():\n"
        "    try:\n"
        + "".join(f"        {line}\n" for line in FINALISERS[finaliser].splitlines())
        + "        time.sleep(10)\n"
        "        print('went on')\n"
        "    except SystemExit as exc:\n"
        "        print('exit', exc.code)\n"
    )
    done = _python(code)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"exit {128 + sig}\n", "")


def _hook_of_a_rank() -> str:
    return sys.unraisablehook.__qualname__


def test_a_forked_rank_keeps_its_stops_from_finalisers():
    """A forked rank's unraisable hook is the one that sends a stop again. (In the real case the
    finaliser, tqdm's bar's, ran after the rank's function had raised, with the traceback that
    held it, so the hook stays with the handlers, never put back; that part is not seen from
    ``fn``: 12 runs of the case, a vgg16 too large at --world-size 2, each gave one line.)"""
    hook = "_stop_again_after_finalisers.<locals>.again"
    assert run(_hook_of_a_rank, (), LaunchSpec(world_size=2)) == {0: hook, 1: hook}


def _companion_timeout() -> float:
    from commbench.comm import p2p

    return p2p._companion(None).options._timeout.total_seconds()


def test_the_companion_keeps_the_launch_timeout():
    """The second connection of two gloo ranks (p2p.enable_duplex) is a gloo connection of its
    own; made without a timeout it took torch's 30 minutes, and a rank stuck on a silent peer
    there hung the run past --timeout."""
    assert run(_companion_timeout, (), LaunchSpec(world_size=2, timeout_s=7)) == {0: 7.0, 1: 7.0}


def test_a_launch_leaves_nothing_in_the_temporary_directory():
    """The elastic agent makes a directory per launch for its ranks' logs; it goes with the run."""
    import tempfile

    def agent_dirs() -> set[Path]:
        return set(Path(tempfile.gettempdir()).glob("torchelastic_*"))

    before = agent_dirs()
    assert run(_companion_timeout, (), LaunchSpec(world_size=2, timeout_s=7)) == {0: 7.0, 1: 7.0}
    assert agent_dirs() - before == set()


def test_a_record_written_while_the_scratch_dir_is_removed_is_removed_too(monkeypatch):
    """A rank stopped by a signal may write its record while the launcher removes the directory:
    that once made an interrupted run end "Directory not empty" instead of "interrupted"."""
    import shutil

    from commbench.bench import launch

    real = shutil.rmtree
    calls = []

    def rmtree_with_a_late_writer(path, ignore_errors=False):
        calls.append(path)
        real(path, ignore_errors=ignore_errors)
        if len(calls) == 1:  # the record lands after the listing, so the directory stays
            os.makedirs(path, exist_ok=True)
            Path(path, "rank1.err").write_text("0.0\tSystemExit: 129")

    monkeypatch.setattr(launch.shutil, "rmtree", rmtree_with_a_late_writer)
    with launch._scratch_dir() as path:
        Path(path, "rank0.err").write_text("0.0\tSystemExit: 129")
    assert not os.path.exists(path)
    assert len(calls) == 2


def test_a_scratch_dir_that_cannot_be_removed_is_left_without_an_error(monkeypatch):
    from commbench.bench import launch

    monkeypatch.setattr(launch, "SCRATCH_REMOVAL_S", 0.2)
    monkeypatch.setattr(launch.shutil, "rmtree", lambda path, ignore_errors=False: None)
    start = time.monotonic()
    with launch._scratch_dir() as path:
        pass
    assert os.path.isdir(path) and time.monotonic() - start < 5
    os.rmdir(path)


def test_the_fork_servers_hook_is_silent_only_when_the_launcher_went_first(capsys):
    def raised(exc: BaseException) -> tuple:
        try:
            raise exc
        except BaseException as caught:
            return type(caught), caught, caught.__traceback__

    for gone in (FileNotFoundError(2, "No such file or directory"), EOFError(), BrokenPipeError()):
        starter.quiet_if_launcher_gone(*raised(gone))
        assert capsys.readouterr().err == ""
    starter.quiet_if_launcher_gone(*raised(ValueError("a real start-up error")))
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "ValueError: a real start-up error" in err


def test_the_fork_server_reports_start_up_errors_through_that_hook():
    hook = "commbench.bench.starter.quiet_if_launcher_gone"
    code = f"import sys, commbench.bench.rankhost, commbench.bench.starter\nprint(sys.excepthook is {hook})"
    assert _python(code).stdout.strip() == "True"


def test_a_rank_stopped_while_writing_its_error_does_not_hide_the_rank_that_died(tmp_path, monkeypatch):
    """The launcher read an empty rank0.err (rank 0 was stopped as it wrote it) and ended with
    "could not convert string to float" instead of naming rank 1, which had exited with code 3."""
    from types import SimpleNamespace

    from commbench.bench import launch

    def failure(exitcode: int, stamp: float):
        return SimpleNamespace(exitcode=exitcode, timestamp=stamp, signal_name=lambda: "<N/A>")

    (tmp_path / "rank0.err").write_text("")  # opened, never written
    (tmp_path / "rank0.err.part").write_text("1.0\tConnectionError: half")  # never moved into place
    exc = SimpleNamespace(failures={0: failure(1, 2.0), 1: failure(3, 1.0)})
    found = launch._first_failure(exc, str(tmp_path))
    assert (found.rank, found.detail) == (1, "exited with code 3")
    # what a rank records is whole: written beside, then moved into place
    monkeypatch.setenv("RANK", "2")
    launch._record(str(tmp_path), ValueError("bad value\nsecond line"))
    stamp, _, text = (tmp_path / "rank2.err").read_text().partition("\t")
    assert float(stamp) > 0 and text == "ValueError: bad value"
    assert not (tmp_path / "rank2.err.part").exists()
    found = launch._first_failure(SimpleNamespace(failures={2: failure(1, 9.0)}), str(tmp_path))
    assert (found.rank, found.detail) == (2, "ValueError: bad value")


def test_a_rank_that_exited_with_a_code_comes_before_one_that_aborted_earlier(tmp_path):
    """An abort (SIGABRT, as gloo's C++ does when a peer vanishes) is most often the effect of
    another rank's failure: the rank that exited with a code of its own is named, though later."""
    from types import SimpleNamespace

    from commbench.bench import launch

    aborted = SimpleNamespace(exitcode=-6, timestamp=1.0, signal_name=lambda: "SIGABRT")
    exited = SimpleNamespace(exitcode=3, timestamp=2.0, signal_name=lambda: "<N/A>")
    found = launch._first_failure(SimpleNamespace(failures={0: aborted, 1: exited}), str(tmp_path))
    assert (found.rank, found.detail) == (1, "exited with code 3")


@pytest.mark.parametrize("code, name", [(143, "SIGTERM"), (130, "SIGINT"), ("137", "SIGKILL")])
def test_a_stopped_process_s_exit_code_is_named_by_its_signal(code, name):
    """128 + the signal's number: the exit status a shell gives a process a signal ended."""
    assert launch._signal_name(code) == name


@pytest.mark.parametrize("code", [1, 0, 128, "stop", None])
def test_any_other_exit_code_names_no_signal(code):
    """Codes that are no signal's, and what is no code at all, are None rather than an error."""
    assert launch._signal_name(code) is None


def test_a_stop_dropped_by_a_finaliser_is_kept_and_other_dropped_errors_still_reported(monkeypatch):
    class Stop(Exception):
        sigval = signal.SIGTERM

    class Raises:
        def __init__(self, exc: BaseException) -> None:
            self.exc = exc

        def __del__(self) -> None:
            raise self.exc

    reported: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(u.exc_value))
    lost: list[int] = []
    rearmed: list[int] = []  # the lost stop made the others do nothing: undone
    with launch._stops_in_finalisers(Stop, lost, lambda: rearmed.append(len(lost))):
        Raises(Stop())
        Raises(KeyboardInterrupt())
        Raises(ValueError("not a stop"))
    Raises(Stop())  # once the launch is over, Python's own handling is back
    assert lost == [signal.SIGTERM, signal.SIGINT]
    assert rearmed == [1, 2]
    assert [type(e) for e in reported] == [ValueError, Stop]


def _a_store_wait_fails() -> None:
    raise dist.DistStoreError("wait timeout after 5000ms, keys: /peer")  # a peer that has gone


@pytest.fixture
def rank_of_torchruns_one(monkeypatch):
    """This process as rank 0 of a world of 1 that torchrun started (its variables set); torch's
    thread count, which a launch sets, put back after."""
    from tests.world import free_port

    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**env, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(name, value)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_a_distributed_error_after_the_join_is_not_called_a_failure_to_join(
    monkeypatch, rank_of_torchruns_one
):
    """Under torchrun or SLURM every DistError was reported as "could not join the group ... (RANK
    and WORLD_SIZE ... are set ...)", a lost peer's or NCCL's in the middle of a run too."""
    with pytest.raises(RankFailed) as caught:
        run(_a_store_wait_fails, (), LaunchSpec(world_size=1, timeout_s=10))
    assert str(caught.value) == "rank 0 failed: DistStoreError: wait timeout after 5000ms, keys: /peer"
    assert not dist.is_initialized()

    def refused(*args, **kwargs):
        raise dist.DistStoreError("connection refused")

    monkeypatch.setattr(dist, "init_process_group", refused)
    with pytest.raises(RankFailed, match=r"could not join the group of WORLD_SIZE=1 at 127\.0\.0\.1:"):
        run(_world, (), LaunchSpec(world_size=1, timeout_s=10))


def _a_peer_is_lost() -> None:
    raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242\nmore")


def _bad_input() -> None:
    raise ValueError("sizes must be > 0")


def test_any_other_error_in_a_rank_of_torchruns_is_its_failure_in_one_line(rank_of_torchruns_one):
    """Under torchrun, a rank whose peer died mid-run printed gloo's RuntimeError with its whole
    traceback, where this launcher's ranks say "rank N failed: ..." in one line; bad input is still
    the CLI's to refuse (exit 2)."""
    with pytest.raises(RankFailed) as caught:
        run(_a_peer_is_lost, (), LaunchSpec(world_size=1, timeout_s=10))
    assert str(caught.value) == (
        "rank 0 failed: RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer "
        "[127.0.0.1]:4242"
    )
    with pytest.raises(ValueError, match="sizes must be > 0"):
        run(_bad_input, (), LaunchSpec(world_size=1, timeout_s=10))
    assert not dist.is_initialized()


def test_ranks_of_torchrun_started_with_other_options_each_refuse_naming_the_first(
    monkeypatch, rank_of_torchruns_one
):
    """Each node parses its own command line: another -e on one node left rank 0 finishing its own
    sweep while rank 1 failed in gloo, and another --strategy aborted a rank in C++. Where rank 0
    writes, a node's data and weights files, and how it prints may differ."""
    import dataclasses

    from commbench.bench.launch import check_same_work
    from commbench.bench.sweep import SweepConfig
    from commbench.trainers.loop import TrainConfig

    # A rank of torchrun's runs the check once it has joined the group, before the work.
    config, spec = SweepConfig(), LaunchSpec(world_size=1, timeout_s=10)
    checked = []
    monkeypatch.setattr(launch, "check_same_work", lambda args: checked.append((dist.is_initialized(), args)))
    assert run(lambda c: dist.get_world_size(), (config,), spec) == {0: 1}
    assert checked == [(True, (config,))]

    def ranks(*configs, refusals=None):
        """check_same_work on rank 0 of a world whose ranks gave ``configs``, and where given, the
        refusals of their nodes' checks (None where a node refused nothing)."""
        monkeypatch.setattr(dist, "get_world_size", lambda: len(configs))
        monkeypatch.setattr(dist, "get_rank", lambda: 0)
        works = [launch.work_of((c, "cpu", None, "commbench ...")) for c in configs]
        said = refusals or [None] * len(configs)
        monkeypatch.setattr(
            dist,
            "all_gather_object",
            lambda out, mine: out.__setitem__(slice(None), list(zip(works, said, strict=True))),
        )
        check_same_work((configs[0], "cpu", None, "commbench ..."))

    sweep = SweepConfig(max_bytes=1 << 16, json_path="a.jsonl")
    ranks(sweep, dataclasses.replace(sweep, json_path="/elsewhere/b.jsonl", csv_path="b.csv", quiet=True))
    with pytest.raises(ValueError) as caught:
        ranks(sweep, sweep, dataclasses.replace(sweep, max_bytes=1 << 20))
    assert str(caught.value) == (
        "the ranks were started with other options: max_bytes is 65536 on rank 0 and 1048576 on rank 2 "
        "(give every node the same command)"
    )
    train = TrainConfig(
        strategies=("ring",),
        model="resnet18",
        dataset="cifar10",
        data_dir="/a",
        model_options=(("weights", "/a/w.pth"), ("hidden", 8)),
    )
    ranks(
        train,
        dataclasses.replace(train, data_dir="/b", model_options=(("weights", "/b/w.pth"), ("hidden", 8))),
    )
    for other in ({"strategies": ("naive",)}, {"model_options": (("hidden", 16),)}, {"batch_size": 32}):
        with pytest.raises(ValueError, match=f"options: {next(iter(other))} is "):
            ranks(train, dataclasses.replace(train, **other))
    # A node's refusal of its input is said on every rank: the lowest rank's, with how many others
    # refused, before any difference in the options.
    with pytest.raises(ValueError) as caught:
        ranks(sweep, sweep, sweep, refusals=[None, None, "cannot write c.jsonl: Permission denied"])
    assert str(caught.value) == "cannot write c.jsonl: Permission denied (said by rank 2)"
    with pytest.raises(ValueError) as caught:
        ranks(
            sweep,
            sweep,
            dataclasses.replace(sweep, max_bytes=1 << 20),
            refusals=[None, "cannot write b.jsonl: Permission denied", "no such file: c.bin"],
        )
    assert (
        str(caught.value) == "cannot write b.jsonl: Permission denied (said by rank 1, and 1 other rank(s))"
    )


def _rank_one_is_stopped() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # `kill PID` of one rank
        time.sleep(30)
    dist.recv(torch.empty(1), src=1)


def _rank_one_aborts() -> None:
    if dist.get_rank() == 1:
        time.sleep(1.0)
        os.abort()  # as NCCL's watchdog ends a rank
    time.sleep(30)


def test_a_rank_that_aborts_is_the_failure_not_the_peers_the_launcher_then_stops():
    """Its peers, stopped by the agent's SIGTERM, record "stopped by SIGTERM": ranked with the
    raised errors, the earliest of them hid the abort and the run ended as interrupted."""
    with pytest.raises(RankFailed, match="rank 1 failed: killed by SIGABRT"):
        run(_rank_one_aborts, (), LaunchSpec(world_size=2, timeout_s=30))


def test_a_rank_stopped_alone_ends_the_run_as_interrupted():
    """A stop sent to one rank was reported as that rank's failure, "SystemExit: 143", exit 1."""
    with pytest.raises(launch.Interrupted) as caught:
        run(_rank_one_is_stopped, (), LaunchSpec(world_size=2, timeout_s=30))
    assert caught.value.signum == signal.SIGTERM


def test_a_slurm_job_without_master_port_gets_a_port_of_its_own(monkeypatch):
    """Two jobs on one node both took 29500, and the second failed to listen."""
    from commbench.bench import launch

    assert launch.slurm_port({"SLURM_JOB_ID": "123"}) == 29623 == launch.slurm_port({"SLURM_JOB_ID": "3123"})
    assert launch.slurm_port({"SLURM_JOB_ID": "124"}) == 29624
    assert launch.slurm_port({}) == launch.slurm_port({"SLURM_JOB_ID": "x"}) == 29500
    assert all(29500 <= launch.slurm_port({"SLURM_JOB_ID": str(j)}) < 32768 for j in range(0, 10**6, 997))
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK"):  # what the call sets, put back after
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "77"}.items():
        monkeypatch.setenv(name, value)
    launch._adopt_slurm_env()
    assert os.environ["MASTER_PORT"] == "29577" and os.environ["RANK"] == "0"


@pytest.mark.parametrize(
    "extra, code", [(71, 2), pytest.param(70, 0, marks=pytest.mark.slow)], ids=["too-long", "longest"]
)
def test_a_temporary_directory_too_long_for_the_servers_socket_is_one_line_and_exit_2(tmp_path, extra, code):
    # The server's socket is $TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX: 37 bytes past the directory;
    # a path of 108 bytes or more cannot be bound, and multiprocessing raised it as a traceback.
    top = Path(tempfile.mkdtemp(prefix="cb-", dir="/tmp"))
    long = top / ("a" * (extra - len(str(top)) + 4))  # /tmp/ + extra bytes, as the shell check had
    long.mkdir()
    assert len(str(long)) == len("/tmp/") + extra
    try:
        done = subprocess.run(
            [sys.executable, "-m", "commbench", "sweep", "-b", "1K", "-e", "1K", "--world-size", "2", "-q"],
            cwd=tmp_path,
            env={**_with_project_path(), "TMPDIR": str(long)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert list(long.iterdir()) == []
    finally:
        shutil.rmtree(top, ignore_errors=True)
    assert done.returncode == code, done.stderr[-2000:]
    if code:
        assert done.stderr.startswith(f"commbench: error: the temporary directory {long} is too long"), (
            done.stderr
        )
        assert done.stderr.endswith("(108 of at most 107 bytes); set TMPDIR to a shorter one\n")


def test_a_value_error_while_torch_loads_is_not_taken_for_bad_input(monkeypatch):
    """Only a $TMPDIR too long for the server's socket is the user's input: a ValueError from a
    broken installation (numpy built against another ABI) must not read as exit 2."""
    from commbench.bench import cli

    def broken():
        raise ValueError("numpy.dtype size changed, may indicate binary incompatibility")

    monkeypatch.setattr(cli, "_import_launch", broken)
    with pytest.raises(ValueError, match="binary incompatibility"):
        cli.main(["summary", "nothing.jsonl"])


def test_a_peer_that_gave_up_waiting_names_the_rank_that_never_answered(tmp_path):
    """Rank 1 stopped (SIGSTOP) raised nothing; rank 0's gloo timeout was the only failure the
    launcher saw, and the run's line blamed rank 0, which had waited for it."""
    from types import SimpleNamespace

    from commbench.bench import launch

    waited = "RuntimeError: [unbound_buffer.cc:78] Timed out waiting 15000ms for recv operation to complete"
    (tmp_path / "rank0.err").write_text(f"5.0\t{waited}")
    failed = SimpleNamespace(exitcode=1, timestamp=6.0, signal_name=lambda: "<N/A>")
    exc = SimpleNamespace(failures={0: failed})
    found = launch._first_failure(exc, str(tmp_path), 2)
    assert (found.rank, found.detail) == (
        1,
        f"it did not answer within the --timeout; rank 0 gave up waiting: {waited}",
    )
    assert launch._first_failure(exc, str(tmp_path), 4).detail.startswith("it (and 2 more) did not answer")
    assert launch._first_failure(exc, str(tmp_path), 4).rank == 1  # the lowest of ranks 1, 2 and 3
    # a rank that finished its work is not the one waited for (the review: it was named)
    (tmp_path / "rank1.done").touch()
    assert launch._first_failure(exc, str(tmp_path), 2).rank == 0
    found = launch._first_failure(exc, str(tmp_path), 4)
    assert found.rank == 2 and found.detail.startswith("it (and 1 more) did not answer")  # ranks 2 and 3
    assert launch._first_failure(exc, str(tmp_path), 3).detail.startswith("it did not answer")  # rank 2
    # an error of another kind, or no rank left out, names the rank that raised
    assert launch._first_failure(exc, str(tmp_path), 1).rank == 0
    for other in (
        "RuntimeError: the sampler thread did not stop within its timeout",
        "ValueError: cannot write runs/timeout-tests/sweep.png: Permission denied",
    ):  # the review: any 'timeout' in a message named a rank left out
        (tmp_path / "rank0.err").write_text(f"5.0\t{other}")
        assert launch._first_failure(exc, str(tmp_path), 4).detail == other


def _returns_or_times_out() -> None:
    """Rank 1 returns; rank 0 then raises gloo's text for a wait on a peer that never answered."""
    if dist.get_rank() == 0:
        time.sleep(1.0)  # rank 1 has returned and left its mark
        raise RuntimeError("[unbound_buffer.cc:78] Timed out waiting 15000ms for recv operation to complete")


def test_a_rank_that_returned_is_not_named_as_the_one_waited_for():
    """A rank marks the launcher's scratch directory when its work returns: without the mark, a
    rank that had finished (waiting in torch's wrapper when the others were stopped) was named as
    the silent one ("rank 1 failed: it did not answer within the --timeout ...")."""
    with pytest.raises(RankFailed) as failed:
        run(_returns_or_times_out, (), LaunchSpec(world_size=2, timeout_s=30))
    assert failed.value.rank == 0 and failed.value.detail.startswith("RuntimeError: [unbound_buffer"), str(
        failed.value
    )


def _shadow_package(where: Path) -> Path:
    """A ``commbench`` in ``where`` that leaves a mark when imported, then fails to import."""
    (where / "commbench").mkdir()
    (where / "commbench" / "__init__.py").write_text(
        "import pathlib\n"
        "pathlib.Path(__file__).with_name('imported').touch()\n"
        "raise ImportError('the other one')\n"
    )
    return where / "commbench" / "imported"


def test_ranks_import_commbench_from_where_the_launcher_does_not_from_the_working_directory(tmp_path):
    """An installed commbench run in a directory holding another ``commbench`` (a checkout) had
    its ranks import that one: the fork server is a ``python -c``, whose sys.path begins with its
    working directory. The launcher here has no working directory on sys.path, as the console
    script has none."""
    mark = _shadow_package(tmp_path)
    code = (
        "import sys\n"
        "sys.path.remove('')\n"
        "from commbench.bench import launch\n"
        "print(sorted(launch.run(launch.external_world_size, (), launch.LaunchSpec(world_size=2))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=_with_project_path(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[0] == "[0, 1]"
    assert not mark.exists()


def test_a_python_m_started_with_the_same_imports_skips_its_working_directory(tmp_path, monkeypatch):
    """What profile's inner command and the cluster's ranks (``python -m``) are started with:
    this process's sys.path, the working directory only where this process has it."""
    mark = _shadow_package(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "commbench", "--help"],
        cwd=tmp_path,
        env=starter.same_imports(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: commbench") and not mark.exists()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", "/a", "rel", *sys.path])
    env = starter.same_imports({"KEPT": "yes"})
    assert env["KEPT"] == "yes" and env["PYTHONSAFEPATH"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[:3] == [str(tmp_path), "/a", str(tmp_path / "rel")]
    # an entry PYTHONPATH cannot hold (a checkout in /work/a:b): the environment as it was, so the
    # child's own start puts its working directory first, as before
    monkeypatch.setattr(sys, "path", ["/work/a:b", *sys.path])
    assert starter.same_imports({"KEPT": "yes", "PYTHONPATH": "/x"}) == {"KEPT": "yes", "PYTHONPATH": "/x"}
