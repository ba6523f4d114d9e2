"""The engine loop: one thread owns the :class:`Engine`; requests reach it through a bounded queue.

Each loop iteration, between two batched steps:

1. queued requests are admitted into free slots, a fair share per request (nothing is computed: their
   prompts wait in the engine's ``prefilling`` list, in admission order). The ``n`` choices of one request
   are one *group* and count against one request's share: a free slot goes to the oldest queued choice of
   the group holding the fewest slots (:func:`fair_pick`; plain requests are groups of one, so they are
   first come, first served), and a group never holds more than ``max_batch_size - 1`` slots, so a request
   arriving while an ``n = 16`` request runs is admitted at the next step instead of after every choice;
2. requests whose client went away (while queued, while their prompt is prefilled, or while decoding)
   are dropped from the queue or aborted, so their slot and KV are free before the next step;
3. one engine step: a chunk of the waiting prompts' prefill — at most ``max_num_batched_tokens``
   tokens (or, if set, ``batched_tokens_per_seq`` per admitted request when that is more) less the running
   sequences' verify windows (never less than a quarter of it), the oldest
   prompt first — then one speculative step that advances every running sequence by its own
   accepted count; a prompt whose last chunk ran takes its first (target-only) step in the same
   engine step. A long prompt therefore never stalls the running streams for more than one chunk.

Results travel back to the asyncio side as immutable :class:`Update` objects through
``loop.call_soon_threadsafe`` into each request's ``asyncio.Queue``. Streaming requests get one
update per step that produced text; other requests only their final update.

The scheduler is what the HTTP app sees of the engine: its tokenizer, context length and grammar compiler,
and :meth:`Scheduler.submit`, which checks a request once (the engine's :meth:`~specdecode.engine.Engine.validate`)
and queues its choices. It writes nothing onto the engine: the server's engine is built for serving
(``first_token_from_target``, a step budget, ``isolate_drafter_faults``), and ``--no-speculation`` makes each
request's ``SamplingParams.speculation`` false.

Faults stay local: a drafter failure is absorbed (``isolate_drafter_faults``: the rows involved
are retried one by one, and only a row that fails alone decodes target-only); a failing prefill fails
that request; a failure of one row's sampling or text fails that request alone (``StepEvent.error``);
only a failure of the shared forward fails the requests in the batch, and the loop keeps serving. If the loop itself dies, every waiting request is failed and
``/health`` reports it; ``busy_since`` lets ``/health`` detect a step that never returns.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field, replace

from specdecode.engine import Engine, PrefillError, Sequence
from specdecode.logprobs import ReportedToken, TokenSpeller
from specdecode.sampling import SamplingParams
from specdecode.server.metrics import ServerMetrics
from specdecode.server.protocol import APIError, choice_params

log = logging.getLogger("specdecode.server")
PREFIX_CACHE_STATE = (
    "prefix_cache_bytes",
    "prefix_cache_draft_bytes",
    "prefix_cache_entries",
    "prefix_cache_evictions",
    "prefix_cache_hit_rate",
)


@dataclass(frozen=True)
class Update:
    text: str = ""  # new text (streaming), or the whole text (final update of a non-streaming request)
    finish_reason: str | None = None  # set on the final update
    completion_tokens: int = 0
    speculation: dict | None = None
    timing: dict | None = None  # queue, prefill and first-token times of the request (final update)
    cached_tokens: int = 0  # prompt tokens the prefix cache answered (final update; OpenAI's usage field)
    # the request's tokens' logprobs not sent before, spelled (None: it asked for none; specdecode.logprobs)
    logprobs: tuple[ReportedToken, ...] | None = None
    error: APIError | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(eq=False)
class Handle:
    """One request as the scheduler sees it; created and cancelled on the asyncio side."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    loop: asyncio.AbstractEventLoop
    group: str = ""  # the request an n > 1 choice belongs to (its share is that request's); "": its own
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    done: bool = False
    # engine-thread state
    seq: Sequence | None = None
    first_token_at: float | None = None
    logprobs_sent: int = 0  # entries of seq.logprobs already pushed

    def timing(self) -> dict[str, float | None]:
        """Seconds: queued from arrival until its prefill began, the prefill (first chunk's start to
        last chunk's end, steps of other requests in between included), arrival to first token."""
        seq = self.seq
        began, ended = (seq.prefill_began, seq.prefill_ended) if seq is not None else (None, None)
        return {
            "queue_time_s": None if began is None else began - self.arrival,
            "prefill_time_s": None if ended is None else ended - began,
            "time_to_first_token_s": None if self.first_token_at is None else self.first_token_at - self.arrival,
        }

    def push(self, update: Update) -> None:
        if update.final:
            self.done = True
        try:
            self.loop.call_soon_threadsafe(self.updates.put_nowait, update)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def speculation_summary(seq: Sequence, lossy_labels: dict | None = None) -> dict:
    """The response's ``speculation`` object; ``lossy_labels`` (engine.lossy) mark a LOSSY engine."""
    s = seq.stats
    lossy = {"lossy": True} | lossy_labels if lossy_labels else {}
    choices = {"choices": dict(s.choices)} if s.choices else {}  # --draft-policy auto: steps per choice
    return (
        lossy
        | {
            "drafted": s.drafted,
            "accepted": s.accepted,
            "acceptance_rate": s.acceptance_rate,
            "tokens_per_step": s.tokens_per_step,
            "target_steps": s.target_steps,
            "nodes": s.nodes,
        }
        | choices
    )


class QueueFull(Exception):
    pass


def group_cap(max_batch_size: int) -> int:
    """The most slots one request's choices hold at once: all but one (while there are two), so a later
    request always finds a slot within one step of arriving."""
    return max(1, max_batch_size - 1)


def fair_pick(queued: list[str], held: dict[str, int], cap: int) -> int | None:
    """The index in ``queued`` (the groups of the queued choices, oldest first) of the one a free slot goes
    to: of the groups holding fewer than ``cap`` slots (``held``), the one holding fewest, its oldest choice;
    None when every queued group is at its cap."""
    best: tuple[int, int] | None = None  # (slots held, index)
    for i, group in enumerate(queued):
        n = held.get(group, 0)
        if n < cap and (best is None or n < best[0]):
            best = (n, i)
            if n == 0:
                break
    return None if best is None else best[1]


def row_error() -> APIError:
    return APIError(500, "internal error while decoding this request", "server_error", code="internal_error")


class Scheduler:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_queue: int = 128, speculation: bool = True) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        # an engine built for serving (EngineConfig, as `specdecode serve` builds it): a request's first token
        # comes from the target's prefill and one target step, its drafter catching up after that, so
        # speculation never delays it; and each step carries at most a token budget (the running rows'
        # verify windows + a chunk of waiting prompts), so a long prompt neither stalls the running
        # sequences for more than one chunk nor keeps the engine busy once its client has left
        # and a drafter's failure makes the rows involved decode target-only instead of failing them
        settings = engine.settings
        if (
            not settings.first_token_from_target
            or settings.max_num_batched_tokens is None
            or not settings.isolate_drafter_faults
        ):
            raise ValueError(
                "the server needs an engine built for serving: first_token_from_target=True, a "
                "max_num_batched_tokens step budget and isolate_drafter_faults=True (EngineConfig / EngineSettings)"
            )
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.speculation = speculation  # False (--no-speculation): every request decodes target-only
        self._faults = (0, 0)  # the engine's drafter faults (failures, rows retried) already counted in metrics
        self._queue: collections.deque[Handle] = collections.deque()
        self._running: dict[int, Handle] = {}  # id(seq) -> handle
        self._cond = threading.Condition()
        self._stopping = False
        self._expired: APIError | None = None  # set at the drain deadline: every request gets it
        self._thread = threading.Thread(target=self._run, name="specdecode-engine", daemon=True)
        self.busy_since: float | None = None  # monotonic start of the engine call in progress
        self.dead: BaseException | None = None
        self._speller: TokenSpeller | None = None  # built when a request first asks for logprobs
        metrics.bind_state(self)

    # -- asyncio side ---------------------------------------------------------------------------
    @property
    def speculation_enabled(self) -> bool:
        return self.engine.drafter is not None and self.speculation

    @property
    def tokenizer(self):
        """The engine's tokenizer (the app encodes prompts with it, off the event loop)."""
        return self.engine.tokenizer

    @property
    def max_context(self) -> int:
        """Tokens a request's prompt and output may hold together."""
        return self.engine.max_context

    @property
    def grammars(self):
        """The tokenizer's grammar compiler (structured outputs), built on first use."""
        return self.engine.grammars

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, stream: bool, request_id: str, n: int = 1
    ) -> list[Handle]:
        """Check a request (:class:`~specdecode.engine.RequestError`: an empty prompt, an id outside the
        vocabulary, too long for the context, a grammar the engine refuses) and queue its ``n`` choices, all or
        none (:class:`QueueFull` past ``max_queue``). The checks are the request's, once: they do not depend on
        a choice's seed, the one thing the choices differ in (ids ``request_id``, ``request_id/1``, ...; their
        share of the slots is one request's)."""
        self.engine.validate(prompt_ids, params)
        if not self.speculation and params.speculation:
            params = replace(params, speculation=False)
        loop = asyncio.get_running_loop()
        handles = [
            Handle(request_id if i == 0 else f"{request_id}/{i}", prompt_ids, p, stream, loop, group=request_id)
            for i, p in enumerate(choice_params(params, n))
        ]
        with self._cond:
            if (e := self._expired) is not None:  # (a fresh exception per request: each gets raised)
                raise APIError(e.status, e.message, e.type, e.param, e.code, e.headers)
            if not self.alive() or self._stopping:
                raise APIError(503, "the engine is not running", "server_error", code="engine_unavailable")
            if len(self._queue) + len(handles) > self.max_queue:
                raise QueueFull
            self._queue.extend(handles)
            self._cond.notify()
        return handles

    def cancel(self, handle: Handle) -> None:
        if handle.done or handle.cancelled:
            return
        handle.cancelled = True
        if handle.seq is not None:  # in the batch: the engine skips its first step if its prefill is running
            handle.seq.cancelled = True
        with self._cond:
            # a request still waiting leaves the queue now, not at the end of the engine's current
            # call (a long prefill): queue depth and the 429 limit count only live requests
            queued = handle in self._queue
            if queued:
                self._queue.remove(handle)
            self._cond.notify()
        if queued:
            self.metrics.finished(handle, "abort")

    def expire(self, error: APIError) -> None:
        """From now on every request gets ``error`` (the drain deadline at shutdown): those queued or
        running are answered now, from the asyncio side, so a long engine call cannot delay it (the
        engine thread drops them at its next step), and later ones at once (``submit``; the engine
        thread answers any it admitted meanwhile)."""
        with self._cond:
            self._expired = error
            self._cond.notify()
        self._answer_all(error)

    def _answer_all(self, error: APIError) -> None:
        """Push ``error`` to every live request and mark it cancelled (either thread)."""
        with self._cond:
            handles = list(self._queue) + list(self._running.values())
        for h in handles:
            if h.done or h.cancelled:
                continue
            h.push(Update(error=error))
            h.cancelled = True
            if h.seq is not None:
                h.seq.cancelled = True

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._queue or self._running):
                        self._cond.wait()
                    if self._stopping:
                        break
                self._admit()
                if self._expired is not None:  # admitted while the deadline passed: answered too
                    self._answer_all(self._expired)
                self._reap_cancelled()  # after admission: a client gone during prefill never gets a step
                self._step()
        except BaseException as exc:  # noqa: BLE001 - report, fail everyone, and let /health say so
            log.exception("the engine loop died")
            self.dead = exc
        finally:
            self._fail_all(
                APIError(
                    503,
                    "the server is shutting down" if self.dead is None else "the engine stopped",
                    "server_error",
                    code="engine_unavailable",
                )
            )

    def _reap_cancelled(self) -> None:
        with self._cond:
            gone = [h for h in self._queue if h.cancelled]
            for h in gone:
                self._queue.remove(h)
        for h in gone:
            self.metrics.finished(h, "abort")
        for h in [h for h in self._running.values() if h.cancelled]:
            self._finish(h, "abort")

    def _admit(self) -> None:
        """Give queued requests free slots, a fair share per request (:func:`fair_pick`); their prompts are
        prefilled by the following steps, a chunk at a time."""
        batch: list[Handle] = []
        held = collections.Counter(h.group or h.request_id for h in self._running.values())
        cap = group_cap(self.engine.max_batch_size)
        with self._cond:
            free = self.engine.free_slots()
            while self._queue and len(batch) < free:
                i = fair_pick([h.group or h.request_id for h in self._queue], held, cap)
                if i is None:
                    break
                h = self._queue[i]
                del self._queue[i]
                if h.cancelled:
                    self.metrics.finished(h, "abort")
                    continue
                batch.append(h)
                held[h.group or h.request_id] += 1
        if not batch:
            return
        requests = [(h.prompt_ids, h.params, h.request_id) for h in batch]
        for h, seq in zip(batch, self.engine.admit(requests, checked=True)):  # (checked in submit)
            h.seq = seq
            self._running[id(seq)] = h

    def _step(self) -> None:
        engine = self.engine
        if not engine.running and not engine.prefilling:
            return
        waiting = [self._running[id(s)] for s in engine.prefilling]
        t0 = time.perf_counter()
        self.busy_since = time.monotonic()
        try:
            events = engine.step()
        except PrefillError as exc:  # those prompts only (the engine dropped them); the others step next time
            log.exception("prefill failed for %d request(s)", len(exc.seqs))
            for seq in exc.seqs:
                self._finish(
                    self._running[id(seq)],
                    "error",
                    APIError(500, "internal error during prefill", "server_error", code="internal_error"),
                )
            return
        except Exception:
            log.exception("engine step failed; failing the %d requests in the batch", len(self._running))
            self.metrics.step_failures.inc()
            error = APIError(500, "internal error during decoding", "server_error", code="internal_error")
            for h in list(self._running.values()):
                self._finish(h, "error", error)
            return
        finally:
            self.busy_since = None
            self._count_draft_faults()
        now = time.perf_counter()
        self.metrics.step_time.observe(now - t0)
        for h in waiting:  # whose prefill began or ended in this step
            seq = h.seq
            if seq.prefill_began is not None and seq.prefill_began >= t0:
                self.metrics.queue_time.observe(seq.prefill_began - h.arrival)
            if seq.prefill_ended is not None:
                self.metrics.prefill_time.observe(seq.prefill_ended - seq.prefill_began)
        for ev in events:
            h = self._running[id(ev.seq)]
            try:
                if ev.error is not None:  # this request alone failed in the step; the batch went on
                    log.error("request %s failed in a decoding step", h.request_id, exc_info=ev.error)
                    self._finish(h, "error", row_error())
                    continue
                if ev.new_token_ids and h.first_token_at is None:
                    h.first_token_at = now
                if ev.finished:
                    self._finish(h, ev.seq.finish_reason)
                elif h.stream:
                    text = ev.seq.text.delta()
                    logprobs = self._new_logprobs(h)
                    if text or logprobs:
                        h.push(Update(text=text, logprobs=logprobs))
            except Exception:  # its text or its response: this request fails, the loop serves on
                log.exception("request %s failed after its step", h.request_id)
                self._drop(h, row_error())

    def _finish(self, h: Handle, reason: str, error: APIError | None = None) -> None:
        """Leave the batch (aborting if still running) and send the final update."""
        seq = h.seq
        self._running.pop(id(seq), None)
        self.engine.abort(seq)  # no-op when the engine already released it
        self._count_draft_faults()  # (a drafter may fail to let go of the slot)
        self.metrics.finished(h, reason)
        if error is not None:
            h.push(Update(error=error))
        elif reason != "abort":
            text = seq.text.delta(final=True) if h.stream else seq.text.finish()
            h.push(
                Update(
                    text,
                    reason,
                    len(seq.output_ids),
                    speculation_summary(seq, self.engine.lossy),
                    h.timing(),
                    cached_tokens=seq.stats.prefill_cached,
                    logprobs=self._new_logprobs(h),
                )
            )

    def _new_logprobs(self, h: Handle) -> tuple[ReportedToken, ...] | None:
        """The request's token logprobs not pushed yet, spelled (each token id spelled once per server, in
        this thread); None when it asked for none. A stream gets each step's tokens with that step's text
        (text held back at a possible stop string follows later, its tokens' logprobs do not wait)."""
        entries = h.seq.logprobs
        if entries is None:
            return None
        if self._speller is None:
            self._speller = TokenSpeller(self.engine.tokenizer)
        new, h.logprobs_sent = entries[h.logprobs_sent :], len(entries)
        return tuple(self._speller.report(e) for e in new)

    def _drop(self, h: Handle, error: APIError) -> None:
        """``_finish`` with ``error``; if even that raises, forget the request and still answer it."""
        try:
            self._finish(h, "error", error)
        except Exception:
            log.exception("could not finish request %s cleanly", h.request_id)
            self._running.pop(id(h.seq), None)
            h.push(Update(error=error))

    def _count_draft_faults(self) -> None:
        """The drafter faults the engine absorbed since the last count, into the metrics."""
        failures, retries = self.engine.drafter_faults
        if failures > self._faults[0]:
            self.metrics.draft_failures.inc(failures - self._faults[0])
        if retries > self._faults[1]:
            self.metrics.draft_retries.inc(retries - self._faults[1])
        self._faults = (failures, retries)

    def _fail(self, h: Handle, error: APIError) -> None:
        self.metrics.finished(h, "error")
        h.push(Update(error=error))

    def _fail_all(self, error: APIError) -> None:
        with self._cond:
            queued, self._queue = list(self._queue), collections.deque()
        for h in queued:
            self._fail(h, error)
        for h in list(self._running.values()):
            self._drop(h, error)  # (the engine may be what broke; the client still gets its error)

    def state(self) -> dict[str, float]:
        """Batch and KV occupancy (read from other threads: a snapshot, not a transaction)."""
        running, prefilling = list(self.engine.running), list(self.engine.prefilling)
        return {
            "queued": len(self._queue),
            "running": len(running) + len(prefilling),
            "kv_slots_used": len(running) + len(prefilling),
            "kv_tokens_used": sum(len(s.token_ids) - 1 for s in running) + sum(s.prefilled for s in prefilling),
            "draft_slots_used": self.engine.draft_slots_used,
            **self.prefix_cache_state(),
        }

    def prefix_cache_state(self) -> dict[str, float]:
        """The prefix cache's size and counts (zeros when it is off)."""
        cache = self.engine.prefix_cache
        if cache is None:
            return dict.fromkeys(PREFIX_CACHE_STATE, 0.0)
        index = cache.index
        stats = index.stats
        return {
            "prefix_cache_bytes": float(index.nbytes),
            "prefix_cache_draft_bytes": float(self.engine.drafts.kept_bytes()),
            "prefix_cache_entries": float(len(index)),
            "prefix_cache_evictions": float(stats.evictions),
            "prefix_cache_hit_rate": stats.hit_rate,
        }
