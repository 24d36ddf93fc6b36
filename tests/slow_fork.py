"""Preloaded by a test's fork server: every child it forks waits a second before it restores the
signal dispositions the server changed, as a child not yet scheduled on a busy machine does."""

from __future__ import annotations

import time
from multiprocessing import forkserver

DELAY_S = 1.0
_serve_one = forkserver._serve_one


def _late(*args, **kwargs):
    time.sleep(DELAY_S)
    return _serve_one(*args, **kwargs)


forkserver._serve_one = _late
