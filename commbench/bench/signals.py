"""Signals noted instead of acted on, for code that must finish a step before it stops."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterable, Iterator


@contextlib.contextmanager
def noted(signals: Iterable[int]) -> Iterator[list[int]]:
    """While the block runs, each of ``signals`` that arrives is appended to the list this yields
    instead of acting; the previous handlers come back after.

    A signal the process inherited as ignored stays ignored. Off the main thread, where Python
    cannot set handlers, nothing is caught and the list stays empty.
    """
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return
    watched = [s for s in signals if signal.getsignal(s) != signal.SIG_IGN]
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in watched}
    try:
        yield got
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
