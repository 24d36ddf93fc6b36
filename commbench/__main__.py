"""The ``commbench`` command and ``python -m commbench``.

The CLI's import (argparse, the records module: tens of milliseconds) runs here inside a guard,
so a Ctrl-C that lands before the CLI has its own handling in place still ends in the one line
and exit code of an interrupted run, not a traceback.
"""

from __future__ import annotations

import os
import signal
import sys

INTERRUPTED = "commbench: interrupted"


def run(argv: list[str] | None = None) -> int:
    """Import the CLI and run it; returns the exit code."""
    try:
        os.getcwd()
    except FileNotFoundError:  # torch's import, the fork server and relative paths each failed on it
        print(
            "commbench: error: the working directory no longer exists; cd to one that does", file=sys.stderr
        )
        return 2
    from commbench.bench import openmp

    try:
        openmp.omp_threads()  # before torch loads libgomp, which complains of a bad value itself
    except ValueError as exc:
        print(f"commbench: error: {exc}", file=sys.stderr)
        return 2
    try:
        from commbench.bench.cli import main
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return 128 + signal.SIGINT
    code = main(argv)
    from commbench.bench import signals  # loaded by main already

    # The command is over and its files are written. A Ctrl-C in the exit's teardown (torch's, about
    # a second) printed "Exception ignored in atexit callback ... KeyboardInterrupt" after a
    # finished run, and, where Python has put the default actions back in place of its handlers,
    # ended the process killed by SIGINT instead of with its code (130 for an interrupted run).
    for signum in signals.STOPS:
        signal.signal(signum, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    raise SystemExit(run())
