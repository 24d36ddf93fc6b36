"""$OMP_NUM_THREADS, read without torch: libgomp, loaded with torch, prints its own complaint about
a bad value (four lines a process), so the command refuses it before it imports torch."""

from __future__ import annotations

import os


def omp_threads() -> int | None:
    """The thread count $OMP_NUM_THREADS gives (the first of a list, as OpenMP reads "4,2"); None
    where unset. ValueError (one line) for what OpenMP would refuse: libgomp printed four lines of
    "Invalid value" from each rank, and the run went on with another count."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None
    counts = value.split(",")
    if not all(c.strip().isascii() and c.strip().isdigit() and int(c) >= 1 for c in counts):
        raise ValueError(f"$OMP_NUM_THREADS={value!r} is not a thread count: give a whole number >= 1")
    return int(counts[0])
