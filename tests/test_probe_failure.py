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


@pytest.fixture
def fake_nvml(monkeypatch):
    """RunProbe opens this fake NVML instead of the machine's; its inits and shutdowns are counted."""
    from commbench.probes.nvml import Nvml
    from tests.fake_nvml import FakeNvmlModule

    fake, real = FakeNvmlModule(), Nvml.open_with_reason.__func__
    monkeypatch.setattr(Nvml, "open_with_reason", classmethod(lambda cls, module=None: real(cls, fake)))
    return fake


def test_a_probe_that_cannot_start_leaves_nvml_closed(fake_nvml, monkeypatch):
    """NVML was opened first and never shut down when the interface or the sampler failed."""
    from commbench.bench import probing

    monkeypatch.setenv("COMMBENCH_NIC", "nope0")
    with pytest.raises(ValueError, match="nope0"):
        probing.RunProbe(0.1)
    assert fake_nvml.inits == fake_nvml.shutdowns
    monkeypatch.delenv("COMMBENCH_NIC")

    def no_thread(*args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(probing, "Sampler", no_thread)
    with pytest.raises(RuntimeError, match="new thread"):
        probing.RunProbe(0.1)
    assert fake_nvml.inits == fake_nvml.shutdowns == 1


def test_a_probe_that_finishes_leaves_nvml_closed(fake_nvml, monkeypatch):
    from commbench.bench import probing

    monkeypatch.setenv("COMMBENCH_NIC", "lo")
    probe = probing.RunProbe(0.1)
    probe.mark("start")
    assert probe.finish()["type"] == "probe"
    assert fake_nvml.inits == fake_nvml.shutdowns == 1


def test_the_probe_interval_is_from_1_ms_to_a_minute():
    import argparse

    from commbench.bench import probing

    assert probing.probe_interval("0.001") == 0.001 and probing.probe_interval("60") == 60.0
    for text in ("0.0009", "60.5", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"must be between 0.001 and 60 s, got {text}"):
            probing.probe_interval(text)


def test_a_sweep_whose_probe_cannot_start_closes_its_record_file(fake_nvml, monkeypatch, tmp_path):
    """The record file, its header written, was left open when the probe failed to start."""
    from commbench.bench import sweep

    closed = []

    class Writer(sweep.RecordWriter):
        def close(self) -> None:
            closed.append(True)
            super().close()

    monkeypatch.setattr(sweep, "RecordWriter", Writer)
    monkeypatch.setenv("COMMBENCH_NIC", "nope0")
    with pytest.raises(ValueError, match="nope0"):
        sweep.Rank0Output(sweep.SweepConfig(json_path=str(tmp_path / "run.jsonl")), {"x": 1})
    assert closed == [True] and fake_nvml.inits == fake_nvml.shutdowns


def test_the_probe_line_gives_each_gpus_address_where_there_are_several(fake_nvml, monkeypatch):
    """NVML numbers every GPU of the host, CUDA only those $CUDA_VISIBLE_DEVICES leaves: the
    timeline's "GPU 1" was the rank lines' cuda:0 with nothing to match them by; the rank lines
    give each GPU's PCI address, and now the probe's line gives NVML's, in the same form."""
    from commbench.bench import probing
    from tests.fake_nvml import FakeDevice

    monkeypatch.setenv("COMMBENCH_NIC", "lo")
    probe = probing.RunProbe(0.1)
    try:
        assert probe.describe() == "# probes: every 0.1 s on lo; 1 GPU(s) through NVML"
    finally:
        probe.finish()
    fake_nvml.devices = [
        FakeDevice(bus_id="00000000:1B:00.0"),
        FakeDevice(bus_id="0001:c4:00.0"),
        FakeDevice(bus_id="x"),
    ]
    probe = probing.RunProbe(0.1)
    try:
        assert probe.describe() == (
            "# probes: every 0.1 s on lo; 3 GPU(s) through NVML "
            "(GPU 0 [0000:1b:00.0], GPU 1 [0001:c4:00.0], GPU 2 [?])"
        )
    finally:
        probe.finish()
