"""A gloo world in which the pytest process is rank 0, so pytest-benchmark can time a collective.

The other ranks are started by the elastic launcher, leave the group it made them, and join
this one through a TCPStore that the pytest process owns. Before each benchmark, rank 0 tells
them which call to repeat. They follow rank 0 call by call rather than count calls, since
pytest-benchmark makes more with some options (``--benchmark-cprofile``): before each call rank 0
broadcasts "one more", then all meet at a barrier, both outside the timed region; at the end it
broadcasts "done", and each rank checks its own last result and puts its count of wrong elements
in the store for rank 0 to assert on.
"""

from __future__ import annotations

import pickle
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commbench import comm
from commbench.bench import launch
from commbench.bench.collectives import SPECS, Buffers
from commbench.comm.ops import parse_dtype

PREFIX = "bench"
RESULT_TIMEOUT = timedelta(seconds=120)  # as the group's: a helper's check is far shorter
MORE, DONE = 1, 0  # what rank 0 broadcasts before each call and after the last


def make(collective: str, size_bytes: int, dtype: str, rank: int, world: int, root: int = 0) -> Buffers:
    spec = SPECS[collective]
    dt = parse_dtype(dtype)
    return spec.make(
        spec.count(size_bytes, dt.itemsize, world), dt, torch.device("cpu"), rank, world, "sum", root
    )


def _next(word: int = DONE) -> int:
    """Rank 0's word to the others, MORE or DONE: rank 0 passes it, the others get it back."""
    t = torch.tensor([word], dtype=torch.int64)
    dist.broadcast(t, 0)
    return int(t.item())


def _helper(host: str, port: int, world: int) -> None:
    """Rank 1.. of the benchmark world: repeat what rank 0 announces until told to stop."""
    rank = dist.get_rank() + 1
    dist.destroy_process_group()
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=600))
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
        collective, algorithm, size_bytes, dtype, root = cmd
        spec = SPECS[collective]
        b = make(collective, size_bytes, dtype, rank, world, root)
        while _next() == MORE:
            b.input.copy_(b.reference)
            dist.barrier()
            spec.run(b, algorithm, "sum", root, None, workspace)
        store.set(f"wrong/{i}/{rank}", str(spec.wrong(b, "sum", rank, world, root)))
        i += 1


class BenchWorld:
    def __init__(self, size: int) -> None:
        self.size = size
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600)
        )
        self.error: BaseException | None = None
        self.i = 0
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one rank a core, as the launcher sets up the other ranks
        spec = launch.LaunchSpec(world_size=size - 1, timeout_s=120)

        def target() -> None:
            try:
                launch.run(_helper, ("127.0.0.1", self.store.port, size), spec)
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(PREFIX, self.store),
            rank=0,
            world_size=size,
            timeout=timedelta(seconds=120),
        )
        self.workspace = comm.Workspace()

    def announce(self, collective: str, algorithm: str, size_bytes: int, dtype: str, root: int) -> None:
        """The call the other ranks repeat until :meth:`results`."""
        if self.error is not None:
            raise RuntimeError(f"benchmark helpers failed: {self.error}")
        self.store.set(f"cmd/{self.i}", pickle.dumps((collective, algorithm, size_bytes, dtype, root)))
        self.i += 1

    def one_more(self) -> None:
        """Before each call on rank 0: the others copy their input afresh and meet it at a barrier."""
        _next(MORE)
        dist.barrier()

    def results(self) -> dict[int, int]:
        """After rank 0's last call: the count of wrong elements in each other rank's last result."""
        _next(DONE)
        keys = [f"wrong/{self.i - 1}/{r}" for r in range(1, self.size)]
        self.store.wait(keys, RESULT_TIMEOUT)
        return {r: int(self.store.get(k)) for r, k in enumerate(keys, start=1)}

    def close(self) -> Any:
        self.store.set(f"cmd/{self.i}", pickle.dumps(None))
        dist.destroy_process_group()
        self.thread.join(timeout=120)
        torch.set_num_threads(self.threads)
