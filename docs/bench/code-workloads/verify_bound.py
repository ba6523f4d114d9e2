"""The most any exact speculation can gain on this machine and backend, from a bench run's own steps.

A decode step that verifies n drafted tokens costs about t(n) = a + b·n (the target reads the pending
token and the n drafts in one forward); target-only costs t1 per token. However many drafts are
accepted, a step emits at most n + 1 tokens, so the decode speedup is at most
(n + 1)·t1 / (a + b·n) < t1 / b (as n grows, with every draft accepted). This takes the median step
time per verified width over every speculative step of a `specdecode bench` run (steps rows are
[context, emitted, drafted, accepted, seconds, nodes]), fits a and b to those medians (widths with at
least MIN_STEPS steps, each width weighing the same: the common width k = 4 would otherwise decide the
slope alone), and prints per width the bound with every draft accepted, and the limit t1 / b.

    python docs/bench/code-workloads/verify_bound.py docs/bench/code-workloads/avx2-llamacpp-code-edit-8-full
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

MIN_STEPS = 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="a bench --out folder")
    args = ap.parse_args()
    runs = [
        r
        for r in map(json.loads, (args.out / "records.jsonl").read_text().splitlines())
        if r.get("type") == "run" and r.get("steps")
    ]
    t1 = float(np.median([s[4] for r in runs if r["config"] == "target" for s in r["steps"][1:]]))
    by_width: dict[int, list[float]] = defaultdict(list)
    for r in runs:
        if r["config"] == "target":
            continue
        for s in r["steps"][1:]:  # the first step also reads the prompt's last token and starts drafters
            by_width[s[5] if len(s) > 5 else s[2]].append(s[4])
    widths = sorted(n for n, ts in by_width.items() if len(ts) >= MIN_STEPS)
    xs = np.array(widths, dtype=float)
    ys = np.array([np.median(by_width[n]) for n in widths])
    a, b = np.linalg.lstsq(np.vstack([np.ones_like(xs), xs]).T, ys, rcond=None)[0]
    print(
        f"target-only step t1 = {1000 * t1:.1f} ms; fit t(n) = {1000 * a:.1f} + {1000 * b:.1f}·n ms "
        f"(medians of {len(widths)} widths with >= {MIN_STEPS} steps)"
    )
    print("| drafted tokens verified n | steps | median step (ms) | speedup bound, all n accepted |")
    print("|---|---|---|---|")
    for n in sorted(by_width):
        med = float(np.median(by_width[n]))
        print(f"| {n} | {len(by_width[n])} | {1000 * med:.1f} | {(n + 1) * t1 / med:.2f}× |")
    print(f"limit t1 / b = {t1 / b:.2f}× (every draft accepted, drafts of any length)")


if __name__ == "__main__":
    main()
