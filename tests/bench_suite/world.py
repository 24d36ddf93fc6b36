"""A gloo world in which the pytest process is rank 0, so pytest-benchmark can time a collective.

The other ranks are started by the elastic launcher, leave the group it made them, and join
this one through a TCPStore that the pytest process owns. Before each benchmark, rank 0 tells
them which call to repeat. They follow rank 0 call by call rather than count calls, since
pytest-benchmark makes more with some options (``--benchmark-cprofile``): before each call rank 0
broadcasts the benchmark's number ("one more"), then all meet at a barrier, both outside the timed
region; at the end it broadcasts "done", and each rank checks its own last result and puts its
count of wrong elements in the store for rank 0 to assert on.

A benchmark that fails on rank 0 must not leave the others repeating its call: the next
benchmark's calls would meet the old one's (a hang, "Connection closed by peer", or gloo aborting
the pytest process on a message longer than the one it waits for). :meth:`BenchWorld.benchmark`
says "done" however its body ends, a rank told to repeat another benchmark than its own stops,
and a failure inside a call, where the others may still be in it, ends the world: later
benchmarks are skipped, saying why.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from commbench import comm
from commbench.bench import cluster, launch
from commbench.bench.collectives import SPECS, Buffers, form_name, ready_for_check
from commbench.bench.records import first_line
from commbench.comm.ops import parse_dtype

PREFIX = "bench"
THREADS = 1  # torch threads on every rank of the world, rank 0 (the pytest process) too
RESULT_TIMEOUT = timedelta(seconds=120)  # as the group's: a helper's check is far shorter
HELPERS_TERM_S = 3.0  # how long a rank stopped with SIGTERM has before SIGKILL
HELPERS_STOP_S = 30.0  # how long a broken world waits for the other ranks to end, to say why they did
DONE = 0  # what rank 0 broadcasts after a benchmark's last call; before each call, its number (1, 2, ...)


def make(
    collective: str, size_bytes: int, dtype: str, rank: int, world: int, root: int = 0, in_place: bool = False
) -> Buffers:
    """A rank's buffers, in the in-place form where ``in_place`` and the collective has one."""
    spec = SPECS[collective]
    dt = parse_dtype(dtype)
    count = spec.count(size_bytes, dt.itemsize, world)
    return spec.make_for(count, dt, torch.device("cpu"), rank, world, "sum", root, in_place)


def _next(word: int = DONE) -> int:
    """Rank 0's word to the others, a benchmark's number or DONE: rank 0 passes it, the others get
    it back."""
    t = torch.tensor([word], dtype=torch.int64)
    dist.broadcast(t, 0)
    return int(t.item())


def _helper(host: str, port: int, world: int) -> None:
    """Rank 1.. of the benchmark world: repeat what rank 0 announces until told to stop."""
    rank = dist.get_rank() + 1
    dist.destroy_process_group()
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=600))
    store.set(f"pid/{rank}", str(os.getpid()))  # for rank 0 to stop it where the group cannot
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(PREFIX, store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    workspace = comm.Workspace()
    i = 0
    while (cmd := pickle.loads(store.get(f"cmd/{i}"))) is not None:
        collective, algorithm, size_bytes, dtype, root, in_place = cmd
        spec = SPECS[collective]
        b = make(collective, size_bytes, dtype, rank, world, root, in_place)
        while (word := _next()) != DONE:
            if abs(word) != i + 1:
                raise RuntimeError(
                    f"rank {rank} repeats benchmark {i + 1}, but rank 0 asks for benchmark {abs(word)}"
                )
            ready_for_check(b)  # any call may be the checked one: a call that writes nothing must show
            target = b
            if word < 0:  # the suite's own test: this call goes to other buffers and leaves b unwritten
                target = make(collective, size_bytes, dtype, rank, world, root, in_place)
                ready_for_check(target)
            dist.barrier()
            spec.run(target, algorithm, "sum", root, None, workspace)
            dist.barrier()  # rank 0's timed call ends once every rank has returned from it
        store.set(f"wrong/{i}/{rank}", str(spec.wrong(b, "sum", rank, world, root)))
        i += 1


@contextlib.contextmanager
def _no_launcher_env() -> Iterator[None]:
    """Without an outer launcher's variables (pytest run by torchrun or srun), as cluster.host_env
    leaves them out: with them the launch took this process for one rank of that job and waited
    for its group, then failed."""
    names = cluster.launcher_vars(os.environ)
    saved = {k: os.environ.pop(k) for k in names}
    try:
        yield
    finally:
        os.environ.update(saved)


class BenchWorld:
    def __init__(self, size: int) -> None:
        self.size = size
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600)
        )
        self.error: BaseException | None = None
        self.broken: str | None = None  # why no more benchmarks can run, once that is so
        self.i = 0  # the number of the benchmark announced last
        self._open = False  # the others repeat the benchmark announced last, not yet told "done"
        self._calling = False  # rank 0 is between one_more and the end of its call
        self.threads = torch.get_num_threads()
        torch.set_num_threads(THREADS)  # one rank a core, as the launcher sets up the other ranks
        spec = launch.LaunchSpec(world_size=size - 1, timeout_s=120)

        def target() -> None:
            try:
                launch.run(_helper, ("127.0.0.1", self.store.port, size), spec)
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=target, daemon=True)
        with _no_launcher_env():  # until every rank has joined, so the launch has read it
            self.thread.start()
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore(PREFIX, self.store),
                rank=0,
                world_size=size,
                timeout=timedelta(seconds=120),
            )
        self.workspace = comm.Workspace()

    @contextlib.contextmanager
    def benchmark(
        self, collective: str, algorithm: str, size_bytes: int, dtype: str, root: int, in_place: bool = False
    ) -> Iterator[None]:
        """The other ranks repeat this call, each time rank 0 calls :meth:`one_more`, until
        :meth:`results` or the end of the body, however it ends (skipped where the world broke)."""
        if self.broken is None and self.error is not None:
            self.broken = f"the other ranks' launcher: {first_line(self.error)}"
        if self.broken is not None:
            pytest.skip(f"the benchmark world broke earlier ({self.broken})")
        what = f"{form_name(collective, in_place)} {algorithm} {size_bytes} B root {root}"
        self.i += 1
        cmd = (collective, algorithm, size_bytes, dtype, root, in_place)
        self.store.set(f"cmd/{self.i - 1}", pickle.dumps(cmd))
        self._open = True
        try:
            yield
        except BaseException as exc:
            if self._calling:  # the others may be inside the call: nothing sent now would reach them as meant
                self._break(f"{what} failed inside a call: {type(exc).__name__}: {first_line(exc)}")
                if self.error is not None:
                    exc.add_note(
                        f"the other ranks' launcher (its rank r is rank r + 1 here): {first_line(self.error)}"
                    )
            raise
        finally:
            if self._open:
                self._done(what)

    def one_more(self, elsewhere: bool = False) -> None:
        """Before each call on rank 0: the others poison their output, copy their input afresh
        (``ready_for_check``) and meet it at a barrier. The call ends with :meth:`returned`. With
        ``elsewhere`` (a test's), the others make this call on other buffers, as a call that writes
        nothing would leave theirs."""
        self._calling = True
        _next(-self.i if elsewhere else self.i)
        dist.barrier()

    def returned(self) -> None:
        """Rank 0's call (after :meth:`one_more`) returned: it waits for the others to return from
        theirs (a barrier), so that a call is timed until its last rank is done, as a root's
        broadcast is not when it returns (the receivers finish after it)."""
        dist.barrier()
        self._calling = False

    def results(self) -> dict[int, int]:
        """After rank 0's last call: the count of wrong elements in each other rank's last result."""
        self._done(f"benchmark {self.i}")
        keys = [f"wrong/{self.i - 1}/{r}" for r in range(1, self.size)]
        self.store.wait(keys, RESULT_TIMEOUT)
        return {r: int(self.store.get(k)) for r, k in enumerate(keys, start=1)}

    def _done(self, what: str) -> None:
        """Tell the others the benchmark is over."""
        self._open = False
        try:
            _next(DONE)
        except BaseException as exc:
            self._break(
                f"{what}: the others could not be told it ended: {type(exc).__name__}: {first_line(exc)}"
            )
            raise

    def _break(self, why: str) -> None:
        """End the group now, and the other ranks with it: one waiting on rank 0 in a collective
        waited out the group's timeout (120 s) where the group was left alive by a traceback
        holding it (a Ctrl-C sent to the pytest process alone)."""
        self.broken = why
        self._open = self._calling = False
        if dist.is_initialized():
            dist.destroy_process_group()
        self._stop_helpers()
        self.thread.join(timeout=HELPERS_STOP_S)

    def _stop_helpers(self) -> None:
        """SIGTERM to each other rank still running, then SIGKILL to those still there after a few
        seconds: a rank waiting inside a gloo call runs its Python stop handler only once the call
        returns, at the group's timeout (the launcher then says it was killed)."""
        import psutil

        if not self.thread.is_alive():
            return  # the launch is over, and the pids may name other processes by now
        helpers = []
        for r in range(1, self.size):
            with contextlib.suppress(Exception):  # not started yet (no pid), or gone already
                if self.store.check([f"pid/{r}"]):
                    helper = psutil.Process(int(self.store.get(f"pid/{r}")))
                    helper.send_signal(signal.SIGTERM)
                    helpers.append(helper)
        _, alive = psutil.wait_procs(helpers, timeout=HELPERS_TERM_S)
        for helper in alive:
            with contextlib.suppress(psutil.Error):
                helper.kill()

    def close(self) -> Any:
        self.store.set(f"cmd/{self.i}", pickle.dumps(None))
        if dist.is_initialized():
            dist.destroy_process_group()
        self.thread.join(timeout=HELPERS_STOP_S)
        self._stop_helpers()  # still there: they wait on a group that will not answer
        self.thread.join(timeout=HELPERS_STOP_S)
        torch.set_num_threads(self.threads)
