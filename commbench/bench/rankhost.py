"""Imported first in the server process that forks local ranks (see :mod:`commbench.bench.starter`).

The server starts with Ctrl-C ignored, so that one arriving while its interpreter starts prints
no traceback. Here, before it imports torch, Ctrl-C gets its default action: during those
seconds it ends the server at once and quietly. Once its imports are done the server ignores
Ctrl-C again on its own and holds it blocked (:mod:`commbench.bench.rankgate`); each rank it
forks gets the default action set here back, and the signal unblocked, before it installs its
own handlers (commbench.bench.launch). The server starts with SIGHUP ignored too (for the sake
of multiprocessing's resource tracker, started beside it); here it gets its default action
back, for the server and its ranks. Once the imports are done the server holds SIGHUP and
SIGTERM blocked as well as Ctrl-C, so that it outlives its ranks (commbench.bench.rankgate).

A rank forked at the moment of a stop may find its launcher gone before it has read its start-up
data; the error that follows is not printed (:func:`commbench.bench.starter.quiet_if_launcher_gone`).
The server is the last of a launch to end (after its launcher and their ranks), so it removes
what a launcher killed outright left behind as it ends
(:func:`commbench.bench.starter.remove_what_the_launcher_left`).
"""

from __future__ import annotations

import atexit
import signal
import sys

from commbench.bench import starter

sys.excepthook = starter.quiet_if_launcher_gone
atexit.register(starter.remove_what_the_launcher_left)
signal.signal(signal.SIGINT, signal.SIG_DFL)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
