"""The ``commbench`` command and ``python -m commbench``.

The CLI's import (argparse, the records module: tens of milliseconds) runs here inside a guard,
so a Ctrl-C that lands before the CLI has its own handling in place still ends in the one line
and exit code of an interrupted run, not a traceback.
"""

from __future__ import annotations

import signal
import sys

INTERRUPTED = "commbench: interrupted"
STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOPPED = tuple(128 + s for s in STOPS)  # the exit codes of an interrupted run


def run(argv: list[str] | None = None) -> int:
    """Import the CLI and run it; returns the exit code."""
    try:
        from commbench.bench.cli import main
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return 128 + signal.SIGINT
    code = main(argv)
    if code in STOPPED:  # the exit's teardown puts the default actions back: a second Ctrl-C there
        for signum in STOPS:  # ended the process killed by SIGINT, not with 130
            signal.signal(signum, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    raise SystemExit(run())
