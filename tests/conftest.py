from __future__ import annotations

import signal

import pytest

from tests import recorded
from tests.world import worlds_of


def pytest_configure(config):
    """The stop tests send SIGINT, SIGTERM and SIGHUP to commbench processes they start, and to
    commbench's code in this one. A suite started with one ignored (``make test &`` from a script
    ignores SIGINT, ``nohup make test`` SIGHUP) would pass that on to them, and commbench keeps an
    inherited ignore (a stop the user asked to ignore). Give the suite a Python handler instead,
    which its children do not inherit, so they start as from a terminal: Python's own for SIGINT,
    and for the others one that lets this process go on, as its starter meant."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_IGN:
            signal.signal(signum, _go_on)


def _go_on(signum, frame):
    pass


@pytest.fixture(scope="session")
def recorded_sweep(tmp_path_factory) -> recorded.Run:
    """The session's one real sweep (see tests/recorded.py)."""
    return recorded.record_sweep(tmp_path_factory.mktemp("recorded-sweep"))


@pytest.fixture(scope="session")
def recorded_compare(tmp_path_factory) -> recorded.Run:
    """The session's one real compare (see tests/recorded.py)."""
    return recorded.record_compare(tmp_path_factory.mktemp("recorded-compare"))


@pytest.fixture
def no_ranks(monkeypatch):
    """For a refusal that must come before any rank starts: starting them fails the test (each
    rank would refuse the same input too, once launched, so the outcome alone cannot tell)."""
    from commbench.bench import launch

    def started(*args, **kwargs):
        raise AssertionError("the ranks were started")

    monkeypatch.setattr(launch, "run", started)


@pytest.fixture(scope="module")
def worlds():
    """Gloo worlds of 1 to 5 CPU ranks, started on first use and kept for the module (idle ranks
    and their launchers are not left polling while later modules run)."""
    from tests.cases import run_case

    with worlds_of(run_case) as get:
        yield get


@pytest.fixture(scope="module", autouse=True)
def no_process_group_left():
    """A module that leaves a default process group in the pytest process makes every later test
    that starts one fail with "initialize the default process group twice": fail the module instead."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("this module left a default process group in the pytest process")


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is present; elsewhere they are skipped with the reason."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is visible to torch here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
