"""Signal handlers for the length of a block: noted instead of acted on, or raising."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

# The signals that end a run as interrupted: Ctrl-C, kill's default, and a closed terminal.
STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(Exception):
    """The run was stopped by a signal (Ctrl-C, SIGTERM); the ranks have been stopped. An Exception,
    so code that turns whatever a step raises into a note (a plot) must let it through by name."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


@contextlib.contextmanager
def handled(
    signals: Iterable[int], handler: Callable[[int, Any], None], also_restore: Iterable[int] = ()
) -> Iterator[None]:
    """While the block runs, each of ``signals`` goes to ``handler``; after it, the handlers from
    before come back, those of ``also_restore`` too (for code in the block that sets its own).

    A signal the process inherited as ignored (``nohup``) stays ignored. Off the main thread, where
    Python cannot set handlers, nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = tuple(signals)
    before = {s: signal.getsignal(s) for s in (*signals, *also_restore)}
    for s in signals:
        if before[s] != signal.SIG_IGN:
            signal.signal(s, handler)
    try:
        yield
    finally:
        restore(before)


def restore(handlers: dict[int, Any]) -> None:
    """Put back each signal's handler from ``handlers`` (as ``signal.getsignal`` gave them); a
    None, a handler set outside Python, cannot be put back and is left as it is now."""
    for s, old in handlers.items():
        if old is not None:
            signal.signal(s, old)


@contextlib.contextmanager
def noted(signals: Iterable[int]) -> Iterator[list[int]]:
    """While the block runs, each of ``signals`` that arrives is appended to the list this yields
    instead of acting (see :func:`handled`); off the main thread the list stays empty."""
    got: list[int] = []
    with handled(signals, lambda signum, frame: got.append(signum)):
        yield got


def ignore_further(signums: Iterable[int] = STOPS, *, exiting: bool = False) -> dict[int, Any]:
    """From now on each of ``signums`` does nothing, in a process that is stopping already: a second
    Ctrl-C cut its clean-up short (a scratch directory half removed, a KeyboardInterrupt in an exit
    handler). Returns the handlers it replaced, to put back where the stop turns out to be lost.

    The handler is a Python function that does nothing, not SIG_IGN: a signal that has reached the
    interpreter but not yet its Python handler is then reported as "Signal 15 ignored due to race
    condition" (seen under timeout(1), whose signal and the launcher's come together). With
    ``exiting``, for a process about to exit (not in a handler), it is SIG_IGN all the same: as it
    exits, Python puts back the default action in place of its own handlers, and a Ctrl-C in the
    second that tearing torch down takes then ended the process (killed by SIGINT, not exit 130).
    A signal inherited as ignored stays so; off the main thread nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        return {}
    quiet = signal.SIG_IGN if exiting else _nothing
    replaced = {}
    for s in signums:
        if signal.getsignal(s) not in (signal.SIG_IGN, quiet):
            replaced[s] = signal.signal(s, quiet)
    return replaced


def _nothing(signum: int, frame: Any) -> None:
    pass
