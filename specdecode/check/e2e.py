"""Part 2: end to end, speculative samples and target-only samples of the first few tokens agree.

For each context (the prompt prefixes where draft and target disagree most, as in part 1) and
setting, ``e2e_samples`` requests go through the speculative engine and as many
through the target-only engine (``max_new_tokens = e2e_tokens``, distinct seeds, batches of
``e2e_batch``). The outcome of a request is its whole token tuple (shorter when it hit EOS). A
two-sample chi-square test on the 2 x cells table (:func:`specdecode.check.stats.two_sample`) at
level ``part alpha / (contexts x settings)`` decides; a correct engine fails this part with
probability at most the part's alpha.

This is the wiring check: the drafter's real sampling, per-request parameters and generators, slot
moves and admission all take part. It compares against the engine's own target-only path, so a fault
shared by both paths (e.g. a wrong warp) is invisible here; part 1 checks against the reference warp.
Its power is modest at small budgets: it detects gross distortions; part 1 carries the precision.
"""

from __future__ import annotations

from specdecode.check.common import CheckConfig, EnginePool, Progress, run_requests
from specdecode.check.contexts import Context
from specdecode.check.report import FAIL, PASS, PartResult
from specdecode.check.stats import two_sample
from specdecode.sampling import SamplingSetting

SPEC_SEEDS, BASE_SEEDS = 1_000_000, 2_000_000  # disjoint seed ranges for the two groups


def check_e2e(pool: EnginePool, contexts: list[Context], cfg: CheckConfig, progress: Progress) -> PartResult:
    num_tests = len(contexts) * len(cfg.e2e_settings)
    level = cfg.part_alpha() / max(1, num_tests)
    progress.part("2 end-to-end law", 2 * cfg.e2e_samples * num_tests)
    records = []
    for pi, context in enumerate(contexts):
        prompt = context.token_ids
        for si, setting in enumerate(cfg.e2e_settings):
            base_seed = cfg.seed * 10_000 + (pi * len(cfg.e2e_settings) + si) * cfg.e2e_samples
            spec = _samples(pool.spec(cfg.e2e_batch), prompt, setting, cfg, SPEC_SEEDS + base_seed, progress)
            base = _samples(pool.target_only(cfg.e2e_batch), prompt, setting, cfg, BASE_SEEDS + base_seed, progress)
            test, table = two_sample([r[0] for r in spec], [r[0] for r in base], level)
            records.append(
                {
                    "context": pi,
                    **context.to_dict(),
                    "setting": setting.name,
                    **test.to_dict(),
                    "table": [
                        {"cell": list(k) if isinstance(k, tuple) else k, "speculative": a, "target_only": b}
                        for k, a, b in table
                    ],
                    "speculative_tokens_per_step": _mean(r[1] for r in spec),
                }
            )
    rejected = [r for r in records if r["rejected"]]
    if rejected:
        worst = min(rejected, key=lambda r: r["p_value"])
        summary = (
            f"{len(rejected)}/{len(records)} two-sample tests rejected (worst: context {worst['context']}, "
            f"{worst['setting']}, p={worst['p_value']:.2g}, TV={worst['tv']:.3f})"
        )
        status = FAIL
    else:
        min_p = min((r["p_value"] for r in records), default=1.0)
        summary = (
            f"{len(records)} two-sample chi-square tests on the first {cfg.e2e_tokens} tokens, "
            f"{cfg.e2e_samples} vs {cfg.e2e_samples} samples each, level {level:.1e} "
            f"(overall <= {cfg.part_alpha():.0e}); min p={min_p:.2g}; "
            f"max TV={max((r['tv'] for r in records), default=0):.3f}"
        )
        status = PASS
    details = {
        "test": "Pearson chi-square homogeneity test, speculative vs target-only, on the joint of the first "
        f"{cfg.e2e_tokens} tokens; cells are token tuples coarsened by prefix until each group's expected "
        "count is >= 5 (from pooled counts)",
        "level_per_test": level,
        "part_alpha": cfg.part_alpha(),
        "samples_per_group": cfg.e2e_samples,
        "records": records,
    }
    return PartResult(2, "end-to-end sampling law", status, summary, details)


def _samples(engine, prompt: list[int], setting: SamplingSetting, cfg: CheckConfig, seed0: int, progress: Progress):
    params = [setting.params(seed=seed0 + i, max_new_tokens=cfg.e2e_tokens) for i in range(cfg.e2e_samples)]
    runs = run_requests(engine, [prompt] * len(params), params, on_finish=progress.advance)
    return [(tuple(r.token_ids), r.stats.tokens_per_step) for r in runs]


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None
