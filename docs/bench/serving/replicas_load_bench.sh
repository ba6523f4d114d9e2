#!/usr/bin/env bash
# The Ray layer's cost and scaling on one machine (docs/replicas.md, issue 44): the same `specdecode load`
# against one process, `--replicas 1` and `--replicas 2`, speculation on vs off per request
# ({"speculation": false}), interleaved in rounds; then a replica killed (SIGKILL of its worker process)
# in the middle of a load run against 2 replicas, to count what was lost.
# Usage: docs/bench/serving/replicas_load_bench.sh OUT_DIR
# Env: SERVE_ARGS (model flags, default: the real Qwen pair on llama.cpp with auto), THREADS_1 (threads of
# one process and of one replica, default 2), THREADS_2 (threads per replica when there are 2, default 1),
# LEVELS (default 1,16), REQUESTS (per level and arm, at least 2 x the level; default 16), OUTLEN (default 64), PORT (default 8211),
# DURATION (time limit per level and arm in s, default 900: long enough that no request is cut on a slow CPU),
# PROMPTS (default humaneval:dev), MODES (default "process r1 r2 kill").
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${1:?output folder}; mkdir -p "$OUT"
PORT=${PORT:-8211}; KEY=bench-key
SERVE_ARGS=${SERVE_ARGS:---backend llamacpp --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --draft ngram --draft-policy auto}
LEVELS=${LEVELS:-1,16}; REQUESTS=${REQUESTS:-16}; OUTLEN=${OUTLEN:-64}; PROMPTS=${PROMPTS:-humaneval:dev}
DURATION=${DURATION:-900}
{ echo "# $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD)"; grep -m1 'model name' /proc/cpuinfo;
  grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E 'avx|amx|fma|vnni' | tr '\n' ' '; echo;
  echo "SERVE_ARGS=$SERVE_ARGS LEVELS=$LEVELS REQUESTS=$REQUESTS OUTLEN=$OUTLEN PROMPTS=$PROMPTS DURATION=$DURATION"; } > "$OUT/machine.txt"

SERVER=
stop_server() {
  if [ -n "$SERVER" ]; then kill -INT "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; SERVER=; fi
  ray stop --force >/dev/null 2>&1 || true
}
trap stop_server EXIT

start_server() {  # $1 = label, rest = extra serve flags
  local label=$1; shift
  # shellcheck disable=SC2086
  python -m specdecode.cli serve $SERVE_ARGS --max-batch-size 16 --port "$PORT" --api-key "$KEY" \
    --log-level warning "$@" > "$OUT/serve-$label.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 900); do
    curl -sf -H "Authorization: Bearer $KEY" "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 "$SERVER" 2>/dev/null || { echo "server $label died"; tail -30 "$OUT/serve-$label.log"; exit 1; }
    sleep 1
  done
  # warm-up: page the memory-mapped weights in before anything is timed (both arms, every replica)
  for i in 1 2 3 4; do
    curl -s "http://127.0.0.1:$PORT/v1/completions" -H "Authorization: Bearer $KEY" -H 'Content-Type: application/json' \
      -d '{"prompt": "def f'"$i"'(x):", "max_tokens": 8}' >/dev/null
  done
}

run_levels() {  # $1 = label: one load run per level, each with at least 2 x level requests per arm, so that
  # both of its round slices keep `level` requests in flight
  for level in ${LEVELS//,/ }; do
    n=$(( REQUESTS > 2 * level ? REQUESTS : 2 * level ))
    run_load "$1-c$level" "$level" "$n"
  done
}

run_load() {  # $1 = label, $2 = levels, $3 = requests
  python -m specdecode.cli load --endpoint "on=http://127.0.0.1:$PORT" --endpoint "off=http://127.0.0.1:$PORT" \
    --endpoint-body 'off={"speculation": false}' --api-key "$KEY" --prompts "$PROMPTS" --levels "$2" \
    --num-requests "$3" --rounds 2 --duration "$DURATION" --output-len "$OUTLEN" \
    --extra-body '{"ignore_eos": true, "temperature": 0}' --no-progress --out "$OUT/load-$1"
  curl -s -H "Authorization: Bearer $KEY" "http://127.0.0.1:$PORT/metrics" > "$OUT/metrics-$1.txt" || true
}

for mode in ${MODES:-process r1 r2 kill}; do
  case $mode in
    process) start_server process --threads "${THREADS_1:-2}"; run_levels process ;;
    r1) start_server r1 --threads "${THREADS_1:-2}" --replicas 1 --replica-cpus "${THREADS_1:-2}"
        run_levels r1 ;;
    r2) start_server r2 --threads "${THREADS_2:-1}" --replicas 2 --replica-cpus "${THREADS_2:-1}"
        run_levels r2 ;;
    kill)
      # 2 replicas, concurrency 16, speculation on only; one replica's worker process is SIGKILLed once
      # a quarter of its requests have left the server. Counted afterwards from the load records.
      start_server kill --threads "${THREADS_2:-1}" --replicas 2 --replica-cpus "${THREADS_2:-1}"
      python -m specdecode.cli load --endpoint "on=http://127.0.0.1:$PORT" --api-key "$KEY" --prompts "$PROMPTS" \
        --levels 16 --num-requests $((REQUESTS * 3)) --duration "$DURATION" --output-len "$OUTLEN" --request-timeout 900 \
        --extra-body '{"ignore_eos": true, "temperature": 0}' --no-progress --out "$OUT/load-kill" &
      LOAD=$!
      total=$((REQUESTS * 3)); killed=
      while kill -0 $LOAD 2>/dev/null; do
        # requests that have left the server, summed over replicas (the endpoint's aggregated /metrics)
        done_n=$(curl -s -m 15 -H "Authorization: Bearer $KEY" "http://127.0.0.1:$PORT/metrics" \
          | awk '/^specdecode_requests_total/ {s += $NF} END {printf "%d", s}')
        if [ -z "$killed" ] && [ "${done_n:-0}" -ge $((total / 4 + 4)) ]; then  # + the 4 warm-up requests
          victim=$(pgrep -f 'ServeReplica:specdecode:Replica' | head -1 || true)
          echo "$(date -u +%T) killing replica worker pid $victim after $done_n requests left the server (4 warm-up)" | tee "$OUT/kill.txt"
          ps -o pid,args -p "$victim" >> "$OUT/kill.txt" || true
          kill -9 "$victim"; killed=1
        fi
        sleep 2
      done
      wait $LOAD || echo "load exited $?" >> "$OUT/kill.txt"
      # the deployment keeps serving: a request after the run
      curl -s -w '\nHTTP %{http_code}\n' "http://127.0.0.1:$PORT/v1/completions" -H "Authorization: Bearer $KEY" \
        -H 'Content-Type: application/json' -d '{"prompt": "def after_kill(x):", "max_tokens": 8, "temperature": 0}' \
        >> "$OUT/kill.txt"
      curl -s -H "Authorization: Bearer $KEY" "http://127.0.0.1:$PORT/metrics" > "$OUT/metrics-kill.txt" || true ;;
  esac
  stop_server
done
echo "done: $OUT"
