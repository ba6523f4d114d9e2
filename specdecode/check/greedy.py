"""Part 3: greedy speculative output equals greedy target-only output, token for token.

Reference: target-only decoding, batch size 1. Compared: speculative decoding at batch size 1 and
with all prompts in one batch (at least 2). At the first divergence the target's logits at that
position are recomputed (teacher-forced on the common prefix, batch of one) and the gap between the
two tokens' logits is compared with a tolerance for the weights' dtype:

    tol = NEAR_TIE_REL[dtype] * max(1, |top-1 logit|)

A gap within tolerance is a *numeric near-tie*: the two runs compute the same function with
different shapes (K+1 tokens per verify pass, batching), so their roundings differ, and a near-tie
can flip. Such divergences are reported but do not fail the part; anything else is a real mismatch.
The tolerances are a stated choice, not a derivation: about 8 units of rounding at the logit scale
for bfloat16 (unit roundoff 2^-8, so 2^-5; per-layer rounding of activations accumulates over a few
dozen layers), 2^-8 for float16, and 2^-14 for float32, where kernel reduction order is the only
source of difference. With ``--batch-invariant`` every row is computed alike whatever its batch and
verify width, so the tolerance is zero: any divergence is a mismatch. A runner may state its own
relative tolerance (``near_tie_rel``): the llama.cpp runner does, since its kernels quantize
activations and pick other kernels for a many-token verify than for one token.
"""

from __future__ import annotations

import torch

from specdecode.check.common import CheckConfig, EnginePool, Progress, Run, first_divergence, run_requests
from specdecode.check.report import FAIL, PASS, PartResult
from specdecode.models.base import next_token_logits
from specdecode.sampling import SamplingParams

NEAR_TIE_REL = {torch.bfloat16: 2.0**-5, torch.float16: 2.0**-8, torch.float32: 2.0**-14, torch.float64: 2.0**-40}


def check_greedy(pool: EnginePool, prompts: list[list[int]], cfg: CheckConfig, progress: Progress) -> PartResult:
    batch_prompts = prompts if len(prompts) > 1 else prompts * 2
    batch = max(2, min(cfg.greedy_batch, len(batch_prompts)))
    progress.part("3 greedy equality", 2 * len(prompts) + len(batch_prompts))
    params = SamplingParams(temperature=0.0, max_new_tokens=cfg.greedy_tokens)
    reference = run_requests(pool.target_only(1), prompts, params, progress.advance)
    runs = {
        "speculative, batch 1": run_requests(pool.spec(1), prompts, params, progress.advance),
        f"speculative, batch {batch}": run_requests(pool.spec(batch), batch_prompts, params, progress.advance),
    }
    comparisons = []
    for label, outs in runs.items():
        for i, out in enumerate(outs):
            pi = i % len(prompts)
            comparisons.append({"run": label, "prompt": pi, **compare(pool, prompts[pi], reference[pi], out)})
    real = [c for c in comparisons if c["verdict"] == "mismatch"]
    ties = [c for c in comparisons if c["verdict"] == "near-tie"]
    emitted = sum(len(r.token_ids) for r in reference)
    if real:
        c = real[0]
        d = c["divergence"]
        summary = (
            f"{len(real)} real mismatches; first: {c['run']}, prompt {c['prompt']}, position {d['position']}: "
            f"target-only {d['reference_token']!r} vs speculative {d['speculative_token']!r}, "
            f"logit gap {_fmt(d.get('logit_gap'))} > tolerance {_fmt(d.get('tolerance'))}"
        )
        status = FAIL
    else:
        summary = (
            f"{len(comparisons)} outputs ({len(prompts)} prompts, batch 1 and {batch}, {cfg.greedy_tokens} tokens, "
            f"{emitted} reference tokens) identical to target-only"
        )
        if ties:
            summary += f" except {len(ties)} numeric near-ties (see evidence)"
        status = PASS
    runner = pool.target_only(1).target
    details = {
        "dtype": str(runner.dtype),
        "near_tie_relative_tolerance": near_tie_rel(runner),
        "reference": [r.token_ids for r in reference],
        "comparisons": comparisons,
    }
    return PartResult(3, "greedy equality", status, summary, details)


def compare(pool: EnginePool, prompt: list[int], ref: Run, out: Run) -> dict:
    i = first_divergence(ref.token_ids, out.token_ids)
    if i is None:
        same = out.finish_reason == ref.finish_reason and out.text == ref.text
        return {
            "verdict": "equal" if same else "mismatch",
            "tokens": len(out.token_ids),
            **(
                {}
                if same
                else {
                    "divergence": {
                        "position": len(out.token_ids),
                        "reference_token": None,
                        "speculative_token": None,
                        "finish_reasons": [ref.finish_reason, out.finish_reason],
                    }
                }
            ),
        }
    a = ref.token_ids[i] if i < len(ref.token_ids) else None
    b = out.token_ids[i] if i < len(out.token_ids) else None
    d = {"position": i, "reference_token": a, "speculative_token": b}
    if a is None or b is None:  # one run ended early with the same tokens: an accounting error, not numerics
        d["finish_reasons"] = [ref.finish_reason, out.finish_reason]
        return {"verdict": "mismatch", "divergence": d}
    runner = pool.target_only(1).target
    logits = next_token_logits(runner, prompt + ref.token_ids[:i])
    top2 = torch.topk(logits, 2).values
    tol = near_tie_rel(runner) * max(1.0, float(top2[0].abs()))
    if runner.batch_invariant:  # both runs computed each row alike: no tie may flip
        tol = 0.0
    gap = float(logits[a] - logits[b])
    d |= {
        "top2_margin": float(top2[0] - top2[1]),
        "logit_gap": gap,
        "tolerance": tol,
        "reference_logit": float(logits[a]),
        "speculative_logit": float(logits[b]),
    }
    return {"verdict": "near-tie" if abs(gap) <= tol else "mismatch", "divergence": d}


def near_tie_rel(runner) -> float:
    """The relative logit tolerance for ``runner``: its own statement, else by its dtype."""
    return runner.near_tie_rel or NEAR_TIE_REL.get(runner.dtype, NEAR_TIE_REL[torch.float32])


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"
