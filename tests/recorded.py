"""One real sweep and one real compare per test session, shared by the tests that read their output.

Each run starts ranks through the elastic launcher (seconds of start-up on a 2-core machine), so
the command-line, byte-check and report tests read the same two runs instead of making their own.
The runs are made with the options those tests need between them:

- sweep: 3 ranks (a ring's bus bandwidth factor differs from 1, loopback is shared by 3), sizes
  2K, 64K and 2M (the last judged by the byte check), every all_reduce algorithm kind;
- compare: 2 ranks, every strategy a multi-rank run can use on CPU, an MLP of 269,322
  parameters (gradients over 1 MiB, so every epoch is judged), two epochs with a plot, and a loss
  threshold.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SWEEP_WORLD = 3
SWEEP_ALGORITHMS = ("builtin", "naive", "ring", "auto")
SWEEP_SIZES = (2 << 10, 64 << 10, 2 << 20)
COMPARE_STRATEGIES = ("naive", "ring", "bucketed", "ddp")
COMPARE_WIDTHS = (256, 256)
COMPARE_EPOCHS = 2
COMPARE_STEPS = 3
COMPARE_LOSS_THRESHOLD = 100  # reached in the first epoch (the loss starts near ln 10)


@dataclass(frozen=True)
class Run:
    """What one ``commbench`` command printed and wrote."""

    argv: tuple[str, ...]
    stdout: str
    stderr: str
    json: Path
    plot: Path
    csv: Path | None = None

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.json.read_text().splitlines()]

    def of_type(self, kind: str) -> list[dict]:
        return [r for r in self.records() if r["type"] == kind]


def commbench(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m commbench ARGS`` from the repository root; output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "commbench", *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout
    )


def _checked(args: list[str], **paths: Path | None) -> Run:
    done = commbench(args)
    assert done.returncode == 0, done.stderr[-3000:]
    return Run(tuple(args), done.stdout, done.stderr, **paths)


def record_sweep(d: Path) -> Run:
    path, table, plot = d / "sweep.jsonl", d / "sweep.csv", d / "sweep.png"
    lo, hi = SWEEP_SIZES[0], SWEEP_SIZES[-1]
    factor = SWEEP_SIZES[1] // SWEEP_SIZES[0]
    args = ["sweep", "--world-size", str(SWEEP_WORLD), "-b", str(lo), "-e", str(hi), "-f", str(factor),
            "-n", "2", "-w", "1", "-a", ",".join(SWEEP_ALGORITHMS),
            "--json", str(path), "--csv", str(table), "--plot", str(plot)]  # fmt: skip
    return _checked(args, json=path, plot=plot, csv=table)


def record_compare(d: Path) -> Run:
    path, plot = d / "compare.jsonl", d / "compare.png"
    args = ["compare", "--world-size", "2", "--strategies", ",".join(COMPARE_STRATEGIES),
            "--model", "mlp", "--model-opt", "widths=" + ",".join(map(str, COMPARE_WIDTHS)),
            "--samples", "512", "--batch-size", "16", "--steps-per-epoch", str(COMPARE_STEPS),
            "--epochs", str(COMPARE_EPOCHS), "--json", str(path), "--plot", str(plot),
            "--loss-threshold", str(COMPARE_LOSS_THRESHOLD)]  # fmt: skip
    return _checked(args, json=path, plot=plot)
