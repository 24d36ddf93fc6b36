"""The emulated cluster: pure parts everywhere; real namespaces where root and iproute2 are here.

The privileged tests build real clusters (namespaces, veths, a bridge, tbf qdiscs) and check the
per-host bytes against the cost model, and that nothing is left behind after a normal run, a
killed rank, or SIGTERM to the cluster command.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from commbench.bench import cli, cluster, netns
from commbench.bench.netns import Shaping, Topology
from tests import stops

ROOT = Path(__file__).resolve().parents[1]


def _privileged() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    reason = netns.missing_privilege(euid=os.geteuid(), cap_eff=netns._cap_eff(), which=shutil.which)
    if reason is None and not Path("/proc/self/ns/net").exists():
        reason = "no network namespaces in this kernel"
    return reason


PRIVILEGED = _privileged()
needs_privileges = pytest.mark.skipif(PRIVILEGED is not None, reason=f"cluster: {PRIVILEGED}")


# ---------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    "text, bits",
    [
        ("1gbit", 10**9),
        ("100mbit", 10**8),
        ("2.5Gbit", 25 * 10**8),
        ("64kbit", 64000),
        ("9000bit", 9000),
        ("1tbit", 10**12),
    ],
)
def test_parse_rate(text, bits):
    assert netns.parse_rate(text) == bits


# "1.1tbit": tc's bucket holds nothing; 1e320 bit: a float's infinity (a traceback, exit 1)
@pytest.mark.parametrize(
    "text", ["1gbps", "fast", "1", "-1gbit", "1 gigabit", "1kbit", "1.1tbit", "1" + "0" * 320 + "bit"]
)
def test_parse_rate_rejects(text):
    with pytest.raises(ValueError):
        netns.parse_rate(text)


def test_parse_time_and_percent():
    assert netns.parse_time_us("100us") == 100.0
    assert netns.parse_time_us("2ms") == 2000.0
    assert netns.parse_time_us("0.5s") == 500000.0
    assert netns.parse_percent("0.1%") == 0.1
    for bad, fn in (("100", netns.parse_time_us), ("1h", netns.parse_time_us), ("101%", netns.parse_percent)):
        with pytest.raises(ValueError):
            fn(bad)


def test_shaping_qdiscs_and_validation():
    plain = Shaping(rate_bit=10**9)
    assert plain.burst == 1_000_000  # 8 ms of 1 Gbit/s
    assert Shaping(rate_bit=10**8).burst == 131072  # two 64 KiB segments; 8 ms of 100 Mbit/s is less
    assert Shaping(rate_bit=10**9, burst_bytes=4096).burst == 4096
    assert plain.qdisc_args() == [
        ["root", "handle", "1:", "tbf", "rate", "1000000000bit", "burst", "1000000", "latency", "10000us"]
    ]
    delayed = Shaping(rate_bit=10**9, delay_us=100, jitter_us=10, loss_percent=0.5)
    assert delayed.needs_netem and not plain.needs_netem
    root, child = delayed.qdisc_args()
    assert root[:4] == ["root", "handle", "1:", "netem"]
    assert root[4:] == ["delay", "100us", "10us", "loss", "0.5%"]
    assert child[:5] == ["parent", "1:1", "handle", "10:", "tbf"]
    with pytest.raises(ValueError, match="jitter needs a delay"):
        Shaping(jitter_us=5)
    with pytest.raises(ValueError, match="burst"):
        Shaping(burst_bytes=100)
    # tbf stalled a link whose bucket could not hold one frame (the kernel said so in its log alone)
    assert Shaping(burst_bytes=9014, mtu=9000).burst == 9014
    with pytest.raises(ValueError, match=r"whole frame of the MTU \(9014 bytes or more\), got 9013"):
        Shaping(burst_bytes=9013, mtu=9000)
    # tc takes 32 bits of bucket, and 2**32 ticks of 64 ns of it at the rate, shrinking a longer one
    # and the queue as 32 bits of bytes (the rate over the queue's time, and the bucket): tc showed
    # 10 Gbit/s with a 10 s queue as 3.13 s
    assert Shaping(rate_bit=10**10, queue_ms=3000).qdisc_args()[0][-2:] == ["latency", "3000000us"]
    for rate, queue in ((10**10, 10_000), (10**17, 0.001)):  # 8 ms of 10**17 bit/s is 10**11 bytes
        with pytest.raises(ValueError, match="more than tc's 4294967295; give a shorter --queue"):
            Shaping(rate_bit=rate, queue_ms=queue)
    with pytest.raises(ValueError, match="at most 4294967295 bytes"):
        Shaping(burst_bytes=1 << 32)
    with pytest.raises(ValueError, match=r"at most 274 s of the rate \(274000 bytes at 8000 bit/s\)"):
        Shaping(rate_bit=8000, burst_bytes=274_001)
    assert Shaping(rate_bit=8000, burst_bytes=274_000).burst == 274_000
    # a queue under a microsecond was given to tc as 1e-07ms, which it refused after the build
    assert Shaping(queue_ms=0.001).qdisc_args()[0][-2:] == ["latency", "1us"]
    with pytest.raises(ValueError, match="queue must be from 1us"):
        Shaping(queue_ms=0.0009)
    with pytest.raises(ValueError, match="loss"):
        Shaping(loss_percent=200)


def test_the_token_bucket_counts_toward_tcs_queue_limit():
    """tc's queue limit is the rate over the queue's time plus the bucket: 3435 ms of 10 Gbit/s is
    4_293_750_000 bytes, under 2**32 alone, over it with the default 10 MB bucket."""
    assert Shaping(rate_bit=10**10, queue_ms=3435, burst_bytes=2048).burst == 2048
    with pytest.raises(ValueError, match="comes to 4303750000 bytes of queue, more than tc's 4294967295"):
        Shaping(rate_bit=10**10, queue_ms=3435)


def test_topology_names_addresses_and_rank_order():
    topo = Topology(hosts=netns.MAX_HOSTS, owner=4242)
    assert topo.namespace(3) == "commbench-4242-h3" and topo.switch == "commbench-4242-sw"
    addresses = [topo.address(i) for i in range(topo.hosts)]
    # The c10d rendezvous gives node ranks in the sorted order of the node address text.
    assert sorted(addresses) == addresses
    assert all(a.startswith("198.18.") for a in addresses)
    with pytest.raises(ValueError, match="hosts"):
        Topology(hosts=0, owner=1)


def test_stale_and_owned_namespaces():
    names = ["commbench-10-h0", "commbench-10-sw", "commbench-20-h0", "other", "commbench-x-h0"]
    assert netns.stale(names, alive=lambda pid: pid == 20) == ["commbench-10-h0", "commbench-10-sw"]
    assert netns.owned(names, 20) == ["commbench-20-h0"]


def test_destroy_kills_a_process_forked_after_the_namespace_was_listed(monkeypatch):
    """The kill came once, from the first listing: a process forked after it lived on, and the
    namespace was deleted under it after 5 s."""
    first = subprocess.Popen(["sleep", "60"])
    late: list[subprocess.Popen] = []

    def pids_in(name: str) -> list[int]:
        if not late:  # the first listing; the process it names forks right after
            late.append(subprocess.Popen(["sleep", "60"]))
            return [first.pid]
        return [p.pid for p in (first, *late) if p.poll() is None]

    monkeypatch.setattr(netns, "pids_in", pids_in)
    monkeypatch.setattr(netns, "_run", lambda cmd, check=True: subprocess.CompletedProcess(cmd, 0, "", ""))
    try:
        assert netns.destroy(["commbench-1-h0"]) == []
        assert late[0].wait(timeout=10) == -signal.SIGKILL
    finally:
        for p in (first, *late):
            p.kill()
            p.wait()


def test_destroy_counts_as_failed_only_a_namespace_still_there(monkeypatch):
    """A delete that fails because the namespace is gone already (removed beside it) is no failure."""
    failed = subprocess.CompletedProcess([], 1, "", "Cannot remove namespace file: No such file")
    monkeypatch.setattr(netns, "_run", lambda cmd, check=True: failed)
    for left, expected in (([], []), (["commbench-1-h0"], ["commbench-1-h0"])):
        monkeypatch.setattr(netns, "namespaces", lambda left=left: left)
        assert netns.destroy(["commbench-1-h0"]) == expected


def test_a_hosts_bytes_sent_are_its_switch_ports_bytes_received(monkeypatch):
    links = [
        {"ifname": "br0", "stats64": {"rx": {"bytes": 1}, "tx": {"bytes": 2}}},
        {"ifname": "h0", "stats64": {"rx": {"bytes": 100}, "tx": {"bytes": 7}}},
    ]
    ran = []

    def run(cmd, check=True):
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, json.dumps(links), "")

    monkeypatch.setattr(netns, "_run", run)
    assert netns.port_counters(Topology(hosts=1, owner=4242)) == {0: (100, 7)}  # (sent, received)
    assert ran == [["ip", "-n", "commbench-4242-sw", "-s", "-j", "link", "show"]]


def test_stale_scratch_directories_are_those_of_dead_owners(tmp_path):
    """A run killed by SIGKILL left its scratch directory; the next run removes it, as it removes
    the namespaces, when the pid in its name is gone."""
    for name in ("commbench-cluster-10-ab", "commbench-cluster-20-cd", "commbench-cluster-ef", "other-10-x"):
        (tmp_path / name).mkdir()
    (tmp_path / "commbench-cluster-11-file").write_text("")
    (tmp_path / "commbench-cluster-12-link").symlink_to(tmp_path / "other-10-x")
    found = cluster.stale_scratch(tmp_path, alive=lambda pid: pid == 20)
    assert found == [tmp_path / "commbench-cluster-10-ab"]
    assert cluster.stale_scratch(tmp_path / "missing", alive=lambda pid: False) == []


def test_missing_privilege_is_reported_in_one_line():
    have = {"ip": "/sbin/ip", "tc": "/sbin/tc"}.get
    assert netns.missing_privilege(euid=0, cap_eff=0, which=have) is None
    caps = (1 << netns.CAP_NET_ADMIN) | (1 << netns.CAP_SYS_ADMIN)
    assert netns.missing_privilege(euid=1000, cap_eff=caps, which=have) is None
    reason = netns.missing_privilege(euid=1000, cap_eff=1 << netns.CAP_NET_ADMIN, which=have)
    assert reason and "root" in reason and "\n" not in reason
    reason = netns.missing_privilege(euid=0, cap_eff=0, which=lambda tool: None)
    assert reason and "iproute2" in reason


def test_privilege_failure_is_exit_2_with_one_line(monkeypatch, capsys):
    def refuse() -> None:
        raise ValueError("the cluster needs root (simulated)")

    args = cli.build_parser().parse_args(["cluster", "--hosts", "2", "--", "sweep", "-b", "1K", "-e", "1K"])
    with pytest.raises(ValueError, match="simulated"):
        cluster.run(args, privileges=refuse)
    monkeypatch.setattr(netns, "check_privileges", refuse)
    assert cli.main(["cluster", "--hosts", "2", "--", "sweep", "-b", "1K", "-e", "1K"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "needs root" in err


def test_a_failed_build_step_is_one_line_and_exit_3(monkeypatch, capsys):
    """What ip or tc says when a step fails (first line only) ends the run, without a traceback,
    with the exit code that tells a study nothing ran (a failed run exits with 1)."""
    said = "RTNETLINK answers: Operation not permitted; second line"
    monkeypatch.setattr(netns, "check_privileges", lambda: None)
    monkeypatch.setattr(netns, "namespaces", lambda: [])
    monkeypatch.setattr(
        netns,
        "create",
        lambda topo, shaping: netns._run(["sh", "-c", f"echo '{said}' | tr ';' '\\n' >&2; exit 2"]),
    )
    assert (
        cli.main(["cluster", "--hosts", "2", "--", "sweep", "-b", "1K", "-e", "1K"]) == cluster.NOT_BUILT == 3
    )
    err = capsys.readouterr().err
    assert err.startswith("commbench: cluster: sh -c") and err.endswith(
        "RTNETLINK answers: Operation not permitted\n"
    ), err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hosts", "0", "--", "sweep"], "--hosts must be in 1.."),
        (["--", "sweep"], "--hosts is required"),
        # argparse checked --hosts, which the unknown option's run of tokens swallowed, first.
        (["--bandwidth", "1gbit", "--hosts", "2", "sweep"], "unrecognized arguments: --bandwidth"),
        (["--hosts", "2", "--rate", "1gbps", "--", "sweep"], "--rate '1gbps': bad rate"),
        (["--hosts", "2", "--rate", "1" + "0" * 320 + "bit", "--", "sweep"], "is above 1tbit"),
        (["--hosts", "2", "--", "sweep", "--world-size", "4"], "--world-size is set by the cluster"),
        (["--hosts", "2", "--", "sweep", "--world-size=4"], "--world-size is set by the cluster"),
        (["--hosts", "2", "--", "sweep", "--world", "3"], "--world-size is set by the cluster"),
        (["--hosts", "2", "--burst", "", "--", "sweep"], "--burst '': not a size: ''"),
        (["--hosts", "2", "--delay", "", "--", "sweep"], "--delay '': bad time ''"),
        (["--hosts", "2", "--loss", "", "--", "sweep"], "--loss '': bad percentage ''"),
        (["--hosts", "2", "--queue", "5", "--", "sweep"], "--queue '5': bad time '5'"),
        (["--hosts", "2", "--delay", "1ms", "--jitter", "x", "--", "sweep"], "--jitter 'x': bad time 'x'"),
        (["--hosts", "2", "--burst", "1MB", "--", "sweep"], "--burst '1MB': not a size: '1MB' is ambiguous"),
        (["--hosts", "2", "--mtu", "9000", "--burst", "4K", "--", "sweep"], "whole frame of the MTU"),
        (["--hosts", "2", "--burst", "8G", "--", "sweep"], "at most 4294967295 bytes"),
        (["--hosts", "2", "--queue", "0.0001us", "--", "sweep"], "queue must be from 1us"),
        # each host's rank refused these (exit 1), after the cluster was built
        (
            ["--hosts", "2", "--", "sweep", "--collective", "reduce_scatter", "-b", "4", "-e", "4"],
            "hold no whole",
        ),
        (["--hosts", "2", "--", "sweep", "--collective", "broadcast", "--root", "2"], "root 2 is not a rank"),
        (["--hosts", "2", "--", "sweep", "--backend", "nccl"], "nccl"),
        (["--hosts", "2"], "no command after '--'"),
        (["--hosts", "2", "--", "summary", "x"], "not 'summary'"),
        (["--hosts", "2", "--jitter", "5us", "--", "sweep"], "jitter needs a delay"),
        # each host's rank refused these, after the cluster was built
        (["--hosts", "3", "--", "compare", "--global-batch", "2"], "gives no sample to each of 3 ranks"),
        (["--hosts", "3", "--", "compare", "--strategies", "dp"], "runs in one process"),
        (["--hosts", "2", "--", "sweep", "-b", "nope"], "not a size"),
        (["--hosts", "2", "--", "sweep", "--json", "/nonexistent-dir/x.jsonl"], "cannot write"),
        (["--hosts", "2", "--", "train", "--plot", "steps.txt"], "must end in one of"),
        (
            ["--hosts", "2", "--", "sweep", "--csv", "r.png", "--plot", "r.png"],
            "--csv and --plot name the same",
        ),
    ],
)
def test_bad_input_is_exit_2_with_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(netns, "check_privileges", lambda: pytest.fail("built a cluster from bad input"))
    assert cli.main(["cluster", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.strip().count("\n") == 0


def test_records_to_a_pipe_are_refused_before_the_build(tmp_path, monkeypatch, capsys):
    """The cluster reads its records back for the hosts' byte counts: from a pipe where this
    process holds the writer, the read would never end; a named pipe with no reader waited in the
    check itself. A descriptor of the command (a shell's >(jq .), /dev/fd/N) is no name the hosts
    can open. /dev/null stays allowed: nothing to read back."""

    def refused(path: str) -> str:
        monkeypatch.setattr(netns, "check_privileges", lambda: pytest.fail("built a cluster from bad input"))
        assert cli.main(["cluster", "--hosts", "2", "--", "sweep", "--json", path]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        return err

    r, w = os.pipe()
    try:
        err = refused(f"/dev/fd/{w}")
        assert "--json names a descriptor of this command, which the hosts do not hold" in err
    finally:
        os.close(r)
        os.close(w)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert f"--json {fifo} is not a file: the cluster reads its records back" in refused(str(fifo))

    def no_privileges() -> None:
        raise ValueError("no privileges here")

    monkeypatch.setattr(netns, "check_privileges", no_privileges)
    assert cli.main(["cluster", "--hosts", "2", "--", "sweep", "--json", os.devnull]) == 2
    assert capsys.readouterr().err == "commbench: error: no privileges here\n"


def test_cuda_without_cuda_is_refused_before_the_build(monkeypatch, capsys):
    """Each host's rank refused it, after the cluster was built (exit 1)."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr(netns, "check_privileges", lambda: pytest.fail("built a cluster from bad input"))
    assert cli.main(["cluster", "--hosts", "2", "--", "sweep", "--device", "cuda"]) == 2
    assert (
        capsys.readouterr().err
        == "commbench: error: --device cuda asked for, but CUDA is not available here\n"
    )


@pytest.mark.parametrize("backend", [[], ["--backend", "nccl"]], ids=["default", "named"])
def test_nccl_is_refused_before_the_build(monkeypatch, capsys, backend):
    """Each host's torchrun starts one rank, local rank 0: every host's rank took GPU 0, which NCCL
    refuses inside the ranks, after the build; gloo (which may share a GPU) is let through."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(netns, "check_privileges", lambda: pytest.fail("built a cluster from bad input"))
    argv = ["cluster", "--hosts", "2", "--", "compare", "--device", "cuda"]
    assert cli.main([*argv, *backend]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "commbench: error: every host's rank takes GPU 0 of this machine, which NCCL "
    ) and (err.endswith("give --backend gloo, whose ranks share it\n")), err

    def built() -> None:
        raise ValueError("past the checks")

    monkeypatch.setattr(netns, "check_privileges", built)
    assert cli.main([*argv, "--backend", "gloo"]) == 2
    assert capsys.readouterr().err == "commbench: error: past the checks\n"


def test_a_training_set_the_hosts_cannot_index_together_is_refused_before_the_build(monkeypatch, capsys):
    """Every host's rank lives in this machine's memory; each host, one rank under its torchrun,
    checked for itself alone, after the build."""
    import psutil

    from commbench.trainers.loop import INDEX_BYTES

    memory = psutil.virtual_memory().total
    samples = memory // INDEX_BYTES // 2  # one rank could index them; four cannot
    monkeypatch.setattr(netns, "check_privileges", lambda: pytest.fail("built a cluster from bad input"))
    argv = ["cluster", "--hosts", "4", "--", "train", "--strategy", "ring", "--samples", str(samples)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"commbench: error: {samples} training samples are more than this host can index")
    assert "for 4 ranks here" in err and err.count("\n") == 1


@pytest.mark.parametrize("when", ["before the hosts run", "as the record is written"])
def test_a_stop_signal_outside_the_hosts_run_unwinds_and_keeps_the_record(
    tmp_path, monkeypatch, capsys, when
):
    """Outside run_hosts' own handlers a SIGTERM ended the process where it stood: the scratch
    directory stayed, and the run's cluster record could be lost after the run had finished."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    monkeypatch.setattr(netns, "check_privileges", lambda: None)
    out = tmp_path / "r.jsonl"

    def run_hosts(config, argv, work):
        assert work.parent == scratch
        if when == "before the hosts run":  # as in the removal of an earlier run's namespaces
            os.kill(os.getpid(), signal.SIGTERM)
        out.write_text(json.dumps({"type": "header"}) + "\n")
        return {0: (1000, 2000), 1: (2000, 1000)}

    read = cluster._read_records

    def read_records(path):
        os.kill(os.getpid(), signal.SIGTERM)
        return read(path)

    monkeypatch.setattr(cluster, "run_hosts", run_hosts)
    monkeypatch.setattr(cluster, "_read_records", read_records)
    argv = ["cluster", "--hosts", "2", "--", "sweep", "-b", "1K", "-e", "1K", "--json", str(out)]
    assert cli.main(argv) == 128 + signal.SIGTERM
    assert list(scratch.iterdir()) == []
    # the line names the records file, which the inner command names
    said = {"before the hosts run": "nothing had finished, {} was not written"}
    said = said.get(when, "finished points are in {}").format(out)  # the cluster's record is written
    assert capsys.readouterr().err == f"commbench: interrupted; {said}\n"
    if when == "as the record is written":
        (record,) = [r for r in map(json.loads, out.read_text().splitlines()) if r["type"] == "cluster"]
        assert [h["tx_bytes"] for h in record["hosts"]] == [1000, 2000]
    else:
        assert not out.exists()


def test_a_training_run_without_json_is_given_the_clusters_own(monkeypatch, capsys):
    """Only a sweep got one, so train and compare without --json printed '-' for every computed
    column: the cluster had no records to read them from."""
    monkeypatch.setattr(netns, "check_privileges", lambda: None)

    def run_hosts(config, argv, work):
        assert argv[-2:] == ["--json", str(work / "train.jsonl")]
        summary = {"type": "train_summary", "strategy": "ring", "wire_bytes_per_rank_per_epoch": [500, 500],
                   "wire_recv_bytes_per_rank_per_epoch": [500, 500]}  # fmt: skip
        lines = [{"type": "epoch", "strategy": "ring", "epoch": 1}, summary]
        Path(argv[-1]).write_text("".join(json.dumps(r) + "\n" for r in lines))
        return {0: (510, 505), 1: (505, 510)}

    monkeypatch.setattr(cluster, "run_hosts", run_hosts)
    assert cli.main(["cluster", "--hosts", "2", "--", "train", "--strategy", "ring"]) == 0
    out = capsys.readouterr().out
    assert "    0  198.18.0.100      0.001      0.001  1.020      0.001      0.001  1.010" in out


def test_a_stop_after_a_csv_only_sweep_names_its_rows(tmp_path, monkeypatch, capsys):
    """The cluster named only the inner command's --json, so a sweep with --csv alone stopped at
    the end said 'interrupted' and nothing of the rows its hosts had written."""
    monkeypatch.setattr(netns, "check_privileges", lambda: None)
    rows = tmp_path / "c.csv"

    def run_hosts(config, argv, work):
        rows.write_text("size_bytes,time_us\n1024,5.0\n2048,6.0\n")
        return {0: (1000, 2000), 1: (2000, 1000)}

    def read_records(path):
        os.kill(os.getpid(), signal.SIGTERM)
        return []

    monkeypatch.setattr(cluster, "run_hosts", run_hosts)
    monkeypatch.setattr(cluster, "_read_records", read_records)
    argv = ["cluster", "--hosts", "2", "--", "sweep", "-b", "1K", "-e", "2K", "--csv", str(rows)]
    assert cli.main(argv) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == f"commbench: interrupted; finished points are in {rows}\n"


def test_a_second_stop_signal_does_not_cut_the_removal_of_the_scratch_directory(tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    monkeypatch.setattr(netns, "check_privileges", lambda: None)

    def run_hosts(config, argv, work):
        os.kill(os.getpid(), signal.SIGINT)

    rmtree = shutil.rmtree

    def impatient_rmtree(*args, **kwargs):  # Ctrl-C pressed again as the directory goes
        os.kill(os.getpid(), signal.SIGINT)
        return rmtree(*args, **kwargs)

    monkeypatch.setattr(cluster, "run_hosts", run_hosts)
    monkeypatch.setattr(shutil, "rmtree", impatient_rmtree)
    assert cli.main(["cluster", "--hosts", "2", "--", "sweep", "-b", "1K", "-e", "1K", "-q"]) == 130
    assert list(scratch.iterdir()) == []


def test_failure_text_and_first_failure():
    killed = "...\n  exitcode  : -9 (pid: 77)\n  traceback : Signal 9 (SIGKILL) received by PID 77\n"
    raised = "Traceback (most recent call last):\n  File x\nRuntimeError: Connection closed by peer\n"
    bad = "commbench: error: unknown algorithm 'x'\n"
    assert cluster.failure_text(killed, 1) == "killed by SIGKILL"
    assert cluster.failure_text(raised, 1) == "RuntimeError: Connection closed by peer"
    assert cluster.failure_text(bad, 2) == "error: unknown algorithm 'x'"
    assert cluster.failure_text("", 3) == "exited with code 3"
    # a rank under torchrun names itself; the cluster's message names it once, not twice
    named = "commbench: rank 0 failed: RuntimeError: Connection closed by peer [198.18.0.102]:4242\n"
    assert cluster.failure_text(named, 1) == "RuntimeError: Connection closed by peer [198.18.0.102]:4242"
    # The killed rank is the cause even when its peers' errors were seen first.
    first = cluster.first_failure(
        {0: (1.0, "RuntimeError: closed", False), 2: (1.2, "killed by SIGKILL", False)}
    )
    assert (first.rank, str(first), first.bad_input) == (2, "rank 2 failed: killed by SIGKILL", False)
    first = cluster.first_failure({1: (2.0, "killed by SIGTERM", False), 0: (2.5, "error: x", True)})
    assert (first.rank, first.bad_input) == (0, True)


def test_rank_exit_code_is_read_from_the_launchers_summary():
    # The launcher on a host exits 1 whatever its rank's code; its summary keeps the rank's.
    log = (
        "commbench: error: expected data_batch_2: no such file\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-26_02:00:00\n"
        "  rank      : 1 (local_rank: 0)\n  exitcode  : 2 (pid: 4242)\n"
    )
    assert cluster.rank_exit_code(log) == 2
    assert cluster.rank_exit_code(log.replace(": 2 (pid", ": -9 (pid")) == -9
    assert cluster.rank_exit_code("RuntimeError: Connection closed by peer\n") is None


@pytest.mark.parametrize("bad_input, code", [(True, 2), (False, 1)])
def test_a_host_that_refused_its_input_is_exit_2(bad_input, code, monkeypatch, capsys):
    from commbench.bench.launch import RankFailed

    def run_hosts(config, argv, work):
        raise RankFailed(1, "error: expected data_batch_2: no such file", bad_input=bad_input)

    monkeypatch.setattr(cluster, "run_hosts", run_hosts)
    monkeypatch.setattr(netns, "check_privileges", lambda: None)
    assert cli.main(["cluster", "--hosts", "2", "--", "sweep", "-b", "1K", "-e", "1K", "-q"]) == code
    assert capsys.readouterr().err == "commbench: rank 1 failed: error: expected data_batch_2: no such file\n"


def test_computed_bytes_counts_every_call_of_every_point():
    rec = {
        "type": "sweep",
        "warmup": 2,
        "iters": 5,
        "computed_sent_bytes_per_rank": [30, 10, 10, 10],
        "computed_recv_bytes_per_rank": [30, 10, 10, 10],
    }
    tx, rx = cluster.computed_bytes([{"type": "header"}, rec, rec], 4, calls_extra=1)
    assert tx == [2 * 8 * 30, 160, 160, 160] and rx == tx
    assert cluster.computed_bytes([{"type": "header"}], 4, 0) is None


def test_bytes_sent_and_received_are_kept_apart_per_host():
    """A rank that sends more than it receives (a broadcast's root): computed and measured bytes
    each way stay in their own column, in the totals and in the per-point tables, whose send/recv
    series is the transport's limit."""
    rec = {
        "type": "sweep",
        "warmup": 1,
        "iters": 2,
        "computed_sent_bytes_per_rank": [30, 10],
        "computed_recv_bytes_per_rank": [0, 30],
    }
    # each point runs warmup + iters + the check = 4 times
    assert cluster.computed_bytes([rec], 2, calls_extra=1) == ([120, 40], [0, 120])

    config = cluster.ClusterConfig(hosts=2, shaping=Shaping(), inner=("sweep",))
    hosts = cluster.host_traffic(config, {0: (1000, 2000), 1: (3000, 4000)}, [rec], calls_extra=1)
    assert [(h.tx_bytes, h.rx_bytes, h.computed_tx_bytes, h.computed_rx_bytes) for h in hosts] == [
        (1000, 2000, 120, 0),
        (3000, 4000, 40, 120),
    ]

    def point(collective, algorithm, per_host):
        keys = ("tx_bytes", "computed_tx_bytes", "rx_bytes", "computed_rx_bytes")
        hosts = [
            {"rank": r, "address": f"198.18.0.{100 + r}", **dict(zip(keys, values, strict=True))}
            for r, values in enumerate(per_host)
        ]
        return {"type": "sweep", "collective": collective, "algorithm": algorithm, "hosts": hosts}

    tables = cluster.per_point_tables(
        [
            point("sendrecv", "p2p", [(3e6, 2e6, 1e6, 4e6)]),
            point("broadcast", "ring", [(5e6, 4e6, 1e6, 2e6)]),
            point("broadcast", "ring", [(1e6, 1e6, 1e6, 2e6)]),  # summed over the sizes
        ]
    ).splitlines()

    def first_row(name):
        title = next(i for i, line in enumerate(tables) if line.startswith(f"# {name}: per iteration"))
        return tables[title + 2].split()  # host, address, tx MB, computed, ratio, rx MB, computed, ratio

    assert first_row("limit") == ["0", "198.18.0.100", "3.000", "2.000", "1.500", "1.000", "4.000", "0.250"]
    assert first_row("ring") == ["0", "198.18.0.100", "6.000", "5.000", "1.200", "2.000", "4.000", "0.500"]
    assert not any("p2p" in line for line in tables)


def test_a_training_runs_bytes_are_priced_per_strategy_and_epoch():
    """train and compare inside the cluster printed '-' for every computed column: only a sweep's
    records were read. Each strategy's bytes an epoch count once for each epoch it ran."""

    def summary(strategy, sent, received):
        return {"type": "train_summary", "strategy": strategy, "wire_bytes_per_rank_per_epoch": sent,
                "wire_recv_bytes_per_rank_per_epoch": received}  # fmt: skip

    def epoch(strategy, n, tx, computed):
        hosts = [{"rank": r, "address": f"198.18.0.{100 + r}", "tx_bytes": tx, "rx_bytes": tx,
                  "computed_tx_bytes": computed, "computed_rx_bytes": computed} for r in (0, 1)]  # fmt: skip
        return {"type": "epoch", "strategy": strategy, "epoch": n, "hosts": hosts}

    records = [
        {"type": "header"},
        *(epoch(s, n, 1000 * n, 900) for n in (1, 2) for s in ("naive", "ring")),
        summary("naive", [300, 100], [100, 300]),  # a broadcast's root sends more than it receives
        summary("ring", [200, 200], [200, 200]),
    ]
    assert cluster.computed_bytes(records, 2, calls_extra=1) == ([2 * 500, 2 * 300], [2 * 300, 2 * 500])
    tables = cluster.per_point_tables(records)
    assert "# naive: per step, mean of its epochs, counted by each rank" in tables
    assert "    0  198.18.0.100      0.002      0.001  1.667" in tables  # (1000 + 2000) / 2 against 900
    assert cluster.computed_bytes([*records, summary("dp", None, None)], 2, 0) is None  # not priced


# ---------------------------------------------------------------- real clusters


def _ours(owner: int) -> list[str]:
    return netns.owned(netns.namespaces(), owner)


def _root_state() -> tuple[set[str], set[str]]:
    """Interface names, and the shaping qdiscs, of this (the root) namespace."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True, timeout=30).stdout
    names = {m.group(1) for m in re.finditer(r"^\d+: ([^:@]+)", links, re.M)}
    return names, {line for line in qdiscs.splitlines() if re.search(r"qdisc (tbf|netem)", line)}


def _assert_clean(owner: int, before: tuple[set[str], set[str]]) -> None:
    assert _ours(owner) == [], "namespaces left behind"
    assert _root_state() == before, "interfaces or qdiscs changed outside the namespaces"
    left = _processes_of(owner)
    assert left == [], f"processes of the run still alive: {left}"


def _processes_of(owner: int) -> list[int]:
    """The live processes of the run of ``owner``: the hosts' launchers, whose command line names
    the rendezvous (commbench-<owner>), and their ranks, whose environment does (the launcher sets
    TORCHELASTIC_RUN_ID); a rank's command line names nothing of the run."""
    tag = re.compile(rf"\bcommbench-{owner}(?!\d)")
    out = []
    for p in psutil.process_iter(["cmdline", "environ", "status"]):
        if p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        run_id = (p.info["environ"] or {}).get("TORCHELASTIC_RUN_ID", "")
        if tag.search(" ".join(p.info["cmdline"] or [])) or tag.fullmatch(run_id):
            out.append(p.pid)
    return out


def test_a_rank_left_behind_is_seen():
    """The check looked for commbench-<owner> in command lines, which only the hosts' launchers
    carry: a rank outliving its namespace (python -m commbench sweep ...) passed it."""
    owner = 999_999_999  # above any pid: no run's
    env = {**os.environ, "TORCHELASTIC_RUN_ID": f"commbench-{owner}"}
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "sweep"], env=env)
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"commbench-{owner}"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"commbench-{owner}0"])
    try:
        deadline = time.monotonic() + 30  # until the children have exec'd
        while sorted(_processes_of(owner)) != sorted((rank.pid, agent.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(_processes_of(owner)) == sorted((rank.pid, agent.pid))
    finally:
        for p in (rank, agent, other):
            p.kill()
            p.wait()
    assert _processes_of(owner) == []


@needs_privileges
def test_three_hosts_bytes_per_host_match_the_cost_model(tmp_path, capfd, monkeypatch):
    """naive: rank 0 moves (n-1)x what the others move; ring: balanced; measured at the switch."""
    before = _root_state()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, timeout=60
    )
    stale = f"commbench-{int(dead.stdout)}-h0"  # as a crashed earlier run leaves it
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=30)
    out = tmp_path / "c3.jsonl"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))  # the hosts' default, which the run should not fill
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    argv = ["cluster", "--hosts", "3", "--rate", "500mbit", "--", "sweep", "-a", "naive,ring"]
    argv += ["-b", "256K", "-e", "1M", "-f", "4", "-n", "3", "-w", "1", "--no-limit", "--json", str(out)]
    code = cli.main(argv)
    captured = capfd.readouterr()
    assert code == 0, captured.err[-2000:]
    _assert_clean(os.getpid(), before)
    assert list(scratch.iterdir()) == []  # each host's torchrun left a torchelastic_* directory here
    assert stale not in netns.namespaces(), "a dead run's namespace was not removed at start"
    records = [json.loads(x) for x in out.read_text().splitlines()]
    sweep = [r for r in records if r.get("type") == "sweep"]
    assert {r["world_size"] for r in sweep} == {3} and all(r["wrong"] == 0 for r in sweep)
    (rec,) = [r for r in records if r.get("type") == "cluster"]
    assert rec["link_rate_gbps"] == 0.5 and rec["tc"]["rate_bit"] == 5 * 10**8
    # the hosts' header (written by host 0's rank) and the cluster record give the whole command
    assert records[0]["command"] == rec["command"] == shlex.join(["commbench", *argv])
    hosts = rec["hosts"]
    assert [h["address"] for h in hosts] == ["198.18.0.100", "198.18.0.101", "198.18.0.102"]
    # the hosts share a hostname: the table's rank lines and the header tell them apart by address
    places = records[0]["ranks"]
    assert sorted(p["address"] for p in places) == [h["address"] for h in hosts]
    assert all(f"({p['address']}), pid {p['pid']}, cpu" in captured.out for p in places)
    slack = 300_000  # rendezvous, store, barriers and timing all-reduces
    for h in hosts:
        for way in ("tx", "rx"):
            measured, computed = h[f"{way}_bytes"], h[f"computed_{way}_bytes"]
            # Frames carry headers (at most ~5% at MTU 1500; less as counted with offload) and ACKs.
            assert 0.99 * computed <= measured <= 1.06 * computed + slack, (h, way)
    tx = [h["tx_bytes"] for h in hosts]
    ctx = [h["computed_tx_bytes"] for h in hosts]
    # What rank 0 moves beyond the others is naive's (n-1)x - 1x: as computed, within 6%.
    assert (tx[0] - tx[1]) == pytest.approx(ctx[0] - ctx[1], rel=0.06)
    assert ctx[0] - ctx[1] > 0.2 * ctx[1]
    # The non-roots are balanced; naive's senders converge on rank 0's one port, and the drops of
    # that queue make retransmissions of up to a few percent, on one sender more than another.
    assert abs(tx[1] - tx[2]) < 0.04 * tx[1]
    assert "# cluster: 3 hosts" in captured.out and "alpha-beta fit" in captured.out
    per_iter = [r for r in sweep if r.get("hosts")]
    for r in per_iter:  # where the sweep counted bytes per iteration itself (COMMBENCH_NIC)
        moved = {h["rank"]: h["tx_bytes"] + h["rx_bytes"] for h in r["hosts"]}
        if r["algorithm"] == "naive":
            assert moved[0] == pytest.approx(2 * moved[1], rel=0.1)
        else:
            assert moved[0] == pytest.approx(moved[1], rel=0.1) == pytest.approx(moved[2], rel=0.1)


@needs_privileges
def test_delay_without_netem_fails_in_one_line_or_runs(capfd):
    before = _root_state()
    argv = ["cluster", "--hosts", "1", "--delay", "100us", "--", "sweep", "-b", "1K", "-e", "1K", "-n", "1"]
    code = cli.main(argv + ["-w", "0", "--no-limit", "--no-probe", "-q"])
    err = capfd.readouterr().err
    if "netem" in err:
        assert code == 2 and err.strip().count("\n") == 0
    else:  # a kernel with netem runs it
        assert code == 0, err[-2000:]
    _assert_clean(os.getpid(), before)


def _start(hosts: int, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "commbench", "cluster", "--hosts", str(hosts), "--rate", "100mbit", "--"]
    argv += ["sweep", "-a", "ring", "-b", "4M", "-e", "4M", "-n", "1000", "-w", "0", "--no-limit", "-c", "0"]
    return subprocess.Popen(
        [*argv, *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _rank_process(owner: int, host: int, timeout_s: float = 120) -> int:
    """The rank (the launcher's child) running in host ``host`` of the run of ``owner``."""
    deadline = time.monotonic() + timeout_s
    ns = f"commbench-{owner}-h{host}"
    while time.monotonic() < deadline:
        if ns in netns.namespaces():
            for pid in netns.pids_in(ns):
                try:
                    cmd = psutil.Process(pid).cmdline()
                except psutil.Error:
                    continue
                if "commbench" in cmd and "torch.distributed.run" not in cmd:
                    return pid
        time.sleep(0.2)
    raise AssertionError(f"no rank process appeared in {ns}")


# Loaded by every Python process of the run through PYTHONPATH: each rank's check counts 3 wrong,
# and rank 1 ends 3 s after its work, as a loaded host's may.
_WRONG_CHECK = """
import atexit, os, time
from commbench.bench import collectives
collectives.AllReduce.wrong = lambda self, *args: 3
if os.environ.get("RANK") == "1":
    atexit.register(time.sleep, 3)
"""


@needs_privileges
@pytest.mark.slow
@pytest.mark.parametrize("records", ["file", "/dev/null"])
def test_wrong_results_keep_the_cluster_record_and_report_then_fail(tmp_path, records):
    """A sweep with wrong elements exits 1 (as nccl-tests fails); the cluster took that for a
    crashed rank ('rank 0 failed'), and the cluster record and each host's bytes were lost. A
    failed rank skips torchrun's exit barrier, so host 0's launcher, which holds the rendezvous,
    went before host 1's had seen its rank end ('rank 1 failed: ... RendezvousConnectionError'):
    the hosts' ranks end well, and the cluster fails the run from the records, which it keeps of
    its own where --json is /dev/null (it said nothing of the wrong points there, exit 0)."""
    (tmp_path / "sitecustomize.py").write_text(_WRONG_CHECK)
    out = tmp_path / "w.jsonl" if records == "file" else Path(os.devnull)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    argv = [sys.executable, "-m", "commbench", "cluster", "--hosts", "2", "--", "sweep", "-a", "ring"]
    argv += ["-b", "1K", "-e", "1K", "-n", "1", "-w", "0", "--no-limit", "--no-probe", "--json", str(out)]
    before = _root_state()
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        said, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    wrong = "all_reduce ring at 1024 B (6)"  # 3 on each of the 2 ranks, summed
    assert proc.returncode == 1 and err.endswith(f"the closed form): {wrong}\n"), err[-2000:]
    assert err.startswith("commbench: wrong results in 1 of 1 points") and err.count("\n") == 1, err[-2000:]
    assert "198.18." in said, said  # the cluster's report of each host's bytes
    if records == "file":
        assert [json.loads(line)["type"] for line in out.read_text().splitlines()] == [
            "header",
            "sweep",
            "cluster",
        ]
    _assert_clean(proc.pid, before)


@needs_privileges
@pytest.mark.slow
def test_killed_rank_fails_the_run_by_name_and_cleans_up():
    before = _root_state()
    proc = _start(2)
    try:
        os.kill(_rank_process(proc.pid, 1), signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1
    assert "rank 1 failed: killed by SIGKILL" in err, err[-2000:]
    _assert_clean(proc.pid, before)


@needs_privileges
@pytest.mark.slow
def test_a_killed_cluster_command_stops_its_hosts_and_the_next_run_removes_its_directory(
    tmp_path, monkeypatch, capfd
):
    """SIGKILL to the cluster command left its hosts' launchers and ranks running to the end of
    their sweep, and its scratch directory, which no later run removed."""
    before = _root_state()
    proc = _start(2, "-q", env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        _rank_process(proc.pid, 1)
        proc.kill()
        proc.wait(timeout=30)  # reaped: a zombie's pid is alive to the next run
        deadline = time.monotonic() + 60
        while _processes_of(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _processes_of(proc.pid) == [], "the hosts ran on after the cluster command was killed"
        (left,) = tmp_path.iterdir()
        assert left.name.startswith(f"commbench-cluster-{proc.pid}-")
    finally:
        proc.kill()
        netns.destroy(_ours(proc.pid))  # where the test failed
        proc.communicate(timeout=30)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    argv = ["cluster", "--hosts", "1", "--", "sweep", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0"]
    assert cli.main([*argv, "--no-limit", "--no-probe", "-q"]) == 0, capfd.readouterr().err[-2000:]
    assert list(tmp_path.iterdir()) == [], "the killed run's directory was not removed"
    _assert_clean(proc.pid, before)
    _assert_clean(os.getpid(), before)


@needs_privileges
@pytest.mark.slow
def test_input_a_host_refuses_after_the_build_is_exit_2(tmp_path):
    # The check before the build cannot read the data files; the hosts' ranks do, and refuse them.
    before = _root_state()
    batches = tmp_path / "cifar-10-batches-py"
    batches.mkdir()
    (batches / "data_batch_1").write_bytes(bytes(1000))
    argv = ["cluster", "--hosts", "2", "--", "train", "--dataset", "cifar10", "--data-dir", str(tmp_path)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "commbench", *argv, "--epochs", "1", "-q"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 2, err[-2000:]
    assert err.endswith("data_batch_2: no such file\n"), err[-2000:]
    assert err.count("\n") == 1, err[-2000:]
    _assert_clean(proc.pid, before)


@needs_privileges
@pytest.mark.slow
@pytest.mark.parametrize("signum", list(stops.STOPS.values()), ids=list(stops.STOPS))
def test_a_stop_signal_ends_the_run_and_cleans_up(tmp_path, signum):
    """SIGHUP (a closed terminal) used to end the command at once, leaving the namespaces, the
    scratch directory, and the hosts' ranks running to the end of their sweep."""
    before = _root_state()
    out = tmp_path / "c.jsonl"
    proc = _start(2, "--json", str(out), env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        _rank_process(proc.pid, 0)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, err[-2000:]
    # the signal may come before rank 0 opens the file
    kept = "holds no points" if out.exists() else "was not written"
    assert err == f"commbench: interrupted; nothing had finished, {out} {kept}\n"
    _assert_clean(proc.pid, before)
    assert list(tmp_path.glob("commbench-*")) == []


@pytest.mark.parametrize("tail", ["cut", "whole"])
def test_the_cluster_record_is_appended_after_a_line_cut_short(tmp_path, monkeypatch, capsys, tail):
    """A stop can leave the inner run's last line cut short; the cluster record, appended to it,
    made that line and so the whole file unreadable ("not JSON Lines: line 3"). A cut line is
    dropped, as readers drop it; a whole last record without its newline is kept."""
    from commbench.bench import reporting

    monkeypatch.setattr(netns, "check_privileges", lambda: None)
    out = tmp_path / "r.jsonl"
    point = {"type": "sweep", "collective": "all_reduce", "algorithm": "ring", "world_size": 2}
    point |= {"size_bytes": 1024, "busbw_gbps": 0.5}
    last = json.dumps(point | {"size_bytes": 2048})  # the next point

    def run_hosts(config, argv, work):
        head = json.dumps({"type": "header"}) + "\n" + json.dumps(point) + "\n"
        out.write_text(head + (last[: len(last) // 2] if tail == "cut" else last))
        return {0: (1000, 2000), 1: (2000, 1000)}

    monkeypatch.setattr(cluster, "run_hosts", run_hosts)
    argv = ["cluster", "--hosts", "2", "--", "sweep", "-b", "1K", "-e", "1K", "-q", "--json", str(out)]
    assert cli.main(argv) == 0
    run = reporting.load_run(out)
    assert len(run.sweeps) == (1 if tail == "cut" else 2)
    assert [h["tx_bytes"] for h in run.clusters[0]["hosts"]] == [1000, 2000]
    err = capsys.readouterr().err.splitlines()  # the reading of the records notes the cut line
    assert len(err) == (tail == "cut") and all(f"{out}: the last line is cut short" in line for line in err)


def test_a_stop_while_the_scratch_directory_is_removed_neither_cuts_it_short_nor_fails_the_run(
    tmp_path, monkeypatch
):
    """A stop during the removal raised the cluster's Interrupted inside it: part of the directory
    (hosts' logs, torchelastic's) stayed, and a run whose report was out ended as interrupted."""
    from commbench.bench import signals
    from commbench.bench.launch import Interrupted

    real = shutil.rmtree

    def stopped_midway(path, ignore_errors=False):
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, before the removal
        real(path, ignore_errors=ignore_errors)

    def raise_stop(signum, frame):
        raise Interrupted(signum)

    monkeypatch.setattr(cluster.shutil, "rmtree", stopped_midway)
    with signals.handled(signals.STOPS, raise_stop):  # as the cluster's run has them
        with cluster._scratch("commbench-cluster-test-", str(tmp_path)) as work:
            Path(work, "host0.log").write_text("done")
        with pytest.raises(Interrupted), cluster._scratch("commbench-cluster-test-", str(tmp_path)):
            os.kill(os.getpid(), signal.SIGTERM)  # a stop during the run still ends it
            time.sleep(5)
    assert list(tmp_path.iterdir()) == []


@needs_privileges
def test_links_under_ipv6s_smallest_mtu_are_built():
    """An MTU under 1280 takes IPv6 off a link, and the build then set an IPv6 setting on it (its
    address generation): --mtu 576 to 1279, which the checks take, failed with exit 3."""
    topo = Topology(hosts=1, owner=os.getpid())
    try:
        netns.create(topo, Shaping(mtu=576))
        shown = subprocess.run(
            ["ip", "-n", topo.namespace(0), "-j", "link", "show", netns.NIC],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        assert json.loads(shown.stdout)[0]["mtu"] == 576
    finally:
        assert netns.destroy(netns.owned(netns.namespaces(), os.getpid())) == []


def test_the_hosts_records_name_the_clusters_command_line(tmp_path, monkeypatch):
    """The hosts' header and the cluster record gave the inner command alone (`commbench sweep
    ...`): re-run from a report, it measured loopback, not the shaped links. (With real hosts:
    test_three_hosts_bytes_per_host_match_the_cost_model.)"""

    monkeypatch.setattr(netns, "check_privileges", lambda: None)
    out = tmp_path / "r.jsonl"
    argv = [
        "cluster",
        "--hosts",
        "2",
        "--rate",
        "1gbit",
        "--",
        "sweep",
        "-b",
        "1K",
        "-e",
        "1K",
        "--json",
        str(out),
    ]
    seen = {}

    def run_hosts(config, argv, work):
        seen["env"] = cluster.host_process_env(config, Topology(hosts=2, owner=1), 0, work)  # as run_hosts
        out.write_text(json.dumps({"type": "header"}) + "\n")
        return {0: (1000, 2000), 1: (2000, 1000)}

    monkeypatch.setattr(cluster, "run_hosts", run_hosts)
    assert cli.main(argv) == 0
    whole = shlex.join(["commbench", *argv])
    assert seen["env"][cluster.COMMAND_ENV] == whole
    (record,) = [r for r in map(json.loads, out.read_text().splitlines()) if r["type"] == "cluster"]
    assert record["command"] == whole
    # a host's command takes the line for its header; outside a cluster's host the variable is not read
    header = tmp_path / "b.jsonl"
    monkeypatch.setenv(cluster.COMMAND_ENV, whole)
    assert cli.main(["bandwidth", "--size", "4K", "--json", str(header)]) == 0
    assert json.loads(header.read_text().splitlines()[0])["command"].startswith("commbench bandwidth")
    header.unlink()
    monkeypatch.setenv(cluster.HOST_ENV, "1")
    assert cli.main(["bandwidth", "--size", "4K", "--json", str(header)]) == 0
    assert json.loads(header.read_text().splitlines()[0])["command"] == whole
