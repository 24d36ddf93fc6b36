"""Starting ranks: torch.distributed's elastic launcher locally, or the environment a launcher set.

``run(fn, args, world_size=N)`` starts N local ranks through the elastic launcher (the engine of
torchrun) with a c10d rendezvous on 127.0.0.1 whose port the launcher picks. Under torchrun or
SLURM (RANK and WORLD_SIZE, or SLURM_PROCID and SLURM_NTASKS, set) it runs ``fn`` in this
process instead, so multi-node runs are ``torchrun --nnodes ... -m commbench ...``. Either way
each rank joins a process group before ``fn`` runs and leaves it after.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from commbench.bench import openmp, signals, starter
from commbench.bench.starter import launched_externally
from commbench.comm import p2p

BACKENDS = ("gloo", "nccl")
MIN_TIMEOUT_S = 1.0  # the rendezvous takes whole seconds; below one it has no time at all
MAX_TIMEOUT_S = 1e7  # 116 days; far larger overflows the launcher's deadline arithmetic
FAILED_RANK_LINGER_S = 1.0  # see _rank_main
SCRATCH_REMOVAL_S = 5.0  # see _scratch_dir
ORPHAN_GRACE_S = 30.0  # see _stop_when_gone; the agent's own grace before it kills a rank
# The signals that torch's elastic agent takes over when it starts the ranks, by default
# (LaunchConfig.signals_to_handle, the TORCHELASTIC_SIGNALS_TO_HANDLE variable; older torch: these four).
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
_stopping = False  # this rank is being stopped by a signal
_joined = False  # this rank has joined its group and made its connections
_node_refusal: str | None = None  # kept by node_checks, said on every rank by check_same_work
# A rank's error that says it gave up waiting for a peer's message: gloo's "Timed out waiting
# 15000ms for recv operation to complete" (or send). NCCL's watchdog aborts the waiting rank
# (SIGABRT) rather than raising in it, which leaves no such text to read.
WAITED_OUT = re.compile(r"Timed out waiting \d+ms for (recv|send)")


Interrupted = signals.Interrupted  # defined beside the handlers, where code without torch can catch it


class RankFailed(RuntimeError):
    """A rank ended with an error or was killed; the message names the rank. ``bad_input``: the rank
    refused its input (exit 2), where the message alone cannot say so."""

    def __init__(self, rank: int, message: str, *, bad_input: bool = False) -> None:
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank
        self.detail = message
        self.bad_input = bad_input


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """How ranks are started and joined. ``backend=None`` picks nccl on cuda, gloo on cpu."""

    world_size: int = 1
    device: str = "cpu"
    backend: str | None = None
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose from {', '.join(BACKENDS)}")
        if self.backend == "nccl" and self.device != "cuda":
            raise ValueError("backend nccl needs --device cuda")
        if not (MIN_TIMEOUT_S <= self.timeout_s <= MAX_TIMEOUT_S):
            raise ValueError(
                f"timeout must be a finite number of seconds >= {MIN_TIMEOUT_S:g} (ranks need that long "
                f"to meet) and <= {MAX_TIMEOUT_S:g}, got {self.timeout_s}"
            )

    @property
    def resolved_backend(self) -> str:
        return self.backend or ("nccl" if self.device == "cuda" else "gloo")


def _adopt_slurm_env() -> None:
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env["SLURM_NTASKS"]
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
        env.setdefault("MASTER_PORT", str(slurm_port(env)))


def slurm_port(env: Any) -> int:
    """The rendezvous port of a SLURM job that set no MASTER_PORT: one per job id, from 29500 up
    to below Linux's ephemeral ports (two jobs on one node both took 29500, and the second failed)."""
    try:
        return 29500 + int(env.get("SLURM_JOB_ID", "")) % 3000
    except ValueError:
        return 29500


# Environment variables that hold this host's rank count, tried in turn; the first that can be
# read counts. SLURM sets SLURM_NTASKS_PER_NODE only where --ntasks-per-node was given, and gives
# every node's count in SLURM_STEP_TASKS_PER_NODE and SLURM_TASKS_PER_NODE ("2(x3),1").
_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def local_ranks() -> int:
    """Ranks on this host of a launch made by torchrun or SLURM (1 where neither says)."""
    env = os.environ
    for count in (
        _count(env.get("LOCAL_WORLD_SIZE", "")),
        *(_node_count(env.get(name, ""), env.get("SLURM_NODEID", "")) for name in _PER_NODE),
        _count(env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]),
    ):
        if count is not None:
            return count
    return 1


def _count(text: str) -> int | None:
    try:
        return max(1, int(text))
    except ValueError:
        return None


def _node_count(text: str, node: str) -> int | None:
    """Node ``node``'s entry of SLURM's per-node list ``text`` ("2(x3),1": 2, 2, 2 and 1); None
    where either cannot be read."""
    if not node.isdigit():
        return None
    left = int(node)  # nodes before this one, in the entries not yet read
    for part in text.split(","):
        each, repeat, times = part.strip().partition("(x")
        if not (each.isdigit() and (not repeat or (times.endswith(")") and times[:-1].isdigit()))):
            return None
        nodes = int(times[:-1]) if repeat else 1
        if left < nodes:
            return max(1, int(each))
        left -= nodes
    return None


def external_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))


def writes_outputs() -> bool:
    """Whether this process writes the run's files: one that starts its ranks itself does, and
    under torchrun or SLURM rank 0 alone (a rank number that cannot be read counts as rank 0, so
    its paths are checked)."""
    if not launched_externally():
        return True
    env = os.environ
    try:
        return int(env.get("RANK", env.get("SLURM_PROCID", "0"))) == 0
    except ValueError:
        return True


def _rank_main(
    fn: Callable[..., Any],
    args: tuple,
    spec: LaunchSpec,
    error_dir: str | None,
    env: Any = None,
    launcher: int | None = None,
    ignored: tuple[int, ...] = (),
) -> Any:
    """Body of every rank: join the group, run ``fn``, leave; record a one-line error on failure.

    ``env`` is the launcher's environment change for a rank forked from the fork server;
    ``launcher`` the pid of the launcher, whose end stops the rank (:func:`_stop_when_gone`);
    ``ignored`` the stop signals that the launcher inherited as ignored (``nohup``), which the
    rank ignores too (the fork server that forked it does not)."""
    if error_dir is not None:
        starter.take_environment(env)
        starter.name_rank(os.environ.get("RANK", "?"))
        # Until the group is joined there is nothing to flush: a signal ends the rank at once, even
        # inside the rendezvous' C++ waits, which a Python handler would sit out.
        for signum in signals.STOPS:
            signal.signal(signum, signal.SIG_IGN if signum in ignored else signal.SIG_DFL)
        unblock_stop()
        if launcher is not None:
            _stop_when_gone(launcher)
    try:
        torch.set_num_threads(_threads())
        device = torch.device(spec.device)
        if spec.device == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("--device cuda asked for, but CUDA is not available")
            local = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
            torch.cuda.set_device(local)
            device = torch.device("cuda", local)
        kwargs: dict[str, Any] = {}
        if spec.resolved_backend == "nccl":
            kwargs["device_id"] = device
        global _joined
        _joined = False
        with _interrupt_ends_at_once(error_dir is None):
            dist.init_process_group(
                spec.resolved_backend, timeout=timedelta(seconds=spec.timeout_s), **kwargs
            )
        try:
            # Here, so that no timed or counted interval pays for its set-up. Its connections are
            # made in a C++ wait on the launcher's store, which a signal must end at once too: with
            # a handler the rank waited for the launcher to exit and printed the store's C++ error.
            with _interrupt_ends_at_once(error_dir is None):
                p2p.prepare(None)
            _joined = True
            if error_dir is None:  # each node parsed its own command line; this launcher's ranks share one
                check_same_work(args)
            if error_dir is not None:
                # Ctrl-C reaches every rank: leave quietly (finally-blocks still flush finished records).
                # So does a closed terminal's SIGHUP: its default action skipped the exit's clean-up,
                # and multiprocessing's resource tracker then reported tqdm's lock as leaked.
                for signum in signals.STOPS:
                    if signum not in ignored:
                        signal.signal(signum, _exit_on_signal)
                # as long as the handlers: a finaliser can take a stop after ``fn`` (tqdm's bar,
                # freed with the traceback of the error that ended it)
                sys.unraisablehook = _stop_again_after_finalisers(sys.unraisablehook)
                result = fn(*args)
                # for the launcher, should a peer fail later: this rank is not one that hung (a
                # hint: a scratch directory gone with its launcher must not fail finished work)
                with contextlib.suppress(OSError):
                    Path(error_dir, f"rank{os.environ.get('RANK', '?')}.done").touch()
                return result
            # Under torchrun or SLURM too: torchrun passes a SIGTERM or SIGHUP on to its ranks, whose
            # default action skipped the finally-blocks (a sweep lost its probe record). This process
            # is the caller's, so its handlers come back after ``fn``.
            with (
                signals.handled(signals.STOPS, _exit_on_signal),
                _stops_kept_from_finalisers(),
                _stops_end_waits(),
            ):
                return fn(*args)
        except BaseException as exc:
            _record(error_dir, exc)  # before leaving the group wakes the peers with errors of their own
            raise
        finally:
            dist.destroy_process_group()
    except BaseException as exc:
        if error_dir is None:
            raise
        _record(error_dir, exc)
        # Under our launcher the parent reports the first failure in one line: no traceback here.
        sys.stdout.flush()
        if not _stopping:
            # A peer that died without a word (os._exit, a crash, SIGKILL) is known to the launcher
            # only by its exit status, and the launcher reports the first rank it sees end. This
            # rank's error is likely that peer's lost connection: it ends a moment after the peer.
            time.sleep(FAILED_RANK_LINGER_S)
        raise SystemExit(1) from None


# What may differ between the nodes of one run: where rank 0 writes (the others write nothing), a
# node's own dataset and weights files, and how each prints or samples.
PER_NODE = frozenset({"json_path", "csv_path", "plot_path", "data_dir", "quiet", "probe_interval_s"})


def work_of(args: tuple) -> dict[str, Any]:
    """The options of a run that every rank must share, from the configurations in ``args``: a
    sweep's or a training's fields, less :data:`PER_NODE` and a model's ``weights`` file."""
    import dataclasses

    work: dict[str, Any] = {}
    for config in args:
        if not dataclasses.is_dataclass(config):
            continue
        for field in dataclasses.fields(config):
            if field.name in PER_NODE:
                continue
            value = getattr(config, field.name)
            if field.name == "model_options":
                value = tuple((k, v) for k, v in value if k != "weights")
            work[field.name] = value
    return work


@contextlib.contextmanager
def node_checks() -> Iterator[None]:
    """The block checks what may differ from rank to rank before the ranks start: what this node
    holds (data files, a weights file, memory) and the files rank 0 alone writes. Under
    commbench's own launcher its ValueError goes on at once; under torchrun or SLURM it is kept,
    the rank joins its group, and :func:`check_same_work` raises it on every rank: ranks that
    refused before joining left the others waiting out --timeout for a group they would never
    fill, and said nothing of why."""
    global _node_refusal
    if not launched_externally():
        yield
        return
    try:
        yield
    except ValueError as exc:
        _node_refusal = str(exc)


def check_same_work(args: tuple) -> None:
    """ValueError on every rank where a rank's node refused its input (:func:`node_checks`), naming
    the first such rank, or where the ranks of torchrun's or SLURM's were started with other
    options, naming the first that differs. Each node parses its own command line: with another -e
    or --strategy on one node, the ranks sent messages of other sizes or to other peers, and rank 0
    finished a sweep of its own sizes while rank 1 failed in gloo, or a rank aborted in C++."""
    global _node_refusal
    mine = work_of(args)
    refusal, _node_refusal = _node_refusal, None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, refusal))
    refused = [(rank, text) for rank, (_, text) in enumerate(gathered) if text is not None]
    if refused:
        rank, text = refused[0]
        more = f", and {len(refused) - 1} other rank(s)" if len(refused) > 1 else ""
        raise ValueError(f"{text} (said by rank {rank}{more})")
    everyone = [work for work, _ in gathered]
    for rank, theirs in enumerate(everyone):
        if theirs == mine:
            continue
        name = next((k for k in mine if mine[k] != theirs.get(k)), None) or next(
            iter(theirs.keys() - mine.keys())
        )
        raise ValueError(
            f"the ranks were started with other options: {name} is {mine.get(name)!r} on rank "
            f"{dist.get_rank()} and {theirs.get(name)!r} on rank {rank} (give every node the same command)"
        )


@contextlib.contextmanager
def _interrupt_ends_at_once(external: bool) -> Iterator[None]:
    """In a rank that torchrun or SLURM started (``external``), SIGINT takes its default action
    while the block runs, where Python's own handler would raise KeyboardInterrupt: in the C++
    waits of a group's joining it ran only when the wait ended (a Ctrl-C waited out the whole
    --timeout). The CLI leaves SIGTERM and SIGHUP at theirs there; a handler of the caller's, or
    an ignore, is kept."""
    if (
        not external
        or threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def unblock_stop() -> None:
    """Let this rank receive the stop signals that its fork server held blocked for it; one that
    reached it while blocked (a Ctrl-C the moment it was forked) acts now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, set(signals.STOPS))


def _stop_when_gone(launcher: int) -> None:
    """Stop this rank as a SIGTERM from its launcher would, once the process ``launcher`` has ended.

    A launcher killed outright (SIGKILL, the out-of-memory killer) stops nothing: its ranks ran
    the sweep to its end and then waited for ever for it to read their results. A thread waits
    for the launcher's end, then sends the main thread SIGTERM: the rank's handler saves what it
    finished and leaves, as when the launcher stops it; one still there after
    :data:`ORPHAN_GRACE_S` (in a C++ wait) is killed, as the agent would have done. The rank keeps
    the fork server's "alive" pipe, which every child of the server inherits, open to its end:
    the server then ends after its last rank, as it must (commbench.bench.rankgate), and removes
    what the launcher left (:func:`commbench.bench.starter.remove_what_the_launcher_left`)."""
    threading.Thread(target=_watch_launcher, args=(launcher,), name="commbench-launcher", daemon=True).start()


def _watch_launcher(launcher: int) -> None:
    _wait_for_end(launcher)
    # To the main thread: a signal that another thread takes acts at the main thread's next Python
    # instruction, and it may be waiting in a semaphore (the agent's queue) for ever.
    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
    time.sleep(ORPHAN_GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_for_end(pid: int) -> None:
    """Return once the process ``pid`` has ended (a zombie counts as ended)."""
    try:
        watched = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd here (not Linux, or before 5.3): ask every second
        with contextlib.suppress(ProcessLookupError):
            while True:
                os.kill(pid, 0)
                time.sleep(1.0)
        return
    try:
        poll = select.poll()
        poll.register(watched, select.POLLIN)
        while not poll.poll():
            pass
    finally:
        os.close(watched)


def _threads() -> int:
    """Torch's threads in a rank: OMP_NUM_THREADS if set (applied here, as a rank forked from the
    fork server has torch loaded already), else one where a host runs several ranks (torchrun's or
    SLURM's count, or this launcher's), which is what torchrun sets, and every core this process
    may use for a rank alone. Sharing the cores out instead (8 threads for each of 2 ranks on 16
    cores) made gloo with CUDA tensors lose to its own calls: the hand-written reductions on host
    copies took the cores gloo's threads needed (docs/PERFORMANCE.md, "Threads per rank on a GPU
    host")."""
    given = openmp.omp_threads()
    if given is not None:
        return given
    if local_ranks() > 1:
        return 1
    return _cores()


def _cores() -> int:
    """The cores this process may run on (its affinity where the platform says, else all)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _exit_on_signal(signum: int, frame: Any) -> None:
    global _stopping
    _stopping = True
    signals.ignore_further()  # one signal is enough; a second would interrupt cleanup
    raise SystemExit(128 + signum)


FINALISER_RETRY_S = 0.01  # see _stop_again_after_finalisers


def _stop_again_after_finalisers(previous: Callable[[Any], None]) -> Callable[[Any], None]:
    """An unraisable hook for a rank. A rank's stop (:func:`_exit_on_signal`'s SystemExit) raised
    while a finaliser runs (a ``__del__``, such as tqdm's bar's, freed as a rank refused its batch
    while the launcher stopped the other; a weakref callback; a generator's ``finally``) is one
    Python prints ("Exception ignored in ...") and drops: the rank went on, deaf to further stop
    signals. This keeps it from stderr, puts the signal's handler back and sends the signal again
    from a daemon thread, to be taken once the finaliser is done; ``previous`` has the rest (the
    launcher's side is :func:`_stops_in_finalisers`)."""

    def again(unraisable: Any) -> None:
        exc = unraisable.exc_value
        if not (_stopping and isinstance(exc, SystemExit) and _signal_name(exc.code)):
            previous(unraisable)
            return
        signum = int(exc.code) - 128
        signal.signal(signum, _exit_on_signal)
        timer = threading.Timer(FINALISER_RETRY_S, os.kill, (os.getpid(), signum))
        timer.daemon = True  # an exit under way does not wait for it
        timer.start()

    return again


@contextlib.contextmanager
def _stops_kept_from_finalisers() -> Iterator[None]:
    """:func:`_stop_again_after_finalisers` for the block, the caller's hook after it."""
    previous = sys.unraisablehook
    sys.unraisablehook = _stop_again_after_finalisers(previous)
    try:
        yield
    finally:
        sys.unraisablehook = previous


STOP_IN_WAIT_GRACE_S = 5.0  # see _stops_end_waits


@contextlib.contextmanager
def _stops_end_waits() -> Iterator[None]:
    """For a rank of torchrun's or SLURM's: a stop signal that its handler has not acted on within
    :data:`STOP_IN_WAIT_GRACE_S` ends the rank, with a line saying so. Python runs a handler only
    between instructions, never inside a C++ wait: a rank waiting on a peer's message when a rank
    was killed sat out the SIGTERM that torchrun then sent, until torchrun's SIGKILL 30 s later,
    with no word. A thread hears of the signal at once, through the wakeup descriptor Python's own
    C-level handler writes to; rank 0's records are on disk as each is written."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    heard, tell = os.pipe()
    os.set_blocking(tell, False)
    left = threading.Event()  # the block, as the handler's SystemExit leaves it too
    previous = signal.set_wakeup_fd(tell, warn_on_full_buffer=False)
    watch = threading.Thread(target=_end_a_stuck_stop, args=(heard, left), name="commbench-stop", daemon=True)
    watch.start()
    try:
        yield
    finally:
        left.set()
        signal.set_wakeup_fd(previous)
        os.close(tell)  # the thread reads its end and leaves


def _end_a_stuck_stop(heard: int, left: threading.Event) -> None:
    try:
        while received := os.read(heard, 64):
            stops = [s for s in received if s in signals.STOPS]
            if stops:
                if left.wait(STOP_IN_WAIT_GRACE_S):  # the handler acted: the main thread could run it
                    return
                name = signal.Signals(stops[0]).name
                rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "?"))
                os.write(
                    2, f"commbench: rank {rank} stopped by {name} inside a wait for its peers\n".encode()
                )
                os._exit(128 + stops[0])
    finally:
        os.close(heard)


def _described(exc: BaseException) -> str:
    """ "Type: first line of the message", or the type's name alone for an empty message."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _record(error_dir: str | None, exc: BaseException) -> None:
    """Write "time<TAB>Type: first line" for this rank, once."""
    path = Path(error_dir or "", f"rank{os.environ.get('RANK', '?')}.err")
    if error_dir is None or path.exists():
        return
    text = _described(exc)
    if _stopping and isinstance(exc, SystemExit) and (name := _signal_name(exc.code)):  # _exit_on_signal's
        text = f"{STOPPED_BY}{name}"
    # Whole or not at all: the launcher reads it while it stops the other ranks, this one among
    # them, and once read an empty file, written by a rank stopped between opening and writing.
    part = path.with_name(path.name + ".part")
    part.write_text(f"{time.time()!r}\t{text}")
    os.replace(part, path)


STOPPED_BY = "stopped by "  # a rank's record of the stop signal that ended it: "stopped by SIGTERM"


def _signal_name(code: Any) -> str | None:
    """SIGTERM for the exit code 143 of a stopped process; None for any other code."""
    try:
        return signal.Signals(int(code) - 128).name
    except (TypeError, ValueError):
        return None


def run(fn: Callable[..., Any], args: tuple, spec: LaunchSpec) -> dict[int, Any]:
    """Run ``fn(*args)`` on every rank; returns {rank: return value} for the ranks of this node.

    Raises:
        RankFailed: a rank raised or died; the others are stopped, nothing is left running.
    """
    if launched_externally():
        _adopt_slurm_env()
        rank = int(os.environ["RANK"])
        try:
            return {rank: _rank_main(fn, args, spec, None)}
        except SystemExit as exc:
            if not _stopping:
                raise
            raise Interrupted(int(exc.code) - 128) from None  # for the CLI to say so in one line
        except dist.DistError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if _joined:  # a peer lost, NCCL's error: not a failure to join
                raise RankFailed(rank, f"{type(exc).__name__}: {first}") from None
            # most often variables left from another job's launcher
            where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
            raise RankFailed(
                rank,
                f"could not join the group of WORLD_SIZE={external_world_size()} at {where} "
                f"(RANK and WORLD_SIZE, or SLURM's variables, are set, so this process is taken "
                f"for one rank of a launched job): {type(exc).__name__}: {first}",
            ) from None
        except (ValueError, TypeError, OSError, RankFailed, Interrupted):
            raise  # bad input (exit 2), the file system's refusal, a launch's: the CLI says each in one line
        except Exception as exc:
            # Any other error in the rank, as this launcher's own ranks report it: gloo's lost peer
            # ("Connection closed by peer", a RuntimeError) printed its traceback, 50 lines a rank.
            raise RankFailed(rank, _described(exc)) from None
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _cheap_rendezvous_event_names()
    quiet = (
        "torch.distributed.elastic",
        "torch.distributed.launcher",
        "torchelastic",
        "torch.multiprocessing",
    )
    # The launcher's progress chatter, and its multi-line report of a failed rank (RankFailed says it in one).
    for name in [*logging.root.manager.loggerDict, *quiet]:
        if name.startswith(quiet):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    method = starter.start_method(spec.world_size)
    forked = method == starter.START_METHOD
    check_local_ranks(spec.world_size)
    lost: list[int] = []  # stops whose exception a finaliser dropped
    # nohup's SIGHUP, a background job's SIGINT: left ignored by the launcher and by its ranks
    ignored = {s for s in {*signals.STOPS, *_agent_signals()} if signal.getsignal(s) == signal.SIG_IGN}
    try:
        with _stops_raise(SignalException, ignored) as rearm:
            if forked:  # first: the scratch directory goes beside the server's socket
                starter.ready(spec.timeout_s)
            with _scratch_dir(starter.scratch_place() if forked else None) as error_dir:
                config = LaunchConfig(
                    min_nodes=1,
                    max_nodes=1,
                    nproc_per_node=spec.world_size,
                    run_id=f"commbench-{uuid.uuid4().hex[:8]}",
                    rdzv_backend="c10d",
                    rdzv_endpoint="127.0.0.1:0",
                    rdzv_configs={"timeout": int(spec.timeout_s)},
                    max_restarts=0,
                    monitor_interval=0.1,
                    start_method=method,
                    local_addr="127.0.0.1",
                    # The agent's per-rank directories, in ours: by default it left an empty tree in
                    # the system's temporary directory at every launch.
                    logs_specs=DefaultLogsSpecs(log_dir=os.path.join(error_dir, "agent")),
                )
                change = starter.environment_change() if forked else None  # a spawned rank has ours
                try:
                    with _stops_in_finalisers(SignalException, lost, rearm):
                        launcher = os.getpid()
                        results = elastic_launch(config, _rank_main)(
                            fn, args, spec, error_dir, change, launcher, tuple(ignored & set(signals.STOPS))
                        )
                except ChildFailedError as exc:
                    if lost:  # the ranks were ended by that stop
                        raise Interrupted(lost[0]) from None
                    failure = _first_failure(exc, error_dir, spec.world_size)
                    if forked and starter.server_gone():  # its ranks get SIGINT (torch's PDEATHSIG)
                        gone = "the fork server that started the ranks had ended"
                        failure = RankFailed(
                            failure.rank, f"{failure.detail} ({gone})", bad_input=failure.bad_input
                        )
                    elif failure.detail.startswith(STOPPED_BY):  # a stop sent to a rank alone
                        raise Interrupted(signal.Signals[failure.detail[len(STOPPED_BY) :]]) from None
                    raise failure from None
    except SignalException as exc:  # the agent has stopped the ranks before raising this
        raise Interrupted(int(exc.sigval)) from None
    except KeyboardInterrupt as exc:  # Ctrl-C, or the CLI's SIGTERM/SIGHUP before the handlers
        raise Interrupted(getattr(exc, "signum", signal.SIGINT)) from None
    if lost:
        raise Interrupted(lost[0])
    return dict(sorted(results.items()))  # the agent's is in the order the ranks ended


@contextlib.contextmanager
def _stops_raise(
    raised: Callable[[str, signal.Signals], BaseException], ignored: set[int]
) -> Iterator[Callable[[], None]]:
    """From the start of a launch, the stop signals raise ``raised`` (msg, signal), as the agent's
    own handler does once it starts the ranks, and the first makes the others, and any that
    follow, do nothing (:func:`commbench.bench.signals.ignore_further`); the handlers from before
    the launch of every signal the agent takes over come back after it (SIGQUIT too: the agent's
    stayed, and a SIGQUIT after a launch raised its exception where nothing catches it, in place
    of its default action). Yields ``rearm()``, which undoes what the last stop did to the others.

    Before the agent's handler, SIGTERM and SIGHUP took their default action: a SIGTERM while the
    fork server started or the rendezvous was made ended this process at once (2 of 8 SIGTERMs
    sent 2 to 5 s into a 2-rank sweep), without "interrupted" and leaving its scratch directory.
    After the launch, the agent's handler stayed, and a stop there would have raised its exception
    where nothing catches it. A second Ctrl-C a moment after the first (the agent's own handler
    raised again) cut short the agent's stopping of the ranks or the removal of the scratch
    directory, which then stayed behind.
    """
    taken = _agent_signals()
    quieted: dict[int, Any] = {}
    # The agent sets its handler for each signal it takes over, those inherited as ignored
    # (``ignored``) too: that handler is this one, which lets those be.

    def stop(signum: int, frame: Any) -> None:
        if signum in ignored:
            return
        quieted.update(signals.ignore_further(taken))
        sig = signal.Signals(signum)
        raise raised(f"commbench launcher got {sig.name}", sig)

    def rearm() -> None:
        while quieted:
            signal.signal(*quieted.popitem())

    with signals.handled(signals.STOPS, stop, also_restore=taken), _agent_handler(stop):
        yield rearm


@contextlib.contextmanager
def _agent_handler(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """The elastic agent sets ``handler`` instead of its own for the signals it takes over (its
    own raises its SignalException, as ``handler`` must). Where torch has no such function, or
    off the main thread (where the agent sets no handlers, and launches may overlap), nothing
    changes."""
    from torch.distributed.elastic.multiprocessing import api

    own = getattr(api, "_terminate_process_handler", None)
    if not callable(own) or threading.current_thread() is not threading.main_thread():
        yield
        return
    api._terminate_process_handler = handler
    try:
        yield
    finally:
        api._terminate_process_handler = own


def _agent_signals() -> tuple[int, ...]:
    """Every signal the elastic agent may set its handler for: torch's default list, the one its
    LaunchConfig names and the one the environment names, less those no handler can take
    (SIGKILL or SIGSTOP named there ended a launch with "[Errno 22] Invalid argument" as their
    handlers were put back)."""
    from torch.distributed.launcher.api import LaunchConfig

    lists = (AGENT_SIGNALS, getattr(LaunchConfig, "signals_to_handle", ""))
    names = ",".join((*lists, os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", ""))).split(",")
    found = {getattr(signal, name.strip(), None) for name in names} - {signal.SIGKILL, signal.SIGSTOP}
    return tuple(sorted(s for s in found if isinstance(s, signal.Signals)))


@contextlib.contextmanager
def _stops_in_finalisers(
    raised: type[BaseException], lost: list[int], rearm: Callable[[], None] = lambda: None
) -> Iterator[None]:
    """Keep the stop that the agent's signal handler raises (``raised``, with its ``sigval``; or a
    KeyboardInterrupt) when it is raised while a finaliser (``__del__``, a weakref callback) runs:
    Python prints such an exception and drops it, and the launch went on. The signal numbers of
    such stops are added to ``lost`` instead of printed, ``rearm()`` is called (the stop made the
    others do nothing), and the launch then ends as interrupted.

    A Ctrl-C reaches the ranks too, which leave, so the run still ends at once (seen once in make
    test: a temporary file's finaliser took it, and the run ended "rank 0 failed: killed by
    SIGINT" under the dropped exception's traceback). A signal sent to this process alone, taken
    in a finaliser, is acted on only when the ranks end; a second one acts as usual."""
    previous = sys.unraisablehook

    def keep(unraisable: Any) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, raised):
            lost.append(int(exc.sigval))
            rearm()
        elif isinstance(exc, KeyboardInterrupt):
            lost.append(signal.SIGINT)
            rearm()
        else:
            previous(unraisable)

    sys.unraisablehook = keep
    try:
        yield
    finally:
        sys.unraisablehook = previous


@contextlib.contextmanager
def _scratch_dir(place: tuple[str, str] | None = None) -> Iterator[str]:
    """A temporary directory for the ranks' error records and the agent's logs, removed on the way
    out: in the system's temporary directory, or in ``place`` (directory, name prefix), where the
    fork server finds it if the launcher is killed before it can remove it
    (:func:`commbench.bench.starter.scratch_place`).

    Once, in a run stopped by a closed terminal during `make test`, a rank wrote its record into
    it while it was being removed: the removal failed with "Directory not empty", and that
    replaced the run's "interrupted". The cause was the fork server ending on the terminal's
    SIGHUP, so that the launcher stopped waiting for its ranks (commbench.bench.rankgate has the
    fix). As a safeguard, removal is still tried again for up to :data:`SCRATCH_REMOVAL_S`, and a
    tree that cannot be removed is left rather than reported as the run's failure: a leftover
    directory costs less than a lost "interrupted" or result."""
    folder, prefix = place or (None, "commbench-")
    path = tempfile.mkdtemp(prefix=prefix, dir=folder)
    try:
        yield path
    finally:
        deadline = time.monotonic() + SCRATCH_REMOVAL_S
        shutil.rmtree(path, ignore_errors=True)
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
            shutil.rmtree(path, ignore_errors=True)


def check_local_ranks(ranks: int) -> None:
    """Refuse ``ranks`` local ranks where they would be spawned (beyond the fork server's count)
    and this host's memory cannot hold them (:func:`_check_spawn_memory`); ValueError, one line."""
    if starter.start_method(ranks) != starter.START_METHOD:
        _check_spawn_memory(ranks)


def _check_spawn_memory(ranks: int) -> None:
    """Refuse to spawn more ranks than this host's memory holds. A spawned rank imports torch
    itself and holds about what this process (which has imported it too) holds; forked ranks share
    the fork server's pages instead."""
    import psutil

    each = psutil.Process().memory_info().rss
    available = psutil.virtual_memory().available
    if ranks * each > available:
        gib = 1 << 30
        raise ValueError(
            f"{ranks} local ranks are more than the fork server can start ({starter.FORKSERVER_MAX_RANKS}), "
            f"and spawned, each would import torch itself: about {ranks * each / gib:.1f} GiB in all, more "
            f"than the {available / gib:.1f} GiB of memory available here; use fewer ranks, or torchrun "
            "on more hosts"
        )


def _cheap_rendezvous_event_names() -> None:
    """Name the c10d rendezvous' log events from the frame instead of ``inspect.stack()``.

    The dynamic rendezvous names every event after the calling method with two calls to
    ``inspect.stack()``, which reads the source of every frame on the stack: about 1.7 s of each
    local launch on a 2-core machine (measured with cProfile; a 2-rank sweep of one size went
    from 8.1 to 6.2 s). The name is the same; where torch has no such function nothing changes.
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = _method_name


def _method_name(depth: int = 2) -> str:
    """The name of the function ``depth`` frames up the stack (0: this one), as torch's helper gives."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def _first_failure(exc: Any, error_dir: str, world: int = 0) -> RankFailed:
    """The failure that came first: a rank's own error, not the peers it took down with it. Where
    that is a rank that gave up waiting for a peer's message (gloo's timeout) and some
    of the ``world`` ranks had neither failed nor finished their work, the first of those is
    named: it raised nothing, being hung (stopped, or in a driver's wait)."""
    # A rank that died on its own (an exit code, a crash, SIGKILL) is the likeliest cause: its
    # peers' recorded errors are then "connection closed". Next come ranks that raised, earliest
    # first, then ranks aborted (SIGABRT, as NCCL's watchdog does to peers) or stopped by the
    # launcher or the user. The launcher's timestamps are detection times, so they cannot order
    # a death against a raise. Last come ranks that recorded the stop signal that ended them (the
    # agent stops the others when one dies); but where every rank that failed left a record and
    # the earliest is such a stop, a signal was sent to that rank alone: it is the failure
    # returned, and the run was interrupted.
    found = []  # (class, time, rank, text)
    recorded = set()
    for path in Path(error_dir).glob("rank*.err"):
        stamp, _, text = path.read_text().partition("\t")
        rank = path.stem[4:]
        try:
            kind = 3 if text.startswith(STOPPED_BY) else 1
            found.append((kind, float(stamp), int(rank) if rank.isdigit() else -1, text))
        except ValueError:  # not a record this launcher's ranks write: go by the exit status
            continue
        recorded.add(rank)
    for rank, failure in exc.failures.items():
        if str(rank) in recorded:
            continue
        name = failure.signal_name()
        text = f"killed by {name}" if name != "<N/A>" else f"exited with code {failure.exitcode}"
        found.append(
            (2 if name in ("SIGABRT", "SIGTERM", "SIGINT") else 0, float(failure.timestamp), rank, text)
        )
    found.sort()
    if not found:
        return RankFailed(-1, str(exc))
    records = sorted((stamp, rank, text) for kind, stamp, rank, text in found if kind in (1, 3))
    if len(records) == len(found) and records[0][2].startswith(STOPPED_BY):
        _, rank, text = records[0]
        return RankFailed(rank, text)
    kind, _, rank, text = found[0]
    done = {p.stem[4:] for p in Path(error_dir).glob("rank*.done")}  # returned from their work
    silent = sorted(r for r in set(range(world)) - {r for _, _, r, _ in found} if str(r) not in done)
    if kind == 1 and silent and WAITED_OUT.search(text):
        # A stopped or hung rank (SIGSTOP, a wait in a driver) raises nothing: its peer's timeout
        # named the rank that waited, not the one it waited for.
        more = f" (and {len(silent) - 1} more)" if len(silent) > 1 else ""
        return RankFailed(
            silent[0], f"it{more} did not answer within the --timeout; rank {rank} gave up waiting: {text}"
        )
    return RankFailed(rank, text)
