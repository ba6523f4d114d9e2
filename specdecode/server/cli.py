"""`specdecode serve`: an OpenAI-compatible server with continuous batching and speculation.

SIGTERM / Ctrl-C drains: the listening socket closes, in-flight requests (streams included) run
to completion for up to ``--graceful-timeout`` seconds, then the engine thread stops.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

API_KEY_ENV = "SPECDECODE_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdecode.build import add_model_arguments

    add_model_arguments(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    g.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on every route but /health (default ${API_KEY_ENV})")
    g.add_argument("--served-model-name", default=None, help="model id clients must use (default: --target)")
    g.add_argument("--max-batch-size", type=int, default=8, help="sequences decoded together (default 8)")
    g.add_argument("--max-queue", type=int, default=128,
                   help="requests waiting for a batch slot before new ones get 429 (default 128)")
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="tokens one engine step carries: the running sequences' verify windows plus a chunk of "
                        "waiting prompts (at least a quarter of it), so a long prompt stalls the running streams "
                        "for one chunk at most (default 512)")
    g.add_argument("--batched-tokens-per-seq", type=int, default=0,
                   help="under load the step budget grows to this many tokens per admitted request when that is "
                        "more than --max-num-batched-tokens (running rows make each step dearer, so a bigger chunk "
                        "costs them relatively less); 0 keeps the budget fixed (default 0: on a CPU it measured "
                        "worse at concurrency 16, docs/server.md)")
    g.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body limit, else 413 (default 1 MiB)")
    g.add_argument("--no-speculation", action="store_true",
                   help="load the draft but decode target-only (requests cannot turn it on)")
    g.add_argument("--wedge-timeout", type=float, default=120.0,
                   help="/health returns 503 when one engine step runs longer than this (seconds, default 120)")
    g.add_argument("--graceful-timeout", type=float, default=60.0,
                   help="on SIGTERM, seconds to let in-flight requests finish (default 60)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def check_arguments(args: argparse.Namespace) -> str | None:
    for name in ("max_batch_size", "max_queue", "max_body_bytes", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if args.batched_tokens_per_seq < 0:
        return "--batched-tokens-per-seq must be >= 0"
    if not 0 <= args.port <= 65535:
        return f"--port must be in [0, 65535], got {args.port}"
    return None


def server_config(args: argparse.Namespace):
    from specdecode.server.app import ServerConfig

    return ServerConfig(model_name=args.served_model_name or args.target, api_key=args.api_key or None,
                        max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        batched_tokens_per_seq=args.batched_tokens_per_seq,
                        speculation=not args.no_speculation, wedge_timeout_s=args.wedge_timeout)


def run_server(app, host: str, port: int, graceful_timeout_s: float = 60.0, log_level: str = "info") -> None:
    """Serve ``app`` with uvicorn until SIGINT/SIGTERM, then drain (uvicorn's graceful shutdown)."""
    import uvicorn

    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                  timeout_graceful_shutdown=graceful_timeout_s, lifespan="on")).run()


def main(args: argparse.Namespace) -> int:
    problem = check_arguments(args)
    if problem:
        print(f"specdecode serve: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.api_key and not _is_loopback(args.host):
        logging.getLogger("specdecode.server").warning(
            "serving on %s without an API key: anyone who can reach it can use it", args.host)

    from specdecode.build import PairError, build_engine, config_from_args
    from specdecode.server.app import create_app

    try:
        engine = build_engine(config_from_args(args, max_batch_size=args.max_batch_size))
    except (PairError, ValueError, OSError) as exc:
        print(f"specdecode serve: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("specdecode.server").info("models on the %s backend", engine.backend)
    run_server(create_app(engine, server_config(args)), args.host, args.port, args.graceful_timeout, args.log_level)
    return 0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
