"""Target-only vs fixed-k vs acceptance-driven draft length vs the same with the draft's confidence
ending chains early (--draft-confidence), interleaved per prompt, one process.

Usage: python docs/bench/draft-model/avx2-fp32-length-policy/policy_ab.py [N_PROMPTS] [MAX_NEW_TOKENS] [DTYPE] [K]
Prints decode tok/s (prefill excluded) per configuration and prompt, and medians.
"""

import statistics
import sys
import time

import torch

from specdecode.bench.prompts import load_prompt_set
from specdecode.build import EngineConfig, engine_from_pair, load_pair
from specdecode.sampling import SamplingParams

n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
max_new = int(sys.argv[2]) if len(sys.argv) > 2 else 64
dtype = sys.argv[3] if len(sys.argv) > 3 else "auto"
k = int(sys.argv[4]) if len(sys.argv) > 4 else 4
torch.set_num_threads(1)
pair = load_pair("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", dtype)
configs = {
    "target": EngineConfig("t", None, num_draft_tokens=0, dtype=dtype),
    f"fixed-k{k}": EngineConfig("t", "d", num_draft_tokens=k, dtype=dtype),
    f"acceptance-k{k}..16": EngineConfig(
        "t", "d", num_draft_tokens=k, dtype=dtype, draft_policy="acceptance", max_draft_tokens=16
    ),
    f"acceptance-k{k}..16+conf0.4": EngineConfig(
        "t", "d", num_draft_tokens=k, dtype=dtype, draft_policy="acceptance", max_draft_tokens=16, draft_confidence=0.4
    ),
    "fixed-k12+conf0.4": EngineConfig("t", "d", num_draft_tokens=12, dtype=dtype, draft_confidence=0.4),
}
engines = {name: engine_from_pair(pair, cfg) for name, cfg in configs.items()}
sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
engines["target"].generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))  # warm-up: page in the weights
rates: dict[str, list[float]] = {name: [] for name in engines}
for i, prompt in enumerate(load_prompt_set("humaneval", n=n)):
    ids = pair.tokenizer(prompt.text, add_special_tokens=False).input_ids
    r = i % len(engines)
    order = list(engines)[r:] + list(engines)[:r]  # rotate so drift hits all alike
    for name in order:
        t0 = time.perf_counter()
        out = engines[name].generate([ids], sp)[0]
        decode_s = time.perf_counter() - t0 - out.stats.prefill_s
        rates[name].append(len(out.token_ids) / decode_s)
        print(
            f"{prompt.id} {name}: {rates[name][-1]:.3f} tok/s decode, tokens/step {out.stats.tokens_per_step:.2f}, "
            f"acceptance {out.stats.acceptance_rate}",
            flush=True,
        )
for name, r in rates.items():
    print(
        f"median {name}: {statistics.median(r):.3f} tok/s decode ({statistics.median(r) / statistics.median(rates['target']):.2f}x)"
    )
