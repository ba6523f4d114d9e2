#!/usr/bin/env bash
# Issue 17 on a CPU with native bf16: the 0.5B draft in bf16, int8, int4 and kept quantized on llama.cpp
# (its GGUF file's own types), beside the bf16 1.5B target, greedy and T = 0.7, on held-out HumanEval
# problems (100-163), configurations interleaved per prompt. Resumable: rerun the same command.
#   OUT=runs/quant-bf16 N=8 TOKENS=64 KS=4,6 docs/bench/quantized-draft/avx512bf16-humaneval8/draft_quant_bench.sh [--batch-invariant off]
set -euo pipefail
OUT=${OUT:-runs/quant-bf16}
specdecode bench --backend torch --dtype bfloat16 --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
  --draft-lengths "${KS:-4,6}" --draft-quantization "${MODES:-none,int8,int4,gguf}" \
  --sampling "${SAMPLING:-greedy,t0.7-p0.95}" --prompts humaneval:test -n "${N:-8}" \
  --max-new-tokens "${TOKENS:-64}" --baselines none --threads 2 --no-progress --out "$OUT" "$@"
