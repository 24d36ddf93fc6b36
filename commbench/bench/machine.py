"""Machine information attached once to every run's records."""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import commbench
from commbench import comm
from commbench.comm import p2p, tcp


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


PACKAGE = Path(__file__).resolve().parents[1]  # commbench's own directory
CHECKOUT = PACKAGE.parent  # the repository root, when run from a clone; else site-packages or such


def _git(root: Path, *args: str) -> str | None:
    """Output of a git command in ``root`` (None where git fails there)."""
    try:
        out = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(root), *args], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def git_commit(root: Path = CHECKOUT) -> tuple[str | None, bool | None]:
    """(HEAD's commit, whether tracked files differ from it) of the checkout at ``root`` that
    tracks the package (``root/commbench``); (None, None) where there is none.

    A run of modified code is not a run of its commit: the header says which it was. An installed
    copy sits in site-packages, where git finds whatever repository holds the virtual environment
    (the user's project): its commit is not commbench's, so ``root`` must be the top of the
    checkout and the package one of its tracked paths.
    """
    top = (_git(root, "rev-parse", "--show-toplevel") or "").strip()
    if not top or Path(top).resolve() != root.resolve():
        return None, None
    if not (_git(root, "ls-files", "--", f"{PACKAGE.name}/__init__.py") or "").strip():
        return None, None
    head = (_git(root, "rev-parse", "HEAD") or "").strip() or None
    if head is None:
        return None, None
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return head, None if status is None else bool(status.strip())


def _gpus() -> dict[str, Any] | None:
    """GPU names and driver through NVML, or None where there is no NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver: not an error, just no GPU information
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)]
        return {
            "driver": pynvml.nvmlSystemGetDriverVersion(),
            "devices": [n.decode() if isinstance(n, bytes) else n for n in names],
        }
    except Exception:  # a GPU NVML cannot query (off the bus, not ours): the run goes on without it
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def rank_device(kind: str) -> torch.device:
    """The device a rank of kind "cpu" or "cuda" runs on (its current GPU, which the launch set)."""
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


def rank_place(device: torch.device) -> dict[str, Any]:
    """Where this rank runs: its host (with the address ``commbench cluster`` gives each of its
    hosts, which share one hostname), process and device, with a GPU's name, UUID and PCI address
    (as nccl-tests lists each rank's before its table; torch gives no PCI function, taken as 0)."""
    place: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "device": str(device)}
    if os.environ.get("COMMBENCH_HOST_ADDRESS"):
        place["address"] = os.environ["COMMBENCH_HOST_ADDRESS"]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        place["gpu"] = props.name
        place["uuid"] = str(getattr(props, "uuid", "")) or None
        bus = [getattr(props, f"pci_{k}_id", None) for k in ("domain", "bus", "device")]
        if None not in bus:
            place["pci"] = f"{bus[0]:04x}:{bus[1]:02x}:{bus[2]:02x}.0"
    return place


def rank_places(device: torch.device) -> list[dict[str, Any]]:
    """Every rank's :func:`rank_place`, on every rank of the default group (one small all-gather)."""
    import torch.distributed as dist

    places: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(places, rank_place(device))
    return places


def describe_place(rank: int, place: dict[str, Any]) -> str:
    """One rank's line under a table's title: "rank 1: host h, pid 42, cuda:1 NVIDIA H100 [0000:1b:00.0]"."""
    where = place.get("device", "?")
    if place.get("gpu"):
        where += f" {place['gpu']}" + (f" [{place['pci']}]" if place.get("pci") else "")
    host = place.get("host", "?") + (f" ({place['address']})" if place.get("address") else "")
    return f"rank {rank}: host {host}, pid {place.get('pid', '?')}, {where}"


def place_lines(places: Sequence[dict[str, Any]] | None) -> str:
    """:func:`describe_place` for each rank, as lines under a table's title ("" for none)."""
    return "".join(f"#  {describe_place(i, p)}\n" for i, p in enumerate(places or ()))


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command line as typed: ``commbench`` and ``argv`` where the CLI was handed its words (a
    study runs each of its commands so, in its own process, whose arguments are the study's), else
    this process's own; ``python -m commbench`` and the script both read as commbench."""
    if argv is not None:
        return shlex.join(["commbench", *argv])
    first = sys.argv[0] if sys.argv else ""
    name = "commbench" if first.endswith(("__main__.py", "commbench")) else first
    return shlex.join([name, *sys.argv[1:]])


def _host_copies_from() -> int | str:
    """Bytes from which hand-written gloo calls on CUDA tensors run on host copies, or the setting
    that gives none (``never``, or what was refused)."""
    try:
        start = comm.stage_whole_from()
    except ValueError:
        return "invalid: " + os.environ.get(comm.HOST_FROM_ENV, "")
    return comm.NEVER if start is None else start


def _duplex() -> bool | str:
    """Whether a job of two gloo ranks gets one connection per direction, or the setting refused."""
    try:
        return p2p.duplex_setting()
    except ValueError:
        return "invalid: " + os.environ.get(p2p.DUPLEX_ENV, "")


def machine_info(backend: str | None = None, command: str | None = None) -> dict[str, Any]:
    """Hostname, CPU, library versions, GPUs, commbench's version and commit, and the command line
    of this run (``command``, as :func:`command_line` gave it in the process that parsed it; by
    default this process's own)."""
    import psutil

    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            nccl = None
    commit, modified = git_commit()
    return {
        "hostname": socket.gethostname(),
        "cpu_model": _cpu_model(),
        "cpu_logical_cores": os.cpu_count(),
        "cpu_physical_cores": psutil.cpu_count(logical=False),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": psutil.virtual_memory().total,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backend": backend,
        "nccl": nccl,
        "cuda": torch.version.cuda,
        "gpus": _gpus(),
        "tcp_congestion_control": tcp.summary(),
        "tcp_notsent_lowat": tcp.notsent_summary(),
        "gloo_cuda_host_copies_from": _host_copies_from(),
        "gloo_duplex": _duplex(),
        "commbench": commbench.__version__,  # an installed commbench has no commit to record
        "commit": commit,
        "commit_modified": modified,
        "command": command_line() if command is None else command,
    }
