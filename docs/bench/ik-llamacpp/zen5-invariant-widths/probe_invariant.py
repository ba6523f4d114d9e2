"""Which decode widths give every row the same bits as one-token decodes, on ik_llama.cpp with and without its
run-time repack and on llama.cpp without repack (what ``--batch-invariant on`` needs; the runner probes the same
thing with PROBE_WIDTH = 8 on the loaded model, LlamaCppRunner.invariant_width): one thread, a seeded random
sequence of 24 tokens, 8 prefilled, the other 16 decoded in chunks of each width.

    python docs/bench/ik-llamacpp/zen5-invariant-widths/probe_invariant.py qwen2.5-coder-1.5b
"""

import sys

import numpy as np
import torch

from specdecode.models.ik_llamacpp import IK
from specdecode.models.llamacpp import MAINLINE, LlamaCppModel, LlamaCppRunner
from specdecode.models.loading import resolve

path = resolve(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b").path
gen = np.random.default_rng(0)
for name, binding, repack in [
    ("ik repack", IK, True),
    ("ik no repack", IK, False),
    ("llamacpp no repack", MAINLINE, False),
]:
    r = LlamaCppRunner(LlamaCppModel(path, 1, repack=repack, binding=binding), 1, 64)
    toks = [int(t) for t in gen.integers(0, 1000, 24)]

    def rows(width: int) -> torch.Tensor:
        r._forget_from(0, 8)
        out: list[torch.Tensor] = []
        for lo in range(8, len(toks), width):
            r._decode([(0, toks[lo : lo + width], lo)], True, False, out, [])
        return torch.cat(out)

    r._forget_from(0, 0)
    r._decode([(0, toks[:8], 0)], False, False, [], [])
    ref = rows(1)
    diff = {w: float((rows(w) - ref).abs().max()) for w in range(2, 10)}
    print(name, "bit-equal widths:", [w for w, d in diff.items() if d == 0.0], "max |diff| of logits:", diff)
