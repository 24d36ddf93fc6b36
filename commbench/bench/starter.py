"""The process that starts local ranks: a fork server that has imported torch once.

A spawned rank is a fresh interpreter that imports torch, about 3 s of CPU on a 2-core machine
for every rank of every launch. The elastic launcher's ``forkserver`` start method forks each
rank from one server process instead; with torch and the launcher's module imported there in
advance, a rank starts in a fraction of a second. The server is itself a fresh interpreter that
only imports: it holds no CUDA context, no process group and no torch work, which forking the
launcher itself could not promise (its one extra thread is OpenBLAS's, which re-creates its
threads after a fork). Ranks are its children, not the launcher's (up to
:data:`FORKSERVER_MAX_RANKS` local ranks; more are spawned by the launcher).

This module does not import torch, so the CLI can start the server first and let its imports
run beside the CLI's own (two cores, two imports at once).

What a rank inherits from the server, and how it differs from a spawned rank:

- The environment: the server's, from when it started. The launcher hands each rank the
  environment of the launch (:func:`environment_change`), so a rank sees it as a spawned one
  would. Variables read while a library loads (OMP_NUM_THREADS for torch's threads) were read by
  the server; the rank applies OMP_NUM_THREADS itself (commbench.bench.launch).
- Standard output and error: the server's, the launcher's when the server started.
- multiprocessing keeps one fork server per process: once commbench's runs, other users of the
  ``forkserver`` start method in the launcher get children of it too, and a server someone else
  started is used as it is (without torch preloaded).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from multiprocessing import connection, forkserver, util
from pathlib import Path
from typing import Any

START_METHOD = "forkserver"
# multiprocessing's fork server takes fewer than MAXFDS_TO_SEND - 4 descriptors with each request,
# and the elastic agent sends every rank a pipe to each local rank (one return-value queue per
# rank, two descriptors each): from 125 local ranks on, a launch failed with "too many fds". Above
# this many, ranks are spawned instead (each imports torch itself: slower to start, no limit).
FORKSERVER_MAX_RANKS = (forkserver.MAXFDS_TO_SEND - 4) // 2 - 4  # 122 with Python's 256
PRELOAD = (
    "commbench.bench.rankhost",
    "torch",
    "torch.distributed",
    "commbench.bench.launch",
    "commbench.bench.rankgate",  # last: it holds Ctrl-C for the ranks
)
# What the elastic agent sets for every rank it starts (LocalElasticAgent), besides TORCHELASTIC_*.
AGENT_VARIABLES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)

# What a rank of this launcher is called (its /proc comm, as ps and top show it), so that tools
# such as commbench profile tell it from the server's other children (the readiness probe).
RANK_NAME = re.compile(r"commbench-r(\d+)")
READY_MIN_S = 60.0  # the least a launch waits for the server's imports (torch: ~3 s here)

_ready: set[int] = set()  # servers (pids) known to have finished their imports


# What a rank forked at the moment its launcher stops meets while it reads its start-up data: the
# launcher has already removed a semaphore the data names, or closed the pipe it comes through.
LAUNCHER_GONE = (FileNotFoundError, EOFError, ConnectionError)


def quiet_if_launcher_gone(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """``sys.excepthook`` of the fork server (set by :mod:`commbench.bench.rankhost`).

    A child the server forks reports an error in its start-up through it, before any rank code
    runs (a rank's own errors are handled by the rank). For errors that mean the launcher went
    away first, say nothing: the launcher is stopping and has its own one line to print, and
    the child's exit status still says that it failed. Anything else is printed as usual.
    """
    if issubclass(kind, LAUNCHER_GONE):
        return
    sys.__excepthook__(kind, value, tb)


class ServerNotReady(RuntimeError):
    """The fork server did not finish its imports in time; it has been stopped."""


def launched_externally() -> bool:
    """True when a launcher (torchrun, SLURM) already made this process one rank of a job."""
    env = os.environ
    return ("RANK" in env and "WORLD_SIZE" in env) or (
        "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "MASTER_ADDR" in env
    )


def _server_pid() -> int | None:
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def start() -> None:
    """Start the fork server, with torch preloaded, and return at once; if one runs, nothing.

    A server that died is replaced.
    """
    import multiprocessing

    if _server_pid() is None or server_gone():
        multiprocessing.set_forkserver_preload(list(PRELOAD))
    # Ignored from their start: Ctrl-C in the server until it has imported commbench.bench.rankhost;
    # a closed terminal's SIGHUP in multiprocessing's resource tracker, which the server's start
    # starts too and which, killed by it, was relaunched and printed a traceback per semaphore.
    if _server_pid() is None or server_gone():
        _check_socket_path()
    with _ignored((signal.SIGINT, signal.SIGHUP)), _delivered(signal.SIGCHLD), _environment(same_imports({})):
        forkserver.ensure_running()


def same_imports(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with PYTHONPATH and PYTHONSAFEPATH set so that a Python started with it imports
    modules from where this process does, in the same order.

    ``python -c`` (the fork server) and ``python -m`` (profile's inner command, the cluster's
    ranks) put their working directory first on sys.path. An installed commbench run from a
    directory holding another ``commbench`` (a checkout) had its ranks run that one: the
    launcher's code with the checkout's ranks. A sys.path entry with the path separator in it
    cannot be written in PYTHONPATH: then ``env`` is returned as it is, and the child finds
    modules as Python's own start puts them (leaving that entry out could leave the child
    without this commbench: a checkout in ``/work/a:b``)."""
    entries = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    if any(os.pathsep in p for p in entries):
        return dict(env)
    return {**env, "PYTHONPATH": os.pathsep.join(entries), "PYTHONSAFEPATH": "1"}


@contextlib.contextmanager
def _environment(changes: Mapping[str, str]) -> Iterator[None]:
    """This process's environment with ``changes`` in the block (for the processes it starts
    there), as it was after. A rank gets the launcher's back (:func:`take_environment`)."""
    before = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class TempDirTooLong(ValueError):
    """$TMPDIR is too long a path for the fork server's socket."""


SOCKET_PATH_MAX = 107  # bytes of an AF_UNIX socket's path on Linux (sun_path is 108 with its NUL)


def _check_socket_path() -> None:
    """ValueError where the server's socket, made in a directory under $TMPDIR, would have a path
    too long to bind (multiprocessing raised OSError from deep inside, as a traceback)."""
    path = connection.arbitrary_address("AF_UNIX")  # the same directory and the same length of name
    if len(os.fsencode(path)) > SOCKET_PATH_MAX:
        raise TempDirTooLong(
            f"the temporary directory {tempfile.gettempdir()} is too long a path for the local ranks' "
            f"socket ({len(os.fsencode(path))} of at most {SOCKET_PATH_MAX} bytes); set TMPDIR to a "
            "shorter one"
        )


def start_method(local_ranks: int) -> str:
    """How the launcher starts ``local_ranks`` ranks: from the fork server, or spawned above
    :data:`FORKSERVER_MAX_RANKS`."""
    return START_METHOD if local_ranks <= FORKSERVER_MAX_RANKS else "spawn"


def ready(timeout_s: float = READY_MIN_S) -> None:
    """Start the server if need be and wait until it has done its imports and can fork.

    Until then a launch would leave a half-made request with the server, served seconds later;
    an interrupted wait here leaves only a process that does nothing. A server still importing
    after ``timeout_s`` (at least :data:`READY_MIN_S`) is killed and :class:`ServerNotReady`
    raised, so a stuck import ends the launch instead of hanging it.
    """
    start()
    pid = _server_pid()
    if pid in _ready:
        return
    # Starting a process blocks until the server has forked it, so the wait is a thread's.
    failed: list[BaseException] = []
    prober = threading.Thread(target=_probe, args=(failed,), name="commbench-server-probe", daemon=True)
    prober.start()
    wait_s = max(timeout_s, READY_MIN_S)
    prober.join(wait_s)
    if prober.is_alive():
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)  # the probe's request then ends with the server
        prober.join(5.0)
        # The probe's connection closes as the server begins to exit, a moment before it has
        # ended; the next launch, finding it not yet ended, would send its request to it.
        deadline = time.monotonic() + 5.0
        while not server_gone() and time.monotonic() < deadline:
            time.sleep(0.01)
        raise ServerNotReady(
            f"the fork server that starts the ranks (pid {pid}) had not finished importing "
            f"{', '.join(PRELOAD[1:])} after {wait_s:g} s; it was stopped"
        )
    if failed:
        exc = failed[0]
        raise ServerNotReady(
            f"the fork server that starts the ranks (pid {pid}) could not start a process: "
            f"{type(exc).__name__}: {exc}"
        )
    _ready.add(pid)


def _probe(failed: list[BaseException]) -> None:
    import multiprocessing

    try:
        probe = multiprocessing.get_context(START_METHOD).Process(target=_nothing, name="commbench-probe")
        probe.start()
        probe.join()
    except Exception as exc:  # handed to the waiting thread
        failed.append(exc)


def _nothing() -> None:
    pass


def scratch_place() -> tuple[str, str] | None:
    """(directory, name prefix) for the scratch directory of a launch whose ranks this process's
    fork server forks: beside the server's socket (in this process's multiprocessing directory)
    and named after it, so that the server can find it (:func:`remove_what_the_launcher_left`).
    None where no server runs, or its socket has no path."""
    address = forkserver._forkserver._forkserver_address
    if not isinstance(address, str) or util.is_abstract_socket_namespace(address):
        return None
    return os.path.dirname(address), os.path.basename(address) + "-commbench-"


def remove_what_the_launcher_left() -> None:
    """In the fork server, as it ends (registered by :mod:`commbench.bench.rankhost`): remove the
    scratch directories of the launches it served, its socket, and the launcher's multiprocessing
    directory once that is empty.

    The server ends when its launcher and every rank it forked have closed its "alive" pipe, all
    by ending, so nothing uses them any more. A launcher that ended as usual removed them itself;
    one killed outright (SIGKILL) left them, and nothing else would remove them."""
    if _server_pid() is not None:  # a process that started a server, not a server
        return
    place = scratch_place()
    if place is None:
        return
    folder, prefix = place
    for path in glob.glob(os.path.join(glob.escape(folder), glob.escape(prefix) + "*")):
        shutil.rmtree(path, ignore_errors=True)
    for remove, path in ((os.unlink, forkserver._forkserver._forkserver_address), (os.rmdir, folder)):
        with contextlib.suppress(OSError):
            remove(path)


def server_gone() -> bool:
    """Whether the fork server this process started has ended (a zombie counts as ended)."""
    pid = _server_pid()
    if pid is None:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


@contextlib.contextmanager
def _ignored(signums: tuple[int, ...]) -> Iterator[None]:
    """``signums`` ignored in the block, so that processes started in it begin with them ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread sets handlers; the server then starts as this process is
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in signums}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _delivered(signum: int) -> Iterator[None]:
    """``signum`` unblocked for this thread in the block, so that processes started in it begin
    with it unblocked. The server learns that a child ended from SIGCHLD: started with it blocked
    (a parent's mask is inherited), it never answered the readiness probe."""
    old = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def name_rank(rank: str) -> None:
    """Name this process after its rank (:data:`RANK_NAME`); where /proc cannot be written it
    keeps its name."""
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(f"commbench-r{rank}"[:15])


def environment_change() -> tuple[dict[str, str], dict[str, str]] | None:
    """(the environment the server started with, the environment now), for :func:`take_environment`
    in a rank; None when the server's environment cannot be read."""
    pid = _server_pid()
    if pid is None:
        return None
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    started = dict(
        entry.decode(errors="surrogateescape").partition("=")[::2] for entry in raw.split(b"\0") if entry
    )
    return started, dict(os.environ)


def take_environment(change: tuple[dict[str, str], dict[str, str]] | None) -> None:
    """In a rank: the launcher's environment at launch, plus what the launcher's agent set for it.

    The agent's variables are those it always sets (:data:`AGENT_VARIABLES`, TORCHELASTIC_*) and
    any other that differs from what the server started with."""
    if change is None:
        return
    started, now = change
    agent = {
        k: v
        for k, v in os.environ.items()
        if k in AGENT_VARIABLES or k.startswith("TORCHELASTIC_") or started.get(k) != v
    }
    os.environ.clear()
    os.environ.update(now)
    os.environ.update(agent)
