"""Summarise a `specdecode bench --draft-policy auto` run: per category and sampling, the `auto` config's
speedup over target-only beside every fixed configuration's, auto / best fixed, and the same for the
whole run taken as one mixed workload. Wall time per (prompt, config) is the median over repeats;
prompts are summed; a prompt counts only once every configuration ran it as often.

With two or more repeats, auto / best fixed also gets a 95 % bootstrap interval: each (prompt,
config)'s repeats are resampled with replacement, the medians summed again and the ratio taken
(against the best fixed configuration of that resample), 2000 times; the interval is the 2.5 and 97.5
percentiles. It shows how far the ratio moves with which sampled paths (and timings) the repeats
happened to draw: a miss whose interval reaches past the target is not beyond that noise.

    python docs/bench/auto-policy/auto_summary.py runs/auto-mixed
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import numpy as np

RESAMPLES = 2000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path, help="the bench --out directory")
    args = ap.parse_args()
    runs = [r for r in map(json.loads, (args.out / "records.jsonl").read_text().splitlines()) if r.get("type") == "run"]
    by_run: dict[tuple, list] = defaultdict(list)  # (sampling, prompt, config) -> its runs (one per repeat)
    for r in runs:
        by_run[(r["sampling"], r["prompt_id"], r["config"])].append(r)
    configs = sorted({r["config"] for r in runs}, key=lambda c: (c != "target", c == "auto", c))
    walls: dict[tuple, list] = defaultdict(list)  # (sampling, group, config) -> per prompt, its repeats' seconds
    tps: dict[tuple, list] = defaultdict(list)
    for sampling, prompt in sorted({(s, p) for s, p, _ in by_run}):
        cells = [by_run.get((sampling, prompt, c), []) for c in configs]
        repeats = {len(c) for c in cells}
        if len(repeats) != 1 or 0 in repeats:
            continue  # only prompts every configuration ran as often
        for c, rs in zip(configs, cells):
            for group in (rs[0]["category"], "mixed (all prompts)"):
                walls[(sampling, group, c)].append([r["wall_s"] for r in rs])
                tps[(sampling, group, c)] += [(r["new_tokens"], r["stats"]["target_steps"]) for r in rs]
    fixed = [c for c in configs if c not in ("target", "auto")]
    print(
        "| sampling | category | "
        + " | ".join(f"{c}" for c in fixed)
        + " | auto | auto / best fixed [95 %] | auto tok/step |"
    )
    print("|---" * (len(fixed) + 5) + "|")
    rng = np.random.default_rng(0)
    for sampling, group in sorted({(s, g) for s, g, _ in walls}, key=lambda k: (k[0], k[1].startswith("mixed"), k[1])):
        if not walls.get((sampling, group, "target")):
            continue
        per = {c: walls[(sampling, group, c)] for c in configs}
        total = {c: sum(statistics.median(w) for w in per[c]) for c in configs}
        speed = {c: total["target"] / total[c] for c in configs}
        best = max(speed[c] for c in fixed)
        n, steps = map(sum, zip(*tps[(sampling, group, "auto")]))
        cells = " | ".join(f"{speed[c]:.2f}×" for c in fixed)
        interval = _interval(per, fixed, rng)
        print(
            f"| {sampling} | {group} | {cells} | **{speed['auto']:.2f}×** | {speed['auto'] / best:.2f}{interval} "
            f"| {n / steps:.2f} |"
        )


def _interval(per: dict[str, list[list[float]]], fixed: list[str], rng: np.random.Generator) -> str:
    """The 95 % bootstrap interval of auto / best fixed (see the module docstring); '' with one repeat."""
    if min(len(w) for ws in per.values() for w in ws) < 2:
        return ""
    ratios = []
    for _ in range(RESAMPLES):
        total = {c: sum(float(np.median(rng.choice(w, size=len(w)))) for w in ws) for c, ws in per.items()}
        ratios.append(min(total[c] for c in fixed) / total["auto"])  # best fixed time / auto time
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return f" [{lo:.2f}, {hi:.2f}]"


if __name__ == "__main__":
    main()
