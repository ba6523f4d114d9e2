#!/usr/bin/env bash
# EAGLE drafter for the real target, start to finish (docs/eagle.md, docs/benchmarks.md "EAGLE"):
# features from the standard library's source (shared with Medusa), training, then one interleaved
# bench of EAGLE (chain and dynamic tree) beside Medusa, the 0.5B draft model, n-gram lookup and
# target-only on held-out HumanEval problems (100-163) and Spec-Bench, and `check` with EAGLE.
# Every step resumes: rerun the same command after an interruption. Weights stay outside the repo.
#   HEADS_ROOT=~/.cache/specdecode OUT=runs/eagle FEATURE_TOKENS=84809 EPOCHS=3 scripts/eagle_recipe.sh
# (docs/benchmarks.md "EAGLE": 52 min of training on 2 cores; more tokens and epochs raise acceptance)
# COMPUTE_DTYPE (default auto: bf16 autocast where the CPU has native bf16), N_HE / REPEATS (HumanEval
# problems, runs per problem), TOKENS (new tokens per run).
set -euo pipefail
ROOT=${HEADS_ROOT:-$HOME/.cache/specdecode}
FEATS=$ROOT/features/qwen2.5-coder-1.5b-stdlib
EAGLE=$ROOT/heads/qwen2.5-coder-1.5b-eagle
MEDUSA=$ROOT/heads/qwen2.5-coder-1.5b-medusa
OUT=${OUT:-runs/eagle}
if [ -z "${SKIP_TRAIN:-}" ]; then  # SKIP_TRAIN=1: the drafter is trained already, benchmark it
time specdecode heads extract --target qwen2.5-coder-1.5b --out "$FEATS" --max-tokens "${FEATURE_TOKENS:-84809}" \
    --max-doc-tokens 1024 --no-progress
# the default recipe for a 2-core CPU: EAGLE-1 features, a narrower MLP (2816 instead of the target's
# 8960), a 16k draft vocabulary, 3 unrolled training-time-test steps
time specdecode heads train --kind eagle --features "$FEATS" --out "$EAGLE" --intermediate-size 2816 \
    --draft-vocab 16384 --ttt-steps 3 --epochs "${EPOCHS:-3}" --batch-chunks 1 --lr 1e-3 --checkpoint-every 25 --evals 10 \
    --compute-dtype "${COMPUTE_DTYPE:-auto}" --no-progress
fi
COMMON=(--target qwen2.5-coder-1.5b --backend torch --max-new-tokens "${TOKENS:-40}" --baselines none --no-progress)
# EAGLE_CONFIGS: space-separated k|trees pairs (session 16: "k=2|trees=none k=3|trees=none k=3|trees=4x8")
EXTRA=()
for c in ${EAGLE_CONFIGS:-k=2|trees=4x8 k=4|trees=none}; do EXTRA+=(--extra-draft "eagle:$EAGLE|$c"); done
[ -d "$MEDUSA" ] && EXTRA+=(--extra-draft "medusa:$MEDUSA|k=2|trees=none")
[ -n "${NGRAM:-}" ] && EXTRA+=(--extra-draft "ngram|k=4")
DRAFT=${DRAFT:-qwen2.5-coder-0.5b}
COMMON+=(--draft-quantization "${DRAFT_QUANT:-none}")  # session 16: gguf (the draft's GGUF weights on llama.cpp)
# HumanEval held-out problems, greedy and T = 0.7
specdecode bench "${COMMON[@]}" --draft "$DRAFT" --draft-lengths 4 "${EXTRA[@]}" \
    --sampling greedy,t0.7-p0.95 --prompts humaneval:test -n "${N_HE:-4}" --repeats "${REPEATS:-1}" --out "$OUT/humaneval"
# Spec-Bench, one prompt per category, greedy
specdecode bench "${COMMON[@]}" --draft "$DRAFT" --draft-lengths 4 "${EXTRA[@]}" \
    --sampling greedy --prompts spec-bench -n "${N_SB:-1}" --out "$OUT/spec-bench"
[ -n "${SKIP_CHECK:-}" ] && exit 0
# exactness on the real pair: chain and tree, greedy and sampled settings (parts 1 and 3)
specdecode check --target qwen2.5-coder-1.5b --draft "eagle:$EAGLE" -k 2 --parts 1,3 --no-progress --json "$OUT/check-chain.json"
specdecode check --target qwen2.5-coder-1.5b --draft "eagle:$EAGLE" -k 2 --tree-topk 4 --tree-nodes 8 --parts 1,3 --no-progress \
    --json "$OUT/check-tree.json"
