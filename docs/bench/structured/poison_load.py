"""Poison specs against a served model (issue 59, "Done when"): bystander stream latency with and without
distinct poison specs arriving at 2 per second, and RSS across 500 distinct poison specs.

It builds a random-weight tiny Qwen2 model over a real tokenizer (Qwen2.5's, from a local model directory:
no download) in a temporary directory, starts ``specdecode serve`` on it (CPU, float32, no speculation),
then, in one run so that load drift hits every phase:

The sandbox child is niced, and by default the server's torch threads take every core: the harshest
case for the poison specs' answers, the point being that the bystanders' decoding does not wait for them.

1. **latency**: bystander clients stream completions back to back (plain ones with ``ignore_eos`` and a
   cached ``json_schema`` one) through quiet / poison / quiet phases; in the poison phase a new, distinct
   poison spec arrives every 1 / ``--rate`` s, each in its own connection (open loop): the issue's
   repetition blow-ups with a changing digit, deep ``$ref`` / ``anyOf`` chains, long Lark and GBNF rule
   chains, an unsatisfiable class, the cache-poisoning regex. Per phase: each bystander request's latency
   (request to ``[DONE]``), its longest gap between chunks, and the poison answers' statuses.
2. **rss**: ``--rss-specs`` more distinct poison specs, two at a time; the RSS of the server process and
   of its children (the grammar sandbox) sampled every 0.2 s, and per 50 specs.

Writes ``--out`` (JSON) and prints a summary.

    python docs/bench/structured/poison_load.py --tokenizer ~/.cache/specdecode/converted/qwen2.5-coder-0.5b-*/ \\
        --out docs/bench/structured/avx512bf16-poison-load/result.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

KEY = "poison-load"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


# --- the poison specs: each i gives a distinct one (no cache hit) ----------------------------------------


def _ref_chain(n: int, tag: str) -> dict:
    defs = {f"{tag}{i}": {"$ref": f"#/$defs/{tag}{i + 1}"} for i in range(n)}
    return {"$defs": defs | {f"{tag}{n}": {"type": "integer"}}, "$ref": f"#/$defs/{tag}0"}


def _any_of_chain(n: int, tag: str) -> dict:
    defs = {
        f"{tag}{i}": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": f"#/$defs/{tag}{i + 1}"}}]}
        for i in range(n)
    }
    return {"$defs": defs | {f"{tag}{n}": {"type": "integer"}}, "$ref": f"#/$defs/{tag}0"}


def _schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}


POISON_KINDS = {  # kind -> fields of a request for the i-th distinct spec
    "regex (x{N}){500}": lambda i: {"regex": f"(x{{{2000 + i}}}){{500}}"},
    "regex a{N}": lambda i: {"regex": f"a{{{1000000 + i}}}"},
    "regex ((x{100}){100}){N}": lambda i: {"regex": f"((x{{100}}){{100}}){{{100 + i}}}"},
    "schema $ref chain 2500": lambda i: _schema(_ref_chain(2500, f"r{i}_")),
    "schema anyOf chain 1000": lambda i: _schema(_any_of_chain(1000, f"a{i}_")),
    "lark rule chain 4000": lambda i: {
        "grammar": f"start: r{i}_0\n" + "".join(f"r{i}_{j}: r{i}_{j + 1}\n" for j in range(4000)) + f'r{i}_4000: "a"\n'
    },
    "gbnf rule chain 4000": lambda i: {
        "grammar": f"root ::= g{i}x0\n"
        + "".join(f"g{i}x{j} ::= g{i}x{j + 1} | [a-z]\n" for j in range(4000))
        + f'g{i}x4000 ::= "a"\n'
    },
    "regex unsatisfiable": lambda i: {"regex": f"[a&&b]{{{i + 1}}}"},
    "regex cache poison": lambda i: {"regex": f"x[0-9]{{3}}|a(b{{{1000 + i}}}){{1000}}", "logit_bias": {"64": 100}},
}


def poison_body(i: int) -> tuple[str, dict]:
    kinds = list(POISON_KINDS)
    kind = kinds[i % len(kinds)]
    return kind, {"model": "tiny", "prompt": "Answer:", "max_tokens": 8, "temperature": 0} | POISON_KINDS[kind](i)


# --- the server ------------------------------------------------------------------------------------------


def build_model(tokenizer_dir: str, out: Path, seed: int) -> None:
    from transformers import AutoTokenizer

    from tiny import make_model

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = make_model(len(tok), seed=seed, hidden=64)
    model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_tree(pid: int) -> dict[int, int]:
    """RSS in bytes of ``pid`` and each of its descendants."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                out[p] = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, StopIteration):
            pass
    return out


# --- the clients -----------------------------------------------------------------------------------------


def stream_once(http: httpx.Client, body: dict) -> dict:
    """One streamed request: latency to [DONE], the longest gap between chunks, chunks."""
    t0 = last = time.perf_counter()
    gap, chunks, done = 0.0, 0, False
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "error": r.text[:300]}
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            gap, last = max(gap, now - last), now
            if line == "data: [DONE]":
                done = True
                break
            chunks += 1
    return {"status": 200, "latency_s": time.perf_counter() - t0, "max_gap_s": gap, "chunks": chunks, "done": done}


BYSTANDERS = {
    "plain": {"model": "tiny", "prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0, "ignore_eos": True},
    "json_schema": {"model": "tiny", "prompt": "name and ok as JSON:", "max_tokens": 32, "temperature": 0}
    | _schema(SCHEMA),
}


def summarize(values: list[float]) -> dict:
    if not values:
        return {}
    qs = statistics.quantiles(values, n=10) if len(values) > 1 else [values[0]] * 9
    return {"n": len(values), "median": statistics.median(values), "p90": qs[8], "max": max(values)}


def latency_phases(url: str, phases: list[tuple[str, float]], rate: float, clients: dict[str, int]) -> dict:
    """Bystanders stream back to back through ``phases`` ((name, seconds), name "poison" sends poison)."""
    records: list[dict] = []
    poison: list[dict] = []
    phase = {"name": phases[0][0]}
    stop = threading.Event()

    def bystander(kind: str) -> None:
        with httpx.Client(base_url=url, timeout=300, headers={"Authorization": f"Bearer {KEY}"}) as http:
            while not stop.is_set():
                name = phase["name"]
                rec = stream_once(http, BYSTANDERS[kind])
                if phase["name"] == name:  # requests that straddle two phases are not counted
                    records.append(rec | {"kind": kind, "phase": name})

    def send_poison(i: int, name: str) -> None:
        kind, body = poison_body(i)
        t0 = time.perf_counter()
        try:
            with httpx.Client(base_url=url, timeout=300, headers={"Authorization": f"Bearer {KEY}"}) as http:
                r = http.post("/v1/completions", json=body)
            status, code = r.status_code, (r.json().get("error") or {}).get("code") if r.status_code != 200 else None
        except httpx.HTTPError as e:
            status, code = 0, type(e).__name__
        poison.append(
            {"i": i, "kind": kind, "status": status, "code": code, "phase": name, "latency_s": time.perf_counter() - t0}
        )

    threads = [threading.Thread(target=bystander, args=(k,), daemon=True) for k, n in clients.items() for _ in range(n)]
    for t in threads:
        t.start()
    sent = 0
    with ThreadPoolExecutor(64) as pool:
        for name, seconds in phases:
            phase["name"] = name
            end = time.perf_counter() + seconds
            next_at = time.perf_counter()
            while time.perf_counter() < end:
                if name == "poison" and time.perf_counter() >= next_at:
                    pool.submit(send_poison, sent, name)
                    sent += 1
                    next_at += 1.0 / rate
                time.sleep(0.01)
        phase["name"] = "drain"
        stop.set()
        for t in threads:
            t.join()
    out: dict = {"phases": phases, "rate_per_s": rate, "poison_sent": sent, "by_phase": {}}
    for name in dict(phases):
        for kind in clients:
            recs = [r for r in records if r["phase"] == name and r["kind"] == kind]
            ok = [r for r in recs if r["status"] == 200 and r["done"]]
            out["by_phase"][f"{name}/{kind}"] = {
                "requests": len(recs),
                "failed": len(recs) - len(ok),
                "latency_s": summarize([r["latency_s"] for r in ok]),
                "max_gap_s": summarize([r["max_gap_s"] for r in ok]),
                "chunks": summarize([r["chunks"] for r in ok]),
            }
    statuses: dict[str, int] = {}
    for p in poison:
        key = f"{p['kind']}: {p['status']} {p['code'] or ''}".strip()
        statuses[key] = statuses.get(key, 0) + 1
    out["poison_answers"] = dict(sorted(statuses.items()))
    out["poison_latency_s"] = summarize([p["latency_s"] for p in poison])
    quiet = [n for n, _ in phases if n != "poison"]
    for kind in clients:
        base = [r["latency_s"] for r in records if r["phase"] in quiet and r["kind"] == kind and r.get("done")]
        hit = [r["latency_s"] for r in records if r["phase"] == "poison" and r["kind"] == kind and r.get("done")]
        if base and hit:
            b, h = summarize(base), summarize(hit)
            out[f"ratio/{kind}"] = {k: h[k] / b[k] for k in ("median", "p90", "max")}
    return out


def rss_phase(url: str, server_pid: int, specs: int, start: int) -> dict:
    samples: list[tuple[float, int, int, int]] = []  # (t, server, children, children count)
    stop = threading.Event()
    children_seen: set[int] = set()

    def sampler() -> None:
        t0 = time.perf_counter()
        while not stop.is_set():
            tree = rss_tree(server_pid)
            kids = {p: v for p, v in tree.items() if p != server_pid}
            children_seen.update(kids)
            samples.append((time.perf_counter() - t0, tree.get(server_pid, 0), sum(kids.values()), len(kids)))
            time.sleep(0.2)

    def at() -> dict:
        tree = rss_tree(server_pid)
        return {"server": tree.get(server_pid, 0), "children": sum(v for p, v in tree.items() if p != server_pid)}

    before = at()
    t = threading.Thread(target=sampler, daemon=True)
    t.start()
    per50, statuses = [], {}
    done = [0]
    lock = threading.Lock()

    def one(i: int) -> None:
        kind, body = poison_body(i)
        with httpx.Client(base_url=url, timeout=300, headers={"Authorization": f"Bearer {KEY}"}) as http:
            r = http.post("/v1/completions", json=body)
        with lock:
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            done[0] += 1
            if done[0] % 50 == 0:
                per50.append({"specs": done[0]} | at())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(one, range(start, start + specs)))
    wall = time.perf_counter() - t0
    stop.set()
    t.join()
    after = at()
    mib = 1 << 20
    return {
        "specs": specs,
        "wall_s": wall,
        "statuses": statuses,
        "before": before,
        "after": after,
        "peak_server": max(s[1] for s in samples),
        "peak_children": max(s[2] for s in samples),
        "peak_total": max(s[1] + s[2] for s in samples),
        "per_50_specs": per50,
        "children_seen": len(children_seen),
        "samples": len(samples),
        "summary_mib": {
            "server_before": before["server"] / mib,
            "server_after": after["server"] / mib,
            "server_peak": max(s[1] for s in samples) / mib,
            "child_before": before["children"] / mib,
            "child_after": after["children"] / mib,
            "child_peak": max(s[2] for s in samples) / mib,
            "total_peak": max(s[1] + s[2] for s in samples) / mib,
        },
    }


def cpu_info() -> dict:
    model, flags = "?", []
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model == "?":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    wanted = [f for f in flags if f.startswith(("avx", "amx", "fma"))]
    return {"model": model, "flags": wanted, "cpus": os.cpu_count(), "loadavg": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="a local model directory with a tokenizer")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rate", type=float, default=2.0, help="poison specs per second in the poison phase")
    ap.add_argument("--quiet-s", type=float, default=30.0, help="each quiet phase (one before, one after)")
    ap.add_argument("--poison-s", type=float, default=60.0)
    ap.add_argument("--rss-specs", type=int, default=500)
    ap.add_argument("--plain-clients", type=int, default=2)
    ap.add_argument("--json-clients", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="the server's --threads (default: every core)")
    args = ap.parse_args()
    result: dict = {"command": " ".join(sys.argv), "cpu": cpu_info()}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny-qwen"
        build_model(args.tokenizer, model_dir, args.seed)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [
            "specdecode",
            "serve",
            "--target",
            str(model_dir),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--no-speculation",
            "--port",
            str(port),
            "--api-key",
            KEY,
            "--served-model-name",
            "tiny",
            "--max-batch-size",
            "8",
            "--threads",
            str(args.threads),
            "--log-level",
            "warning",
        ]
        result["serve"] = " ".join(cmd)
        log = open(Path(tmp) / "serve.log", "w")
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            for _ in range(600):
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None:
                    raise SystemExit(f"the server exited: {(Path(tmp) / 'serve.log').read_text()[-3000:]}")
                time.sleep(0.5)
            with httpx.Client(base_url=url, timeout=300, headers={"Authorization": f"Bearer {KEY}"}) as http:
                for body in BYSTANDERS.values():  # warm-up: the schema is compiled and cached before timing
                    stream_once(http, body)
            phases = [("quiet-before", args.quiet_s), ("poison", args.poison_s), ("quiet-after", args.quiet_s)]
            clients = {"plain": args.plain_clients, "json_schema": args.json_clients}
            result["latency"] = latency_phases(url, phases, args.rate, clients)
            print(
                json.dumps({k: v for k, v in result["latency"].items() if k.startswith("ratio")}, indent=1), flush=True
            )
            result["rss"] = rss_phase(url, server.pid, args.rss_specs, start=100_000)
            print(json.dumps(result["rss"]["summary_mib"], indent=1), flush=True)
            result["server_alive"] = server.poll() is None
            result["health_after"] = httpx.get(url + "/health", timeout=10).status_code
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            result["serve_log_tail"] = (Path(tmp) / "serve.log").read_text()[-3000:]
    result["cpu"]["loadavg_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
