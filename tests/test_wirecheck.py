"""Wire-byte arithmetic and link maxima: TCP framing overhead, tolerances per interconnect, ratios
with zero and impossible inputs, PCIe/NVLink ceilings and ImpossibleReading."""

from __future__ import annotations

import math

import pytest

from commbench.probes.links import ImpossibleReading, check_rate, nvlink_max_gbps, pcie_max_gbps
from commbench.probes.wirecheck import TOLERANCES, compare, expected_overhead, expected_ratio

MIB = 1 << 20


def test_expected_overhead_closed_form():
    assert expected_overhead(1500) == pytest.approx(1514 / 1448)
    assert expected_overhead(1500) == pytest.approx(1.05, abs=0.005)
    assert expected_overhead(65536) == pytest.approx(65550 / 65484)
    assert expected_overhead(65536) == pytest.approx(1.001, abs=0.0005)
    assert expected_overhead(9000) < expected_overhead(1500)
    for bad in (52, 0, -1, 1500.0, True):
        with pytest.raises(ValueError, match="MTU"):
            expected_overhead(bad)


def test_every_interconnect_has_a_tolerance_and_a_reason():
    assert set(TOLERANCES) == {"loopback", "ethernet", "pcie", "nvlink"}
    assert TOLERANCES["loopback"].relative == 0.02
    assert TOLERANCES["ethernet"].relative > TOLERANCES["loopback"].relative
    assert min(TOLERANCES["pcie"].relative, TOLERANCES["nvlink"].relative) > TOLERANCES["ethernet"].relative
    assert all(len(t.reason) > 40 for t in TOLERANCES.values())


def test_loopback_within_and_outside_two_percent():
    computed = 64 * MIB
    framed = round(computed * expected_overhead(65536))
    ok = compare(computed, framed + 5000, 5000, "loopback")
    assert ok.measured_bytes == framed and ok.ratio == pytest.approx(ok.expected_ratio, rel=1e-6)
    assert ok.within_tolerance and ok.flag is None
    edge = compare(computed, round(framed * 1.019), 0, "loopback")
    assert edge.within_tolerance
    off = compare(computed, round(framed * 1.03), 0, "loopback")
    assert not off.within_tolerance and "loopback" in off.flag and "1 MiB" not in off.flag
    low = compare(computed, round(framed * 0.97), 0, "loopback")
    assert not low.within_tolerance


def test_ethernet_uses_the_mtu_and_allows_for_acks():
    computed = 100 * MIB
    with_acks = round(computed * expected_overhead(1500) * 1.023)
    assert compare(computed, with_acks, 0, "ethernet", mtu=1500).within_tolerance
    jumbo = compare(computed, with_acks, 0, "ethernet", mtu=9000)
    assert jumbo.expected_ratio == pytest.approx(expected_overhead(9000))


def test_gpu_links_expect_payload_and_refuse_an_mtu():
    assert expected_ratio("nvlink") == expected_ratio("pcie") == 1.0
    assert compare(10 * MIB, round(10 * MIB * 1.067), 0, "nvlink").within_tolerance  # LL128 flags
    assert not compare(10 * MIB, 20 * MIB, 0, "nvlink").within_tolerance  # LL's 2x is not explained
    with pytest.raises(ValueError, match="MTU"):
        compare(MIB, MIB, 0, "pcie", mtu=1500)


def test_zero_computed_has_no_ratio():
    quiet = compare(0, 100, 100, "loopback")
    assert quiet.ratio is None and quiet.within_tolerance and quiet.flag is None
    noisy = compare(0, 5000, 100, "loopback")
    assert noisy.ratio is None and not noisy.within_tolerance and "nothing computed" in noisy.flag


def test_measured_below_baseline_is_flagged_impossible():
    c = compare(MIB, 100, 5000, "ethernet")
    assert c.measured_bytes == -4900 and c.ratio is None
    assert not c.within_tolerance and "impossible" in c.flag


def test_small_transfers_say_why_they_may_miss():
    c = compare(4096, 4096 * 2, 0, "loopback")
    assert not c.within_tolerance and "below 1 MiB" in c.flag


def test_the_tolerance_is_a_fraction_of_the_expected_ratio():
    """Ethernet allows 4% of the expected 1514/1448 either way, about 0.0418 in the ratio, not 0.04
    (a mutant taking the tolerance as an absolute difference went unnoticed): a ratio just inside
    want x 1.04 is within, just past it is flagged, and the same below."""
    computed = 100 * MIB
    want = 1514 / 1448  # MTU 1500: frame bytes over TCP payload bytes of a full segment
    tol = 0.04
    for side in (1, -1):
        inside = compare(computed, round(computed * want * (1 + side * tol * 0.999)), 0, "ethernet")
        assert inside.expected_ratio == pytest.approx(want) and inside.tolerance == tol
        assert abs(inside.ratio - want) > tol  # past an absolute 0.04, inside 4% of want
        assert inside.within_tolerance and inside.flag is None, side
        outside = compare(computed, round(computed * want * (1 + side * tol * 1.001)), 0, "ethernet")
        assert not outside.within_tolerance and "ethernet" in outside.flag, side


def test_one_mib_is_judged_without_the_small_transfer_note():
    """The note is for transfers below 1 MiB; one of exactly 1 MiB is judged as any larger one
    (a mutant adding the note at 1 MiB too went unnoticed)."""
    at = compare(MIB, 2 * MIB, 0, "loopback")
    assert not at.within_tolerance and "below 1 MiB" not in at.flag
    below = compare(MIB - 1, 2 * (MIB - 1), 0, "loopback")
    assert not below.within_tolerance and "below 1 MiB" in below.flag


def test_a_packet_count_below_its_baseline_is_taken_as_none():
    """Packets are counted less an idle baseline, which may come out negative: it is taken as no
    packets, so no framing is expected (ratio 1.0), never less than the payload. Taken as it is,
    -1000 packets at 1 MiB expected 1 - 1000 x 66 / 2^20, about 0.937, and flagged a measured
    ratio of exactly 1."""
    c = compare(MIB, MIB, 0, "loopback", packets=-1000)
    assert c.expected_ratio == 1.0
    assert c.ratio == 1.0 and c.within_tolerance and c.flag is None
    assert compare(MIB, MIB, 0, "loopback", packets=0).expected_ratio == 1.0
    # a positive count adds one link, IP and TCP header a packet: 14 + 20 + 20 + 12 bytes
    assert compare(MIB, MIB, 0, "loopback", packets=1000).expected_ratio == 1 + 1000 * 66 / MIB


@pytest.mark.parametrize(
    "args,needle",
    [
        ((-1, 0, 0, "loopback"), "computed_bytes"),
        ((1, -1, 0, "loopback"), "measured_bytes"),
        ((1, 1, -1, "loopback"), "baseline_bytes"),
        ((1.5, 1, 0, "loopback"), "computed_bytes"),
        ((1, 1, 0, "infiniband"), "unknown interconnect"),
    ],
)
def test_bad_inputs_raise(args, needle):
    with pytest.raises(ValueError, match=needle):
        compare(*args)


def test_pcie_maxima():
    assert pcie_max_gbps(3, 16) == pytest.approx(15.76)
    assert pcie_max_gbps(4, 16) == pytest.approx(31.504)
    assert pcie_max_gbps(5, 16) == pytest.approx(63.008)
    assert pcie_max_gbps(1, 1) == 0.25 and pcie_max_gbps(6, 1) == 7.563
    with pytest.raises(ValueError, match="generation"):
        pcie_max_gbps(7, 16)
    with pytest.raises(ValueError, match="width"):
        pcie_max_gbps(4, 3)


def test_nvlink_maxima():
    assert nvlink_max_gbps(18, 4) == 450.0  # H100 SXM: 18 links x 25 GB/s a direction
    assert nvlink_max_gbps(12, 3) == 300.0  # A100
    assert nvlink_max_gbps(4, 25.0) == 100.0  # per-link rate given directly
    for bad in ((0, 4), (18, 9), (18, -1.0), (18, True), (2.5, 4)):
        with pytest.raises(ValueError):
            nvlink_max_gbps(*bad)


def test_nvlink_maxima_of_the_first_and_fifth_generations():
    """The ends of the table: NVLink 5 (B200) carries 50 GB/s a link and direction, 18 links 900;
    NVLink 1 (P100) 20, 4 links 80."""
    assert nvlink_max_gbps(18, 5) == 900.0
    assert nvlink_max_gbps(4, 1) == 80.0


@pytest.mark.parametrize(
    ("links", "per_link", "needle"),
    [
        (True, 4, "links must be a positive whole number"),  # a bool is an int to Python, not a count
        (4, 0.0, "per-link GB/s must be a positive finite float"),
        (4, math.inf, "per-link GB/s must be a positive finite float"),
    ],
)
def test_nvlink_refuses_a_bool_count_and_a_zero_or_infinite_rate(links, per_link, needle):
    with pytest.raises(ValueError, match=needle):
        nvlink_max_gbps(links, per_link)


@pytest.mark.parametrize("measured", [math.nan, math.inf])
@pytest.mark.parametrize("max_gbps", [None, 31.5])
def test_a_byte_count_that_is_not_a_number_is_an_impossible_reading(measured, max_gbps):
    """NaN passes both the sign check and the comparison with the maximum, and infinity the sign
    check where no maximum is known: neither may come back as a rate."""
    with pytest.raises(ImpossibleReading, match="bytes measured"):
        check_rate(measured, 1.0, max_gbps)


def test_check_rate():
    assert check_rate(31.5e9, 1.0, pcie_max_gbps(4, 16)) == pytest.approx(31.5)
    assert check_rate(32.5e9, 1.0, pcie_max_gbps(4, 16)) == pytest.approx(32.5)  # within the 5% margin
    with pytest.raises(ImpossibleReading, match="exceeds"):
        check_rate(40e9, 1.0, pcie_max_gbps(4, 16), what="host->device")
    with pytest.raises(ImpossibleReading):
        check_rate(-1, 1.0, None)
    assert check_rate(1e12, 1.0, None) == 1000.0  # no known ceiling: no check
    with pytest.raises(ValueError, match="seconds"):
        check_rate(1, 0.0, 10.0)
    assert issubclass(ImpossibleReading, RuntimeError) and not issubclass(ImpossibleReading, ValueError)


def test_only_a_judged_flag_is_told_as_bytes_off_under_a_training_table():
    """compare and train printed '# wire bytes off: ... not judged: messages under 1 MiB' for every
    small-message epoch; a sweep printed none for such points."""
    from commbench.bench.train import wire_flag_lines

    small = "not judged: messages under 1 MiB, where per-message overhead dominates"
    epochs = [
        {"strategy": "naive", "epoch": 1, "wire_check": small},
        {"strategy": "ring", "epoch": 1, "wire_check": None},
        {"strategy": "ring", "epoch": 2, "wire_check": "measured/computed 1.2, expected 1.001"},
    ]
    assert (
        wire_flag_lines(epochs) == "# wire bytes off: ring epoch 2: measured/computed 1.2, expected 1.001\n"
    )
