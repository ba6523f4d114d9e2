"""The server as Ray Serve replicas: ``specdecode serve --replicas N`` and :func:`build_app` for a cluster.

Two deployments behind Ray Serve's HTTP proxy:

- :class:`Replica` (``N`` replicas): the single-process server as it is — :func:`~specdecode.server.app.create_app`
  over its own engine and scheduler — called in-process with each forwarded HTTP request, so routes, request
  and response models, streaming, errors and the API key are the single-process server's own. Every response
  carries ``x-specdecode-replica`` (the replica's Ray Serve id).
- :class:`Ingress` (``INGRESS_REPLICAS`` replicas, no CPU reserved): the Host/API-key check (the app's own
  middleware, so a refused request costs no replica call), the body read within the same size and time limits,
  a routing key from the prompt, then the request forwarded to a replica through a handle whose router is
  :class:`PrefixRouter`; ``GET /metrics`` is answered here with every replica's metrics aggregated
  (:func:`aggregate_metrics`). Every forwarded response carries ``x-specdecode-ingress`` too.

Routing (:func:`rank_replicas`, pure): a request with a prompt goes to the replica that a consistent-hash ring
gives for the first ``prefix_chars`` characters of its prompt (chat: the rendered messages), so requests sharing
a prefix meet the same replica; unless that replica holds more than ``imbalance`` requests beyond the least
loaded one, then the least loaded takes it. Requests without a prompt go to the less loaded of two. Load is
Ray Serve's count of requests a replica holds (queued, running or streaming).

Faults: a replica that dies (crash, ``ray.kill``, a lost node) fails its requests at the ingress with
``ActorDiedError``. A request of which nothing reached the client yet is sent once more (the router has dropped
the dead replica by then); one that fails again, or one already streaming, gets a clean error: a 503 body, or
an SSE error event and ``[DONE]``. Ray Serve restarts the replica. A replica stopped on purpose (scale-down,
redeploy, ``serve.shutdown``) first drains: no new requests, the running ones finish within
``graceful_shutdown_timeout_s`` (``--graceful-timeout``); any left then die with it, as in a crash.

An ingress replica that dies is not a single point of failure: there are two or more, and Ray Serve's proxy
routes new requests to a live one at once (its router drops a replica whose call fails with ``ActorDiedError``
and sends the request to another), while Ray Serve starts a replacement. The requests that were passing through
the dead one are lost with it: nothing in front of it but Ray's proxy, which answers a request that had no
response yet with its own ``500`` (text/plain) and closes a begun stream without an error event (no ingress
is left to write one). docs/replicas.md says the same.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import hashlib
import json
import logging
import math
import random
import signal
import sys
import threading
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from specdecode.config import EngineConfig, config_dict
from specdecode.server.app import ServerConfig, _AuthAndCount, create_app
from specdecode.server.protocol import APIError

log = logging.getLogger("specdecode.server")
APP_NAME = "specdecode"
REPLICA_HEADER = b"x-specdecode-replica"
INGRESS_HEADER = b"x-specdecode-ingress"
INGRESS_REPLICAS = 2  # one dead ingress leaves another serving while Ray Serve replaces it
INGRESS_NAME = "Ingress"
PREFIX_CHARS = 256  # characters of the prompt that pick its replica
IMBALANCE = 8  # requests a prefix's replica may hold beyond the least loaded one before the least loaded takes it
RING_POINTS = 64  # points per replica on the hash ring
RETRIES = 1  # times a request is sent again after its replica died, when nothing reached the client yet
METRICS_TIMEOUT_S = 10.0
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
NOT_SUMMED = frozenset({"specdecode_speculation_enabled"})  # gauges shown per replica: a sum means nothing
_REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)


# -- routing: pure ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    """What the router reads of a forwarded request (the first argument of :meth:`Replica.forward`)."""

    key: str | None = None  # the prompt's prefix: same key, same replica (load permitting)
    pin: str | None = None  # a replica id: that replica or none (metrics scrapes)


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


@lru_cache(maxsize=64)
def hash_ring(replica_ids: tuple[str, ...], points: int = RING_POINTS) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """A consistent-hash ring: ``points`` positions per replica, sorted; (positions, owner of each)."""
    ring = sorted((_hash(f"{rid}#{i}"), rid) for rid in replica_ids for i in range(points))
    return tuple(h for h, _ in ring), tuple(r for _, r in ring)


def ring_owner(replica_ids: Sequence[str], key: str) -> str:
    """The replica that owns ``key``: removing a replica moves only its own keys, adding one takes ~1/N."""
    positions, owners = hash_ring(tuple(sorted(replica_ids)))
    return owners[bisect.bisect(positions, _hash(key)) % len(owners)]


def rank_replicas(
    replica_ids: Sequence[str],
    route: Route,
    queue_lens: Mapping[str, int],
    imbalance: int = IMBALANCE,
    rng: random.Random | None = None,
) -> list[list[str]]:
    """Groups of replica ids to try in order (Ray Serve takes the least loaded that accepts in a group).

    ``queue_lens``: the requests each replica holds, where known (Ray Serve's cache; missing = unknown).
    """
    if not replica_ids:
        return []
    if route.pin is not None:
        return [[route.pin]] if route.pin in replica_ids else []
    if route.key is None:  # power of two choices
        return [list((rng or random).sample(list(replica_ids), min(2, len(replica_ids))))]
    owner = ring_owner(replica_ids, route.key)
    others = [r for r in replica_ids if r != owner]
    known = [queue_lens[r] for r in others if r in queue_lens]
    if owner in queue_lens and known and queue_lens[owner] - min(known) > imbalance:
        return [others, [owner]]
    return [[owner], others] if others else [[owner]]


def routing_key(path: str, body: bytes, prefix_chars: int = PREFIX_CHARS) -> str | None:
    """The first ``prefix_chars`` characters of a generation request's prompt (chat: role and content of each
    message, in order; token ids: as decimal text), or None (other routes, or a body that is no such request:
    the replica will say what is wrong with it)."""
    if path not in GENERATION_ROUTES:
        return None
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    text = _prompt_text(obj.get("messages") if path.endswith("chat/completions") else obj.get("prompt"))
    return text[:prefix_chars] or None


def _prompt_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return ",".join(map(str, value))
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, dict):  # chat messages
            return "".join(
                f"{m.get('role')}\x00{_prompt_text(m.get('content'))}\x00" for m in value if isinstance(m, dict)
            )
        return _prompt_text(first)  # a batch of one prompt
    return ""


# -- routing: the Ray Serve request router ----------------------------------------------------------
_ROUTERS: dict[tuple[str, str], "PrefixRouter"] = {}  # (app, deployment) -> the router of this process


class PrefixRouter(RequestRouter):
    """Ray Serve request router over :func:`rank_replicas` (set on the :class:`Replica` deployment).

    Ray Serve ships a router class pickled *by value* with its module, so each process gets a copy of this
    module's globals: the methods reach the real module (``Route``, the registry) through an import."""

    def initialize_state(self, imbalance: int = IMBALANCE, **_) -> None:
        from specdecode.server import replicas

        self.imbalance = imbalance
        replicas._ROUTERS[(self._deployment_id.app_name, self._deployment_id.name)] = self

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        from specdecode.server import replicas

        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        args = pending_request.args if pending_request is not None else ()
        route = args[0] if args and isinstance(args[0], replicas.Route) else replicas.Route()
        cache = self._replica_queue_len_cache
        queue_lens = {rid: n for rid, r in by_id.items() if (n := cache.get(r.replica_id)) is not None}
        ranked = replicas.rank_replicas(list(by_id), route, queue_lens, self.imbalance)
        if pending_request is not None:  # every replica was ranked: if none takes it, wait before asking again
            pending_request.routing_context.should_backoff = True
        return [[by_id[rid] for rid in group] for group in ranked]

    @staticmethod
    def replica_ids(app_name: str, deployment: str) -> list[str]:
        """The replicas this process's router currently routes to (none before the handle's first request)."""
        router = _ROUTERS.get((app_name, deployment))
        return [] if router is None else [rid.to_full_id_str() for rid in list(router.curr_replicas)]


# -- the replica --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HttpRequest:
    """An HTTP request as the ingress received it (body read in full, within the server's limits)."""

    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None


# what Replica.forward yields: (status and headers of the response, or None after the first item; body; more)
Chunk = tuple[tuple[int, list[tuple[bytes, bytes]]] | None, bytes, bool]


class Replica:
    """One engine + scheduler: the single-process app, served in-process to forwarded requests."""

    async def __init__(self, engine_factory: Callable[[], Any], config: ServerConfig) -> None:
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        self.app = create_app(engine_factory, config)
        self._tasks: set[asyncio.Task] = set()  # the app's calls in flight (held, so none is collected early)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # builds the engine (in a thread) and starts the scheduler

    async def forward(self, route: Route, request: HttpRequest) -> AsyncIterator[Chunk]:
        """The app's response to ``request``: the status and headers come with the first body chunk, so a
        JSON response is one item and "nothing sent yet" is "no item yet"; cancelled = client gone."""
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": "http",
            "path": request.path,
            "raw_path": request.path.encode(),
            "query_string": request.query_string,
            "root_path": "",
            "headers": list(request.headers),
            "client": request.client,
            "server": None,
            "state": {},
            "app": self.app,
        }
        outbox: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body = [request.body]

        async def receive() -> dict:
            if body:
                return {"type": "http.request", "body": body.pop(), "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def run() -> None:
            try:
                await self.app(scope, receive, outbox.put)
            finally:
                outbox.put_nowait(None)

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        head = None
        try:
            while (message := await outbox.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [*message.get("headers", []), (REPLICA_HEADER, self.replica_id.encode())]
                    head = (message["status"], headers)
                    continue
                if message["type"] != "http.response.body":
                    continue
                more = message.get("more_body", False)
                yield head, message.get("body", b""), more
                head = None
                if not more:
                    break
        finally:
            gone.set()  # the app sees the client leave: a queued or running request is cancelled

    def replica_metrics(self, route: Route) -> bytes:
        """This replica's Prometheus text (``route``: for the router, which pins the scrape here)."""
        return self.app.state.metrics.render()

    def check_health(self) -> None:
        """Ray Serve's health check: a dead engine loop restarts the replica (a wedged step does not:
        /health reports it, as in one process)."""
        if not self.app.state.scheduler.alive():
            raise RuntimeError("the engine loop is not running")

    async def __del__(self) -> None:
        """Called by Ray Serve once this replica, taken out of routing, holds no request: the engine thread
        stops. (Requests still running at ``graceful_shutdown_timeout_s`` die with the replica; the ingress
        treats them as after a crash.)"""
        await self._lifespan.__aexit__(None, None, None)


# -- the ingress --------------------------------------------------------------------------------------
class Ingress:
    """The HTTP entry: auth, body, routing key, forwarding with one retry, metrics aggregation."""

    def __init__(self, replicas, config: ServerConfig, prefix_chars: int = PREFIX_CHARS) -> None:
        self.replicas, self.config, self.prefix_chars = replicas, config, prefix_chars
        context = serve.get_replica_context()
        self.ingress_id, self.app_name = context.replica_id.to_full_id_str(), context.app_name
        self._ingresses = None  # a handle to the ingress replicas (the first /metrics scrape makes it)
        self.registry = CollectorRegistry()
        counter = Counter(
            "specdecode_ingress_http_requests",
            "HTTP requests the ingress answered or forwarded, by route and status code",
            ["route", "code"],
            registry=self.registry,
        )
        self.counts = SimpleNamespace(http_requests=counter)

    def __serve_build_asgi_app__(self):
        return _AuthAndCount(self._asgi, self.config, self.counts)

    async def _asgi(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            return await send({"type": "lifespan.shutdown.complete"})
        if scope["type"] != "http":
            return
        try:
            body = await self._read_body(scope, receive)
        except APIError as exc:
            return await _send_error(send, exc, exc.headers)
        if body is None:
            return  # the client left
        if scope["path"] == "/metrics" and scope["method"] == "GET":
            return await Response(await self.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")(
                scope, receive, send
            )
        request = HttpRequest(
            scope["method"],
            scope["path"],
            scope.get("query_string", b""),
            tuple((bytes(k), bytes(v)) for k, v in scope["headers"]),
            body,
            tuple(scope["client"]) if scope.get("client") else None,
        )
        await self.forward(Route(key=routing_key(scope["path"], body, self.prefix_chars)), request, send)

    async def _read_body(self, scope, receive) -> bytes | None:
        """The body, at most one byte over the limit (the replica answers 413 as one process does) and
        within the body timeout (408 here: the replica never sees how long it took)."""
        limit, timeout = self.config.max_body_bytes, self.config.body_timeout_s
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            return b""  # the replica refuses it from the header alone
        body = bytearray()
        try:
            async with asyncio.timeout(timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    body += message.get("body", b"")
                    if len(body) > limit or not message.get("more_body", False):
                        return bytes(body[: limit + 1])
        except TimeoutError:
            raise APIError(
                408,
                f"the request body did not arrive within {timeout:g} s",
                code="body_timeout",
                headers={"Connection": "close"},
            ) from None

    async def forward(self, route: Route, request: HttpRequest, send) -> None:
        streaming = False  # the client has the response head: a failure now can only end the stream
        for attempt in range(RETRIES + 1):
            responses = self.replicas.options(stream=True).forward.remote(route, request)
            finished = False
            try:
                async for head, body, more in responses:
                    if head is not None:
                        streaming = True
                        headers = [*head[1], (INGRESS_HEADER, self.ingress_id.encode())]
                        await send({"type": "http.response.start", "status": head[0], "headers": headers})
                    await send({"type": "http.response.body", "body": body, "more_body": more})
                finished = True
                return
            except _REPLICA_GONE as exc:
                finished = True
                log.warning(
                    "a replica died under %s %s (attempt %d): %s",
                    request.method,
                    request.path,
                    attempt + 1,
                    type(exc).__name__,
                )
                if streaming:
                    return await send(_stream_end(_replica_gone()))
            except Exception:  # a bug: logged once, and answered as the server answers one
                finished = True
                log.exception("forwarding %s %s failed", request.method, request.path)
                error = APIError(500, "internal server error", "server_error", code="internal_error")
                return await (send(_stream_end(error)) if streaming else _send_error(send, error))
            finally:
                if not finished:
                    responses.cancel()  # the client left: so does the request, on its replica
        await _send_error(send, _replica_gone(), {"Retry-After": "1"})

    def ingress_metrics(self, route: Route) -> bytes:
        """This ingress replica's request counts (``route``: for the router, which pins the scrape here)."""
        return generate_latest(self.registry)

    async def metrics(self) -> bytes:
        """Every replica's /metrics, summed (counters, histograms, gauges) or per replica (NOT_SUMMED and
        ``specdecode_replica_up``), and the request counts of every ingress replica, summed."""
        if self._ingresses is None:
            self._ingresses = serve.get_deployment_handle(INGRESS_NAME, self.app_name)
        texts = await _scrape(self.replicas, "replica_metrics")
        ingress_texts = await _scrape(self._ingresses, "ingress_metrics")
        return aggregate_metrics(texts) + aggregate_metrics(ingress_texts, up=False)


async def _scrape(handle, method: str) -> dict[str, str | None]:
    """``method`` of every replica of ``handle``'s deployment, pinned to each (None: it did not answer)."""
    call = handle.options(method_name=method).remote

    def ids() -> list[str]:
        return PrefixRouter.replica_ids(handle.app_name, handle.deployment_name)

    if not ids():  # the handle's router starts with its first request
        await asyncio.wait_for(call(Route()), METRICS_TIMEOUT_S)
    texts = {}
    for rid in ids():  # one at a time: calls made under one request share its id in the router
        try:
            texts[rid] = (await asyncio.wait_for(call(Route(pin=rid)), METRICS_TIMEOUT_S)).decode()
        except (TimeoutError, *_REPLICA_GONE):
            log.warning("replica %s did not answer a metrics scrape", rid)
            texts[rid] = None
    return texts


def _replica_gone() -> APIError:
    return APIError(503, "the replica serving this request died; retry", "server_error", code="replica_unavailable")


def _stream_end(error: APIError) -> dict:
    """The last message of a stream that failed: its error event and ``[DONE]``, as the server ends one."""
    data = f"data: {json.dumps(error.body(), separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode()
    return {"type": "http.response.body", "body": data, "more_body": False}


async def _send_error(send, error: APIError, headers: Mapping[str, str] | None = None) -> None:
    raw = [(b"content-type", b"application/json")]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": raw})
    await send({"type": "http.response.body", "body": json.dumps(error.body()).encode(), "more_body": False})


# -- metrics aggregation (pure) -----------------------------------------------------------------------
def aggregate_metrics(texts: Mapping[str, str | None], up: bool = True) -> bytes:
    """Prometheus text of several replicas as one: samples of counters, histograms and gauges summed over
    replicas with the same name and labels; gauges in NOT_SUMMED and families of unknown type labelled
    ``replica``; with ``up``, ``specdecode_replica_up{replica}`` 1 or 0 (``None`` text: it did not answer)."""
    families: dict[str, tuple[str, str, dict]] = {}  # name -> (type, help, {(sample name, labels): value})
    for rid, text in texts.items():
        for family in text_string_to_metric_families(text or ""):
            kind = family.type
            per_replica = kind not in ("counter", "histogram", "gauge", "summary") or family.name in NOT_SUMMED
            _, _, samples = families.setdefault(family.name, (kind, family.documentation, {}))
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue  # a creation time: no sum of those means anything
                labels = dict(s.labels) | ({"replica": rid} if per_replica else {})
                key = (s.name, tuple(sorted(labels.items())))
                samples[key] = samples.get(key, 0.0) + s.value
    if up:
        answered = {
            ("specdecode_replica_up", (("replica", rid),)): float(text is not None) for rid, text in texts.items()
        }
        families["specdecode_replica_up"] = ("gauge", "1 when the replica answered this scrape", answered)
    lines = []
    for name, (kind, doc, samples) in families.items():
        lines += [f"# HELP {name} {_escape_help(doc)}", f"# TYPE {name} {kind}"]
        lines += [f"{sample}{_labels(labels)} {_number(value)}" for (sample, labels), value in samples.items()]
    return ("\n".join(lines) + "\n").encode()


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{v}"'.replace("\n", "\\n") for k, v in labels)
    return "{" + inner + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


# -- the application and the launcher -----------------------------------------------------------------
def build_app(
    engine_factory: Callable[[], Any],
    config: ServerConfig,
    replicas: int = 1,
    replica_cpus: float = 1.0,
    replica_gpus: float = 0.0,
    max_ongoing_requests: int | None = None,
    graceful_timeout_s: float = 60.0,
    prefix_chars: int = PREFIX_CHARS,
    imbalance: int = IMBALANCE,
    ingress_replicas: int = INGRESS_REPLICAS,
):
    """The Ray Serve application: ``serve.run(build_app(...), name="specdecode", route_prefix="/")``.

    ``engine_factory``: builds one replica's engine, on the replica (picklable, e.g.
    ``functools.partial(build.build_engine_from, config_dict(EngineConfig(...)))``: a replica makes the config
    again, so it is checked there; the models must be reachable from every node).
    ``max_ongoing_requests``: requests a replica takes before Ray Serve holds more back at the ingress
    (default: the queue plus 64, so the replica's own 429 ``queue_full`` answers first).
    ``ingress_replicas``: copies of the ingress (2 by default, so none is a single point of failure; module
    docstring).
    """
    per_replica = max_ongoing_requests or config.max_queue + 64
    replica = serve.deployment(
        Replica,
        name="Replica",
        num_replicas=replicas,
        max_ongoing_requests=per_replica,
        graceful_shutdown_timeout_s=graceful_timeout_s + 5,
        graceful_shutdown_wait_loop_s=0.5,
        ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus},
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixRouter, request_router_kwargs={"imbalance": imbalance}
        ),
    )
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        name=INGRESS_NAME,
        num_replicas=ingress_replicas,
        max_ongoing_requests=replicas * per_replica + 64,
        ray_actor_options={"num_cpus": 0},
        request_router_config=RequestRouterConfig(request_router_class=PrefixRouter),
    )
    return ingress.bind(replica.bind(engine_factory, config), config, prefix_chars)


def main(args: argparse.Namespace, server: ServerConfig, cfg: EngineConfig) -> int:
    """``specdecode serve --replicas N``: the application on a Ray cluster, until SIGINT/SIGTERM (``server``: the
    HTTP settings ``serve``'s flags gave; ``cfg``: the engine's, each replica builds its engine from)."""
    import functools

    import ray

    from specdecode.build import build_engine_from, validate_config

    try:
        validate_config(cfg)
    except ValueError as exc:
        print(f"specdecode serve: {exc}", file=sys.stderr)
        return 2
    gpus = args.replica_gpus if args.replica_gpus is not None else float(_wants_cuda(cfg.device))
    ray.init(
        address=args.ray_address,
        include_dashboard=False if args.ray_address is None else None,
        logging_level=args.log_level.upper(),
    )
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build_app(
        functools.partial(build_engine_from, config_dict(cfg)),  # plain data: checked again on the replica
        server,
        args.replicas,
        args.replica_cpus,
        gpus,
        graceful_timeout_s=args.graceful_timeout,
    )
    serve.run(app, name=APP_NAME, route_prefix="/")
    log.info("serving %d replicas on http://%s:%d", args.replicas, args.host, args.port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("draining the replicas (up to %g s)", args.graceful_timeout)
    serve.shutdown()
    ray.shutdown()
    return 0


def _wants_cuda(device: str) -> bool:
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    import torch

    return torch.cuda.is_available()
