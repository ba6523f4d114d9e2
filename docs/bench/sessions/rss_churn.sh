#!/usr/bin/env bash
# The prefix cache under churn: `specdecode serve` (real pair, llama.cpp) with a small --prefix-cache-mb so that
# entries are evicted all the time, driven by `specdecode load` for DURATION seconds at a fixed concurrency
# over the editor-replay sessions (many files, each typed into: every request extends or edits an earlier
# prompt), cycled. Every SAMPLE seconds it records the server's RSS (/proc/PID/status VmRSS and RssFile) and
# its prefix-cache gauges (/metrics). At the end, summary.txt: RSS after warm-up, at the end and at its peak
# against weights + budget, the drift over the run's second half, evictions, and requests that failed.
# Usage: docs/bench/sessions/rss_churn.sh [DURATION] [CACHE_MB] [LEVEL]
# Env: TARGET, DRAFT (aliases or .gguf; default the Qwen2.5-Coder pair), BACKEND (llamacpp), THREADS (2),
#      K (4), PROMPTS (editor_replay), SAMPLE (10), OUT (runs/rss-churn), PORT (18461),
#      OUTPUT_LEN (32: short outputs, so more requests, more cache entries, more evictions)
set -euo pipefail
cd "$(dirname "$0")/../../.."
DURATION=${1:-1800}; CACHE_MB=${2:-128}; LEVEL=${3:-4}
TARGET=${TARGET:-qwen2.5-coder-1.5b}; DRAFT=${DRAFT:-qwen2.5-coder-0.5b}; BACKEND=${BACKEND:-llamacpp}
THREADS=${THREADS:-2}; K=${K:-4}; PROMPTS=${PROMPTS:-editor_replay}; SAMPLE=${SAMPLE:-10}
OUT=${OUT:-runs/rss-churn}; PORT=${PORT:-18461}; OUTPUT_LEN=${OUTPUT_LEN:-32}
mkdir -p "$OUT"
git rev-parse HEAD > "$OUT/commit.txt"
python -m specdecode.cli serve --backend "$BACKEND" --target "$TARGET" --draft "$DRAFT" --num-draft-tokens "$K" \
  --threads "$THREADS" --max-batch-size "$LEVEL" --prefix-cache-mb "$CACHE_MB" --port "$PORT" \
  --log-level warning > "$OUT/serve.log" 2>&1 &
SERVER=$!
SAMPLER=""
trap 'kill -TERM $SERVER 2>/dev/null || true; if [ -n "$SAMPLER" ]; then kill $SAMPLER 2>/dev/null || true; fi' EXIT
for _ in $(seq 1 900); do  # ours, not another server on the port: its /metrics names specdecode
  curl -sf "http://127.0.0.1:$PORT/metrics" 2>/dev/null | grep -q "^specdecode_" && break
  kill -0 $SERVER 2>/dev/null || { echo "the server exited (see $OUT/serve.log)" >&2; exit 1; }
  sleep 1
done
curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt": "def f(x):", "max_tokens": 4}' >/dev/null
python - "$SERVER" "$PORT" "$SAMPLE" > "$OUT/samples.csv" <<'EOF' &
import sys, time, urllib.request
pid, port, every = sys.argv[1], sys.argv[2], float(sys.argv[3])
print("t_s,rss_mb,rss_file_mb,cache_bytes_mb,entries,evictions,hit_rate", flush=True)
t0 = time.time()
while True:
    try:
        status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status") if ":" in line)
        rss = int(status["VmRSS"].split()[0]) / 1024
        rss_file = int(status.get("RssFile", "0 kB").split()[0]) / 1024
        gauges = {}
        for line in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode().splitlines():
            if line.startswith("specdecode_prefix_cache_"):
                name, value = line.rsplit(" ", 1)
                gauges[name.split("{")[0]] = float(value)
        print(f"{time.time() - t0:.0f},{rss:.1f},{rss_file:.1f},{gauges.get('specdecode_prefix_cache_bytes', 0) / 2**20:.1f},"
              f"{gauges.get('specdecode_prefix_cache_entries', 0):.0f},{gauges.get('specdecode_prefix_cache_evictions', 0):.0f},"
              f"{gauges.get('specdecode_prefix_cache_hit_rate', 0):.3f}", flush=True)
    except (OSError, KeyError, ValueError):
        if not __import__("os").path.exists(f"/proc/{pid}"):
            break
    time.sleep(every)
EOF
SAMPLER=$!
python -m specdecode.cli load --endpoint "serve=http://127.0.0.1:$PORT" --prompts "$PROMPTS" --levels "$LEVEL" \
  --num-requests 100000 --output-len "$OUTPUT_LEN" --duration "$DURATION" --time-limit "$((DURATION + 600))" \
  --extra-body '{"temperature": 0}' --no-progress --out "$OUT/load" > "$OUT/load.log" 2>&1 || echo "load exited $?" >> "$OUT/load.log"
curl -s "http://127.0.0.1:$PORT/metrics" > "$OUT/metrics-end.txt" || true
grep -m1 "model name" /proc/cpuinfo > "$OUT/machine.txt"; grep -m1 "^flags" /proc/cpuinfo >> "$OUT/machine.txt"; uptime >> "$OUT/machine.txt"
python - "$OUT" "$CACHE_MB" "$TARGET" "$DRAFT" > "$OUT/summary.txt" <<'EOF'
import csv, statistics, sys
from pathlib import Path
out, budget = Path(sys.argv[1]), float(sys.argv[2])
rows = [{k: float(v) for k, v in r.items()} for r in csv.DictReader(open(out / "samples.csv"))]
if len(rows) < 4:
    sys.exit("too few samples")
warm = [r for r in rows if r["t_s"] >= 60] or rows  # after the first minute: weights paged in, caches warm
half = [r for r in rows if r["t_s"] >= rows[-1]["t_s"] / 2]
first, peak, last = warm[0], max(rows, key=lambda r: r["rss_mb"]), rows[-1]
slope = statistics.linear_regression([r["t_s"] / 60 for r in half], [r["rss_mb"] for r in half]).slope
print(f"samples: {len(rows)} over {rows[-1]['t_s'] / 60:.1f} min; prefix-cache budget {budget:g} MiB (target and draft together)")
print(f"RSS after warm-up {first['rss_mb']:.0f} MiB (file-backed {first['rss_file_mb']:.0f}), end {last['rss_mb']:.0f}, peak {peak['rss_mb']:.0f} at {peak['t_s'] / 60:.1f} min")
print(f"RSS drift over the second half: {slope:+.2f} MiB/min; peak - warm-up = {peak['rss_mb'] - first['rss_mb']:.0f} MiB against a budget of {budget:g} MiB")
print(f"target cache at end: {last['cache_bytes_mb']:.0f} MiB, {last['entries']:.0f} entries, {last['evictions']:.0f} evictions, hit rate {last['hit_rate']:.3f}")
EOF
grep -E "requests|error|failed" "$OUT/load.log" | tail -5 >> "$OUT/summary.txt" || true
cat "$OUT/summary.txt"
echo "written: $OUT"
