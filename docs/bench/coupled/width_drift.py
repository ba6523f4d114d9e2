"""Why coupled sampling is not token-identical on llama.cpp: the target's logits for one position depend on
how many tokens the ``llama_decode`` that computes them holds (the verify width).

For each prompt (the last ``--prompt-tokens`` tokens of a HumanEval dev problem) the logits of its last
position are computed ``--max-width`` ways: the history up to ``n`` tokens before the end decoded one token at
a time (as target-only decoding does), then the last ``n`` tokens in one decode (as a k = n - 1 verify does),
for n = 1 .. max-width. Width 1 is the reference. ``--no-repack`` loads the model without llama.cpp's CPU
repack and ``--decode-threads 1`` runs one-token decodes on one thread (what ``--batch-invariant on`` does);
``--prompt-tokens`` past 512 reaches flash attention's split-KV decode path. Reported per width: the largest and mean absolute logit
difference from width 1, how often the greedy argmax changes, and how often the coupled sampler's choice
(Gumbel-max with noise keyed by (seed, position), at ``--temperature``/``--top-p``, over ``--seeds`` seeds)
changes. Writes ``results.json`` and prints a Markdown table.

    python docs/bench/coupled/width_drift.py --out docs/bench/coupled/<machine>-width-drift
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from specdecode.bench.prompts import HUMANEVAL_DEV, load_humaneval
from specdecode.models.fetch import lookup_alias
from specdecode.models.llamacpp import LlamaCppModel, LlamaCppRunner
from specdecode.models.loading import load_gguf_tokenizer
from specdecode.sampling import SamplingParams, race_noise, warp, warp_tensors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-width", type=int, default=9)
    ap.add_argument("--seeds", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--decode-threads", type=int, help="threads of one-token decodes (llama.cpp's n_threads; default --threads)"
    )
    ap.add_argument("--no-repack", action="store_true", help="load the GGUF without llama.cpp's CPU repack")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    path = lookup_alias(args.target) or Path(args.target)
    tok = load_gguf_tokenizer(path)
    texts = [
        tok(p.text, add_special_tokens=False).input_ids for p in load_humaneval(None, seed=0, problems=HUMANEVAL_DEV)
    ]
    prompts = []
    for i in range(args.prompts):  # problem i, preceded by the problems before it when it is shorter
        ids, j = list(texts[i]), i
        while len(ids) < args.prompt_tokens:
            j = (j - 1) % len(texts)
            ids = texts[j] + ids
        prompts.append(ids[-args.prompt_tokens :])
    runner = LlamaCppRunner(
        LlamaCppModel(path, threads=args.threads, repack=not args.no_repack),
        num_slots=1,
        max_len=args.prompt_tokens + 16,
    )
    if args.decode_threads:
        runner.ll.llama_set_n_threads(runner.ctx, args.decode_threads, args.threads)
    slot = torch.tensor([0])

    def decode(tokens: list[int], start: int) -> torch.Tensor:  # one forward of ``tokens``: their logits [n, V]
        out = runner.forward(slot, torch.tensor([tokens]), torch.arange(start, start + len(tokens))[None])
        return out.hidden[0]

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    W = args.max_width
    stats = {n: {"max_abs": 0.0, "sum_mean_abs": 0.0, "greedy_flips": 0, "coupled_flips": 0} for n in range(2, W + 1)}
    for i, ids in enumerate(prompts):
        base = len(ids) - W
        rows = {}
        for n in range(1, W + 1):
            runner.prefill([0], [ids[:base]])  # the prompt's head, one prefill (the slot starts empty)
            for p in range(base, len(ids) - n):  # history one token at a time
                decode([ids[p]], p)
            rows[n] = decode(ids[len(ids) - n :], len(ids) - n)[-1].float()  # the last n tokens in one decode
        ref = rows[1]
        law = {n: warp(rows[n][None], *warp_tensors([params]))[0] for n in rows}
        for s in range(args.seeds):
            noise = race_noise(s, len(ids), ref.shape[-1])
            choice = {n: int((law[n] / noise).argmax()) for n in rows}
            for n in range(2, W + 1):
                stats[n]["coupled_flips"] += choice[n] != choice[1]
        for n in range(2, W + 1):
            d = (rows[n] - ref).abs()
            stats[n]["max_abs"] = max(stats[n]["max_abs"], float(d.max()))
            stats[n]["sum_mean_abs"] += float(d.mean())
            stats[n]["greedy_flips"] += int(rows[n].argmax()) != int(ref.argmax())
        print(
            f"prompt {i}: max |diff| by width",
            {n: round(float((rows[n] - ref).abs().max()), 3) for n in range(2, W + 1)},
            flush=True,
        )
    P = len(prompts)
    table = [
        {
            "width": n,
            "k": n - 1,
            "max_abs_logit_diff": s["max_abs"],
            "mean_abs_logit_diff": s["sum_mean_abs"] / P,
            "greedy_flips": s["greedy_flips"],
            "positions": P,
            "coupled_flip_rate": s["coupled_flips"] / (P * args.seeds),
        }
        for n, s in stats.items()
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": platform.processor() or platform.machine(),
        "runner": runner.where,
    }
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "widths": table}, indent=1))
    print(
        "| width (k + 1) | max abs logit diff vs width 1 | mean abs diff | greedy argmax changed | "
        "coupled choice changed (T, top-p, seeds) |"
    )
    print("|---|---|---|---|---|")
    for r in table:
        print(
            f"| {r['width']} | {r['max_abs_logit_diff']:.3f} | {r['mean_abs_logit_diff']:.4f} | "
            f"{r['greedy_flips']} / {P} | {100 * r['coupled_flip_rate']:.2f} % |"
        )


if __name__ == "__main__":
    main()
