"""Exact arithmetic of the load metrics on synthetic records (no server, no clock)."""

from __future__ import annotations

import numpy as np
import pytest

from specdecode.load.records import LevelRun, RequestRecord
from specdecode.load.stats import Slo, compare, crossover, distribution, median_ci, paired, summarize


def _record(
    ttft: float, latency: float, tokens: int, itl: list[float] | None = None, error: str | None = None, **extra: object
) -> RequestRecord:
    return RequestRecord(
        index=0,
        prompt_id="p",
        kind="chat",
        max_tokens=tokens,
        start_s=0.0,
        latency_s=latency,
        ttft_s=ttft,
        itl_s=itl or [],
        output_tokens=tokens,
        token_source="usage",
        error=error,
        **extra,
    )  # type: ignore[arg-type]


def test_distribution_uses_linear_interpolation() -> None:
    dist = distribution([4.0, 1.0, 3.0, 2.0])
    assert dist == pytest.approx({"p50": 2.5, "p90": 3.7, "p99": 3.97, "mean": 2.5})
    assert distribution([]) is None


def test_tpot_definition() -> None:
    assert _record(0.1, 1.0, 10).tpot_s == pytest.approx(0.1)  # (1.0 - 0.1) / 9
    assert _record(0.1, 1.0, 1).tpot_s is None
    assert _record(0.1, 1.0, 10, error="timeout").ok is False


def test_summarize_level() -> None:
    records = [
        _record(0.1, 1.0, 10, itl=[0.1, 0.2]),  # TPOT 0.1
        _record(0.3, 2.3, 21, itl=[0.4]),  # TPOT 0.1
        _record(0.2, 1.2, 5),  # TPOT 0.25
        _record(0.9, 1.0, 1),  # TPOT undefined
        _record(0.0, 0.5, 0, error="http_500"),
        _record(0.0, 0.5, 0, error="http_500"),
        _record(0.0, 9.0, 0, error="timeout"),
    ]
    run = LevelRun("A", 4, "closed", records=records, wall_s=2.0, issued=9, cancelled=2)
    summary = summarize(run, Slo(ttft_s=0.25, tpot_s=0.2))
    assert (summary.completed, summary.issued, summary.cancelled) == (4, 9, 2)
    assert summary.errors == {"http_500": 2, "timeout": 1}
    assert summary.request_throughput == pytest.approx(2.0)
    assert summary.output_throughput == pytest.approx(37 / 2.0)
    # SLO: rec0 ok, rec1 TTFT too slow, rec2 TPOT too slow, rec3 TTFT too slow.
    assert summary.goodput == pytest.approx(1 / 2.0)
    assert summary.ttft == pytest.approx(distribution([0.1, 0.3, 0.2, 0.9]))
    assert summary.tpot == pytest.approx(distribution([0.1, 0.1, 0.25]))
    assert summary.itl == pytest.approx(distribution([0.1, 0.2, 0.4]))
    assert summary.latency == pytest.approx(distribution([1.0, 2.3, 1.2, 1.0]))
    assert summary.token_source == {"usage": 4}
    assert summary.speculation is None
    assert summarize(run).goodput is None  # no SLO given


def test_slo_edge_cases() -> None:
    slo = Slo(ttft_s=0.5, tpot_s=0.05)
    assert slo.met(_record(0.5, 0.6, 1))  # at the target counts; no TPOT for one token
    assert not slo.met(_record(0.51, 0.6, 1))
    assert not Slo(ttft_s=1.0).met(_record(0.1, 0.2, 2, error="timeout"))


def test_speculation_totals() -> None:
    records = [
        _record(
            0.1, 1.0, 10, speculation={"drafted": 8, "accepted": 6, "acceptance_rate": 0.75, "tokens_per_step": 2.0}
        ),
        _record(
            0.1, 1.0, 30, speculation={"drafted": 12, "accepted": 4, "acceptance_rate": 1 / 3, "tokens_per_step": 3.0}
        ),
        _record(0.1, 1.0, 7),
    ]
    spec = summarize(LevelRun("B", 1, "closed", records=records, wall_s=1.0)).speculation
    assert spec is not None
    assert (spec["requests"], spec["drafted"], spec["accepted"]) == (2, 20, 10)
    assert spec["acceptance_rate"] == pytest.approx(0.5)
    assert spec["tokens_per_step"] == pytest.approx(40 / (10 / 2.0 + 30 / 3.0))


@pytest.mark.parametrize(
    "ratios, expected",
    [
        ([1.5, 1.2, 0.9, 0.8], 4),
        ([1.5, 1.2, 1.1, 1.01], None),
        ([0.8, 0.9, 1.1, 1.3], 4),
        ([None, 1.0, 1.2, 0.7], 8),
        ([1.0, 1.0, 1.0, 1.0], None),
    ],
)
def test_crossover(ratios: list[float | None], expected: float | None) -> None:
    assert crossover([1, 2, 4, 8], ratios) == expected


def test_compare_ratios_per_level() -> None:
    def level(label: str, concurrency: int, tokens: int, wall: float) -> LevelRun:
        recs = [_record(0.1, 1.0, tokens) for _ in range(concurrency)]
        return LevelRun(label, concurrency, "closed", records=recs, wall_s=wall, issued=concurrency)

    off = [summarize(level("off", c, 100, 1.0)) for c in (1, 2, 4)]
    on = [summarize(level("on", c, 100, w)) for c, w in ((1, 0.5), (2, 0.8), (4, 1.25))]
    comparison = compare(off, on)
    assert (comparison.baseline, comparison.candidate) == ("off", "on")
    assert comparison.levels == [1, 2, 4]
    assert comparison.ratios["output_throughput"] == pytest.approx([2.0, 1.25, 0.8])
    assert comparison.crossover["output_throughput"] == 4
    assert comparison.ratios["latency.p50"] == pytest.approx([1.0, 1.0, 1.0])
    assert comparison.crossover["latency.p50"] is None
    # the tail latencies chunked prefill trades: first token and the longest gaps between chunks
    stalls = compare(
        [summarize(LevelRun("a", 1, "closed", records=[_record(2.0, 9.0, 10, itl=[0.5, 8.0])], wall_s=9.0, issued=1))],
        [summarize(LevelRun("b", 1, "closed", records=[_record(3.0, 9.0, 10, itl=[1.0, 2.0])], wall_s=9.0, issued=1))],
    )
    assert stalls.ratios["ttft.p99"] == pytest.approx([1.5])
    assert stalls.ratios["itl.p99"] == pytest.approx([(1.0 + 0.99 * 1.0) / (0.5 + 0.99 * 7.5)])
    partial = compare(off, on[:2])  # the candidate never ran level 4
    assert partial.levels == [1, 2]


def test_paired_ratios_match_requests_by_plan_index_not_by_rank() -> None:
    # A mixed workload: short prompts (TTFT ~1 s) and long ones (~5 s). The candidate is 2 % slower on
    # every request, but its p50 lands on a long prompt where the baseline's lands on a short one (the
    # two sets differ by one request that the candidate did not finish): p50 / p50 says 1.6x, the
    # pairs say 1.02.
    def rec(index: int, ttft: float, error: str | None = None) -> RequestRecord:
        r = _record(ttft, ttft + 3.0, 4, error=error)
        r.index = index
        return r

    ttfts = [1.0, 5.0, 1.1, 5.1, 1.2, 5.2]
    base = LevelRun("off", 1, "closed", records=[rec(i, t) for i, t in enumerate(ttfts)], wall_s=30.0, issued=6)
    cand = LevelRun(
        "on",
        1,
        "closed",
        issued=6,
        wall_s=30.0,
        records=[rec(i, t * 1.02, error="http_500" if i == 0 else None) for i, t in enumerate(ttfts)],
    )
    cand.records.reverse()  # completion order does not matter, the index does
    ratio_of_p50 = (summarize(cand).metric("ttft.p50") or 0) / (summarize(base).metric("ttft.p50") or 1)
    assert ratio_of_p50 > 1.5  # the artefact the pairing removes
    pairs = paired(base, cand)
    assert pairs["n"] == 5  # request 0 failed on the candidate: no pair
    assert pairs["ttft"] == pytest.approx(1.02)
    assert pairs["latency"] == pytest.approx(float(np.median([(t * 1.02 + 3.0) / (t + 3.0) for t in ttfts[1:]])))
    assert pairs["tpot"] == pytest.approx(1.0)  # 3 s over 3 later tokens in both
    assert pairs["ttft_lo"] is None and pairs["ttft_hi"] is None  # 5 pairs: too few for a 95 % interval
    empty = paired(base, LevelRun("on", 1, "closed"))
    assert empty == {
        "n": 0.0,
        "ttft": None,
        "tpot": None,
        "latency": None,
        "ttft_lo": None,
        "ttft_hi": None,
        "tpot_lo": None,
        "tpot_hi": None,
        "latency_lo": None,
        "latency_hi": None,
    }


def test_paired_ratios_carry_the_order_statistic_interval_of_their_median() -> None:
    def rec(index: int, ttft: float) -> RequestRecord:
        r = _record(ttft, ttft + 3.0, 4)
        r.index = index
        return r

    base = LevelRun("off", 1, "closed", records=[rec(i, 1.0) for i in range(8)], wall_s=30.0, issued=8)
    factors = [0.9, 1.3, 1.0, 1.05, 0.95, 1.1, 1.2, 0.8]
    cand = LevelRun("on", 1, "closed", records=[rec(i, f) for i, f in enumerate(factors)], wall_s=30.0, issued=8)
    pairs = paired(base, cand)
    # n = 8: P(B <= 0) = 1/256 and P(B <= 1) = 9/256 (> 2.5 %): the 1st and 8th order statistics
    assert (pairs["ttft_lo"], pairs["ttft"], pairs["ttft_hi"]) == pytest.approx((0.8, 1.025, 1.3))


def test_median_ci_ranks_and_coverage() -> None:
    assert median_ci([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # P(B = 0) = 1/32 > 2.5 %: no interval at n = 5
    assert median_ci([6.0, 1.0, 5.0, 2.0, 4.0, 3.0]) == (1.0, 6.0)  # n = 6: the extremes (coverage 62/64)
    # n = 64: P(B <= 23) = 0.0184 <= 0.025 < P(B <= 24) = 0.0300: ranks 24 and 41
    x = list(range(1, 65))
    assert median_ci(x) == (24.0, 41.0)
    # coverage at least 95 % for a skewed law (log-normal ratios, true median 1.0), and not far above
    rng = np.random.default_rng(0)
    trials = [median_ci(np.exp(rng.normal(0.0, 0.3, size=40))) for _ in range(2000)]
    covered = np.mean([lo <= 1.0 <= hi for lo, hi in trials])
    assert 0.95 - 3 * np.sqrt(0.05 * 0.95 / 2000) <= covered <= 0.995
    # a negative control: a median 25 % off (about four standard errors here) is seldom inside
    shifted = np.mean([lo <= 1.25 <= hi for lo, hi in trials])
    assert shifted < 0.2
