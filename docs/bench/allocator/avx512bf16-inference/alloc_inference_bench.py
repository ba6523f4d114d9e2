"""Inference with and without specdecode.allocator's glibc setting: seconds and minor page faults of
the target's prompt prefill, a decode step (1 token) and a verify step (5 tokens) at that context.
Run each arm in its own process and alternate them (the machine is shared and noisy):

    for i in 1 2; do for a in none mallopt; do python docs/bench/allocator/avx512bf16-inference/alloc_inference_bench.py $a; done; done

Usage: python docs/bench/allocator/avx512bf16-inference/alloc_inference_bench.py {none,mallopt} [MODEL] [DTYPE] [PROMPT_TOKENS] [THREADS]
(default qwen2.5-coder-1.5b bfloat16 768 2). Prints one JSON line: medians per operation."""

import json
import resource
import statistics
import sys
import time

import torch

alloc = sys.argv[1]
name = sys.argv[2] if len(sys.argv) > 2 else "qwen2.5-coder-1.5b"
dtype = getattr(torch, sys.argv[3] if len(sys.argv) > 3 else "bfloat16")
n_prompt = int(sys.argv[4]) if len(sys.argv) > 4 else 768
torch.set_num_threads(int(sys.argv[5]) if len(sys.argv) > 5 else 2)
if alloc == "mallopt":
    from specdecode.allocator import retain_freed_memory

    assert retain_freed_memory()
elif alloc != "none":
    raise SystemExit("first argument: none or mallopt")

from specdecode.models.hf import HFRunner  # noqa: E402
from specdecode.models.loading import load_model  # noqa: E402

model, _ = load_model(name, dtype)
runner = HFRunner(model, 1, n_prompt + 64)
prompt = [1000 + (i * 7919) % 20000 for i in range(n_prompt)]
slot = torch.tensor([0])


def measured(fn) -> tuple[float, int]:
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


def step(width: int):
    ids = torch.arange(5, 5 + width)[None]
    pos = torch.arange(n_prompt, n_prompt + width)[None]
    return runner.logits(runner.forward(slot, ids, pos).hidden)


ops = {
    "prefill": (lambda: runner.prefill([0], [prompt]), 3),
    "decode 1": (lambda: step(1), 12),
    "verify 5": (lambda: step(5), 12),
}
out = {
    "alloc": alloc,
    "model": name,
    "dtype": str(dtype),
    "prompt_tokens": n_prompt,
    "threads": torch.get_num_threads(),
}
with torch.inference_mode():
    runner.prefill([0], [prompt])  # warm-up: pages in the weights
    step(1), step(5)
    for op, (fn, reps) in ops.items():
        runs = [measured(fn) for _ in range(reps)]
        out[op] = {
            "median_s": round(statistics.median(t for t, _ in runs), 4),
            "minor_faults": int(statistics.median(f for _, f in runs)),
        }
print(json.dumps(out))
