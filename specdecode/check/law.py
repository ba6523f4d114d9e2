"""Part 1: the verification step follows the warped target law, on the pair's real distributions.

For each context (a prefix of a prompt where draft and target disagree most, see
:mod:`specdecode.check.contexts`) and sampling setting:

1. the real drafter proposes a chain ``d_1..d_n`` (n = num_draft_tokens) with its warped draft
   distributions ``draft_probs[j]``, and one target forward over ``[last prompt token, d_1..d_n]``
   gives ``target_logits[0..n]``;
2. with those tensors fixed, the verification step (the engine's ``warp`` of the target logits, then
   its verifier) runs ``law_samples`` times. Each repetition draws a fresh draft chain
   ``X_j ~ draft_probs[j]`` independently for every j and fresh uniforms;
3. for every position j, among the repetitions that accepted the first j draft tokens, the token
   emitted at position j must follow ``warp(target_logits[j])`` computed by the reference
   :func:`specdecode.sampling.warp`. (Given that event, which depends only on earlier draws,
   ``X_j`` and the later uniforms are fresh, so this holds exactly for a correct verifier: position
   0 is the law of the first emitted token; position n is the bonus token; in between the accepted
   and recovered tokens.) The target distributions at j >= 1 are the ones of the real chain;
   the verifier is a pure function, so its law holds for whatever distributions it is given.

Statistics: chi-square goodness of fit (:func:`specdecode.check.stats.goodness_of_fit`; a token
outside the target's support is an immediate failure), Bonferroni over contexts x sampled settings x
(n + 1) positions, so a correct verifier fails this part with probability at most the part's alpha.

Negative controls, per (context, setting), at position 0 and at the same level: samples straight
from the draft distribution (what "accept everything" would emit), and a verifier that resamples
from the target instead of the residual after a rejection. The part only passes if the draft control
is detected in at least one context for every sampled setting; otherwise it reports NO POWER.

Greedy: the emitted tokens must equal the target argmax exactly, for the real chain and for chains
forced to be rejected at every position 0..n (and fully accepted), through both the greedy verifier
and the speculative verifier fed one-hot distributions (what a mixed batch does).

What this part does not see: whether the drafter's tokens really follow the ``draft_probs`` it
reports, and how the engine wires requests to rows; part 2 covers those end to end.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import specdecode.engine as engine_module
from specdecode.check.common import CheckConfig, EnginePool, Progress
from specdecode.check.contexts import Context
from specdecode.check.report import FAIL, PASS, WEAK, PartResult
from specdecode.check.stats import goodness_of_fit
from specdecode.sampling import SamplingParams, SamplingSetting, make_generator, params_tensors, warp

CHUNK_ELEMENTS = 1 << 22  # verifier calls are chunked so that a [chunk, V] float64 tensor stays ~32 MB
GREEDY_REPEATS = 8


@dataclass
class _View:
    """What a drafter reads of a sequence (see ``drafters.base.SequenceView``)."""

    slot: int
    token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator


@dataclass
class Chain:
    draft_tokens: torch.Tensor  # [n] long
    draft_probs: torch.Tensor | None  # [n, V] warped draft distributions (None: point masses)
    target_logits: torch.Tensor  # [n+1, V] float32


def check_law(
    pool: EnginePool,
    contexts: list[Context],
    cfg: CheckConfig,
    progress: Progress,
    verify_fn=None,
    greedy_fn=None,
    warp_fn=None,
) -> PartResult:
    """``verify_fn``/``greedy_fn`` default to the engine's own verifier and ``warp_fn`` to the warp
    the engine module calls, so an engine running with a replaced verifier is tested as it runs."""
    engine = pool.spec(1)
    verify_fn = verify_fn or engine.verifier.speculative
    greedy_fn = greedy_fn or engine.verifier.greedy
    warp_fn = warp_fn or engine_module.warp
    if engine.drafter is None or pool.k == 0:
        raise ValueError("part 1 needs a drafter and --num-draft-tokens >= 1")
    sampled = [s for s in cfg.law_settings if not s.greedy]
    num_tests = len(contexts) * len(sampled) * (pool.k + 1)
    level = cfg.part_alpha() / max(1, num_tests)
    progress.part("1 verifier law", len(contexts) * len(cfg.law_settings))

    def record(chain: Chain, setting: SamplingSetting, seed: int) -> dict:
        if setting.greedy:
            return greedy_record(chain, warp_fn, verify_fn, greedy_fn, seed)
        return law_record(chain, setting, cfg.law_samples, level, seed, verify_fn, warp_fn)

    records = per_context_and_setting(
        engine,
        contexts,
        cfg,
        progress,
        lambda ctx, s, seed: real_chain(engine, ctx, s, pool.k, seed),
        record,
        lambda chain: len(chain.draft_tokens),
    )
    return _verdict(records, sampled, contexts, cfg, level, num_tests)


def per_context_and_setting(
    engine, contexts: list[Context], cfg: CheckConfig, progress: Progress, draft, record, size
) -> list[dict]:
    """For each context and setting: the drafter's real proposal after the context (``draft``), then
    ``record(proposal, setting, seed)``. The target's slot 0 holds the context; the drafter starts afresh
    (it expects the last token not to be cached yet; one that reads features observes the context's) and
    is released after drafting."""
    from specdecode.drafters.base import TargetFeatures

    records = []
    layers = tuple(engine.drafter.feature_layers)
    for ci, context in enumerate(contexts):
        ctx = context.token_ids
        cached = None
        if engine.prefix_cache is not None:  # (never with features: the engine keeps no cache then)
            feats, cached = None, restore_context(engine, ctx)
        else:
            feats = engine.target.prefill([0], [ctx[:-1]], layers)[0]
        for si, setting in enumerate(cfg.law_settings):
            seed = (cfg.seed * 1000 + ci) * 100 + si
            engine.drafter.start([0], [ctx])
            if layers:  # a drafter that reads the target's features (Medusa) gets the context's, as in the engine
                engine.drafter.observe([0], [TargetFeatures(0, list(ctx[:-1]), feats)])
            try:
                proposal = draft(ctx, setting, seed)
            finally:
                engine.drafter.release(0)
            rec = record(proposal, setting, seed)
            rec |= {"prefix_cache": cached} if cached is not None else {}
            records.append({"context": ci, "setting": setting.name, "num_draft": size(proposal), **rec})
            progress.advance()
    return records


@torch.inference_mode()
def restore_context(engine, ctx: list[int]) -> dict:
    """Slot 0 of the target gets ``ctx[:-1]`` from the engine's prefix cache (the rest prefilled on top), as an
    admission would. The distributions part 1 tests are the target's after that restored context, so they
    are checked against the target's own computed cold: the next-token logits must agree within the
    tolerance of part 3 (a stale or wrong-prefix entry gives other logits)."""
    from specdecode.check.greedy import near_tie_rel
    from specdecode.models.base import next_token_logits

    target = engine.target
    cold = next_token_logits(target, ctx)  # (its own prefill of the whole context, in slot 0)
    n = engine.prefix_cache.restore(0, ctx, len(ctx) - 1)
    if len(ctx) - 1 > n:
        target.prefill([0], [ctx[n:-1]], starts=[n])
    pos = torch.tensor([[len(ctx) - 1]])
    warm = target.logits(target.forward(torch.tensor([0]), torch.tensor([[ctx[-1]]]), pos).hidden)[0, 0].cpu()
    tolerance = near_tie_rel(target) * max(1.0, float(cold.abs().max()))
    gap = float((warm.float() - cold.float()).abs().max())
    return {"restored": n, "logit_gap": gap, "tolerance": tolerance, "same_logits": gap <= tolerance}


@torch.inference_mode()
def real_chain(engine, ctx: list[int], setting: SamplingSetting, k: int, seed: int) -> Chain:
    """Draft ``k`` tokens after ``ctx`` with the engine's drafter, then score them with the target.

    Expects the target's slot 0 to hold ``ctx[:-1]`` and the drafter to have started slot 0 on ctx.
    """
    params = setting.params(seed=seed, max_new_tokens=k + 1)
    view = _View(slot=0, token_ids=list(ctx), params=params, generator=make_generator(seed))
    proposal = engine.drafter.propose([view], [k])
    n = int(proposal.num_tokens[0])
    tokens = proposal.tokens[0, :n].cpu().clone()
    probs = None if proposal.probs is None else proposal.probs[0, :n].float().cpu().clone()
    ids = torch.tensor([[ctx[-1]] + tokens.tolist()])
    positions = (len(ctx) - 1 + torch.arange(n + 1))[None]
    logits = engine.target.logits(engine.target.forward(torch.tensor([0]), ids, positions).hidden)[0].cpu()
    return Chain(tokens, probs, logits.float())


def _warped(fn, logits: torch.Tensor, setting: SamplingSetting) -> torch.Tensor:  # [n+1, V]
    temperature, top_k, top_p = params_tensors([setting.params()] * logits.shape[0])
    return fn(logits, temperature, top_k, top_p)


def law_record(
    chain: Chain, setting: SamplingSetting, num_samples: int, level: float, seed: int, verify_fn, warp_fn
) -> dict:
    n = len(chain.draft_tokens)
    ref = _warped(warp, chain.target_logits, setting)  # the law the output must follow
    fed = _warped(warp_fn, chain.target_logits, setting)  # what the engine gives its verifier
    # Drop tokens that no distribution involved can produce: exact, and fast for top-k / top-p.
    support = (ref > 0).any(0) | (fed > 0).any(0)
    if chain.draft_probs is not None:
        support |= (chain.draft_probs > 0).any(0)
    support[chain.draft_tokens] = True
    cols = support.nonzero().flatten()  # [V'] vocabulary id of each kept column
    col_of = torch.full((support.numel(),), -1, dtype=torch.long)
    col_of[cols] = torch.arange(len(cols))
    draft_probs = None if chain.draft_probs is None else chain.draft_probs[:, cols]

    gen = torch.Generator().manual_seed(seed)
    emitted, accepted = verify_many(verify_fn, col_of[chain.draft_tokens], draft_probs, fed[:, cols], num_samples, gen)
    emitted = cols[emitted]  # back to vocabulary ids
    positions = []
    for j in range(n + 1):
        samples = emitted[accepted >= j, j].numpy()
        test = goodness_of_fit(samples, ref[j].numpy(), level)
        positions.append({"position": j, **test.to_dict()})

    draft_x, skip_x = _controls(chain, ref[0], num_samples, gen)
    return {
        "positions": positions,
        "mean_accepted": float(accepted.float().mean()),
        "control_draft": goodness_of_fit(draft_x, ref[0].numpy(), level).to_dict(),
        "control_skip_residual": goodness_of_fit(skip_x, ref[0].numpy(), level).to_dict(),
    }


def verify_many(
    verify_fn,
    draft_tokens: torch.Tensor,  # [n] the real chain (used as is when draft_probs is None)
    draft_probs: torch.Tensor | None,  # [n, V]
    target_probs: torch.Tensor,  # [n+1, V]
    num_samples: int,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:  # emitted [N, n+1] (valid up to num_accepted), num_accepted [N]
    """Run the verifier ``num_samples`` times on fixed distributions, redrawing ``X_j ~ draft_probs[j]``."""
    n, vocab = len(draft_tokens), target_probs.shape[-1]
    chunk = max(1, min(num_samples, CHUNK_ELEMENTS // vocab))
    cdf = None if draft_probs is None or n == 0 else draft_probs.double().cumsum(-1)  # [n, V]
    tokens, accepted = [], []
    for lo in range(0, num_samples, chunk):
        c = min(chunk, num_samples - lo)
        if cdf is None:
            drafts = draft_tokens.expand(c, n)
        else:
            u = torch.rand(n, c, generator=gen, dtype=torch.float64) * cdf[:, -1:]
            drafts = torch.searchsorted(cdf, u, right=True).clamp(max=vocab - 1).T.contiguous()  # [c, n]
        res = verify_fn(
            drafts,
            None if draft_probs is None else draft_probs.expand(c, n, vocab),
            target_probs.expand(c, n + 1, vocab),
            torch.full((c,), n, dtype=torch.long),
            torch.rand(c, n + 1, generator=gen),
        )
        tokens.append(res.tokens[:, : n + 1])
        accepted.append(res.num_accepted)
    return torch.cat(tokens), torch.cat(accepted)


def _controls(
    chain: Chain, target0: torch.Tensor, num_samples: int, gen: torch.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Position-0 samples of two wrong rules: accept every draft token (= sample the draft), and
    resample from the target instead of the residual after a rejection."""
    if chain.draft_probs is None or len(chain.draft_tokens) == 0:
        first = chain.draft_tokens[:1] if len(chain.draft_tokens) else target0.argmax()[None]
        x = first.expand(num_samples)
        draft_at_x = torch.ones(num_samples, dtype=torch.float64)
    else:
        x = _inverse_cdf(chain.draft_probs[0], num_samples, gen)
        draft_at_x = chain.draft_probs[0].double()[x]
    accept = torch.rand(num_samples, generator=gen, dtype=torch.float64) * draft_at_x < target0.double()[x]
    skip = torch.where(accept, x, _inverse_cdf(target0, num_samples, gen))
    return x.numpy(), skip.numpy()


def _inverse_cdf(probs: torch.Tensor, num_samples: int, gen: torch.Generator) -> torch.Tensor:  # [V] -> [N]
    cdf = probs.double().cumsum(-1)
    u = torch.rand(num_samples, generator=gen, dtype=torch.float64) * cdf[-1]
    return torch.searchsorted(cdf, u, right=True).clamp(max=probs.numel() - 1)


def greedy_record(chain: Chain, warp_fn, verify_fn, greedy_fn, seed: int) -> dict:
    """Exact checks: every emitted token is the target argmax, with the expected acceptance count."""
    n, vocab = len(chain.draft_tokens), chain.target_logits.shape[-1]
    argmax = chain.target_logits.argmax(-1)  # [n+1]
    real = chain.draft_tokens
    chains, expected = [real], [int((real == argmax[:n]).long().cumprod(0).sum())]
    for j in range(n + 1):  # rejected exactly at j (j == n: everything accepted)
        forced = torch.cat([argmax[:j], real[j:]]) if j < n else argmax[:n].clone()
        if j < n:
            forced[j] = (argmax[j] + 1) % vocab
        chains.append(forced)
        expected.append(j)
    drafts = torch.stack(chains) if n else torch.zeros(len(chains), 0, dtype=torch.long)  # [m, n]
    m = len(chains)
    num_draft = torch.full((m,), n, dtype=torch.long)
    target_probs = _warped(warp_fn, chain.target_logits, SamplingSetting(0.0))  # one-hot rows
    one_hot = torch.zeros(m, n, vocab).scatter_(2, drafts[:, :, None], 1.0)  # the greedy drafter's q

    gen = torch.Generator().manual_seed(seed)
    results = [("verify_greedy", greedy_fn(drafts, argmax.expand(m, n + 1), num_draft))]
    for _ in range(GREEDY_REPEATS):
        uniforms = torch.rand(m, n + 1, generator=gen)
        res = verify_fn(drafts, one_hot, target_probs.expand(m, n + 1, vocab), num_draft, uniforms)
        results.append(("verify_speculative", res))
    mismatches = []
    for fn_name, res in results:
        for i in range(m):
            acc = int(res.num_accepted[i])
            got = res.tokens[i, : acc + 1].tolist()
            want = argmax[: expected[i] + 1].tolist()
            if acc != expected[i] or got != want:
                mismatches.append(
                    {
                        "fn": fn_name,
                        "chain": drafts[i].tolist(),
                        "expected_accepted": expected[i],
                        "accepted": acc,
                        "expected_tokens": want,
                        "tokens": got,
                    }
                )
    return {"chains": m, "calls": len(results), "mismatches": mismatches[:10], "num_mismatches": len(mismatches)}


def _verdict(
    records: list[dict],
    sampled: list[SamplingSetting],
    contexts: list[Context],
    cfg: CheckConfig,
    level: float,
    num_tests: int,
) -> PartResult:
    greedy = [r for r in records if "chains" in r]
    law = [r for r in records if "positions" in r]
    tests = [t | {"context": r["context"], "setting": r["setting"]} for r in law for t in r["positions"]]
    rejected = [t for t in tests if t["rejected"]]
    greedy_bad = sum(r["num_mismatches"] for r in greedy)
    stale = sorted({r["context"] for r in records if not r.get("prefix_cache", {}).get("same_logits", True)})
    power = {
        s.name: [r["context"] for r in law if r["setting"] == s.name and r["control_draft"]["rejected"]]
        for s in sampled
    }
    skip_power = sum(r["control_skip_residual"]["rejected"] for r in law)
    informative = [t for t in tests if t["cells"] >= 2]
    min_p = min((t["p_value"] for t in informative), default=1.0)

    if rejected or greedy_bad or stale:
        status = FAIL
        worst = min(rejected, key=lambda t: (-t["impossible"], t["p_value"]), default=None)
        what = []
        if worst:
            why = f"{worst['impossible']} impossible tokens" if worst["impossible"] else f"p={worst['p_value']:.2g}"
            what.append(
                f"{len(rejected)}/{len(tests)} law tests rejected (worst: context {worst['context']}, "
                f"{worst['setting']}, position {worst['position']}, {why})"
            )
        if greedy_bad:
            what.append(f"{greedy_bad} greedy verifications differ from the target argmax")
        if stale:
            what.append(f"contexts {stale} restored from the prefix cache give other target logits than computed cold")
        summary = "; ".join(what)
    elif sampled and not all(power.values()):
        status = WEAK
        missing = [name for name, ctxs in power.items() if not ctxs]
        summary = (
            f"no test rejected, but samples from the draft were not distinguishable from the target for "
            f"{', '.join(missing)}: raise --law-samples or use other prompts"
        )
    else:
        status = PASS
        summary = (
            f"{len(informative)} chi-square tests (of {len(tests)}; {cfg.law_samples} verifications per "
            f"context x setting, {len(contexts)} contexts), each at {level:.1e} (overall <= {cfg.part_alpha():.0e}); "
            f"min p={min_p:.2g}; draft control detected in {sum(len(v) for v in power.values())}/{len(law)}, "
            f"skip-residual control in {skip_power}/{len(law)}; greedy exact on "
            f"{sum(r['chains'] * r['calls'] for r in greedy)} verifications"
        )
    details = {
        "test": "Pearson chi-square goodness of fit to the reference-warped target distribution, per position; "
        "Bonferroni over contexts x sampled settings x (num_draft + 1) positions",
        "level_per_test": level,
        "tests_planned": num_tests,
        "part_alpha": cfg.part_alpha(),
        "samples_per_context_setting": cfg.law_samples,
        "control_detected_contexts": power,
        "contexts": [c.to_dict() for c in contexts],
        "records": records,
    }
    return PartResult(1, "verifier law", status, summary, details)
