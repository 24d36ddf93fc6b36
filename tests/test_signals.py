"""Handlers for the length of a block (commbench.bench.signals)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from commbench.bench import signals


class Stop(Exception):
    pass


def _raise(signum, frame):
    raise Stop(signum)


def test_a_handled_signal_raises_in_the_block_and_the_old_handlers_come_back():
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)
    with pytest.raises(Stop), signals.handled((signal.SIGUSR1,), _raise):
        os.kill(os.getpid(), signal.SIGUSR1)
        raise AssertionError("the handler did not run")
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)) == before


def test_a_handler_set_inside_the_block_is_undone_where_asked():
    """The elastic agent sets its own handlers and leaves them: also_restore puts back the old."""
    old = signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    try:
        with signals.handled((signal.SIGUSR1,), _raise, also_restore=(signal.SIGUSR2,)):
            signal.signal(signal.SIGUSR2, _raise)
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR2, old)


def test_an_ignored_signal_stays_ignored():
    old = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        with signals.noted((signal.SIGUSR1,)) as got:
            assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGUSR1)
        assert got == []
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_noted_signals_wait_in_the_list():
    with signals.noted((signal.SIGUSR1, signal.SIGUSR2)) as got:
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR1)
    assert got == [signal.SIGUSR2, signal.SIGUSR1]


def test_off_the_main_thread_nothing_changes():
    before = signal.getsignal(signal.SIGUSR1)
    seen = []

    def body():
        with signals.handled((signal.SIGUSR1,), _raise):
            seen.append(signal.getsignal(signal.SIGUSR1))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [before]


def test_further_signals_do_nothing_and_what_was_replaced_is_returned():
    """A stopping process lets later stops do nothing (a Python no-op, or SIG_IGN for one about to
    exit, where Python puts the default action back); one inherited as ignored stays ignored."""
    usr1, usr2 = signal.getsignal(signal.SIGUSR1), signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        replaced = signals.ignore_further((signal.SIGUSR1, signal.SIGUSR2))
        assert replaced == {signal.SIGUSR1: usr1}
        assert callable(signal.getsignal(signal.SIGUSR1))
        os.kill(os.getpid(), signal.SIGUSR1)  # its default action would end this process
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
        assert signals.ignore_further((signal.SIGUSR1,)) == {}  # done already
        signals.ignore_further((signal.SIGUSR1,), exiting=True)
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, usr1)
        signal.signal(signal.SIGUSR2, usr2)


def test_a_handler_set_outside_python_is_left_as_it_is_now():
    """getsignal gives None for a handler that Python did not set; signal.signal cannot take None
    back (TypeError), so restore skips it and the handler now in place stays."""
    old = signal.signal(signal.SIGUSR1, _raise)
    try:
        signals.restore({signal.SIGUSR1: None})
        assert signal.getsignal(signal.SIGUSR1) is _raise
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_ignoring_further_signals_off_the_main_thread_changes_nothing():
    """Only the main thread may set handlers: off it, signal.signal raised ValueError in the caller."""
    old = signal.signal(signal.SIGUSR1, _raise)
    got: list[object] = []

    def body():
        try:
            got.append(signals.ignore_further((signal.SIGUSR1,)))
        except Exception as exc:
            got.append(exc)

    try:
        t = threading.Thread(target=body)
        t.start()
        t.join(10)
        assert got == [{}]
        assert signal.getsignal(signal.SIGUSR1) is _raise
    finally:
        signal.signal(signal.SIGUSR1, old)
