"""llama.cpp and ik_llama.cpp side by side in one process: target-only decoding and the 0.5B draft at k = 4, greedy,
on HumanEval held-out prompts, the four (backend, config) runs of each prompt back to back in an order that rotates
per prompt, so a busy machine's drift hits all of them alike (what two `specdecode bench` runs one after the other
cannot do on a shared machine).

Per run: decode tok/s = (generated tokens - 1) / (wall time - prefill time) (the first token comes with the
prefill), end-to-end tok/s = generated / wall, and the tokens, so greedy identity is checked per backend
(speculative == target-only) and across backends (informational: two libraries, two sets of kernels).

    python docs/bench/ik-llamacpp/zen5-interleaved/interleaved_decode.py --prompts 6 --out interleaved.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from specdecode.bench.prompts import HUMANEVAL_TEST, load_humaneval
from specdecode.config import EngineSettings
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.engine import Engine
from specdecode.models.ik_llamacpp import IK
from specdecode.models.llamacpp import MAINLINE, LlamaCppModel, LlamaCppRunner
from specdecode.models.loading import load_gguf_tokenizer, resolve
from specdecode.sampling import SamplingParams

BINDINGS = {"llamacpp": MAINLINE, "ik_llamacpp": IK}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    target, draft = resolve(args.target).path, resolve(args.draft).path
    tok = load_gguf_tokenizer(target)
    prompts = load_humaneval(args.prompts, problems=HUMANEVAL_TEST)
    settings = EngineSettings(max_batch_size=1, max_context=1024)
    engines = {}
    for name, binding in BINDINGS.items():
        t = LlamaCppModel(target, args.threads, mmap=False, binding=binding)
        d = LlamaCppModel(draft, args.threads, mmap=False, binding=binding)
        engines[(name, "target")] = Engine(LlamaCppRunner(t), tok, None, 0, settings)
        engines[(name, f"k{args.k}")] = Engine(
            LlamaCppRunner(t), tok, DraftModelDrafter(LlamaCppRunner(d)), args.k, settings
        )
    sp = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    keys = list(engines)
    for key in keys:  # warm-up, not recorded
        engines[key].generate([tok("def f(x):\n").input_ids], SamplingParams(max_new_tokens=8, ignore_eos=True))
    runs = []
    for i, prompt in enumerate(prompts):
        ids = tok(prompt.text).input_ids
        for key in keys[i % len(keys) :] + keys[: i % len(keys)]:
            load = os.getloadavg()[0]
            start = time.perf_counter()
            out = engines[key].generate([ids], sp)[0]
            wall = time.perf_counter() - start
            n = len(out.token_ids) - len(ids) if out.token_ids[: len(ids)] == ids else len(out.token_ids)
            runs.append(
                {
                    "prompt": prompt.id,
                    "backend": key[0],
                    "config": key[1],
                    "tokens": n,
                    "wall_s": wall,
                    "prefill_s": out.stats.prefill_s,
                    "decode_tok_s": (n - 1) / (wall - out.stats.prefill_s),
                    "e2e_tok_s": n / wall,
                    "drafted": out.stats.drafted,
                    "accepted": out.stats.accepted,
                    "token_ids": list(out.token_ids),
                    "load_1min": load,
                }
            )
            print(f"{prompt.id:16s} {key[0]:12s} {key[1]:7s} decode {runs[-1]['decode_tok_s']:6.2f} tok/s", flush=True)
    table = {}
    for key in keys:
        mine = [r for r in runs if (r["backend"], r["config"]) == key]
        table["/".join(key)] = {
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in mine),
            "e2e_tok_s": statistics.median(r["e2e_tok_s"] for r in mine),
            "acceptance": sum(r["accepted"] for r in mine) / max(1, sum(r["drafted"] for r in mine)),
        }

    def by(backend, config):
        return {r["prompt"]: r for r in runs if r["backend"] == backend and r["config"] == config}

    identical = {
        name: all(by(name, f"k{args.k}")[p]["token_ids"] == r["token_ids"] for p, r in by(name, "target").items())
        for name in BINDINGS
    }
    same_across = sum(
        by("ik_llamacpp", "target")[p]["token_ids"] == r["token_ids"] for p, r in by("llamacpp", "target").items()
    )
    ratio = {  # per prompt, then the median: ik over llama.cpp, same config
        cfg: statistics.median(
            by("ik_llamacpp", cfg)[p]["decode_tok_s"] / r["decode_tok_s"] for p, r in by("llamacpp", cfg).items()
        )
        for cfg in ("target", f"k{args.k}")
    }
    result = {
        "target": str(target),
        "draft": str(draft),
        "threads": args.threads,
        "prompts": [p.id for p in prompts],
        "max_new_tokens": args.max_new_tokens,
        "k": args.k,
        "medians": table,
        "ik_over_llamacpp_decode": ratio,
        "greedy_identical_to_target_only": identical,
        "prompts_with_same_tokens_on_both_backends": same_across,
        "load_1min": [r["load_1min"] for r in runs],
        "runs": runs,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "load_1min")}, indent=1))
    print(f"load average (1 min): {min(result['load_1min']):.1f}-{max(result['load_1min']):.1f}")


if __name__ == "__main__":
    main()
