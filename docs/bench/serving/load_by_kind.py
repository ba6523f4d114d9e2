"""TTFT and ITL of a `specdecode load` run split by prompt kind (HumanEval vs Spec-Bench category),
per endpoint and level: where a mixed-length workload's long prompts pay. With ``--baseline LABEL``
each other endpoint's row also gets its TTFT and TPOT paired with the baseline's request by request
(request ``i`` of every endpoint is the same prompt): the median of the ratios over that kind's pairs,
with its distribution-free 95 % interval (``specdecode.load.stats.median_ci``).

Usage: python docs/bench/serving/load_by_kind.py runs/prefill-latency/load/requests.jsonl [--baseline off]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import fields

import numpy as np

from specdecode.load.records import RequestRecord
from specdecode.load.stats import median_ci


def kind(prompt_id: str) -> str:
    return "humaneval" if prompt_id.startswith("HumanEval") else "spec-bench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("requests", help="a load run's requests.jsonl")
    parser.add_argument("--baseline", help="endpoint label to pair the others' TTFT with")
    args = parser.parse_args()
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for line in open(args.requests, encoding="utf-8"):
        row = json.loads(line)
        if row["error"] is None and row["ttft_s"] is not None:
            groups[(row["level"], row["endpoint"], kind(row["prompt_id"]))].append(row)
    paired = f" pairs | TTFT / {args.baseline} [95 %] | TPOT / {args.baseline} [95 %] |" if args.baseline else ""
    print("| level | endpoint | prompts | n | prompt tokens p50 | TTFT p50 / p99 / max (s) | ITL p99 (s) |" + paired)
    print("|---|---|---|---|---|---|---|" + ("---|---|---|" if paired else ""))
    for (level, endpoint, k), rows in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        ttft = np.array([r["ttft_s"] for r in rows])
        itl = np.array([g for r in rows for g in r["itl_s"]] or [np.nan])
        tokens = np.median([r.get("prompt_tokens") or 0 for r in rows])
        line = (
            f"| {level:g} | {endpoint} | {k} | {len(rows)} | {tokens:.0f} | {np.percentile(ttft, 50):.1f} / "
            f"{np.percentile(ttft, 99):.1f} / {ttft.max():.1f} | {np.nanpercentile(itl, 99):.1f} |"
        )
        if args.baseline:
            base = {r["index"]: r for r in groups.get((level, args.baseline, k), [])}
            pairs = [(base[r["index"]], r) for r in rows if r["index"] in base]
            if endpoint == args.baseline or not pairs:
                line += " – | – | – |"
            else:
                line += (
                    f" {len(pairs)} | "
                    + " | ".join(_ratio([f(c) / f(b) for b, c in pairs if f(b) and f(c)]) for f in (_ttft, _tpot))
                    + " |"
                )
        print(line)


def _ttft(row: dict) -> float | None:
    return row["ttft_s"]


def _tpot(row: dict) -> float | None:
    return RequestRecord(**{f.name: row[f.name] for f in fields(RequestRecord) if f.name in row}).tpot_s


def _ratio(ratios: list[float]) -> str:
    if not ratios:
        return "–"
    ci = median_ci(ratios)
    return f"{np.median(ratios):.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


if __name__ == "__main__":
    main()
