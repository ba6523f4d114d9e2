"""What padding a ragged prefill costs, and what grouping rows by length saves: one chunk of prompt
rows of unlike length through ``HFRunner.prefill``, all rows padded into one forward (the old way,
``slack`` = infinity) vs grouped by ``pack_rows`` (the default). Fastest of ``repeats`` timings.

Usage: python docs/bench/prefill-latency/avx512bf16-ragged-prefill/ragged_prefill_cost.py [MODEL] [THREADS] [REPEATS]
       (default qwen2.5-coder-1.5b, 2 threads, 3 repeats; bf16 where the CPU has native bf16, else float32)
"""

from __future__ import annotations

import sys
import time

import torch

from specdecode.models import hf
from specdecode.models.device import resolve_dtype
from specdecode.models.loading import load_model

CASES = {  # rows of one prefill call: (name, lengths)
    "tail of one prompt + head of the next (a 256-token chunk)": [40, 216],
    "four rows of 256, 158, 30, 120 (catch-ups on prompts of unlike length)": [256, 158, 30, 120],
    "16 short prompts beside one long one": [256] + [24] * 15,
}


def timed(runner, lengths, repeats):
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(n)] for i, n in enumerate(lengths)]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.prefill(list(range(len(lengths))), prompts)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    spec = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b"
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    dtype = resolve_dtype("auto", "cpu")
    model, _ = load_model(spec, dtype)
    runner = hf.HFRunner(model, num_slots=16, max_len=512)
    timed(runner, [16, 8], 1)  # warm-up
    print(f"{spec}, {dtype}, {torch.get_num_threads()} threads, fastest of {repeats}\n")
    print(
        "| rows | real tokens | one padded forward: tokens / s | grouped (pack_rows): tokens / s | grouped / padded |"
    )
    print("|---|---|---|---|---|")
    for name, lengths in CASES.items():
        padded_tokens = len(lengths) * max(lengths)
        grouped_tokens = sum(len(g) * max(lengths[i] for i in g) for g in hf.pack_rows(lengths))
        hf.PAD_SLACK = float("inf")
        padded = timed(runner, lengths, repeats)
        hf.PAD_SLACK = 0.25
        grouped = timed(runner, lengths, repeats)
        print(
            f"| {name} | {sum(lengths)} | {padded_tokens} / {padded:.2f} | {grouped_tokens} / {grouped:.2f} | "
            f"{grouped / padded:.2f} |"
        )


if __name__ == "__main__":
    main()
