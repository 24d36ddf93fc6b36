"""``commbench profile`` on a 2-rank run: one profile per rank, shares that add up; stopped by a
signal it stops every child and keeps the profiles; an output it cannot write is bad input."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commbench.bench import profile
from commbench.bench.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def py_spy() -> str:
    tool = profile.find_py_spy()
    try:
        profile.check_py_spy(tool)
    except ValueError as exc:
        pytest.skip(f"cannot profile here: {exc}")
    assert tool is not None
    return tool


def test_classify_frames():
    assert (
        profile.classify(["step (loop.py:1)", "ring_all_reduce (commbench/comm/ring.py:40)"])
        == "communication"
    )
    assert (
        profile.classify(["step (loop.py:1)", "wait (torch/distributed/distributed_c10d.py:9)"])
        == "communication"
    )
    assert profile.classify(["step (loop.py:1)", "_call_impl (torch/nn/modules/module.py:1)"]) == "compute"
    assert profile.classify(["run (x.py:1)", "init_process_group (distributed_c10d.py:2)"]) == "elsewhere"
    assert profile.classify(["<module> (x.py:1)", "read (json.py:3)"]) == "elsewhere"
    assert profile.classify(
        ["_find_and_load (<frozen importlib._bootstrap>:1)", "<module> (torch/nn/a.py:1)"]
    ) == ("elsewhere")
    done = [  # a rank that finished first, waiting for the others in the launcher's code
        "_wrap (torch/distributed/elastic/multiprocessing/api.py:706)",
        "Event.wait (multiprocessing/synchronize.py:349)",
        "Condition.wait (multiprocessing/synchronize.py:268)",
    ]
    assert profile.classify(done) == "elsewhere"
    stacks = profile.parse_collapsed(["a (x.py:1);b (y.py:2) 7\n", "garbage\n", "c (z.py:3) 2\n"])
    assert stacks == [(["a (x.py:1)", "b (y.py:2)"], 7), (["c (z.py:3)"], 2)]


def test_classify_does_not_take_names_alike_for_communication():
    """Bare "broadcast" and "wait (" took mse_loss's broadcast_tensors and any threading wait for
    communication; a gradient sync waiting for its transport thread's allreduce is communication."""
    loss = [
        "step (loop.py:1)",
        "mse_loss (torch/nn/functional.py:4320)",
        "broadcast_tensors (torch/functional.py:76)",
    ]
    assert profile.classify(loss) == "compute"
    for wait in ("Event.wait (threading.py:629)", "Barrier.wait (threading.py:700)"):
        stack = ["<module> (x.py:1)", "run (y.py:2)", wait, "Condition.wait (threading.py:331)"]
        assert profile.classify(stack) == "elsewhere", wait
    sync = ["step (commbench/trainers/loop.py:1)", "after_backward (commbench/trainers/sync.py:230)"]
    stack = [*sync, "Event.wait (threading.py:629)", "Condition.wait (threading.py:331)"]
    assert profile.classify(stack) == "communication"
    c10d = ["step (loop.py:1)", "broadcast (torch/distributed/distributed_c10d.py:2700)"]
    assert profile.classify(c10d) == "communication"


def test_only_a_threading_wait_under_a_gradient_sync_is_communication():
    """A sync strategy starting its transport thread waits in Thread.start for the thread to run:
    a threading call under the strategy's frame, but no allreduce."""
    start = [
        "step (commbench/trainers/loop.py:1)",
        "_RingThread.__init__ (commbench/trainers/sync.py:250)",
        "Thread.start (threading.py:999)",
        "Event.wait (threading.py:629)",
    ]
    assert profile.classify(start) == "elsewhere"


def test_classify_takes_forward_and_backward_by_the_frames_own_name():
    """A bare "backward (" took the sync strategies' after_backward for compute: the main thread
    blocked there in a Work's wait (a native call, seen without --native as that frame alone)."""
    sync = ["step (commbench/trainers/loop.py:1)", "Bucketed.after_backward (commbench/trainers/sync.py:315)"]
    assert profile.classify(sync) == "communication"
    assert profile.classify([*sync, "c10d::ProcessGroupGloo::AsyncWork::wait"]) == "communication"
    unpack = [*sync, "unpack (commbench/kernels/bucket.py:40)"]
    assert profile.classify(unpack) == "compute"
    assert profile.classify(["step (loop.py:1)", "after_backward (mine/sync.py:3)"]) == "elsewhere"
    for frame in ("forward (model.py:3)", "Net.forward (model.py:3)", "Scale.backward (fn.py:9)"):
        assert profile.classify(["step (loop.py:1)", frame]) == "compute", frame
    assert profile.classify(["backward (torch/_tensor.py:521)"]) == "compute"
    assert profile.classify(["step (loop.py:1)", "before_forward (sync.py:80)"]) == "elsewhere"


def test_ddps_buffer_broadcast_is_communication_as_the_hand_written_strategies_is():
    """Without the bare "broadcast", DDP's broadcast of its buffers (in torch/nn/parallel) was taken
    for compute by torch/nn/, while the same broadcast by naive or ring was communication."""
    ddp = [
        "step (commbench/trainers/loop.py:356)",
        "_call_impl (torch/nn/modules/module.py:1787)",
        "forward (torch/nn/parallel/distributed.py:1860)",
        "_pre_forward (torch/nn/parallel/distributed.py:1783)",
        "timed (commbench/trainers/sync.py:380)",
        "_sync_buffers (torch/nn/parallel/distributed.py:2426)",
        "_sync_module_buffers (torch/nn/parallel/distributed.py:2430)",
        "_default_broadcast_coalesced (torch/nn/parallel/distributed.py:2452)",
        "_distributed_broadcast_coalesced (torch/nn/parallel/distributed.py:2364)",
    ]
    assert profile.classify(ddp) == "communication"
    hand = [
        "step (commbench/trainers/loop.py:356)",
        "before_forward (commbench/trainers/sync.py:135)",
        "broadcast_buffers (commbench/trainers/sync.py:110)",
        "broadcast (torch/distributed/distributed_c10d.py:2800)",
    ]
    assert profile.classify(hand) == "communication"


FORK_SERVER = ["python", "-c", "from multiprocessing.forkserver import main; main(3, 5, ['torch'])"]


class _Proc:
    """Enough of psutil.Process for rank discovery: by default, a child of the fork server."""

    def __init__(self, pid: int, ppid: int, env: dict[str, str] | None = None, name: str = "python") -> None:
        self.pid, self._ppid, self._env, self._name = pid, ppid, env or {}, name

    def name(self) -> str:
        return self._name

    def environ(self) -> dict[str, str]:
        return self._env

    def cmdline(self) -> list[str]:
        return ["lscpu"] if self._env else FORK_SERVER

    def ppid(self) -> int:
        return self._ppid


class _Top:
    def __init__(self) -> None:
        self.kids: list[_Proc] = []

    def children(self, recursive: bool) -> list[_Proc]:
        return self.kids


def test_ranks_are_found_by_the_name_the_launcher_gives_them():
    """The fork server's children are ranks once they carry their rank's name: not the server,
    its readiness probe, a rank not yet named, the resource tracker or what a rank runs."""
    top = _Top()
    tracker = _Proc(99, 7)
    server, probe = _Proc(100, 7), _Proc(101, 100)
    tool = _Proc(301, 102, {"RANK": "0", "LOCAL_RANK": "0"})  # inherits the rank's environment
    worker = _Proc(302, 102, name="commbench-r0")  # forked by rank 0: inherits its name
    top.kids = [tracker, server, probe, _Proc(102, 100, name="commbench-r0"), _Proc(103, 100), tool, worker]
    assert profile._discover(top, 7) == {102: 0}  # rank 1 not yet named
    top.kids[4] = _Proc(103, 100, name="commbench-r1")
    assert profile._discover(top, 7) == {102: 0, 103: 1}
    # under torchrun (the emulated cluster's hosts) a rank has RANK and LOCAL_RANK, its agent too
    agent = _Proc(500, 7, {"RANK": "0", "LOCAL_RANK": "0"})
    agent.cmdline = lambda: ["python", "-m", "torch.distributed.run", "-m", "commbench"]
    top.kids = [agent, _Proc(501, 500, {"RANK": "2", "LOCAL_RANK": "0"})]
    assert profile._discover(top, 7) == {501: 2}


def test_a_process_with_rank_but_no_local_rank_is_not_taken_for_a_rank():
    """RANK alone is any program's variable (a job script's, another launcher's); torchrun gives
    its ranks LOCAL_RANK too."""
    top = _Top()
    top.kids = [_Proc(600, 7, {"RANK": "1"}), _Proc(601, 7, {"RANK": "2", "LOCAL_RANK": "0"})]
    assert profile._discover(top, 7) == {601: 2}


def test_a_rank_names_itself_as_profile_reads_it():
    from commbench.bench import starter

    code = "from commbench.bench import starter\nimport psutil\n"
    code += "starter.name_rank('12')\nprint(psutil.Process().name())"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    name = done.stdout.strip()
    assert name == "commbench-r12" and starter.RANK_NAME.fullmatch(name).group(1) == "12"


def test_two_rank_profile(py_spy, tmp_path):
    # Start-up (imports) takes most of a rank's samples; 100 small steps per strategy give each rank
    # some 10-40 samples in communication and 30 or more in compute at 50 Hz. With 15 steps of the
    # default batch, one rank once had none in one of them.
    out = tmp_path / "prof"
    done = subprocess.run(
        [sys.executable, "-m", "commbench", "profile", "-o", str(out), "--rate", "50", "--no-native", "--",
         "compare", "--world-size", "2", "--strategies", "ring,ddp", "--model", "mlp", "--model-opt",
         "widths=256,256", "--samples", "4096", "--batch-size", "16", "--steps-per-epoch", "100", "--no-eval",
         "--no-probe", "-q"],
        capture_output=True, text=True, cwd=ROOT, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    ranks = summary["ranks"]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        raw = Path(r["raw_path"])
        assert raw.exists() and raw.name.startswith(f"rank{r['rank']}-pid{r['pid']}")
        speedscope = json.loads(Path(r["profile_path"]).read_text())
        assert speedscope["profiles"][0]["type"] == "sampled"
        assert r["samples"] > 0
        assert r["communication"] + r["compute"] + r["elsewhere"] == r["samples"]
        assert r["communication"] > 0 and r["compute"] > 0
    rows = [line.split() for line in done.stdout.splitlines() if line[:4].strip() in ("0", "1")]
    assert len(rows) == 2
    for row in rows:
        shares = [float(x.rstrip("%")) for x in row[3:6]]
        assert abs(sum(shares) - 100) < 0.5


def test_flamegraph_writer(tmp_path):
    stacks = [(["main (a.py:1)", "ring_all_reduce (commbench/comm/ring.py:2)"], 5), (["main (a.py:1)"], 3)]
    path = tmp_path / "f.svg"
    profile.write_flamegraph(stacks, path, "t")
    text = path.read_text()
    assert text.startswith("<svg") and "ring_all_reduce" in text and "#e4572e" in text and "{y" not in text


def test_flamegraph_siblings_sit_side_by_side(tmp_path):
    """Each frame's children share its width in turn, the second starting where the first ends."""
    stacks = [(["main (m.py:1)", "a (a.py:1)"], 5), (["main (m.py:1)", "b (b.py:1)"], 5)]
    path = tmp_path / "f.svg"
    profile.write_flamegraph(stacks, path, "t")
    xs = dict(re.findall(r"<title>(\w+) \(.*?</title><rect x=\"([\d.]+)\"", path.read_text()))
    assert xs == {"main": "0.00", "a": "0.00", "b": "600.00"}  # the graph is 1200 wide


def test_speedscope_weights_are_seconds_at_the_sampling_rate(tmp_path):
    path = tmp_path / "p.speedscope.json"
    profile.write_speedscope([(["a (x.py:1)"], 5), (["a (x.py:1)", "b (y.py:2)"], 10)], path, "r0", 50)
    (doc,) = json.loads(path.read_text())["profiles"]
    assert doc["unit"] == "seconds" and doc["samples"] == [[0], [0, 1]]
    assert doc["weights"] == pytest.approx([0.1, 0.2]) and doc["endValue"] == pytest.approx(0.3)


def test_a_ranks_hottest_frames_are_its_innermost_python_frames_heaviest_first(tmp_path):
    raw = tmp_path / "rank0-pid1.txt"
    raw.write_text(
        "<module> (x.py:1);step (loop.py:2);ring_all_reduce (commbench/comm/ring.py:40) 5\n"
        "<module> (x.py:1);step (loop.py:2);broadcast (torch/distributed/distributed_c10d.py:2700);"
        "c10d::ProcessGroupGloo::AsyncWork::wait 9\n"
    )
    p = profile.summarise(0, 1, raw, native=True, profile_path=None)
    assert (p.samples, p.communication, p.compute, p.elsewhere) == (14, 14, 0, 0)
    assert p.top["communication"] == [
        ("broadcast (torch/distributed/distributed_c10d.py:2700)", 9),
        ("ring_all_reduce (commbench/comm/ring.py:40)", 5),
    ]


def test_a_rank_without_samples_names_py_spys_last_line(tmp_path):
    """py-spy warns before it fails: its last line says why."""
    log = tmp_path / "rank0-pid1.log"
    log.write_text("warning: x\nError: Failed to attach\n\n")
    p = profile.summarise(0, 1, tmp_path / "rank0-pid1.txt", native=False, profile_path=None, log=log)
    assert p.samples == 0 and p.failure() == "py-spy: Error: Failed to attach"


def test_missing_py_spy_is_one_line():
    with pytest.raises(ValueError, match="py-spy not found"):
        profile.check_py_spy(None)


@pytest.mark.parametrize("native", [True, False])
def test_each_rank_is_recorded_raw_with_idle_waits_and_threads_and_native_frames_as_asked(native, tmp_path):
    """Idle samples are what a rank waiting on the network shows; raw is what summarise reads."""
    out = tmp_path / "rank0-pid42.txt"
    cmd = profile._record_cmd("/bin/py-spy", 42, 250, native, out)
    assert cmd[:4] == ["/bin/py-spy", "record", "--pid", "42"]
    assert cmd[cmd.index("--rate") + 1] == "250" and cmd[cmd.index("--format") + 1] == "raw"
    assert cmd[cmd.index("--output") + 1] == str(out)
    assert "--idle" in cmd and "--threads" in cmd
    assert ("--native" in cmd) is native


def test_a_py_spy_that_may_not_ptrace_is_told_how_to_allow_it(tmp_path):
    fake = tmp_path / "py-spy"
    fake.write_text('#!/bin/sh\necho "Error: Permission denied (os error 1)" >&2; exit 1\n')
    fake.chmod(0o755)
    with pytest.raises(
        ValueError, match=r"Permission denied \(os error 1\) \(ptrace not permitted: run as root"
    ):
        profile.check_py_spy(str(fake))


@pytest.mark.parametrize("out", ["profiles", "a/b/profiles"])
def test_a_run_that_cannot_profile_leaves_no_directory(tmp_path, monkeypatch, capsys, out):
    """Nor the parents it made for it (a/b was left behind)."""
    monkeypatch.setattr(profile, "find_py_spy", lambda: None)
    assert main(["profile", "-o", str(tmp_path / out), "--", "sweep", "--world-size", "2"]) == 2
    assert "py-spy not found" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_py_spy_that_cannot_run_is_one_line_and_leaves_no_directory(tmp_path, monkeypatch, capsys):
    """An executable py-spy the kernel refuses (an empty file: "Exec format error") was an OSError:
    exit 1, and the directories made for the profiles left behind."""
    broken = tmp_path / "bin" / "py-spy"
    broken.parent.mkdir()
    broken.write_bytes(b"")
    broken.chmod(0o755)
    monkeypatch.setattr(profile, "find_py_spy", lambda: str(broken))
    assert main(["profile", "-o", str(tmp_path / "a" / "prof"), "--", "sweep", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert f"py-spy at {broken} cannot run: Exec format error" in err and err.count("\n") == 1
    assert [p.name for p in tmp_path.iterdir()] == ["bin"]


def _fake_py_spy(where: Path, *, records_without_native: bool = False) -> str:
    """A py-spy that attaches for the check (dump) but whose recorders fail, as py-spy's would; with
    ``records_without_native`` only a recorder given --native fails, and one without it writes one
    stack to its --output and exits 0, as py-spy does where it cannot unwind native frames."""
    where.mkdir(exist_ok=True)
    fake = where / "py-spy"
    records = ""
    if records_without_native:
        records = (
            'case " $* " in *" --native "*) ;; *)\n'
            '  while [ "$#" -gt 0 ]; do\n'
            '    [ "$1" = --output ] && echo "<module> (x.py:1) 3" > "$2"; shift\n'
            "  done\n"
            "  exit 0;;\nesac\n"
        )
    fake.write_text(
        '#!/bin/sh\nif [ "$1" = dump ]; then exit 0; fi\n'
        + records
        + 'echo "Error: Failed to attach" >&2; exit 1\n'
    )
    fake.chmod(0o755)
    return str(fake)


@pytest.mark.slow
def test_bad_input_to_the_profiled_command_leaves_no_parents_either(tmp_path, monkeypatch):
    fake = _fake_py_spy(tmp_path / "bin")
    monkeypatch.setattr(profile, "find_py_spy", lambda: fake)
    assert main(["profile", "-o", str(tmp_path / "a" / "b" / "prof"), "--", "sweep", "-b", "0"]) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["bin"]


@pytest.mark.parametrize(
    ("inner", "said"),
    [
        (["sweep", "--help"], "usage: commbench sweep"),
        (["train", "-b", "1", "-h"], "usage: commbench train"),
        (["--help"], "usage: commbench [-h]"),
        (["sweep", "-qh"], "usage: commbench sweep"),  # as the command reads them: -h among short flags,
        (["sweep", "--hel"], "usage: commbench sweep"),  # --help abbreviated
    ],
)
def test_help_for_the_profiled_command_is_its_help_and_exit_0(tmp_path, monkeypatch, capsys, inner, said):
    """The help printed, then 'no rank process was seen' and exit 1; it starts nothing now, so it
    needs no py-spy either."""
    monkeypatch.setattr(profile, "run_profile", lambda config: pytest.fail(f"sampled {config.inner}"))
    out = tmp_path / "prof"
    with pytest.raises(SystemExit) as ended:
        main(["profile", "-o", str(out), "--", *inner])
    printed = capsys.readouterr()
    assert ended.value.code == 0 and printed.out.startswith(said) and printed.err == "", printed
    assert not out.exists()


def test_words_the_profiled_command_cannot_take_are_refused_before_sampling(monkeypatch, capsys):
    monkeypatch.setattr(profile, "run_profile", lambda config: pytest.fail(f"sampled {config.inner}"))
    assert main(["profile", "--", "sweep", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --bogus" in err


@pytest.mark.parametrize("command", ["bandwidth", "summary", "study"])
def test_a_command_without_ranks_is_refused_in_one_line(command, capsys):
    """bandwidth ran, then profile said no rank process was seen and exited 1."""
    from commbench.bench.cli import main

    assert main(["profile", "--", command]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"not {command!r}" in err


def test_the_rate_is_1_to_10000_samples_per_second():
    for rate in (1, 10000):
        assert profile.ProfileConfig(inner=("sweep",), rate_hz=rate).rate_hz == rate
    for rate in (0, 10001):
        with pytest.raises(ValueError, match=f"--rate must be in 1..10000 samples per second, got {rate}"):
            profile.ProfileConfig(inner=("sweep",), rate_hz=rate)


@pytest.mark.slow  # two imports of torch (9 s); make test keeps profile's own refusals (CI's ten minutes)
def test_bad_input_to_the_profiled_command_is_its_one_line_and_exit_2(py_spy, tmp_path):
    out = tmp_path / "prof"
    done = subprocess.run(
        [sys.executable, "-m", "commbench", "profile", "-o", str(out), "--", "sweep", "-b", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert done.stderr.count("\n") == 1 and "sizes must be > 0" in done.stderr, done.stderr
    assert not out.exists()


@pytest.mark.slow  # all three: make test keeps test_two_rank_profile (CI's ten minutes)
@pytest.mark.parametrize(
    "sig, group",
    [(signal.SIGTERM, False), (signal.SIGINT, True), (signal.SIGHUP, True)],
    ids=["sigterm", "sigint-to-group", "sighup-to-group"],  # SIGHUP: the terminal closed
)
def test_a_stopped_profile_stops_every_child_and_keeps_the_profiles(py_spy, tmp_path, sig, group):
    """SIGTERM to profile, or Ctrl-C or a closed terminal to its process group, while py-spy
    records a 2-rank sweep."""
    import psutil

    out, log = tmp_path / "prof", tmp_path / "stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "commbench", "profile", "-o", str(out), "--no-native", "--",
             "sweep", "--world-size", "2", "-b", "4K", "-e", "4K", "-n", "1000000", "-w", "1", "-q"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
        )  # fmt: skip
    top = psutil.Process(proc.pid)
    family: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            family = top.children(recursive=True)
            if sum("py-spy" in " ".join(_cmdline(p)) for p in family) == 2:
                break
            time.sleep(0.1)
        assert proc.poll() is None and len(family) >= 5, "the 2 ranks and their recorders never started"
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        assert proc.wait(timeout=60) == 128 + sig
    finally:
        _, alive = psutil.wait_procs(family, timeout=1)
        for p in [*alive, top]:
            with contextlib.suppress(psutil.Error):
                p.kill()
    assert [p.pid for p in alive] == []
    lines = log.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("commbench: interrupted"), lines
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == sig.name and sorted(r["rank"] for r in summary["ranks"]) == [0, 1]


def _cmdline(proc) -> list[str]:
    import psutil

    try:
        return proc.cmdline()
    except psutil.Error:
        return []


@pytest.mark.parametrize("out", ["/proc/commbench-x", "/etc/passwd"])
def test_unwritable_output_is_one_line_before_the_run(out, capsys, monkeypatch):
    started, popen = [], subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a) or popen(*a, **k))
    assert main(["profile", "-o", out, "--", "sweep", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot write to {out}" in err
    assert started == []  # neither py-spy's check nor the command ran


@pytest.mark.slow
def test_a_profile_whose_recorders_all_fail_says_so_and_exits_1(tmp_path, monkeypatch, capsys):
    """py-spy attaches for the check but every recorder fails (its error only in its log): profile
    printed a table of zero samples, named collapsed-stack files that did not exist, and exited 0."""
    fake = _fake_py_spy(tmp_path)
    monkeypatch.setattr(profile, "find_py_spy", lambda: fake)
    out = tmp_path / "prof"
    argv = ["profile", "-o", str(out), "--", "sweep", "--world-size", "2", "-b", "1K", "-e", "1K"]
    assert main([*argv, "-n", "2", "-w", "1", "-q", "--no-probe"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    for rank in (0, 1):
        assert any(
            line.startswith(f"commbench: profile: rank {rank} ")
            and line.endswith("py-spy: Error: Failed to attach")
            for line in lines
        ), lines
    assert lines[-1].startswith("commbench: profile: no rank was sampled") and len(lines) == 3


def _slow_dump(where: Path, ends: str) -> str:
    """A py-spy whose check (dump) takes 1 s and then ``ends``: "exit 0", or "kill -INT $$" (killed,
    as a terminal's Ctrl-C to the whole process group killed the real one)."""
    where.mkdir(exist_ok=True)
    fake = where / "py-spy"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = dump ]; then sleep 1; {ends}; fi\nexit 1\n')
    fake.chmod(0o755)
    return str(fake)


@pytest.mark.parametrize("ends", ["exit 0", "kill -INT $$"])
def test_a_stop_during_the_py_spy_check_is_an_interruption_that_leaves_no_directory(
    tmp_path, monkeypatch, capsys, ends
):
    """A Ctrl-C at the terminal killed the check's py-spy too, and was reported as "py-spy cannot
    attach to processes here: exit code -2", exit 2; a stop that let the check finish left the
    directories the run had made."""
    import threading

    fake = _slow_dump(tmp_path / "bin", ends)
    monkeypatch.setattr(profile, "find_py_spy", lambda: fake)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        code = main(["profile", "-o", str(tmp_path / "a" / "b" / "prof"), "--", "sweep", "-b", "1K"])
    finally:
        timer.cancel()
    assert code == 130, capsys.readouterr().err
    assert "cannot attach" not in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["bin"]


def test_a_command_killed_by_a_signal_is_said_and_exits_as_a_shell_would(tmp_path, monkeypatch, capsys):
    """-9 from the inner command became exit 247, without a word."""
    monkeypatch.setattr(profile, "check_py_spy", lambda py_spy: None)
    monkeypatch.setattr(profile, "profile_command", lambda config, py_spy, stop: (-signal.SIGKILL, []))
    assert main(["profile", "-o", str(tmp_path / "prof"), "--", "sweep", "-b", "1K"]) == 137
    err = capsys.readouterr().err
    assert "commbench: profile: the command was killed by SIGKILL" in err


def test_a_stop_while_the_profiles_are_written_keeps_the_summary(tmp_path, monkeypatch, capsys):
    """The write-up ran after the stop handlers were gone: a stop there, once the run had ended,
    lost summary.json."""
    out = tmp_path / "prof"
    raw = out / "rank0-pid1.txt"

    def ran(config, py_spy, stop):
        raw.write_text("main (x.py:1);f (y.py:2) 3\n")
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()
        return 0, [profile._Recorder(rank=0, pid=1, raw=raw, proc=proc, native=False, log=out / "r.log")]

    write = profile.write_speedscope

    def stopped_while_writing(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return write(*args, **kwargs)

    monkeypatch.setattr(profile, "check_py_spy", lambda py_spy: None)
    monkeypatch.setattr(profile, "profile_command", ran)
    monkeypatch.setattr(profile, "write_speedscope", stopped_while_writing)
    assert main(["profile", "-o", str(out), "--", "sweep", "-b", "1K"]) == 128 + signal.SIGTERM
    summary = json.loads((out / "summary.json").read_text())
    assert summary["returncode"] == 0 and summary["stopped_by"] is None  # the run had ended first
    assert (out / "rank0-pid1.speedscope.json").exists()


def test_an_inner_command_that_refuses_removes_only_an_empty_directory(tmp_path, monkeypatch):
    """Two profiles into one directory that neither found: the one whose command refused its
    input removed the directory whole, with the other's rank logs and profiles in it."""
    monkeypatch.setattr(profile, "check_py_spy", lambda tool: None)
    out = tmp_path / "a" / "prof"
    for other in (False, True):

        def refused(config, py_spy, stop, other=other):
            if other:  # what the profile beside it wrote meanwhile
                (out / "rank0-pid1.txt").write_text("other")
            return profile.BAD_INPUT, {}

        monkeypatch.setattr(profile, "profile_command", refused)
        config = profile.ProfileConfig(inner=("sweep",), out_dir=str(out))
        assert profile.run_profile(config, py_spy="py-spy") == (profile.BAD_INPUT, [], None)
        if other:
            assert (out / "rank0-pid1.txt").read_text() == "other"
        else:
            assert not (tmp_path / "a").exists()  # made by this run, parents too, and empty


def test_a_recorder_that_fails_with_native_frames_is_started_again_without(tmp_path, monkeypatch):
    """Where py-spy cannot unwind native frames (--native unsupported here), the rank is recorded
    without them rather than not at all."""
    fake = _fake_py_spy(tmp_path / "bin", records_without_native=True)
    rank = subprocess.Popen(["sleep", "60"])
    started, stop = [], []
    start = profile._start
    monkeypatch.setattr(profile, "_start", lambda *a: started.append(start(*a)) or started[-1])

    def discover(top, top_pid):
        if len(started) == 1:  # the first recorder's py-spy must have ended before the loop looks again
            started[0].proc.wait(timeout=30)
        elif len(started) == 2:  # started again: the run may stop
            stop.append(signal.SIGTERM)
        return {rank.pid: 0}

    monkeypatch.setattr(profile, "_discover", discover)
    # the inner command: a stand-in that lives until the run stops it (commbench's own imports torch)
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexec sleep 60\n")
    python.chmod(0o755)
    monkeypatch.setattr(profile.sys, "executable", str(python))
    config = profile.ProfileConfig(inner=("sweep",), out_dir=str(tmp_path))
    try:
        _, recorders = profile.profile_command(config, fake, stop)
    finally:
        rank.kill()
        rank.wait()
    assert [(r.native, r.proc.returncode) for r in started] == [(True, 1), (False, 0)]
    (rec,) = recorders
    assert (rec.rank, rec.pid, rec.native) == (0, rank.pid, False)
    assert rec.raw.read_text() == "<module> (x.py:1) 3\n"


def _recorded(out: Path) -> profile._Recorder:
    """A recorder that has finished, with one stack in its raw file."""
    raw = out / "rank0-pid1.txt"
    raw.write_text("<module> (x.py:1);f (y.py:2) 3\n")
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return profile._Recorder(rank=0, pid=1, raw=raw, proc=proc, native=False, log=out / "r.log")


def test_a_command_that_refuses_its_input_after_its_ranks_were_recorded_keeps_the_summary(
    tmp_path, monkeypatch
):
    """Exit 2 with nothing recorded removes the directory; exit 2 from ranks that were recorded
    (a rank refusing what the parser let through) is a run whose profiles are kept."""
    out = tmp_path / "prof"
    monkeypatch.setattr(profile, "check_py_spy", lambda py_spy: None)
    monkeypatch.setattr(profile, "profile_command", lambda config, py_spy, stop: (2, [_recorded(out)]))
    config = profile.ProfileConfig(inner=("sweep",), out_dir=str(out))
    code, profiles, stopped = profile.run_profile(config, py_spy="py-spy")
    assert (code, [p.samples for p in profiles], stopped) == (profile.BAD_INPUT, [3], None)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["returncode"] == 2 and [r["samples"] for r in summary["ranks"]] == [3]


def test_the_summary_names_the_signal_that_stopped_the_run(tmp_path, monkeypatch):
    out = tmp_path / "prof"

    def stopped(config, py_spy, stop):
        os.kill(os.getpid(), signal.SIGINT)  # noted by run_profile's handler, as a Ctrl-C mid-run
        return 130, [_recorded(out)]

    monkeypatch.setattr(profile, "check_py_spy", lambda py_spy: None)
    monkeypatch.setattr(profile, "profile_command", stopped)
    config = profile.ProfileConfig(inner=("sweep",), out_dir=str(out))
    assert profile.run_profile(config, py_spy="py-spy")[2] == signal.SIGINT
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT" and summary["returncode"] == 130


@pytest.mark.parametrize(
    ("code", "stopped", "said"),
    [
        (128 + signal.SIGTERM, signal.SIGTERM, False),  # the command said it was stopped: not again
        (0, signal.SIGINT, True),  # it had ended first: the CLI says the run was interrupted
    ],
    ids=["command-stopped", "command-done"],
)
def test_a_stopped_profile_says_so_once(tmp_path, monkeypatch, capsys, code, stopped, said):
    monkeypatch.setattr(profile, "run_profile", lambda config: (code, [], stopped))
    assert main(["profile", "-o", str(tmp_path / "prof"), "--", "sweep", "-b", "1K"]) == 128 + stopped
    err = capsys.readouterr().err
    assert ("commbench: interrupted" in err) is said, err
