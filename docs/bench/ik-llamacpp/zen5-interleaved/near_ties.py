"""Where a greedy speculative run of interleaved.json left its backend's target-only tokens: the target's logits
there (one-token decode after the prompt and target-only's tokens, 2 threads), its top two tokens and their margin,
absolute and relative to the top logit (a numeric near-tie when both tokens are the top two and the margin is small).

    python docs/bench/ik-llamacpp/zen5-interleaved/near_ties.py docs/bench/ik-llamacpp/zen5-interleaved/interleaved.json
"""

import json
import sys

import torch

from specdecode.bench.prompts import HUMANEVAL_TEST, load_humaneval
from specdecode.models.ik_llamacpp import IK
from specdecode.models.llamacpp import MAINLINE, LlamaCppModel, LlamaCppRunner
from specdecode.models.loading import load_gguf_tokenizer, resolve

r = json.load(open(sys.argv[1]))
path = resolve("qwen2.5-coder-1.5b").path
tok = load_gguf_tokenizer(path)
prompts = {p.id: p for p in load_humaneval(len(r["prompts"]), problems=HUMANEVAL_TEST)}


def get(backend, config, prompt):
    return next(x for x in r["runs"] if (x["backend"], x["config"], x["prompt"]) == (backend, config, prompt))


for backend, binding in (("ik_llamacpp", IK), ("llamacpp", MAINLINE)):
    runner = LlamaCppRunner(LlamaCppModel(path, 2, binding=binding), 1, 512)
    for p in r["prompts"]:
        a, s = get(backend, "target", p)["token_ids"], get(backend, f"k{r['k']}", p)["token_ids"]
        i = next((i for i, (x, y) in enumerate(zip(a, s)) if x != y), None)
        if i is None:
            print(backend, p, "identical")
            continue
        ids = tok(prompts[p].text).input_ids + a[:i]
        runner.truncate(0, 0)
        runner.prefill([0], [ids[:-1]])
        out = runner.forward(torch.tensor([0]), torch.tensor([[ids[-1]]]), torch.tensor([[len(ids) - 1]]))
        top = runner.logits(out.hidden)[0, 0].topk(2)
        margin = float(top.values[0] - top.values[1])
        print(
            f"{backend} {p} token {i}: target-only {a[i]}, speculative {s[i]}, top two {top.indices.tolist()}, "
            f"margin {margin:.4f} ({margin / abs(float(top.values[0])):.2%} of the top logit)"
        )
