"""The ``commbench`` command and ``python -m commbench``.

The CLI's import (argparse, the records module: tens of milliseconds) runs here inside a guard,
so a Ctrl-C that lands before the CLI has its own handling in place still ends in the one line
and exit code of an interrupted run, not a traceback.
"""

from __future__ import annotations

import signal
import sys

INTERRUPTED = "commbench: interrupted"


def run(argv: list[str] | None = None) -> int:
    """Import the CLI and run it; returns the exit code."""
    try:
        from commbench.bench.cli import main
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return 128 + signal.SIGINT
    code = main(argv)
    from commbench.bench import signals  # loaded by main already

    if code in (128 + s for s in signals.STOPS):  # interrupted: the exit's teardown puts the default
        for signum in signals.STOPS:  # actions back, and a second Ctrl-C there ended the process
            signal.signal(signum, signal.SIG_IGN)  # killed by SIGINT, not with 130
    return code


if __name__ == "__main__":
    raise SystemExit(run())
