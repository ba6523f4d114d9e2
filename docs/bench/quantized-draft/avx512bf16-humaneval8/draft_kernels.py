"""Which kernel makes the 0.5B draft cheapest on this CPU? One token (and a few) through each linear shape
of Qwen2.5-Coder-0.5B (hidden 896, intermediate 4864, vocabulary 151936), for every implementation
`--draft-quantization` can choose: bf16 / float32 matmul, int8 weight-only (`aten._weight_int8pack_mm`,
bf16 or float32 activations), dynamic int8 (`torch.ao`, fbgemm: float32 activations, a bf16 model's cast
around it) and int4 weight-only (`aten._weight_int4pack_mm_for_cpu`). Prints a Markdown table of the fastest of 20 timings per cell and the
sum over one decoder forward (24 layers + LM head).

Usage: python docs/bench/quantized-draft/avx512bf16-humaneval8/draft_kernels.py [threads]
"""

import sys
import time

import torch
from torch import nn

from specdecode.models.quantize import DynamicInt8Linear, Int4WeightOnlyLinear, Int8WeightOnlyLinear

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
LAYERS = 24
# (name, in, out, count per forward)
SHAPES = [
    ("q/o proj", 896, 896, 2),
    ("k/v proj", 896, 128, 2),
    ("gate/up", 896, 4864, 2),
    ("down", 4864, 896, 1),
    ("lm head", 896, 151936, 1 / LAYERS),
]


def timed(fn, x, reps=20):
    with torch.inference_mode():
        for _ in range(3):
            fn(x)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(x)
            best = min(best, time.perf_counter() - t0)
    return best * 1e3


def kernels(linear_f32: nn.Linear):
    bf16 = nn.Linear(linear_f32.in_features, linear_f32.out_features, bias=False, dtype=torch.bfloat16)
    bf16.weight.data.copy_(linear_f32.weight.data)
    return {
        "bf16": (bf16, torch.bfloat16),
        "fp32": (linear_f32, torch.float32),
        "int8 w-only, bf16 act": (Int8WeightOnlyLinear(bf16), torch.bfloat16),
        "int8 w-only, fp32 act": (Int8WeightOnlyLinear(linear_f32), torch.float32),
        "int8 dynamic, fp32 act": (DynamicInt8Linear(linear_f32), torch.float32),
        "int8 dynamic, bf16 act (cast)": (DynamicInt8Linear(bf16), torch.bfloat16),
        "int4 w-only": (Int4WeightOnlyLinear(bf16), torch.bfloat16),
    }


def main():
    print(
        f"threads {torch.get_num_threads()}, torch {torch.__version__}, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}\n"
    )
    for tokens in (1, 5):
        totals = {}
        lines = []
        for name, fan_in, fan_out, count in SHAPES:
            lin = nn.Linear(fan_in, fan_out, bias=False).requires_grad_(False)
            cells = {}
            for kname, (mod, dtype) in kernels(lin).items():
                x = torch.randn(tokens, fan_in, dtype=dtype)
                ms = timed(mod, x)
                cells[kname] = ms
                totals[kname] = totals.get(kname, 0.0) + ms * count * LAYERS
            lines.append((name, cells))
        names = list(totals)
        print(f"### {tokens} token(s)\n")
        print("| shape | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
        for name, cells in lines:
            print(f"| {name} | " + " | ".join(f"{cells[k]:.3f}" for k in names) + " |")
        print(
            "| **one forward (24 layers + head), ms** | " + " | ".join(f"**{totals[k]:.1f}**" for k in names) + " |\n"
        )


if __name__ == "__main__":
    main()
