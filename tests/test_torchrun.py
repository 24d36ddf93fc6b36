"""Under torchrun commbench takes the launcher's world instead of starting its own ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sweep_under_torchrun(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "3",
            "-m",
            "commbench",
            "sweep",
            "-b",
            "4K",
            "-e",
            "4K",
            "-n",
            "2",
            "-w",
            "1",
            "-a",
            "ring,naive",
            "--json",
            str(tmp_path / "r.jsonl"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()[1:]]
    records = [r for r in lines if r["type"] == "sweep"]
    assert {r["world_size"] for r in records} == {3}
    assert all(r["wrong"] == 0 for r in records)
    assert out.stdout.count("# commbench sweep:") == 1  # one table, printed by rank 0 only


def test_world_size_that_contradicts_torchrun_is_bad_input():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "commbench",
            "sweep",
            "--world-size",
            "4",
            "-b",
            "1K",
            "-e",
            "1K",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
    )
    assert out.returncode != 0
    assert "disagrees with the launcher's world of 2" in out.stderr
