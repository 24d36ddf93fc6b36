"""The alpha-beta fit recovers known parameters; points are priced by the cost model."""

from __future__ import annotations

import random

import pytest

from commbench.bench import alphabeta
from commbench.bench.alphabeta import AlphaBeta, Point
from commbench.comm.costmodel import cost

ALPHA, BETA = 250e-6, 8e-9  # 250 us per step, 1/beta = 0.125 GB/s (a 1 Gbit/s link)


def _record(algorithm: str, world: int, size: int, time_s: float, collective: str = "all_reduce") -> dict:
    return {
        "type": "sweep",
        "collective": collective,
        "algorithm": algorithm,
        "resolved_algorithm": algorithm,
        "world_size": world,
        "size_bytes": size,
        "count": size // 4,
        "root": 0,
        "time_us": time_s * 1e6,
    }


def _synthetic(noise: float = 0.0, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for algorithm in ("naive", "ring"):
        for size in [1 << k for k in range(10, 27, 2)]:
            c = cost("all_reduce", algorithm, 4, size // 4, 4)
            t = c.time_s(ALPHA, BETA) * (1 + rng.uniform(-noise, noise))
            out.append(_record(algorithm, 4, size, t))
    return out


def test_fit_recovers_known_alpha_and_beta():
    model = alphabeta.fit(alphabeta.points(_synthetic()))
    assert model.alpha_s == pytest.approx(ALPHA, rel=1e-6)
    assert model.beta_s_per_byte == pytest.approx(BETA, rel=1e-6)
    assert model.gbps == pytest.approx(0.125)
    assert all(abs(r.error) < 1e-6 for r in alphabeta.compare(alphabeta.points(_synthetic()), model))


def test_fit_with_noise_stays_close_and_predicts_within_ten_percent():
    pts = alphabeta.points(_synthetic(noise=0.05, seed=3))
    model = alphabeta.fit(pts)
    assert model.alpha_s == pytest.approx(ALPHA, rel=0.15)
    assert model.beta_s_per_byte == pytest.approx(BETA, rel=0.05)
    rows = alphabeta.compare(pts, model)
    assert rows and all(r.size_bytes >= 1 << 20 for r in rows)
    assert all(abs(r.error) < 0.10 for r in rows)


def test_pure_bandwidth_data_fits_zero_alpha():
    pts = [
        Point(collective="x", algorithm="a", size_bytes=s, steps=2, critical_bytes=s, time_s=s * BETA)
        for s in (1 << 20, 1 << 22, 1 << 24)
    ]
    model = alphabeta.fit(pts)
    assert model.alpha_s == pytest.approx(0.0, abs=1e-9)
    assert model.beta_s_per_byte == pytest.approx(BETA, rel=1e-6)


def test_negative_latency_is_clamped_to_zero():
    # Times that fall faster than the bytes would need a negative alpha: the fit keeps alpha >= 0.
    pts = [
        Point(collective="x", algorithm="a", size_bytes=s, steps=1, critical_bytes=s, time_s=s * BETA - 1e-4)
        for s in (1 << 20, 1 << 22, 1 << 24)
    ]
    model = alphabeta.fit(pts)
    assert model.alpha_s == 0.0 and model.beta_s_per_byte > 0


def test_points_price_records_and_skip_what_the_model_cannot():
    records = [
        {"type": "header"},
        _record("ring", 4, 1 << 20, 0.01),
        _record("p2p", 4, 1 << 20, 0.008, collective="sendrecv"),
        _record("nosuch", 4, 1 << 20, 0.01),
    ]
    pts = alphabeta.points(records)
    assert [p.algorithm for p in pts] == ["ring", "limit"]
    ring = cost("all_reduce", "ring", 4, (1 << 18), 4)
    assert (pts[0].steps, pts[0].critical_bytes) == (ring.steps, ring.critical_bytes)
    assert (pts[1].steps, pts[1].critical_bytes) == (1, 1 << 20)


def test_the_limit_series_takes_one_step_per_segment_it_sends():
    """The limit was one step at any size: 64 MiB goes as 4 segments of the default 16 MiB, and
    p2p@64K sends 1 MiB as 16."""
    records = [
        _record("p2p", 2, 64 << 20, 0.5, collective="sendrecv"),
        _record("p2p@64K", 2, 1 << 20, 0.01, collective="sendrecv"),
        _record("p2p", 2, 4, 0.0001, collective="sendrecv"),
    ]
    pts = alphabeta.points(records)
    assert [(p.steps, p.critical_bytes) for p in pts] == [(4, 64 << 20), (16, 1 << 20), (1, 4)]


def test_a_series_with_its_own_segment_is_priced_with_it():
    """A pipelined broadcast takes n - 2 + segments steps: ring@64K at 4 ranks and 4 MiB is 66."""
    record = {**_record("ring@64K", 4, 4 << 20, 0.05, collective="broadcast"), "resolved_algorithm": "ring"}
    (point,) = alphabeta.points([record])
    priced = cost("broadcast", "ring", 4, 1 << 20, 4, segment_bytes=64 << 10)
    assert (point.steps, point.critical_bytes) == (priced.steps, priced.critical_bytes)
    assert point.steps == 66 and point.algorithm == "ring@64K"
    # an all_reduce's ring steps grow with its segments too: 2 (n - 1) x 4 at 4 ranks and 4 MiB
    ar = {**_record("ring@256K", 4, 4 << 20, 0.05), "resolved_algorithm": "ring"}
    assert alphabeta.points([ar])[0].steps == 2 * 3 * 4


def test_builtin_is_priced_as_the_records_backend_runs_it():
    """gloo's reduce_scatter is an allreduce of the whole array: 2 (n-1)/n of it on the busiest
    link, where a ring reduce-scatter carries (n-1)/n."""
    record = {**_record("builtin", 4, 4 << 20, 0.05, collective="reduce_scatter"), "backend": "gloo"}
    (point,) = alphabeta.points([record])
    assert point.critical_bytes == cost("all_reduce", "ring", 4, 1 << 20, 4).critical_bytes == 6 << 20
    (unsaid,) = alphabeta.points([{**record, "backend": "nccl"}])
    assert unsaid.critical_bytes == 3 << 20


def test_points_that_cannot_tell_alpha_from_beta_are_refused():
    """From 64 MiB at 4 ranks the ring's steps and the limit's each carry one 16 MiB segment: any
    split of the time fitted as well, and one was printed as measured (alpha 134 ms, 1/beta inf)."""
    records = []
    for size in (64 << 20, 128 << 20, 256 << 20):
        ring = cost("all_reduce", "ring", 4, size // 4, 4)
        records.append(_record("ring", 4, size, ring.time_s(ALPHA, BETA)))
        records.append(_record("p2p", 4, size, (size >> 24) * ALPHA + size * BETA, collective="sendrecv"))
    pts = alphabeta.points(records)
    assert {p.critical_bytes / p.steps for p in pts} == {16 << 20}
    with pytest.raises(ValueError, match="cannot be told apart: every point moves 16777216 B a step"):
        alphabeta.fit(pts)
    smaller = alphabeta.points(
        [*records, _record("ring", 4, 4 << 20, cost("all_reduce", "ring", 4, 1 << 20, 4).time_s(ALPHA, BETA))]
    )
    model = alphabeta.fit(smaller)  # a size below the segment separates them
    assert model.alpha_s == pytest.approx(ALPHA) and model.beta_s_per_byte == pytest.approx(BETA)
    bytes_only = [
        Point(collective="x", algorithm="a", size_bytes=s, steps=0, critical_bytes=s, time_s=s * BETA)
        for s in (1 << 20, 1 << 22)
    ]
    assert alphabeta.fit(bytes_only).beta_s_per_byte == pytest.approx(BETA)  # no steps: beta alone


def test_the_cluster_report_says_why_no_fit_was_made():
    """It left the fit out without a word."""
    from commbench.bench.cluster import ClusterConfig, Shaping, report

    records = [_record("p2p", 4, size, size * BETA, collective="sendrecv") for size in (64 << 20, 128 << 20)]
    config = ClusterConfig(hosts=4, shaping=Shaping(rate_bit=10**9), inner=("sweep",))
    text = report(config, [], records)
    assert "# alpha-beta fit not made: alpha and beta cannot be told apart" in text
    one = ClusterConfig(hosts=1, shaping=Shaping(rate_bit=10**9), inner=("sweep",))
    assert "# cluster: 1 host, links 1 Gbit/s" in report(one, [], [])  # was "1 hosts"


def test_points_skip_records_without_a_finite_time():
    good = _record("ring", 4, 1 << 20, 0.01)
    odd = [{**good, "time_us": t} for t in (float("nan"), float("inf"), None, "12", -1.0)]
    assert len(alphabeta.points([good, *odd])) == 1


def test_bad_input_raises_value_error():
    with pytest.raises(ValueError, match="at least 2 points"):
        alphabeta.fit(alphabeta.points(_synthetic())[:1])
    with pytest.raises(ValueError, match="time"):
        Point(collective="x", algorithm="a", size_bytes=1, steps=1, critical_bytes=1, time_s=0.0)
    with pytest.raises(ValueError, match="alpha_s"):
        AlphaBeta(alpha_s=-1.0, beta_s_per_byte=0.0, points=2)


def test_table_lists_each_point_with_its_error():
    pts = alphabeta.points(_synthetic())
    model = alphabeta.fit(pts)
    text = alphabeta.table(model, alphabeta.compare(pts, model))
    assert "alpha = 250.0 us per step" in text
    assert text.count("naive") == text.count("ring") == 4  # 1, 4, 16, 64 MiB


def test_fitted_points_left_out_of_the_rows_are_counted():
    """The fit's line counted the points under 1 MiB, and the rows left them out without a word."""
    pts = alphabeta.points(_synthetic())
    model = alphabeta.fit(pts)
    rows = alphabeta.compare(pts, model)
    small = sum(p.size_bytes < 1 << 20 for p in pts)
    assert small and len(rows) == model.points - small
    text = alphabeta.table(model, rows)
    assert (
        text.splitlines()[-1]
        == f"# {small} fitted point(s) under 1 MiB, where the steps set the time, not listed"
    )
    big = [p for p in pts if p.size_bytes >= 1 << 20]
    model = alphabeta.fit(big)
    assert "not listed" not in alphabeta.table(model, alphabeta.compare(big, model))


def test_a_fit_of_small_points_alone_gives_no_beta():
    small = [p for p in alphabeta.points(_synthetic()) if p.size_bytes < 1 << 20]  # 1 KiB to 256 KiB
    model = alphabeta.fit(small)
    text = alphabeta.table(model, alphabeta.compare(small, model))
    assert "us per step, beta not measured (no point of 1 MiB or more" in text
    assert "ns/B" not in text and text.count("\n") == 2  # the header lines and the count of the unlisted


def test_table_rows_carry_measured_predicted_and_error():
    model = alphabeta.fit(alphabeta.points(_synthetic()))
    rows = [
        alphabeta.Row(algorithm="ring", size_bytes=1 << 20, measured_us=1000.0, predicted_us=1100.0),
        alphabeta.Row(algorithm="naive", size_bytes=1 << 24, measured_us=2000.0, predicted_us=1500.0),
    ]
    body = [line.split() for line in alphabeta.table(model, rows).splitlines() if not line.startswith("#")]
    assert body == [
        ["ring", "1048576", "1000.0", "1100.0", "+10.0%"],
        ["naive", "16777216", "2000.0", "1500.0", "-25.0%"],
    ]
    noisy = alphabeta.points(_synthetic(noise=0.05, seed=3))
    compared = alphabeta.compare(noisy, model)
    lines = [
        line.split() for line in alphabeta.table(model, compared).splitlines() if not line.startswith("#")
    ]
    assert len(lines) == len(compared) and any(abs(r.error) > 0.005 for r in compared)
    for fields, r in zip(lines, compared, strict=True):
        assert fields[:2] == [r.algorithm, str(r.size_bytes)]
        assert float(fields[2]) == pytest.approx(r.measured_us, abs=0.05)
        assert float(fields[3]) == pytest.approx(r.predicted_us, abs=0.05)
        assert float(fields[4].rstrip("%")) == pytest.approx(100 * r.error, abs=0.05)


def test_one_rank_gives_no_points():
    """Nothing crosses a link at one rank: the collectives are priced 0 there, and the limit, a
    local copy, alone set alpha and beta ('1/beta = 7.1283 GB/s' on a 1 Gbit/s link)."""
    limit = {**_record("p2p", 1, 4 << 20, 0.0002, collective="sendrecv"), "resolved_algorithm": "p2p"}
    assert alphabeta.points([_record("ring", 1, 4 << 20, 0.0001), limit]) == []
    assert len(alphabeta.points([{**limit, "world_size": 2}])) == 1


def test_a_record_without_its_resolved_algorithm_is_priced_by_its_series():
    """'ring@256K' went to the cost model whole, which refused it, and the point was dropped."""
    record = _record("ring@256K", 4, 4 << 20, 0.05)
    del record["resolved_algorithm"]
    (point,) = alphabeta.points([record])
    assert point.steps == 2 * 3 * 4 and point.algorithm == "ring@256K"


def test_the_cluster_fits_only_points_beyond_a_links_burst():
    """A 256 KiB rd inside the shaper's 1,000,000-byte burst ran at 0.32 GB/s on a 0.125 GB/s link
    and took the fitted 1/beta to 0.19 GB/s."""
    from commbench.bench.cluster import _fit

    def point(size: int, steps: int, time_s: float) -> Point:
        return Point(collective="all_reduce", algorithm="rd", size_bytes=size, steps=steps,
                     critical_bytes=size, time_s=time_s)  # fmt: skip

    shaped = [point(s, 1, ALPHA + s * BETA) for s in (4 << 20, 16 << 20)] + [
        point(2 << 20, 8, 8 * ALPHA + (2 << 20) * BETA)
    ]
    fast = point(256 << 10, 1, ALPHA + (256 << 10) / 0.32e9)
    text = _fit([*shaped, fast], 1_000_000)
    assert "1/beta = 0.1250 GB/s" in text and "1 point(s) left out of the fit" in text, text
    assert "1/beta = 0.1250 GB/s" not in _fit([*shaped, fast], 100_000)
    assert _fit([fast, shaped[0]], 10 << 20).startswith("# alpha-beta fit not made: 0 point(s)")


def test_an_auto_record_is_priced_as_what_auto_ran():
    """A record of "auto" is priced by its resolved_algorithm, what ran, not by what auto would
    pick at its size: at 4 ranks and 4 MiB auto picks another algorithm, and one resolved to
    naive moves 2 (n - 1) x 4 MiB on the root's link in 2 (n - 1) steps."""
    size = 4 << 20
    by_size = cost("all_reduce", "auto", 4, size // 4, 4)
    assert by_size.critical_bytes != 2 * 3 * size  # auto's own pick prices differently here
    record = {**_record("auto", 4, size, 0.05), "resolved_algorithm": "naive"}
    (point,) = alphabeta.points([record])
    assert (point.steps, point.critical_bytes) == (2 * 3, 2 * 3 * size)
    assert point.algorithm == "auto"


def test_one_fitted_point_left_out_of_the_rows_is_counted():
    """A single point under 1 MiB is counted under the rows as well as several."""
    pts = [
        Point(collective="x", algorithm="a", size_bytes=s, steps=1, critical_bytes=s, time_s=ALPHA + s * BETA)
        for s in (256 << 10, 1 << 20, 4 << 20)
    ]
    model = alphabeta.fit(pts)
    rows = alphabeta.compare(pts, model)
    assert [r.size_bytes for r in rows] == [1 << 20, 4 << 20]
    text = alphabeta.table(model, rows)
    assert (
        text.splitlines()[-1] == "# 1 fitted point(s) under 1 MiB, where the steps set the time, not listed"
    )
