"""Imported last in the fork server that starts local ranks (see :mod:`commbench.bench.starter`).

Once its imports are done the server ignores Ctrl-C (multiprocessing sets that), and a child it
forks keeps that disposition until it restores the default, a moment after the fork. A Ctrl-C,
or the launcher's SIGINT that follows it, sent to a rank in that moment was discarded: on a busy
machine a just-forked rank may not run for a while, and it then went on to join its group, and
the launcher waited out its 30 s grace period before killing it.

From here on the server holds SIGINT blocked. Linux keeps a blocked signal pending even while it
is ignored, so a rank inherits the block and keeps a SIGINT sent to it before it is ready; the
rank unblocks it once it has set its own disposition (:func:`commbench.bench.launch.unblock_stop`),
and the pending signal then acts. The server itself is stopped as before, by its launcher
closing their pipe, or by SIGTERM or SIGKILL.
"""

from __future__ import annotations

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
