#!/usr/bin/env bash
# The prefix cache on the editor replay: `specdecode serve` with the cache (its default) against the same
# server with --prefix-cache-mb 0, the same GGUF pair and flags, driven by one `specdecode load` run that
# alternates the two endpoints slice by slice (--rounds), sessions whole (each request after the last).
# Usage: docs/bench/sessions/cache_ab.sh [PROMPTS] [REQUESTS] [ROUNDS]
# Env: TARGET, DRAFT (aliases or .gguf; default the Qwen2.5-Coder pair), BACKEND (llamacpp), THREADS (2),
#      K (4), OUT (runs/cache-ab), LEVELS (1)
set -euo pipefail
cd "$(dirname "$0")/../../.."
PROMPTS=${1:-editor_replay:test}; REQUESTS=${2:-48}; ROUNDS=${3:-4}
TARGET=${TARGET:-qwen2.5-coder-1.5b}; DRAFT=${DRAFT:-qwen2.5-coder-0.5b}; BACKEND=${BACKEND:-llamacpp}
THREADS=${THREADS:-2}; K=${K:-4}; OUT=${OUT:-runs/cache-ab}; LEVELS=${LEVELS:-1}
mkdir -p "$OUT"
git rev-parse HEAD > "$OUT/commit.txt"  # the code the servers run (at their start)
serve() {  # serve PORT CACHE_MB LOG
  python -m specdecode.cli serve --backend "$BACKEND" --target "$TARGET" --draft "$DRAFT" --num-draft-tokens "$K" \
    --threads "$THREADS" --max-batch-size 4 --prefix-cache-mb "$2" --port "$1" --log-level warning > "$3" 2>&1 &
}
serve 8151 1024 "$OUT/serve-cache.log"; A=$!
serve 8152 0 "$OUT/serve-nocache.log"; B=$!
trap 'kill -TERM $A $B 2>/dev/null || true' EXIT
for port in 8151 8152; do
  for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
  curl -s "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "def f(x):", "max_tokens": 4}' >/dev/null
done
python -m specdecode.cli load --endpoint "cache=http://127.0.0.1:8151" --endpoint "nocache=http://127.0.0.1:8152" \
  --prompts "$PROMPTS" --levels "$LEVELS" --num-requests "$REQUESTS" --rounds "$ROUNDS" --duration 3000 \
  --time-limit 6000 --extra-body '{"temperature": 0}' --no-progress --out "$OUT/load"
curl -s http://127.0.0.1:8151/metrics | grep prefix_cache > "$OUT/cache-metrics.txt" || true
grep -m1 "model name" /proc/cpuinfo > "$OUT/machine.txt"; uptime >> "$OUT/machine.txt"
echo "written: $OUT"
