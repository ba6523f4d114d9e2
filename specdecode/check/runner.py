"""``run_check``: run the parts of the check against an engine factory and collect one report."""

from __future__ import annotations

import time
import traceback

from specdecode.check.cache_hits import HitCount, account, forcing_hits
from specdecode.check.common import (
    OPTIONAL_PARTS,
    PART_NAMES,
    CheckConfig,
    EngineFactory,
    EnginePool,
    NullProgress,
    Progress,
)
from specdecode.check.contexts import Context, rank_contexts
from specdecode.check.coupled import check_coupled
from specdecode.check.e2e import check_e2e
from specdecode.check.greedy import check_greedy
from specdecode.check.law import check_law
from specdecode.check.report import ERROR, SKIP, CheckReport, PartResult
from specdecode.check.seeds import check_seeds
from specdecode.check.stops import check_stops
from specdecode.check.tree_law import check_tree_law


def run_check(
    engine_factory: EngineFactory,
    prompts: list[list[int]],
    config: CheckConfig | None = None,
    progress: Progress | None = None,
    verify_fn=None,
    greedy_fn=None,
    warp_fn=None,
    meta: dict | None = None,
) -> CheckReport:
    """Run the selected parts; an exception inside a part makes that part ERROR, not the whole run.

    ``engine_factory(num_draft_tokens, max_batch_size)`` builds an engine (0 draft tokens: the
    target-only reference). ``prompts`` are token-id lists. ``verify_fn``/``greedy_fn``/``warp_fn``
    replace what part 1 tests (default: what the engine module calls).
    """
    cfg = config or CheckConfig()
    progress = progress or NullProgress()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("the check needs at least one non-empty prompt")
    # engines with a prefix cache restore every prompt from it (the reference none): check.cache_hits
    pool = EnginePool(forcing_hits(engine_factory, prompts), cfg.num_draft_tokens)
    ranked: list[Context] = []

    def contexts(n: int) -> list[Context]:
        if not ranked:
            progress.part("choosing contexts", len(prompts))
            ranked.extend(rank_contexts(pool.spec(1), prompts, progress.advance))
        return ranked[:n]

    parts = {
        1: lambda: (check_tree_law if pool.spec(1).max_tree_nodes else check_law)(
            pool, contexts(cfg.law_contexts), cfg, progress, verify_fn, greedy_fn, warp_fn
        ),
        2: lambda: check_e2e(pool, contexts(cfg.e2e_prompts), cfg, progress),
        3: lambda: check_greedy(pool, prompts, cfg, progress),
        4: lambda: check_stops(pool, prompts, cfg, progress),
        5: lambda: check_seeds(pool, prompts, cfg, progress),
        6: lambda: check_coupled(pool, prompts, contexts(cfg.law_contexts), cfg, progress),
    }
    results = []
    for number, run in parts.items():
        if number not in cfg.parts:
            if number not in OPTIONAL_PARTS:  # (an optional part not asked for is not listed)
                results.append(PartResult(number, PART_NAMES[number], SKIP, "not selected"))
            continue
        t0 = time.perf_counter()
        count = HitCount(pool)
        try:
            result = account(run(), count)
        except Exception as exc:  # a broken engine is a finding, reported with the part's name
            result = PartResult(
                number, PART_NAMES[number], ERROR, f"{type(exc).__name__}: {exc}", {"traceback": traceback.format_exc()}
            )
        result.seconds = time.perf_counter() - t0
        results.append(result)
    progress.close()
    return CheckReport(results, cfg.to_dict(), meta or {})
