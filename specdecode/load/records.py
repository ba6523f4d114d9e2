"""Plain data recorded by a load run: one record per request, grouped by (endpoint, level)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

TokenSource = Literal["usage", "chunks"]


@dataclass
class RequestRecord:
    """What one streamed request did. Times are seconds; ``start_s`` is from the level's start.

    ``error`` is ``None`` for a completed request, else its kind: ``"http_<status>"``,
    ``"timeout"``, ``"connection"``, ``"stream_error"`` (an error event inside the stream),
    ``"bad_response"`` (unparsable data) or ``"incomplete_stream"`` (no ``[DONE]``).
    ``output_tokens`` comes from the final usage chunk when the server sends one
    (``token_source == "usage"``), else it is the number of content chunks (``"chunks"``).
    """

    index: int
    prompt_id: str
    kind: str
    max_tokens: int
    start_s: float
    latency_s: float | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    content_chunks: int = 0
    token_source: TokenSource = "chunks"
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache answered (when it says)
    text: str | None = None  # the streamed text, kept only for a session's next turn (not written out)
    speculation: dict[str, Any] | None = None
    server_timing: dict[str, float] | None = None  # from a specdecode server's usage: queue/prefill/TTFT seconds
    error: str | None = None
    error_detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """(latency - TTFT) / (output_tokens - 1); undefined for fewer than two tokens."""
        if self.latency_s is None or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class LevelRun:
    """All requests of one endpoint at one load level (a concurrency or a request rate)."""

    label: str
    level: float
    mode: str
    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float | None = None  # level start to its end (all done, time limit or Ctrl-C)
    issued: int = 0
    cancelled: int = 0  # in flight when the level's time limit hit (or on Ctrl-C)
    hit_time_limit: bool = False
    stopped_by: str | None = None  # which limit ended it: "duration" (the level's own) or "time_limit" (the run's)


@dataclass
class SweepResult:
    """A whole sweep; levels are in the order they ran (interleaved by endpoint)."""

    endpoints: dict[str, dict[str, Any]] = field(default_factory=dict)  # label -> url, model
    levels: list[LevelRun] = field(default_factory=list)
    skipped: list[tuple[str, float]] = field(default_factory=list)  # global time limit
    interrupted: bool = False

    @property
    def labels(self) -> list[str]:
        return list(self.endpoints)

    def runs_for(self, label: str) -> list[LevelRun]:
        return [run for run in self.levels if run.label == label]
