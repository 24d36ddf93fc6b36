"""``commbench profile -- <command>``: sample every rank of a commbench run with py-spy.

The inner command runs as ``python -m commbench ...``; as its ranks appear (the processes
commbench's launcher names ``commbench-r<rank>``, or processes with RANK in their environment
under torchrun and the emulated cluster) one ``py-spy record`` attaches to each and writes its
collapsed stacks. Each rank's main thread is then split into communication, compute and
elsewhere by the frames on its stacks, and the profile is also written in the format asked for
(speedscope JSON or a flame graph SVG).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import html
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from commbench.bench import signals, starter
from commbench.bench.records import directory_held, output_path, write_whole

FORMATS = ("speedscope", "flamegraph")
CATEGORIES = ("communication", "compute", "elsewhere")
POLL_S = 0.05
BAD_INPUT = 2  # the exit code of a commbench command that refused its arguments
STOP_GRACE_S = 20.0

# Frames that mean "waiting for or moving bytes": commbench's collectives, torch.distributed's
# collectives, work handles and comm hooks (by file), and the backends' native code. Not bare
# names such as "broadcast" or "wait (": they matched torch.functional's broadcast_tensors (under
# mse_loss) and any threading wait.
COMM_PATTERNS = (
    "commbench/comm/",
    "comm/ring.py",
    "comm/naive.py",
    "comm/tree.py",
    "comm/recursive.py",
    "comm/pipeline.py",
    "comm/p2p.py",
    "comm/builtin.py",
    "distributed_c10d.py",
    "c10d_logger.py",
    "torch/distributed/_functional_collectives",
    "torch/distributed/algorithms/",
    # DDP's buffer broadcast before forward, in torch/nn/parallel (else taken for compute by torch/nn/)
    "_sync_buffers (",
    "_broadcast_coalesced (",
    "Work.wait",
    "gloo",
    "nccl",
    "c10d::",
    "ProcessGroup",
)
# A threading wait is communication where a gradient-sync strategy makes it: the main thread
# waiting for the transport thread's allreduce of a bucket.
COMM_WAITERS = ("commbench/trainers/sync.py",)
# Setup (imports, joining and leaving the group) is neither, even where it runs torch code.
SETUP_PATTERNS = (
    "init_process_group",
    "rendezvous",
    "destroy_process_group",
    "_store_based_barrier",
    "_find_and_load",
    "<frozen importlib",
    # a rank that is done waits in the launcher's own code for the others: a wait, not a collective's
    "multiprocessing/synchronize.py",
)
# A model's or an autograd Function's forward and backward, by the frame's own name: a bare
# "backward (" took the sync strategies' after_backward, whose waits for an allreduce are not compute.
COMPUTE_NAMES = re.compile(r"(?:^|;|\.)(?:forward|backward) \(")
COMPUTE_PATTERNS = (
    "_call_impl",
    "_wrapped_call_impl",
    "torch/nn/",
    "torch/autograd/",
    "torch/optim/",
    "torch/_tensor.py",
    "torch/functional.py",
    "commbench/kernels/",
    "kernels/reduce.py",
    "kernels/compute.py",
    "kernels/bucket.py",
    "at::native",
    "at::_ops",
    "autograd::",
    "mkl",
    "dnnl",
    "gemm",
    "sleef",
    "libtorch_cpu",
    "libcublas",
    "libcudnn",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """``commbench profile``: the inner command and how to sample it."""

    inner: tuple[str, ...]
    out_dir: str = "profile"
    rate_hz: int = 100
    format: str = "speedscope"
    native: bool = True

    def __post_init__(self) -> None:
        if not self.inner:
            raise ValueError("no command after '--' (e.g. commbench profile -- compare --world-size 2)")
        if self.inner[0] in ("profile", "study", "report", "summary", "bandwidth"):
            raise ValueError(  # bandwidth, summary and report start no ranks: nothing would be sampled
                f"profile samples the ranks of sweep, train, compare, demo or cluster, not {self.inner[0]!r}"
            )
        if not 1 <= self.rate_hz <= 10000:
            raise ValueError(f"--rate must be in 1..10000 samples per second, got {self.rate_hz}")
        if self.format not in FORMATS:
            raise ValueError(f"unknown format {self.format!r}; choose from {', '.join(FORMATS)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankProfile:
    """One rank's samples (main thread) split by category, and the files written for it."""

    rank: int
    pid: int
    samples: int
    communication: int
    compute: int
    elsewhere: int
    native: bool
    raw_path: str
    profile_path: str | None
    top: dict[str, list[tuple[str, int]]]
    log_path: str | None = None  # py-spy's own output for this rank

    def share(self, category: str) -> float:
        return getattr(self, category) / self.samples if self.samples else 0.0

    def failure(self) -> str:
        """Why this rank has no samples: the last line py-spy wrote, or that it wrote none."""
        text = ""
        if self.log_path:
            with contextlib.suppress(OSError):
                text = Path(self.log_path).read_text(errors="replace")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if lines:
            return f"py-spy: {lines[-1]}"
        raw = Path(self.raw_path)
        return "no main-thread samples" if raw.exists() and raw.stat().st_size else "py-spy recorded nothing"


# ---- py-spy ---------------------------------------------------------------------------------


def find_py_spy() -> str | None:
    """py-spy beside this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def check_py_spy(py_spy: str | None) -> None:
    """Raise ValueError (one line) unless py-spy exists and may attach to a process of ours."""
    if py_spy is None:
        raise ValueError("py-spy not found (pip install py-spy); it is needed to profile the ranks")
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        time.sleep(0.3)
        done = subprocess.run(  # a session of its own: a Ctrl-C at the terminal is this process's to take
            [py_spy, "dump", "--pid", str(target.pid)],
            capture_output=True,
            text=True,
            timeout=30,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        raise ValueError("py-spy did not answer within 30 s when attaching to a test process") from None
    except OSError as exc:  # there, but not a program this machine runs (a broken install)
        raise ValueError(f"py-spy at {py_spy} cannot run: {exc.strerror or exc}") from None
    finally:
        target.kill()
        target.wait()
    if done.returncode != 0:
        text = (done.stderr or done.stdout).strip().splitlines()
        reason = text[-1] if text else f"exit code {done.returncode}"
        hint = ""
        if "ermission" in reason or "ptrace" in reason.lower():
            hint = (
                " (ptrace not permitted: run as root, add CAP_SYS_PTRACE, or set kernel.yama.ptrace_scope=0)"
            )
        raise ValueError(f"py-spy cannot attach to processes here: {reason}{hint}")


def _rank_of(proc: Any, top_pid: int) -> int | None:
    """The rank a process runs, or None if it is no rank (launcher, agent, fork server, resource
    tracker, the fork server's readiness probe) or not yet known as one (a rank just forked)."""
    import psutil

    try:
        if proc.pid == top_pid:
            return None
        if m := starter.RANK_NAME.fullmatch(proc.name()):  # a rank of commbench's own launcher
            return int(m.group(1))
        env = proc.environ()
        if "RANK" in env and "LOCAL_RANK" in env:  # a rank torchrun started, as the cluster's hosts do
            cmd = " ".join(proc.cmdline())
            if "torch.distributed.run" in cmd or "torchrun" in cmd:
                return None
            return int(env["RANK"])
    except (psutil.Error, ValueError):
        return None
    return None


def _discover(top: Any, top_pid: int) -> dict[int, int]:
    """{pid: rank} for the rank processes under ``top`` right now."""
    import psutil

    try:
        children = top.children(recursive=True)
    except psutil.Error:
        return {}
    candidates: dict[int, tuple[int, int]] = {}  # pid -> (rank, parent pid)
    for c in children:
        rank = _rank_of(c, top_pid)
        try:
            if rank is not None:
                candidates[c.pid] = (rank, c.ppid())
        except psutil.Error:
            continue
    # A rank's own child (a tool it runs, a worker it forks) inherits its RANK or its name: no rank.
    return {pid: rank for pid, (rank, parent) in candidates.items() if parent not in candidates}


def _record_cmd(py_spy: str, pid: int, rate: int, native: bool, out: Path) -> list[str]:
    cmd = [py_spy, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw", "--idle"]
    cmd += ["--threads", "--output", str(out)]
    return cmd + (["--native"] if native else [])


@dataclasses.dataclass
class _Recorder:
    rank: int
    pid: int
    raw: Path
    proc: subprocess.Popen
    native: bool
    log: Path


def profile_command(
    config: ProfileConfig, py_spy: str, stop: Sequence[int] = ()
) -> tuple[int, list[_Recorder]]:
    """Run the inner command and record each of its ranks; returns its exit code and the recorders.

    The inner command and the recorders run in sessions of their own, so a Ctrl-C at the terminal
    reaches only this process. Once ``stop`` holds a signal (see :func:`signals.noted`), or if this
    raises, the inner command gets one SIGTERM (its launcher stops the ranks and keeps their finished
    records); whatever of its processes outlives the grace is killed, and each recorder is waited for.
    """
    import psutil

    out = Path(config.out_dir)
    command = [sys.executable, "-m", "commbench", *config.inner]
    from commbench.bench.records import given_descriptors

    # The descriptors this command was given, which its --json /dev/fd/N may name (Popen closes the rest)
    inner = subprocess.Popen(
        command,
        start_new_session=True,
        pass_fds=sorted(given_descriptors() - {0, 1, 2}),
        env=starter.same_imports(os.environ),
    )
    top = psutil.Process(inner.pid)
    recorders: dict[int, _Recorder] = {}
    try:
        while inner.poll() is None and not stop:
            for pid, rank in _discover(top, inner.pid).items():
                if pid not in recorders:
                    recorders[pid] = _start(py_spy, config, out, rank, pid, config.native)
            for pid, rec in list(recorders.items()):  # --native unsupported: again without it
                if rec.native and rec.proc.poll() not in (None, 0) and psutil.pid_exists(pid):
                    recorders[pid] = _start(py_spy, config, out, rec.rank, pid, False)
            time.sleep(POLL_S)
    finally:
        if inner.poll() is None:
            _stop_inner(inner, top)
        deadline = time.monotonic() + STOP_GRACE_S
        for rec in recorders.values():
            try:
                rec.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rec.proc.send_signal(
                    signal.SIGINT
                )  # py-spy writes what it has on SIGINT (on SIGTERM, nothing)
                try:
                    rec.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    rec.proc.kill()
                    rec.proc.wait()
    return inner.returncode, sorted(recorders.values(), key=lambda r: r.rank)


def _stop_inner(inner: subprocess.Popen, top: Any) -> None:
    """SIGTERM the inner command and wait; kill its processes that outlive the grace or it."""
    import psutil

    try:
        family = top.children(recursive=True)
    except psutil.Error:
        family = []
    inner.terminate()
    try:
        inner.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        inner.kill()
        inner.wait()
    _, alive = psutil.wait_procs(family, timeout=1.0)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5.0)


def output_dir(path: str) -> Path:
    """``path`` as a directory the profiles can be written into, made if need be (ValueError if not)."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"cannot write to {out}: not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as exc:
        raise ValueError(f"cannot write to {out}: {exc.strerror}") from None
    return out


def _first_missing(path: Path) -> Path | None:
    """The highest directory of ``path`` (itself included) that does not exist: the top of what
    making it with its parents makes. None when it exists."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            break
        missing = p
    return missing


def _remove_made(out: Path, top: Path | None) -> None:
    """Remove ``out`` if it is empty, and the parents made for it, up to ``top`` (:func:`_first_missing`
    before it was made); nothing when ``top`` is None. What is in it is another run's: two profiles
    that found the directory missing both take it for their own."""
    if top is None:
        return
    made = [out, *out.parents]
    for p in made[: made.index(top) + 1]:
        with contextlib.suppress(OSError):  # not empty: something else is in it now
            p.rmdir()


def _start(py_spy: str, config: ProfileConfig, out: Path, rank: int, pid: int, native: bool) -> _Recorder:
    raw = out / f"rank{rank}-pid{pid}.txt"
    log = out / f"rank{rank}-pid{pid}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            _record_cmd(py_spy, pid, config.rate_hz, native, raw), stdout=f, stderr=f, start_new_session=True
        )
    return _Recorder(rank=rank, pid=pid, raw=raw, proc=proc, native=native, log=log)


# ---- collapsed stacks -----------------------------------------------------------------------


def parse_collapsed(lines: Iterable[str]) -> list[tuple[list[str], int]]:
    """(frames root first, count) per line of py-spy's raw (collapsed) output."""
    stacks = []
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        stacks.append((stack.split(";"), int(count)))
    return stacks


def _main_thread(frames: Sequence[str]) -> bool:
    """True for the rank's main thread: its stack starts at the interpreter's main entry."""
    text = ";".join(frames[:6])
    return "spawn_main" in text or "_run_module_as_main" in text or "<module>" in text


def classify(frames: Sequence[str]) -> str:
    """communication, compute or elsewhere, by the frames on one stack (innermost decides ties:
    communication anywhere wins, as a collective inside a backward hook is still a collective)."""
    text = ";".join(frames)
    if any(p in text for p in SETUP_PATTERNS):
        return "elsewhere"
    if any(p in text for p in COMM_PATTERNS) or _waits_for_comm(frames):
        return "communication"
    if any(p in text for p in COMPUTE_PATTERNS) or COMPUTE_NAMES.search(text):
        return "compute"
    return "elsewhere"


def _waits_for_comm(frames: Sequence[str]) -> bool:
    """True where a frame of :data:`COMM_WAITERS` calls a threading wait, as py-spy names it
    ``Event.wait (threading.py:629)``, or where a strategy's ``after_backward`` is the innermost
    frame: its native calls there are the waits for the buckets' allreduces (Work.wait), seen
    without --native as that frame alone; its own tensor work runs in frames below it."""
    name, _, where = frames[-1].partition(" (") if frames else ("", "", "")
    if name.rpartition(".")[2] == "after_backward" and any(w in where for w in COMM_WAITERS):
        return True
    for caller, callee in zip(frames, frames[1:], strict=False):
        name, _, where = callee.partition(" (")
        if (
            "threading.py" in where
            and name.rpartition(".")[2] == "wait"
            and any(w in caller for w in COMM_WAITERS)
        ):
            return True
    return False


def _leaf(frames: Sequence[str]) -> str:
    python = [f for f in frames if "(" in f and ".py" in f]
    return (python[-1] if python else frames[-1]).strip()


def summarise(
    rank: int, pid: int, raw: Path, native: bool, profile_path: str | None, log: Path | None = None
) -> RankProfile:
    """Split one rank's main-thread samples into the three categories."""
    stacks = parse_collapsed(raw.read_text().splitlines()) if raw.exists() else []
    counts = dict.fromkeys(CATEGORIES, 0)
    leaves: dict[str, dict[str, int]] = {c: {} for c in CATEGORIES}
    for frames, n in stacks:
        if not _main_thread(frames):
            continue
        category = classify(frames)
        counts[category] += n
        leaf = _leaf(frames)
        leaves[category][leaf] = leaves[category].get(leaf, 0) + n
    top = {c: sorted(v.items(), key=lambda kv: -kv[1])[:3] for c, v in leaves.items()}
    return RankProfile(
        rank=rank,
        pid=pid,
        samples=sum(counts.values()),
        native=native,
        raw_path=str(raw),
        profile_path=profile_path,
        top=top,
        log_path=None if log is None else str(log),
        **counts,
    )


# ---- output formats -------------------------------------------------------------------------


def write_speedscope(stacks: Sequence[tuple[list[str], int]], path: Path, name: str, rate_hz: int) -> None:
    """The stacks as a speedscope 'sampled' profile (weights in seconds)."""
    frames: dict[str, int] = {}
    samples, weights = [], []
    for stack, n in stacks:
        samples.append([frames.setdefault(f, len(frames)) for f in stack])
        weights.append(n / rate_hz)
    doc = {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": [{"name": f} for f in frames]},
        "profiles": [
            {
                "type": "sampled",
                "name": name,
                "unit": "seconds",
                "startValue": 0,
                "endValue": sum(weights),
                "samples": samples,
                "weights": weights,
            }
        ],
        "name": name,
        "exporter": "commbench profile",
    }
    text = json.dumps(doc)
    write_whole(path, lambda p: p.write_text(text))


def write_flamegraph(stacks: Sequence[tuple[list[str], int]], path: Path, title: str) -> None:
    """A plain SVG flame graph: width = samples, root at the bottom, one colour per category."""
    tree: dict[str, Any] = {"n": 0, "kids": {}}
    for stack, n in stacks:
        node = tree
        node["n"] += n
        for f in stack:
            node = node["kids"].setdefault(f, {"n": 0, "kids": {}})
            node["n"] += n
    total = max(tree["n"], 1)
    width, row = 1200.0, 16
    rects: list[str] = []
    depth_max = [0]
    colours = {"communication": "#e4572e", "compute": "#4c9f70", "elsewhere": "#a0a0a0"}

    def walk(node: dict[str, Any], x: float, depth: int, path_frames: list[str]) -> None:
        for name, kid in node["kids"].items():
            w = kid["n"] / total * width
            frames = [*path_frames, name]
            if w >= 0.3:
                depth_max[0] = max(depth_max[0], depth)
                colour = colours[classify(frames)]
                label = html.escape(name if len(name) * 6.5 < w else name[: max(0, int(w / 6.5) - 2)] + "..")
                tip = html.escape(f"{name} ({kid['n']} samples, {100 * kid['n'] / total:.1f}%)")
                rects.append(
                    f'<g><title>{tip}</title><rect x="{x:.2f}" y="{{y{depth}}}" width="{w:.2f}" '
                    f'height="{row - 1}" fill="{colour}" rx="2"/>'
                    + (f'<text x="{x + 2:.2f}" y="{{t{depth}}}">{label}</text>' if w > 20 else "")
                    + "</g>"
                )
                walk(kid, x, depth + 1, frames)
            x += w

    walk(tree, 0.0, 0, [])
    height = (depth_max[0] + 3) * row
    body = "\n".join(rects)
    for d in range(depth_max[0] + 1):
        y = height - (d + 2) * row
        body = body.replace(f"{{y{d}}}", str(y)).replace(f"{{t{d}}}", str(y + row - 4))
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" '
        f'font-family="monospace" font-size="11">\n<text x="4" y="14">{html.escape(title)} - red: '
        f"communication, green: compute, grey: elsewhere</text>\n{body}\n</svg>\n"
    )
    write_whole(path, lambda p: p.write_text(svg))


# ---- the command ----------------------------------------------------------------------------


def run_profile(
    config: ProfileConfig, py_spy: str | None = None
) -> tuple[int, list[RankProfile], int | None]:
    """Check the output directory and py-spy, run and record, then summarise and convert each rank's
    profile; returns the inner command's exit code, the profiles, and the signal (SIGINT or SIGTERM)
    that stopped the run early, or None."""
    out = Path(config.out_dir)
    made = _first_missing(out)  # what output_dir makes, parents included
    output_dir(config.out_dir)
    # Held until the profiles and summary.json are written; another run's refusal leaves the
    # directory (the other run's) as it is.
    with directory_held(out):
        py_spy = py_spy or find_py_spy()
        # SIGHUP too: the inner command runs in a session of its own, so a closed terminal reaches only
        # this process, which must stop it. Noted, not raised: children first, then what they wrote is kept.
        with signals.noted(signals.STOPS) as stop:
            try:
                check_py_spy(py_spy)
            except ValueError:
                _remove_made(out, made)  # a run that cannot profile leaves no empty directory
                if stop:  # stopped while checking: an interruption, not a py-spy that cannot attach
                    raise signals.Interrupted(stop[0]) from None
                raise
            assert py_spy is not None
            if stop:  # before the run began: nothing to keep
                _remove_made(out, made)
                raise signals.Interrupted(stop[0])
            code, recorders = profile_command(config, py_spy, stop)
            if code < 0:  # killed by a signal: said, and the shell's code for it (-9 was exit 247)
                try:
                    name = signal.Signals(-code).name
                except ValueError:
                    name = f"signal {-code}"
                print(f"commbench: profile: the command was killed by {name}", file=sys.stderr, flush=True)
                code = 128 - code
            if code == BAD_INPUT and not recorders and not stop:
                # The inner command refused its input, in its own one line, before starting a rank, and
                # no recorder wrote here: a directory this run made is removed if still empty (a profile
                # beside it that found it missing too may have written into it since).
                _remove_made(out, made)
                return code, [], None
            # Still held: a stop now waits for the profiles and summary.json of a run that has ended.
            profiles = _write_up(config, code, recorders, stop[0] if stop else None)
        return code, profiles, stop[0] if stop else None


def _write_up(config: ProfileConfig, code: int, recorders: Sequence[Any], stopped: int | None) -> list:
    """Each rank's profile converted and summarised, and summary.json written; the summaries."""
    profiles = []
    for rec in recorders:
        stacks = parse_collapsed(rec.raw.read_text().splitlines()) if rec.raw.exists() else []
        converted = None
        if stacks:
            name = f"rank {rec.rank} (pid {rec.pid}): commbench {' '.join(config.inner)}"
            if config.format == "speedscope":
                converted = rec.raw.with_suffix(".speedscope.json")
                write_speedscope(stacks, converted, name, config.rate_hz)
            else:
                converted = rec.raw.with_suffix(".svg")
                write_flamegraph(stacks, converted, name)
        profiles.append(
            summarise(rec.rank, rec.pid, rec.raw, rec.native, str(converted) if converted else None, rec.log)
        )
    summary = {
        "command": ["commbench", *config.inner],
        "returncode": code,
        "stopped_by": signal.Signals(stopped).name if stopped else None,
        "rate_hz": config.rate_hz,
        "ranks": [dataclasses.asdict(p) for p in profiles],
    }
    text = json.dumps(summary, indent=1)
    write_whole(Path(config.out_dir) / "summary.json", lambda p: p.write_text(text))
    return profiles


def summary_table(profiles: Sequence[RankProfile]) -> str:
    """The per-rank shares, one row per rank, and each category's hottest frame."""
    lines = [
        f"{'rank':>4} {'pid':>8} {'samples':>8} {'comm':>7} {'compute':>8} {'elsewhere':>9}  native  "
        "hottest communication frame"
    ]
    for p in profiles:
        hot = p.top["communication"][0][0] if p.top["communication"] else "-"
        lines.append(
            f"{p.rank:>4} {p.pid:>8} {p.samples:>8} {100 * p.share('communication'):6.1f}% "
            f"{100 * p.share('compute'):7.1f}% {100 * p.share('elsewhere'):8.1f}%  "
            f"{'yes' if p.native else 'no':>6}  {hot[:70]}"
        )
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    """Register ``commbench profile`` on the CLI's subparsers."""
    p = sub.add_parser(
        "profile",
        help="sample every rank of a commbench run with py-spy; per-rank communication/compute shares",
        description="Run a commbench command (given after '--'), attach py-spy to each of its ranks, write "
        "one profile per rank into DIR (collapsed stacks, plus speedscope JSON or a flame graph SVG), and "
        "print "
        "each rank's share of samples in communication, compute and elsewhere (main thread, idle waits "
        "included). Needs py-spy and ptrace. Example: commbench profile -o prof -- compare --world-size 2",
    )
    p.add_argument(
        "-o",
        "--output",
        type=output_path,
        default="profile",
        help="directory for the profiles (default ./profile)",
    )
    p.add_argument("--rate", type=int, default=100, help="samples per second per rank (default 100)")
    p.add_argument(
        "--format", choices=FORMATS, default="speedscope", help="profile format (default speedscope)"
    )
    p.add_argument(
        "--native",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="include native (C/C++) frames where py-spy can unwind them (default on; falls back without)",
    )
    p.add_argument("inner", nargs=argparse.REMAINDER, help="-- then any commbench command")


def run(args: argparse.Namespace) -> int:
    """``commbench profile``; returns the inner command's exit code."""
    inner = list(args.inner)
    if inner and inner[0] == "--":
        inner = inner[1:]
    config = ProfileConfig(
        inner=tuple(inner), out_dir=args.output, rate_hz=args.rate, format=args.format, native=args.native
    )
    # Read as the command would read it: asked for its help (-h, -qh, --hel), it prints it and exits 0,
    # as without profile, sampling nothing; words it cannot take are refused before py-spy starts.
    from commbench.bench.cli import build_parser

    build_parser().parse_args(list(config.inner))
    code, profiles, stopped = run_profile(config)
    if stopped is not None:  # one line says so: the inner command's, or the CLI's if it had none to say
        if code != 128 + signal.SIGTERM:
            from commbench.bench.launch import Interrupted

            raise Interrupted(stopped)
        return 128 + stopped
    if code == BAD_INPUT and not profiles:
        return code
    if not profiles:
        print(
            f"commbench: profile: no rank process was seen (the command exited with {code})", file=sys.stderr
        )
        return code or 1
    for p in profiles:
        if not p.samples:
            print(
                f"commbench: profile: rank {p.rank} (pid {p.pid}) has no samples: {p.failure()}",
                file=sys.stderr,
            )
    if not any(p.samples for p in profiles):
        print(
            f"commbench: profile: no rank was sampled; py-spy's output is in {config.out_dir}/",
            file=sys.stderr,
        )
        return code or 1
    print(f"# commbench profile: {len(profiles)} rank(s), {config.rate_hz} Hz, main thread incl. idle waits")
    print(summary_table(profiles))
    print(f"# profiles in {config.out_dir}/ (rank<r>-pid<p>.txt collapsed stacks; summary.json)")
    return code
