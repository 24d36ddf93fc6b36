"""The stop signals a test is parametrised over, one of them in `make test` and the others, which
take the same path, in `make test-slow` (to keep `make test` within CI's ten minutes)."""

from __future__ import annotations

import signal
from typing import Any

import pytest

STOPS = {"term": signal.SIGTERM, "hup": signal.SIGHUP, "int": signal.SIGINT}


def one_fast(fast: str) -> dict[str, Any]:
    """``parametrize`` arguments over the three stops, ``fast`` ("term", "hup" or "int") first."""
    names = [fast, *(n for n in STOPS if n != fast)]
    values = [STOPS[fast], *(pytest.param(STOPS[n], marks=pytest.mark.slow) for n in names[1:])]
    return {"argvalues": values, "ids": names}
