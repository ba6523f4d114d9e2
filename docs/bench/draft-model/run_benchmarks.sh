#!/usr/bin/env bash
# The real-pair benchmarks behind docs/benchmarks.md, run one after another.
# Each writes runs/<name>/ (records.jsonl, results.json, report.md, PNGs); rerunning a command resumes it.
# Usage: docs/bench/draft-model/run_benchmarks.sh [name ...]   (default: all, in the order below)
set -u
cd "$(dirname "$0")/../../.."
PAIR=(--target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --dtype bfloat16 --threads 1)

run() {
  local name=$1; shift
  echo "=== $name: $(date -Is)"
  python -m specdecode.cli bench "${PAIR[@]}" "$@" --out "runs/$name" > "runs/$name.log" 2>&1
  echo "=== $name: exit $? at $(date -Is)"
}

# issue 2: engine vs transformers, target-only and speculative k = 1..8, greedy, 128 new tokens
issue2() { run issue2-humaneval --prompts humaneval -n 4 --max-new-tokens 128 --sampling greedy \
             --draft-lengths 1,2,3,4,5,6,7,8 --baselines hf,hf-assisted; }
# the same in float32 (what --dtype auto picks on a CPU without native bf16 matmuls)
issue2fp32() { run issue2-humaneval-fp32 --dtype float32 --prompts humaneval -n 4 --max-new-tokens 128 \
                 --sampling greedy --draft-lengths 1,2,3,4,6,8 --baselines hf,hf-assisted; }
# issue 3, code completion: greedy and T=0.7/top-p 0.95, the draft lengths that matter
humaneval() { run humaneval-sampling --prompts humaneval -n 5 --max-new-tokens 64 --sampling greedy,t0.7-p0.95 \
                --draft-lengths 2,4 --baselines none; }
# issue 3, Spec-Bench: one prompt per category, greedy and T=0.7/top-p 0.95
specbench() { run spec-bench --prompts spec-bench -n 1 --max-new-tokens 64 --sampling greedy,t0.7-p0.95 \
                --draft-lengths 3 --baselines none; }
# issue 3 at the stated scale, in float32 (what --dtype auto picks on this AVX2-only CPU; bf16 prefill and
# verification are emulated here and would take ~4x longer): 40 HumanEval prompts and 5 per Spec-Bench
# category, greedy and T=0.7/top-p 0.95, target-only vs k=4 (the best fixed k in float32), 32 new tokens
humaneval40() { run humaneval40-fp32 --dtype float32 --prompts humaneval -n 40 --max-new-tokens 32 \
                  --sampling greedy,t0.7-p0.95 --draft-lengths 4 --baselines none; }
specbench5() { run spec-bench5-fp32 --dtype float32 --prompts spec-bench -n 5 --max-new-tokens 32 \
                 --sampling greedy,t0.7-p0.95 --draft-lengths 4 --baselines none; }
# issue 2: peak RSS of a generating process at batch 1 and 2k context
memory() { echo "=== memory: $(date -Is)"
           python -m specdecode.cli bench "${PAIR[@]}" -k 4 --memory-check 2048 --out runs/memory-2k \
             > runs/memory-2k.log 2>&1; echo "=== memory: exit $? at $(date -Is)"; }

mkdir -p runs
for name in "${@:-issue2 issue2fp32 humaneval specbench memory}"; do
  for n in $name; do "$n"; done
done
