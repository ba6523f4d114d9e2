"""Drive load levels against one or more endpoints: closed loop (fixed concurrency) or open loop
(Poisson arrivals at a request rate), bounded by a request count and a time limit per level and a
time limit for the whole sweep.

Every endpoint sees the same request plan (prompt order and output lengths, from ``seed``) and, in
open loop, the same arrival times at a given rate. With several endpoints the levels are interleaved
(A at level 1, B at level 1, A at level 2, ...) so that drift on the machine hits them alike. With
``rounds`` > 1 each level's plan is cut into that many consecutive slices and the endpoints alternate
slice by slice (A's first slice, B's first slice, A's second slice, ...): a long level then no longer
puts all of A's requests in one stretch of the machine's time and all of B's in the next.
``duration_s`` bounds each endpoint's level over all its slices: a slice runs until the endpoint has
spent the level's ``duration_s`` in all (a slow slice takes time from the later ones, rather than
being cut at an even share while time is left); once it is spent, that endpoint's later slices are
not issued. Request ``index`` is the plan's, so request ``i`` of every endpoint is the same prompt
(the report pairs them).

Sessions (``editor_replay``, ``chat_turns``: :mod:`specdecode.bench.sessions`) are units of the plan: a
session's requests go in order, each sent when the one before it ended (a chat turn carries the
endpoint's own earlier answers in its history), so a level's concurrency (closed loop) counts sessions
in flight and an open loop's arrivals start sessions. Slices (``rounds``) cut between sessions.

From Python: ``result = run_sweep(LoadConfig(targets=[Target("A", url)], prompts=...))``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Literal, Protocol

import httpx
import numpy as np

from specdecode.bench.prompts import Prompt
from specdecode.bench.sessions import needs_history, sessions, with_history
from specdecode.load.client import Target, first_model, make_client, stream_request
from specdecode.load.records import LevelRun, RequestRecord, SweepResult

DEFAULT_OUTPUT_LEN = 128

MAX_ENDPOINTS = 8  # one baseline and up to seven candidates


@dataclass
class LoadConfig:
    """A sweep. ``levels`` are concurrencies (closed loop) or requests per second (open loop).

    ``output_len`` is ``(low, high)``: each request's ``max_tokens`` is drawn uniformly from it
    (``(n, n)`` for a fixed length); ``None`` uses each prompt's ``max_new_tokens`` or
    :data:`DEFAULT_OUTPUT_LEN`. ``num_requests`` and ``duration_s`` bound each level;
    ``time_limit_s`` bounds the whole sweep (levels not started by then are skipped).
    """

    targets: list[Target]
    prompts: list[Prompt]
    mode: Literal["closed", "open"] = "closed"
    levels: list[float] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    num_requests: int = 100
    duration_s: float = 60.0
    time_limit_s: float = 3600.0
    rounds: int = 1
    output_len: tuple[int, int] | None = None
    request_timeout_s: float = 300.0
    api_key: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        labels = {t.label for t in self.targets}
        if not 1 <= len(self.targets) <= MAX_ENDPOINTS or len(labels) != len(self.targets):
            raise ValueError(f"need 1 to {MAX_ENDPOINTS} targets with distinct labels")
        if not self.prompts:
            raise ValueError("need at least one prompt")
        if self.mode not in ("closed", "open"):
            raise ValueError(f"mode must be 'closed' or 'open', got {self.mode!r}")
        if not self.levels or any(level <= 0 for level in self.levels):
            raise ValueError("levels must be positive")
        if self.mode == "closed" and any(level != int(level) for level in self.levels):
            raise ValueError("closed-loop levels are concurrencies and must be whole numbers")
        if self.num_requests < 1 or self.duration_s <= 0 or self.time_limit_s <= 0:
            raise ValueError("num_requests, duration_s and time_limit_s must be positive")
        if not 1 <= self.rounds <= self.num_requests:
            raise ValueError(
                f"rounds must be between 1 and the number of requests ({self.num_requests}), got {self.rounds}"
            )


class Progress(Protocol):
    """Receives progress events; the CLI shows them, tests ignore them."""

    def level_started(self, run: LevelRun, total: int) -> None: ...

    def request_done(self, run: LevelRun, record: RequestRecord) -> None: ...


class NoProgress:
    def level_started(self, run: LevelRun, total: int) -> None:
        pass

    def request_done(self, run: LevelRun, record: RequestRecord) -> None:
        pass


def run_sweep(config: LoadConfig, progress: Progress | None = None) -> SweepResult:
    """Run the sweep to completion. On Ctrl-C it returns what finished with ``interrupted`` set."""
    result = SweepResult()
    try:
        asyncio.run(run_sweep_async(config, result, progress or NoProgress()))
    except KeyboardInterrupt:
        result.interrupted = True
    return result


class _Stop:
    """Ctrl-C during a sweep. asyncio's own handler cancels the main task once, and that one
    cancellation can be swallowed: httpx closes a cancelled stream inside a shielded anyio cancel
    scope, and a native asyncio cancel that lands there is lost, so the workers went on issuing the
    rest of the plan (the cause of a test that hung at random under CPU load). Instead SIGINT sets a
    flag that every worker checks before each request, and cancels the running level's task."""

    def __init__(self, result: SweepResult) -> None:
        self.result = result
        self.level_task: asyncio.Task | None = None
        self.installed = False

    @property
    def requested(self) -> bool:
        return self.result.interrupted

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            loop.add_signal_handler(signal.SIGINT, self.trigger)
            self.installed = True

    def uninstall(self, loop: asyncio.AbstractEventLoop) -> None:
        import signal

        if self.installed:
            loop.remove_signal_handler(signal.SIGINT)
            self.installed = False

    def trigger(self) -> None:
        self.result.interrupted = True
        if self.level_task is not None:
            self.level_task.cancel()


async def run_sweep_async(config: LoadConfig, result: SweepResult, progress: Progress) -> None:
    """Fill ``result`` level by level, so that an interrupted sweep keeps what finished."""
    loop = asyncio.get_running_loop()
    stop = _Stop(result)
    stop.install(loop)
    try:
        await _sweep(config, result, progress, stop)
    finally:
        stop.uninstall(loop)


async def _sweep(config: LoadConfig, result: SweepResult, progress: Progress, stop: _Stop) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config.time_limit_s
    plan = plan_requests(config)
    async with AsyncExitStack() as stack:
        clients: dict[str, httpx.AsyncClient] = {}
        targets: list[Target] = []
        for target in config.targets:
            client = make_client(target.url, config.api_key, config.request_timeout_s)
            clients[target.label] = await stack.enter_async_context(client)
            if target.model is None:
                target = dataclasses.replace(target, model=await first_model(client))
            result.endpoints[target.label] = {"url": str(client.base_url), "model": target.model}
            targets.append(target)
        for level in config.levels:
            runs: dict[str, LevelRun] = {}
            for part, target in itertools.product(session_rounds(plan, config.rounds), targets):
                if stop.requested:
                    return
                run = runs.get(target.label)
                if run is None:
                    if loop.time() >= deadline:
                        if (target.label, level) not in result.skipped:
                            result.skipped.append((target.label, level))
                        continue
                    run = runs[target.label] = LevelRun(label=target.label, level=level, mode=config.mode)
                    result.levels.append(run)
                    progress.level_started(run, config.num_requests)
                elif run.hit_time_limit or loop.time() >= deadline:
                    continue  # its level's (or the run's) time is up: the later slices are not issued
                stop.level_task = asyncio.ensure_future(
                    run_level(clients[target.label], target, plan, config, run, deadline, progress, stop, part)
                )
                try:
                    await stop.level_task
                except asyncio.CancelledError:
                    if not stop.requested:  # not ours: pass it on
                        raise
                    return
                finally:
                    stop.level_task = None


def rounds(n: int, count: int) -> list[range]:
    """``n`` plan indices cut into ``count`` consecutive slices, as even as can be (earlier ones larger)."""
    size, extra = divmod(n, count)
    cuts = [0]
    for i in range(count):
        cuts.append(cuts[-1] + size + (1 if i < extra else 0))
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


async def run_level(
    client: httpx.AsyncClient,
    target: Target,
    plan: list[tuple[Prompt, int]],
    config: LoadConfig,
    run: LevelRun,
    deadline: float,
    progress: Progress,
    stop: _Stop | None = None,
    part: range | None = None,
) -> None:
    """Issue ``plan`` (the indices in ``part``; default all) at ``run.level`` until it is done, its time
    passes (``duration_s`` less what the run's earlier slices took), ``deadline``, or Ctrl-C. A
    ``run`` that already holds earlier slices is extended: its wall time adds up and its records'
    ``start_s`` go on from where the last slice ended."""
    loop = asyncio.get_running_loop()
    part = range(len(plan)) if part is None else part
    before = run.wall_s or 0.0
    t0 = time.perf_counter() - before
    own_end = loop.time() + max(0.0, config.duration_s - before)
    stop_at = min(own_end, deadline)

    async def one(unit: range) -> None:
        """A unit of the plan: one request, or a session's requests in order (each after the last)."""
        answers: list[str] = []
        for index in unit:
            prompt, max_tokens = plan[index]
            if needs_history(prompt):
                prompt = with_history(prompt, answers)
            run.issued += 1
            keep = index + 1 in unit and plan[index + 1][0].kind == "chat"  # a later turn needs this answer
            extra = {"keep_text": True} if keep else {}
            record = await stream_request(
                client, target, prompt, max_tokens, index, t0, config.request_timeout_s, **extra
            )
            run.records.append(record)
            progress.request_done(run, record)
            if not record.ok or stopping():
                return  # a session whose turn failed ends there: its later turns would lack their history
            answers.append(record.text or "")

    units = iter(plan_units(plan, part))

    def stopping() -> bool:
        return stop is not None and stop.requested

    async def worker() -> None:
        while not stopping() and (unit := next(units, None)) is not None:
            await one(unit)

    async def arrivals(group: asyncio.TaskGroup) -> None:
        times = arrival_times(run.level, len(plan), config.seed)
        start = time.perf_counter()
        for unit in units:
            await asyncio.sleep(max(0.0, start + times[unit.start] - times[part.start] - time.perf_counter()))
            if stopping():
                return
            group.create_task(one(unit))

    try:
        async with asyncio.timeout_at(stop_at), asyncio.TaskGroup() as group:
            if config.mode == "closed":
                for _ in range(int(run.level)):
                    group.create_task(worker())
            else:
                group.create_task(arrivals(group))
    except TimeoutError:
        run.hit_time_limit = True
        run.stopped_by = "time_limit" if deadline < own_end else "duration"
    finally:
        run.wall_s = time.perf_counter() - t0
        run.cancelled = run.issued - len(run.records)


def plan_requests(config: LoadConfig) -> list[tuple[Prompt, int]]:
    """``num_requests`` (prompt, max_tokens) pairs: prompts (sessions whole, in turn order) shuffled by
    ``seed``, then cycled; the last session may be cut short by ``num_requests``."""
    rng = random.Random(config.seed)
    units = sessions(list(config.prompts))
    rng.shuffle(units)
    prompts = [prompt for unit in units for prompt in unit]
    plan = []
    for index in range(config.num_requests):
        prompt = prompts[index % len(prompts)]
        if config.output_len is not None:
            max_tokens = rng.randint(*config.output_len)
        else:
            max_tokens = prompt.max_new_tokens or DEFAULT_OUTPUT_LEN
        plan.append((prompt, max_tokens))
    return plan


def plan_units(plan: list[tuple[Prompt, int]], part: range | None = None) -> list[range]:
    """The plan's indices (those in ``part``) as units that go in order: each session's consecutive
    requests (a new unit where the session changes or its turns start again), else one request each."""
    part = range(len(plan)) if part is None else part
    units: list[range] = []
    for index in part:
        prompt = plan[index][0]
        if units and index > part.start:
            last = plan[index - 1][0]
            if prompt.session is not None and prompt.session == last.session and prompt.turn > last.turn:
                units[-1] = range(units[-1].start, index + 1)
                continue
        units.append(range(index, index + 1))
    return units


def session_rounds(plan: list[tuple[Prompt, int]], count: int) -> list[range]:
    """:func:`rounds` of the plan, each cut moved forward to the next session boundary (a slice may
    then be empty, and is dropped)."""
    starts = {unit.start for unit in plan_units(plan)} | {len(plan)}
    cuts = [min(s for s in starts if s >= part.start) for part in rounds(len(plan), count)] + [len(plan)]
    return [range(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def arrival_times(rate: float, n: int, seed: int) -> list[float]:
    """Send times (s) of a Poisson process at ``rate`` per second; the first request goes at 0."""
    rng = np.random.default_rng([seed, int(rate * 1000)])
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()
