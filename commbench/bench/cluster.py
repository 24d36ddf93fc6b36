"""``commbench cluster``: run a commbench command on N emulated hosts with shaped links.

Host i is a network namespace with its own NIC and address (see ``netns``), and rank i is started
in it the way a real node starts its rank: torchrun with N nodes, one process per node and a c10d
rendezvous on host 0. Node ranks follow the hosts because the rendezvous orders nodes by address.
Each host's bytes are read at its switch port before and after the run and set beside what the
cost model says the run moves; everything built is removed when the run ends, however it ends.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from commbench.bench import netns, signals
from commbench.bench.netns import NIC, RDZV_PORT, Shaping, Topology
from commbench.bench.records import file_stamp

INNER_COMMANDS = ("sweep", "train", "compare")
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_PROCID",
    "SLURM_NTASKS",
)
NOT_BUILT = 3  # the exit code when the cluster could not be built (an ip or tc step failed): nothing ran
STOP_GRACE_S = 5.0  # how long torchrun agents get to stop their ranks before everything is killed
FAILURE_GRACE_S = 1.0  # after a first failure, how long to wait for others (to tell cause from effect)
SCRATCH_PREFIX = "commbench-cluster-"  # then the owner's pid and '-', as its namespaces are named
_SCRATCH = re.compile(rf"^{SCRATCH_PREFIX}(\d+)-")


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """One emulated-cluster run: hosts, link shaping and the inner commbench command."""

    hosts: int
    shaping: Shaping
    inner: tuple[str, ...]
    join_timeout_s: float = 120.0
    # The whole command line (``commbench cluster ... -- sweep ...``), which the hosts' records
    # give as theirs: the inner command alone, re-run, measured loopback and not the shaped links.
    command: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= netns.MAX_HOSTS:
            raise ValueError(f"--hosts must be in 1..{netns.MAX_HOSTS}, got {self.hosts}")
        if not self.inner:
            raise ValueError(f"no command after '--'; give one of {', '.join(INNER_COMMANDS)}")
        if self.inner[0] not in INNER_COMMANDS:
            raise ValueError(
                f"the cluster runs {', '.join(INNER_COMMANDS)}, not {self.inner[0]!r} (put it after '--')"
            )
        if any(a == "--world-size" or a.startswith("--world-size=") for a in self.inner):
            raise ValueError("--world-size is set by the cluster (one rank per host); use --hosts instead")
        if not self.join_timeout_s > 0:
            raise ValueError(f"join timeout must be > 0 s, got {self.join_timeout_s}")


@dataclass(frozen=True, kw_only=True)
class HostTraffic:
    """One host's bytes over a run: measured at its switch port, and what the cost model says."""

    rank: int
    address: str
    nic: str
    tx_bytes: int
    rx_bytes: int
    computed_tx_bytes: int | None
    computed_rx_bytes: int | None


@dataclass(frozen=True, kw_only=True)
class ClusterRecord:
    """Appended to the inner command's JSON Lines: the whole run's traffic per host and the links."""

    hosts: tuple[HostTraffic, ...]
    link_rate_gbps: float
    tc: dict[str, float | int]
    command: str
    type: str = "cluster"


def add_parser(sub: Any) -> None:
    """Register ``commbench cluster`` on the CLI's subparsers."""
    p = sub.add_parser(
        "cluster",
        help="run sweep/train/compare on N emulated hosts (network namespaces, shaped links)",
        description="Build N hosts as network namespaces on a bridge, each with its own address in "
        "198.18.0.0/15 and a link shaped both ways with tc, start rank i on host i with torchrun (c10d "
        "rendezvous on host 0), run the commbench command given after '--', report each host's bytes "
        "(measured beside the cost model), then remove everything. Needs root (or CAP_NET_ADMIN and "
        "CAP_SYS_ADMIN) and iproute2. Exits with 3 where an ip or tc step failed (nothing ran). Example: "
        "commbench cluster --hosts 4 --rate 1gbit -- sweep -a naive,ring",
    )
    # Required, but checked in config_from_args: argparse checks required options before it reports
    # unknown ones, so an unknown option before --hosts was reported as --hosts missing.
    p.add_argument("--hosts", type=int, default=None, help="hosts, one rank each (required)")
    p.add_argument(
        "--rate", default="1gbit", help="link rate each way: 100mbit, 1gbit (default), up to 1tbit"
    )
    p.add_argument(
        "--burst",
        default=None,
        help="token-bucket size, bytes or with a K/M/G suffix (2^10, 2^20, 2^30; default 8 ms of the "
        "rate, >= 128K)",
    )
    p.add_argument(
        "--mtu", type=int, default=1500, help="MTU of every link (default 1500; 9000: jumbo frames)"
    )
    p.add_argument("--queue", default="10ms", help="longest wait in a link queue, then drop (default 10ms)")
    p.add_argument("--delay", default=None, help="one-way delay of each link direction, e.g. 100us (netem)")
    p.add_argument("--jitter", default=None, help="delay variation, e.g. 20us (netem; needs --delay)")
    p.add_argument("--loss", default=None, help="packet loss of each link direction, e.g. 0.1%% (netem)")
    p.add_argument("inner", nargs=argparse.REMAINDER, help="-- then a commbench sweep, train or compare")


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    """The ClusterConfig the command line asks for (ValueError names a bad value)."""
    from commbench.units import parse_size

    inner = list(args.inner)
    if inner and inner[0] == "--":
        inner = inner[1:]
    if args.hosts is None:
        raise ValueError("--hosts is required (one rank per host): commbench cluster --hosts 4 -- sweep")

    def given(option: str, parse: Callable[[str], Any], default: Any = None) -> Any:
        text = getattr(args, option)
        if text is None:  # '' is refused, not unset
            return default
        try:
            return parse(text)
        except ValueError as error:  # the parsers' words do not say which of five options they read
            raise ValueError(f"--{option} {text!r}: {error}") from None

    shaping = Shaping(
        rate_bit=given("rate", netns.parse_rate),
        burst_bytes=given("burst", parse_size),
        queue_ms=given("queue", netns.parse_time_us) / 1e3,
        delay_us=given("delay", netns.parse_time_us, 0.0),
        jitter_us=given("jitter", netns.parse_time_us, 0.0),
        loss_percent=given("loss", netns.parse_percent, 0.0),
        mtu=args.mtu,
    )
    return ClusterConfig(
        hosts=args.hosts, shaping=shaping, inner=tuple(inner), command=getattr(args, "command_line", None)
    )


def _check_outputs(inner: argparse.Namespace) -> None:
    """The inner command's output files, checked before anything is built (they are written last).
    The records are read back for the hosts' byte counts: a pipe or a terminal (/dev/stdout, a
    shell's >(jq .)) would have been read from, waiting for ever on the writer this process holds."""
    from commbench.bench.records import check_outputs, is_stream, names_descriptor, plots_beside, shown

    outputs = {name: getattr(inner, name, None) for name in ("json", "csv", "plot")}
    for name, path in outputs.items():  # host 0's rank writes them, given the command's own words
        if names_descriptor(path):
            raise ValueError(
                f"--{name} names a descriptor of this command, which the hosts do not hold; give a file"
            )
    json_path = outputs["json"]
    if json_path and is_stream(json_path) and os.path.realpath(json_path) != os.devnull:
        raise ValueError(
            f"--json {shown(json_path)} is not a file: the cluster reads its records back to count each "
            "host's bytes; give a file (a run without --json gets one of the cluster's own)"
        )
    check_outputs(**outputs, beside=plots_beside(inner.command, outputs["plot"], not inner.no_probe))


def run(args: argparse.Namespace, *, privileges: Callable[[], None] | None = None) -> int:
    """``commbench cluster``: check, build, run, report, remove. Returns the exit code.

    Args:
        args: the parsed command line.
        privileges: raises ValueError when the cluster cannot be built (default: the real check).
    """
    from commbench.bench.cli import build_parser
    from commbench.bench.launch import Interrupted

    config = config_from_args(args)
    inner = build_parser().parse_args(list(config.inner))  # bad inner input: exit 2 before building
    check_inner(inner, config.hosts)
    # An interruption's one line names where the finished points are (the JSON Lines file, else a
    # sweep's CSV), and not an earlier run's, in a file not yet written.
    args.json, args.csv = inner.json, getattr(inner, "csv", None)
    args.records_before = file_stamp(args.json or args.csv)
    (privileges or netns.check_privileges)()

    def on_signal(signum: int, frame: Any) -> None:
        for s in signals.STOPS:  # one is enough; a second must not cut the removal of the directory
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    # From the scratch directory on, a stop signal unwinds (run_hosts has handlers of its own
    # while the cluster stands): the directory was left behind by one that came outside them.
    with signals.handled(signals.STOPS, on_signal), _scratch(f"{SCRATCH_PREFIX}{os.getpid()}-") as work:
        json_path = getattr(inner, "json", None)
        argv = list(config.inner)
        # The report, and the check for wrong results, need the records (the last --json counts).
        if not json_path or os.path.realpath(json_path) == os.devnull:  # sweep, train or compare
            json_path = str(Path(work, f"{config.inner[0]}.jsonl"))
            argv += ["--json", json_path]
        measured = run_hosts(config, argv, Path(work))
        with signals.noted(signals.STOPS) as stopped:  # the run's record is written whole, or not at all
            records = _read_records(json_path)
            hosts = host_traffic(config, measured, records, extra_calls(inner))
            record = ClusterRecord(
                hosts=tuple(hosts),
                link_rate_gbps=config.shaping.link_gbps,
                tc=config.shaping.as_record(),
                command=config.command or shlex.join(config.inner),
            )
            if getattr(inner, "json", None):
                from commbench.bench.records import append_record

                append_record(inner.json, dataclasses.asdict(record))
        if stopped:
            raise Interrupted(stopped[0])
        if not getattr(inner, "quiet", False):  # -q on the command: no tables, the cluster's neither
            print(report(config, hosts, records), flush=True)
    from commbench.bench.cli import wrong_results

    wrong = wrong_results([r for r in records if r.get("type") == "sweep"])
    if wrong is not None:  # every host measured every size: its records and the report stand
        print(f"commbench: {wrong}", file=sys.stderr)
        return 1
    return 0


@contextlib.contextmanager
def _scratch(prefix: str, folder: str | None = None) -> Iterator[str]:
    """A temporary directory, removed on the way out with the stop signals noted, not acted on: a
    stop that came while it was removed cut the removal short, and left part of it behind (and a
    run whose report was out ended as interrupted)."""
    work = tempfile.mkdtemp(prefix=prefix, dir=folder)
    try:
        yield work
    finally:
        with signals.noted(signals.STOPS):
            shutil.rmtree(work, ignore_errors=True)


def check_inner(inner: argparse.Namespace, hosts: int) -> None:
    """What each host's rank would refuse only after the cluster was built (ValueError, exit 2):
    a --world-size however abbreviated, the launch settings, the outputs, and the command's own
    checks (a sweep's sizes, root and memory; a training run's batch against the ranks, its data)."""
    from commbench.bench import cli, launch

    cli.check_environment()
    if getattr(inner, "world_size", None) is not None:  # argparse takes --world for --world-size
        raise ValueError("--world-size is set by the cluster (one rank per host); use --hosts instead")
    spec = launch.LaunchSpec(
        world_size=hosts, device=inner.device, backend=inner.backend, timeout_s=inner.timeout
    )
    cli.check_device(spec.device)
    if spec.resolved_backend == "nccl":
        # Every host's rank took GPU 0 (each host's torchrun starts one rank, local rank 0), which
        # NCCL refuses inside the ranks; and NCCL between GPUs of one machine goes over NVLink or
        # PCIe, around the shaped links the cluster is for.
        raise ValueError(
            "every host's rank takes GPU 0 of this machine, which NCCL refuses (and between GPUs of "
            "one machine it would go around the shaped links): give --backend gloo, whose ranks share it"
        )
    _check_outputs(inner)
    if inner.command in ("train", "compare"):
        from commbench.bench import train

        config = train.train_config(inner)
        train.check_launch(config, hosts, inner.device)
        # every host's rank lives in this machine's memory
        train.check_data(config, ranks_here=hosts, device=inner.device, world=hosts)
    if inner.command == "sweep":  # every host's rank lives in this machine's memory
        config = cli.sweep_config(inner)
        cli.check_sweep(config, spec)
        cli.check_sweep_memory(config, spec, local=hosts)


def _read_records(path: str | None) -> list[dict[str, Any]]:
    from commbench.bench.records import read_jsonl

    if not path or not Path(path).exists():
        return []
    try:
        return [r for r in read_jsonl(path) if isinstance(r, dict)]
    except (OSError, json.JSONDecodeError):
        return []


def launcher_vars(env: Mapping[str, str]) -> set[str]:
    """The names in ``env`` that an outer launcher (torchrun, SLURM) set for its ranks."""
    return {k for k in env if k in LAUNCHER_VARS or k.startswith("TORCHELASTIC_")}


# Set for each host's rank: a sweep with wrong results ends well there (exit 0), so that the hosts'
# launchers end together (a failed rank skips torchrun's exit barrier, and host 0's launcher, which
# holds the rendezvous, could go before another host's had its rank's end); the cluster reads the
# wrong points from the records, and exits 1 after its own record and report.
HOST_ENV = "COMMBENCH_CLUSTER_HOST"
COMMAND_ENV = "COMMBENCH_CLUSTER_COMMAND"  # the cluster's command line, for the hosts' records


def host_env(
    base: dict[str, str], topo: Topology, i: int, shaping: Shaping, command: str | None = None
) -> dict[str, str]:
    """The environment of host ``i``'s launcher and rank: no outer launcher's variables, this
    process's imports (:func:`starter.same_imports`), one thread, gloo on the host's NIC, the
    COMMBENCH_* variables the probes read, and the cluster's ``command`` line for the records'
    header."""
    from commbench.bench import starter

    outer = launcher_vars(base)
    env = starter.same_imports({k: v for k, v in base.items() if k not in outer})
    env.update(
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME=NIC,
        COMMBENCH_NIC=NIC,
        COMMBENCH_LINK_GBPS=repr(shaping.link_gbps),
        COMMBENCH_LINK_BURST=str(shaping.burst),
        COMMBENCH_HOST_ADDRESS=topo.address(i),
    )
    env[HOST_ENV] = "1"
    env.pop(COMMAND_ENV, None)
    if command:
        env[COMMAND_ENV] = command
    return env


def host_process_env(config: ClusterConfig, topo: Topology, i: int, work: Path) -> dict[str, str]:
    """The environment :func:`run_hosts` starts host ``i`` with: this process's, as :func:`host_env`
    makes it a host's, with the cluster's command line and its scratch directory for TMPDIR."""
    return {**host_env(dict(os.environ), topo, i, config.shaping, config.command), "TMPDIR": str(work)}


def host_command(topo: Topology, i: int, argv: Sequence[str], join_timeout_s: float) -> list[str]:
    """How host ``i`` starts its node: torchrun inside its namespace, rendezvous at host 0."""
    return [
        "ip",
        "netns",
        "exec",
        topo.namespace(i),
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(topo.hosts),
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{topo.address(0)}:{RDZV_PORT}",
        "--rdzv-id",
        f"{netns.PREFIX}-{topo.owner}",
        "--rdzv-conf",
        f"is_host={int(i == 0)},join_timeout={int(join_timeout_s)}",
        "--local-addr",  # the rendezvous sorts nodes by this: node rank i on host i
        topo.address(i),
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.1",
        "-m",
        "commbench",
        *argv,
    ]


# argv: the parent's pid, then a command. Asks the kernel for SIGTERM when the thread that started
# this process ends (PR_SET_PDEATHSIG, 1), then becomes the command: the request outlives exec.
_PARENT_DEATH = (
    "import ctypes, os, signal, sys\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM):\n"
    "    sys.exit(f'prctl(PR_SET_PDEATHSIG): {os.strerror(ctypes.get_errno())}')\n"
    "if os.getppid() != int(sys.argv[1]):\n"  # the parent ended before the request
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def ending_with_this_process(cmd: Sequence[str]) -> list[str]:
    """``cmd``, started so that it gets SIGTERM when the thread that starts it ends: a cluster
    command killed by SIGKILL left its hosts' launchers and ranks running to the end of their
    command. Through an exec rather than a ``preexec_fn``, which can deadlock in a process
    with threads."""
    return [sys.executable, "-I", "-S", "-c", _PARENT_DEATH, str(os.getpid()), *cmd]


def run_hosts(config: ClusterConfig, argv: Sequence[str], work: Path) -> dict[int, tuple[int, int]]:
    """Build the cluster, run ``argv`` on every host, remove the cluster.

    Returns {host: (tx_bytes, rx_bytes)} measured at the switch over the run.

    Raises:
        RankFailed: a host's rank failed (named, with its error); the others were stopped.
        Interrupted: SIGINT, SIGTERM or SIGHUP reached this process; the ranks were stopped.
    """
    import psutil

    from commbench.bench.launch import Interrupted

    topo = Topology(hosts=config.hosts, owner=os.getpid())
    leftover = netns.destroy(netns.stale(netns.namespaces(), psutil.pid_exists))
    if leftover:
        raise netns.ClusterError(f"cannot remove namespaces of an earlier run: {', '.join(leftover)}")
    for path in stale_scratch(work.parent, psutil.pid_exists):  # its ranks went with its namespaces
        shutil.rmtree(path, ignore_errors=True)

    def on_signal(signum: int, frame: Any) -> None:
        for s in signals.STOPS:  # one is enough; a second must not cut the cleanup
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    main_thread = threading.current_thread() is threading.main_thread()
    procs: list[subprocess.Popen] = []
    logs = [work / f"host{i}.log" for i in range(config.hosts)]
    # SIGHUP too: a closed terminal used to end this process at once, leaving the namespaces and
    # the hosts' ranks running to the end of their command.
    with signals.handled(signals.STOPS, on_signal):
        try:
            netns.create(topo, config.shaping)
            before = netns.port_counters(topo)
            for i in range(config.hosts):
                with open(logs[i], "w") as log:
                    procs.append(
                        subprocess.Popen(
                            ending_with_this_process(host_command(topo, i, argv, config.join_timeout_s)),
                            env=host_process_env(config, topo, i, work),
                            stdin=subprocess.DEVNULL,
                            stdout=None if i == 0 else log,
                            stderr=log,
                            start_new_session=True,  # our signals are ours; the hosts are stopped by us
                            # (and stop when this process is killed: ending_with_this_process)
                        )
                    )
            _wait(procs, logs)
            after = netns.port_counters(topo)
            return {i: (after[i][0] - before[i][0], after[i][1] - before[i][1]) for i in range(config.hosts)}
        finally:
            if main_thread:
                for s in signals.STOPS:
                    signal.signal(s, signal.SIG_IGN)
            _stop(procs)
            left = netns.destroy(netns.owned(netns.namespaces(), topo.owner))
            if left:
                print(f"commbench: could not remove {', '.join(left)}", file=sys.stderr)


def stale_scratch(directory: Path, alive: Callable[[int], bool]) -> list[Path]:
    """Scratch directories in ``directory`` of earlier runs whose owner process is gone: a killed
    run (SIGKILL) left its directory, which nothing removed. Only this user's, never a link."""
    try:
        entries = list(directory.iterdir())
    except OSError:
        return []
    out = []
    for path in entries:
        m = _SCRATCH.match(path.name)
        if not m or alive(int(m.group(1))):
            continue
        try:
            st = path.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            out.append(path)
    return sorted(out)


def _wait(procs: Sequence[subprocess.Popen], logs: Sequence[Path]) -> None:
    """Until every host ends well; on a failure, raise the one that came first (RankFailed)."""
    failed: dict[int, float] = {}
    while True:
        now = time.monotonic()
        for i, p in enumerate(procs):
            if i not in failed and p.poll() not in (None, 0):
                failed[i] = now
        ended = all(p.poll() is not None for p in procs)
        if failed and (ended or now - min(failed.values()) > FAILURE_GRACE_S):
            tails = {i: _tail(logs[i]) for i in failed}
            raise first_failure(
                {
                    i: (t, failure_text(tails[i], procs[i].returncode), rank_exit_code(tails[i]) == 2)
                    for i, t in failed.items()
                }
            )
        if not failed and all(p.poll() == 0 for p in procs):
            return
        time.sleep(0.05)


def _tail(path: Path, limit: int = 1 << 20) -> str:
    """The end of a host's log (what ended it is printed last)."""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - limit))
        return f.read().decode("utf-8", "replace")


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM each running launcher (it stops its rank), wait a little; ``destroy`` kills the rest."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        try:
            p.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_GRACE_S
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


_SIGNAL = re.compile(r"Signal (\d+) \((SIG\w+)\) received")
_ERROR = re.compile(r"^(commbench: .+|[A-Za-z_][\w.]*(Error|Exception|Interrupt|Failed)\b.*)$")


def failure_text(log: str, returncode: int | None) -> str:
    """What ended a host, in one line, from its launcher's output: a signal, an error, or the code."""
    if m := _SIGNAL.search(log):
        return f"killed by {m.group(2)}"
    errors = [line.strip() for line in log.splitlines() if _ERROR.match(line.strip())]
    noise = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError", "ChildFailedError")
    errors = [e for e in errors if not e.startswith(noise)]
    if errors:  # a rank under torchrun names itself ("rank 0 failed: ..."), as the cluster does
        return re.sub(r"^rank \d+ failed: ", "", errors[-1].removeprefix("commbench: "))
    if returncode is not None and returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"


_EXIT_CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)


def rank_exit_code(log: str) -> int | None:
    """The exit code of a host's rank, from its launcher's failure summary (the launcher itself
    exits 1 whatever its rank's code was); None where the summary has none."""
    m = _EXIT_CODE.search(log)
    return int(m.group(1)) if m else None


def first_failure(failed: dict[int, tuple[float, str, bool]]) -> Exception:
    """The failure that came first: a killed or crashed rank before the peers it took down.
    ``failed`` maps a host to (when it was seen, what ended it, whether its rank refused its input)."""
    from commbench.bench.launch import RankFailed

    def key(item: tuple[int, tuple[float, str, bool]]) -> tuple[int, float, int]:
        host, (when, text, _) = item
        stopped = text.startswith("killed by") and text.endswith(("SIGTERM", "SIGINT"))
        return (2 if stopped else 0 if text.startswith("killed by") else 1, when, host)

    host, (_, text, bad_input) = min(failed.items(), key=key)
    return RankFailed(host, text, bad_input=bad_input)


def extra_calls(inner: argparse.Namespace) -> int:
    """Calls of each sweep point beyond warmup + iters: the check, and the probes' counting pass."""
    check = 1 if getattr(inner, "check", 0) else 0
    probing = not getattr(inner, "no_probe", True) and getattr(inner, "device", "cpu") == "cpu"
    return check + (getattr(inner, "probe_iters", 0) if probing else 0)


def computed_bytes(
    records: Sequence[dict[str, Any]], world: int, calls_extra: int
) -> tuple[list[int], list[int]] | None:
    """Per-rank payload bytes sent and received over a whole sweep, from its records' cost-model
    fields: each point runs warmup + iters times, plus ``calls_extra`` (the check); or over a
    whole training run (train or compare): each strategy's epochs times its bytes an epoch. None
    when the records are neither's, or a training run's strategies are not all priced."""
    sweep = [r for r in records if r.get("type") == "sweep" and "computed_sent_bytes_per_rank" in r]
    tx, rx = [0] * world, [0] * world
    if not sweep:
        return _trained_bytes(records, tx, rx)
    for r in sweep:
        calls = r["warmup"] + r["iters"] + calls_extra
        for rank in range(min(world, len(r["computed_sent_bytes_per_rank"]))):
            tx[rank] += calls * r["computed_sent_bytes_per_rank"][rank]
            rx[rank] += calls * r["computed_recv_bytes_per_rank"][rank]
    return tx, rx


def _trained_bytes(
    records: Sequence[dict[str, Any]], tx: list[int], rx: list[int]
) -> tuple[list[int], list[int]] | None:
    """:func:`computed_bytes` of a training run: gradients and buffers, not the parameters sent
    once at the start or the evaluation's metrics."""
    summaries = [r for r in records if r.get("type") == "train_summary"]
    epochs = collections.Counter(r.get("strategy") for r in records if r.get("type") == "epoch")
    if not summaries:
        return None
    for s in summaries:
        sent, received = s.get("wire_bytes_per_rank_per_epoch"), s.get("wire_recv_bytes_per_rank_per_epoch")
        if sent is None or received is None:  # not modelled, or written before received bytes were
            return None
        for rank in range(min(len(tx), len(sent), len(received))):
            tx[rank] += epochs[s.get("strategy")] * int(sent[rank])
            rx[rank] += epochs[s.get("strategy")] * int(received[rank])
    return tx, rx


def host_traffic(
    config: ClusterConfig,
    measured: dict[int, tuple[int, int]],
    records: Sequence[dict[str, Any]],
    calls_extra: int,
) -> list[HostTraffic]:
    """Measured and computed bytes of each host over the run (rank i is host i)."""
    topo = Topology(hosts=config.hosts, owner=os.getpid())
    computed = computed_bytes(records, config.hosts, calls_extra)
    return [
        HostTraffic(
            rank=i,
            address=topo.address(i),
            nic=NIC,
            tx_bytes=measured[i][0],
            rx_bytes=measured[i][1],
            computed_tx_bytes=computed[0][i] if computed else None,
            computed_rx_bytes=computed[1][i] if computed else None,
        )
        for i in range(config.hosts)
    ]


def _ratio(measured: int, computed: int | None) -> str:
    return f"{measured / computed:>6.3f}" if computed else f"{'-':>6}"


def _mb(x: int | float | None) -> str:
    return f"{'-':>10}" if x is None else f"{x / 1e6:>10.3f}"


def traffic_table(hosts: Sequence[HostTraffic], title: str) -> str:
    """Per host: measured beside computed bytes each way (MB = 1e6 bytes) and their ratio."""
    lines = [
        f"# {title}; MB = 1e6 B, computed = payload by the cost model",
        f"#{'host':>4} {'address':>13} {'tx MB':>10} {'computed':>10} {'ratio':>6} "
        f"{'rx MB':>10} {'computed':>10} {'ratio':>6}",
    ]
    for h in hosts:
        lines.append(
            f"{h.rank:>5} {h.address:>13} {_mb(h.tx_bytes)} {_mb(h.computed_tx_bytes)} "
            f"{_ratio(h.tx_bytes, h.computed_tx_bytes)} {_mb(h.rx_bytes)} {_mb(h.computed_rx_bytes)} "
            f"{_ratio(h.rx_bytes, h.computed_rx_bytes)}"
        )
    return "\n".join(lines)


def per_point_tables(records: Sequence[dict[str, Any]]) -> str | None:
    """From sweep records that carry ``hosts`` (per-iteration bytes measured by each rank): per
    algorithm, each host's bytes summed over the sizes; from epoch records (per-step bytes): per
    strategy, each host's bytes a step, the mean of its epochs. None when no record carries them."""
    sums: dict[str, dict[int, list[float]]] = {}
    epochs: collections.Counter[str] = collections.Counter()
    for r in records:
        if r.get("type") not in ("sweep", "epoch") or not r.get("hosts"):
            continue
        if r["type"] == "epoch":
            name = str(r.get("strategy", "?"))
            epochs[name] += 1
        else:
            name = "limit" if r.get("collective") == "sendrecv" else r.get("algorithm", "?")
        per = sums.setdefault(name, {})
        for h in r["hosts"]:
            acc = per.setdefault(int(h["rank"]), [0.0] * 6)
            for k, key in enumerate(
                ("tx_bytes", "computed_tx_bytes", "rx_bytes", "computed_rx_bytes", "cpu_user", "cpu_system")
            ):
                acc[k] += float(h.get(key) or 0)
    if not sums:
        return None
    address = {int(h["rank"]): str(h.get("address", "?")) for r in records for h in r.get("hosts") or []}
    lines = []
    for name, per in sums.items():
        n = epochs[name] or 1  # a sweep's are summed over its sizes
        hosts = [
            HostTraffic(
                rank=rank,
                address=address.get(rank, "?"),
                nic=NIC,
                tx_bytes=int(acc[0] / n),
                rx_bytes=int(acc[2] / n),
                computed_tx_bytes=int(acc[1] / n) or None,
                computed_rx_bytes=int(acc[3] / n) or None,
            )
            for rank, acc in sorted(per.items())
        ]
        what = "per step, mean of its epochs" if epochs[name] else "per iteration, summed over sizes"
        lines.append(traffic_table(hosts, f"{name}: {what}, counted by each rank"))
    return "\n".join(lines)


def report(config: ClusterConfig, hosts: Sequence[HostTraffic], records: Sequence[dict[str, Any]]) -> str:
    """What the cluster prints after the run: traffic per host, and the alpha-beta fit of a sweep."""
    from commbench.bench import alphabeta

    s = config.shaping
    netem = (("delay", s.delay_us, "us"), ("jitter", s.jitter_us, "us"), ("loss", s.loss_percent, "%"))
    extra = "".join(f", {name} {value:g}{unit}" for name, value, unit in netem if value)
    parts = [
        f"\n# cluster: {config.hosts} host{'s' if config.hosts != 1 else ''}, "
        f"links {s.link_gbps:g} Gbit/s each way "
        f"(MTU {s.mtu}, tbf burst {s.burst} B, queue {s.queue_ms:g} ms{extra})",
        traffic_table(hosts, "whole run, counted at each host's switch port (frames)"),
    ]
    if table := per_point_tables(records):
        parts.append(table)
    if any(r.get("type") == "sweep" for r in records):
        parts.append(_fit(alphabeta.points(records), s.burst))
    return "\n".join(parts)


def _fit(pts: Sequence[Any], burst: int) -> str:
    """The alpha-beta fit of a sweep's points, less those whose bytes in sequence fit in a link's
    burst: the shaper lets them through at the host's own speed (a 256 KiB rd at 0.32 GB/s on a
    1 Gbit/s link, which took 1/beta to 0.19 GB/s, above the link's 0.125)."""
    from commbench.bench import alphabeta

    shaped = [p for p in pts if p.critical_bytes > burst]
    if len(shaped) < 2:
        return (
            f"# alpha-beta fit not made: {len(shaped)} point(s) of more than the {burst}-byte burst on a "
            "link, and one rank moves nothing across one (give -e of a few MiB, and 2 hosts or more)"
        )
    try:
        model = alphabeta.fit(shaped)
    except ValueError as exc:
        return f"# alpha-beta fit not made: {exc}"
    left = len(pts) - len(shaped)
    unshaped = (
        f"\n# {left} point(s) left out of the fit: their bytes fit in the links' {burst}-byte burst, "
        "which passes unshaped"
        if left
        else ""
    )
    return alphabeta.table(model, alphabeta.compare(shaped, model)) + unshaped
