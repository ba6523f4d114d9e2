#!/usr/bin/env bash
# Serving latency with mixed prompt lengths: a baseline server built from an older commit vs this
# tree's server, same models and flags, driven by one `specdecode load` run that alternates the two
# endpoints level by level (streamed requests; TTFT, ITL, TPOT, output tok/s).
# Usage: docs/bench/prefill-latency/prefill_latency_bench.sh BASE_REF TARGET DRAFT [LEVELS] [OUTPUT_LEN] [DURATION_S] [REQUESTS]
# Env: SERVE_ARGS (flags for every server), BASE_ARGS / NEW_ARGS (flags for one of them), NEW2_ARGS
#      (if set, a third server from this tree with these flags, endpoint "new2"),
#      MAX_CHARS (longest summarization article, default 3000), OUT (default runs/prefill-latency),
#      PROMPTS (a prompt set `load` takes, e.g. humaneval, instead of the mixed summarization + HumanEval),
#      OFF=1 (one more endpoint, "off": the "new" server with {"speculation": false} per request)
set -euo pipefail
cd "$(dirname "$0")/../../.."
BASE=${1:?base commit}; TARGET=${2:?target}; DRAFT=${3:?draft}
LEVELS=${4:-4,16}; OUTLEN=${5:-32}; DURATION=${6:-600}; REQUESTS=${7:-32}
OUT=${OUT:-runs/prefill-latency}
mkdir -p "$OUT"
WT=$(mktemp -d /tmp/specdecode-base-XXXX)
git worktree add --detach "$WT" "$BASE" >/dev/null
PROMPT_SET=${PROMPTS:-$OUT/prompts.jsonl}
[ -n "${PROMPTS:-}" ] || python docs/bench/serving/mixed_prompts.py "$OUT/prompts.jsonl" --max-chars "${MAX_CHARS:-3000}"
serve() {  # serve DIR PORT ARGS...
  local dir=$1 port=$2; shift 2
  (cd "$dir" && PYTHONPATH="$dir" exec python -m specdecode.cli serve --target "$TARGET" --draft "$DRAFT" \
     --max-batch-size 16 --port "$port" --log-level warning ${SERVE_ARGS:-} "$@") > "$OUT/serve-$port.log" 2>&1 &
  echo $!
}
# one server at a time: a server that measures its step costs at start (--draft-policy auto) must
# not be timed while another one loads
up() {  # up PORT: wait for /health, then one warm-up request (pages in the memory-mapped weights)
  local port=$1
  for _ in $(seq 1 900); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
  curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "server $port did not come up"; cat "$OUT/serve-$port.log"; exit 1; }
  curl -s "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "'"$TARGET"'", "prompt": "def f(x):", "max_tokens": 8}' >/dev/null
}
A=; B=; C=
trap 'kill -TERM $A $B $C 2>/dev/null || true; sleep 2; git worktree remove --force "$WT" || true' EXIT
A=$(serve "$WT" 8131 ${BASE_ARGS:-}); up 8131
B=$(serve "$PWD" 8132 ${NEW_ARGS:-}); up 8132
PORTS="8131 8132"; ENDPOINTS=(--endpoint "base=http://127.0.0.1:8131" --endpoint "new=http://127.0.0.1:8132")
BODIES=()
if [ -n "${OFF:-}" ]; then
  ENDPOINTS+=(--endpoint "off=http://127.0.0.1:8132"); BODIES=(--endpoint-body 'off={"speculation": false}')
fi
if [ -n "${NEW2_ARGS:-}" ]; then
  C=$(serve "$PWD" 8133 $NEW2_ARGS); up 8133
  PORTS="$PORTS 8133"; ENDPOINTS+=(--endpoint "new2=http://127.0.0.1:8133")
fi
echo "base $(git -C "$WT" log --oneline -1) | new $(git log --oneline -1) $(git diff --quiet || echo '(modified tree)')" \
  > "$OUT/commits.txt"
echo "SERVE_ARGS=${SERVE_ARGS:-} | BASE_ARGS=${BASE_ARGS:-} | NEW_ARGS=${NEW_ARGS:-} | NEW2_ARGS=${NEW2_ARGS:-} | OFF=${OFF:-} | PROMPTS=${PROMPTS:-mixed}" >> "$OUT/commits.txt"
python -m specdecode.cli load "${ENDPOINTS[@]}" "${BODIES[@]}" \
  --prompts "$PROMPT_SET" --levels "$LEVELS" --num-requests "$REQUESTS" --duration "$DURATION" \
  --time-limit $((DURATION * 8)) --output-len "$OUTLEN" --extra-body '{"ignore_eos": true, "temperature": 0}' \
  --no-progress --out "$OUT/load"
for port in $PORTS; do curl -s "http://127.0.0.1:$port/metrics" > "$OUT/metrics-$port.txt"; done
