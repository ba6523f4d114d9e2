"""Float32 linear kernels on this CPU: MKL sgemm (`F.linear`) vs oneDNN (`mkldnn_linear`) vs MKL
packed sgemm on the target's shapes as the token count m grows, then a whole-forward A/B of the target
with every nn.Linear swapped for oneDNN (1 vs 5 vs 8 tokens at context 200, medians of 3).

Usage: python docs/bench/verify-cost/avx2-kernels/fp32_kernels.py [MODEL] [THREADS]   (default qwen2.5-coder-1.5b, 1 thread)
"""

import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from specdecode.models.loading import load_model
from specdecode.models.hf import HFRunner

name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b"
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)


def median_time(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


print("| weight | m | F.linear ms | MKL packed ms | oneDNN ms |\n|---|---|---|---|---|")
for out_f, in_f in ((8960, 1536), (151936, 1536)):
    w = torch.randn(out_f, in_f)
    w_dnn, b_dnn = w.to_mkldnn(), torch.zeros(out_f).to_mkldnn()
    for m in (1, 5, 8):
        x = torch.randn(m, in_f)
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
        cells = [
            median_time(lambda: F.linear(x, w)),
            median_time(lambda: torch.ops.mkl._mkl_linear(x, packed, w, None, m)),
            median_time(lambda: torch._C._nn.mkldnn_linear(x.to_mkldnn(), w_dnn, b_dnn).to_dense()),
        ]
        print(f"| {out_f}×{in_f} | {m} | " + " | ".join(f"{c * 1e3:.1f}" for c in cells) + " |", flush=True)


class OneDNNLinear(nn.Module):
    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.out_features = lin.out_features
        self.w = lin.weight.detach().to_mkldnn()
        bias = lin.bias.detach() if lin.bias is not None else torch.zeros(lin.out_features)
        self.b = bias.to_mkldnn()

    def forward(self, x):
        y = torch._C._nn.mkldnn_linear(x.reshape(-1, x.shape[-1]).contiguous().to_mkldnn(), self.w, self.b)
        return y.to_dense().reshape(*x.shape[:-1], self.out_features)


model, _ = load_model(name, torch.float32)
runner = HFRunner(model, 1, 1024)
slot = torch.tensor([0])


def forward(m: int):
    return runner.logits(runner.forward(slot, torch.arange(5, 5 + m)[None], torch.arange(200, 200 + m)[None]).hidden)


with torch.inference_mode():
    runner.prefill([0], [list(range(1000, 1200))])
    reference = forward(5)
    for tag in ("F.linear", "oneDNN"):
        if tag == "oneDNN":
            for module in list(model.modules()):
                for child_name, child in list(module.named_children()):
                    if isinstance(child, nn.Linear):
                        setattr(module, child_name, OneDNNLinear(child))
            diff = (forward(5) - reference).abs().max().item()
            print(f"oneDNN vs F.linear logits, 5 tokens: max |diff| {diff:.2e}")
        times = {m: median_time(lambda: forward(m), reps=3) for m in (1, 5, 8)}
        print(
            f"{name} float32 {tag}: "
            + ", ".join(f"{m} tokens {t:.3f} s" for m, t in times.items())
            + f"; v(5) = {times[5] / times[1]:.2f}",
            flush=True,
        )
