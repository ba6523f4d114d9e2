"""Cost of one Qwen2.5-1.5B MLP projection (1536 -> 8960) on this CPU as the number of tokens in the
forward grows, bf16 vs float32: on a CPU without native bf16 dot products (no avx512_bf16/AMX) a bf16
matmul is compute-bound, so verifying k + 1 tokens costs about k + 1 single-token steps.

Usage: python docs/bench/verify-cost/avx2-kernels/linear_cost.py [threads]     (prints a Markdown table; fastest of 15 timings: the least disturbed by other processes)
"""

import sys
import time

import torch

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
rows = []
for tokens in (1, 2, 3, 5, 9, 17, 64):
    cells = []
    for dtype in (torch.bfloat16, torch.float32):
        weight = torch.randn(8960, 1536, dtype=dtype)  # [out, in]
        x = torch.randn(tokens, 1536, dtype=dtype)  # [tokens, in]
        for _ in range(2):
            torch.nn.functional.linear(x, weight)
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, weight)
            times.append(time.perf_counter() - t0)
        cells.append(min(times) * 1e3)
    rows.append((tokens, *cells))
base_bf16, base_fp32 = rows[0][1], rows[0][2]
print(
    f"threads: {torch.get_num_threads()}, torch {torch.__version__}, CPU capability "
    f"{torch.backends.cpu.get_cpu_capability()}\n"
)
print("| tokens | bf16 ms | bf16 / 1 token | fp32 ms | fp32 / 1 token |\n|---|---|---|---|---|")
for tokens, bf16, fp32 in rows:
    print(f"| {tokens} | {bf16:.2f} | {bf16 / base_bf16:.1f}× | {fp32:.2f} | {fp32 / base_fp32:.1f}× |")
