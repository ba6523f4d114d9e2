"""Acceptance against the draft's context (``--draft-context N``) from `specdecode bench --draft-contexts` runs.

Usage: python docs/bench/draft-context/summarize.py RUN_DIR [RUN_DIR ...]   (each a bench --out folder, or runs/*)

Per run folder (a workload) and configuration: prompts, mean prompt tokens, acceptance (accepted / drafted,
pooled), tokens per target step (emitted / steps, pooled), the draft's acceptance relative to the whole-prompt
draft (``spec-k<k>``) on the same prompts, the mean prefill seconds per request (target and draft), and whether
every output equals target-only's or first differs at a near-tie (bench's greedy check: on llama.cpp a verify of
several tokens rounds differently from a one-token step, so a top-2 gap within the backend's tolerance may
flip; a difference that is not a near-tie would be a bug). Acceptance and outputs
are deterministic under greedy decoding; the seconds are whatever the machine gave (see the run's load)."""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path


def summarize(folder: Path) -> list[str]:
    path = folder / "records.jsonl"
    with gzip.open(f"{path}.gz", "rt") if not path.exists() else open(path) as f:  # (kept gzipped in the repo)
        records = [json.loads(line) for line in f if line.strip()]
    runs = [r for r in records if r.get("type") == "run"]
    checks: dict[str, list[dict]] = defaultdict(list)
    for c in records:
        if c.get("type") == "check":
            checks[c["config"]].append(c)
    by: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in runs:
        by[r["config"]][r["prompt_id"]] = r
    whole = next((c for c in by if c.startswith("spec-k") and "-ctx" not in c), None)
    lines = [
        f"### {folder.name}",
        "",
        "| config | prompts | prompt tokens (mean) | acceptance | tokens/step | vs whole prompt | prefill s (mean) "
        "| greedy: equal / near-tie / other |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def pooled(rs: list[dict]) -> tuple[float, float]:
        drafted = sum(r["stats"]["drafted"] for r in rs)
        accepted = sum(r["stats"]["accepted"] for r in rs)
        steps = sum(r["stats"]["target_steps"] for r in rs)
        emitted = sum(r["stats"]["emitted"] for r in rs)
        return (accepted / drafted if drafted else float("nan")), (emitted / steps if steps else float("nan"))

    def order(name: str) -> tuple:
        ctx = int(name.split("-ctx")[1]) if "-ctx" in name else 10**9
        return (name != "target", -ctx)

    for config in sorted(by, key=order):
        done = by[config]
        rs = list(done.values())
        alpha, per_step = pooled(rs)
        rel = "–"
        if whole and config != "target":
            shared = [p for p in done if p in by[whole]]
            a_whole = pooled([by[whole][p] for p in shared])[0]
            rel = f"{pooled([done[p] for p in shared])[0] / a_whole:.3f}" if shared and a_whole else "–"
        cs = checks.get(config, [])
        equal, tie = sum(c["match"] for c in cs), sum(not c["match"] and c.get("near_tie", False) for c in cs)
        verdict = "–" if config == "target" else f"{equal} / {tie} / {len(cs) - equal - tie}"
        lines.append(
            f"| {config} | {len(rs)} | {sum(r['prompt_tokens'] for r in rs) / len(rs):.0f} | "
            f"{'–' if config == 'target' else f'{alpha:.3f}'} | {'–' if config == 'target' else f'{per_step:.2f}'} | "
            f"{rel} | {sum(r['prefill_s'] for r in rs) / len(rs):.2f} | {verdict} |"
        )
    return lines + [""]


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print("\n".join(summarize(Path(arg))))
