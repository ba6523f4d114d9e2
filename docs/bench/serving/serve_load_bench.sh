#!/usr/bin/env bash
# Server under load, speculation on vs off, on one server (requests opt out per request with
# {"speculation": false}), interleaved by concurrency level. Writes runs/serve-<set>/ per prompt set.
# Usage: docs/bench/serving/serve_load_bench.sh TARGET DRAFT [LEVELS] [OUTPUT_LEN] [DURATION_PER_LEVEL_S]
# Env: K (draft length, default 3), SERVE_ARGS (more serve flags), SETS (prompt sets, default
# "humaneval spec-bench:qa,math_reasoning"; a .jsonl file works too, e.g. one docs/bench/serving/mixed_prompts.py
# wrote), TAG (suffix of the runs/serve-<set><TAG> directories), PORT, REQUESTS (per level and arm,
# default 64), ROUNDS (the arms alternate in this many slices of each level, default 1: `load --rounds`)
set -euo pipefail
cd "$(dirname "$0")/../../.."
TARGET=${1:?target}; DRAFT=${2:?draft}; LEVELS=${3:-1,4,16}; OUTLEN=${4:-32}; DURATION=${5:-120}
PORT=${PORT:-8123}
mkdir -p runs
python -m specdecode.cli serve --target "$TARGET" --draft "$DRAFT" --num-draft-tokens "${K:-3}" \
  --max-batch-size 16 --port "$PORT" --log-level warning ${SERVE_ARGS:-} > runs/serve.log 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "server did not come up"; cat runs/serve.log; exit 1; }
# warm-up (page in the memory-mapped weights) before anything is timed
curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "'"$TARGET"'", "prompt": "def f(x):", "max_tokens": 8}' >/dev/null
for set in ${SETS:-humaneval spec-bench:qa,math_reasoning}; do
  prompts=${set%%:*}; cats=${set#*:}; name=serve-$(basename "${prompts%.jsonl}")${TAG:-}
  extra=(); [ "$cats" != "$set" ] && extra=(--categories "$cats")
  python -m specdecode.cli load --endpoint "off=http://127.0.0.1:$PORT" --endpoint "on=http://127.0.0.1:$PORT" \
    --endpoint-body 'off={"speculation": false}' --prompts "$prompts" "${extra[@]}" --levels "$LEVELS" \
    --num-requests "${REQUESTS:-64}" --rounds "${ROUNDS:-1}" --duration "$DURATION" --time-limit $((DURATION * 8)) --output-len "$OUTLEN" \
    --extra-body '{"ignore_eos": true, "temperature": 0}' --no-progress --out "runs/$name"
done
curl -s "http://127.0.0.1:$PORT/metrics" > runs/serve-metrics.txt
