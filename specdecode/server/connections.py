"""What uvicorn is given so that no client can hold the server: connection limits and a clean drain.

- :func:`guarded_protocol`: uvicorn's h11 protocol with a **request-head timeout** (a connection that
  has not sent a complete request head within ``header_timeout_s`` of connecting, or of its previous
  response, is closed: slowloris) and a **connection cap** (past ``max_connections`` open
  connections a new one is closed at once, so descriptors stay for real clients; logged once per
  interval). Reading the *body* is bounded by the app (``ServerConfig.body_timeout_s``).
- :class:`OncePerInterval`: the event loop's ``accept()`` errors (out of descriptors) logged once per
  interval with a count, not once per attempt.
- :class:`DrainingServer`: on SIGTERM, uvicorn stops accepting and lets in-flight requests finish;
  at ``graceful_timeout_s`` the app's ``drain`` answers every request still open with the 503 error
  (JSON, or an SSE error event then ``[DONE]``), and uvicorn's own deadline, a little later, finds
  nothing left to cut.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from dataclasses import dataclass
from typing import Callable

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("specdecode.server")

HEADER_TIMEOUT_S = 20.0
BODY_TIMEOUT_S = 60.0
DRAIN_SLACK_S = 5.0  # uvicorn's deadline comes this long after the app's: time to send the 503s
LOG_INTERVAL_S = 10.0


def default_max_connections() -> int:
    """Open connections allowed: the descriptor limit less a reserve for the process's own files
    (models, logs), at most 2048."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 2048
    return max(8, min(2048, soft - 64))


class OncePerInterval:
    """Log a repeated event once per ``interval_s`` (the first at once), with the count suppressed."""

    def __init__(
        self,
        message: str,
        interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ) -> None:
        self.message, self.interval_s, self.clock, self.logger = message, interval_s, clock, logger
        self._last: float | None = None
        self._suppressed = 0

    def __call__(self, detail: object = None) -> None:
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_s:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more in the last {now - self._last:.0f} s)" if self._suppressed else ""
        self.logger.warning("%s%s%s", self.message, f": {detail}" if detail is not None else "", more)
        self._last, self._suppressed = now, 0


def accept_error_handler(loop: asyncio.AbstractEventLoop) -> Callable[[asyncio.AbstractEventLoop, dict], None]:
    """An event-loop exception handler: ``accept()`` out of resources (EMFILE, ...) once per interval;
    anything else goes to the handler that was there before."""
    previous = loop.get_exception_handler()
    limited = OncePerInterval("accept() failed, out of system resources (new connections wait)")

    def handler(loop_: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") == "socket.accept() out of system resource":
            limited(context.get("exception"))
        elif previous is not None:
            previous(loop_, context)
        else:
            loop_.default_exception_handler(context)

    return handler


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = HEADER_TIMEOUT_S
    max_connections: int = 1024


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    refused = OncePerInterval(f"over {limits.max_connections} open connections (--max-connections): closing new ones")

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                refused()
                transport.close()  # connection_lost forgets it
                return
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a complete request head arrived
                self._disarm()

        def on_response_complete(self) -> None:
            self._arm()  # the next request's head (before: a pipelined one may disarm it at once)
            super().on_response_complete()

        def send_400_response(self, msg: str) -> None:
            """A request h11 cannot parse (malformed, or a head over h11's 16 KiB): OpenAI's error body,
            as every other error, instead of uvicorn's text/plain."""
            body = json.dumps(
                {
                    "error": {
                        "message": f"{msg} (malformed request or request head over 16 KiB)",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": "invalid_http_request",
                    }
                }
            ).encode()
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            for event in (
                h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
            self.transport.close()

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


def uvicorn_config(
    app,
    host: str = "127.0.0.1",
    port: int = 0,
    limits: ConnectionLimits = ConnectionLimits(),
    graceful_timeout_s: float = 60.0,
    log_level: str = "info",
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        http=guarded_protocol(limits),
        timeout_graceful_shutdown=graceful_timeout_s + DRAIN_SLACK_S,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn's server; at shutdown the app's ``state.drain(seconds)`` is given the graceful timeout
    (the config's, less :data:`DRAIN_SLACK_S`), and accept errors are logged once per interval."""

    async def startup(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(accept_error_handler(loop))
        await super().startup(sockets)

    async def shutdown(self, sockets=None) -> None:
        drain = getattr(getattr(self.config.loaded_app, "state", None), "drain", None)
        if drain is None:  # (loaded_app may be a middleware wrapper)
            drain = getattr(getattr(self.config.app, "state", None), "drain", None)
        if drain is not None:
            drain(max(0.0, self.config.timeout_graceful_shutdown - DRAIN_SLACK_S))
        await super().shutdown(sockets)
