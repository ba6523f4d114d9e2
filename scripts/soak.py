#!/usr/bin/env python
"""Soak the server: mixed streaming / non-streaming requests, random client disconnects and a share of
invalid requests for ``--duration`` seconds, sampling the server's RSS; then compare ``/metrics`` with
what the clients counted. Writes ``soak.json`` and prints a markdown summary (docs/server.md).

    python scripts/soak.py --duration 600 --concurrency 6 --out runs/soak            # a tiny model built here
    python scripts/soak.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b ... # or a real pair

Pass criteria: zero 5xx; no valid request refused; every invalid one refused with a 4xx; every valid
request answered (200 with a finish reason) or, when the client left, cancelled (the server counts
finish_reason="abort", or nothing if the client left before the request reached the engine), so
client answered <= server finished <= client answered + client left; the RSS slope over the second
half stated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

PROMPTS = ["def fib(n):", "Once upon a time", "import numpy as np\n", "The capital of France is", "abc " * 30]


def tiny_model(root: Path) -> str:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny import make_model, make_tokenizer

    model = make_model(64, seed=0, layers=2, hidden=64, arch="llama")
    model.save_pretrained(root / "target")
    tok = make_tokenizer(64)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # chat requests are valid too
    tok.save_pretrained(root / "target")
    return str(root / "target")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def invalid_request(rng: random.Random) -> tuple[str, object]:
    """(path, body) of a request the server must refuse with a 4xx."""
    return rng.choice(
        [
            ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": -5}),
            ("/v1/completions", {"model": "m", "prompt": "x", "temperature": -1}),
            ("/v1/completions", {"model": "m", "prompt": "x", "top_p": 7}),
            ("/v1/completions", {"model": "m"}),
            ("/v1/chat/completions", {"model": "m", "messages": "not a list"}),
            ("/v1/completions", {"model": "m", "prompt": "x" * 200_000, "max_tokens": 4}),
            ("/v1/completions", "{not json"),
        ]
    )


async def one(
    client: httpx.AsyncClient,
    rng: random.Random,
    counts: Counter,
    model: str,
    invalid_share: float,
    disconnect_share: float,
) -> None:
    if rng.random() < invalid_share:
        path, body = invalid_request(rng)
        kwargs = (
            {"content": body, "headers": {"content-type": "application/json"}}
            if isinstance(body, str)
            else {"json": {**body, "model": model}}
        )
        r = await client.post(path, **kwargs)
        counts[f"invalid:{r.status_code}"] += 1
        return
    chat = rng.random() < 0.4
    stream = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {
        "model": model,
        "max_tokens": rng.randint(1, 48),
        "stream": stream,
        "temperature": rng.choice([0, 0.8]),
        "seed": rng.randint(0, 10**6),
    }
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    else:
        body["prompt"] = rng.choice(PROMPTS)
    leave_after = rng.uniform(0.0, 0.5) if rng.random() < disconnect_share else None
    try:
        async with asyncio.timeout(leave_after) if leave_after is not None else _null():
            if stream:
                async with client.stream("POST", path, json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
                    status = r.status_code
            else:
                r = await client.post(path, json=body)
                status = r.status_code
                if status == 200 and not r.json()["choices"][0].get("finish_reason"):
                    counts["valid:200_without_finish_reason"] += 1
        counts[f"valid:{status}"] += 1
    except TimeoutError:
        counts["valid:client_left"] += 1


class _null:
    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(specdecode_(?:http_requests|requests|requests_rejected)_total)(\{[^}]*\})? ([0-9.e+]+)$", line)
        if m:
            out[m[1] + (m[2] or "")] = float(m[3])
    return out


async def drive(url: str, args, pid: int) -> dict:
    rng = random.Random(args.seed)
    counts: Counter = Counter()
    rss: list[tuple[float, float]] = []
    proc = psutil.Process(pid)
    t0 = time.monotonic()
    stop = t0 + args.duration
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def worker(i: int) -> None:
            wrng = random.Random(rng.random())
            while time.monotonic() < stop:
                await one(client, wrng, counts, model, args.invalid_share, args.disconnect_share)

        async def sampler() -> None:
            while time.monotonic() < stop:
                rss.append((time.monotonic() - t0, proc.memory_info().rss / 2**20))
                await asyncio.sleep(5)

        await asyncio.gather(sampler(), *(worker(i) for i in range(args.concurrency)))
        await asyncio.sleep(2)  # let cancelled requests leave the server
        metrics = parse_metrics((await client.get("/metrics")).text)
    return {"counts": dict(counts), "rss_mib": rss, "metrics": metrics}


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares MiB per minute over the second half (after warm-up)."""
    pts = points[len(points) // 2 :]
    if len(pts) < 2:
        return 0.0
    n = len(pts)
    mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
    var = sum((p[0] - mx) ** 2 for p in pts)
    return 60 * sum((p[0] - mx) * (p[1] - my) for p in pts) / var if var else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="model (default: a tiny model built here)")
    p.add_argument("--draft", default=None)
    p.add_argument("--serve-args", default="-k 3 --max-batch-size 4", help="extra `specdecode serve` flags")
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--invalid-share", type=float, default=0.15)
    p.add_argument("--disconnect-share", type=float, default=0.15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/soak"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    target = args.target or tiny_model(tmp)
    draft = args.draft or (target if args.target is None else None)
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "specdecode.cli",
        "serve",
        "--target",
        target,
        "--port",
        str(port),
        "--dtype",
        "float32",
        *(["--draft", draft] if draft else []),
        *args.serve_args.split(),
    ]
    log = open(args.out / "server.log", "w")  # noqa: SIM115 - the server's log stays open while it runs
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start; see {args.out / 'server.log'}")
            time.sleep(0.5)
        result = asyncio.run(drive(url, args, server.pid))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    counts, metrics = result["counts"], result["metrics"]
    five_xx = sum(v for k, v in counts.items() if re.search(r":5\d\d$", k))
    server_5xx = sum(v for k, v in metrics.items() if 'code="5' in k)
    valid_ok = counts.get("valid:200", 0)
    left = counts.get("valid:client_left", 0)
    finished = {k: v for k, v in metrics.items() if k.startswith("specdecode_requests_total")}
    aborted = sum(v for k, v in finished.items() if 'finish_reason="abort"' in k)
    answered = sum(v for k, v in finished.items() if 'finish_reason="abort"' not in k)
    invalid = sum(v for k, v in counts.items() if k.startswith("invalid:"))
    invalid_4xx = sum(v for k, v in counts.items() if re.match(r"invalid:4\d\d$", k))
    summary = {
        "command": " ".join(sys.argv),
        "server": " ".join(cmd),
        "duration_s": args.duration,
        "concurrency": args.concurrency,
        "client_counts": counts,
        "server_counters": metrics,
        "five_xx_client": five_xx,
        "five_xx_server": server_5xx,
        "valid_answered_client": valid_ok,
        "valid_left_client": left,
        "server_finished_not_abort": answered,
        "server_finished_abort": aborted,
        "invalid_sent": invalid,
        "invalid_refused_4xx": invalid_4xx,
        "rss_mib_first_last": [result["rss_mib"][0][1], result["rss_mib"][-1][1]] if result["rss_mib"] else None,
        "rss_slope_mib_per_min_second_half": round(slope(result["rss_mib"]), 3),
        "rss_samples": result["rss_mib"],
    }
    valid_refused = sum(v for k, v in counts.items() if k.startswith("valid:") and k[6:].isdigit() and k != "valid:200")
    summary["valid_refused"] = valid_refused
    # a client that leaves before its request reaches the engine is never counted by the server
    summary["pass"] = bool(
        five_xx == 0
        and server_5xx == 0
        and invalid_4xx == invalid
        and valid_refused == 0
        and valid_ok <= answered <= answered + aborted <= valid_ok + left
    )
    (args.out / "soak.json").write_text(json.dumps(summary, indent=1))
    print(f"| soak | {args.duration:.0f} s, concurrency {args.concurrency} |\n|---|---|")
    for key in (
        "five_xx_client",
        "five_xx_server",
        "valid_refused",
        "valid_answered_client",
        "valid_left_client",
        "server_finished_not_abort",
        "server_finished_abort",
        "invalid_sent",
        "invalid_refused_4xx",
        "rss_mib_first_last",
        "rss_slope_mib_per_min_second_half",
        "pass",
    ):
        print(f"| {key} | {summary[key]} |")
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
