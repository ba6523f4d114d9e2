#!/usr/bin/env bash
# Chain k=4 vs trees on the real pair, greedy and T=0.7, HumanEval and Spec-Bench, configurations
# interleaved per prompt by `specdecode bench` (issue: exact tree verification). Resumable: rerun.
#   OUT=runs/trees N_HE=4 N_SB=1 TOKENS=48 scripts/tree_bench.sh
set -euo pipefail
OUT=${OUT:-runs/trees}
COMMON=(--target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --max-new-tokens "${TOKENS:-48}"
        --sampling greedy,t0.7-p0.95 --draft-lengths 4 --tree-shapes "${SHAPES:-2x8,4x16,4x32}"
        --baselines none --no-progress)
specdecode bench "${COMMON[@]}" --prompts humaneval -n "${N_HE:-4}" --out "$OUT/humaneval"
specdecode bench "${COMMON[@]}" --prompts spec-bench -n "${N_SB:-1}" --out "$OUT/spec-bench"
