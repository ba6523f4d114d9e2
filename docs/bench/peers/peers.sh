#!/usr/bin/env bash
# Peers side by side (issues 57, 58): the servers a user would otherwise pick and `specdecode serve`, on the
# same GGUF pair, threads and prompts, at temperature 0, driven by one `specdecode load` run per prompt set
# that alternates the endpoints slice by slice at each concurrency (--rounds; sessions kept whole).
# Endpoints (ENDPOINTS picks among these labels; default: every one this machine can run):
#   llama-server        llama.cpp's own server alone (its prompt cache on, its default)
#   llama-server-draft  the same with the draft model (-md): llama.cpp's own speculative decoding
#   llamacpp-target     specdecode serve --backend llamacpp, target-only
#   llamacpp-auto       ... --draft DRAFT --draft ngram --draft suffix --draft-policy auto
#   llamacpp-fixed      ... --draft FIXED_DRAFT -k FIXED_K
#   ik-target, ik-auto, ik-fixed: the same three on --backend ik_llamacpp (when ik-llama-cpp-python is installed)
# summary.md names the bar (per prompt set and level, the fastest ordinary decoder: llama-server,
# llamacpp-target, ik-target) and every endpoint's ratio to it (summarize.py). How to run: README.md.
# Env: TARGET, DRAFT (aliases or .gguf; the Qwen2.5-Coder pair), PROMPTS (comma-separated sets; SET@N: N
#      requests for that set), LEVELS, REQUESTS (per level and endpoint), ROUNDS, DURATION (s per level and
#      endpoint), TIME_LIMIT (s per set), STARTUP_S (s a server may take to come up),
#      OUTPUT_LEN (max_tokens N or LO:HI; default each prompt's own), EXTRA_BODY (JSON for every request),
#      FIM_MARKERS (a FIM request as one prompt with these markers, load --fim-markers; empty: OpenAI's suffix),
#      THREADS, CTX (context per slot), FIXED_DRAFT, FIXED_K, LLAMA_DRAFT_MAX, LLAMA_DRAFT_MIN,
#      CACHE_MB (one prefix-cache budget for every server; default each server's own), ENDPOINTS, PORT (first
#      port, the next ones after it; default: free ports the kernel hands out), OUT, TOOLS (llama.cpp tools
#      dir), LLAMA_ARGS, SERVE_ARGS (more flags for every server of a kind)
set -euo pipefail
cd "$(dirname "$0")/../../.."
TARGET=${TARGET:-qwen2.5-coder-1.5b}; DRAFT=${DRAFT:-qwen2.5-coder-0.5b}
PROMPTS=${PROMPTS:-editor_replay:test,chat_turns,humaneval:test}; LEVELS=${LEVELS:-1,4,16}
REQUESTS=${REQUESTS:-32}; ROUNDS=${ROUNDS:-4}; DURATION=${DURATION:-1800}; TIME_LIMIT=${TIME_LIMIT:-28800}
OUTPUT_LEN=${OUTPUT_LEN:-}; EXTRA_BODY=${EXTRA_BODY:-'{"temperature": 0}'}
# FIM requests as one prompt with the target's markers: llama-server's /v1/completions ignores OpenAI's suffix
FIM_MARKERS=${FIM_MARKERS-'<|fim_prefix|>,<|fim_suffix|>,<|fim_middle|>'}
THREADS=${THREADS:-2}; CTX=${CTX:-4096}; FIXED_DRAFT=${FIXED_DRAFT:-suffix}; FIXED_K=${FIXED_K:-4}
LLAMA_DRAFT_MAX=${LLAMA_DRAFT_MAX:-$FIXED_K}; LLAMA_DRAFT_MIN=${LLAMA_DRAFT_MIN:-}; CACHE_MB=${CACHE_MB:-}
ALL="llama-server,llama-server-draft,llamacpp-target,llamacpp-auto,llamacpp-fixed,ik-target,ik-auto,ik-fixed"
ENDPOINTS=${ENDPOINTS:-$ALL}; PORT=${PORT:-}; OUT=${OUT:-runs/peers-$(date -u +%Y%m%d-%H%M%S)}
TOOLS=${TOOLS:-$HOME/.cache/specdecode/llama.cpp-tools}

mkdir -p "$OUT/logs"
path() { python -c "from specdecode.models.loading import resolve; print(resolve('$1').path)"; }
T=$(path "$TARGET"); D=$(path "$DRAFT")
SLOTS=$(tr ',' '\n' <<< "$LEVELS" | sort -n | tail -1)  # every level's sessions run at once

# What the run was: the code, the machine, the libraries, the settings.
{ git rev-parse HEAD; git status --short --untracked-files=no | sed 's/^/modified: /'; } > "$OUT/commit.txt"
{ grep -m1 '^model name' /proc/cpuinfo; grep -m1 '^flags' /proc/cpuinfo; echo "cores: $(nproc)"
  free -g | sed -n 2p; echo "load at start: $(cut -d' ' -f1-3 /proc/loadavg)"; } > "$OUT/machine.txt"
{ pip list 2>/dev/null | grep -i -E '^(llama.cpp.python|ik.llama.cpp.python|specdecode) ' || true
  LD_LIBRARY_PATH="$TOOLS/build/bin" "$TOOLS/bin/llama-server" --version 2>&1 | grep -i version || true
} > "$OUT/versions.txt"
for name in TARGET DRAFT PROMPTS LEVELS REQUESTS ROUNDS DURATION TIME_LIMIT OUTPUT_LEN EXTRA_BODY FIM_MARKERS THREADS CTX \
  FIXED_DRAFT FIXED_K LLAMA_DRAFT_MAX LLAMA_DRAFT_MIN CACHE_MB ENDPOINTS LLAMA_ARGS SERVE_ARGS; do
  echo "$name=${!name:-}"
done > "$OUT/settings.txt"
printf 'label\tport\tcommand\n' > "$OUT/endpoints.tsv"

PIDS=()
cleanup() {  # TERM every server this script started, then KILL what still runs after a while
  local pid
  for pid in ${PIDS[@]+"${PIDS[@]}"}; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 1 30); do
    local alive=0
    for pid in ${PIDS[@]+"${PIDS[@]}"}; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 1
  done
  for pid in ${PIDS[@]+"${PIDS[@]}"}; do kill -KILL "$pid" 2>/dev/null || true; done
  true
}
trap cleanup EXIT

has() { [[ ",$ENDPOINTS," == *",$1,"* ]]; }
skip() { echo "skipped $1: $2" | tee -a "$OUT/skipped.txt"; }

ENDPOINT_ARGS=()
next_port() {  # fixed ports collide with other scripts on a shared machine: by default take a free one
  if [ -n "$PORT" ]; then echo $((PORT + $(wc -l < "$OUT/endpoints.tsv") - 1)); return; fi
  python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
}
launch() {  # launch LABEL COMMAND...: start one server (--port appended), wait for /health, warm it up
  local label=$1 port; shift
  port=$(next_port)
  printf '%s\t%s\t%s\n' "$label" "$port" "$*" >> "$OUT/endpoints.tsv"
  "$@" --port "$port" > "$OUT/logs/$label.log" 2>&1 &
  local pid=$!
  PIDS+=("$pid")
  for _ in $(seq 1 "${STARTUP_S:-1800}"); do  # `auto` measures this machine's costs first when it has none cached
    kill -0 "$pid" 2>/dev/null || break
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    sleep 1
  done
  if ! kill -0 "$pid" 2>/dev/null || ! curl -sf "http://127.0.0.1:$port/health" >/dev/null; then
    skip "$label" "did not come up (log: logs/$label.log)"; tail -5 "$OUT/logs/$label.log" || true
    kill -TERM "$pid" 2>/dev/null || true
    return 0
  fi
  curl -s "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "def f(x):", "max_tokens": 8, "temperature": 0}' >/dev/null || true  # page the weights in
  ENDPOINT_ARGS+=(--endpoint "$label=http://127.0.0.1:$port")
  echo "up: $label on port $port"
}

llama_server() {  # llama_server LABEL [DRAFT FLAGS...]
  local label=$1; shift
  local cache=(); [ -n "$CACHE_MB" ] && cache=(--cache-ram "$CACHE_MB")
  # shellcheck disable=SC2086
  launch "$label" env LD_LIBRARY_PATH="$TOOLS/build/bin:${LD_LIBRARY_PATH:-}" "$TOOLS/bin/llama-server" -m "$T" "$@" \
    -t "$THREADS" -tb "$THREADS" -np "$SLOTS" -c $((SLOTS * CTX)) --metrics ${cache[@]+"${cache[@]}"} \
    ${LLAMA_ARGS:-}
}
if [ -x "$TOOLS/bin/llama-server" ]; then
  # llama-server renamed its draft-length flags; use the spelling this build has
  HELP=$(LD_LIBRARY_PATH="$TOOLS/build/bin" "$TOOLS/bin/llama-server" --help 2>&1 || true)
  if grep -q -- '--spec-draft-n-max' <<< "$HELP"; then DMAX=--spec-draft-n-max; DMIN=--spec-draft-n-min
  else DMAX=--draft-max; DMIN=--draft-min; fi
  DRAFT_FLAGS=(-md "$D" "$DMAX" "$LLAMA_DRAFT_MAX")
  [ -n "$LLAMA_DRAFT_MIN" ] && DRAFT_FLAGS+=("$DMIN" "$LLAMA_DRAFT_MIN")
  if has llama-server; then llama_server llama-server; fi
  if has llama-server-draft; then llama_server llama-server-draft "${DRAFT_FLAGS[@]}"; fi
else
  for label in llama-server llama-server-draft; do
    if has "$label"; then skip "$label" "no $TOOLS/bin/llama-server (scripts/build-llamacpp-tools.sh llama-server)"; fi
  done
fi

ours() {  # ours LABEL BACKEND [DRAFT FLAGS...]
  local label=$1 backend=$2; shift 2
  local cache=(); [ -n "$CACHE_MB" ] && cache=(--prefix-cache-mb "$CACHE_MB")
  # shellcheck disable=SC2086
  launch "$label" python -m specdecode.cli serve --backend "$backend" --target "$T" "$@" --threads "$THREADS" \
    --max-batch-size "$SLOTS" --max-context "$CTX" --log-level warning ${cache[@]+"${cache[@]}"} ${SERVE_ARGS:-}
}
for backend in llamacpp ik_llamacpp; do
  prefix=${backend%_llamacpp}  # the labels: llamacpp-*, ik-*
  if ! python -c "from specdecode.models import $backend as m; raise SystemExit(0 if m.available() else 1)"; then
    for kind in target auto fixed; do
      if has "$prefix-$kind"; then skip "$prefix-$kind" "--backend $backend is not installed here"; fi
    done
    continue
  fi
  if has "$prefix-target"; then ours "$prefix-target" "$backend"; fi
  if has "$prefix-auto"; then
    ours "$prefix-auto" "$backend" --draft "$D" --draft ngram --draft suffix --draft-policy auto
  fi
  if has "$prefix-fixed"; then ours "$prefix-fixed" "$backend" --draft "$FIXED_DRAFT" -k "$FIXED_K"; fi
done
[ ${#ENDPOINT_ARGS[@]} -gt 0 ] || { echo "no endpoint came up"; exit 1; }

# One load run per prompt set, every endpoint in it; a failed set does not stop the others.
IFS=',' read -r -a SETS <<< "$PROMPTS"
for entry in "${SETS[@]}"; do
  pset=${entry%@*}; n=$REQUESTS  # SET@N: N requests per level and endpoint for this set (a session's are many)
  [[ "$entry" == *@* ]] && n=${entry##*@}
  dir=${pset//[:\/]/-}
  echo "load: $pset, $n requests per level and endpoint -> $OUT/$dir"
  python -m specdecode.cli load "${ENDPOINT_ARGS[@]}" --prompts "$pset" --levels "$LEVELS" \
    --num-requests "$n" --rounds "$ROUNDS" --duration "$DURATION" --time-limit "$TIME_LIMIT" \
    ${OUTPUT_LEN:+--output-len "$OUTPUT_LEN"} ${FIM_MARKERS:+--fim-markers "$FIM_MARKERS"} --extra-body "$EXTRA_BODY" --no-progress --out "$OUT/$dir" \
    > "$OUT/logs/load-$dir.log" 2>&1 || echo "load failed for $pset (logs/load-$dir.log)" | tee -a "$OUT/skipped.txt"
done

while IFS=$'\t' read -r label port _; do
  [ "$label" = label ] && continue
  curl -sf "http://127.0.0.1:$port/metrics" > "$OUT/logs/$label-metrics.txt" 2>/dev/null \
    || rm -f "$OUT/logs/$label-metrics.txt"
done < "$OUT/endpoints.tsv"
echo "load at end: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/machine.txt"
python docs/bench/peers/summarize.py "$OUT" > "$OUT/summary.md"
cat "$OUT/summary.md"
echo "written: $OUT"
