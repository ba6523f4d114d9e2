"""The OpenAI-compatible HTTP app: ``create_app(engine_or_factory, ServerConfig(...))``.

Routes: ``POST /v1/completions`` (fill-in-the-middle with ``suffix``: :mod:`specdecode.fim`),
``POST /v1/chat/completions`` (both with SSE streaming),
``GET /v1/models``, ``GET /health`` and ``GET /metrics``. Every route but those in
``ServerConfig.public_paths`` needs ``Authorization: Bearer <api key>`` when a key is set.
The request path is: Host (without an API key: loopback or ``allowed_hosts``) -> auth -> body (content
type, size, read timeout, JSON, nesting depth, valid Unicode) -> schema -> model name -> sampling
parameters -> a cheap length bound -> tokenization (in a worker thread: the event loop never waits
on another request's text) -> context check -> queue (429 when full) -> engine thread. Every error a
request causes is a 4xx with OpenAI's error body; a 500 is a server bug, logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hmac
import ipaddress
import json
import logging
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specdecode.engine import Engine, RequestError
from specdecode.fim import DEFAULT_FIM_STOP, FimTokens, FimUnsupported, fim_prompt, fim_tokens, stop_fields
from specdecode.grammar import GrammarCompiler, GrammarError, GrammarSpec
from specdecode.grammar_worker import SandboxClosed
from specdecode.logprobs import ReportedToken, text_offsets
from specdecode.server import protocol as P
from specdecode.server.connections import BODY_TIMEOUT_S
from specdecode.server.metrics import ServerMetrics
from specdecode.server.protocol import APIError
from specdecode.server.scheduler import Handle, QueueFull, Scheduler, Update

log = logging.getLogger("specdecode.server")
CLIENT_CLOSED = 499  # nginx's "client closed request"
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
MAX_JSON_DEPTH = 32  # nesting of the request body (the deepest valid request needs 5)
TOKENIZE_WORKERS = 2  # threads that tokenize and apply chat templates, off the event loop
GRAMMAR_WORKERS = 2  # threads that wait on the grammar sandbox and compile requests' matchers ahead
# (and as many for specs served before, which need no sandbox job: never queued behind new ones)
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class ServerConfig:
    model_name: str = "specdecode"
    api_key: str | None = None
    public_paths: tuple[str, ...] = ("/health",)  # the liveness allowlist: no API key needed
    max_queue: int = 128  # requests waiting for a batch slot; more get 429
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = BODY_TIMEOUT_S  # the whole body must arrive within this, else 408
    # Host headers served without an API key, besides loopback ones (DNS rebinding); "*" = any
    allowed_hosts: tuple[str, ...] = ()
    speculation: bool = True  # server-wide; a request can still opt out with "speculation": false
    wedge_timeout_s: float = 120.0  # /health fails when one engine call runs longer than this
    retry_after_s: int = 1
    completions_default_max_tokens: int = P.COMPLETIONS_DEFAULT_MAX_TOKENS


def create_app(engine: Engine | Callable[[], Engine], config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    metrics = ServerMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        eng = engine if isinstance(engine, Engine) else await asyncio.to_thread(engine)
        scheduler = Scheduler(eng, metrics, config.max_queue, config.speculation)
        app.state.scheduler = scheduler
        app.state.max_prompt_chars = await asyncio.to_thread(
            max_prompt_chars, scheduler.tokenizer, scheduler.max_context
        )
        app.state.tokenize_pool = ThreadPoolExecutor(TOKENIZE_WORKERS, thread_name_prefix="specdecode-tokenize")
        app.state.grammar_pool = ThreadPoolExecutor(GRAMMAR_WORKERS, thread_name_prefix="specdecode-grammar")
        app.state.known_grammar_pool = ThreadPoolExecutor(
            GRAMMAR_WORKERS, thread_name_prefix="specdecode-known-grammar"
        )
        app.state.grammars = await asyncio.to_thread(_build_grammars, scheduler)
        loop = asyncio.get_running_loop()

        def drain(seconds: float) -> None:  # at shutdown (connections.DrainingServer): then 503 to the rest
            loop.call_later(
                seconds,
                scheduler.expire,
                APIError(503, "the server is shutting down", "server_error", code="shutting_down"),
            )

        app.state.drain = drain
        scheduler.start()
        try:
            yield
        finally:
            app.state.tokenize_pool.shutdown(wait=False, cancel_futures=True)
            app.state.grammar_pool.shutdown(wait=False, cancel_futures=True)
            app.state.known_grammar_pool.shutdown(wait=False, cancel_futures=True)
            await asyncio.to_thread(scheduler.stop)
            await asyncio.to_thread(_close_grammars, scheduler)

    # no redirects: "/v1/completions/" is a 404 with the error body, not a 307 that clients would follow
    app = FastAPI(
        title="specdecode", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False
    )
    app.state.config, app.state.metrics = config, metrics
    app.add_middleware(_AuthAndCount, config=config, metrics=metrics)
    _install_error_handlers(app)

    @app.get("/health")
    async def health(request: Request) -> Response:
        problem = _health_problem(request.app.state.scheduler, config.wedge_timeout_s)
        if problem:
            return _error(APIError(503, problem, "server_error", code="unhealthy"))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": config.model_name, "object": "model", "created": 0, "owned_by": "specdecode"}],
        }

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = P.parse(P.CompletionRequest, await _read_json(request, config))
        _check_model(req.model, config)
        if (fim := P.fim_input(req)) is not None:  # fill-in-the-middle: the model's own FIM prompt
            prefix, suffix = fim
            _check_length(request, len(prefix) + len(suffix), "prompt")
            tokenizer = request.app.state.scheduler.tokenizer
            tokens = await _off_loop(request, _fim_tokens, request.app.state, tokenizer)
            params = P.sampling_params(
                req,
                req.max_tokens,
                config.completions_default_max_tokens,
                stop_fields(tokens, req.fim_stop or DEFAULT_FIM_STOP, prefix),
            )
            prompt_ids = await _off_loop(request, _encode_fim, tokenizer, prefix, suffix, tokens)
            return await _generate(request, req, prompt_ids, params, _CompletionFormat(config.model_name))
        prompt = P.prompt_input(req.prompt)
        params = P.sampling_params(req, req.max_tokens, config.completions_default_max_tokens)
        if isinstance(prompt, list):
            prompt_ids = prompt
        else:
            _check_length(request, len(prompt), "prompt")
            tokenizer = request.app.state.scheduler.tokenizer
            prompt_ids = await _off_loop(request, _encode, tokenizer, prompt)
        return await _generate(request, req, prompt_ids, params, _CompletionFormat(config.model_name))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = P.parse(P.ChatCompletionRequest, await _read_json(request, config))
        _check_model(req.model, config)
        messages = P.chat_messages(req)
        _check_length(request, sum(len(m["content"]) for m in messages), "messages")
        scheduler = request.app.state.scheduler
        prompt_ids = await _off_loop(request, _apply_chat_template, scheduler.tokenizer, messages)
        room = scheduler.max_context - len(prompt_ids)  # chat default: the rest of the context
        params = P.sampling_params(req, P.requested_max_tokens(req), max(room, 1))
        return await _generate(request, req, prompt_ids, params, _ChatFormat(config.model_name))

    return app


# -- request handling ---------------------------------------------------------------------------
async def _read_json(request: Request, config: ServerConfig) -> Any:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {content_type or 'none'!r}")
    limit = config.max_body_bytes
    too_big = APIError(413, f"request body exceeds {limit} bytes", code="body_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    body = bytearray()
    try:
        async with asyncio.timeout(config.body_timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_big
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {config.body_timeout_s:g} s",
            code="body_timeout",
            headers={"Connection": "close"},
        ) from None
    try:
        obj = json.loads(body)
    except ValueError as exc:  # includes bad UTF-8
        raise P.bad_request(f"malformed JSON body: {exc}", code="invalid_json") from None
    except RecursionError:
        raise P.bad_request(
            f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid_json"
        ) from None
    _check_json(obj)
    return obj


def _check_json(obj: Any) -> None:
    """Nesting depth and valid Unicode (a lone surrogate such as \\ud800 is valid JSON but no text a
    tokenizer can encode), walked without recursion."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise P.bad_request(
                    "the request holds a lone UTF-16 surrogate (\\ud800-\\udfff): not valid Unicode",
                    code="invalid_unicode",
                )
            continue
        if not isinstance(value, (list, dict)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise P.bad_request(f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid_json")
        if isinstance(value, dict):
            stack.extend((k, depth) for k in value)
            value = value.values()
        stack.extend((v, depth + 1) for v in value if isinstance(v, (str, list, dict)))


def max_prompt_chars(tokenizer, max_context: int) -> int:
    """Characters past which a text cannot fit the context whatever it says: no token spells more
    characters than the longest vocabulary entry (added tokens included; byte-level entries spell
    bytes, at least one each), with a factor 4 for normalisers that shrink text (NFKC)."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return 4 * max(longest, 1) * max_context


def _check_length(request: Request, chars: int, param: str) -> None:
    """Refuse a text that cannot fit before spending anything on tokenizing it."""
    limit = request.app.state.max_prompt_chars
    if chars > limit:
        raise P.bad_request(
            f"the {param} has {chars} characters, more than can fit the context of "
            f"{request.app.state.scheduler.max_context} tokens (at most {limit})",
            param,
            "context_length_exceeded",
        )


async def _off_loop(request: Request, fn, *args):
    """Tokenizing and templating in a worker thread: a long text never stalls other requests' streams."""
    return await asyncio.get_running_loop().run_in_executor(request.app.state.tokenize_pool, fn, *args)


def _encode(tokenizer, text: str) -> list[int]:
    try:
        return tokenizer(text).input_ids
    except Exception as exc:  # the text is the request's: e.g. characters the tokenizer cannot take
        raise P.bad_request(f"the tokenizer could not encode the prompt: {exc}", "prompt") from None


def _fim_tokens(state, tokenizer) -> FimTokens:
    """The model's FIM tokens (looked up once; a model without them: 400 with what was looked for)."""
    found = getattr(state, "fim_tokens", None)
    if found is None:
        try:
            found = fim_tokens(tokenizer)
        except FimUnsupported as exc:
            found = exc
        state.fim_tokens = found
    if isinstance(found, FimUnsupported):
        raise P.bad_request(str(found), "suffix", "fim_unsupported")
    return found


def _encode_fim(tokenizer, prefix: str, suffix: str, tokens: FimTokens) -> list[int]:
    try:
        return fim_prompt(tokenizer, prefix, suffix, tokens)
    except Exception as exc:  # the text is the request's: e.g. characters the tokenizer cannot take
        raise P.bad_request(f"the tokenizer could not encode the prompt or suffix: {exc}", "prompt") from None


def _build_grammars(scheduler: Scheduler) -> GrammarCompiler | None:
    """The tokenizer's grammar compiler and its sandbox child, at startup (seconds for a 150k-token
    vocabulary: not on the first structured request's time to first token). A tokenizer it cannot serve
    answers those requests 400. Every new spec is compiled first in the sandbox (a crash there costs the
    child, never the server: :mod:`specdecode.grammar_worker`)."""
    try:
        grammars = scheduler.grammars
    except Exception as exc:
        log.warning("structured outputs unavailable for this tokenizer: %s", exc)
        return None
    try:
        grammars.start_sandbox()
    except Exception as exc:  # e.g. no process can be started here: specs compile in-process, bounds still hold
        log.warning("the grammar sandbox did not start (%s); new specs compile in the server's process", exc)
    return grammars


def _close_grammars(scheduler: Scheduler) -> None:
    with contextlib.suppress(Exception):
        scheduler.grammars.close()


def _prepare_grammar(scheduler: Scheduler, spec: GrammarSpec, n: int) -> None:
    """Validate the spec (sandbox, bounds) and compile the request's ``n`` matchers with their first
    masks here, in a grammar thread, so that the engine thread only takes them."""
    try:
        scheduler.grammars.prepare(spec, n)
    except GrammarError as exc:  # the engine's own words about the schema, regex or grammar, or the bound
        raise P.bad_request(str(exc), P.grammar_param(spec), "invalid_grammar") from None
    except SandboxClosed:  # the server is shutting down: the sandbox starts no new child
        raise APIError(503, "the server is shutting down", "server_error", code="shutting_down") from None


def _check_model(name: str | None, config: ServerConfig) -> None:
    if name is not None and name != config.model_name:
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {config.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _apply_chat_template(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise P.bad_request("this model has no chat template; use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids
    except Exception as exc:  # template errors (e.g. "roles must alternate") are the request's fault
        raise P.bad_request(f"the chat template rejected these messages: {exc}", "messages") from None


async def _generate(request: Request, req: P.SamplingFields, prompt_ids: list[int], params, fmt) -> Response:
    scheduler: Scheduler = request.app.state.scheduler
    config: ServerConfig = request.app.state.config
    n = P.choices(req)
    if params.grammar is not None:  # validated and compiled off the event loop and off the engine thread
        state = request.app.state  # a spec served before needs no sandbox job: its own threads
        known = state.grammars is not None and state.grammars.known(params.grammar)
        pool = state.known_grammar_pool if known else state.grammar_pool
        await asyncio.get_running_loop().run_in_executor(pool, _prepare_grammar, scheduler, params.grammar, n)
    rid = fmt.new_id()
    try:  # n choices: n requests of their own (ids rid/1, rid/2, ... inside; the response says rid)
        handles = scheduler.submit(prompt_ids, params, req.stream, rid, n)
    except RequestError as exc:  # an empty prompt, an id outside the vocabulary, or too long
        too_long = exc.param is None and len(prompt_ids) + params.max_new_tokens > scheduler.max_context
        raise P.bad_request(
            str(exc), None if too_long else (exc.param or "prompt"), "context_length_exceeded" if too_long else None
        ) from None
    except QueueFull:
        request.app.state.metrics.rejected.labels("queue_full").inc()
        raise APIError(
            429,
            "the server is at capacity (request queue full); retry later",
            "rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(config.retry_after_s)},
        ) from None
    if req.stream:
        return StreamingResponse(
            _stream(scheduler, handles, rid, fmt, len(prompt_ids), req.include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    updates = await _final_updates(request, scheduler, handles)
    if updates is None:
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it; keeps the 5xx count honest
    errors = [u.error for u in updates if u is not None and u.error is not None]
    if errors:  # a failed choice's own error (the unfinished ones were cancelled because of it)
        raise errors[0]
    return JSONResponse(fmt.response(rid, updates, len(prompt_ids)))


async def _final_updates(request: Request, scheduler: Scheduler, handles: list[Handle]) -> list[Update | None] | None:
    """Wait for every choice's result; ``None`` (and every choice cancelled) if the client disconnects first.
    As soon as one fails the others are cancelled and stand as ``None`` in the list."""
    waiters = [asyncio.ensure_future(h.updates.get()) for h in handles]
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        pending = set(waiters)
        while pending:
            done, _ = await asyncio.wait(pending | {gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                return None
            pending -= done
            if any(w.result().error is not None for w in done):
                break
        return [w.result() if w.done() else None for w in waiters]
    finally:
        for w in waiters:
            w.cancel()
        gone.cancel()
        for h in handles:
            scheduler.cancel(h)  # no-op once finished


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _stream(scheduler: Scheduler, handles: list[Handle], rid: str, fmt, prompt_tokens: int, include_usage: bool):
    """SSE events, every choice's chunks as they come (each carries its ``index``); Starlette cancels this
    generator when the client disconnects. An error in any choice ends the stream (the others cancelled)."""
    fmts = [fmt.for_choice(i) for i in range(len(handles))]
    merged: asyncio.Queue = asyncio.Queue()

    async def forward(i: int, handle: Handle) -> None:
        while True:
            update = await handle.updates.get()
            await merged.put((i, update))
            if update.final:
                return

    tasks = [asyncio.ensure_future(forward(i, h)) for i, h in enumerate(handles)]
    finals: dict[int, Update] = {}
    try:
        for f in fmts:
            if (first := f.stream_start(rid)) is not None:
                yield _sse(first)
        while len(finals) < len(handles):
            i, update = await merged.get()
            if update.error is not None:
                yield _sse(update.error.body())
                break
            if not update.final:
                yield _sse(fmts[i].chunk(rid, update.text, logprobs=update.logprobs))
                continue
            finals[i] = update
            last = fmts[i].chunk(rid, update.text, update.finish_reason, update.logprobs)
            if len(finals) < len(handles):
                yield _sse(last)
                continue
            ordered = [finals[k] for k in range(len(handles))]
            if include_usage:
                yield _sse(last)
                last = fmt.chunk(rid, None) | {"usage": _usage(prompt_tokens, ordered)}
            yield _sse(last | {"speculation": _speculation(ordered)})
    except Exception:  # a bug here must still end the stream properly
        log.exception("streaming failed for request %s", rid)
        yield _sse(APIError(500, "internal error while streaming", "server_error", code="internal_error").body())
    finally:
        for t in tasks:
            t.cancel()
        for h in handles:
            scheduler.cancel(h)
    yield "data: [DONE]\n\n"


def _usage(prompt_tokens: int, updates: list[Update]) -> dict:
    """OpenAI's token counts (the prompt once, every choice's completion tokens), extended with the
    request's server-side times (seconds from arrival, of choice 0: ``queue_time_s``, ``prefill_time_s``,
    ``time_to_first_token_s``)."""
    completion = sum(u.completion_tokens for u in updates)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": updates[0].cached_tokens},  # from the prefix cache
        **(updates[0].timing or {}),
    }


def _speculation(updates: list[Update]) -> dict | None:
    """The response's ``speculation`` object: a choice's own, or the choices' counts summed (rates of the sums)."""
    if len(updates) == 1 or any(u.speculation is None for u in updates):
        return updates[0].speculation
    specs = [u.speculation for u in updates]
    out = dict(specs[0])
    for key in ("drafted", "accepted", "target_steps", "nodes"):
        out[key] = sum(sp.get(key) or 0 for sp in specs)
    out["acceptance_rate"] = out["accepted"] / out["drafted"] if out["drafted"] else None
    emitted = sum(u.completion_tokens for u in updates)
    out["tokens_per_step"] = emitted / out["target_steps"] if out["target_steps"] else None
    if any("choices" in sp for sp in specs):
        counts: dict = {}
        for sp in specs:
            for name, steps in (sp.get("choices") or {}).items():
                counts[name] = counts.get(name, 0) + steps
        out["choices"] = counts
    return out


class _CompletionFormat:
    object = "text_completion"

    def __init__(self, model: str) -> None:
        self.model, self.created = model, int(time.time())
        self._offsets = None  # the text offsets' running decoder (specdecode.logprobs.text_offsets)

    def new_id(self) -> str:
        return f"cmpl-{uuid.uuid4().hex}"

    index = 0  # the choice this format's chunks belong to (for_choice)

    def for_choice(self, index: int) -> "_CompletionFormat":
        """This format for choice ``index`` of a request (its own running state: text offsets)."""
        other = copy.copy(self)
        other.index, other._offsets = index, None
        return other

    def _envelope(self, rid: str, choices: list) -> dict[str, Any]:
        return {"id": rid, "object": self.object, "created": self.created, "model": self.model, "choices": choices}

    def _choice(self, index: int, u: Update) -> dict[str, Any]:
        return {
            "index": index,
            "text": u.text,
            "logprobs": self.for_choice(index).logprobs(u.logprobs),
            "finish_reason": u.finish_reason,
        }

    def response(self, rid: str, updates: list[Update], prompt_tokens: int) -> dict[str, Any]:
        return self._envelope(rid, [self._choice(i, u) for i, u in enumerate(updates)]) | {
            "usage": _usage(prompt_tokens, updates),
            "speculation": _speculation(updates),
        }

    def stream_start(self, rid: str) -> dict[str, Any] | None:
        return None

    def chunk(
        self,
        rid: str,
        text: str | None,
        finish_reason: str | None = None,
        logprobs: tuple[ReportedToken, ...] | None = None,
    ) -> dict[str, Any]:
        if text is None:  # the usage-only chunk
            return self._envelope(rid, [])
        return self._envelope(
            rid,
            [{"index": self.index, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}],
        )

    def logprobs(self, tokens: tuple[ReportedToken, ...] | None) -> dict[str, Any] | None:
        """OpenAI's legacy completions object; ``text_offset``: characters of the completion's text before
        each token, continued across a stream's chunks; ``top_logprobs`` holds the chosen token too."""
        if tokens is None:
            return None
        offsets, self._offsets = text_offsets(list(tokens), self._offsets)
        return {
            "tokens": [t.spelling.token for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{s.token: v for s, v in t.top} | {t.spelling.token: t.logprob} for t in tokens],
            "text_offset": offsets,
        }


class _ChatFormat(_CompletionFormat):
    object = "chat.completion"

    def new_id(self) -> str:
        return f"chatcmpl-{uuid.uuid4().hex}"

    def _choice(self, index: int, u: Update) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": u.text},
            "logprobs": self.logprobs(u.logprobs),
            "finish_reason": u.finish_reason,
        }

    def stream_start(self, rid: str) -> dict[str, Any]:
        return self._chunk_envelope(
            rid,
            [
                {
                    "index": self.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        )

    def _chunk_envelope(self, rid: str, choices: list) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(
        self,
        rid: str,
        text: str | None,
        finish_reason: str | None = None,
        logprobs: tuple[ReportedToken, ...] | None = None,
    ) -> dict[str, Any]:
        if text is None:
            return self._chunk_envelope(rid, [])
        delta = {"content": text} if text or finish_reason is None else {}
        return self._chunk_envelope(
            rid,
            [
                {
                    "index": self.index,
                    "delta": delta,
                    "logprobs": self.logprobs(logprobs),
                    "finish_reason": finish_reason,
                }
            ],
        )

    def logprobs(self, tokens: tuple[ReportedToken, ...] | None) -> dict[str, Any] | None:
        """OpenAI's chat object: per token its text, value and UTF-8 bytes, and its ``top_logprobs``."""
        if tokens is None:
            return None

        def entry(s, value: float) -> dict[str, Any]:
            return {"token": s.token, "logprob": value, "bytes": list(s.bytes)}

        return {
            "content": [
                entry(t.spelling, t.logprob) | {"top_logprobs": [entry(s, v) for s, v in t.top]} for t in tokens
            ]
        }


# -- health, auth, errors -----------------------------------------------------------------------
def _health_problem(scheduler: Scheduler, wedge_timeout_s: float) -> str | None:
    if not scheduler.alive():
        return "the engine loop is not running"
    busy = scheduler.busy_since
    if busy is not None and time.monotonic() - busy > wedge_timeout_s:
        return f"the engine has been stuck in one step for over {wedge_timeout_s:g} s"
    return None


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: APIError) -> Response:
        return _error(exc)

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error(APIError(exc.status_code, str(exc.detail), code=kind))

    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=CLIENT_CLOSED)  # left while sending its body; nobody reads this

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(ClientDisconnect, client_gone)
    # any other exception is a bug: _AuthAndCount logs it once and answers 500 (an exception handler
    # for Exception would answer too, but Starlette then re-raises it and uvicorn logs it again)


def _host_name(host: str) -> str:
    """A Host header's (or an --allowed-hosts entry's) name: lower case, without port or IPv6 brackets."""
    name = host.strip().lower()
    if name.startswith("[") and "]" in name:
        return name[1 : name.index("]")]
    return name.rsplit(":", 1)[0] if name.count(":") == 1 else name


class _AuthAndCount:
    """ASGI middleware: without an API key, only loopback Host headers (or ``allowed_hosts``) on every
    non-public path, so a web page cannot reach a local server through DNS rebinding; with a key,
    the bearer-key check (constant time); per-route request counts by status code; and the one place
    an unexpected exception is logged and answered with 500. Pure ASGI, so streaming and disconnects
    pass through untouched."""

    def __init__(self, app, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.app, self.config, self.metrics = app, config, metrics
        self.key = config.api_key.encode() if config.api_key else None
        self.any_host = "*" in config.allowed_hosts
        self.hosts = {_host_name(h) for h in config.allowed_hosts}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in ROUTES else "other"
        status = 500

        async def counting_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        started = False

        async def guarded_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await counting_send(message)

        try:
            if path not in self.config.public_paths:
                if self.key is None and not self._host_allowed(scope):
                    return await _error(
                        APIError(
                            400,
                            "invalid Host header: without an API key this server answers only loopback hosts "
                            "(see --allowed-hosts)",
                            code="invalid_host",
                        )
                    )(scope, receive, counting_send)
                if self.key is not None and not self._authorized(scope):
                    response = _error(
                        APIError(
                            401,
                            "missing or invalid API key (send 'Authorization: Bearer <key>')",
                            code="invalid_api_key",
                        )
                    )
                    response.headers["WWW-Authenticate"] = "Bearer"
                    return await response(scope, receive, counting_send)
            await self.app(scope, receive, guarded_send)
        except Exception as exc:  # a bug: logged here, once, and answered if nothing was sent yet
            log.error("unhandled error on %s", path, exc_info=exc)
            if not started:
                await _error(APIError(500, "internal server error", "server_error", code="internal_error"))(
                    scope, receive, counting_send
                )
        finally:
            self.metrics.http_requests.labels(route, str(status)).inc()

    def _host_allowed(self, scope) -> bool:
        if self.any_host:
            return True
        host = next((v for k, v in scope["headers"] if k == b"host"), None)
        if host is None:  # HTTP/1.0 without Host: no browser sends that
            return True
        name = _host_name(host.decode("latin-1"))
        if name in self.hosts or name == "localhost" or name.endswith(".localhost"):
            return True
        try:
            return ipaddress.ip_address(name).is_loopback
        except ValueError:
            return False

    def _authorized(self, scope) -> bool:
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
        scheme, _, token = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
