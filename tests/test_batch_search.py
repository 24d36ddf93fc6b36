"""The largest-batch search behind ``--batch-size 0``, with a memory bound standing in for the GPU."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from commbench.trainers.loop import largest_fitting


@given(memory=st.integers(0, 5000), limit=st.integers(0, 5000))
def test_finds_the_smaller_of_memory_and_limit(memory: int, limit: int) -> None:
    tried: list[int] = []

    def fits(b: int) -> bool:
        assert 1 <= b <= limit, b  # never tries past the data's limit
        tried.append(b)
        return b <= memory

    assert largest_fitting(fits, limit) == min(memory, limit)
    # doubling, then bisection: about two tries per bit of the answer
    assert len(tried) <= 2 * math.ceil(math.log2(limit + 1)) + 1


def test_nothing_fits() -> None:
    assert largest_fitting(lambda b: False, 1 << 16) == 0
    assert largest_fitting(lambda b: True, 0) == 0


def test_limit_below_the_first_power_of_two_that_fails() -> None:
    assert largest_fitting(lambda b: b <= 100, 8192) == 100
    assert largest_fitting(lambda b: True, 300) == 300
