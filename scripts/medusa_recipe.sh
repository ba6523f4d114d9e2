#!/usr/bin/env bash
# Medusa heads for the real target, start to finish (docs/medusa.md, docs/benchmarks.md "Medusa heads"):
# features from the standard library's source, training, then one interleaved bench of Medusa (chain and
# static tree) beside the 0.5B draft model and target-only on held-out HumanEval problems (100-163) and
# Spec-Bench. Every step resumes: rerun the same command after an interruption. Weights stay outside the repo.
#   HEADS_ROOT=~/.cache/specdecode OUT=runs/medusa TOKENS=40 N_HE=6 N_SB=1 scripts/medusa_recipe.sh
set -euo pipefail
ROOT=${HEADS_ROOT:-$HOME/.cache/specdecode}
FEATS=$ROOT/features/qwen2.5-coder-1.5b-stdlib
HEADS=$ROOT/heads/qwen2.5-coder-1.5b-medusa
OUT=${OUT:-runs/medusa}
time specdecode heads extract --target qwen2.5-coder-1.5b --out "$FEATS" --max-tokens "${FEATURE_TOKENS:-60000}" \
    --max-doc-tokens 1024 --no-progress
time specdecode heads train --kind medusa --features "$FEATS" --out "$HEADS" --num-heads 4 --epochs "${EPOCHS:-3}" \
    --no-progress
COMMON=(--target qwen2.5-coder-1.5b --max-new-tokens "${TOKENS:-40}" --baselines none --no-progress)
# heads vs the draft model, chains and trees, greedy and T = 0.7
specdecode bench "${COMMON[@]}" --draft qwen2.5-coder-0.5b --extra-draft "medusa:$HEADS" --draft-lengths 4 \
    --tree-shapes 4x16 --sampling greedy,t0.7-p0.95 --prompts humaneval:test -n "${N_HE:-6}" --out "$OUT/humaneval"
# the heads' draft length
specdecode bench "${COMMON[@]}" --draft "medusa:$HEADS" --draft-lengths 1,2,4 --sampling greedy \
    --prompts humaneval:test -n "${N_HE:-4}" --out "$OUT/humaneval-k"
# Spec-Bench, one prompt per category
specdecode bench "${COMMON[@]}" --draft qwen2.5-coder-0.5b --extra-draft "medusa:$HEADS" --draft-lengths 2,4 \
    --sampling greedy --prompts spec-bench -n "${N_SB:-1}" --out "$OUT/spec-bench"
