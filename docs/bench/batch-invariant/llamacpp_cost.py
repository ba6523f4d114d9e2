"""What ``--batch-invariant on`` costs on the llama.cpp backend, and what it buys (issues 37, 43).

Two loads of the same GGUF pair in one process: as usual (CPU weight repack, decodes as wide as they come)
and in the mode (no repack, one-token decodes on one thread, every decode — prefill chunks included — cut to
the probed invariant width). Interleaved per prompt and repeat (the mode order alternating), greedy:
target-only and the draft model at ``-k``. Reports per configuration the medians over repeats of decode
tok/s (draft + verify time), prefill tok/s and end-to-end tok/s, the mode's ratio to the usual load, and
how many greedy speculative outputs equal target-only's in the same load.

    python docs/bench/batch-invariant/llamacpp_cost.py --prompts 6 --max-new-tokens 64 --repeats 2 \
        --out docs/bench/batch-invariant/<machine>-llamacpp.json
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompts", type=int, default=6, help="HumanEval dev problems 0..N-1")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    pairs = {
        mode: load_pair(EngineConfig(args.target, args.draft, backend="llamacpp", batch_invariant=mode), "llamacpp")
        for mode in ("off", "on")
    }
    prompts, _ = tokenize_prompts(
        load_humaneval(problems=range(HUMANEVAL_DEV.start, args.prompts)),
        pairs["off"].tokenizer,
        args.max_new_tokens,
        4096,
    )
    greedy = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
    configs = {"target-only": None, f"draft k={args.k}": args.draft}
    engines = {
        (mode, name): engine_from_pair(
            pairs[mode],
            EngineConfig(args.target, draft, backend="llamacpp", num_draft_tokens=args.k, batch_invariant=mode),
        )
        for mode in pairs
        for name, draft in configs.items()
    }
    runner = {mode: engines[(mode, "target-only")].target.where for mode in pairs}
    for engine in engines.values():  # warm (and, in the mode, the width probe) before anything is timed
        engine.generate([prompts[0].ids], SamplingParams(max_new_tokens=2, temperature=0.0))
    samples: dict[tuple[str, str], dict[str, list[float]]] = {}
    outputs: dict[tuple[str, str], dict[str, list[int]]] = {}
    for rep in range(args.repeats):
        for i, p in enumerate(prompts):
            modes = ("off", "on") if (rep + i) % 2 == 0 else ("on", "off")
            for mode in modes:
                for name in configs:
                    t0 = time.perf_counter()
                    out = engines[(mode, name)].generate([p.ids], greedy)[0]
                    wall = time.perf_counter() - t0
                    st = out.stats
                    decode = st.draft_s + st.verify_s
                    row = samples.setdefault((mode, name), {"decode": [], "prefill": [], "end_to_end": []})
                    # per prompt and repeat; a configuration's figure is the median of the per-run ratios' parts
                    row["decode"].append((len(out.token_ids) - 1) / decode if decode else float("nan"))
                    row["prefill"].append(len(p.ids) / st.prefill_s if st.prefill_s else float("nan"))
                    row["end_to_end"].append(len(out.token_ids) / wall)
                    outputs.setdefault((mode, name), {})[p.id] = list(out.token_ids)
                    print(
                        f"rep {rep} {p.id:14s} mode {mode:3s} {name:12s} decode {row['decode'][-1]:6.2f} tok/s  "
                        f"prefill {row['prefill'][-1]:6.1f} tok/s  end to end {row['end_to_end'][-1]:6.2f} tok/s",
                        flush=True,
                    )
    rows = []
    for (mode, name), s in samples.items():
        usual = samples[("off", name)]
        ratio = {k: statistics.median(a / b for a, b in zip(s[k], usual[k])) for k in s}  # paired per run
        same = sum(outputs[(mode, name)][pid] == outputs[(mode, "target-only")][pid] for pid in outputs[(mode, name)])
        rows.append(
            dict(
                mode=mode,
                config=name,
                **{f"{k}_tok_s": statistics.median(v) for k, v in s.items()},
                **{f"{k}_vs_usual": r for k, r in ratio.items()},
                greedy_equal_target_only=same,
                prompts=len(prompts),
                samples=s,
            )
        )
    modes_agree = sum(
        outputs[("on", "target-only")][pid] == outputs[("off", "target-only")][pid]
        for pid in outputs[("on", "target-only")]
    )
    print(
        "\n| mode | config | decode tok/s | vs usual | prefill tok/s | vs usual | end to end tok/s | vs usual "
        "| greedy == target-only |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['config']} | {r['decode_tok_s']:.2f} | {r['decode_vs_usual']:.2f}× "
            f"| {r['prefill_tok_s']:.1f} | {r['prefill_vs_usual']:.2f}× | {r['end_to_end_tok_s']:.2f} "
            f"| {r['end_to_end_vs_usual']:.2f}× | {r['greedy_equal_target_only']} / {r['prompts']} |"
        )
    print(f"target-only outputs equal across the two loads: {modes_agree} / {len(prompts)}")
    print(f"runners: {runner}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                dict(
                    args=vars(args),
                    rows=rows,
                    runners=runner,
                    target_only_equal_across_loads=modes_agree,
                    command=command_line(),
                    commit=commit(),
                    machine=machine(),
                ),
                f,
                indent=1,
                default=str,
            )


if __name__ == "__main__":
    main()
