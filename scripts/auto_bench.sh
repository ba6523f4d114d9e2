#!/bin/bash
# issue 11: --draft-policy auto vs every fixed configuration it chooses from, one interleaved run
cd "$(dirname "$0")/.."
H=~/.cache/specdecode/heads/qwen2.5-coder-1.5b-medusa
specdecode bench --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --backend torch \
  --draft-quantization int8 --draft-lengths ${LENGTHS:-4} --extra-draft "ngram|k=4" --extra-draft "medusa:$H|k=2" \
  --draft-policy auto --max-draft-tokens 8 --baselines none --sampling greedy,t0.7-p0.95 \
  --max-new-tokens 48 --prompts humaneval:test --prompts spec-bench --num-prompts 1 \
  --no-progress --out ${OUT:-runs/auto-mixed} "$@"
