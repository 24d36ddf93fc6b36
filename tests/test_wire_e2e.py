"""Computed wire bytes against the interface's own count, for real: CPU ranks over loopback.

Loopback is one interface shared by every rank, so its counter is compared with the sum over
ranks; messages of 1 MiB and more must agree within 2% once TCP/IP framing is allowed for.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str]) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "commbench", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_sweep_bytes_match_loopback_counter(tmp_path: Path) -> None:
    world = 3
    path = tmp_path / "w.jsonl"
    out = _run(
        [
            "sweep",
            "--world-size",
            str(world),
            "-b",
            "1M",
            "-e",
            "2M",
            "-n",
            "2",
            "-w",
            "1",
            "-a",
            "naive,ring",
            "--json",
            str(path),
        ]
    )
    assert "# probes: every 0.1 s on lo" in out.stdout
    sweep = [r for r in _records(path) if r["type"] == "sweep"]
    assert len(sweep) == 2 * 3  # two sizes x (naive, ring, limit)
    for r in sweep:
        where = f"{r['algorithm']} at {r['size_bytes']} B"
        assert r["computed_wire_bytes"] == sum(r["computed_sent_bytes_per_rank"]), where
        assert r["wire_check"] is None, where
        assert r["wire_bytes_ratio"] == pytest.approx(r["wire_expected_ratio"], rel=0.02), where
        (host,) = r["hosts"]  # one machine, one shared interface, every rank on it
        assert host["nic"] == "lo" and host["ranks"] == list(range(world))
        assert host["computed_tx_bytes"] == r["computed_wire_bytes"]
        assert host["tx_bytes"] == r["measured_wire_bytes"]
    naive = next(r for r in sweep if r["algorithm"] == "naive")
    s = naive["size_bytes"]
    assert naive["computed_wire_bytes"] == 2 * (world - 1) * s  # n-1 tensors in, n-1 results out


def test_training_epoch_bytes_match_loopback_counter(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    _run(
        [
            "compare",
            "--world-size",
            "2",
            "--strategies",
            "naive,bucketed,ddp",
            "--model",
            "mlp",
            "--model-opt",
            "widths=256,256",
            "--samples",
            "1024",
            "--steps-per-epoch",
            "4",
            "--no-eval",
            "--json",
            str(path),
            "-q",
        ]
    )
    epochs = [r for r in _records(path) if r["type"] == "epoch"]
    assert {e["strategy"] for e in epochs} == {"naive", "bucketed", "ddp"}
    for e in epochs:
        # 269,322 float32 gradients per step: ~1.08 MB per rank and sync, over 1 MiB.
        assert e["wire_check"] is None, e["strategy"]
        assert e["wire_bytes_ratio"] == pytest.approx(e["wire_expected_ratio"], rel=0.02), e["strategy"]
    probe = _records(path)[-1]
    assert probe["type"] == "probe"
    labels = [m["label"] for m in probe["markers"]]
    assert labels == ["1: naive epoch 1", "2: bucketed epoch 1", "3: ddp epoch 1"]
