"""Summarise a `specdecode bench --draft-policy auto` run: per category and sampling, the `auto` config's
speedup over target-only beside every fixed configuration's, auto / best fixed, and the same for the
whole run taken as one mixed workload. Wall time per (prompt, config) is the median over repeats;
prompts are summed; a prompt counts only once every configuration ran it as often.

    python scripts/auto_summary.py runs/auto-mixed [--markdown]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path, help="the bench --out directory")
    args = ap.parse_args()
    runs = [r for r in map(json.loads, (args.out / "records.jsonl").read_text().splitlines()) if r.get("type") == "run"]
    by_run: dict[tuple, list] = defaultdict(list)  # (sampling, prompt, config) -> its runs (one per repeat)
    for r in runs:
        by_run[(r["sampling"], r["prompt_id"], r["config"])].append(r)
    configs = sorted({r["config"] for r in runs}, key=lambda c: (c != "target", c == "auto", c))
    wall: dict[tuple, float] = defaultdict(float)  # (sampling, group, config) -> summed median seconds
    tps: dict[tuple, list] = defaultdict(list)
    for sampling, prompt in sorted({(s, p) for s, p, _ in by_run}):
        cells = [by_run.get((sampling, prompt, c), []) for c in configs]
        repeats = {len(c) for c in cells}
        if len(repeats) != 1 or 0 in repeats:
            continue  # only prompts every configuration ran as often
        for c, rs in zip(configs, cells):
            for group in (rs[0]["category"], "mixed (all prompts)"):
                wall[(sampling, group, c)] += statistics.median(r["wall_s"] for r in rs)
                tps[(sampling, group, c)] += [(r["new_tokens"], r["stats"]["target_steps"]) for r in rs]
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
