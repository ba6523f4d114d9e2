#!/usr/bin/env bash
# greedy token ids of one checkout for a few real prompts, both backends, target-only and k=4
tree=$1; out=$2
cd "$tree"
: > "$out"
for backend in torch llamacpp; do
  for k in 0 4; do
    for prompt in 'def quicksort(arr):' 'import numpy as np
def moving_average(x, w):' 'class Stack:
    def __init__(self):'; do
      draft=""; [ "$k" != 0 ] && draft="--draft qwen2.5-coder-0.5b"
      ids=$(python -m specdecode.cli generate --backend $backend --target qwen2.5-coder-1.5b $draft -k $k --prompt "$prompt" --max-new-tokens 48 --ignore-eos --json --threads 2 2>/dev/null | python -c "import sys,json; print(json.load(sys.stdin)['token_ids'])")
      echo "$backend k=$k $(echo "$prompt" | head -1): $ids" >> "$out"
    done
  done
done
