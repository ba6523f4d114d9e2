"""`specdecode serve`: an OpenAI-compatible server with continuous batching and speculation.

SIGTERM / Ctrl-C drains: the listening socket closes, in-flight requests (streams included) run
to completion for up to ``--graceful-timeout`` seconds; any still open then get a 503 error (JSON, or
an SSE error event and ``[DONE]``), and the engine thread stops. The limits every request and
connection meet are listed in docs/server.md.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path

API_KEY_ENV = "SPECDECODE_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdecode.build import add_model_arguments
    from specdecode.config import add_setting

    add_model_arguments(parser, tool="serve")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    g.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every route but /health (default ${API_KEY_ENV})",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients use and responses show (default: the alias or hub id given as --target; "
        "for a local path, its last component without .gguf, so no path is shown to clients)",
    )
    g.add_argument(
        "--allowed-hosts",
        default="",
        help="without an API key, only requests whose Host header is loopback (localhost, 127.0.0.1, "
        "[::1]) are answered, so a web page cannot reach the server through DNS rebinding; a "
        "comma-separated list of more host names to accept, or '*' for any",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections at once; past it new ones are closed at once "
        "(default: the descriptor limit less 64, at most 2048)",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=None,
        help="seconds a connection may take to send a request head, from connecting or from its "
        "previous response, before it is closed (default 20)",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=None,
        help="seconds a request body may take to arrive, else 408 (default 60)",
    )
    add_setting(g, "max_batch_size", "serve")  # the engine's settings: their defaults for serve are the config's
    g.add_argument(
        "--max-queue",
        type=int,
        default=128,
        help="requests waiting for a batch slot before new ones get 429 (default 128)",
    )
    add_setting(g, "max_num_batched_tokens", "serve")
    add_setting(g, "batched_tokens_per_seq", "serve")
    add_setting(g, "prefix_cache_mb", "serve")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit, else 413 (default 1 MiB)")
    g.add_argument(
        "--no-speculation",
        action="store_true",
        help="load the draft but decode target-only (requests cannot turn it on)",
    )
    g.add_argument(
        "--wedge-timeout",
        type=float,
        default=120.0,
        help="/health returns 503 when one engine step runs longer than this (seconds, default 120)",
    )
    g.add_argument(
        "--graceful-timeout",
        type=float,
        default=60.0,
        help="on SIGTERM, seconds to let in-flight requests finish (default 60)",
    )
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    r = parser.add_argument_group("replicas (Ray Serve; pip install 'specdecode[ray]'; docs/replicas.md)")
    r.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="serve through Ray Serve with N replicas, each an engine + scheduler, requests routed by "
        "prompt prefix and load (default 0: this one process, no Ray)",
    )
    r.add_argument(
        "--ray-address",
        default=None,
        help="the Ray cluster to run the replicas on ('auto', HOST:6379 or ray://HOST:10001; "
        "default: start a local one on this machine)",
    )
    r.add_argument(
        "--replica-cpus",
        type=float,
        default=1.0,
        help="CPUs each replica reserves (default 1; Ray then gives torch one thread)",
    )
    r.add_argument(
        "--replica-gpus",
        type=float,
        default=None,
        help="GPUs each replica reserves (default 1 when --device is cuda, or auto with CUDA present; else 0)",
    )


def check_arguments(args: argparse.Namespace) -> str | None:
    for name in ("max_queue", "max_body_bytes"):  # the engine's settings: specdecode.config checks them
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if not 0 <= args.port <= 65535:
        return f"--port must be in [0, 65535], got {args.port}"
    if args.replicas < 0:
        return "--replicas must be >= 0"
    if args.replicas and args.port == 0:
        return "--replicas needs a fixed --port (Ray Serve's proxy binds it on every node)"
    if args.max_connections is not None and args.max_connections < 1:
        return "--max-connections must be >= 1"
    for name in ("header_timeout", "body_timeout"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            return f"--{name.replace('_', '-')} must be > 0"
    return None


def served_model_name(target: str) -> str:
    """The model id shown to clients by default: an alias or hub id as given; a local path's last
    component (a file's without ``.gguf``), so that no local path reaches a client."""
    path = Path(target).expanduser()
    if not path.exists():
        return target
    name = path.resolve().name
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def allowed_hosts(spec: str) -> tuple[str, ...]:
    return tuple(h.strip() for h in spec.split(",") if h.strip())


def server_config(args: argparse.Namespace):
    from specdecode.server.app import ServerConfig
    from specdecode.server.connections import BODY_TIMEOUT_S

    return ServerConfig(
        model_name=args.served_model_name or served_model_name(args.target),
        api_key=args.api_key or None,
        allowed_hosts=allowed_hosts(args.allowed_hosts),
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        body_timeout_s=args.body_timeout or BODY_TIMEOUT_S,
        speculation=not args.no_speculation,
        wedge_timeout_s=args.wedge_timeout,
    )


def connection_limits(args: argparse.Namespace):
    from specdecode.server.connections import HEADER_TIMEOUT_S, ConnectionLimits, default_max_connections

    return ConnectionLimits(
        header_timeout_s=args.header_timeout or HEADER_TIMEOUT_S,
        max_connections=args.max_connections or default_max_connections(),
    )


def run_server(
    app, host: str, port: int, graceful_timeout_s: float = 60.0, log_level: str = "info", limits=None
) -> None:
    """Serve ``app`` with uvicorn until SIGINT/SIGTERM, then drain (see the module docstring)."""
    from specdecode.server.connections import ConnectionLimits, DrainingServer, uvicorn_config

    DrainingServer(uvicorn_config(app, host, port, limits or ConnectionLimits(), graceful_timeout_s, log_level)).run()


def main(args: argparse.Namespace) -> int:
    problem = check_arguments(args)
    if problem:
        print(f"specdecode serve: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.api_key and not _is_loopback(args.host):
        logging.getLogger("specdecode.server").warning(
            "serving on %s without an API key: anyone who can reach it can use it%s",
            args.host,
            "" if args.allowed_hosts else "; only loopback Host headers are answered (--allowed-hosts adds more)",
        )
    from specdecode.config import ConfigError, config_from_args

    try:  # the engine's settings, with the defaults the config declares for serve: a request's first token
        # comes from the target's prefill and one step (its drafter catches up after), a drafter's fault stays
        # in its rows, and each step carries a token budget
        cfg = config_from_args(args, "serve")
    except ConfigError as exc:
        print(f"specdecode serve: {exc}", file=sys.stderr)
        return 2
    if args.replicas:
        try:
            from specdecode.server import replicas
        except ImportError as exc:
            print(
                f"specdecode serve: --replicas needs Ray Serve (pip install 'specdecode[ray]'): {exc}", file=sys.stderr
            )
            return 2
        return replicas.main(args, server_config(args), cfg)

    from specdecode.build import PairError, build_engine
    from specdecode.profile.cache import measured_speeds
    from specdecode.server.app import create_app

    try:
        engine = build_engine(cfg, measured_speeds(cfg))
    except (PairError, ValueError, OSError) as exc:
        print(f"specdecode serve: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("specdecode.server").info("models on the %s backend", engine.backend)
    run_server(
        create_app(engine, server_config(args)),
        args.host,
        args.port,
        args.graceful_timeout,
        args.log_level,
        connection_limits(args),
    )
    return 0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
