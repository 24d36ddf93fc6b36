"""A probe that fails while a run goes on: the run finishes and keeps its records, one line says
the probe stopped, and no probe record is written. (The sampler's thread died on an NVML error or
a missing interface, and the next mark raised in the run, ending it.)"""

from __future__ import annotations

import json

import pytest

from commbench.bench.cli import main
from commbench.probes.sampler import Sampler
from tests.world import free_port


@pytest.fixture
def one_rank_here(monkeypatch):
    """This process is rank 0 of a job of one, as under torchrun: the run stays in this process."""
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))


@pytest.fixture
def failing_marks(monkeypatch):
    real, calls = Sampler.mark, []

    def mark(self, label):
        calls.append(label)
        if len(calls) > 1:
            raise OSError("device fell off the bus")
        return real(self, label)

    monkeypatch.setattr(Sampler, "mark", mark)
    return calls


@pytest.mark.parametrize(
    "argv, kind, count",
    [
        (
            [
                "train",
                "--strategy",
                "none",
                "--epochs",
                "3",
                "--model",
                "mlp",
                "--model-opt",
                "widths=32",
                "--samples",
                "256",
                "--steps-per-epoch",
                "2",
                "-q",
            ],
            "epoch",
            3,
        ),
        (["sweep", "-b", "1K", "-e", "8K", "-n", "2", "-w", "0", "-q"], "sweep", 4 * 4),
    ],
)
def test_a_probe_that_fails_leaves_the_run_and_its_records(
    one_rank_here, failing_marks, tmp_path, capsys, argv, kind, count
):
    out = tmp_path / "run.jsonl"
    assert main([*argv, "--json", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sum(r["type"] == kind for r in records) == count
    assert not any(r["type"] == "probe" for r in records)
    err = capsys.readouterr().err
    assert err.count("the probe stopped") == 1 and "fell off the bus" in err
    assert len(failing_marks) == 2  # once failed, the probe marks nothing more
