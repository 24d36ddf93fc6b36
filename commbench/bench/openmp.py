"""$OMP_NUM_THREADS, read without torch: libgomp, loaded with torch, prints its own complaint about
a bad value (four lines a process), so the command refuses it before it imports torch."""

from __future__ import annotations

import os
import re

MAX_THREADS = 4096  # past any host's cores; torch takes a C int, and libgomp an unsigned long


def omp_threads() -> int | None:
    """The thread count $OMP_NUM_THREADS gives (the first of a list, as OpenMP reads "4,2"); None
    where unset. ValueError (one line) for what OpenMP refuses (libgomp printed four lines of
    "Invalid value" from each process, and the run went on with another count) and for counts past
    MAX_THREADS (a count past a C int failed in a rank, "Overflow when unpacking long")."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None
    counts = value.split(",")
    if not all(re.fullmatch(r"\s*\+?[0-9]{1,9}\s*", c) and 1 <= int(c) <= MAX_THREADS for c in counts):
        raise ValueError(
            f"$OMP_NUM_THREADS={value!r} is not a thread count: give a whole number from 1 to {MAX_THREADS}"
        )
    return int(counts[0])
