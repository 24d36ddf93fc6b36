"""The send/receive pipeline's order of posting and the Workspace's kept schedules, with no process group."""

from __future__ import annotations

import torch

from commbench.comm import pipeline
from commbench.comm.pipeline import Unit
from commbench.comm.workspace import PLANS_KEPT, Workspace, plan


class _Done:
    def wait(self) -> bool:
        return True


def _posted(monkeypatch, n: int, lag: int, ahead: int) -> list[str]:
    """What pipeline.run hands to p2p, in order, for ``n`` units: through the link to its two
    neighbours when receives are posted ahead, through exchange (send and receive paired) when not."""
    log: list[str] = []
    units = [Unit(torch.full((2,), float(i)), torch.empty(2)) for i in range(n)]
    index = {id(u.recv): i for i, u in enumerate(units)}

    def post_send(tensor: torch.Tensor | None) -> _Done | None:
        if tensor is None:
            return None
        log.append(f"send {int(tensor[0])}")
        return _Done()

    def post_recv(tensor: torch.Tensor | None) -> _Done | None:
        if tensor is None:
            return None
        log.append(f"recv {index[id(tensor)]}")
        return _Done()

    def link(group: object, dst: int, src: int, device: torch.device) -> tuple:
        assert (dst, src, device) == (1, 1, torch.device("cpu"))
        return post_send, post_recv

    def exchange(
        send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int, group: object
    ) -> tuple:
        return post_send(send), post_recv(recv)

    monkeypatch.setattr(pipeline.p2p, "link", link)
    monkeypatch.setattr(pipeline.p2p, "exchange", exchange)
    pipeline.run(units, right=1, left=1, lag=lag, recv_ahead=ahead, op="sum", group=None)
    return log


def test_first_sends_leave_before_the_rest_of_the_receives_are_posted(monkeypatch):
    log = _posted(monkeypatch, n=6, lag=2, ahead=64)
    assert log[:4] == ["recv 0", "recv 1", "send 0", "send 1"]
    assert log[4:8] == ["recv 2", "recv 3", "recv 4", "recv 5"]
    assert sorted(log) == sorted([f"recv {i}" for i in range(6)] + [f"send {i}" for i in range(6)])


def test_without_receives_ahead_each_receive_goes_with_its_send(monkeypatch):
    log = _posted(monkeypatch, n=4, lag=1, ahead=0)
    assert log == [entry for i in range(4) for entry in (f"send {i}", f"recv {i}")]


def test_receives_never_run_further_ahead_than_asked(monkeypatch):
    log = _posted(monkeypatch, n=10, lag=1, ahead=3)
    for i, entry in enumerate(log):
        if entry.startswith("recv "):
            unit = int(entry.split()[1])
            sent = sum(e.startswith("send ") for e in log[:i])
            assert unit < max(sent, 1) + 3, (entry, log)


def test_a_kept_schedule_is_reused_for_its_key_only():
    ws = Workspace()
    built: list[str] = []

    def make(name: str):
        return lambda: built.append(name) or [name]

    first = plan(ws, ("a", 1), make("a"))
    assert plan(ws, ("a", 1), make("a again")) is first
    assert plan(ws, ("a", 2), make("b")) == ["b"]
    assert built == ["a", "b"]
    assert plan(None, ("a", 1), make("no workspace")) == ["no workspace"]


def test_only_the_most_recent_schedules_are_kept():
    ws = Workspace()
    built: list[int] = []
    for k in range(PLANS_KEPT + 1):
        plan(ws, k, lambda k=k: built.append(k))
    plan(ws, PLANS_KEPT, lambda: built.append(-1))  # the newest: kept
    plan(ws, 0, lambda: built.append(-2))  # the oldest: dropped when the last one came
    assert built == [*range(PLANS_KEPT + 1), -2]
    assert len(ws._plans) == PLANS_KEPT


def test_a_schedule_used_again_is_kept_over_one_left_unused():
    """The schedules kept are the most recently used, not the most recently made: a sweep's series
    take turns at every size, so the one used again must outlast one not used since."""
    ws = Workspace()
    built: list[int] = []
    for k in range(PLANS_KEPT):
        plan(ws, k, lambda k=k: built.append(k))
    plan(ws, 0, lambda: built.append(-1))  # used again: now the most recent
    plan(ws, PLANS_KEPT, lambda: built.append(PLANS_KEPT))  # one too many: 1 goes, not 0
    plan(ws, 0, lambda: built.append(-2))
    plan(ws, 1, lambda: built.append(-3))
    assert built == [*range(PLANS_KEPT + 1), -3]


def test_a_grown_buffer_is_not_held_by_the_schedules_kept_on_it():
    """Series of one algorithm with different segments (ring@1M, then ring) held the scratch of
    both, since the first's kept schedule viewed the buffer the second outgrew."""
    import gc
    import weakref

    ws, like = Workspace(), torch.zeros(1)
    small = ws.get("slots", (10,), like)
    plan(ws, "ring@1M", lambda s=small: [s[:5], s[5:]])
    outgrown = weakref.ref(small._base)
    del small
    ws.get("slots", (20,), like)
    gc.collect()
    assert outgrown() is None and not ws._plans
    kept = plan(ws, "ring", lambda: [ws.get("slots", (20,), like)])
    ws.get("slots", (20,), like)  # no growth: the schedule stays
    assert plan(ws, "ring", lambda: []) is kept
