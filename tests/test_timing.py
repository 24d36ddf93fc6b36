"""The trainer's clock: on CUDA its stamps are events made before the step that records them."""

from __future__ import annotations

import pytest
import torch

from commbench.trainers import timing
from commbench.trainers.timing import Clock


class _Event:
    """Stands in for torch.cuda.Event where no GPU is (the real one: tests/test_gpu.py)."""

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.records = 0

    def record(self) -> None:
        self.records += 1


def test_a_cuda_clock_stamps_with_events_made_before_the_step(monkeypatch):
    made_ahead: list[_Event] = []

    def ahead(count: int) -> list[_Event]:
        made_ahead.extend(_Event(True) for _ in range(count))
        return made_ahead[-count:]

    made_in_step: list[_Event] = []

    def in_step(enable_timing: bool = False) -> _Event:
        made_in_step.append(_Event(enable_timing))
        return made_in_step[-1]

    monkeypatch.setattr(timing, "timing_events", ahead)
    monkeypatch.setattr(torch.cuda, "Event", in_step)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    clock = Clock(torch.device("cuda", 0), stamps_per_step=3)
    assert len(made_ahead) == 3 and not made_in_step
    first = [clock.stamp() for _ in range(5)]  # two more than foreseen: made as they are recorded
    assert first[:3] == made_ahead[::-1] and first[3:] == made_in_step
    clock.settle()  # the next step's five are made here, outside any step
    assert len(made_ahead) == 8 and len(made_in_step) == 2
    second = [clock.stamp() for _ in range(5)]
    assert len(made_in_step) == 2 and all(any(e is m for m in made_ahead[3:]) for e in second)
    clock.settle()
    clock.settle()  # a step without stamps keeps what the largest step needed
    assert len(clock.spare) == 5
    # each event is recorded once: a stamp read after its step still says when it was taken
    assert all(e.records == 1 for e in first + second)


def test_a_cpu_clock_makes_no_events(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: pytest.fail("a CPU clock made an event"))
    monkeypatch.setattr(timing, "timing_events", lambda n: pytest.fail("a CPU clock made events"))
    clock = Clock(torch.device("cpu"))
    a, b = clock.stamp(), clock.stamp()
    clock.settle()
    assert clock.seconds(a, b) >= 0 and not clock.spare


def test_the_hidden_share_is_hidden_over_all_communication_of_every_step():
    from commbench.trainers.loop import PHASES, hidden_fraction

    def step(comm: float, hidden: float) -> list[float]:
        row = [0.0] * len(PHASES)
        row[PHASES.index("comm")], row[PHASES.index("hidden_comm")] = comm, hidden
        return row

    # summed over steps, not a mean of each step's share (which would be (0.5 + 0) / 2)
    times = torch.tensor([step(0.002, 0.001), step(0.008, 0.0)], dtype=torch.float64)
    assert hidden_fraction(times) == pytest.approx(0.1)
    assert hidden_fraction(torch.tensor([step(0.0, 0.0)])) is None  # no communication timed
    assert hidden_fraction(torch.empty(0, len(PHASES))) is None


def test_union_length_counts_each_stretch_once():
    """The length covered by intervals: overlaps once, one inside another once, gaps not at all,
    in whatever order they come."""
    assert timing.union_length([(0.0, 2.0), (1.0, 3.0)]) == 3.0  # overlapping: [0, 3]
    assert timing.union_length([(0.0, 5.0), (1.0, 2.0)]) == 5.0  # the second inside the first
    assert timing.union_length([(0.0, 1.0), (2.0, 3.0)]) == 2.0  # apart: the gap not counted
    assert timing.union_length([(0.0, 1.0), (1.0, 2.0)]) == 2.0  # end to end
    assert timing.union_length([(1.0, 3.0), (0.0, 2.0)]) == 3.0  # out of order
    assert timing.union_length([(4.0, 6.0), (0.0, 1.0), (0.5, 5.0)]) == 6.0  # chained, unsorted
    assert timing.union_length([(1.0, 2.0), (1.0, 2.0)]) == 1.0  # the same one twice
    assert timing.union_length([]) == 0.0
    assert timing.union_length(iter([(0.0, 2.0), (1.0, 3.0)])) == 3.0  # any iterable


def test_overlap_length_is_the_union_clipped_to_the_window():
    """Each interval is cut to the window before the union is taken; those outside it, or only
    touching its edge, add nothing."""
    assert timing.overlap_length([(0.0, 4.0), (3.0, 6.0)], (1.0, 5.0)) == 4.0  # [1, 4] and [3, 5]
    assert timing.overlap_length([(0.0, 10.0)], (2.0, 3.0)) == 1.0  # the window inside an interval
    assert timing.overlap_length([(0.0, 1.0), (5.0, 6.0)], (1.0, 5.0)) == 0.0  # touching its edges only
    assert timing.overlap_length([(0.0, 4.0), (6.0, 7.0)], (1.0, 5.0)) == 3.0  # one wholly past it
    assert timing.overlap_length([(2.0, 3.0), (0.0, 2.5)], (1.0, 5.0)) == 2.0  # out of order: [1, 3]
    assert timing.overlap_length([], (0.0, 1.0)) == 0.0
