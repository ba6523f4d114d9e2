"""Issue 43 on the real pair: seeded requests under ``--sampler coupled`` give the target-only tokens
whatever drafts them (drafter, k, batch), and what coupling costs against rejection sampling.

A run resumes: configurations already in ``--out``/results.json are kept (the reference's token ids are
saved beside it in ``reference.json``), the rest are run.

Each configuration runs the same seeded requests (HumanEval dev prompts, the last ``--prompt-tokens``
tokens of each, T and top-p as given): target-only coupled decoding is the reference; every other
configuration's token ids are compared with it (equal, or the first differing position). Acceptance,
tokens per step and decode tok/s are reported for each, and for rejection sampling with the same
draft. Writes ``results.json`` and prints a Markdown table.

    python docs/bench/coupled/coupled_identity.py --backend llamacpp --requests 24 --max-new-tokens 32 \
        --out docs/bench/coupled/<machine>-identity

HumanEval dev has 100 problems; with ``--requests`` above 100 a prompt recurs with another seed.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from specdecode.bench.prompts import HUMANEVAL_DEV, load_humaneval
from specdecode.build import EngineConfig, engine_from_pair, load_pair
from specdecode.sampling import SamplingParams


def run(engine, prompts, params_list, batch: int):
    """Every request through ``engine`` ``batch`` at a time; per request: token ids; totals of the stats."""
    outs, totals = [], {"drafted": 0, "accepted": 0, "steps": 0, "emitted": 0, "decode_s": 0.0}
    for lo in range(0, len(prompts), batch):
        seqs = [engine.add(p, params) for p, params in zip(prompts[lo : lo + batch], params_list[lo : lo + batch])]
        while not all(s.finished for s in seqs):
            t0 = time.perf_counter()
            engine.step()
            if all(s.stats.target_steps for s in seqs):  # past every prefill: a decode step
                totals["decode_s"] += time.perf_counter() - t0
        for s in seqs:
            outs.append(list(s.output_ids))
            totals["drafted"] += s.stats.drafted
            totals["accepted"] += s.stats.accepted
            totals["steps"] += s.stats.target_steps
            totals["emitted"] += len(s.output_ids)
    return outs, totals


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="llamacpp")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batch-invariant", default="auto", choices=("auto", "on", "off"))
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="with --batch-invariant on: also run target-only and draft k=4 on the target loaded as usual "
        "(what invariance costs)",
    )
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="CONFIG",
        help="run only this configuration (its label, e.g. 'draft k=2'; repeat the flag for several): "
        "two processes can share a long run, each on its own --out, merged afterwards",
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    base = EngineConfig(
        args.target,
        args.draft,
        backend=args.backend,
        sampler="coupled",
        max_batch_size=args.batch,
        batch_invariant=args.batch_invariant,
    )
    pair = load_pair(base, args.backend)
    tok = pair.tokenizer
    dev = [
        tok(p.text, add_special_tokens=False).input_ids[-args.prompt_tokens :]
        for p in load_humaneval(None, seed=0, problems=HUMANEVAL_DEV)
    ]
    prompts = [dev[i % len(dev)] for i in range(args.requests)]  # past 100 requests a prompt recurs with a new seed
    params = [
        SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            ignore_eos=True,
            seed=1000 + i,
        )
        for i in range(len(prompts))
    ]
    # (label, drafter spec or None, k, batch, sampler[, pair, config overrides])
    # the widths where kernels change (k >= 4) and the negative control first: a run that stops early
    # has the rows that decide the question (k = 2, verify width 3, was identical even without the mode)
    configs = [("target-only", None, 0, 1, "coupled")]
    configs += [(f"draft k={k}", args.draft, k, 1, "coupled") for k in (4, 8)]
    configs += [
        ("draft k=4, rejection sampling", args.draft, 4, 1, "rejection"),
        (f"draft k=4, batch {args.batch}", args.draft, 4, args.batch, "coupled"),
        ("n-gram k=4", "ngram", 4, 1, "coupled"),
        ("suffix k=4", "suffix", 4, 1, "coupled"),
        (f"n-gram k=4, batch {args.batch}", "ngram", 4, args.batch, "coupled"),
        ("draft k=2", args.draft, 2, 1, "coupled"),
    ]
    if args.baseline:
        usual = replace(base, batch_invariant="off")
        plain = load_pair(usual, args.backend)
        configs += [
            ("target-only, not invariant", None, 0, 1, "coupled", plain, usual),
            ("draft k=4, not invariant", args.draft, 4, 1, "coupled", plain, usual),
        ]
    results, reference = [], None
    saved, ref_file = args.out / "results.json", args.out / "reference.json"
    if saved.exists() and ref_file.exists():  # resume: keep the configurations a stopped run finished
        results = json.loads(saved.read_text())["results"]
        reference = json.loads(ref_file.read_text())
        print(f"resuming: {[r['config'] for r in results]} kept", flush=True)
    known = {c[0] for c in configs}
    if unknown := [c for c in args.only if c not in known]:
        ap.error(f"--only {unknown}: not a configuration of this run; choose from {sorted(known)}")
    for label, draft, k, batch, sampler, *other in configs:
        if any(r["config"] == label for r in results):
            continue
        if args.only and label not in args.only and label != "target-only":  # the reference always runs first
            continue
        which, config = other if other else (pair, base)
        cfg = replace(config, draft=draft, num_draft_tokens=k, sampler=sampler, max_batch_size=batch)
        engine = engine_from_pair(which, cfg)
        outs, tot = run(engine, prompts, [replace(p, sampler=sampler) for p in params], batch)
        if reference is None:
            reference = outs
            args.out.mkdir(parents=True, exist_ok=True)
            ref_file.write_text(json.dumps(reference) + "\n")
        diffs = [first_diff(o, r) for o, r in zip(outs, reference)]
        row = {
            "config": label,
            "sampler": sampler,
            "k": k,
            "batch": batch,
            "requests": len(outs),
            "batch_invariant": cfg.batch_invariant,
            "runner": getattr(engine.target, "where", ""),
            "identical": sum(d is None for d in diffs),
            "first_differences": [d for d in diffs if d is not None],
            "acceptance": tot["accepted"] / tot["drafted"] if tot["drafted"] else None,
            "tokens_per_step": tot["emitted"] / tot["steps"] if tot["steps"] else None,
            "decode_tok_s": (tot["emitted"] - len(outs)) / tot["decode_s"] if tot["decode_s"] else None,
            "drafted": tot["drafted"],
            "accepted": tot["accepted"],
        }
        results.append(row)
        print(json.dumps(row), flush=True)
        args.out.mkdir(parents=True, exist_ok=True)  # after every configuration: a partial run keeps its rows
        (args.out / "results.json").write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1) + "\n"
        )
    ref = results[0]["decode_tok_s"]
    print("| config | sampler | identical to target-only | acceptance | tokens/step | decode tok/s | vs target-only |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        speed = f"{r['decode_tok_s'] / ref:.2f}×" if r["decode_tok_s"] and ref else "–"
        acc = "–" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
        print(
            f"| {r['config']} | {r['sampler']} | {r['identical']} / {r['requests']} | {acc} "
            f"| {r['tokens_per_step']:.2f} | {r['decode_tok_s'] or 0:.2f} | {speed} |"
        )


if __name__ == "__main__":
    main()
