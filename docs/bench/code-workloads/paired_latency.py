"""Paired latency of each configuration against target-only in a `specdecode bench` run folder.

A fill-in-the-middle request on a CPU is mostly prefill, and prefill is the same computation in every
configuration whose drafters read the prompt lazily or cheaply (`auto`, the lookup drafters); its
run-to-run noise on a shared VM is larger than all of decode. So the pooled p50 / p99 of the report
cannot say whether `auto` is slower. This pairs each run with target-only's run of the same
(prompt, repeat) — the two ran back to back, in rotated order — and gives, per configuration:

* the paired ratio of latency (time to the last token), of latency after prefill (the time from the
  end of prefill to the last token: a request whose prompt is cached) and of prefill alone: the median
  over pairs and its 95 % bootstrap interval (pairs resampled with replacement, 2000 times);
* the pooled p50 / p99 ratios (as in the report) of latency and of latency after prefill;
* how many pairs were slower than target-only after prefill, and by how much at most.

    python docs/bench/code-workloads/paired_latency.py docs/bench/code-workloads/avx2-llamacpp-fim-replicates
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

RESAMPLES = 2000


def _interval(ratios: np.ndarray, rng: np.random.Generator) -> tuple[float, float, float]:
    picks = rng.integers(0, len(ratios), size=(RESAMPLES, len(ratios)))
    meds = np.median(ratios[picks], axis=1)
    return float(np.median(ratios)), float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def summarize(out: Path, sampling: str = "greedy") -> dict[str, dict]:
    runs = [
        r
        for r in map(json.loads, (out / "records.jsonl").read_text().splitlines())
        if r.get("type") == "run" and r["sampling"] == sampling and r.get("prefill_s") is not None
    ]
    by_key = {(r["prompt_id"], r["repeat"], r["config"]): r for r in runs}
    rng = np.random.default_rng(0)
    result = {}
    for config in sorted({r["config"] for r in runs} - {"target"}):
        pairs = [
            (by_key[(p, rep, "target")], r)
            for (p, rep, c), r in sorted(by_key.items())
            if c == config and (p, rep, "target") in by_key
        ]
        if not pairs:
            continue
        wall = np.array([[t["wall_s"], r["wall_s"]] for t, r in pairs])
        pre = np.array([[t["prefill_s"], r["prefill_s"]] for t, r in pairs])
        after = wall - pre
        row = {
            "pairs": len(pairs),
            "prompts": len({t["prompt_id"] for t, _ in pairs}),
            "equal_outputs": sum(t["token_ids"] == r["token_ids"] for t, r in pairs),
        }
        for name, x in (("latency", wall), ("after_prefill", after), ("prefill", pre)):
            row[name] = dict(zip(("median", "lo", "hi"), _interval(x[:, 1] / x[:, 0], rng)))
        for name, x in (("latency", wall), ("after_prefill", after)):
            row[name]["p50_ratio"] = float(np.percentile(x[:, 1], 50) / np.percentile(x[:, 0], 50))
            row[name]["p99_ratio"] = float(np.percentile(x[:, 1], 99) / np.percentile(x[:, 0], 99))
            row[name]["p50_s"] = [float(np.percentile(x[:, 0], 50)), float(np.percentile(x[:, 1], 50))]
            row[name]["p99_s"] = [float(np.percentile(x[:, 0], 99)), float(np.percentile(x[:, 1], 99))]
        slower = after[:, 1] / after[:, 0]
        row["after_prefill"]["slower_pairs"] = int((slower > 1).sum())
        row["after_prefill"]["worst_ratio"] = float(slower.max())
        row["decode_share_of_target"] = float(after[:, 0].sum() / wall[:, 0].sum())
        result[config] = row
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="a bench --out folder")
    ap.add_argument("--sampling", default="greedy")
    args = ap.parse_args()
    result = summarize(args.out, args.sampling)
    for config, row in result.items():
        print(
            f"{config}: {row['pairs']} pairs over {row['prompts']} prompts ({row['equal_outputs']} equal outputs); "
            f"after prefill is {100 * row['decode_share_of_target']:.0f} % of target-only's time"
        )
        for name in ("latency", "after_prefill", "prefill"):
            m = row[name]
            pooled = (
                f"; pooled p50 {m['p50_ratio']:.3f}x ({m['p50_s'][0]:.2f} -> {m['p50_s'][1]:.2f} s), "
                f"p99 {m['p99_ratio']:.3f}x ({m['p99_s'][0]:.2f} -> {m['p99_s'][1]:.2f} s)"
                if "p50_ratio" in m
                else ""
            )
            print(f"  {name:13s} paired {m['median']:.3f} [{m['lo']:.3f}, {m['hi']:.3f}]{pooled}")
        a = row["after_prefill"]
        print(
            f"  after prefill slower than target-only in {a['slower_pairs']} of {row['pairs']} pairs "
            f"(worst {a['worst_ratio']:.2f}x)"
        )
    (args.out / "paired_latency.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
