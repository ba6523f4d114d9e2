"""One timed, streamed request against an OpenAI-compatible endpoint.

Chat prompts go to ``/v1/chat/completions`` (``messages``), completion prompts to
``/v1/completions`` (``prompt``); a fill-in-the-middle prompt (the ``fim`` workload) adds OpenAI's
``suffix`` field, and its editor rule as ``"stop": ["\\n"]`` where the rule is ``line`` (the portable
spelling; the ``block`` rule has none), or, for a target with ``fim_stop`` set, as specdecode's own
``fim_stop`` field (exact for both rules; other servers may refuse the field); with ``fim_markers`` the
prefix and suffix go as one prompt in prefix-suffix-middle order instead (for servers that ignore ``suffix``). Always with
``stream: true`` and ``stream_options: {"include_usage": true}``. Server-sent ``data:`` lines are read
until ``[DONE]``. A *content chunk* is a chunk whose first choice carries non-empty text
(``text`` for completions, ``delta.content`` or ``delta.reasoning_content`` for chat); TTFT and
inter-token latencies are measured on content chunks. A top-level ``"speculation"`` object on any
chunk (our server puts it on the last one) is kept as reported.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from specdecode.bench.prompts import Prompt
from specdecode.load.records import RequestRecord


class LoadError(RuntimeError):
    """The load run cannot start (e.g. the endpoint lists no model)."""


@dataclass(frozen=True)
class Target:
    """One endpoint configuration: where to send, which model, what extra request fields; ``fim_stop``:
    send a FIM prompt's editor rule as specdecode's ``fim_stop`` field (else as OpenAI's ``stop``);
    ``response_format``: send a prompt's ``response_format`` (structured output, e.g. ``json_extract``)."""

    label: str
    url: str
    model: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    fim_stop: bool = False
    response_format: bool = True
    # a FIM prompt sent as one prompt with these markers (prefix, suffix, middle) instead of OpenAI's suffix
    fim_markers: tuple[str, str, str] | None = None


def base_url(url: str) -> str:
    """``http://host:port``, ``.../`` and ``.../v1`` all mean the same server."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def make_client(url: str, api_key: str | None, timeout_s: float) -> httpx.AsyncClient:
    """A client bound to one server; ``trust_env=False`` so no proxy or netrc is ever consulted."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=base_url(url),
        headers=headers,
        timeout=httpx.Timeout(timeout_s),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,
    )


async def first_model(client: httpx.AsyncClient) -> str:
    """The first model listed by ``GET /v1/models``."""
    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise LoadError(
            f"could not read a model name from {client.base_url}/v1/models ({type(exc).__name__}: {exc}); pass --model"
        ) from exc


def request_body(target: Target, prompt: Prompt, max_tokens: int) -> tuple[str, dict[str, Any]]:
    """The path and JSON body for one prompt; ``target.extra_body`` overrides the defaults."""
    body: dict[str, Any] = {"model": target.model, "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
    if prompt.kind == "chat":
        path, body["messages"] = "/v1/chat/completions", prompt.messages
    else:
        path, body["prompt"] = "/v1/completions", prompt.text
    if prompt.suffix is not None and target.fim_markers is not None:
        prefix, suffix, middle = target.fim_markers
        body["prompt"] = f"{prefix}{prompt.text}{suffix}{prompt.suffix}{middle}"
        if prompt.fim_stop == "line":
            body["stop"] = ["\n"]
    elif prompt.suffix is not None:
        body["suffix"] = prompt.suffix
        if target.fim_stop and prompt.fim_stop:
            body["fim_stop"] = prompt.fim_stop
        elif not target.fim_stop and prompt.fim_stop == "line":
            body["stop"] = ["\n"]
    if prompt.response_format is not None and target.response_format:
        body["response_format"] = prompt.response_format
    body.update(target.extra_body)
    body["stream"] = True
    return path, body


async def stream_request(
    client: httpx.AsyncClient,
    target: Target,
    prompt: Prompt,
    max_tokens: int,
    index: int,
    level_t0: float,
    timeout_s: float,
    keep_text: bool = False,
) -> RequestRecord:
    """Send one request and time it; never raises for server or network trouble. ``keep_text``: keep the
    streamed text in ``record.text`` (a session's next turn carries it in its history)."""
    path, body = request_body(target, prompt, max_tokens)
    t_start = time.perf_counter()
    record = RequestRecord(
        index=index, prompt_id=prompt.id, kind=prompt.kind, max_tokens=max_tokens, start_s=t_start - level_t0
    )
    if keep_text:
        record.text = ""
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    text = (await response.aread()).decode("utf-8", "replace")
                    _fail(record, f"http_{response.status_code}", text[:300], t_start)
                else:
                    await _read_stream(response, record, t_start)
    except (TimeoutError, httpx.TimeoutException) as exc:
        detail = f"no complete response within {timeout_s:g} s ({type(exc).__name__})"
        _fail(record, "timeout", detail, t_start)
    except httpx.TransportError as exc:
        _fail(record, "connection", f"{type(exc).__name__}: {exc}", t_start)
    return record


async def _read_stream(response: httpx.Response, record: RequestRecord, t_start: float) -> None:
    last_chunk: float | None = None
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, ": keep-alive" comments, "event:" lines
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            _finish(record, t_start)
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            _fail(record, "bad_response", f"not JSON: {data[:200]}", t_start)
            return
        if not isinstance(chunk, dict) or chunk.get("error") is not None:
            detail = chunk.get("error") if isinstance(chunk, dict) else chunk
            _fail(record, "stream_error", json.dumps(detail)[:300], t_start)
            return
        now = time.perf_counter()
        if _has_content(chunk):
            if record.text is not None:
                record.text += _content(chunk)
            if last_chunk is None:
                record.ttft_s = now - t_start
            else:
                record.itl_s.append(now - last_chunk)
            last_chunk = now
            record.content_chunks += 1
        _read_extras(chunk, record)
    _fail(record, "incomplete_stream", "stream ended without [DONE]", t_start)


def _has_content(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    delta = choice.get("delta") or {}
    return any(
        isinstance(t, str) and t for t in (choice.get("text"), delta.get("content"), delta.get("reasoning_content"))
    )


def _content(chunk: dict[str, Any]) -> str:
    choice = chunk["choices"][0]
    delta = choice.get("delta") or {}
    text = choice.get("text") if isinstance(choice.get("text"), str) else delta.get("content")
    return text if isinstance(text, str) else ""


SERVER_TIMING = ("queue_time_s", "prefill_time_s", "time_to_first_token_s")  # specdecode's usage extension


def _read_extras(chunk: dict[str, Any], record: RequestRecord) -> None:
    usage = chunk.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        record.output_tokens = usage["completion_tokens"]
        record.token_source = "usage"
        if isinstance(usage.get("prompt_tokens"), int):
            record.prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            record.cached_tokens = details["cached_tokens"]  # OpenAI's field: prompt tokens a cache answered
        timing = {k: float(usage[k]) for k in SERVER_TIMING if isinstance(usage.get(k), (int, float))}
        if timing:
            record.server_timing = timing
    timings = chunk.get("timings")  # llama-server's own: cache_n prompt tokens reused, prompt_n evaluated
    if isinstance(timings, dict) and isinstance(timings.get("cache_n"), int) and record.cached_tokens is None:
        record.cached_tokens = timings["cache_n"]
        if record.prompt_tokens is None and isinstance(timings.get("prompt_n"), int):
            record.prompt_tokens = timings["cache_n"] + timings["prompt_n"]
    if isinstance(chunk.get("speculation"), dict):
        record.speculation = chunk["speculation"]


def _finish(record: RequestRecord, t_start: float) -> None:
    record.latency_s = time.perf_counter() - t_start
    if record.token_source == "chunks":
        record.output_tokens = record.content_chunks


def _fail(record: RequestRecord, kind: str, detail: str, t_start: float) -> None:
    _finish(record, t_start)
    record.error, record.error_detail = kind, detail
