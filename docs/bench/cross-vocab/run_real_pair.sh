#!/bin/bash
# Issue 42 on the real pair: SmolLM2-135M drafting for Qwen2.5-Coder-1.5B across tokenizers (xvocab: string-level
# exact match; xvocab-tli: token-level intersection) beside the same-vocabulary Qwen2.5-Coder-0.5B draft, on the
# llama.cpp backend: `check` (lossless proof) for both cross-vocabulary modes, then one bench run per draft model
# (each interleaves its own target-only baseline; bench runs one draft model per run).
#   bash docs/bench/cross-vocab/run_real_pair.sh OUT_DIR [THREADS]
set -u
out=${1:?out dir}; threads=${2:-2}
mkdir -p "$out"
for spec in xvocab:smollm2-135m xvocab-tli:smollm2-135m; do
  name=$(echo "$spec" | tr ':.' '__')
  echo "== check $spec $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
  specdecode check --backend llamacpp --threads "$threads" --target qwen2.5-coder-1.5b --draft "$spec" -k 4 \
    --num-prompts 4 --json "$out/check-$name.json" --no-progress > "$out/check-$name.txt" 2>&1
  echo "   exit $? $(tail -1 "$out/check-$name.txt")"
done
for spec in xvocab:smollm2-135m xvocab-tli:smollm2-135m qwen2.5-coder-0.5b; do
  name=$(echo "$spec" | tr ':.' '__')
  echo "== bench $spec $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
  specdecode bench --backend llamacpp --threads "$threads" --target qwen2.5-coder-1.5b --draft "$spec" \
    --draft-lengths 2,4 --sampling greedy,t0.7-p0.95 --baselines none --prompts humaneval:test --num-prompts 8 \
    --max-new-tokens 64 --out "$out/bench-$name" --no-progress > "$out/bench-$name.txt" 2>&1
  echo "   exit $? $(date -u +%T)"
done
