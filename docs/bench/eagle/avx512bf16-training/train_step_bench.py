"""Seconds per EAGLE training step on one feature directory: float32 vs bf16 autocast, with or without
specdecode.allocator's setting (docs/benchmarks.md, session 16). Run each arm in its own process:

    python docs/bench/eagle/avx512bf16-training/train_step_bench.py FEATURES {float32,bfloat16} {none,mallopt}

Prints the median of 7 steps after 2 warm-up steps (same chunks in every arm: seed 0)."""

import sys
import tempfile
import time
from pathlib import Path

import torch

from specdecode.heads import eagle_train
from specdecode.heads.features import FeatureSet
from specdecode.heads.train import Loop

features, dtype, alloc = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(2)
if alloc == "mallopt":
    from specdecode.allocator import retain_freed_memory

    print("allocator setting applied:", retain_freed_memory())


def timed_run(self, step_fn, eval_fn):
    times = []
    for i in range(9):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            loss = step_fn(i)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        times.append(time.perf_counter() - t0)
    print(f"{dtype} {alloc}: median of 7 after 2: {sorted(times[2:])[3]:.2f} s", [f"{t:.2f}" for t in times])
    raise SystemExit(0)


Loop.run = timed_run
settings = eagle_train.EagleSettings(intermediate_size=2816, ttt_steps=3, epochs=0.5)
with tempfile.TemporaryDirectory() as out:
    eagle_train.train(FeatureSet(features), Path(out), settings, "qwen2.5-coder-1.5b", 1000, 0, False)
