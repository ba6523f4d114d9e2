"""Decode speed against threads and OpenMP's wait policy, on a quiet machine and beside one busy process
per core: each cell one `specdecode generate` run (target only), its decode tok/s from the stats line.

    python docs/bench/threads/contention.py --out docs/bench/threads/<run>.json \
        --backend torch --target qwen2.5-coder-1.5b --threads 1,2,default --waits default,passive

`--waits`: `default` leaves OMP_WAIT_POLICY as specdecode leaves it; `active` / `passive` set it for the
run. Each condition runs `--repeats` times, the conditions interleaved; the table gives medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

STATS = re.compile(r"decode [0-9.]+ s \(([0-9.]+) tok/s\)")


def run(args, threads: str, wait: str) -> float | None:
    cmd = [
        "specdecode",
        "generate",
        "--backend",
        args.backend,
        "--target",
        args.target,
        "--prompt",
        args.prompt,
        "--max-new-tokens",
        str(args.tokens),
        "--weights",
        "mapped",
    ]
    if threads != "default":
        cmd += ["--threads", threads]
    env = dict(os.environ)
    if wait != "default":
        env["OMP_WAIT_POLICY"] = wait.upper()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    m = STATS.search(out.stderr)
    if m is None:
        print(out.stderr[-2000:], file=sys.stderr)
        return None
    return float(m.group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--backend", default="torch")
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--prompt", default="def quicksort(arr):")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", default="1,2,default")
    p.add_argument("--waits", default="default")
    p.add_argument("--loads", default="quiet,busy")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    cells: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        for load in args.loads.split(","):
            hogs = (
                [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
                if load == "busy"
                else []
            )
            time.sleep(1 if hogs else 0)
            try:
                for threads in args.threads.split(","):
                    for wait in args.waits.split(","):
                        tok_s = run(args, threads, wait)
                        key = f"{load} threads={threads} wait={wait}"
                        print(f"[{rep}] {key}: {tok_s} tok/s", file=sys.stderr, flush=True)
                        if tok_s is not None:
                            cells.setdefault(key, []).append(tok_s)
            finally:
                for h in hogs:
                    h.kill()
    table = {k: {"median_tok_s": statistics.median(v), "runs": v} for k, v in cells.items()}
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    meta = {
        "command": " ".join(sys.argv),
        "cores": os.cpu_count(),
        "loadavg_end": os.getloadavg(),
        "cpu_flags": [x for x in flags if x.startswith(("avx", "amx", "fma"))],
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "cells": table}, f, indent=1)
    for k, v in table.items():
        print(f"{k:40s} {v['median_tok_s']:.2f} tok/s  {v['runs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
