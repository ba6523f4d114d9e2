"""What --batch-invariant costs, and what it buys, on one set of weights in one process.

Interleaved per repeat: target-only, the draft model at k and n-gram lookup at k, each greedy, with
the mode off and on (the same models switched in place). Reports decode tok/s (median over
repeats) and, per mode, whether greedy speculation reproduced target-only token for token.

Usage: python docs/bench/batch-invariant/cost-by-cpu/batch_invariant_cost.py [--target T] [--draft D] [--dtype float32|bfloat16]
       [--num-prompts N] [--max-new-tokens M] [--repeats R] [-k K] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdecode.bench.env import command_line, commit, machine
from specdecode.bench.prompts import load_humaneval
from specdecode.bench.runner import tokenize_prompts
from specdecode.build import EngineConfig, engine_from_pair, load_pair
from specdecode.models import batch_invariant
from specdecode.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-ngram", action="store_true", help="leave out n-gram lookup")
    args = ap.parse_args()

    pair = load_pair(EngineConfig(args.target, args.draft, dtype=args.dtype, backend="torch"), "torch")
    prompts, _ = tokenize_prompts(
        load_humaneval(problems=range(0, args.num_prompts)), pair.tokenizer, args.max_new_tokens, 4096
    )
    greedy = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
    configs = {"target-only": None, f"draft k={args.k}": args.draft}
    if not args.no_ngram:
        configs[f"ngram k={args.k}"] = "ngram"
    times: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[str, str], list[list[int]]] = {}
    for rep in range(args.repeats):
        for mode in ("off", "on"):
            if mode == "on":  # what engine_from_pair does with --batch-invariant
                batch_invariant.enable(pair.target.module)
                batch_invariant.enable(pair.draft.module, batch_invariant.DRAFT_WORKLOAD)
            else:
                batch_invariant.disable(pair.target.module)
                batch_invariant.disable(pair.draft.module)
            for name, draft in configs.items():
                cfg = EngineConfig(args.target, draft, num_draft_tokens=args.k, dtype=args.dtype, batch_invariant=mode)
                engine = engine_from_pair(pair, cfg)
                engine.generate([prompts[0].ids], SamplingParams(max_new_tokens=2, temperature=0.0))  # warm, probe
                tokens, decode_s, outs = 0, 0.0, []
                for p in prompts:
                    out = engine.generate([p.ids], greedy)[0]
                    tokens += len(out.token_ids)
                    decode_s += out.stats.draft_s + out.stats.verify_s
                    outs.append(out.token_ids)
                times.setdefault((mode, name), []).append(tokens / decode_s)
                outputs[(mode, name)] = outs
                print(f"rep {rep} batch-invariant {mode:3s} {name:12s} {tokens / decode_s:6.2f} tok/s", flush=True)
    rows = []
    for (mode, name), tps in times.items():
        base = statistics.median(times[(mode, "target-only")])
        plain = statistics.median(times[("off", name)])
        same = outputs[(mode, name)] == outputs[(mode, "target-only")]
        rows.append(
            dict(
                mode=mode,
                config=name,
                tok_s=statistics.median(tps),
                vs_target_only=statistics.median(tps) / base,
                vs_mode_off=statistics.median(tps) / plain,
                greedy_equals_target_only=same,
                samples=tps,
            )
        )
    print(
        f"\n{'mode':4s} {'config':12s} {'tok/s':>7s} {'vs target-only':>15s} {'vs mode off':>12s}  greedy == target-only"
    )
    for r in rows:
        print(
            f"{r['mode']:4s} {r['config']:12s} {r['tok_s']:7.2f} {r['vs_target_only']:14.2f}x {r['vs_mode_off']:11.2f}x  "
            f"{r['greedy_equals_target_only']}"
        )
    print("plans:", json.dumps(batch_invariant.plans()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                dict(
                    args=vars(args),
                    rows=rows,
                    plans=batch_invariant.plans(),
                    command=command_line(),
                    commit=commit(),
                    machine=machine(),
                    threads=torch.get_num_threads(),
                ),
                f,
                indent=1,
                default=str,
            )


if __name__ == "__main__":
    main()
