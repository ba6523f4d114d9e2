"""What ``--sampler coupled`` costs in speed against rejection sampling, side by side (issue 43).

One load of the pair (the usual one unless ``--batch-invariant on``). For each prompt and repeat, the same
seeded request (T, top-p, a seed per prompt and repeat) runs four ways, the order rotating: target-only
and the draft model at ``-k``, each under rejection sampling and under the coupled sampler. Reports per
configuration the medians over runs of decode tok/s (draft + verify time) and end-to-end tok/s, acceptance
and tokens per step, and the paired per-run ratios coupled / rejection; and, as a check that coupling was
exercised, how many coupled speculative outputs equal coupled target-only's (rejection sampling's rarely do).

    python docs/bench/coupled/sampler_cost.py --prompts 8 --max-new-tokens 96 --repeats 3 \\
        --out docs/bench/coupled/<machine>-llamacpp-sampler-cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from specdecode.bench.env import command_line, commit, machine
from specdecode.bench.prompts import HUMANEVAL_DEV, load_humaneval
from specdecode.bench.runner import tokenize_prompts
from specdecode.build import EngineConfig, engine_from_pair, load_pair
from specdecode.sampling import SamplingParams

SAMPLERS = ("rejection", "coupled")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="llamacpp", choices=["llamacpp", "torch"])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", type=int, default=8, help="HumanEval dev problems 0..N-1")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--batch-invariant", default="off", choices=["off", "on"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.prompts < 1 or args.repeats < 1 or args.k < 1:
        ap.error("--prompts, --repeats and -k must be >= 1")

    cfg = dict(backend=args.backend, batch_invariant=args.batch_invariant)
    pair = load_pair(EngineConfig(args.target, args.draft, **cfg), args.backend)
    prompts, _ = tokenize_prompts(
        load_humaneval(problems=range(HUMANEVAL_DEV.start, args.prompts)), pair.tokenizer, args.max_new_tokens, 4096
    )
    configs = {"target-only": None, f"draft k={args.k}": args.draft}
    engines = {
        name: engine_from_pair(pair, EngineConfig(args.target, draft, num_draft_tokens=args.k, **cfg))
        for name, draft in configs.items()
    }
    for engine in engines.values():  # warm before anything is timed
        engine.generate([prompts[0].ids], SamplingParams(max_new_tokens=2, temperature=0.0))
    runs = [(name, sampler) for name in configs for sampler in SAMPLERS]
    samples: dict[tuple[str, str], dict[str, list[float]]] = {r: {"decode": [], "end_to_end": []} for r in runs}
    counts = {r: {"drafted": 0, "accepted": 0, "steps": 0, "emitted": 0} for r in runs}
    outputs: dict[tuple[str, str], dict[tuple[int, str], list[int]]] = {r: {} for r in runs}
    n = 0
    for rep in range(args.repeats):
        for i, p in enumerate(prompts):
            seed = 1000 + rep * 1000 + i
            for j in range(len(runs)):
                name, sampler = runs[(n + j) % len(runs)]  # the order rotates: no configuration always first
                sp = SamplingParams(
                    temperature=args.temperature,
                    top_p=args.top_p,
                    seed=seed,
                    max_new_tokens=args.max_new_tokens,
                    ignore_eos=True,
                    sampler=sampler,
                )
                t0 = time.perf_counter()
                out = engines[name].generate([p.ids], sp)[0]
                wall = time.perf_counter() - t0
                st = out.stats
                decode = st.draft_s + st.verify_s
                s = samples[(name, sampler)]
                s["decode"].append((len(out.token_ids) - 1) / decode if decode else float("nan"))
                s["end_to_end"].append(len(out.token_ids) / wall)
                c = counts[(name, sampler)]
                c["drafted"] += st.drafted
                c["accepted"] += st.accepted
                c["steps"] += st.target_steps
                c["emitted"] += st.emitted
                outputs[(name, sampler)][(rep, p.id)] = list(out.token_ids)
                print(
                    f"rep {rep} {p.id:14s} {name:12s} {sampler:9s} decode {s['decode'][-1]:6.2f} tok/s  "
                    f"end to end {s['end_to_end'][-1]:6.2f} tok/s  accepted {st.accepted}/{st.drafted}",
                    flush=True,
                )
            n += 1
    rows = []
    for name, sampler in runs:
        s, c = samples[(name, sampler)], counts[(name, sampler)]
        rej = samples[(name, "rejection")]
        ratio = {k: statistics.median(a / b for a, b in zip(s[k], rej[k])) for k in s}  # paired per run
        ref = outputs[("target-only", sampler)]
        same = sum(outputs[(name, sampler)][key] == ref[key] for key in ref)
        rows.append(
            dict(
                config=name,
                sampler=sampler,
                **{f"{k}_tok_s": statistics.median(v) for k, v in s.items()},
                **{f"{k}_vs_rejection": r for k, r in ratio.items()},
                acceptance=c["accepted"] / c["drafted"] if c["drafted"] else None,
                tokens_per_step=c["emitted"] / c["steps"] if c["steps"] else None,
                equal_to_target_only=same,
                runs=len(ref),
                samples=s,
                **c,
            )
        )
    print(
        "\n| config | sampler | decode tok/s | vs rejection | end to end tok/s | vs rejection | acceptance "
        "| tokens / step | equal to target-only (same sampler) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "–" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
        print(
            f"| {r['config']} | {r['sampler']} | {r['decode_tok_s']:.2f} | {r['decode_vs_rejection']:.3f}× "
            f"| {r['end_to_end_tok_s']:.2f} | {r['end_to_end_vs_rejection']:.3f}× | {acc} "
            f"| {r['tokens_per_step']:.2f} | {r['equal_to_target_only']} / {r['runs']} |"
        )
    where = engines["target-only"].target.where
    print(f"runner: {where}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                dict(
                    args=vars(args), rows=rows, runner=where, command=command_line(), commit=commit(), machine=machine()
                ),
                f,
                indent=1,
                default=str,
            )


if __name__ == "__main__":
    main()
