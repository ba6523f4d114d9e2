"""TTFT and ITL of a `specdecode load` run split by prompt kind (HumanEval vs Spec-Bench category),
per endpoint and level: where a mixed-length workload's long prompts pay.

Usage: python scripts/load_by_kind.py runs/prefill-latency/load/requests.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import numpy as np


def kind(prompt_id: str) -> str:
    return "humaneval" if prompt_id.startswith("HumanEval") else "spec-bench"


def main(path: str) -> None:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for line in open(path, encoding="utf-8"):
        row = json.loads(line)
        if row["error"] is None and row["ttft_s"] is not None:
            groups[(row["level"], row["endpoint"], kind(row["prompt_id"]))].append(row)
    print("| level | endpoint | prompts | n | prompt tokens p50 | TTFT p50 / p99 / max (s) | ITL p99 (s) |")
    print("|---|---|---|---|---|---|---|")
    for (level, endpoint, k), rows in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        ttft = np.array([r["ttft_s"] for r in rows])
        itl = np.array([g for r in rows for g in r["itl_s"]] or [np.nan])
        tokens = np.median([r.get("prompt_tokens") or 0 for r in rows])
        print(f"| {level:g} | {endpoint} | {k} | {len(rows)} | {tokens:.0f} | {np.percentile(ttft, 50):.1f} / "
              f"{np.percentile(ttft, 99):.1f} / {ttft.max():.1f} | {np.nanpercentile(itl, 99):.1f} |")


if __name__ == "__main__":
    main(sys.argv[1])
