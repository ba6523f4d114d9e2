"""Trace `--draft-policy auto`'s catch-up decisions on real prompts: one `auto` engine (the 0.5B GGUF
draft + n-gram lookup beside the bf16 1.5B target, as `docs/bench/auto-policy/auto_bench.sh` runs it) serves Spec-Bench
prompts one after another, as `bench` does, with the `specdecode.selector` logger at DEBUG: every step
a draft model would have to catch up on a sequence, one line with its cost, the tokens left, `ready`
(seconds per token without it), its forecast seconds per token, and the verdict. Then one RESULT line
per request (wall seconds, what `auto` chose).

    python docs/bench/auto-policy/avx512bf16-catch-up-trace/catch_up_trace.py summarization,rag greedy [N_PER_CATEGORY] > trace.log
"""

from __future__ import annotations

import logging
import sys

from specdecode.bench.prompts import load_prompt_set
from specdecode.bench.runner import bench_setting, run_engine, run_seed, tokenize_prompts
from specdecode.build import EngineConfig, engine_from_pair, load_pair


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    categories, samplings = sys.argv[1].split(","), sys.argv[2].split(",")
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    logging.getLogger("specdecode.selector").setLevel(logging.DEBUG)
    cfg = EngineConfig(
        "qwen2.5-coder-1.5b",
        "qwen2.5-coder-0.5b",
        extra_drafts=("ngram",),
        draft_policy="auto",
        max_draft_tokens=8,
        dtype="bfloat16",
        backend="torch",
        draft_quantization="gguf",
        num_draft_tokens=4,
        max_context=4096,
    )
    pair = load_pair(cfg.target, cfg.draft, cfg.dtype, cfg.device, cfg.draft_quantization, backend="torch")
    engine = engine_from_pair(pair, cfg)
    prompts = [p for c in categories for p in load_prompt_set("spec-bench", n, 0, [c])]
    for p in tokenize_prompts(prompts, pair.tokenizer, 48, 4096)[0]:
        for name in samplings:
            params = bench_setting(name).params(seed=run_seed(0, p.id, 0), max_new_tokens=48, ignore_eos=True)
            out = run_engine(engine, p.ids, params)
            print(
                "RESULT",
                p.id,
                p.category,
                name,
                len(p.ids),
                f"wall {out['wall_s']:.1f}",
                out["stats"]["choices"],
                flush=True,
            )
    print("cost model corrections (log of observed / calibrated):", engine.policy.inner.cost.correction)


if __name__ == "__main__":
    main()
