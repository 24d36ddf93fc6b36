"""``commbench train`` and ``commbench compare``: bad input is one line and exit 2; a run writes the
table, the records the issue names, and the plots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from commbench.bench.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "mlp", "--model-opt", "widths=32", "--samples", "256", "--steps-per-epoch", "3"]
SUMMARY_KEYS = (
    "strategy",
    "world_size",
    "step_time_ms",
    "compute_ms",
    "comm_ms",
    "exposed_comm_ms",
    "hidden_comm_fraction",
    "images_per_s",
    "trainable_params",
    "grad_bytes_per_epoch",
    "wire_bytes_per_rank_per_epoch",
)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["train", "--strategy", "bogus"], "unknown strategy 'bogus'"),
        (["compare", "--strategies", "ring,ring"], "listed twice"),
        (["train", "--model", "bogus"], "unknown model"),
        (["train", "--model-opt", "widths"], "widths"),
        (["train", "--model", "mlp", "--model-opt", "colour=red"], "colour"),
        (["train", "--dataset", "mnist"], "--data-dir"),
        (["train", "--dataset", "mnist", "--data-dir", "/nonexistent"], "/nonexistent"),
        (["train", "--strategy", "none", "--world-size", "2"], "one process"),
        (["train", "--strategy", "dp"], "needs --device cuda"),
        (["train", "--epochs", "0"], "epochs"),
        (["train", "--lr", "0"], "lr"),
        (["train", "--lr", "nan"], "lr"),
        (["train", "--bucket-cap-mb", "-1"], "bucket cap"),
        (["train", "--transport", "pigeon"], "invalid choice"),
        (["train", "--momentum", "1"], "momentum"),
        (["train", "--json", "/nonexistent-dir/x.jsonl"], "cannot write"),
        (["compare", "--world-size", "0"], "world size"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv: list[str], needle: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_batch_search_needs_cuda(capsys) -> None:
    assert main(["train", "--strategy", "none", "--batch-size", "0", *TINY, "-q"]) == 2
    assert "needs --device cuda" in capsys.readouterr().err


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "commbench", *args], capture_output=True, text=True, cwd=ROOT, timeout=240
    )


def test_compare_writes_table_records_and_plots(tmp_path: Path) -> None:
    out = _run(
        [
            "compare",
            "--strategies",
            "naive,bucketed,ddp",
            "--world-size",
            "2",
            "--epochs",
            "2",
            *TINY,
            "--batch-size",
            "16",
            "--json",
            str(tmp_path / "c.jsonl"),
            "--plot",
            str(tmp_path / "c.png"),
        ]
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    rows = {
        line.split()[0]: line.split()
        for line in lines
        if line.split() and line.split()[0] in ("naive", "bucketed", "ddp")
    }
    assert set(rows) == {"naive", "bucketed", "ddp"}
    assert rows["ddp"][-1] == "1.00"  # the ratio column of the reference
    records = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert records[0]["type"] == "header" and records[0]["config"]["strategies"] == [
        "naive",
        "bucketed",
        "ddp",
    ]
    epochs = [r for r in records if r["type"] == "epoch"]
    assert sorted((r["strategy"], r["epoch"]) for r in epochs) == sorted(
        (s, e) for s in ("naive", "bucketed", "ddp") for e in (1, 2)
    )
    assert all(len(r["step_losses"]) == 3 and r["first_epoch"] == (r["epoch"] == 1) for r in epochs)
    summaries = {r["strategy"]: r for r in records if r["type"] == "train_summary"}
    assert set(summaries) == {"naive", "bucketed", "ddp"}
    for s in summaries.values():
        assert all(k in s for k in SUMMARY_KEYS)
        assert s["world_size"] == 2 and s["steps_timed"] == 3
        assert s["trainable_params"] == 784 * 32 + 32 + 32 * 10 + 10
        assert s["grad_bytes_per_epoch"] == s["trainable_params"] * 4 * 3
        assert len(s["wire_bytes_per_rank_per_epoch"]) == 2
    naive = summaries["naive"]["wire_bytes_per_rank_per_epoch"]
    assert naive[0] == naive[1]  # 2 ranks: rank 1 sends its gradients, rank 0 sends the sum back
    for name in ("c.png", "c-loss.png", "c-timeline.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG", name


def test_train_none_runs_on_one_rank_without_world_size(tmp_path: Path) -> None:
    out = _run(["train", "--strategy", "none", *TINY, "--json", str(tmp_path / "t.jsonl"), "-q"])
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""  # -q: no table
    summary = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()][-2]
    assert summary["type"] == "train_summary" and summary["world_size"] == 1
    assert summary["comm_ms"] == 0 and summary["hidden_comm_fraction"] is None
