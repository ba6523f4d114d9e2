"""Summarise a `specdecode bench --draft-policy auto` run: per category and sampling, the `auto` config's
speedup over target-only beside every fixed configuration's, auto / best fixed, and the same for the
whole run taken as one mixed workload (sums of wall time over every prompt).

    python scripts/auto_summary.py runs/auto-mixed [--markdown]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path, help="the bench --out directory")
    args = ap.parse_args()
    runs = [r for r in map(json.loads, (args.out / "records.jsonl").read_text().splitlines()) if r.get("type") == "run"]
    wall: dict[tuple, float] = defaultdict(float)  # (sampling, group, config) -> seconds
    tps: dict[tuple, list] = defaultdict(list)
    complete = defaultdict(set)  # (sampling, prompt) -> configs run
    for r in runs:
        complete[(r["sampling"], r["prompt_id"])].add(r["config"])
    configs = sorted({r["config"] for r in runs}, key=lambda c: (c != "target", c == "auto", c))
    for r in runs:
        if complete[(r["sampling"], r["prompt_id"])] != set(configs):
            continue  # only prompts every configuration finished
        for group in (r["category"], "mixed (all prompts)"):
            wall[(r["sampling"], group, r["config"])] += r["wall_s"]
            tps[(r["sampling"], group, r["config"])].append((r["new_tokens"], r["stats"]["target_steps"]))
    fixed = [c for c in configs if c not in ("target", "auto")]
    print("| sampling | category | " + " | ".join(f"{c}" for c in fixed) + " | auto | auto / best fixed | auto tok/step |")
    print("|---" * (len(fixed) + 5) + "|")
    for sampling, group in sorted({(s, g) for s, g, _ in wall}, key=lambda k: (k[0], k[1].startswith("mixed"), k[1])):
        base = wall.get((sampling, group, "target"))
        if not base:
            continue
        speed = {c: base / wall[(sampling, group, c)] for c in configs if wall.get((sampling, group, c))}
        best = max(speed[c] for c in fixed)
        n, steps = map(sum, zip(*tps[(sampling, group, "auto")]))
        cells = " | ".join(f"{speed[c]:.2f}×" for c in fixed)
        print(f"| {sampling} | {group} | {cells} | **{speed['auto']:.2f}×** | {speed['auto'] / best:.2f} | {n / steps:.2f} |")


if __name__ == "__main__":
    main()
