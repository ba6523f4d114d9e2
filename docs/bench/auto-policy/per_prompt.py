"""Per-prompt speedups of a bench run over its own target-only runs: the median over prompts of
target wall / config wall (end to end) and of target / config seconds per token in decode steps, beside
the ratio of totals (which one slow run on a shared machine can swing). And what `auto` rested on at its
last run (the `policy` record).

    python docs/bench/auto-policy/per_prompt.py docs/bench/auto-policy/<run>/records.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys


def main(path: str) -> None:
    recs = [json.loads(line) for line in open(path)]
    runs = [r for r in recs if r.get("type") == "run" and r["prompt_id"] != "warmup" and r.get("repeat", 0) == 0]
    target = {r["prompt_id"]: r for r in runs if r["config"] == "target"}
    for cfg in sorted({r["config"] for r in runs} - {"target"}):
        e2e, dec = [], []
        mine = [r for r in runs if r["config"] == cfg and r["prompt_id"] in target]
        for r in mine:
            t = target[r["prompt_id"]]
            e2e.append(t["wall_s"] / r["wall_s"])
            per_token = lambda x: sum(s[4] for s in x["steps"]) / len(x["token_ids"])  # noqa: E731
            dec.append(per_token(t) / per_token(r))
        total = sum(target[r["prompt_id"]]["wall_s"] for r in mine) / sum(r["wall_s"] for r in mine)
        print(
            f"{cfg:16s} prompts {len(mine):2d}  per prompt: end to end {statistics.median(e2e):.3f} "
            f"(min {min(e2e):.2f}, max {max(e2e):.2f}), decode {statistics.median(dec):.3f}; totals {total:.3f}"
        )
    autos = [r for r in runs if r["config"] == "auto" and r.get("policy")]
    if autos:
        p = autos[-1]["policy"]
        print(
            f"auto's costs at its last run: calibration {p['calibration']} ({p['noise']}); a step "
            f"{p['step_s'] * 1e3:.1f} ms; "
            + ", ".join(f"v({w}) {s / p['step_s']:.2f}" for w, s in p["verify_s"].items())
        )
        for d, x in p["drafters"].items():
            print(
                f"  {d}: tried {x['tried']}, alpha {x['alpha']:.2f}, c {x['draft_token_s'] / p['step_s']:.2f}, "
                f"best k {x['best_k']}, x plain {x['speed_vs_plain']:.2f}"
            )


if __name__ == "__main__":
    main(sys.argv[1])
