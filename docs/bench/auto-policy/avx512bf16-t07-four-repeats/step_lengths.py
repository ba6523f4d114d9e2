"""Per draft length, what the steps of a `specdecode bench` run cost and yielded: for each (sampling,
category, config) and each number of tokens a step drafted, the steps, their mean seconds, mean emitted
tokens (bonus included) and emitted tokens per second. Reads the per-step rows every run record keeps
(``[context, emitted, drafted, accepted, seconds, nodes]``); prefill is not in them. Shows whether the
lengths `--draft-policy auto` picked were the ones that paid on that category (a fixed configuration's
rows at its one length sit beside them). Steps of every drafter are pooled per length.

    python docs/bench/auto-policy/avx512bf16-t07-four-repeats/step_lengths.py runs/auto-bf16-s19 [--category qa] [--sampling t0.7-p0.95]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the bench --out directory")
    ap.add_argument("--category", help="only this category")
    ap.add_argument("--sampling", help="only this sampling setting")
    args = ap.parse_args()
    cells: dict[tuple, list] = defaultdict(list)  # (sampling, category, config, drafted) -> (seconds, emitted)
    for line in (args.out / "records.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("type") != "run" or not r.get("steps"):
            continue
        if (args.category and r["category"] != args.category) or (args.sampling and r["sampling"] != args.sampling):
            continue
        for _, emitted, drafted, _, seconds, _ in r["steps"]:
            cells[(r["sampling"], r["category"], r["config"], drafted)].append((seconds, emitted))
    print("| sampling | category | config | drafted | steps | s / step | tokens / step | tokens / s |")
    print("|---|---|---|---|---|---|---|---|")
    for (sampling, category, config, drafted), rows in sorted(cells.items()):
        seconds = sum(s for s, _ in rows)
        tokens = sum(e for _, e in rows)
        print(
            f"| {sampling} | {category} | {config} | {drafted} | {len(rows)} | {seconds / len(rows):.3f} "
            f"| {tokens / len(rows):.2f} | {tokens / seconds:.2f} |"
        )


if __name__ == "__main__":
    main()
