"""What one ``llama_decode`` of n tokens costs on llama.cpp and on ik_llama.cpp (with and without its run-time
repack), the target and the draft, after a context of real code: v(n) = time(n) / time(1) for n = 1..N, logits
for every row (what a verify of n - 1 drafts asks for), and the draft's one-token step against the target's (c).

Each configuration loads its own copy of the GGUF files (both libraries in one process). Per round, every
configuration times every n once (configurations and widths interleaved, so a busy machine's drift hits all
alike); each decode is rolled back after it; the medians over ``--repeats`` rounds are reported.

    python docs/bench/ik-llamacpp/zen5-verify-widths/verify_widths.py --threads 2 --out verify_widths.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from specdecode.models.ik_llamacpp import IK
from specdecode.models.llamacpp import MAINLINE, LlamaCppModel, LlamaCppRunner
from specdecode.models.loading import load_gguf_tokenizer, resolve

CONFIGS = {  # name -> (binding, repack)
    "llamacpp": (MAINLINE, True),  # llama.cpp as this project loads it (its CPU repack buffers on)
    "ik_llamacpp": (IK, True),  # the ik_llamacpp backend as it loads a model (repack_tensors on)
    "ik_llamacpp-norepack": (IK, False),  # the same library, weights as in the file
}


def code_tokens(path: Path, count: int) -> list[int]:
    """``count`` tokens of real code: this repository's engine source."""
    text = (Path(__file__).resolve().parents[4] / "specdecode" / "engine.py").read_text()
    ids = load_gguf_tokenizer(path)(text, add_special_tokens=False).input_ids
    return ids[:count]


class Timer:
    """One model on one configuration, ``context`` tokens prefilled in slot 0."""

    def __init__(self, path: Path, binding, repack: bool, threads: int, context: list[int], follow: list[int]):
        self.model = LlamaCppModel(path, threads, repack=repack, mmap=False, binding=binding)
        self.runner = LlamaCppRunner(self.model, 1, len(context) + len(follow) + 16)
        self.runner.prefill([0], [context])
        self.at, self.follow = len(context), follow
        self.times: dict[int, list[float]] = {}

    def time(self, n: int) -> None:
        r = self.runner
        tokens = [(t, self.at + j, (0,)) for j, t in enumerate(self.follow[:n])]
        start = time.perf_counter()
        r._submit(tokens, True, False)  # one llama_decode, logits for every row
        self.times.setdefault(n, []).append(time.perf_counter() - start)
        r.ll.llama_memory_seq_rm(r.mem, 0, self.at, -1)  # rolled back: the next decode sees the same context


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--widths", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    target, draft = resolve(args.target).path, resolve(args.draft).path
    ids = code_tokens(target, args.context + args.widths)
    context, follow = ids[: args.context], ids[args.context :]
    timers = {}
    for name, (binding, repack) in CONFIGS.items():
        timers[name] = Timer(target, binding, repack, args.threads, context, follow)
        timers[name + " draft"] = Timer(draft, binding, repack, args.threads, context, follow)
    for name, t in timers.items():  # warm-up: each width once, not recorded
        for n in range(1, args.widths + 1):
            t.time(n)
        t.times.clear()
    load = []
    for _ in range(args.repeats):
        load.append(os.getloadavg()[0])
        for name, t in timers.items():
            for n in range(1, args.widths + 1) if not name.endswith(" draft") else (1,):
                t.time(n)
    med = {name: {n: statistics.median(ts) for n, ts in t.times.items()} for name, t in timers.items()}
    result = {
        "target": str(target),
        "draft": str(draft),
        "threads": args.threads,
        "context": args.context,
        "repeats": args.repeats,
        "load_average_1min": load,
        "where": {name: t.runner.where for name, t in timers.items()},
        "median_s": med,
        "v": {name: {n: m[n] / m[1] for n in m} for name, m in med.items() if not name.endswith(" draft")},
        "tok_s": {name: 1 / m[1] for name, m in med.items()},
        "c": {name: med[name + " draft"][1] / med[name][1] for name in CONFIGS},
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"load average (1 min) over the rounds: {min(load):.1f}-{max(load):.1f}; {args.threads} threads")
    print("config                 one token  " + " ".join(f"v({n})" for n in range(2, args.widths + 1)) + "   c")
    for name in CONFIGS:
        v = result["v"][name]
        cells = " ".join(f"{v[n]:4.2f}" for n in range(2, args.widths + 1))
        print(f"{name:22s} {1000 * med[name][1]:6.1f} ms  {cells}  {result['c'][name]:.2f}")


if __name__ == "__main__":
    main()
