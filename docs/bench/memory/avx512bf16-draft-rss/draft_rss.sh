#!/usr/bin/env bash
# Peak RSS of one `specdecode generate` per draft quantization (a process each, /usr/bin/time -v), and
# whether they all generate the same greedy tokens.
#   DTYPE=bfloat16 MODES="none int8 int4 gguf" docs/bench/memory/avx512bf16-draft-rss/draft_rss.sh [OUT]
set -euo pipefail
OUT=${1:-runs/draft-rss}
mkdir -p "$OUT"
for mode in ${MODES:-none int8 int4 gguf}; do
  /usr/bin/time -v specdecode generate --backend torch --dtype "${DTYPE:-bfloat16}" --target qwen2.5-coder-1.5b \
    --draft qwen2.5-coder-0.5b -k 4 --max-new-tokens 16 --draft-quantization "$mode" --json \
    --prompt "def fibonacci(n):" > "$OUT/$mode.json" 2> "$OUT/$mode.time"
  rss=$(awk -F': ' '/Maximum resident set size/ {printf "%.2f", $2 / 1048576}' "$OUT/$mode.time")
  echo "$mode peak RSS ${rss} GiB  text $(python3 -c "import json,sys; print(repr(json.load(open(sys.argv[1]))['text']))" "$OUT/$mode.json")"
done | tee "$OUT/summary.txt"
