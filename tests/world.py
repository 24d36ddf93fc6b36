"""A long-lived group of real gloo ranks that runs test cases sent from the pytest process.

One launch serves many cases (and hypothesis' shrinking): the pytest process puts a pickled
case in a TCPStore, every rank runs it and puts its result back. Every wait has a timeout, so a
broken case fails the test instead of hanging it.
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from commbench.bench import launch

CASE_TIMEOUT_S = 60.0
IDLE_POLL_S = 30.0  # a rank waiting for its next case checks this often that the pytest process lives
IDLE_LIMIT_S = 1800.0  # and gives up after this long without a case


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, for a rendezvous a test makes by hand."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _next_case(store: dist.TCPStore, key: str) -> Any:
    """The case under ``key``, however long other worlds keep this one idle.

    A wait that times out means no case yet; a pytest process that has gone closes the store's
    connection, which raises at once.
    """
    deadline = time.monotonic() + IDLE_LIMIT_S
    while True:
        try:
            store.wait([key], timedelta(seconds=IDLE_POLL_S))
            return pickle.loads(store.get(key))
        except dist.DistStoreError:
            if time.monotonic() > deadline:
                raise


def _serve(host: str, port: int, runner: Callable[[Any], Any]) -> None:
    """Rank body: run cases until the pytest process sends None."""
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    i = 0
    while True:
        case = _next_case(store, f"case/{i}")
        if case is None:
            return
        try:
            result = runner(case)
        except Exception as exc:  # reported to the test, which fails with it
            result = ("error", f"{type(exc).__name__}: {exc}")
        store.set(f"result/{i}/{rank}", pickle.dumps(result))
        i += 1


class World:
    """``world.run(case)`` returns every rank's result for ``case``."""

    def __init__(self, size: int, runner: Callable[[Any], Any]) -> None:
        self.size = size
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=CASE_TIMEOUT_S)
        )
        self.i = 0
        self.stopped = False
        self.error: BaseException | None = None
        spec = launch.LaunchSpec(world_size=size, timeout_s=30)
        args = ("127.0.0.1", self.store.port, runner)

        def target() -> None:
            try:
                launch.run(_serve, args, spec)
            except BaseException as exc:  # surfaced by run()/close()
                self.error = exc

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()

    def run(self, case: Any) -> list[Any]:
        if self.error is not None:
            raise RuntimeError(f"world of {self.size} died: {self.error}")
        key = self.i
        self.i += 1
        self.store.set(f"case/{key}", pickle.dumps(case))
        keys = [f"result/{key}/{r}" for r in range(self.size)]
        self.store.wait(keys, timedelta(seconds=CASE_TIMEOUT_S))
        return [pickle.loads(self.store.get(k)) for k in keys]

    def stop(self) -> None:
        """Tell the ranks to leave; ``close`` waits for them (stop every world first, then close)."""
        if not self.stopped:
            self.store.set(f"case/{self.i}", pickle.dumps(None))
            self.stopped = True

    def close(self) -> None:
        self.stop()
        self.thread.join(timeout=60)
        if self.error is not None:
            raise RuntimeError(f"world of {self.size} failed: {self.error}")


@contextlib.contextmanager
def worlds_of(runner: Callable[[Any], Any]) -> Iterator[Callable[[int], World]]:
    """``get(size)`` starts a world of ``size`` ranks on first use; on exit all leave at once."""
    started: dict[int, World] = {}

    def get(size: int) -> World:
        if size not in started:
            started[size] = World(size, runner)
        return started[size]

    try:
        yield get
    finally:
        for w in started.values():
            w.stop()
        for w in started.values():
            w.close()


def run_as_nodes(argv: list[str], nodes: list[Any], timeout_s: float) -> list[tuple[int, str]]:
    """``python -m commbench *argv`` as the ranks of one job on as many nodes, rank i started in
    directory ``nodes[i]`` with the variables torchrun gives (local rank 0 each); returns each
    rank's exit code and standard error. Each is killed if it outlives ``timeout_s``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root, "WORLD_SIZE": str(len(nodes)), "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "commbench", *argv],
            cwd=node,
            env={**env, "RANK": str(rank), "LOCAL_RANK": "0"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, node in enumerate(nodes)
    ]
    try:
        errors = [rank.communicate(timeout=timeout_s)[1] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    return [(rank.returncode, err) for rank, err in zip(ranks, errors, strict=True)]
