"""Under torchrun commbench takes the launcher's world instead of starting its own ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from commbench.bench.cli import main

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
    # The ranks' own one-line errors first: torchrun's report of the failure fills the tail.
    said = "\n".join(line for line in out.stderr.splitlines() if line.startswith("commbench"))
    assert out.returncode == 0, f"{said}\n...\n{out.stderr[-2000:]}"
    lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()[1:]]
    records = [r for r in lines if r["type"] == "sweep"]
    assert {r["world_size"] for r in records} == {3}
    assert all(r["wrong"] == 0 for r in records)
    assert out.stdout.count("# commbench sweep:") == 1  # one table, printed by rank 0 only


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "0", "WORLD_SIZE": "2"},  # what torchrun sets
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "127.0.0.1"},  # what srun sets
    ],
)
def test_world_size_that_contradicts_the_launcher_is_bad_input(monkeypatch, capsys, env):
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["sweep", "--world-size", "4", "-b", "1K", "-e", "1K"]) == 2
    err = capsys.readouterr().err
    assert "disagrees with the launcher's world of 2" in err and err.count("\n") == 1
