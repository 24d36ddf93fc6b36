"""Typed result records and their writers: JSON Lines (one object a line) and CSV, flushed per record
so an interrupted run keeps every finished point."""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import stat
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from commbench.bench.signals import STOPS, Interrupted, noted


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepRecord:
    """One (size, algorithm) point of a sweep. Times are the slowest rank's, per iteration."""

    collective: str
    algorithm: str
    resolved_algorithm: str
    backend: str
    device: str
    world_size: int
    dtype: str
    op: str | None
    root: int | None
    size_bytes: int
    count: int
    iters: int
    warmup: int
    time_us: float
    time_us_min: float
    time_us_mean: float
    time_us_p90: float
    time_us_max: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int | None
    busbw_ratio_to_builtin: float | None
    limit_busbw_gbps: float | None
    frac_of_limit: float | None
    computed_sent_bytes_per_rank: list[int]
    computed_recv_bytes_per_rank: list[int]
    # From the counting pass (``--probe``), per iteration; None where not measured.
    computed_wire_bytes: int | None = None
    measured_wire_bytes: int | None = None
    wire_bytes_ratio: float | None = None
    wire_expected_ratio: float | None = None
    wire_check: str | None = None
    hosts: list[dict] | None = None
    block: int = 1  # iterations of one series run back to back (1: interleaved call by call)
    # The call wrote over its input: all_reduce, broadcast and reduce always, reduce_scatter and
    # all_gather with --in-place (nccl-tests' in-place column), the send/recv limit never.
    in_place: bool | None = None
    type: str = "sweep"


def say(text: str, end: str = "\n") -> None:
    """Print ``text`` on standard output. Once its reader has gone (``commbench sweep | head``),
    the rest is dropped and the run goes on, its records still written to their files."""
    try:
        print(text, end=end, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


# How long a named pipe given as an output may wait for its reader before the run is refused.
FIFO_READER_WAIT_S = 10.0
_HELD_FIFOS: list[int] = []  # write ends of named pipes, open until this process ends


def _hold_fifo(p: Path) -> None:
    """Open the named pipe ``p`` to write, once something reads it (``FIFO_READER_WAIT_S`` at most,
    then ValueError), and keep it open until this process ends: closed now, it would give the
    reader an end of file before the run wrote. With no reader, rank 0 waited in its open for ever
    and the others timed out in their first collective ("rank 1 failed: ... Timed out")."""
    waited = 0.0
    while True:
        try:
            _HELD_FIFOS.append(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            return
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: nothing has it open to read
                raise
        if waited >= FIFO_READER_WAIT_S:
            raise ValueError(
                f"cannot write {shown(p)}: a named pipe that nothing opened to read in "
                f"{FIFO_READER_WAIT_S:g} s (start its reader first)"
            )
        time.sleep(0.05)
        waited += 0.05


def check_writable(path: str | Path) -> None:
    """Raise ValueError unless ``path`` can be created or overwritten."""
    p = Path(path)
    try:
        if p.is_dir():
            raise ValueError(f"cannot write {shown(p)}: it is a directory")
        parent = p.parent if str(p.parent) else Path(".")
        if not parent.is_dir():
            raise ValueError(f"cannot write {shown(p)}: directory {parent} does not exist")
        # A check leaves nothing behind (a run refused later must not leave empty files), and
        # holds when several processes check one path at once, as every rank does under torchrun:
        # only the check that created the file removes it, and a file that another check removed
        # meanwhile was creatable. (Seeing whether it existed, then creating and removing it, made
        # one rank's removal fail on another's, and left files behind.)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            if p.is_fifo():
                _hold_fifo(p)
                return
            try:
                os.close(os.open(p, os.O_WRONLY | os.O_APPEND))  # there already: can it be written?
            except FileNotFoundError:  # removed meanwhile, or a link to a file not made yet
                if p.is_symlink():  # its target is what the run makes (one in no directory failed rank 0)
                    check_writable(p.parent / os.readlink(p))
        else:
            os.close(fd)
            p.unlink(missing_ok=True)
    except OSError as exc:  # no access to a directory on the way, a name too long, ...
        raise ValueError(f"cannot write {shown(p)}: {exc.strerror or exc}") from None


def output_path(text: str) -> str:
    """Argument type of every option naming a file or directory to write: an empty name is
    refused (it was taken for "not given", and nothing was written).

    A name of one of this process's file descriptors (``/dev/fd/5``, a shell's ``>(jq .)``,
    ``/dev/stdout``) becomes ``/proc/PID/fd/N`` with this process's id: the local ranks, which
    write the files, hold none of its descriptors past 0-2, and rank 0 opened its own fd N
    instead (a missing one failed the run once it had started, another took the records)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("needs a file name, got an empty one")
    fd = _own_fd(text)
    if fd is None:
        return text
    if _GIVEN is not None and fd not in _GIVEN:  # one commbench opened itself: a pipe of its own
        raise argparse.ArgumentTypeError(f"{text} names descriptor {fd}, which this command was not given")
    _TYPED[descriptor_path(fd)] = text
    return descriptor_path(fd)


def input_path(text: str) -> str:
    """Argument type of every file to read: an empty name is refused (it was read as the current
    directory, "cannot read : Is a directory")."""
    if not text:
        raise argparse.ArgumentTypeError("needs a file name, got an empty one")
    return text


_GIVEN: frozenset[int] | None = None  # the descriptors the command was started with
_TYPED: dict[str, str] = {}  # /proc/PID/fd/N -> the name given for it (/dev/stdout)


def shown(path: str | Path) -> str:
    """``path`` in the words the command was given: /dev/stdout rather than the /proc/PID/fd/1
    that :func:`output_path` made of it."""
    return _TYPED.get(str(path), str(path))


def note_given_descriptors() -> None:
    """Take note of the descriptors this process holds as a command starts, before commbench opens
    any: the ones that a name like /dev/fd/N may mean (the fork server's pipes took records)."""
    global _GIVEN
    _TYPED.clear()  # names given to an earlier command in this process (the tests run many)
    try:
        listed = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        _GIVEN = None
        return
    given = []
    for fd in listed:  # the listing's own descriptor is closed by now
        try:
            os.fstat(fd)
        except OSError:
            continue
        given.append(fd)
    _GIVEN = frozenset(given)


def given_descriptors() -> frozenset[int]:
    """The descriptors :func:`note_given_descriptors` found (none where it was not called)."""
    return _GIVEN or frozenset()


def descriptor_path(fd: int) -> str:
    """The name of this process's descriptor ``fd`` that another process can open."""
    return f"/proc/{os.getpid()}/fd/{fd}"


def names_descriptor(path: str | None) -> bool:
    """Whether ``path`` is one of this process's descriptors, as :func:`output_path` names them."""
    return bool(path) and re.fullmatch(rf"/proc/{os.getpid()}/fd/[0-9]+", str(path)) is not None


def is_stream(path: str | Path) -> bool:
    """Whether ``path`` is there and no regular file: a pipe, a terminal or another device, which
    keeps no stamp of what went through it and cannot be read back."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _own_fd(text: str) -> int | None:
    """The file descriptor of this process that ``text`` names through /proc/self/fd (/dev/fd/N,
    /dev/stdout, a link to one of them), or None."""
    own = os.path.realpath(f"/proc/{os.getpid()}/fd")
    p = Path(text)
    for _ in range(40):  # links followed one at a time: the last is the descriptor's own magic link
        try:
            if os.path.realpath(p.parent) == own:
                return int(p.name) if p.name.isascii() and p.name.isdigit() else None
            if not p.is_symlink():
                return None
            p = p.parent / os.readlink(p)
        except OSError:
            return None
    return None


def resolved(path: str | Path) -> Path:
    """``path`` made absolute, its links followed as far as they go. A loop of links stays as
    given (made absolute): Path.resolve raised RuntimeError for it, a traceback. An open through
    it then refuses in its own words; a file written beside it and renamed replaces it."""
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError):
        return Path(os.path.abspath(path))


def write_whole(path: str | Path, write: Callable[[Path], None]) -> None:
    """Have ``write`` make ``path`` through a file beside it, renamed over ``path`` once whole, so
    that a stopped or failed write leaves the last one as it was. A link is followed (its target
    is replaced), the old file's mode is kept, and what is not a regular file (a named pipe, the
    null device) is written in place."""
    target = resolved(path)
    if target.exists() and not target.is_file():
        write(target)
        return
    scratch = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        try:
            write(scratch)
        except PermissionError:
            if not target.is_file() or os.access(target.parent, os.W_OK):
                raise
            write(target)  # a directory this user may not add to, holding a file it may write
            return
        with contextlib.suppress(OSError):  # none there yet: the new file's mode stands
            shutil.copymode(target, scratch)
        os.replace(scratch, target)
    finally:
        with contextlib.suppress(OSError):  # a read-only file system: its error, not this one, is said
            scratch.unlink(missing_ok=True)


def check_distinct(**paths: str | None) -> None:
    """Raise ValueError when two of the output options (name=path) name the same file; the null
    device, which keeps nothing to mix, may take any number of them."""
    seen: dict[Path, str] = {}
    for name, path in paths.items():
        if not path:
            continue
        key = resolved(path)
        if key == resolved(os.devnull):
            continue
        if key in seen:
            raise ValueError(f"--{seen[key]} and --{name} name the same file {shown(path)}")
        seen[key] = name


# Formats matplotlib lists but cannot write by itself: pgf runs LaTeX (xelatex), and failed only
# once the whole run had finished.
PLOT_FORMATS_REFUSED = ("pgf",)


def _check_plot_format(path: str | Path) -> None:
    """Raise ValueError unless ``path`` is a file name matplotlib can save a plot as."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as exc:  # a broken install: one line, not the import's traceback
        raise ValueError(f"cannot plot to {shown(path)}: matplotlib does not import ({exc})") from None

    if names_descriptor(str(path)):  # matplotlib reads the format, and the companion plots' names, off it
        raise ValueError(f"cannot plot to {shown(path)}: it names a descriptor, not a file; give a file name")
    formats = sorted(set(FigureCanvasBase.get_supported_filetypes()) - set(PLOT_FORMATS_REFUSED))
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in formats:
        raise ValueError(
            f"cannot plot to {shown(path)}: the name must end in one of .{', .'.join(formats)}"
            f" (got {'.' + suffix if suffix else 'no suffix'})"
        )


def check_outputs(
    *, plot: str | None = None, beside: Sequence[Path] = (), writes: bool = True, **files: str | None
) -> None:
    """Refuse a run's output options (name=path, and ``plot``) before it starts: two naming one
    file, a file named where a plot drawn ``beside`` the main one goes (NAME-timeline.png: the plot
    replaced the records), a plot name matplotlib cannot save as, and, where ``writes``, a file
    that cannot be written.

    ``writes`` is False in the ranks that write nothing: under torchrun or SLURM only rank 0
    writes, and the others may run on nodes whose file systems lack its directories.
    """
    check_distinct(**files, plot=plot)
    if plot:
        _check_plot_format(plot)
        named = {resolved(path): name for name, path in files.items() if path}
        for other in beside:
            if (name := named.get(resolved(other))) is not None:
                raise ValueError(
                    f"--{name} {shown(files[name] or '')} is where the plot {other.name} beside "
                    f"--plot {shown(plot)} is drawn; name another file"
                )
    if writes:
        for path in (*files.values(), plot):
            if path:
                check_writable(path)
        for path in files.values():
            if path:
                check_not_busy(path)


def plots_beside(command: str, plot: str | None, probe: bool) -> list[Path]:
    """The plots ``command`` draws beside its main one, ``plot``: the timeline where it ``probe``s,
    and for a training run its loss curves."""
    if not plot:
        return []
    from commbench.bench.report import timeline_path

    beside = [timeline_path(plot)] if probe else []
    if command in ("train", "compare"):
        from commbench.bench.train import plot_paths

        beside.append(plot_paths(plot)[1])
    return beside


def _busy(path: str | Path, what: str = "file", instead: str = "name another file") -> str:
    held = f"is being written by another run (it holds the {what}'s lock)"
    return f"{shown(path)} {held}; {instead}, or wait for it"


def _free(fd: int, exclusive: bool) -> bool:
    """Take ``fd``'s lock without waiting; False where another holds it. A file system without
    locks takes none and answers True: its files are written as before."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        pass
    return True


def check_not_busy(path: str | Path) -> None:
    """ValueError where another run holds ``path`` open for its records (:func:`open_records`):
    two runs given one file wrote over each other's lines, and both ended as if all was well."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:  # not there (nobody writes it) or not readable (said by check_writable)
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode) and not _free(fd, exclusive=False):
            raise ValueError(_busy(path))
    finally:
        os.close(fd)


def open_records(path: str, newline: str | None = None) -> IO[str]:
    """``path`` opened to be written anew, a regular file held under an exclusive lock until it is
    closed; ValueError where another run holds it (see :func:`check_not_busy`, the check before the
    ranks start: this one settles two runs that passed it together). Truncated once the lock is
    held, so that the run refused leaves the other's lines as they were."""
    if is_stream(path):
        return open(path, "w", newline=newline)
    f = open(path, "a", newline=newline)
    if not _free(f.fileno(), exclusive=True):
        f.close()
        raise ValueError(_busy(path))
    f.truncate(0)
    return f


_HELD_DIRS: set[str] = set()  # the directories this process holds (see directory_held)


@contextlib.contextmanager
def directory_held(path: str | Path) -> Iterator[None]:
    """Hold the output directory ``path`` (made already) under an exclusive lock while the block
    writes into it: a report, a study or a profile. Another run holding it is refused (ValueError):
    two runs given one -o directory wrote plots of the same names over each other's, and a study's
    progress file over the other study's, each ending as if all was well. A directory this process
    holds already, or one that cannot be opened or locked (a file system without locks), is
    written as before."""
    real = os.path.realpath(path)
    fd = None
    if real not in _HELD_DIRS:
        try:
            fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            pass
    if fd is not None:
        if not _free(fd, exclusive=True):
            os.close(fd)
            raise ValueError(_busy(path, "directory", "give another -o"))
        _HELD_DIRS.add(real)
    try:
        yield
    finally:
        if fd is not None:
            _HELD_DIRS.discard(real)
            os.close(fd)


class RecordWriter:
    """Writes a header and records to JSON Lines and/or CSV as they come."""

    def __init__(self, json_path: str | None, csv_path: str | None) -> None:
        self._json: IO[str] | None = open_records(json_path) if json_path else None
        try:
            self._csv_file: IO[str] | None = open_records(csv_path, newline="") if csv_path else None
        except BaseException:
            if self._json is not None:
                self._json.close()
            raise
        self._csv: csv.DictWriter | None = None
        self._failed = False  # a write failed (a full disk): the files are closed, nothing more goes
        # Both files regular: a stop waits for a point to be in both. Not where either is a pipe or
        # a terminal, whose write can block for as long as its reader stalls, and a stop must end it.
        self._whole = bool(json_path and csv_path) and not (is_stream(json_path) or is_stream(csv_path))

    @contextlib.contextmanager
    def _naming(self, f: IO[str]) -> Iterator[None]:
        """An OSError of a write to ``f`` (a full disk) names the file, which the bare error did
        not; the records before it are in the files, whole (each line is flushed as written). Both
        files are closed then, and later writes and the close are nothing: each would fail again,
        and its bare error would replace this one."""
        try:
            yield
        except OSError as exc:
            self._failed = True
            for each in (self._json, self._csv_file):
                if each is not None:
                    with contextlib.suppress(OSError):
                        each.close()
            if exc.filename is not None:
                raise
            raise OSError(
                exc.errno, f"{exc.strerror} (the records written before are kept)", f.name
            ) from None

    def header(self, info: dict[str, Any]) -> None:
        if self._json and not self._failed:
            with self._naming(self._json):
                self._json.write(json.dumps({"type": "header", **info}) + "\n")
                self._json.flush()

    def write(self, record: Any) -> None:
        """A typed record goes to JSON and CSV; a plain dict (the probe timeline) to JSON only. Where
        both are regular files, a stop signal waits for both: between the two, it left a point in
        the JSON file alone."""
        if not self._whole:
            self._write(record)
            return
        with noted(STOPS) as held:
            self._write(record)
        if held:
            signal.raise_signal(held[0])

    def _write(self, record: Any) -> None:
        if self._failed:
            return
        row = record if isinstance(record, dict) else dataclasses.asdict(record)
        if self._json:
            with self._naming(self._json):
                self._json.write(json.dumps(row) + "\n")
                self._json.flush()
        if self._csv_file and not isinstance(record, dict):
            flat = {k: _csv_cell(v) for k, v in row.items()}
            with self._naming(self._csv_file):
                if self._csv is None:
                    self._csv = csv.DictWriter(self._csv_file, fieldnames=list(flat))
                    self._csv.writeheader()
                self._csv.writerow(flat)
                self._csv_file.flush()

    def close(self) -> None:
        for f in (self._json, self._csv_file):
            if f and not self._failed:
                f.close()


def _csv_cell(value: Any) -> Any:
    """A CSV cell: a list of numbers space-separated; what nests (a list of the hosts' dicts) as
    JSON, which a reader can parse (Python's repr, with its quotes and True, it could not)."""
    if isinstance(value, list) and not any(isinstance(v, list | dict) for v in value):
        return " ".join(map(str, value))
    if isinstance(value, list | dict):
        return json.dumps(value)
    return value


def file_stamp(path: str | Path | None) -> tuple[int, int, int] | None:
    """(inode, size, modification time) of ``path``, None where it cannot be read: a run's records
    file stamped when the run begins tells whether the run wrote it at all."""
    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns) if st else None


def exposed_comm_ms(summary: dict[str, Any]) -> float | None:
    """A training record's exposed communication, where its communication is measured: a strategy
    whose comm is not (dp, comm_ms null) has a 0 there that would read as a measurement."""
    return None if summary.get("comm_ms") is None else summary.get("exposed_comm_ms")


def append_record(path: str | Path, row: dict[str, Any]) -> None:
    """Append one record to the JSON Lines file ``path`` (made if missing). A last line that a
    stopped write cut short (no newline after it, not JSON) is dropped first, as readers leave it
    out (:func:`complete_lines`): appended to it, the record made the line, and so the file,
    unreadable."""
    with open(path, "a+b") as f:
        f.seek(0)
        text = f.read()
        if text and not text.endswith(b"\n"):
            start = text.rfind(b"\n") + 1
            try:
                loads(text[start:])
            except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
                f.truncate(start)
            else:
                f.write(b"\n")  # a whole record without its newline: kept
        f.write((json.dumps(row) + "\n").encode())


def loads(text: str | bytes) -> Any:
    """``json.loads``, where a value nested too deeply for Python's parser is a JSONDecodeError
    like any other damage (it raised RecursionError: a traceback)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply to read", str(text[:0]), 0) from None
    except json.JSONDecodeError:
        raise
    except ValueError:  # an integer past Python's digit limit: its message named no file or line
        raise json.JSONDecodeError("a number with too many digits to read", str(text[:0]), 0) from None


def first_line(exc: BaseException) -> str:
    """An error's first non-blank line, or its type's name where it says nothing."""
    return next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def plot_or_note(draw: Callable[[], None], path: str | Path) -> bool:
    """Call ``draw`` (which writes the plot ``path``); a failure becomes one line on stderr rather
    than a failed run, since the plot comes after the measurements, which are written by then.
    Returns whether the plot was drawn."""
    try:
        draw()
    except Interrupted:  # a signal, not a failed plot
        raise
    except Exception as exc:  # whatever the plotting library raises, the run's records stand
        print(f"commbench: plot {shown(path)} not written: {first_line(exc)}", file=sys.stderr, flush=True)
        return False
    return True


# What str.splitlines breaks a line at: a name given with one split a message in two.
_LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"


def escape_breaks(message: object) -> str:
    """``message`` on one line, each line break in it written as its escape (``\\n``); where a
    break may simply go, :func:`commbench.bench.report.one_line` makes it a space."""
    return "".join(c.encode("unicode_escape").decode() if c in _LINE_BREAKS else c for c in str(message))


def complete_lines(text: str, path: str | Path) -> tuple[list[str], str | None]:
    """(the lines of a JSON Lines file's ``text``, a note or None).

    A last line that a write did not finish (no newline after it, and not JSON: the run was
    killed, or the disk filled, mid-record) is left out, so that the records before it are read;
    the note says so, for the caller to print once the file has passed its checks."""
    lines = text.splitlines()
    if lines and lines[-1].strip() and not text.endswith("\n"):
        try:
            loads(lines[-1])
        except json.JSONDecodeError:
            lines.pop()
            kept = sum(1 for line in lines if line.strip())
            return lines, (
                f"commbench: {escape_breaks(path)}: the last line is cut short (a write that did not "
                f"finish); the {kept} lines before it are read"
            )
    return lines, None


def numbered_records(path: str | Path) -> tuple[list[tuple[int, Any]], str | None]:
    """([(its line in the file, value)] for every value of a JSON Lines file, in order; the note of
    :func:`complete_lines`). Blank lines count, so a message can name the line an editor shows. A
    JSONDecodeError gives the file's line."""
    records = []
    lines, note = complete_lines(Path(path).read_text(), path)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append((number, loads(line)))
        except json.JSONDecodeError as exc:  # numbered within its line: renumber in the file
            doc = "\n" * (number - 1) + line
            raise json.JSONDecodeError(exc.msg, doc, exc.pos + number - 1) from None
    return records, note


def check_one_run(path: str | Path, numbered: list[tuple[int, Any]]) -> None:
    """Raise ValueError where a records file (its ``(line, value)`` pairs) holds several runs, a
    header record each: files joined with ``cat``. Read as one run, the first header named them
    all, and a point several runs hold was taken from the last (commbench writes a file per run)."""
    lines = [n for n, r in numbered if isinstance(r, dict) and r.get("type") == "header"]
    if len(lines) > 1:
        raise ValueError(
            f"{path} holds {len(lines)} runs (header records at lines {', '.join(map(str, lines))}); "
            "commbench writes one run a file: give each run a file of its own"
        )


def read_records(path: str | Path) -> tuple[list[Any], str | None]:
    """(every value of a JSON Lines file, in order; the note of :func:`complete_lines`)."""
    numbered, note = numbered_records(path)
    return [value for _, value in numbered], note


def read_jsonl(path: str | Path) -> list[Any]:
    """:func:`read_records`, its note (if any) printed on stderr."""
    records, note = read_records(path)
    if note:
        print(note, file=sys.stderr)
    return records
