"""Imported last in the fork server that starts local ranks (see :mod:`commbench.bench.starter`).

Once its imports are done the server ignores Ctrl-C (multiprocessing sets that), and a child it
forks keeps that disposition until it restores the default, a moment after the fork. A Ctrl-C,
or the launcher's SIGINT that follows it, sent to a rank in that moment was discarded: on a busy
machine a just-forked rank may not run for a while, and it then went on to join its group, and
the launcher waited out its 30 s grace period before killing it.

From here on the server holds the stop signals blocked: SIGINT, and a closed terminal's SIGHUP
and SIGTERM, which reach it with the rest of the terminal's process group (or of a group that
``kill`` or a job scheduler signals). Linux keeps a blocked signal pending even while it is
ignored, so a rank inherits the block and keeps a signal sent to it before it is ready; the rank
unblocks them once it has set its own dispositions (:func:`commbench.bench.launch.unblock_stop`),
and a pending one then acts.

The server must outlive its ranks: the launcher's agent learns that a rank has ended from the
server, through a pipe that the server writes the rank's exit status to. When SIGHUP or SIGTERM
ended the server, the agent read the closed pipe as the rank's end and the launcher returned,
and removed its scratch directory, while the ranks were still leaving and writing their records
into it. The server itself is stopped by its launcher closing their pipe (the launcher's exit,
whatever ended it), or by SIGKILL.
"""

from __future__ import annotations

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGHUP, signal.SIGTERM})
