"""How much should a sequence's own recent steps count against its drafter's history? Replays the
steps of fixed-drafter runs from `specdecode bench` records through the selector's own estimate
(`specdecode.selector`: discounted per-sequence counts, `decay` per step, plus the drafter's history,
discounted `prior_decay` per step over all sequences, worth `prior_weight` tokens), and scores how
likely each step's accepted count was under the estimate made before it (geometric acceptance per
token, censored at the drafted length: the same law the selector's arithmetic assumes). Higher mean
log-likelihood per step = a better forecast. Runs are replayed in the order the bench ran them
(`finished_at`), and, as a mixed workload, in shuffled orders (history mixing every category).
With ``--fit``: whether that geometric law fits each cell's steps at all (measured mean tokens of a
k-token draft against the law's, at the cell's pooled per-token rate).

    python docs/bench/auto-policy/avx512bf16-acceptance-prior/acceptance_prior.py runs/auto-bf16-s19 [runs/auto-bf16-s18 ...] \
        [--config spec-k4@gguf] [--config 'spec-k4[ngram]'] [--grid 0.7:3,0.7:10,0.9:20]
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import defaultdict
from pathlib import Path

from specdecode.selector import AutoPolicy


def replay(runs: list[list[tuple[int, int]]], decay: float, weight: float) -> tuple[float, int]:
    """Sum of log-likelihoods and number of steps; ``runs``: per run, its (drafted, accepted) steps,
    fed to a real :class:`AutoPolicy` (its ``observe`` and ``estimate``, nothing re-derived here)."""
    policy = AutoPolicy(["d"], max_k=16, decay=decay, prior_weight=weight)
    total, n = 0.0, 0
    for steps in runs:
        seq = object()  # a request: the policy keys its state by identity
        for drafted, accepted in steps:
            alpha = max(policy.estimate(seq, "d")[0], 1e-3)
            total += accepted * math.log(alpha) + (math.log(1 - alpha) if accepted < drafted else 0.0)
            n += 1
            policy._state(seq).choice = ("d", drafted)  # as if the plan had asked for that many
            policy.observe(seq, drafted, accepted)
        policy.forget(seq)
    return total, n


def fit(runs: list[list[tuple[int, int]]]) -> tuple[float, list[float], list[float]]:
    """Does the geometric law fit? The pooled per-token rate (accepted / (accepted + rejections)) of
    steps drafting the run's usual length ``K``, and for each k <= K the measured mean tokens a
    k-token draft would have emitted (1 + min(accepted, k): the first k positions do not depend on
    what is drafted after them) beside the law's 1 + alpha + ... + alpha^k."""
    steps = [(d, a) for run in runs for d, a in run]
    K = max(d for d, _ in steps)
    steps = [(d, a) for d, a in steps if d == K]
    accepted = sum(a for _, a in steps)
    alpha = accepted / max(accepted + sum(a < d for d, a in steps), 1)
    measured = [1 + sum(min(a, k) for _, a in steps) / len(steps) for k in range(1, K + 1)]
    law = [1 + sum(alpha**j for j in range(1, k + 1)) for k in range(1, K + 1)]
    return alpha, measured, law


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outs", nargs="+", type=Path, help="bench --out directories")
    ap.add_argument(
        "--config", action="append", help="fixed-drafter configurations (default: spec-k4@gguf and spec-k4[ngram])"
    )
    ap.add_argument(
        "--grid", default="0.7:3,0.7:5,0.7:10,0.85:10,0.9:10,0.9:20", help="decay:prior_weight pairs, comma-separated"
    )
    ap.add_argument("--shuffles", type=int, default=5, help="shuffled (mixed-workload) orders per file")
    ap.add_argument("--fit", action="store_true", help="instead: does the geometric law fit each cell's steps?")
    args = ap.parse_args()
    grid = [tuple(float(x) for x in pair.split(":")) for pair in args.grid.split(",")]
    configs = args.config or ["spec-k4@gguf", "spec-k4[ngram]"]
    if args.fit:
        print("| config | sampling | category | alpha | tokens of a k-token draft, measured / law (k = 1, 2, ...) |")
        print("|---|---|---|---|---|")
    else:
        columns = " | ".join(f"{d:g} / {w:g}" for d, w in grid)
        print(f"| config | order | sampling | category | steps | {columns} |")
        print("|---|---|---|---|---|" + "---|" * len(grid))
    for config in configs:
        cells: dict[tuple, dict] = defaultdict(lambda: defaultdict(float))
        pooled: dict[tuple, list] = defaultdict(list)
        for out in args.outs:
            runs = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
            runs = sorted(
                (r for r in runs if r.get("type") == "run" and r.get("config") == config and r.get("steps")),
                key=lambda r: r.get("finished_at", 0),
            )
            steps = [[(d, a) for _, _, d, a, _, _ in r["steps"] if d > 0] for r in runs]
            groups = defaultdict(list)  # (sampling, category) -> runs in bench order
            for r, s in zip(runs, steps):
                groups[(r["sampling"], r["category"])].append(s)
                groups[(r["sampling"], "all")].append(s)
            if args.fit:  # pooled over the files
                for key, group in groups.items():
                    pooled[key].extend(group)
                continue
            for (sampling, category), group in groups.items():
                cell = cells[("bench", sampling, category)]
                for g in grid:
                    ll, n = replay(group, *g)
                    cell[g] += ll
                cell["n"] += n
                if category == "all":  # the same runs as a mixed workload: each file's runs shuffled
                    cell = cells[("shuffled", sampling, "all")]
                    for seed in range(args.shuffles):
                        mixed = list(group)
                        random.Random(seed).shuffle(mixed)
                        for g in grid:
                            cell[g] += replay(mixed, *g)[0] / args.shuffles
                    cell["n"] += n
        for (sampling, category), group in sorted(pooled.items()):
            if category != "all":
                alpha, measured, law = fit(group)
                pairs = ", ".join(f"{m:.2f} / {g:.2f}" for m, g in zip(measured, law))
                print(f"| {config} | {sampling} | {category} | {alpha:.2f} | {pairs} |")
        for (order, sampling, category), row in sorted(cells.items()):
            n = row["n"] or 1
            best = max(grid, key=lambda g: row[g])
            vals = " | ".join(f"**{row[g] / n:.3f}**" if g == best else f"{row[g] / n:.3f}" for g in grid)
            print(f"| {config} | {order} | {sampling} | {category} | {int(row['n'])} | {vals} |")


if __name__ == "__main__":
    main()
