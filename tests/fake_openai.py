"""A fake OpenAI-compatible streaming server with known timing, for load-generator tests.

Chunk ``k`` (0-based) of a response is sent ``first_token_s + k * token_interval_s`` after the
request arrived (an absolute schedule, so late wake-ups do not accumulate). Chat responses first
send an empty role chunk at once, which must not count as the first token. The prompt text (or
the last message) steers failures: ``status:NNN`` answers HTTP NNN, ``stream-error`` sends one
token then an error event, ``hang`` waits 30 s before anything. With ``hold_until = n`` no response
starts before ``n`` requests have arrived (an ordering, not a clock: only a client that sends
without waiting for answers gets any).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class Behaviour:
    """Timing and content of the fake's responses; ``bodies`` collects the requests received.

    ``slowdown_s`` is added to the token interval per other stream in flight, so throughput can
    peak at a chosen concurrency (as speculation does under load).
    """

    first_token_s: float = 0.05
    token_interval_s: float = 0.01
    slowdown_s: float = 0.0
    tokens_per_chunk: int = 1
    send_usage: bool = True
    speculation: dict[str, Any] | None = None
    hold_until: int = 0
    cached_tokens: int | None = None  # sent as usage.prompt_tokens_details.cached_tokens when set
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0


def make_app(behaviour: Behaviour) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def complete(request: Request, chat: bool) -> Any:
        arrived = time.perf_counter()
        body = await request.json()
        behaviour.bodies.append(body)
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        if text.startswith("status:"):
            status = int(text.split(":")[1])
            return JSONResponse({"error": {"message": "fake failure"}}, status_code=status)
        stream = _stream(behaviour, body, text, chat, arrived)
        return StreamingResponse(stream, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await complete(request, chat=True)

    return app


async def _stream(
    behaviour: Behaviour, body: dict[str, Any], text: str, chat: bool, arrived: float
) -> AsyncIterator[str]:
    def event(payload: object) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    def piece(content: str) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"content": content}} if chat else {"index": 0, "text": content}
        return {"choices": [choice]}

    while len(behaviour.bodies) < behaviour.hold_until:
        await asyncio.sleep(0.005)
    if chat:
        yield event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    if text == "hang":
        await asyncio.sleep(30)
    tokens = int(body["max_tokens"])
    n_chunks = -(-tokens // behaviour.tokens_per_chunk)
    due = arrived + behaviour.first_token_s
    behaviour.in_flight += 1
    try:
        for k in range(n_chunks):
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            size = min(behaviour.tokens_per_chunk, tokens - k * behaviour.tokens_per_chunk)
            yield event(piece("tok " * size))
            if text == "stream-error":
                yield event({"error": {"message": "boom", "type": "internal"}})
                return
            due += behaviour.token_interval_s + behaviour.slowdown_s * (behaviour.in_flight - 1)
    finally:
        behaviour.in_flight -= 1
    final: dict[str, Any] = {"choices": []}
    if behaviour.send_usage and body.get("stream_options", {}).get("include_usage"):
        final["usage"] = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}
        if behaviour.cached_tokens is not None:
            final["usage"]["prompt_tokens_details"] = {"cached_tokens": behaviour.cached_tokens}
    if behaviour.speculation is not None:
        final["speculation"] = behaviour.speculation
    yield event(final)
    yield "data: [DONE]\n\n"


class FakeServer:
    """``with FakeServer(Behaviour()) as server: server.url`` serves on 127.0.0.1, a free port."""

    def __init__(self, behaviour: Behaviour | None = None) -> None:
        self.behaviour = behaviour or Behaviour()
        config = uvicorn.Config(
            make_app(self.behaviour), log_level="warning", lifespan="off", timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 60  # generous (a busy machine); exits as soon as it is up
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def free_port() -> int:
    """A port nothing listens on (for connection-error tests)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
