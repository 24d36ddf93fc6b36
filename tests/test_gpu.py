"""CUDA paths: NCCL at world size 1 (one GPU), gloo with CUDA tensors at 2 ranks, CUDA-event timing."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commbench.bench.launch import LaunchSpec, run

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu


def _all_cases(host_from: str | None = None, backend: str | None = None) -> list[str]:
    """Every collective, algorithm and a few dtypes/ops/sizes on CUDA tensors; returns failures.
    ``host_from`` sets $COMMBENCH_GLOO_CUDA_HOST_FROM, the size from which gloo's calls run on
    host copies (below it each message is staged). ``backend`` makes a group of that backend
    ("cpu:gloo,cuda:nccl") and runs every case on it, on host tensors as well."""
    import torch
    import torch.distributed as dist

    from commbench import comm
    from commbench.bench.collectives import SPECS, TWO_FORMS, ready_for_check

    if host_from is not None:
        os.environ[comm.HOST_FROM_ENV] = host_from
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.device("cuda", torch.cuda.current_device())
    group = dist.new_group(backend=backend) if backend is not None else None
    failures = []
    for device, collective in itertools.product(
        [cuda] if group is None else [cuda, torch.device("cpu")], comm.ALGORITHMS
    ):
        algorithms = comm.ALGORITHMS[collective]
        spec = SPECS[collective]
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for op in ("sum", "max") if spec.needs_op else ("sum",):
                for count in (0, 1, 1000 * world + 1, (1 << 20) * world):
                    if collective in ("reduce_scatter", "all_gather"):
                        count -= count % world
                    # both forms of reduce_scatter and all_gather (sweep --in-place)
                    forms = (False, True) if collective in TWO_FORMS else (False,)
                    for algorithm, in_place in itertools.product(algorithms, forms):
                        b = spec.make_for(count, dtype, device, rank, world, op, 0, in_place)
                        ready_for_check(b)
                        spec.run(b, algorithm, op, 0, group, comm.Workspace())
                        torch.cuda.synchronize()
                        wrong = spec.wrong(b, op, rank, world, 0)
                        if wrong:
                            what = f"{collective}/in-place" if in_place else collective
                            failures.append(
                                f"{device.type}/{what}/{algorithm}/{dtype}/{op}/{count}: {wrong} wrong"
                            )
    return failures


def test_nccl_world_of_one():
    """Every collective and algorithm on one NCCL rank. At one rank a result is the rank's own
    data, which an in-place call already holds: these show that each call runs on CUDA tensors and
    leaves them right, and out-of-place reduce_scatter and all_gather that they write their output."""
    results = run(_all_cases, (), LaunchSpec(world_size=1, device="cuda"))
    assert results == {0: []}


def _backends_of_a_group_per_device() -> dict[str, str]:
    import torch
    import torch.distributed as dist

    from commbench.comm import p2p

    group = dist.new_group(backend="cpu:gloo,cuda:nccl")
    return {d: p2p.backend_for(group, torch.device(d)) for d in ("cpu", "cuda")}


def test_a_group_with_a_backend_per_device():
    """A real "cpu:gloo,cuda:nccl" group (one rank): CUDA tensors go by NCCL, host tensors by
    gloo, and every collective and algorithm is right on both."""
    assert run(_backends_of_a_group_per_device, (), LaunchSpec(world_size=1, device="cuda")) == {
        0: {"cpu": "gloo", "cuda": "nccl"}
    }
    results = run(_all_cases, (None, "cpu:gloo,cuda:nccl"), LaunchSpec(world_size=1, device="cuda"))
    assert results == {0: []}


def _inference_on_cuda() -> list[str]:
    from tests.cases import _inference

    return _inference({"device": "cuda"})


@pytest.mark.parametrize(
    "spec",
    [LaunchSpec(world_size=1, device="cuda"), LaunchSpec(world_size=2, device="cuda", backend="gloo")],
    ids=["nccl-1", "gloo-2"],
)
def test_cuda_tensors_made_in_inference_mode_are_taken(spec):
    """Every collective and algorithm on CUDA tensors made under torch.inference_mode, and with a
    Workspace first used inside it: NCCL's own path and gloo's host copies of CUDA tensors."""
    results = run(_inference_on_cuda, (), spec)
    assert results == {rank: [] for rank in range(spec.world_size)}


def test_the_trainers_clock_hands_out_events_made_ahead():
    import torch

    from commbench.trainers.timing import Clock

    clock = Clock(torch.device("cuda"), stamps_per_step=2)
    ahead = list(clock.spare)
    assert all(e.cuda_event != 0 for e in ahead)  # made (torch makes an event on its first record)
    stamps = [clock.stamp()]
    torch.cuda._sleep(20_000_000)  # GPU cycles: about 10 to 20 ms at the clocks GPUs run at
    stamps += [clock.stamp() for _ in range(2)]
    assert stamps[:2] == ahead[::-1]
    clock.settle()
    assert len(clock.spare) == 3 and all(e.cuda_event != 0 for e in clock.spare)
    assert 0.002 <= clock.seconds(stamps[0], stamps[2]) <= 1.0  # seconds, the sleep between them
    assert 0 <= clock.seconds(stamps[1], stamps[2]) < clock.seconds(stamps[0], stamps[1])


@pytest.mark.parametrize("host_from", [None, "1M"], ids=["default", "staged-below-1M"])
def test_gloo_with_cuda_tensors_at_two_ranks(host_from):
    results = run(_all_cases, (host_from,), LaunchSpec(world_size=2, device="cuda", backend="gloo"))
    assert results == {0: [], 1: []}


@pytest.mark.parametrize("args", [["--world-size", "1"], ["--world-size", "2", "--backend", "gloo"]])
def test_cuda_sweep(tmp_path, args):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "commbench",
            "sweep",
            "--device",
            "cuda",
            "-b",
            "1K",
            "-e",
            "16M",
            "-f",
            "16",
            "-n",
            "5",
            "-w",
            "2",
            "--json",
            str(tmp_path / "r.jsonl"),
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    header, *lines = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    records = [r for r in lines if r["type"] == "sweep"]
    assert records and all(r["device"] == "cuda" and r["wrong"] == 0 for r in records)
    # each rank's GPU, by name, UUID and PCI address as NVML gives them (one GPU here: every rank's is 0)
    places = header["ranks"]
    assert len(places) == int(args[1]) and {p["device"] for p in places} == {"cuda:0"}
    import pynvml

    def text(value: str | bytes) -> str:
        return value.decode() if isinstance(value, bytes) else value

    pynvml.nvmlInit()  # NVML's word on GPU 0, against what the ranks took from torch
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        bus = text(pynvml.nvmlDeviceGetPciInfo(handle).busId).lower()  # "00000000:1b:00.0"
        name, uuid = text(pynvml.nvmlDeviceGetName(handle)), text(pynvml.nvmlDeviceGetUUID(handle))
    finally:
        pynvml.nvmlShutdown()
    assert {p["gpu"] for p in places} == {name}
    assert {f"GPU-{p['uuid']}" for p in places} == {uuid}
    assert all(len(p["pci"]) == len("0000:1b:00.0") and bus.endswith(p["pci"]) for p in places), (bus, places)
    assert f"#  rank 0: host {places[0]['host']}, pid {places[0]['pid']}, cuda:0 " in out.stdout


def _batch_searches(tmp_path: Path, command: str, *args: str) -> list[dict]:
    """The train summaries of ``commbench COMMAND --device cuda --batch-size 0 ARGS``, which must
    end well."""
    path = tmp_path / "t.jsonl"
    argv = [command, "--device", "cuda", "--batch-size", "0", "--no-eval", "-q", "--json", str(path), *args]
    out = subprocess.run(
        [sys.executable, "-m", "commbench", *argv], capture_output=True, text=True, cwd=ROOT, timeout=400
    )
    assert out.returncode == 0, out.stderr
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["type"] == "train_summary"]


@pytest.mark.parametrize(
    "args, batch",
    [(["--strategy", "none"], 300), (["--strategy", "ring", "--world-size", "2", "--backend", "gloo"], 150)],
    ids=["one-rank", "two-ranks"],
)
def test_largest_batch_is_capped_by_the_data(tmp_path, args, batch):
    """--batch-size 0 on a small dataset: the model fits far more, so the data's share per rank wins."""
    summaries = _batch_searches(
        tmp_path, "train", "--model", "mlp", "--model-opt", "widths=32", "--samples", "300", *args
    )
    assert summaries and all(s["batch_size"] == batch for s in summaries)


def test_a_batch_the_memory_bounds_trains(tmp_path):
    """--batch-size 0 where GPU memory, not the data, sets the batch: the batch found trains, with
    several strategies' models resident. A batch found at the edge of a lone trial step's memory
    ran out of it before training had taken a step."""
    strategies = ["--world-size", "1", "--strategies", "none,ddp,vanilla-dp"]
    model = ["--model", "resnet18_cifar", "--samples", "200000", "--steps-per-epoch", "2"]
    summaries = _batch_searches(tmp_path, "compare", *strategies, *model)
    batches = {s["batch_size"] for s in summaries}
    assert len(summaries) == 3 and len(batches) == 1 and 0 < batches.pop() < 200000, summaries


@pytest.mark.parametrize("ranks", [["--world-size", "1"], ["--world-size", "2", "--backend", "gloo"]])
def test_a_sweep_beyond_the_gpus_memory_is_refused_before_it_runs(tmp_path, ranks):
    """It ran the smaller sizes, then its rank failed on CUDA's out-of-memory error."""
    path = tmp_path / "r.jsonl"
    argv = ["sweep", "--device", "cuda", *ranks, "-a", "builtin", "-b", "1M", "-e", "1024G"]
    out = subprocess.run(
        [sys.executable, "-m", "commbench", *argv, "--json", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},  # both ranks on one GPU, however many there are
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "failed: ValueError: at 1099511627776 bytes the sweep's buffers" in out.stderr
    assert f"({ranks[1]} rank(s) on it)" in out.stderr and "on GPU 0 of " in out.stderr
    assert not [r for r in map(json.loads, path.read_text().splitlines()) if r["type"] == "sweep"]


def _train_on_one_gpu(*args: str) -> subprocess.CompletedProcess:
    argv = ["train", "--device", "cuda", "--world-size", "1", "--strategy", "ddp", "--no-eval", *args]
    return subprocess.run(
        [sys.executable, "-m", "commbench", *argv], capture_output=True, text=True, cwd=ROOT, timeout=180
    )


@pytest.mark.parametrize("batch", ["8", "0"], ids=["given", "searched"])
def test_a_resized_input_larger_than_the_gpu_is_refused_in_one_line(batch):
    """image_size=100000 ran out of CUDA's memory in the rank (894 GiB asked of an 80 GB H100), exit 1;
    a searched batch is held to a batch of one. A side of 10^6 is 12 TB an image, past any GPU
    (10^5's 112 GiB fits an H200, whose batch search then found no batch)."""
    out = _train_on_one_gpu("--model", "resnet18", "--model-opt", "image_size=1000000", "--batch-size", batch)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    shown = "8" if batch == "8" else "1"
    assert f"failed: ValueError: option image_size=1000000: a batch of {shown} resized to" in out.stderr
    assert "where GPU 0 has " in out.stderr and "OutOfMemoryError" not in out.stderr


def test_a_batch_whose_activations_pass_the_gpus_memory_is_refused_in_one_line():
    """Its input fits (12 GB at 224x224) and vgg16's first layer's output does not (257 GB): CUDA's
    out-of-memory error, torch's paragraph and exit 1 before, is now the batch's refusal."""
    out = _train_on_one_gpu("--model", "vgg16", "--batch-size", "20000", "--samples", "20000")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    said = (
        "failed: ValueError: a batch of 20000 of vgg16 does not fit in the GPU's memory: CUDA out of memory, "
    )
    assert said in out.stderr and "(lower --batch-size, or give --batch-size 0" in out.stderr


def _judged(records: list[dict], what: str) -> None:
    """Each record's interface count agrees with its computed bytes as on the CPU (test_wire_e2e)."""
    assert records, what
    for r in records:
        where = f"{what}: {r.get('algorithm', r.get('strategy'))} at {r.get('size_bytes', r.get('epoch'))}"
        assert r["computed_wire_bytes"] and r["measured_wire_bytes"], where
        assert r["wire_check"] is None, (where, r["wire_check"])
        assert r["wire_bytes_ratio"] == pytest.approx(r["wire_expected_ratio"], rel=0.02), where


def test_gloos_traffic_with_cuda_tensors_is_counted_on_the_wire(tmp_path):
    """gloo sends host copies of CUDA tensors over TCP, so the interface counts them as it counts
    host tensors'; these runs carried no wire count before (it was for the CPU alone)."""
    run = [sys.executable, "-m", "commbench"]
    gloo = ["--device", "cuda", "--world-size", "2", "--backend", "gloo"]
    for collective in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"):
        path = tmp_path / f"{collective}.jsonl"
        argv = ["sweep", *gloo, "--collective", collective, "-b", "1M", "-e", "4M", "-f", "4", "-n", "3"]
        out = subprocess.run(
            [*run, *argv, "-w", "1", "--json", str(path)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=200,
        )
        assert out.returncode == 0 and "wire bytes off" not in out.stdout, out.stdout + out.stderr
        _judged(
            [r for r in map(json.loads, path.read_text().splitlines()) if r["type"] == "sweep"], collective
        )
    path = tmp_path / "compare.jsonl"
    argv = ["compare", *gloo, "--strategies", "naive,ring,bucketed,ddp", "--samples", "2048"]
    argv += ["--steps-per-epoch", "4", "--no-eval", "-q", "--json", str(path)]
    out = subprocess.run([*run, *argv], capture_output=True, text=True, cwd=ROOT, timeout=200)
    assert out.returncode == 0 and "wire bytes off" not in out.stdout, out.stdout + out.stderr
    _judged([r for r in map(json.loads, path.read_text().splitlines()) if r["type"] == "epoch"], "compare")


SYNCS = ("naive", "ring", "bucketed")


def _syncs_on_cuda() -> dict[str, object]:
    """The gradient syncs as a library with CUDA models (tests/train_cases.run_sync_case): each
    one's wrap from a seed per rank, two backwards against DDP's, and bucketed's mismatches."""
    from tests.train_cases import run_sync_case

    results: dict[str, object] = {}
    for sync in SYNCS:
        results[f"{sync}/start"] = run_sync_case({"sync": sync, "kind": "start", "device": "cuda"})
        case = {"sync": sync, "kind": "accumulate", "each": True, "device": "cuda"}
        results[f"{sync}/accumulate"] = run_sync_case(case)
    lone = {"sync": "bucketed", "kind": "accumulate", "each": False, "device": "cuda"}
    results["bucketed/accumulate-once"] = run_sync_case(lone)
    for how in ("wider", "transposed", "dtype"):
        case = {"sync": "bucketed", "kind": "mismatch", "how": how, "device": "cuda"}
        results[f"bucketed/mismatch-{how}"] = run_sync_case(case)
    return results


def test_the_hand_written_syncs_with_cuda_models_match_ddp_at_two_ranks():
    """gloo with CUDA models at 2 ranks: wrap gives rank 1, built from another seed, rank 0's
    parameters (a broadcast of CUDA tensors, the layout's hash compared on the host); two
    backwards before one sync leave DDP's gradients; bucketed refuses a second backward without
    before_backward, and models that differ, on each rank."""
    import torch

    results = run(_syncs_on_cuda, (), LaunchSpec(world_size=2, device="cuda", backend="gloo"))
    torch.manual_seed(100)
    built = list(
        torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).parameters()
    )
    for sync in SYNCS:
        first, second = results[0][f"{sync}/start"], results[1][f"{sync}/start"]
        for mine, zero, own in zip(second, first, built, strict=True):
            assert torch.equal(mine, zero) and torch.equal(zero, own.detach()), sync
        for rank in (0, 1):
            diff = results[rank][f"{sync}/accumulate"]
            assert isinstance(diff, float) and diff < 1e-5, (sync, rank, diff)
    for rank in (0, 1):
        text = results[rank]["bucketed/accumulate-once"]
        assert "got a second gradient before after_backward" in str(text), text
        for how in ("wider", "transposed", "dtype"):
            text = results[rank][f"bucketed/mismatch-{how}"]
            assert str(text).startswith("the ranks' models differ"), (how, text)


def _start_alike_on_one_nccl_rank() -> dict[str, object]:
    """start_alike's own path on NCCL (its hash goes to the GPU; wrap skips it at one rank), on a
    model with BatchNorm buffers, then each sync's two backwards against DDP's."""
    import torch

    from commbench.trainers import sync
    from tests.train_cases import run_sync_case

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5)).cuda()
    model(torch.randn(4, 6, device="cuda"))  # running statistics away from their start
    before = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
    sync.start_alike(model)
    sync.broadcast_buffers(model)
    after = [*model.parameters(), *model.buffers()]
    results: dict[str, object] = {
        "kept": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        "backend": torch.distributed.get_backend(),
    }
    for name in SYNCS:
        case = {"sync": name, "kind": "accumulate", "each": True, "device": "cuda"}
        results[name] = run_sync_case(case)
    return results


def test_start_alike_and_the_syncs_on_one_nccl_rank():
    (result,) = run(_start_alike_on_one_nccl_rank, (), LaunchSpec(world_size=1, device="cuda")).values()
    assert result["backend"] == "nccl" and result["kept"] is True, result
    for name in SYNCS:
        assert isinstance(result[name], float) and result[name] < 1e-5, (name, result[name])


def _train_on_cuda(case: dict) -> object:
    from tests.train_cases import run_train_case

    return run_train_case({**case, "device": "cuda"})


def test_every_strategy_trains_a_model_with_batchnorm_on_cuda_as_ddp():
    """vgg11 (eight BatchNorm2d) on CUDA, gloo at 2 ranks, three steps: each hand-written
    strategy's parameters and buffers against DDP's. The bound is looser than the CPU test's 1e-6
    (cuDNN's backward may add in another order); without the buffers' broadcast, rank 1's
    statistics were 0.02 off there."""
    from tests.train_cases import BATCHNORM_RUN

    config = dict(strategies=("naive", "ring", "bucketed", "ddp"), lr=0.05, evaluate=True, **BATCHNORM_RUN)
    results = run(
        _train_on_cuda,
        ({"config": config, "diff_against": "ddp"},),
        LaunchSpec(world_size=2, device="cuda", backend="gloo"),
    )
    for rank, r in results.items():
        assert r["buffer_count"] == 3 * 8, r["buffer_count"]
        for s in ("naive", "ring", "bucketed"):
            assert r["param_diff"][s] < 1e-4, (s, rank, r["param_diff"])
            assert r["buffer_diff"][s] < 1e-4, (s, rank, r["buffer_diff"])
