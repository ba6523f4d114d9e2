"""Per-level serving metrics and the two-endpoint comparison.

Definitions (also written into every report):

- **TTFT**: request start (just before the request is sent) to the first content chunk.
- **TPOT**: ``(latency - TTFT) / (output_tokens - 1)``; undefined for fewer than two tokens.
- **ITL**: the gaps between consecutive content chunks, pooled over all completed requests.
  With speculation one chunk may carry several tokens, so ITL can exceed TPOT.
- **Latency**: request start to ``[DONE]``.
- **Percentiles**: ``numpy.percentile`` with linear interpolation, over completed requests.
- **Throughput**: completed requests (or their output tokens) per second of the level's wall time,
  from its start until its last request ends (or its time limit cuts it).
- **Goodput**: completed requests that meet every given SLO (TTFT <= target, TPOT <= target; a
  request without a defined TPOT meets the TPOT target), per second of wall time.
- **Paired ratios**: request ``i`` of every endpoint is the same prompt with the same
  ``max_tokens``; for each request both endpoints completed, ``candidate / baseline`` of its TTFT,
  TPOT and latency, and the median of those ratios per level. Unlike a ratio of two p50s, it does
  not move when prompts of different lengths trade places around the middle of a mixed workload.
  Each median comes with a distribution-free 95 % confidence interval (order statistics of the
  ratios: the interval ``[r_(j), r_(n+1-j)]`` whose binomial(n, 1/2) coverage is at least 95 %;
  none below 6 pairs). It treats the pairs as independent draws, which requests sharing a server
  under concurrency only approximate: read it as the noise of the sample, not a proof.
- **Speculation**: summed ``drafted``/``accepted``; ``acceptance_rate = accepted / drafted``;
  ``tokens_per_step = sum(tokens) / sum(tokens / tokens_per_step)`` over reporting requests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specdecode.load.records import LevelRun, RequestRecord

QUANTILES = (50, 90, 99)
Distribution = dict[str, float]

# (metric, label, higher is better) compared as candidate / baseline.
RATIO_METRICS: tuple[tuple[str, str, bool], ...] = (
    ("output_throughput", "output tok/s", True),
    ("request_throughput", "requests/s", True),
    ("ttft.p50", "TTFT p50", False),
    ("ttft.p99", "TTFT p99", False),
    ("tpot.p50", "TPOT p50", False),
    ("itl.p99", "ITL p99", False),  # the stalls a long prompt's prefill causes (chunked prefill)
    ("latency.p50", "latency p50", False),
    ("latency.p99", "latency p99", False),
)


def distribution(values: Sequence[float]) -> Distribution | None:
    """p50/p90/p99 (linear interpolation) and mean, or ``None`` for no values."""
    if not values:
        return None
    arr = np.asarray(values, dtype=float)
    stats = {f"p{q}": float(np.percentile(arr, q)) for q in QUANTILES}
    stats["mean"] = float(arr.mean())
    return stats


@dataclass(frozen=True)
class Slo:
    """Service-level targets in seconds; ``None`` means no target."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None

    def met(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        if self.ttft_s is not None and (record.ttft_s is None or record.ttft_s > self.ttft_s):
            return False
        tpot = record.tpot_s
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s


@dataclass
class LevelSummary:
    """The metrics of one :class:`LevelRun`; see the module docstring for definitions."""

    label: str
    level: float
    wall_s: float
    issued: int
    completed: int
    cancelled: int
    errors: dict[str, int]
    request_throughput: float | None
    output_throughput: float | None
    goodput: float | None
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    latency: Distribution | None
    token_source: dict[str, int] = field(default_factory=dict)
    speculation: dict[str, Any] | None = None  # incl. "choices" (label -> steps) from a selector
    # the server's own view, where it reports one (specdecode serve): queue, prefill and TTFT seconds
    server_queue: Distribution | None = None
    server_prefill: Distribution | None = None
    server_ttft: Distribution | None = None
    # prompt tokens a prefix cache answered / prompt tokens, over requests whose server says both (None: none did)
    cached_share: float | None = None

    def metric(self, name: str) -> float | None:
        """A scalar by dotted name, e.g. ``"output_throughput"`` or ``"tpot.p50"``."""
        head, _, key = name.partition(".")
        value: Any = getattr(self, head)
        if key:
            value = None if value is None else value.get(key)
        return None if value is None else float(value)


def summarize(run: LevelRun, slo: Slo = Slo()) -> LevelSummary:
    """Aggregate one level's records."""
    done = [r for r in run.records if r.ok]
    wall = run.wall_s or 0.0

    def per_second(count: float) -> float | None:
        return count / wall if wall > 0 else None

    return LevelSummary(
        label=run.label,
        level=run.level,
        wall_s=wall,
        issued=run.issued,
        completed=len(done),
        cancelled=run.cancelled,
        errors=dict(Counter(r.error for r in run.records if r.error is not None)),
        request_throughput=per_second(len(done)),
        output_throughput=per_second(sum(r.output_tokens for r in done)),
        goodput=per_second(sum(slo.met(r) for r in done)) if slo.given else None,
        ttft=distribution([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=distribution([t for r in done if (t := r.tpot_s) is not None]),
        itl=distribution([gap for r in done for gap in r.itl_s]),
        latency=distribution([r.latency_s for r in done if r.latency_s is not None]),
        token_source=dict(Counter(r.token_source for r in done)),
        speculation=speculation_totals(done),
        server_queue=_server(done, "queue_time_s"),
        server_prefill=_server(done, "prefill_time_s"),
        server_ttft=_server(done, "time_to_first_token_s"),
        cached_share=cached_share(done),
    )


def cached_share(records: Sequence[RequestRecord]) -> float | None:
    """Prompt tokens the server's cache answered over all prompt tokens (requests that report both)."""
    pairs = [(r.cached_tokens, r.prompt_tokens) for r in records if r.cached_tokens is not None and r.prompt_tokens]
    total = sum(p for _, p in pairs)
    return sum(c for c, _ in pairs) / total if total else None


def _server(records: Sequence[RequestRecord], key: str) -> Distribution | None:
    return distribution([r.server_timing[key] for r in records if r.server_timing and key in r.server_timing])


def speculation_totals(records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """Server-reported speculation stats summed over requests, or ``None`` if none reported."""
    reports = [(r.output_tokens, r.speculation) for r in records if r.speculation]
    if not reports:
        return None
    drafted = sum(int(s.get("drafted", 0)) for _, s in reports)
    accepted = sum(int(s.get("accepted", 0)) for _, s in reports)
    steps = [(n, n / s["tokens_per_step"]) for n, s in reports if n > 0 and float(s.get("tokens_per_step") or 0) > 0]
    totals: dict[str, Any] = {"requests": len(reports), "drafted": drafted, "accepted": accepted}
    if drafted:
        totals["acceptance_rate"] = accepted / drafted
    if steps:
        totals["tokens_per_step"] = sum(n for n, _ in steps) / sum(k for _, k in steps)
    choices: dict[str, int] = {}  # a server's selector (--draft-policy auto): steps per choice
    for _, s in reports:
        for label, n in (s.get("choices") or {}).items() if isinstance(s.get("choices"), dict) else ():
            choices[str(label)] = choices.get(str(label), 0) + int(n)
    if choices:
        totals["choices"] = choices
    return totals


@dataclass
class Comparison:
    """``candidate / baseline`` ratios per level, and where each ratio first crosses 1.0."""

    baseline: str
    candidate: str
    levels: list[float]
    ratios: dict[str, list[float | None]]
    crossover: dict[str, float | None]
    # per level: median over same-index request pairs of candidate / baseline ("n": the pairs)
    paired: list[dict[str, float | None]] = field(default_factory=list)


def compare(baseline: Sequence[LevelSummary], candidate: Sequence[LevelSummary]) -> Comparison:
    """Compare two endpoints level by level (levels both of them finished)."""
    by_level = {s.level: s for s in candidate}
    pairs = [(a, by_level[a.level]) for a in baseline if a.level in by_level]
    levels = [a.level for a, _ in pairs]
    ratios = {name: [_ratio(b.metric(name), a.metric(name)) for a, b in pairs] for name, _, _ in RATIO_METRICS}
    return Comparison(
        baseline=baseline[0].label if baseline else "",
        candidate=candidate[0].label if candidate else "",
        levels=levels,
        ratios=ratios,
        crossover={name: crossover(levels, r) for name, r in ratios.items()},
    )


PAIRED_METRICS = (("ttft", "ttft_s"), ("tpot", "tpot_s"), ("latency", "latency_s"))


def median_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median of ``values`` (independent draws):
    ``[x_(j), x_(n+1-j)]`` of the sorted values, ``j`` the largest rank with
    ``P(Binomial(n, 1/2) < j) <= (1 - confidence) / 2``, so the interval covers the true median with
    probability at least ``confidence`` whatever the distribution. None when ``n`` is too small for
    any such interval (below 6 at 95 %)."""
    from scipy.stats import binom

    x = np.sort(np.asarray(values, dtype=float))
    n = len(x)
    j = 0
    while j + 1 <= n // 2 and binom.cdf(j, n, 0.5) <= (1 - confidence) / 2:
        j += 1  # P(B < j + 1) = P(B <= j) still within the tail: rank j + 1 is allowed
    if j == 0:
        return None
    return float(x[j - 1]), float(x[n - j])


def paired(baseline: LevelRun, candidate: LevelRun) -> dict[str, float | None]:
    """The median of ``candidate / baseline`` over the requests (same plan index: same prompt and
    ``max_tokens``) that both completed, for TTFT, TPOT and latency, each with its 95 % interval
    (``<name>_lo``, ``<name>_hi``: :func:`median_ci`; None below 6 pairs); ``n`` is the number of pairs."""
    theirs = {r.index: r for r in baseline.records if r.ok}
    pairs = [(theirs[r.index], r) for r in candidate.records if r.ok and r.index in theirs]
    out: dict[str, float | None] = {"n": float(len(pairs))}
    for name, attr in PAIRED_METRICS:
        ratios = [
            c / b
            for b, c in ((getattr(x, attr), getattr(y, attr)) for x, y in pairs)
            if b is not None and c is not None and b > 0
        ]
        out[name] = float(np.median(ratios)) if ratios else None
        ci = median_ci(ratios)
        out[f"{name}_lo"], out[f"{name}_hi"] = ci if ci is not None else (None, None)
    return out


def crossover(levels: Sequence[float], ratios: Sequence[float | None]) -> float | None:
    """The first level whose ratio lies on the other side of 1.0 than the first level's.

    Levels without a ratio, and ratios of exactly 1.0, neither start nor end a side.
    ``None`` means no crossover in the tested range.
    """
    side = 0.0
    for level, ratio in zip(levels, ratios):
        if ratio is None or ratio == 1.0:
            continue
        here = float(np.sign(ratio - 1.0))
        if side and here != side:
            return level
        side = side or here
    return None


def _ratio(candidate: float | None, baseline: float | None) -> float | None:
    if candidate is None or baseline is None or baseline == 0:
        return None
    return candidate / baseline
