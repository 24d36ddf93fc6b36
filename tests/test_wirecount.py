"""Grouping ranks' interface readings by host and judging them, mostly without a process group."""

from __future__ import annotations

import math

import pytest
import torch

from commbench.probes.wirecount import WireCounter, link_gbps, link_problem


def _counter(hosts: list[list[int]], nics: list[str], interconnect: str, mtu: int, link: float | None):
    c = WireCounter.__new__(WireCounter)  # the grouping a live group would have gathered
    c.hosts = hosts
    c.info = [(n, f"198.18.0.{i + 1}") for i, n in enumerate(nics)]
    c.interconnect, c.mtu, c.nic, c.link_gbps = interconnect, mtu, nics[0], link
    return c


def test_shared_loopback_is_compared_with_the_sum_over_ranks() -> None:
    c = _counter([[0, 1, 2]], ["lo"], "loopback", 65536, None)
    sent = [2_000_000, 1_000_000, 1_000_000]
    # Every rank read the same counter; rank 0's reading is used: 3 iterations, 12 MB + framing.
    rows = [[12_012_000, 12_012_000, 1000, 1000, 0.3, 0.03]] + [[1, 1, 0, 0, 0.3, 0.03]] * 2
    wc = c.summarise(rows, 3, sent, sent, 2 << 20)
    (h,) = wc.hosts
    assert h.ranks == [0, 1, 2] and h.computed_tx_bytes == 4_000_000
    assert h.tx_bytes == (12_012_000 - 1000) // 3
    assert wc.wire_bytes_ratio == pytest.approx(12_011_000 / 12_000_000)
    assert wc.wire_check is None
    assert h.cpu_user == pytest.approx(0.3)  # CPU seconds summed over the host's ranks, per iteration


def test_one_rank_per_host_each_with_its_own_counter() -> None:
    c = _counter([[0], [1], [2]], ["eth0", "eth0", "eth0"], "ethernet", 1500, None)
    sent = [2_000_000, 1_000_000, 1_000_000]  # naive: rank 0 sends (n-1) x S
    rows = [[int(s * 1.046), int(s * 1.046), 0, 0, 0.1, 0.0] for s in sent]
    wc = c.summarise(rows, 1, sent, sent, 1 << 20)
    assert [h.computed_tx_bytes for h in wc.hosts] == sent
    assert [h.address for h in wc.hosts] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
    assert wc.wire_check is None


def test_a_short_count_is_flagged_and_small_messages_are_not_judged() -> None:
    c = _counter([[0, 1]], ["lo"], "loopback", 65536, None)
    rows = [[900_000, 900_000, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    assert "measured/computed" in c.summarise(rows, 1, [500_000, 500_000], [500_000] * 2, 2 << 20).wire_check
    assert c.summarise(rows, 1, [500_000, 500_000], [500_000] * 2, 4096).wire_check.startswith("not judged")


def test_small_segments_are_not_judged_and_64k_ones_are() -> None:
    """A ring of 1 KiB segments sent 30% more than computed on loopback: gloo's own bytes with each
    message, which the cost model leaves out, and it was flagged against a model that was right."""
    c = _counter([[0, 1]], ["lo"], "loopback", 65536, None)
    rows = [[1_300_000, 1_300_000, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    sent = [500_000, 500_000]
    check = c.summarise(rows, 1, sent, sent, 2 << 20, message_bytes=1024).wire_check
    assert check.startswith("not judged: segments of 1024 bytes"), check
    assert "measured/computed" in c.summarise(rows, 1, sent, sent, 2 << 20, message_bytes=64 << 10).wire_check


@pytest.mark.parametrize(
    "collective, series, world, size, segment",
    [
        ("all_reduce", "ring@1K", 4, 2 << 20, 1024),
        ("all_reduce", "ring@100K", 4, 2 << 20, 21846 * 4),  # 512 KiB chunks in 6 segments
        ("all_reduce", "ring", 4, 2 << 20, 512 << 10),  # one segment a chunk
        ("all_reduce", "naive", 4, 2 << 20, None),
        ("sendrecv", "p2p@1K", 2, 2 << 20, 1024),
        ("all_reduce", "limit", 4, 2 << 20, 2 << 20),  # the whole message, in one 16 MiB segment
    ],
)
def test_the_sweep_knows_the_segments_a_series_sends(collective, series, world, size, segment) -> None:
    from commbench.bench.sweep import SweepConfig, _segment_bytes_on_wire

    config = SweepConfig(
        collective=collective, algorithms=("p2p",) if collective == "sendrecv" else ("ring",)
    )
    assert _segment_bytes_on_wire(config, series, size, 4, world) == segment


def test_link_check_names_an_impossible_rate(monkeypatch) -> None:
    assert link_problem("eth0", 120_000_000, 0, 1.0, 0.125) is None  # 1 Gbit/s
    assert link_problem("eth0", 200_000_000, 0, 1.0, 0.125).startswith("impossible reading: eth0 sent")
    assert link_problem("eth0", 0, 200_000_000, 1.0, 0.125).startswith("impossible reading: eth0 received")
    assert link_problem("eth0", 200_000_000, 0, 0.05, 0.125) is None  # a burst in a short pass
    assert link_problem("eth0", 200_000_000, 0, 1.0, None) is None  # no known maximum
    # 10 Mbit/s with the cluster's least bucket: 789,990 bytes in 0.557 s is within rate and burst
    assert link_problem("eth0", 789_990, 0, 0.557, 0.00125).startswith(
        "impossible reading: eth0 sent: 0.00142 GB/s measured (789990 bytes in 0.557 s) exceeds the link "
        "maximum of 0.00125 GB/s by more than 5%"
    )
    monkeypatch.setenv("COMMBENCH_LINK_BURST", str(128 << 10))
    assert link_problem("eth0", 789_990, 0, 0.557, 0.00125) is None
    assert link_problem("eth0", 900_000, 0, 0.557, 0.00125).endswith(
        "by more than 5% and a burst of 131072 bytes"
    )
    monkeypatch.setenv("COMMBENCH_LINK_BURST", "128K")
    with pytest.raises(ValueError, match=r"^\$COMMBENCH_LINK_BURST='128K' is not a number of bytes"):
        link_problem("eth0", 789_990, 0, 0.557, 0.00125)
    monkeypatch.delenv("COMMBENCH_LINK_BURST")
    monkeypatch.setattr("commbench.probes.wirecount.CHECKED_PASS_S", 0.0)
    assert link_problem("eth0", 0, 0, 0.0, 0.125) is None  # no steps counted: nothing to judge
    monkeypatch.setenv("COMMBENCH_LINK_GBPS", "2.5")
    assert link_gbps("eth0", False) == pytest.approx(2.5 / 8)
    monkeypatch.delenv("COMMBENCH_LINK_GBPS")
    assert link_gbps("lo", True) is None


def test_broken_readings_are_judged_from_the_gathered_rows() -> None:
    """A host's reading that went backwards, or beyond its link, is judged after the all-gather
    from every rank's row, so every rank records the same verdict and the run goes on. It was
    raised on the rank that read it: a ValueError ended the run with exit 2, and an
    ImpossibleReading before the all-gather left the other ranks waiting in it."""
    c = _counter([[0], [1]], ["eth0", "eth0"], "ethernet", 1500, None)
    sent = [1_000_000, 1_000_000]
    ok = [1_001_056, 1_001_056, 0, 0, 0.0, 0.0, 16, 0, 1.0, math.nan, 0.0]  # no known link maximum
    fast = [200_000_000, 1_000_000, 0, 0, 0.0, 0.0, 16, 0, 1.0, 0.125, 0.0]  # 1.6 Gbit/s on 1 Gbit/s
    wc = c.summarise([ok, fast], 1, sent, sent, 1 << 20)
    assert wc.wire_check.startswith("impossible reading: eth0 (198.18.0.2) sent: 0.200 GB/s")
    assert len(wc.hosts) == 2 and wc.measured_wire_bytes is not None
    short = c.summarise([ok, fast[:8] + [0.4, 0.125, 0.0]], 1, sent, sent, 1 << 20)  # a 0.4 s pass
    assert not short.wire_check.startswith("impossible reading")
    went_back = ok[:10] + [1.0]
    wc = c.summarise([ok, went_back], 1, sent, sent, 1 << 20)
    assert wc.wire_check == (
        "not judged: the interface counters went backwards (a reset or a link flap) during the count, "
        "on eth0 (198.18.0.2)"
    )
    assert (wc.measured_wire_bytes, wc.wire_bytes_ratio, wc.hosts) == (None, None, [])
    assert wc.computed_wire_bytes == sum(sent)
    # One host's reset does not hide another host's impossible reading (the point is not recounted).
    wc = c.summarise([fast, went_back], 1, sent, sent, 1 << 20)
    assert wc.wire_check.startswith("not judged: the interface counters went backwards")
    assert "; impossible reading: eth0 (198.18.0.1) sent: 0.200 GB/s" in wc.wire_check


@pytest.mark.parametrize(
    "fault, verdict",
    [
        ("reset", "not judged: the interface counters went backwards"),
        ("impossible", "impossible reading: veth1 (198.18.0.2) sent"),
    ],
)
def test_one_hosts_broken_reading_is_every_ranks_verdict(worlds, fault, verdict) -> None:
    """Two real ranks, rank 1's reading broken: both finish the count with the same wire_check."""
    results = worlds(2).run(("wire_faults", {"fault": fault, "rank": 1}))
    assert results[0] == results[1] and results[0].startswith(verdict), results


def test_an_idle_interval_whose_counters_went_backwards_is_left_out(worlds) -> None:
    """The other idle interval is the baseline: the point is still measured."""
    results = worlds(2).run(("wire_faults", {"fault": "idle_reset", "rank": 1}))
    assert results[0] == results[1], results
    assert not (results[0] or "").startswith("not judged: the interface counters"), results


def test_counts_from_several_hosts_with_several_ranks_to_a_host_are_not_judged() -> None:
    """The cost model's bytes are all a rank sends; the interface between hosts does not carry what
    ranks of one host send each other. A 2 x 2 ring crosses hosts on half its hops: 0.5 of the
    computed bytes was flagged as a short count."""
    c = _counter([[0, 1], [2, 3]], ["eth0", "eth0"], "ethernet", 1500, None)
    sent = [3_000_000] * 4
    rows = [[3_138_000, 3_138_000, 0, 0, 0.0, 0.0]] * 4  # each host: one rank's bytes, framed
    wc = c.summarise(rows, 1, sent, sent, 4 << 20)
    assert wc.wire_check == (
        "not judged: ranks run on 2 hosts, several to a host, and what ranks of one host send each "
        "other does not cross its interface"
    )
    assert wc.measured_wire_bytes == 2 * 3_138_000 and wc.wire_bytes_ratio == pytest.approx(0.523)
    assert (
        _counter([[0, 1, 2, 3]], ["lo"], "loopback", 65536, None)
        .summarise([[12_012_000, 12_012_000, 0, 0, 0.0, 0.0]] * 4, 1, sent, sent, 4 << 20)
        .wire_check
        is None
    )  # one host: every byte crosses its loopback


def test_a_loopback_count_among_several_hosts_is_not_judged() -> None:
    c = _counter([[0], [1]], ["lo", "eth0"], "loopback", 65536, None)
    sent = [1_000_000, 1_000_000]
    rows = [[0, 0, 0, 0, 0.0, 0.0], [1_046_000, 1_046_000, 0, 0, 0.0, 0.0]]
    assert c.summarise(rows, 1, sent, sent, 1 << 20).wire_check == (
        "not judged: ranks run on 2 hosts, and lo (198.18.0.1) is loopback, which carries none of the "
        "traffic between them (name the interface in $COMMBENCH_NIC)"
    )


class _Gathered:
    """A stand-in process group for the probes' all-gathers: rank ``rank`` of ``rows``."""

    def __init__(self, monkeypatch, rank: int, rows: list[tuple]) -> None:
        from commbench.probes import wirecount

        self.rows = rows
        monkeypatch.setattr(wirecount.dist, "get_world_size", lambda: len(rows))
        monkeypatch.setattr(wirecount.dist, "all_gather_object", self.gather)
        self.rank, self.calls = rank, 0

    def gather(self, out: list, mine: tuple) -> None:
        self.calls += 1
        out[:] = [mine if r == self.rank else row for r, row in enumerate(self.rows)]


@pytest.mark.parametrize(
    "node1, override, want",
    [
        ("hostB:1", "", "eth0"),  # ranks on another host: the master's host counts toward it
        ("hostA:1", "", "lo"),  # one host: everything goes through loopback
        ("hostB:1", "lo", "lo"),  # $COMMBENCH_NIC is kept as given
    ],
)
def test_the_masters_host_counts_the_interface_toward_the_other_hosts(monkeypatch, node1, override, want):
    """Under torchrun the master's host has $MASTER_ADDR as its own address, which gives loopback:
    it counted none of its traffic with the other hosts, while they counted theirs on eth0."""
    from commbench.probes import host, wirecount

    monkeypatch.setenv(host.NIC_ENV, override)
    monkeypatch.setattr(host, "selected_nic", lambda: "lo")
    monkeypatch.setattr(wirecount, "_node_id", lambda: "hostA:1")
    monkeypatch.setattr(wirecount, "_address", lambda nic: "127.0.0.1" if nic == "lo" else "192.0.2.2")
    routes = []
    monkeypatch.setattr(host, "nic_for_address", lambda a: routes.append(a) or "eth0")
    _Gathered(monkeypatch, 0, [None, (node1, "192.0.2.3", False, None)])
    assert wirecount.agreed_nic() == want
    assert routes == (["192.0.2.3"] if want == "eth0" else [])


def test_an_interface_one_host_lacks_is_every_ranks_error(worlds) -> None:
    results = worlds(2).run(("bad_nic_on_one_host", {}))
    assert results[0] == results[1], results
    assert results[0].startswith("COMMBENCH_NIC='eth-not-here' is not an interface here; known:"), results


def test_every_rank_judges_with_rank_0s_framing(monkeypatch) -> None:
    """Each rank judged with its own interface's MTU and kind, so the same rows got two verdicts."""
    import types

    from commbench.probes import wirecount

    monkeypatch.setattr(wirecount.p2p, "moves_host_tensors", lambda group: True)
    monkeypatch.setattr(wirecount, "agreed_nic", lambda: "eth1")
    monkeypatch.setattr(wirecount, "_address", lambda nic: "192.0.2.3")
    monkeypatch.setattr(
        wirecount.psutil, "net_if_stats", lambda: {"eth1": types.SimpleNamespace(mtu=9000, speed=0)}
    )
    gathered = _Gathered(monkeypatch, 1, [("hostA:1", "eth0", "192.0.2.2", 1500, False), None])
    c = wirecount.WireCounter(torch.device("cpu"))
    assert gathered.calls == 1 and (c.mtu, c.interconnect, c.hosts) == (1500, "ethernet", [[0], [1]])


def test_framing_is_counted_per_packet_where_packets_are_known() -> None:
    # veth with offload: 64 KiB segments, so 1 MB of payload is ~16 packets, not ~700 frames.
    c = _counter([[0], [1]], ["eth0", "eth0"], "ethernet", 1500, None)
    sent = [1_000_000, 1_000_000]
    rows = [[s + 16 * 66, s + 16 * 66, 0, 0, 0.0, 0.0, 16, 0] for s in sent]
    wc = c.summarise(rows, 1, sent, sent, 1 << 20)
    assert wc.wire_expected_ratio == pytest.approx(1 + 32 * 66 / 2_000_000)
    assert wc.wire_check is None  # the MTU-based 1.046 would have flagged this
    assert c.summarise([r[:6] for r in rows], 1, sent, sent, 1 << 20).wire_check is not None


def test_the_idle_intervals_packets_are_taken_off_the_framing_count() -> None:
    """The baseline's packets are someone else's: only the packets above it carry framing of the
    payload, as only the bytes above it are the payload's."""
    c = _counter([[0], [1]], ["eth0", "eth0"], "ethernet", 1500, None)
    sent = [1_000_000, 1_000_000]
    # 16 packets of the count's own and 10 of the idle interval's, with their 1000 bytes
    rows = [[s + 16 * 66 + 1000, s + 16 * 66 + 1000, 1000, 1000, 0.0, 0.0, 26, 10] for s in sent]
    wc = c.summarise(rows, 1, sent, sent, 1 << 20)
    assert wc.wire_expected_ratio == pytest.approx(1 + 32 * 66 / 2_000_000)
    assert wc.wire_check is None


def test_each_hosts_computed_bytes_received_are_the_cost_models_received_not_sent() -> None:
    """A broadcast's root sends and receives different amounts: each column comes from its own list,
    and the measured bytes received from the received counter less its baseline."""
    c = _counter([[0], [1], [2]], ["eth0", "eth0", "eth0"], "ethernet", 1500, None)
    sent, recv = [2_000_000, 1_000_000, 0], [0, 1_000_000, 2_000_000]
    rows = [[7000 + s, 5000 + r, 7000, 5000, 0.0, 0.0] for s, r in zip(sent, recv, strict=True)]
    wc = c.summarise(rows, 1, sent, recv, 1 << 20)
    assert [h.computed_tx_bytes for h in wc.hosts] == sent
    assert [h.computed_rx_bytes for h in wc.hosts] == recv
    assert [(h.tx_bytes, h.rx_bytes) for h in wc.hosts] == list(zip(sent, recv, strict=True))


def test_a_window_opens_between_two_barriers(monkeypatch):
    """All ranks done with what came before, then the reading, then nobody starts until all read."""
    from commbench.probes import wirecount

    calls = []
    monkeypatch.setattr(wirecount.dist, "barrier", lambda: calls.append("barrier"))
    assert wirecount.opened(lambda: calls.append("read") or 7) == 7
    assert calls == ["barrier", "read", "barrier"]


@pytest.mark.parametrize("value", ["junk", "-1", "0", "nan", "inf", "1e400"])
def test_a_bad_link_rate_is_one_line_and_exit_2_before_any_rank_starts(monkeypatch, capsys, no_ranks, value):
    """A rate the ranks could not read failed in one of them ("rank 1 failed: ValueError: could not
    convert string to float"), naming no variable; 0, -1 and nan were taken as they came."""
    from commbench.bench import cli

    monkeypatch.setenv("COMMBENCH_LINK_GBPS", value)
    assert cli.main(["sweep", "-b", "1K", "-e", "1K", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    refusal = f"$COMMBENCH_LINK_GBPS={value!r} is not a link rate: give Gbit/s, a number > 0 (e.g. 1 or 2.5)"
    assert err == f"commbench: error: {refusal}\n"


def test_a_shaped_link_rate_is_read_in_gbit_per_s(monkeypatch):
    from commbench.probes.wirecount import shaped_link_gbps

    monkeypatch.delenv("COMMBENCH_LINK_GBPS", raising=False)
    assert shaped_link_gbps() is None
    monkeypatch.setenv("COMMBENCH_LINK_GBPS", " ")
    assert shaped_link_gbps() is None
    monkeypatch.setenv("COMMBENCH_LINK_GBPS", "2.5")
    assert shaped_link_gbps() == 2.5 and link_gbps("lo", True) == pytest.approx(2.5 / 8)


def test_a_refused_demo_leaves_no_results_directory(monkeypatch, tmp_path, capsys):
    from commbench.bench import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COMMBENCH_LINK_GBPS", "junk")
    assert cli.main(["demo"]) == 2
    assert "$COMMBENCH_LINK_GBPS='junk'" in capsys.readouterr().err and not (tmp_path / "results").exists()


def test_a_hosts_counted_time_is_kept_beside_its_cpu_time() -> None:
    """CPU time moves in 10 ms ticks: the report shows a CPU time per call only where the counted work
    took long enough, so the count keeps how long that was (rank 0's reading of its host)."""
    c = _counter([[0, 1]], ["lo"], "loopback", 65536, None)
    sent = [1_000_000, 1_000_000]
    row = [2_002_000, 2_002_000, 0, 0, 0.01, 0.0, 40, 0]
    wc = c.summarise([row + [0.02, math.nan, 0.0], row + [0.03, math.nan, 0.0]], 3, sent, sent, 1 << 20)
    assert [h.counted_s for h in wc.hosts] == [0.02]
    assert [h.counted_s for h in c.summarise([row, row], 3, sent, sent, 1 << 20).hosts] == [None]
