"""Prometheus metrics of one server (its own registry, so several apps can live in one process).

Request-level counters and histograms are updated when a request leaves the server (finished,
aborted or failed), from the engine thread; speculation counters follow the conventions of
:mod:`specdecode.metrics` (the bonus/recovered token is emitted, not accepted). Gauges are read
live at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdecode.engine import Sequence


class FinishedRequest(Protocol):
    """What :meth:`ServerMetrics.finished` reads of a request (:class:`specdecode.server.scheduler.Handle`)."""

    seq: Sequence | None
    arrival: float
    first_token_at: float | None


class LiveState(Protocol):
    """What the gauges read live (:class:`specdecode.server.scheduler.Scheduler`)."""

    @property
    def speculation_enabled(self) -> bool: ...

    def state(self) -> Mapping[str, float]: ...


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        p = "specdecode_"
        self.http_requests = Counter(
            p + "http_requests", "HTTP requests by route and status code", ["route", "code"], registry=r
        )
        self.requests = Counter(
            p + "requests",
            "generation requests that left the server, by finish reason (stop, length, abort = client gone, error)",
            ["finish_reason"],
            registry=r,
        )
        self.rejected = Counter(
            p + "requests_rejected", "requests refused before queueing, by reason", ["reason"], registry=r
        )
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "generated tokens", registry=r)
        self.ttft = Histogram(
            p + "time_to_first_token_seconds", "arrival to first generated token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            p + "time_per_output_token_seconds",
            "mean time per token after the first, per request",
            buckets=TOKEN_TIME_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            p + "request_latency_seconds",
            "arrival to last token (finished requests)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            p + "queue_time_seconds",
            "arrival to the start of the request's prefill",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            p + "prefill_time_seconds",
            "the target's prefill of the prompt, first chunk's "
            "start to last chunk's end (the drafter catches up after the first token)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.step_time = Histogram(
            p + "step_seconds",
            "one engine step: a prefill chunk (if prompts wait) and a batched draft+verify",
            buckets=TOKEN_TIME_BUCKETS,
            registry=r,
        )
        self.spec_drafted = Counter(p + "spec_draft_tokens", "draft tokens verified by the target", registry=r)
        self.spec_accepted = Counter(p + "spec_accepted_tokens", "draft tokens accepted", registry=r)
        self.spec_steps = Counter(
            p + "spec_target_steps", "target verification steps (summed over sequences)", registry=r
        )
        self.spec_emitted = Counter(
            p + "spec_emitted_tokens",
            "tokens emitted by verification steps, including bonus/recovered tokens",
            registry=r,
        )
        self.spec_drafted_at = Counter(
            p + "spec_draft_tokens_at_position",
            "draft tokens verified, by 0-based position in the draft",
            ["position"],
            registry=r,
        )
        self.spec_accepted_at = Counter(
            p + "spec_accepted_tokens_at_position",
            "draft tokens accepted, by 0-based position in the draft",
            ["position"],
            registry=r,
        )
        self.spec_choices = Counter(
            p + "spec_choice_steps",
            "--draft-policy auto: target steps (summed over sequences) by the selector's choice, <drafter>:k<k> or off",
            ["choice"],
            registry=r,
        )
        self.draft_failures = Counter(
            p + "draft_failures",
            "drafter exceptions absorbed where a row failed alone (it fell back to target-only)",
            registry=r,
        )
        self.draft_retries = Counter(
            p + "draft_retries",
            "rows whose drafter call was retried alone after a call "
            "for several rows failed (the innocent ones keep drafting)",
            registry=r,
        )
        self.step_failures = Counter(p + "step_failures", "decoding steps that raised (their batch failed)", registry=r)
        self._gauges = {
            "queued": Gauge(p + "queue_depth", "requests waiting for a batch slot", registry=r),
            "running": Gauge(p + "running_requests", "sequences in the running batch", registry=r),
            "kv_slots_used": Gauge(p + "kv_slots_used", "target KV-cache slots holding a sequence", registry=r),
            "kv_tokens_used": Gauge(
                p + "kv_tokens_used", "target KV-cache positions holding valid entries", registry=r
            ),
            "draft_slots_used": Gauge(p + "draft_slots_used", "slots for which the drafter holds state", registry=r),
            "prefix_cache_bytes": Gauge(p + "prefix_cache_bytes", "memory the prefix cache holds", registry=r),
            "prefix_cache_draft_bytes": Gauge(
                p + "prefix_cache_draft_bytes",
                "memory the draft models' prefix caches hold (with prefix_cache_bytes: the --prefix-cache-mb budget)",
                registry=r,
            ),
            "prefix_cache_entries": Gauge(p + "prefix_cache_entries", "sequences the prefix cache holds", registry=r),
            "prefix_cache_evictions": Gauge(
                p + "prefix_cache_evictions", "prefix cache entries evicted for room (so far)", registry=r
            ),
            "prefix_cache_hit_rate": Gauge(
                p + "prefix_cache_hit_rate",
                "prompt tokens answered by the prefix cache / prompt tokens looked up",
                registry=r,
            ),
        }
        self.prefix_cache_hits = Counter(
            p + "prefix_cache_hit_tokens", "prompt tokens restored from the prefix cache, not computed", registry=r
        )
        self.speculation = Gauge(
            p + "speculation_enabled", "1 when the server drafts (a draft is loaded and speculation is on)", registry=r
        )

    def bind_state(self, scheduler: LiveState) -> None:
        for name, gauge in self._gauges.items():
            gauge.set_function(lambda name=name: scheduler.state()[name])
        self.speculation.set_function(lambda: float(scheduler.speculation_enabled))

    def finished(self, h: FinishedRequest, reason: str) -> None:
        self.requests.labels(reason).inc()
        seq = h.seq
        if seq is None:
            return
        now = time.perf_counter()
        n_out = len(seq.output_ids)
        self.prompt_tokens.inc(len(seq.prompt_ids))
        self.prefix_cache_hits.inc(seq.stats.prefill_cached)
        self.generation_tokens.inc(n_out)
        if h.first_token_at is not None:
            self.ttft.observe(h.first_token_at - h.arrival)
            if n_out > 1:
                self.tpot.observe((now - h.first_token_at) / (n_out - 1))
        if reason in ("stop", "length"):
            self.e2e.observe(now - h.arrival)
        s = seq.stats
        self.spec_drafted.inc(s.drafted)
        self.spec_accepted.inc(s.accepted)
        self.spec_steps.inc(s.target_steps)
        self.spec_emitted.inc(s.emitted)
        for j, (d, a) in enumerate(zip(s.drafted_at, s.accepted_at)):
            self.spec_drafted_at.labels(str(j)).inc(d)
            self.spec_accepted_at.labels(str(j)).inc(a)
        for choice, n in s.choices.items():
            self.spec_choices.labels(choice).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
