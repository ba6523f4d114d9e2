#!/bin/bash
# issue 11: --draft-policy auto vs every fixed configuration it chooses from, one interleaved run.
# DRAFTS: the drafters and their fixed configs (default: session 9's int8 draft model + n-gram + Medusa);
# on a CPU with native bf16 (session 13):
#   DRAFTS="--dtype bfloat16 --draft qwen2.5-coder-0.5b --draft-quantization gguf --draft-lengths 4,6
#           --extra-draft ngram|k=4" docs/bench/auto-policy/auto_bench.sh --repeats 2
cd "$(dirname "$0")/../../.."
H=~/.cache/specdecode/heads/qwen2.5-coder-1.5b-medusa
DEFAULT="--draft qwen2.5-coder-0.5b --draft-quantization int8 --draft-lengths ${LENGTHS:-4} --extra-draft ngram|k=4
         --extra-draft medusa:$H|k=2"
# shellcheck disable=SC2086  # DRAFTS is a list of flags; no flag value contains a space
specdecode bench --target qwen2.5-coder-1.5b --backend torch ${DRAFTS:-$DEFAULT} \
  --draft-policy auto --max-draft-tokens 8 --baselines none --sampling greedy,t0.7-p0.95 \
  --max-new-tokens 48 --prompts humaneval:test --prompts spec-bench --num-prompts "${N:-1}" \
  --no-progress --out "${OUT:-runs/auto-mixed}" "$@"
