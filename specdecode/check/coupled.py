"""Part 6: the coupled sampler (``--sampler coupled``): seeded equality with target-only decoding, and its law.

Equality (exact): every prompt with its own seed (``--seed`` based) under ``coupled_setting`` (default
T=0.7), ``coupled_tokens`` tokens, EOS on. Reference: target-only coupled decoding at batch size 1.
Compared: speculative coupled decoding with each draft length in ``coupled_ks`` (default 2, 4, 8), at
batch size 1 and with all prompts in one batch. Token ids, finish reason and text must be equal. At the
first divergence the target's logits there are recomputed (teacher-forced, batch of one) and the gap
between the two tokens' noise-perturbed scores, in logit units,

    gap = (logit[a] - logit[b]) - T * (log E[a] - log E[b])     (E: the race noise of that position)

is compared with part 3's tolerance (zero with ``--batch-invariant``): within it, a numeric near-tie of
the coupled choice (the runs computed the target's logits with other shapes), reported but not failing.
The part reports NO POWER when no draft token was accepted: the equality would be vacuous.

Law (statistical): for each context and sampled setting of part 1, the drafter's real proposal after the
context gives the draft's warped law there (a point mass for a drafter without one); over
``coupled_samples`` seeds the draft proposes its coupled choice with the seed's noise and the engine's
coupled verifier emits the first token, which must follow the reference-warped target law (chi-square
goodness of fit, Bonferroni over contexts x settings, level ``alpha_6``). Negative controls with the same
test: a verifier that accepts every draft token (the draft's law) must be detected in at least one context
per setting (else NO POWER), and noise not keyed by the seed (one token for all) always. The measured
acceptance of the first draft token is reported beside rejection sampling's ``sum(min(p, q))`` there.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from specdecode.check.common import CheckConfig, EnginePool, Progress, first_divergence, run_requests
from specdecode.check.contexts import Context
from specdecode.check.greedy import near_tie_rel
from specdecode.check.law import per_context_and_setting, real_chain
from specdecode.check.report import FAIL, PASS, WEAK, PartResult
from specdecode.check.stats import goodness_of_fit
from specdecode.models.base import next_token_logits
from specdecode.sampling import SamplingParams, coupled_choice, params_tensors, race_noise, warp

NAME = "coupled sampler"


def check_coupled(
    pool: EnginePool,
    prompts: list[list[int]],
    contexts: list[Context],
    cfg: CheckConfig,
    progress: Progress,
    verify_fn=None,
) -> PartResult:
    equality = _equality(pool, prompts, cfg, progress)
    law = _law(pool, contexts, cfg, progress, verify_fn or pool.spec(1).verifier.coupled)
    mismatches = [c for c in equality["comparisons"] if c["verdict"] == "mismatch"]
    ties = sum(c["verdict"] == "near-tie" for c in equality["comparisons"])
    rejected = [r for r in law["records"] if r["test"]["rejected"]]
    weak = [name for name, ctxs in law["control_detected"].items() if not ctxs]
    unkeyed_missed = sum(not r["control_unkeyed"]["rejected"] for r in law["records"])
    if mismatches or rejected:
        what = []
        if mismatches:
            c = mismatches[0]
            d = c["divergence"]
            what.append(
                f"{len(mismatches)} outputs differ from target-only; first: {c['run']}, prompt {c['prompt']}, "
                f"position {d['position']}: target-only {d['reference_token']!r} vs speculative "
                f"{d['speculative_token']!r}, score gap {_fmt(d.get('score_gap'))} > tolerance "
                f"{_fmt(d.get('tolerance'))}"
            )
        if rejected:
            worst = min(rejected, key=lambda r: r["test"]["p_value"])
            what.append(
                f"{len(rejected)}/{len(law['records'])} law tests rejected (worst: context {worst['context']}, "
                f"{worst['setting']}, p={worst['test']['p_value']:.2g})"
            )
        status, summary = FAIL, "; ".join(what)
    elif equality["accepted"] == 0:
        status, summary = WEAK, "no draft token was accepted in the equality runs: the equality proves nothing"
    elif weak or unkeyed_missed:
        status = WEAK
        summary = (
            f"outputs equal, but the accept-every-draft control was not detected for {', '.join(weak) or '-'} "
            f"(unkeyed-noise control missed {unkeyed_missed}x): raise --coupled-samples or use other prompts"
        )
    else:
        status = PASS
        summary = (
            f"{len(equality['comparisons'])} seeded outputs ({len(prompts)} prompts, "
            f"{cfg.coupled_setting.name}, k {'/'.join(map(str, cfg.coupled_ks))}, batch 1 and "
            f"{equality['batch']}, {cfg.coupled_tokens} tokens; {equality['accepted']}/{equality['drafted']} "
            f"drafts accepted) identical to target-only"
            + (f" except {ties} numeric near-ties" if ties else "")
            + f"; law: {len(law['records'])} chi-square tests at {law['level']:.1e}, min p="
            f"{min((r['test']['p_value'] for r in law['records']), default=1.0):.2g}, both controls detected"
        )
    return PartResult(6, NAME, status, summary, {"equality": equality, "law": law})


def _equality(pool: EnginePool, prompts: list[list[int]], cfg: CheckConfig, progress: Progress) -> dict:
    batch_prompts = prompts if len(prompts) > 1 else prompts * 2
    batch = max(2, min(cfg.greedy_batch, len(batch_prompts)))
    params = [
        cfg.coupled_setting.params(seed=cfg.seed * 1000 + i, max_new_tokens=cfg.coupled_tokens, sampler="coupled")
        for i in range(len(prompts))
    ]
    batch_params = [params[i % len(prompts)] for i in range(len(batch_prompts))]
    progress.part("6 coupled equality", len(prompts) + len(cfg.coupled_ks) * (len(prompts) + len(batch_prompts)))
    reference = run_requests(pool.target_only(1), prompts, params, progress.advance)
    runs = {}
    for k in cfg.coupled_ks:
        runs[f"k={k}, batch 1"] = run_requests(pool.engine(k, 1), prompts, params, progress.advance)
        runs[f"k={k}, batch {batch}"] = run_requests(
            pool.engine(k, batch), batch_prompts, batch_params, progress.advance
        )
    comparisons = []
    for label, outs in runs.items():
        for i, out in enumerate(outs):
            pi = i % len(prompts)
            comparisons.append(
                {
                    "run": label,
                    "prompt": pi,
                    "accepted": out.stats.accepted,
                    "drafted": out.stats.drafted,
                    **_compare(pool, prompts[pi], params[pi], reference[pi], out),
                }
            )
    return {
        "setting": cfg.coupled_setting.name,
        "batch": batch,
        "draft_lengths": list(cfg.coupled_ks),
        "drafted": sum(c["drafted"] for c in comparisons),
        "accepted": sum(c["accepted"] for c in comparisons),
        "reference": [r.token_ids for r in reference],
        "comparisons": comparisons,
    }


def _compare(pool: EnginePool, prompt: list[int], sp: SamplingParams, ref, out) -> dict:
    i = first_divergence(ref.token_ids, out.token_ids)
    if i is None:
        same = out.finish_reason == ref.finish_reason and out.text == ref.text
        return {"verdict": "equal" if same else "mismatch", "tokens": len(out.token_ids)}
    a = ref.token_ids[i] if i < len(ref.token_ids) else None
    b = out.token_ids[i] if i < len(out.token_ids) else None
    d = {"position": i, "reference_token": a, "speculative_token": b}
    if a is None or b is None:
        return {"verdict": "mismatch", "divergence": d | {"finish_reasons": [ref.finish_reason, out.finish_reason]}}
    runner = pool.target_only(1).target
    logits = next_token_logits(runner, prompt + ref.token_ids[:i])
    noise = race_noise(sp.seed, len(prompt) + i, logits.shape[-1])
    gap = float(logits[a] - logits[b]) - sp.temperature * (math.log(float(noise[a])) - math.log(float(noise[b])))
    tol = 0.0 if runner.batch_invariant else near_tie_rel(runner) * max(1.0, float(logits.abs().max()))
    d |= {"score_gap": gap, "tolerance": tol}
    return {"verdict": "near-tie" if abs(gap) <= tol else "mismatch", "divergence": d}


def _law(pool: EnginePool, contexts: list[Context], cfg: CheckConfig, progress: Progress, verify_fn) -> dict:
    engine = pool.spec(1)
    sampled = tuple(s for s in cfg.law_settings if not s.greedy)
    level = cfg.part_alpha() / max(1, len(contexts) * len(sampled))
    progress.part("6 coupled law", len(contexts) * len(sampled))

    def draft(ctx: list[int], setting, seed: int):
        return len(ctx), real_chain(engine, ctx, setting, 1, seed)

    def record(proposal, setting, seed: int) -> dict:
        position, chain = proposal
        return _law_record(chain, position, setting, seed, cfg.coupled_samples, level, verify_fn)

    records = per_context_and_setting(
        engine,
        contexts,
        replace(cfg, law_settings=sampled),
        progress,
        draft,
        record,
        lambda proposal: len(proposal[1].draft_tokens),
    )
    detected = {
        s.name: [r["context"] for r in records if r["setting"] == s.name and r["control_accept_all"]["rejected"]]
        for s in sampled
    }
    return {
        "test": "Pearson chi-square goodness of fit of the first emitted token to the reference-warped target "
        "law; Bonferroni over contexts x sampled settings",
        "level": level,
        "samples": cfg.coupled_samples,
        "contexts": [c.to_dict() for c in contexts],
        "control_detected": detected,
        "records": records,
    }


@torch.inference_mode()
def _law_record(chain, position: int, setting, seed: int, n: int, level: float, verify_fn) -> dict:
    params = setting.params(sampler="coupled")
    target = warp(chain.target_logits[:1], *params_tensors([params]))[0]  # [V]
    vocab = target.shape[-1]
    if chain.draft_probs is not None and len(chain.draft_tokens):
        draft = chain.draft_probs[0][:vocab]
    else:  # a point-mass drafter: its proposal, or the target's argmax when it proposed nothing
        token = int(chain.draft_tokens[0]) if len(chain.draft_tokens) else int(target.argmax())
        draft = torch.zeros(vocab).index_fill_(0, torch.tensor([token]), 1.0)
    probs = target.expand(1, 2, vocab)
    emitted, proposed = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    for i in range(n):
        noise = race_noise(seed * 100_000 + i, position, vocab)
        d = coupled_choice(draft, noise)
        result = verify_fn(d.view(1, 1), probs, noise.expand(1, 2, vocab), torch.tensor([1]))
        emitted[i], proposed[i] = int(result.tokens[0, 0]), int(d)
    unkeyed = np.full(n, int(coupled_choice(target, race_noise(seed * 100_000, position, vocab))))
    reference = target.double().numpy()
    return {
        "test": goodness_of_fit(emitted, reference, level).to_dict(),
        "control_accept_all": goodness_of_fit(proposed, reference, level).to_dict(),
        "control_unkeyed": goodness_of_fit(unkeyed, reference, level).to_dict(),
        "acceptance": float(np.mean(proposed == emitted)),
        "rejection_acceptance": float(torch.minimum(target, draft).sum()),
    }


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"
