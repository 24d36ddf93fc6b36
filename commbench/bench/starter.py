"""The process that starts local ranks: a fork server that has imported torch once.

A spawned rank is a fresh interpreter that imports torch, about 3 s of CPU on a 2-core machine
for every rank of every launch. The elastic launcher's ``forkserver`` start method forks each
rank from one server process instead; with torch and the launcher's module imported there in
advance, a rank starts in a fraction of a second. The server is itself a fresh interpreter that
only imports: it holds no CUDA context, no process group and no torch thread pool, which forking
the launcher itself could not promise. Ranks are its children, not the launcher's.

This module does not import torch, so the CLI can start the server first and let its imports
run beside the CLI's own (two cores, two imports at once).

The ranks forked from the server inherit the environment the server started with; the launcher
hands the difference to each rank (:func:`environment_change`), so a rank sees the launcher's
environment at launch time, as a spawned one would. Their standard output and error are the
server's: the launcher's when the server started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

START_METHOD = "forkserver"
PRELOAD = ("commbench.bench.rankhost", "torch", "torch.distributed", "commbench.bench.launch")


def launched_externally() -> bool:
    """True when a launcher (torchrun, SLURM) already made this process one rank of a job."""
    env = os.environ
    return ("RANK" in env and "WORLD_SIZE" in env) or (
        "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "MASTER_ADDR" in env
    )


_started_env: dict[str, str] | None = None  # the environment the running server started with


def start() -> None:
    """Start the fork server now, with torch preloaded; nothing happens if one already runs.

    A server that someone else started (multiprocessing's is one per process) is used as it is.
    """
    global _started_env
    import multiprocessing
    from multiprocessing import forkserver

    server = forkserver._forkserver
    before = getattr(server, "_forkserver_pid", None)
    if before is None:
        multiprocessing.set_forkserver_preload(list(PRELOAD))
    env = dict(os.environ)
    with _sigint_ignored():  # in the server until it has imported commbench.bench.rankhost
        forkserver.ensure_running()  # starts one, or a new one if the last one died
    if getattr(server, "_forkserver_pid", None) != before:
        _started_env = env


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread sets handlers; the server then starts as this process is
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def environment_change() -> tuple[dict[str, str], dict[str, str]] | None:
    """(the environment the server started with, the environment now), for :func:`take_environment`
    in a rank; None when the server is not one this module started."""
    if _started_env is None:
        return None
    return _started_env, dict(os.environ)


def take_environment(change: tuple[dict[str, str], dict[str, str]] | None) -> None:
    """In a rank: the launcher's environment now, plus what the launcher's agent set for this rank.

    The agent's variables (RANK, MASTER_PORT, ...) are those that differ from what the server
    started with."""
    if change is None:
        return
    started, now = change
    agent = {k: v for k, v in os.environ.items() if started.get(k) != v}
    os.environ.clear()
    os.environ.update(now)
    os.environ.update(agent)
