#!/usr/bin/env bash
# Serving on llama.cpp's kernels: llama.cpp's own `llama-server -md` vs `specdecode serve --backend
# llamacpp`, the same GGUF pair, threads, slots and draft length, driven by one `specdecode load` run
# that alternates the two endpoints level by level (streamed requests: TTFT, ITL, TPOT, output tok/s).
# A second run (OFF=1) compares the two with speculation off: llama-server without a draft vs our
# server with {"speculation": false} per request.
#   scripts/build-llamacpp-tools.sh llama-server   # once, from the source the backend was built from
# Usage: docs/bench/llamacpp/llamacpp_serve_compare.sh TARGET DRAFT [LEVELS] [OUTPUT_LEN] [DURATION_S] [REQUESTS]
#   TARGET, DRAFT: .gguf files or aliases (resolved with `specdecode models list`'s cache)
# Env: K (draft length, default 4), THREADS (default 2), SLOTS (default 16), PROMPTS (default humaneval),
#      OUT (default runs/llamacpp-serve), OFF (1: also the speculation-off run; ONLY_OFF=1: that run only),
#      LLAMA_ARGS (more llama-server flags), LLAMA_BODY (request fields for llama-server only, JSON),
#      TOOLS (llama.cpp tools dir). llama-server keeps prompts' K/V for reuse (slots, host cache) and our
#      server does not: LLAMA_ARGS="--cache-ram 0" LLAMA_BODY='{"cache_prompt": false}' compares without it.
set -euo pipefail
cd "$(dirname "$0")/../../.."
TARGET=${1:?target}; DRAFT=${2:?draft}; LEVELS=${3:-1,4,16}; OUTLEN=${4:-64}; DURATION=${5:-180}; REQUESTS=${6:-64}
K=${K:-4}; THREADS=${THREADS:-2}; SLOTS=${SLOTS:-16}; OUT=${OUT:-runs/llamacpp-serve}
TOOLS=${TOOLS:-$HOME/.cache/specdecode/llama.cpp-tools}
[ -x "$TOOLS/bin/llama-server" ] || { echo "run scripts/build-llamacpp-tools.sh llama-server first"; exit 1; }
path() { python -c "from specdecode.models.loading import resolve; print(resolve('$1').path)"; }
T=$(path "$TARGET"); D=$(path "$DRAFT")
mkdir -p "$OUT"
CTX=$((SLOTS * 2048))
wait_up() {  # wait_up PORT LOG
  for _ in $(seq 1 900); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && break; sleep 1; done
  curl -sf "http://127.0.0.1:$1/health" >/dev/null || { echo "server $1 did not come up"; cat "$2"; exit 1; }
  curl -s "http://127.0.0.1:$1/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "def f(x):", "max_tokens": 8}' >/dev/null  # warm-up: page the weights in
}
run_pair() {  # run_pair NAME LLAMA_DRAFT_ARGS OURS_BODY
  local name=$1 llama_args=$2 body=$3
  LD_LIBRARY_PATH="$TOOLS/build/bin:${LD_LIBRARY_PATH:-}" "$TOOLS/bin/llama-server" -m "$T" $llama_args ${LLAMA_ARGS:-} \
    -t "$THREADS" -tb "$THREADS" -np "$SLOTS" -c "$CTX" --port 8141 --log-disable > "$OUT/llama-server-$name.log" 2>&1 &
  local A=$!
  python -m specdecode.cli serve --backend llamacpp --target "$T" --draft "$D" --num-draft-tokens "$K" \
    --threads "$THREADS" --max-batch-size "$SLOTS" --port 8142 --log-level warning > "$OUT/specdecode-$name.log" 2>&1 &
  local B=$!
  trap "kill -TERM $A $B 2>/dev/null || true" EXIT
  wait_up 8141 "$OUT/llama-server-$name.log"; wait_up 8142 "$OUT/specdecode-$name.log"
  python -m specdecode.cli load --endpoint "llama-server=http://127.0.0.1:8141" \
    --endpoint "specdecode=http://127.0.0.1:8142" --endpoint-body "specdecode=$body" \
    --endpoint-body "llama-server=${LLAMA_BODY:-{\}}" \
    --prompts "${PROMPTS:-humaneval}" --levels "$LEVELS" --num-requests "$REQUESTS" --duration "$DURATION" \
    --time-limit $((DURATION * 12)) --output-len "$OUTLEN" --extra-body '{"ignore_eos": true, "temperature": 0}' \
    --no-progress --out "$OUT/$name"
  curl -s http://127.0.0.1:8142/metrics > "$OUT/specdecode-$name-metrics.txt" || true
  kill -TERM $A $B 2>/dev/null || true
  wait $A $B 2>/dev/null || true
}
[ "${ONLY_OFF:-0}" = 1 ] || run_pair spec "-md $D --spec-draft-n-max $K" '{}'
if [ "${OFF:-0}" = 1 ] || [ "${ONLY_OFF:-0}" = 1 ]; then run_pair off "" '{"speculation": false}'; fi
echo "written: $OUT"
