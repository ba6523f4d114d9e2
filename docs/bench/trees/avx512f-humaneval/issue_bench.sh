#!/usr/bin/env bash
# The real-pair runs behind docs/benchmarks.md's tree and quantized-draft sections, one after another
# (configurations interleaved per prompt inside each `specdecode bench`). Resumable: rerun the same command.
#   OUT=runs/issues N_HE=4 N_SB=1 TOKENS=40 docs/bench/trees/avx512f-humaneval/issue_bench.sh
set -euo pipefail
OUT=${OUT:-runs/issues}
COMMON=(--target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --max-new-tokens "${TOKENS:-40}"
        --sampling greedy,t0.7-p0.95 --draft-lengths 4 --baselines none --no-progress)
TREES=(--tree-shapes "${SHAPES:-2x8,4x16}")
QUANT=(--draft-quantization none,int8,int4)
specdecode bench "${COMMON[@]}" "${TREES[@]}" --prompts humaneval -n "${N_HE:-4}" --out "$OUT/trees-humaneval"
specdecode bench "${COMMON[@]}" "${QUANT[@]}" --prompts humaneval -n "${N_HE:-4}" --out "$OUT/quant-humaneval"
specdecode bench "${COMMON[@]}" "${TREES[@]}" --prompts spec-bench -n "${N_SB:-1}" --out "$OUT/trees-spec-bench"
specdecode bench "${COMMON[@]}" "${QUANT[@]}" --prompts spec-bench -n "${N_SB:-1}" --out "$OUT/quant-spec-bench"
