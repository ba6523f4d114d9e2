"""A/B of one forward pass: specdecode's HFRunner vs the transformers model with a DynamicCache,
in one process, interleaved (1 token and 5 tokens at context 200; a 64-token prefill).

Usage: python docs/bench/verify-cost/avx2-kernels/forward_ab.py [MODEL] [DTYPE] [THREADS]   (default qwen2.5-coder-1.5b bfloat16 1)
"""

import statistics
import sys
import time

import torch
from transformers import DynamicCache

from specdecode.models.loading import load_model
from specdecode.models.hf import HFRunner

name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b"
dtype = getattr(torch, sys.argv[2] if len(sys.argv) > 2 else "bfloat16")
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
model, _ = load_model(name, dtype)
runner = HFRunner(model, 1, 4101)
ctx = list(range(1000, 1200))
slot = torch.tensor([0])


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


with torch.inference_mode():
    runner.prefill([0], [ctx])
    cache = DynamicCache(config=model.config)
    model(torch.tensor([ctx]), past_key_values=cache, use_cache=True)

    def hf_step():
        model(torch.tensor([[5]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.crop(-1)

    res: dict[str, list[float]] = {}
    for _ in range(4):
        res.setdefault("ours, 1 token", []).append(
            timed(lambda: runner.logits(runner.forward(slot, torch.tensor([[5]]), torch.tensor([[200]])).hidden))
        )
        res.setdefault("transformers, 1 token", []).append(timed(hf_step))
        res.setdefault("ours, 5 tokens", []).append(
            timed(
                lambda: runner.logits(
                    runner.forward(slot, torch.tensor([[5, 6, 7, 8, 9]]), torch.arange(200, 205)[None]).hidden
                )
            )
        )
    prompt = list(range(1000, 1064))
    for _ in range(2):
        res.setdefault("ours, 64-token prefill", []).append(timed(lambda: runner.prefill([0], [prompt])))
        res.setdefault("transformers, 64-token prefill", []).append(
            timed(
                lambda: model(
                    torch.tensor([prompt]),
                    past_key_values=DynamicCache(config=model.config),
                    use_cache=True,
                    logits_to_keep=1,
                )
            )
        )
print(f"{name} {dtype} threads={torch.get_num_threads()}")
for key, times in res.items():
    print(f"{key}: median {statistics.median(times):.3f} s over {len(times)}")
