"""Benchmark arithmetic: the Leviathan formula, break-even, the α estimate, aggregation and buckets."""

import random

import pytest

from specdecode.bench import analysis as A


def run_rec(
    pid,
    config,
    k,
    wall,
    steps,
    draft_s=0.0,
    verify_s=None,
    category="code",
    sampling="greedy",
    repeat=0,
    kind="completion",
):
    """A run record as the runner writes it; ``steps`` rows are [ctx, emitted, drafted, accepted, seconds]."""
    drafted_at, accepted_at = [0] * k, [0] * k
    for _, _, d, a, _ in steps:
        for j in range(d):
            drafted_at[j] += 1
        for j in range(a):
            accepted_at[j] += 1
    new = sum(s[1] for s in steps)
    stats = {
        "draft_s": draft_s,
        "verify_s": sum(s[4] for s in steps) if verify_s is None else verify_s,
        "drafted_at": drafted_at,
        "accepted_at": accepted_at,
    }
    return {
        "type": "run",
        "prompt_id": pid,
        "category": category,
        "prompt_kind": kind,
        "sampling": sampling,
        "config": config,
        "k": k,
        "repeat": repeat,
        "new_tokens": new,
        "wall_s": wall,
        "stats": stats,
        "steps": steps,
        "token_ids": list(range(new)),
    }


def test_expected_tokens_per_step_edges_and_value():
    assert A.expected_tokens_per_step(0.0, 4) == 1.0
    assert A.expected_tokens_per_step(1.0, 4) == 5.0
    assert A.expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    assert A.expected_tokens_per_step(0.7, 0) == 1.0
    with pytest.raises(ValueError):
        A.expected_tokens_per_step(1.5, 2)


def test_predicted_speedup_matches_the_paper_formula():
    e = (1 - 0.8**5) / 0.2
    assert A.predicted_speedup(0.8, 4, 0.1) == pytest.approx(e / 1.4)
    assert A.predicted_speedup(0.8, 4, 0.1, v=2.0) == pytest.approx(e / 2.4)
    assert A.predicted_speedup(0.0, 3, 0.0) == 1.0  # free drafts that never hit: no gain, no loss


@pytest.mark.parametrize("k,c", [(1, 0.1), (4, 0.05), (4, 0.3), (8, 0.2), (3, 0.9)])
def test_break_even_alpha_solves_e_equals_cost(k, c):
    alpha = A.break_even_alpha(k, c)
    assert alpha is not None and 0 < alpha < 1
    assert A.expected_tokens_per_step(alpha, k) == pytest.approx(k * c + 1, abs=1e-7)
    assert A.predicted_speedup(alpha, k, c) == pytest.approx(1.0, abs=1e-7)


def test_break_even_alpha_edges_and_monotonicity():
    assert A.break_even_alpha(4, 0.0) == 0.0
    assert A.break_even_alpha(4, 1.0) is None  # a draft as slow as the target never pays
    assert A.break_even_alpha(2, 0.1, v=3.0) is None  # nor a verification costing k + 1 steps
    assert A.break_even_alpha(4, 0.1) < A.break_even_alpha(4, 0.2) < A.break_even_alpha(4, 0.2, v=1.5)
    with pytest.raises(ValueError):
        A.break_even_alpha(0, 0.1)


def test_alpha_estimate_recovers_iid_acceptance_where_the_rate_is_biased():
    """Steps with i.i.d. acceptance (α = 0.7, k = 4): the MLE is within 0.01 of α (its standard error
    here is ~0.004), while accepted / drafted converges to (α − α^(k+1)) / ((1 − α)·k) ≈ 0.52."""
    rng, alpha, k = random.Random(0), 0.7, 4
    counts = A.Counts()
    for _ in range(20000):
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        counts.add_step([100, accepted + 1, k, accepted, 0.01])
    assert counts.alpha == pytest.approx(alpha, abs=0.01)
    biased = (alpha - alpha ** (k + 1)) / ((1 - alpha) * k)
    assert counts.acceptance_rate == pytest.approx(biased, abs=0.01)
    assert counts.tokens_per_step == pytest.approx(A.expected_tokens_per_step(alpha, k), abs=0.03)


def test_buckets():
    assert A.bucket_of(0) == "<256" and A.bucket_of(255) == "<256"
    assert A.bucket_of(256) == "256–512" and A.bucket_of(1023) == "512–1k"
    assert A.bucket_of(1024) == "1k–2k" and A.bucket_of(2048) == "≥2k" and A.bucket_of(10**6) == "≥2k"


def test_first_difference():
    assert A.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert A.first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert A.first_difference([1, 2], [1, 2, 3]) == 2


def test_near_tie_scales_with_the_logit():
    eps = 2**-7  # bfloat16
    assert A.is_near_tie(0.1, 20.0, eps)  # 20 · 2 · 2^-7 = 0.31
    assert not A.is_near_tie(1.0, 20.0, eps)
    assert not A.is_near_tie(0.001, 20.0, 2**-23)  # float32 is held to a much tighter standard


def _records():
    """Two prompts; target-only steps of 0.1 s; spec-k2 accepts (2, 1, 0, 2) per prompt with a 0.02 s draft
    forward per drafted token and 0.15 s verification."""
    recs = []
    for pid, cat, ctx in (("p1", "code", 100), ("p2", "chat", 300)):
        target_steps = [[ctx + i, 1, 0, 0, 0.1] for i in range(8)]
        recs.append(run_rec(pid, "target", 0, 1.0, target_steps, category=cat))
        spec_steps = [
            [ctx, 3, 2, 2, 0.19],
            [ctx + 3, 2, 2, 1, 0.19],
            [ctx + 5, 1, 2, 0, 0.19],
            [ctx + 6, 2, 2, 1, 0.19],
        ]
        recs.append(run_rec(pid, "spec-k2", 2, 0.8, spec_steps, draft_s=8 * 0.02, verify_s=4 * 0.15, category=cat))
    return recs


def test_summarize_cells():
    cells = {(c.config, c.group): c for c in A.summarize(_records())}
    assert set(cells) == {(c, g) for c in ("target", "spec-k2") for g in ("overall", "code", "chat")}
    base, spec = cells[("target", "overall")], cells[("spec-k2", "overall")]
    assert base.tok_s == pytest.approx(8.0) and base.speedup == pytest.approx(1.0)
    assert spec.tok_s == pytest.approx(10.0) and spec.speedup == pytest.approx(1.25)
    assert spec.acceptance_rate == pytest.approx(4 / 8)
    assert spec.alpha == pytest.approx(4 / (4 + 3))  # three steps rejected a token
    assert spec.tokens_per_step == pytest.approx(2.0)
    assert spec.acceptance_by_position == pytest.approx([3 / 4, 1 / 4])
    assert spec.c == pytest.approx(0.02 / 0.1)
    assert spec.v == pytest.approx(0.15 / 0.1)
    e = A.expected_tokens_per_step(4 / 7, 2)
    assert spec.predicted_speedup == pytest.approx(e / (2 * 0.2 + 1))
    assert spec.predicted_speedup_v == pytest.approx(e / (2 * 0.2 + 1.5))
    assert base.decode_speedup == pytest.approx(1.0)
    assert spec.decode_tok_s == pytest.approx(8 / 0.76)  # prefill excluded: steps only
    assert spec.decode_speedup == pytest.approx(8 / 0.76 / 10.0)
    assert spec.efficiency == pytest.approx(spec.decode_speedup / spec.predicted_speedup)
    # every step drafted k = 2: the prediction over the steps is the formula's with the measured v
    assert spec.predicted_speedup_steps == pytest.approx(spec.predicted_speedup_v)
    assert spec.efficiency_steps == pytest.approx(spec.decode_speedup / spec.predicted_speedup_v)


def test_prediction_over_the_steps_counts_steps_that_drafted_nothing():
    """A lookup drafter drafts nothing where it finds no match: such a step emits one token at one target step's
    cost, which E(alpha, k) over every step would count as k drafts' worth of tokens."""
    alpha, c, v = 0.8, 0.05, 1.2
    half = A.predicted_from_steps(alpha, {0: 5, 4: 5}, c, v)
    e4 = A.expected_tokens_per_step(alpha, 4)
    assert half == pytest.approx(((1 + e4) / 2) / (2 * c + v))
    assert A.predicted_from_steps(alpha, {4: 10}, c, v) == pytest.approx(A.predicted_speedup(alpha, 4, c, v))
    assert half < A.predicted_speedup(alpha, 4, c, v)
    assert A.predicted_from_steps(alpha, {}, c, v) is None


def test_repeats_reduce_to_medians():
    recs = [
        run_rec("p", "target", 0, wall, [[10, 1, 0, 0, 0.1]] * 10, repeat=r) for r, wall in enumerate((1.0, 2.0, 9.0))
    ]
    (cell,) = A.summarize(recs)
    assert cell.tok_s == pytest.approx(5.0)  # the median run (10 tokens in 2 s), not the mean


def test_by_context_buckets_and_speedup():
    cells = {(c.config, c.bucket): c for c in A.by_context(_records())}
    assert cells[("target", "<256")].tok_s == pytest.approx(10.0)
    assert cells[("spec-k2", "<256")].tok_s == pytest.approx(8 / 0.76)
    assert cells[("spec-k2", "256–512")].speedup == pytest.approx(8 / 0.76 / 10.0)


def test_break_even_table_flags_prompts_below():
    rows = A.break_even_table(_records(), "code")
    (row,) = rows
    assert row.prompt_id == "p1" and row.k == 2
    assert row.c == pytest.approx(0.2)
    assert row.break_even == pytest.approx(A.break_even_alpha(2, 0.2))
    assert row.below is (row.alpha < row.break_even)
    assert row.speedup == pytest.approx(1.25)


def test_tokens_per_step_needed_is_the_step_cost_ratio_and_decides_paying():
    """spec-k2's decode steps take 0.19 s against target-only's 0.1 s: it needs 1.9 tokens per step and
    gets 2.0, so it pays; with 0.25 s steps it would need 2.5 and not pay. got / needed = decode speedup."""
    (row,) = A.break_even_table(_records(), "code")
    assert row.needed_tokens_per_step == pytest.approx(1.9)
    assert row.tokens_per_step == pytest.approx(2.0)
    assert row.pays is True
    cell = next(c for c in A.summarize(_records()) if (c.config, c.group) == ("spec-k2", "code"))
    assert row.tokens_per_step / row.needed_tokens_per_step == pytest.approx(cell.decode_speedup)
    slow = [dict(r, steps=[s[:4] + [0.25] for s in r["steps"]]) if r["config"] == "spec-k2" else r for r in _records()]
    (row,) = A.break_even_table(slow, "code")
    assert row.needed_tokens_per_step == pytest.approx(2.5) and row.pays is False


def test_break_even_rows_cover_trees_and_lookup_configs_without_the_chain_formula():
    recs = _records()
    tree = [dict(r, config="spec-k2-t2n4") for r in recs if r["config"] == "spec-k2"]
    auto = [dict(r, config="auto") for r in recs if r["config"] == "spec-k2"]
    rows = {r.config: r for r in A.break_even_table(recs + tree + auto, "code")}
    assert set(rows) == {"spec-k2", "spec-k2-t2n4", "auto"}
    assert rows["spec-k2-t2n4"].break_even is None and rows["spec-k2-t2n4"].below is None  # no chain formula
    assert rows["spec-k2-t2n4"].pays is True and rows["auto"].break_even is not None


def test_percentile_interpolates_like_numpy():
    assert A.percentile([], 50) is None
    assert A.percentile([3.0], 99) == 3.0
    assert A.percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert A.percentile(range(101), 99) == pytest.approx(99.0)
    assert A.percentile([0, 10], 99) == pytest.approx(9.9)


def test_latency_cells_per_group_with_ratios_to_target_on_the_same_prompts():
    recs = _records()  # target runs 1.0 s, spec-k2 0.8 s, both prompts
    recs.append(run_rec("p3", "target", 0, 4.0, [[10, 1, 0, 0, 0.1]], category="chat"))  # no spec run for p3
    cells = {(c.config, c.group): c for c in A.latency_cells(recs)}
    assert set(cells) == {(c, g) for c in ("target", "spec-k2") for g in ("overall", "code", "chat")}
    assert cells[("target", "overall")].requests == 3 and cells[("spec-k2", "overall")].requests == 2
    assert cells[("spec-k2", "code")].p50_s == pytest.approx(0.8)
    assert cells[("spec-k2", "chat")].p50_ratio == pytest.approx(0.8)  # p3 has no spec run: left out of the ratio
    assert cells[("spec-k2", "overall")].p99_ratio == pytest.approx(0.8)
    assert cells[("target", "overall")].p99_s == pytest.approx(1.0 + 3.0 * 0.98)  # interpolated toward p3's 4 s


def test_latency_after_prefill_leaves_the_prefill_out_and_runs_that_time_none():
    recs = _records()
    for r in recs:
        if r.get("type") == "run":
            r["prefill_s"] = 0.5 if r["config"] == "target" else 0.6  # spec-k2: 0.8 s in all, 0.2 s after prefill
    recs.append(run_rec("p1", "hf", 0, 9.0, [[10, 1, 0, 0, 0.1]]) | {"prefill_s": None})
    cells = {(c.config, c.group): c for c in A.latency_cells(recs, after_prefill=True)}
    assert {config for config, _ in cells} == {"target", "spec-k2"}  # hf times no prefill
    assert cells[("target", "overall")].p50_s == pytest.approx(0.5)
    assert cells[("spec-k2", "overall")].p50_s == pytest.approx(0.2)
    assert cells[("spec-k2", "overall")].p99_ratio == pytest.approx(0.4)
    assert {(c.config, c.group): c for c in A.latency_cells(recs)}[("spec-k2", "overall")].p50_ratio == pytest.approx(
        0.8
    )
